//! Every listener of a real gateway process is bounded: a slowloris head is cut at
//! `header_read_timeout_ms` on the public, admin and tunnel listeners, and with 10,000 idle
//! connections held open (over `public_max_connections`) a paid request still succeeds. The
//! data directory and the ledger files are owner-only. Loopback only.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::convert::Infallible;
use std::time::{Duration, Instant};

use common::{add_node, fake_llama_meta, full, serve_fake_engine, tenant, FakeBody, Gateway};
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use serde_json::{json, Value};
use spine_test_support::Engine;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Only a hang takes this long.
const HANG: Duration = Duration::from_secs(60);

/// Idle connections the flood holds. This process and the gateway each hold one descriptor per
/// connection; the container's limit is 20,000 per process.
const IDLE_CONNECTIONS: usize = 10_000;

async fn fake_llama(
    req: hyper::Request<Incoming>,
) -> Result<hyper::Response<FakeBody>, Infallible> {
    let path = req.uri().path().to_owned();
    let _ = req.into_body().collect().await;
    if let Some(meta) = fake_llama_meta(&path) {
        return Ok(meta);
    }
    Ok(match path.as_str() {
        "/v1/chat/completions" => full(
            200,
            "application/json",
            json!({
                "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "smollm2",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}
            })
            .to_string(),
        ),
        _ => full(404, "application/json", r#"{"error":"not found"}"#.into()),
    })
}

fn addr(url: &str) -> String {
    url.trim_start_matches("http://")
        .trim_start_matches("wss://")
        .trim_end_matches("/v1/tunnel")
        .to_owned()
}

/// Trickles a head that never completes, one byte per 100 ms; returns how long until the
/// gateway closed the connection.
async fn slowloris(addr: &str) -> Duration {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let started = Instant::now();
    let head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    for b in head {
        if tcp.write_all(&[*b]).await.is_err() {
            return started.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        if started.elapsed() > HANG {
            panic!("{addr}: still open after {HANG:?}");
        }
    }
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout(HANG, tcp.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return started.elapsed(),
            Ok(Ok(_)) => {}
            Err(_) => panic!("{addr}: still open after {HANG:?}"),
        }
    }
}

async fn paid_chat(gw: &Gateway, api_key: &str) -> (u16, Value) {
    let r = tokio::time::timeout(
        HANG,
        gw.api_post(
            api_key,
            "/v1/chat/completions",
            &json!({"model": "smollm2", "max_tokens": 8,
                    "messages": [{"role": "user", "content": "Hello"}]}),
        ),
    )
    .await
    .expect("paid request in time");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_is_cut_on_every_listener_and_idle_floods_do_not_stop_paid_requests() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start_with(
        dir.path(),
        &engine,
        "header_read_timeout_ms = 1000\npublic_max_connections = 2000",
    )
    .await;

    // --- files: owner-only data dir, ledger and tunnel key ----------------------------------
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let data = dir.path().join("data");
        assert_eq!(mode(&data), 0o700);
        assert_eq!(mode(&data.join("spine.db")), 0o600);
        assert_eq!(mode(&data.join("tunnel-key.pem")), 0o600);
        for side in ["spine.db-wal", "spine.db-shm"] {
            let p = data.join(side);
            if p.exists() {
                assert_eq!(mode(&p), 0o600, "{side}");
            }
        }
    }

    // --- slowloris on each listener: cut at ~1 s --------------------------------------------
    for (name, listener) in [("public", addr(&gw.public)), ("admin", addr(&gw.admin))] {
        let took = slowloris(&listener).await;
        assert!(
            took >= Duration::from_millis(900),
            "{name}: cut after {took:?}"
        );
        assert!(took < Duration::from_secs(15), "{name}: cut after {took:?}");
    }
    // the tunnel listener is TLS: a client that never finishes its handshake is cut at the
    // tunnel's handshake timeout (10 s); after TLS its head bound is the same as above
    // (spine-transport's tests/limits.rs trickles a head through TLS)
    let mut silent = TcpStream::connect(addr(&gw.tunnel)).await.unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 64];
    let r = tokio::time::timeout(HANG, silent.read(&mut buf)).await;
    assert!(matches!(r, Ok(Ok(0) | Err(_))), "{r:?}");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(30), "tunnel: cut after {took:?}");

    // --- a paid request while 10,000 idle connections are held ------------------------------
    let (url, _engine_task) = serve_fake_engine(fake_llama).await;
    let t = tenant(&gw).await;
    let (_node, _agent) = add_node(&gw, dir.path(), &t.operator, &url, "node").await;
    let (status, body) = paid_chat(&gw, &t.api_key).await;
    assert_eq!(status, 200, "{body}");

    let public = addr(&gw.public);
    let mut idle = Vec::with_capacity(IDLE_CONNECTIONS);
    let started = Instant::now();
    for _ in 0..IDLE_CONNECTIONS {
        match TcpStream::connect(&public).await {
            Ok(tcp) => idle.push(tcp),
            Err(e) => panic!("connect {} failed: {e}", idle.len()),
        }
    }
    let opened = started.elapsed();
    let started = Instant::now();
    let (status, body) = paid_chat(&gw, &t.api_key).await;
    let took = started.elapsed();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "Hi", "{body}");
    eprintln!(
        "{IDLE_CONNECTIONS} idle connections opened in {opened:?}; paid request took {took:?}"
    );
    // the cap held: the gateway closed idle connections beyond it
    let metrics = gw.metrics().await;
    let closed: f64 = ["evicted", "header_timeout"]
        .iter()
        .map(|reason| {
            common::metric(
                &metrics,
                &format!(
                    "spine_listener_connections_closed_total{{listener=\"public\",reason=\"{reason}\"}}"
                ),
            )
        })
        .sum();
    assert!(
        closed >= (IDLE_CONNECTIONS - 2000) as f64,
        "closed {closed}"
    );
    drop(idle);
}
