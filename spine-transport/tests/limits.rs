//! `LimitedServer` on real loopback sockets: slowloris heads are cut at the header timeout, slow
//! bodies at the body timeout, idle connections at the idle timeout, and at the connection cap
//! an idle connection makes room for a new caller (a request in flight is never cut).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::{get, post};
use spine_transport::{
    self_signed_cert, server_config_from_pem, LimitedServer, ListenerLimits, StaticAuthenticator,
    TunnelServer, TunnelServerConfig,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// Far above any bound under test: only a hang takes this long.
const HANG: Duration = Duration::from_secs(60);

/// Upper bound on a cut under test: far above the bounds (0.5 to 2 s) on a loaded machine, far
/// below the time a trickle or another timer would take.
const CUT: Duration = Duration::from_secs(15);

/// A response far larger than the loopback socket buffers (a few MiB on Linux): most of it
/// waits in the server until the client reads.
const BIG_BYTES: usize = 64 << 20;

/// A request head that never completes, 200 bytes long (20 s at one byte per 100 ms).
fn endless_head(start: &str) -> Vec<u8> {
    let mut head = start.as_bytes().to_vec();
    head.extend_from_slice(b"x-slow: ");
    head.resize(200, b'a');
    head
}

fn app() -> axum::Router {
    axum::Router::new()
        .route("/", get(|| async { "ok" }))
        .route(
            "/echo",
            post(|body: axum::body::Bytes| async move { format!("{}", body.len()) }),
        )
        .route("/big", get(|| async { vec![b'x'; BIG_BYTES] }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                "slow"
            }),
        )
}

async fn start(limits: ListenerLimits) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(LimitedServer::new("test", limits).serve(listener, app(), std::future::pending()));
    addr
}

/// Reads until the peer closes; returns what came and how long it took.
async fn read_to_close(tcp: &mut TcpStream) -> (Vec<u8>, Duration) {
    let started = Instant::now();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(HANG, tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (seen, started.elapsed()),
            Ok(Ok(n)) => seen.extend_from_slice(&buf[..n]),
            Err(_) => panic!("connection still open after {HANG:?}"),
        }
    }
}

async fn get_ok(addr: std::net::SocketAddr) -> String {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let (seen, _) = read_to_close(&mut tcp).await;
    String::from_utf8(seen).unwrap()
}

#[tokio::test]
async fn slowloris_head_is_cut_at_the_header_timeout() {
    let addr =
        start(ListenerLimits::default().header_read_timeout(Duration::from_millis(500))).await;
    // a partial head, one byte every 100 ms: never complete
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let started = Instant::now();
    let head = endless_head("GET / HTTP/1.1\r\n");
    let trickle = async {
        for b in &head {
            if tcp.write_all(&[*b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(HANG, trickle).await.unwrap();
    let (_, _) = read_to_close(&mut tcp).await;
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(450), "{elapsed:?}");
    assert!(elapsed < CUT, "{elapsed:?}");

    // a connection that sends nothing at all (and so never gets past protocol detection)
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let (seen, elapsed) = read_to_close(&mut silent).await;
    assert!(seen.is_empty());
    assert!(elapsed >= Duration::from_millis(450), "{elapsed:?}");
    assert!(elapsed < CUT, "{elapsed:?}");

    // a complete request is still served
    assert!(get_ok(addr).await.ends_with("ok"));
}

#[tokio::test]
async fn a_slow_body_is_cut_at_the_body_timeout() {
    // the idle bound (2 s) ends the connection should hyper wait for the rest of the body
    let addr = start(
        ListenerLimits::default()
            .body_read_timeout(Duration::from_millis(500))
            .idle_timeout(Duration::from_secs(2)),
    )
    .await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nabc")
        .await
        .unwrap();
    let (seen, elapsed) = read_to_close(&mut tcp).await;
    let seen = String::from_utf8(seen).unwrap();
    // axum answers its body-read failure; the connection then closes
    assert!(seen.starts_with("HTTP/1.1 400 "), "{seen}");
    assert!(elapsed >= Duration::from_millis(450), "{elapsed:?}");
    assert!(elapsed < CUT, "{elapsed:?}");

    // a body sent at once is read whole
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(
        b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 3\r\n\r\nabc",
    )
    .await
    .unwrap();
    let (seen, _) = read_to_close(&mut tcp).await;
    assert!(String::from_utf8(seen).unwrap().ends_with("\r\n\r\n3"));
}

#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed() {
    let addr = start(
        ListenerLimits::default()
            .header_read_timeout(Duration::from_secs(20))
            .idle_timeout(Duration::from_millis(500)),
    )
    .await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let (seen, elapsed) = read_to_close(&mut tcp).await;
    let seen = String::from_utf8(seen).unwrap();
    assert!(seen.starts_with("HTTP/1.1 200 OK"), "{seen}");
    assert!(seen.ends_with("ok"), "{seen}");
    assert!(elapsed >= Duration::from_millis(450), "{elapsed:?}");
    // hyper's own timer for the next head (20 s) is not what closed it
    assert!(elapsed < CUT, "{elapsed:?}");
}

#[tokio::test]
async fn at_the_cap_idle_connections_make_room_and_busy_ones_are_kept() {
    let addr = start(ListenerLimits::default().max_connections(8)).await;
    // a request in flight (1.5 s), then 20 idle connections: 8 at most are held
    let mut busy = TcpStream::connect(addr).await.unwrap();
    busy.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut idle = Vec::new();
    for _ in 0..20 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    // a caller past the cap is served: an idle connection made room
    let answer = tokio::time::timeout(HANG, get_ok(addr)).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(answer.ends_with("ok"), "{answer}");
    // the request in flight was never cut
    let (seen, _) = read_to_close(&mut busy).await;
    let seen = String::from_utf8(seen).unwrap();
    assert!(seen.ends_with("slow"), "{seen}");
    // and the server holds at most the cap: at least 20 + 1 - 7 idle ones were closed
    let mut closed = 0;
    for tcp in &mut idle {
        let mut buf = [0u8; 1];
        if let Ok(Ok(0) | Err(_)) =
            tokio::time::timeout(Duration::from_millis(50), tcp.read(&mut buf)).await
        {
            closed += 1;
        }
    }
    assert!(closed >= 14, "{closed} of 20 idle connections closed");
}

/// Issue 13's attacker: every connection under the cap sends a complete head with
/// `content-length: 1000` and withholds the body. Those requests are "in flight" from their
/// head, yet a caller past the cap is served at once: a connection whose requests are all still
/// receiving their body is as evictable as an idle one (not kept until the 60 s body timeout).
#[tokio::test]
async fn at_the_cap_connections_withholding_their_body_make_room() {
    let addr = start(ListenerLimits::default().max_connections(8)).await;
    let mut stalled = Vec::new();
    for _ in 0..8 {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        tcp.write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\nab")
            .await
            .unwrap();
        stalled.push(tcp);
    }
    // the heads are read and the requests started before the next caller comes
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let answer = tokio::time::timeout(HANG, get_ok(addr)).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    // evicted at once, not at the body timeout (60 s)
    assert!(started.elapsed() < CUT, "{:?}", started.elapsed());
    let mut closed = 0;
    for tcp in &mut stalled {
        let mut buf = [0u8; 1];
        if let Ok(Ok(0) | Err(_)) =
            tokio::time::timeout(Duration::from_millis(200), tcp.read(&mut buf)).await
        {
            closed += 1;
        }
    }
    assert!(closed >= 1, "no stalled connection made room");
}

#[tokio::test]
async fn the_tunnel_listener_cuts_slowloris_heads_too() {
    let (cert, key) = self_signed_cert(&["localhost".into()]).unwrap();
    let tls = server_config_from_pem(&cert, &key).unwrap();
    let mut config = TunnelServerConfig::default();
    config.handshake_timeout = Duration::from_millis(500);
    let server = TunnelServer::new(config, Arc::new(StaticAuthenticator::new()), Arc::new(()));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(server.serve(listener, Some(tls)));

    // no TLS handshake at all
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let (_, elapsed) = read_to_close(&mut tcp).await;
    assert!(elapsed >= Duration::from_millis(450), "{elapsed:?}");
    assert!(elapsed < CUT, "{elapsed:?}");

    // TLS, then a partial head trickled
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let connector =
        tokio_rustls::TlsConnector::from(spine_transport::client_config_with_ca(&cert).unwrap());
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    let started = Instant::now();
    let mut closed = false;
    for b in &endless_head("GET /v1/tunnel HTTP/1.1\r\nhost: localhost\r\n") {
        if tls.write_all(&[*b]).await.is_err() || tls.flush().await.is_err() {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if !closed {
        let mut buf = [0u8; 64];
        let r = tokio::time::timeout(HANG, tls.read(&mut buf))
            .await
            .unwrap();
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    }
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(450), "{elapsed:?}");
    assert!(elapsed < CUT, "{elapsed:?}");
}

#[tokio::test]
async fn a_slow_reader_gets_its_whole_answer_past_the_idle_timeout() {
    // the response body ends at once (one frame) but most of it is still waiting to be written
    // when the idle bound (300 ms) passes, many times over
    let addr = start(ListenerLimits::default().idle_timeout(Duration::from_millis(300))).await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    // nothing read for 10 idle bounds (and past the 1 s grace an idle close gives)
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (seen, _) = read_to_close(&mut tcp).await;
    let head_end = seen
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head")
        + 4;
    assert!(seen.starts_with(b"HTTP/1.1 200"));
    assert_eq!(
        seen.len() - head_end,
        BIG_BYTES,
        "the whole answer, then the idle close"
    );
}
