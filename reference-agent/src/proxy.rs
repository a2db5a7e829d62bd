//! The service the agent serves over the tunnel: an allowlisted proxy to the one local engine
//! (design brief §9).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use spine_core::{BoxBody, BoxError};
use tracing::{debug, warn};

use crate::engine::{join, EngineClient, RequestGuard};

/// Largest request body the proxy buffers to check it ([`RequestGuard`]), bytes (64 MiB).
const MAX_CHECKED_BODY_BYTES: usize = 64 * 1024 * 1024;

/// The one field of a request body the guard reads; serde_json still checks the whole document.
#[derive(serde::Deserialize)]
struct ModelField {
    #[serde(default)]
    model: Option<String>,
}

/// Where an allowed request goes on the engine: the path, or the engine's health path.
fn allowed_target(method: &Method, path: &str, health_path: &'static str) -> Option<&'static str> {
    match (method, path) {
        (&Method::POST, "/v1/chat/completions") => Some("/v1/chat/completions"),
        (&Method::POST, "/v1/completions") => Some("/v1/completions"),
        (&Method::POST, "/v1/embeddings") => Some("/v1/embeddings"),
        (&Method::GET, "/v1/models") => Some("/v1/models"),
        (&Method::GET, "/health") => Some(health_path),
        _ => None,
    }
}

/// Headers never forwarded in either direction: hop-by-hop (RFC 9110 §7.6.1) and proxy headers.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

fn is_stripped(name: &HeaderName, request: bool) -> bool {
    let n = name.as_str();
    HOP_BY_HOP.contains(&n)
        || n == "upgrade"
        || n.starts_with("proxy-")
        || n.starts_with("x-spine-")
        || (request && (n == "authorization" || n == "host"))
}

/// Copies `headers` minus hop-by-hop headers, those the `Connection` header names, every
/// `x-spine-*` header (both ways: only the gateway sets them, so an engine cannot fake, say, an
/// owner's `x-spine-refusal`) and (for requests) `authorization` and `host`.
fn filter_headers(headers: &HeaderMap, request: bool) -> HeaderMap {
    let named_by_connection: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect();
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        if is_stripped(name, request) || named_by_connection.iter().any(|t| t == name.as_str()) {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

fn json_error(status: StatusCode, message: &str, kind: &str, code: &str) -> Response<BoxBody> {
    let body = serde_json::json!({
        "error": { "message": message, "type": kind, "code": code }
    });
    let mut resp = Response::new(
        Full::new(Bytes::from(body.to_string()))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// What the engine is doing, as the proxy sees it: requests in flight (sent to the engine and
/// not yet answered whole or dropped) and when the engine last sent a byte of an answer. The
/// SIGTERM drain reads it to tell an engine that is working (bytes flow) from one that hangs.
#[derive(Debug)]
pub(crate) struct EngineActivity {
    started: std::time::Instant,
    in_flight: std::sync::atomic::AtomicUsize,
    /// Milliseconds after `started` of the engine's last answer byte (or of a request sent).
    last_byte_ms: std::sync::atomic::AtomicU64,
}

impl Default for EngineActivity {
    fn default() -> Self {
        Self {
            started: std::time::Instant::now(),
            in_flight: std::sync::atomic::AtomicUsize::new(0),
            last_byte_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl EngineActivity {
    fn touch(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_byte_ms
            .store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// Requests in flight at the engine.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How long since the engine last sent a byte of an answer (or was sent a request).
    pub(crate) fn quiet_for(&self) -> std::time::Duration {
        let last = self.last_byte_ms.load(std::sync::atomic::Ordering::Relaxed);
        self.started
            .elapsed()
            .saturating_sub(std::time::Duration::from_millis(last))
    }
}

/// One request in flight at the engine: counted from its sending until its answer's body ends
/// or is dropped.
struct InFlight(std::sync::Arc<EngineActivity>);

impl InFlight {
    fn start(activity: &std::sync::Arc<EngineActivity>) -> Self {
        activity
            .in_flight
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        activity.touch();
        Self(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

pin_project_lite::pin_project! {
    /// An engine answer's body that notes each frame in [`EngineActivity`].
    struct ActivityBody {
        #[pin]
        inner: BoxBody,
        guard: InFlight,
    }
}

impl http_body::Body for ActivityBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &polled {
            this.guard.0.touch();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The allowlisted proxy from the tunnel to the engine.
#[derive(Clone, Debug)]
pub(crate) struct EngineProxy {
    client: EngineClient,
    engine: Uri,
    health_path: &'static str,
    guard: RequestGuard,
    /// The model ids the engine serves (for the guard).
    models: std::sync::Arc<[spine_core::ModelId]>,
    activity: std::sync::Arc<EngineActivity>,
}

impl EngineProxy {
    pub(crate) fn new(client: EngineClient, engine: Uri, health_path: &'static str) -> Self {
        Self {
            client,
            engine,
            health_path,
            guard: RequestGuard::default(),
            models: std::sync::Arc::from(Vec::new()),
            activity: std::sync::Arc::default(),
        }
    }

    /// What the engine is doing through this proxy (shared by its clones).
    pub(crate) fn activity(&self) -> std::sync::Arc<EngineActivity> {
        self.activity.clone()
    }

    /// Checks `POST` bodies as `guard` says before the engine sees them (an engine quirk, see
    /// [`RequestGuard`]): malformed JSON → 400 `invalid_json`, a `model` not among `models` →
    /// 404 `model_not_found`, a body over 64 MiB → 413.
    pub(crate) fn with_guard(
        mut self,
        guard: RequestGuard,
        models: Vec<spine_core::ModelId>,
    ) -> Self {
        self.guard = guard;
        self.models = std::sync::Arc::from(models);
        self
    }

    /// The checked body, or the error answer (see [`EngineProxy::with_guard`]). Never logs the
    /// body.
    async fn checked_body(&self, body: Incoming) -> Result<Bytes, Response<BoxBody>> {
        let bytes = match http_body_util::Limited::new(body, MAX_CHECKED_BODY_BYTES)
            .collect()
            .await
        {
            Ok(c) => c.to_bytes(),
            Err(e) => {
                let too_large = e
                    .downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some();
                return Err(if too_large {
                    json_error(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "the request body is too large for this node",
                        "invalid_request_error",
                        "request_too_large",
                    )
                } else {
                    json_error(
                        StatusCode::BAD_REQUEST,
                        "the request body could not be read",
                        "invalid_request_error",
                        "invalid_body",
                    )
                });
            }
        };
        // an object (serde would also read a struct from an array)
        let is_object = bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
        let model = match serde_json::from_slice::<ModelField>(&bytes) {
            Ok(f) if is_object => f.model,
            _ => {
                warn!("refused a request body that is not a JSON object");
                return Err(json_error(
                    StatusCode::BAD_REQUEST,
                    "the request body is not a valid JSON object",
                    "invalid_request_error",
                    "invalid_json",
                ));
            }
        };
        if !model
            .as_deref()
            .is_some_and(|m| self.models.iter().any(|s| s.as_str() == m))
        {
            let model: String = model.unwrap_or_default().chars().take(100).collect();
            warn!(%model, "refused a request for a model this node's engine does not serve");
            return Err(json_error(
                StatusCode::NOT_FOUND,
                "this node does not serve the requested model",
                "invalid_request_error",
                "model_not_found",
            ));
        }
        Ok(bytes)
    }

    /// Forwards an allowed request (query string dropped, headers filtered, the body of a `GET`
    /// or `HEAD` dropped with its `content-length`) and streams the engine's response back as it
    /// arrives; 403 for anything else, 502 when the engine cannot be
    /// reached. Never logs bodies.
    pub(crate) async fn handle(&self, req: Request<Incoming>) -> Response<BoxBody> {
        let method = req.method().clone();
        let Some(target) = allowed_target(&method, req.uri().path(), self.health_path) else {
            let path: String = req.uri().path().chars().take(200).collect();
            warn!(%method, %path, "refused a tunnel request outside the engine allowlist");
            return json_error(
                StatusCode::FORBIDDEN,
                "this path is not served by the node",
                "invalid_request_error",
                "path_not_allowed",
            );
        };
        let uri = match join(&self.engine, target) {
            Ok(uri) => uri,
            Err(e) => {
                warn!(error = %e, "cannot build the engine url");
                return json_error(
                    StatusCode::BAD_GATEWAY,
                    "the node's engine url is invalid",
                    "server_error",
                    "engine_unreachable",
                );
            }
        };
        let (mut parts, body) = req.into_parts();
        // a body read whole here can be sent again (see `stale_connection`)
        let mut replay: Option<Bytes> = None;
        let body = if parts.method == Method::GET || parts.method == Method::HEAD {
            // never a body on GET/HEAD: a naive engine could read it as the next request
            // (request smuggling); dropped unread, and its length with it
            parts.headers.remove(header::CONTENT_LENGTH);
            drop(body);
            Full::new(Bytes::new())
                .map_err(|e| match e {})
                .boxed_unsync()
        } else if self.guard.check_json_and_model && parts.method == Method::POST {
            match self.checked_body(body).await {
                Ok(bytes) => {
                    replay = Some(bytes.clone());
                    full(bytes)
                }
                Err(refusal) => return refusal,
            }
        } else {
            body.map_err(BoxError::from).boxed_unsync()
        };
        let headers = filter_headers(&parts.headers, true);
        let upstream = |body: BoxBody| {
            let mut upstream = Request::new(body);
            *upstream.method_mut() = parts.method.clone();
            *upstream.uri_mut() = uri.clone();
            *upstream.headers_mut() = headers.clone();
            upstream
        };

        debug!(%method, path = target, "forwarding to the engine");
        let in_flight = InFlight::start(&self.activity);
        let mut answer = self.client.request(upstream(body)).await;
        if let (Err(e), Some(bytes)) = (&answer, replay) {
            if stale_connection(e) {
                // a pooled keep-alive connection the engine closed as the request went out
                // (llama.cpp closes idle ones after 5 s): the engine never read it; once more
                // on a fresh connection
                debug!(error = %e, path = target, "engine connection was stale; sending again");
                answer = self.client.request(upstream(full(bytes))).await;
            }
        }
        match answer {
            Ok(resp) => {
                let (mut parts, body) = resp.into_parts();
                parts.headers = filter_headers(&parts.headers, false);
                debug!(
                    status = parts.status.as_u16(),
                    path = target,
                    "engine answered"
                );
                let body = ActivityBody {
                    inner: body.map_err(BoxError::from).boxed_unsync(),
                    guard: in_flight,
                };
                Response::from_parts(parts, BoxBody::new(body))
            }
            Err(e) => {
                warn!(error = %e, path = target, "engine unreachable");
                json_error(
                    StatusCode::BAD_GATEWAY,
                    "the node's engine is unreachable",
                    "server_error",
                    "engine_unreachable",
                )
            }
        }
    }
}

/// A body of bytes already read.
fn full(bytes: Bytes) -> BoxBody {
    Full::new(bytes).map_err(|e| match e {}).boxed_unsync()
}

/// Whether the engine request failed because its pooled connection was closed under it before
/// any answer (hyper: "connection closed before message completed", or the request canceled
/// with its connection): the race between reusing an idle keep-alive connection and the
/// engine closing it. Nothing was answered, so the request may be sent again.
fn stale_connection(err: &hyper_util::client::legacy::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(h) = e.downcast_ref::<hyper::Error>() {
            return h.is_incomplete_message() || h.is_canceled();
        }
        source = e.source();
    }
    false
}

impl tower::Service<Request<Incoming>> for EngineProxy {
    type Response = Response<BoxBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<BoxBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.handle(req).await) })
    }
}

#[cfg(test)]
mod tests {
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
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc),
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
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc),
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
        for chunk in ["data: {\"a\":1}\n\n", "data: [DONE]\n\n"] {
            tx.send(Bytes::from_static(chunk.as_bytes())).await.unwrap();
            let frame = tokio::time::timeout(Duration::from_secs(5), body.frame())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            assert_eq!(
                frame.into_data().unwrap(),
                Bytes::from_static(chunk.as_bytes())
            );
        }
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
        let proxy = EngineProxy::new(crate::engine::engine_client(), engine_url, "/health")
            .with_guard(
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
}
