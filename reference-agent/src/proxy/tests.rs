#![allow(clippy::unwrap_used, clippy::expect_used)]
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::StreamBody;
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use super::*;

#[test]
fn allowlist_is_exact() {
    let h = "/health";
    assert_eq!(
        allowed_target(&Method::POST, "/v1/chat/completions", h),
        Some("/v1/chat/completions")
    );
    assert_eq!(
        allowed_target(&Method::GET, "/health", "/healthz"),
        Some("/healthz")
    );
    for (m, p) in [
        (Method::GET, "/v1/chat/completions"),
        (Method::POST, "/v1/chat/completions/"),
        (Method::POST, "/v1/chat/completions/../../slots"),
        (Method::GET, "/slots"),
        (Method::GET, "/metrics"),
        (Method::POST, "/tokenize"),
        (Method::DELETE, "/v1/models"),
        (Method::GET, "/V1/models"),
    ] {
        assert_eq!(allowed_target(&m, p, h), None, "{m} {p}");
    }
}

#[test]
fn headers_are_scrubbed() {
    let mut h = HeaderMap::new();
    for (n, v) in [
        ("authorization", "Bearer secret"),
        ("x-spine-node", "n1"),
        ("x-spine-request-id", "r"),
        ("connection", "keep-alive, x-custom-hop"),
        ("x-custom-hop", "1"),
        ("keep-alive", "timeout=5"),
        ("proxy-authorization", "p"),
        ("te", "trailers"),
        ("trailer", "x"),
        ("transfer-encoding", "chunked"),
        ("upgrade", "h2c"),
        ("host", "gateway"),
        ("content-type", "application/json"),
        ("x-request-id", "req-1"),
        ("accept", "text/event-stream"),
    ] {
        h.append(HeaderName::from_static(n), HeaderValue::from_static(v));
    }
    let out = filter_headers(&h, true);
    let mut names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, vec!["accept", "content-type", "x-request-id"]);
}

#[test]
fn engine_responses_lose_x_spine_headers() {
    let mut h = HeaderMap::new();
    for (n, v) in [
        ("x-spine-refusal", "node_full"),
        ("x-spine-node-id", "n2"),
        ("content-type", "application/json"),
        ("x-request-id", "req-1"),
        ("connection", "close"),
    ] {
        h.append(HeaderName::from_static(n), HeaderValue::from_static(v));
    }
    let out = filter_headers(&h, false);
    let mut names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, vec!["content-type", "x-request-id"]);
}

/// A fake engine on 127.0.0.1: records request heads, streams `/v1/chat/completions` from a
/// channel.
async fn engine(chunks: mpsc::Receiver<Bytes>) -> (Uri, Arc<Mutex<Vec<(String, HeaderMap)>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let chunks = Arc::new(Mutex::new(Some(chunks)));
    let seen2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let seen = seen2.clone();
            let chunks = chunks.clone();
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                seen.lock().unwrap().push((
                    req.uri().path_and_query().unwrap().to_string(),
                    req.headers().clone(),
                ));
                let rx = if req.uri().path() == "/v1/chat/completions" {
                    chunks.lock().unwrap().take()
                } else {
                    None
                };
                async move {
                    let body = match rx {
                        Some(rx) => {
                            let s = futures_util::stream::unfold(rx, |mut rx| async move {
                                rx.recv()
                                    .await
                                    .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
                            });
                            StreamBody::new(s).boxed_unsync()
                        }
                        None => {
                            Full::new(Bytes::from_static(b"{\"status\":\"ok\"}")).boxed_unsync()
                        }
                    };
                    Ok::<_, Infallible>(Response::new(body))
                }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tcp), svc),
            );
        }
    });
    (format!("http://{addr}").parse().unwrap(), seen)
}

/// Runs `proxy` behind a local HTTP/1 listener (hyper needs an `Incoming` body) and returns
/// its base URL.
async fn serve_proxy(proxy: EngineProxy) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let svc = hyper_util::service::TowerToHyperService::new(proxy.clone());
            tokio::spawn(
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tcp), svc),
            );
        }
    });
    format!("http://{addr}")
}

fn client() -> hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
> {
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new())
}

#[tokio::test]
async fn forwards_allowed_paths_scrubbed_and_streams_the_response() {
    let (tx, rx) = mpsc::channel(1);
    let (engine_url, seen) = engine(rx).await;
    let proxy = EngineProxy::new(crate::engine::engine_client(), engine_url, "/health");
    let base = serve_proxy(proxy).await;

    let req = Request::post(format!("{base}/v1/chat/completions?debug=1"))
        .header("authorization", "Bearer sk-secret")
        .header("x-spine-node", "n1")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{\"model\":\"smollm2\"}")))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    spine_test_support::assert_streams_each(
        &tx,
        &mut body,
        &["data: {\"a\":1}\n\n", "data: [DONE]\n\n"],
        Duration::from_secs(5),
    )
    .await;
    drop(tx);

    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    let (path, headers) = &seen[0];
    assert_eq!(path, "/v1/chat/completions");
    assert!(headers.get("authorization").is_none());
    assert!(headers.get("x-spine-node").is_none());
    assert_eq!(headers.get("content-type").unwrap(), "application/json");
}

#[tokio::test]
async fn a_get_body_never_reaches_the_engine() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    // a raw engine: records every byte the proxy sends on its connection
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine_url: Uri = format!("http://{}", listener.local_addr().unwrap())
        .parse()
        .unwrap();
    let (seen_tx, mut seen_rx) = mpsc::channel::<Vec<u8>>(1);
    tokio::spawn(async move {
        let (mut tcp, _) = listener.accept().await.unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        // the head, then whatever follows within 300 ms (a smuggled body would)
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = tcp.read(&mut buf).await.unwrap();
            assert_ne!(n, 0);
            seen.extend_from_slice(&buf[..n]);
        }
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(300), tcp.read(&mut buf)).await
        {
            seen.extend_from_slice(&buf[..n]);
        }
        tcp.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            .await
            .unwrap();
        seen_tx.send(seen).await.unwrap();
    });
    let proxy = EngineProxy::new(crate::engine::engine_client(), engine_url, "/health");
    let base = serve_proxy(proxy).await;
    let smuggled = "POST /slots?action=erase HTTP/1.1\r\nhost: e\r\ncontent-length: 0\r\n\r\n";
    let req = Request::get(format!("{base}/v1/models"))
        .header("content-length", smuggled.len().to_string())
        .body(Full::new(Bytes::from(smuggled)))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let seen = String::from_utf8(seen_rx.recv().await.unwrap()).unwrap();
    let (head, rest) = seen.split_once("\r\n\r\n").unwrap();
    assert_eq!(rest, "", "bytes after the GET's head: {rest:?}");
    assert!(head.starts_with("GET /v1/models HTTP/1.1\r\n"), "{head}");
    assert!(
        !head.to_ascii_lowercase().contains("content-length"),
        "{head}"
    );
    assert!(
        !head.to_ascii_lowercase().contains("transfer-encoding"),
        "{head}"
    );
}

/// The engine closes a kept-alive connection as the next request goes out on it (llama.cpp
/// closes idle ones after 5 s): the request is sent again on a fresh connection, and the
/// caller sees only the answer.
#[tokio::test]
async fn a_request_on_a_connection_the_engine_closed_is_sent_again() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine_url: Uri = format!("http://{}", listener.local_addr().unwrap())
        .parse()
        .unwrap();
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = answered.clone();
    tokio::spawn(async move {
        // the first connection answers one request, then closes on the next one unanswered;
        // later connections answer everything
        let mut first = true;
        loop {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let close_after_one = std::mem::take(&mut first);
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 8192];
                let mut served = 0;
                loop {
                    let mut seen = Vec::new();
                    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tcp.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    if close_after_one && served == 1 {
                        return; // closed under the request, nothing answered
                    }
                    served += 1;
                    counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let answer = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                    if tcp.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let proxy = EngineProxy::new(crate::engine::engine_client(), engine_url, "/health").with_guard(
        RequestGuard {
            check_json_and_model: true,
        },
        vec![spine_core::ModelId::new("smollm2")],
    );
    let base = serve_proxy(proxy).await;
    for _ in 0..2 {
        let req = Request::post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"model\":\"smollm2\"}")))
            .unwrap();
        let resp = client().request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"{}");
    }
    assert_eq!(answered.load(std::sync::atomic::Ordering::SeqCst), 2);
}

#[tokio::test]
async fn other_paths_are_403_with_an_openai_error() {
    let (_tx, rx) = mpsc::channel(1);
    let (engine_url, seen) = engine(rx).await;
    let proxy = EngineProxy::new(crate::engine::engine_client(), engine_url, "/health");
    let base = serve_proxy(proxy).await;
    let req = Request::get(format!("{base}/slots"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::FORBIDDEN);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"error":{
            "message":"this path is not served by the node",
            "type":"invalid_request_error",
            "code":"path_not_allowed"}})
    );
    assert!(seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn health_maps_to_the_engine_health_path_and_dead_engine_is_502() {
    let (_tx, rx) = mpsc::channel(1);
    let (engine_url, seen) = engine(rx).await;
    let proxy = EngineProxy::new(crate::engine::engine_client(), engine_url, "/healthz");
    let base = serve_proxy(proxy).await;
    let req = Request::get(format!("{base}/health"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(seen.lock().unwrap()[0].0, "/healthz");

    // nothing listens on the engine url
    let dead = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_url: Uri = format!("http://{}", dead.local_addr().unwrap())
        .parse()
        .unwrap();
    drop(dead);
    let proxy = EngineProxy::new(crate::engine::engine_client(), dead_url, "/health");
    let base = serve_proxy(proxy).await;
    let req = Request::get(format!("{base}/v1/models"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "engine_unreachable");
    assert_eq!(v["error"]["type"], "server_error");
}
