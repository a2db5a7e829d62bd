//! Lingering close on real loopback sockets: an answer given before the request body was read
//! (a refusal) reaches a caller that is still writing a body far larger than the socket
//! buffers, where closing at once resets the connection under its write; a lingering
//! connection never holds up the server's shutdown nor a new caller at the connection cap.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use axum::routing::{get, post};
use spine_transport::{LimitedServer, ListenerLimits};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// Far above any bound under test: only a hang takes this long.
const HANG: Duration = Duration::from_secs(60);

/// A request body far larger than the loopback socket buffers of both ends (a few MiB each on
/// Linux): most of it is still being written when the answer comes.
const BODY_BYTES: usize = 64 << 20;

fn app() -> axum::Router {
    axum::Router::new()
        .route("/", get(|| async { "ok" }))
        // answers without reading the body, as a refusal for lack of credit does
        .route(
            "/refuse",
            post(|| async { (http::StatusCode::PAYMENT_REQUIRED, "no credit") }),
        )
}

/// Serves [`app`] until the returned sender fires (or is dropped); the join handle ends when
/// the server has stopped.
async fn start(
    limits: ListenerLimits,
) -> (
    std::net::SocketAddr,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    start_with(limits, app()).await
}

/// [`start`] serving `router`.
async fn start_with(
    limits: ListenerLimits,
    router: axum::Router,
) -> (
    std::net::SocketAddr,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        LimitedServer::new("test", limits)
            .http1_only()
            .serve(listener, router, async move {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    (addr, stop, server)
}

fn head(bytes: usize) -> String {
    format!("POST /refuse HTTP/1.1\r\nhost: x\r\ncontent-length: {bytes}\r\n\r\n")
}

/// Sends a refused request with a [`BODY_BYTES`] body as a caller does (writing the whole body
/// while reading); returns the outcome of the body's write and what was read until the close.
async fn refused_while_writing(addr: std::net::SocketAddr) -> (std::io::Result<()>, String) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = tcp.into_split();
    let writer = tokio::spawn(async move {
        wr.write_all(head(BODY_BYTES).as_bytes()).await?;
        let chunk = vec![b'x'; 64 << 10];
        for _ in 0..BODY_BYTES / chunk.len() {
            wr.write_all(&chunk).await?;
        }
        wr.flush().await?;
        // the caller is done sending; keep the read half open
        wr.shutdown().await
    });
    let reader = tokio::spawn(async move {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&seen).into_owned()
    });
    let written = tokio::time::timeout(HANG, writer)
        .await
        .expect("the body's write hung")
        .unwrap();
    let read = tokio::time::timeout(HANG, reader)
        .await
        .expect("the answer's read hung")
        .unwrap();
    (written, read)
}

#[tokio::test]
async fn an_answer_before_the_body_reaches_a_caller_still_writing_it() {
    let (addr, _stop, _server) = start(ListenerLimits::default()).await;
    let (written, read) = refused_while_writing(addr).await;
    assert!(
        written.is_ok(),
        "the caller's write was cut: {written:?} (read: {read:?})"
    );
    assert!(read.starts_with("HTTP/1.1 402"), "{read:?}");
    assert!(read.ends_with("no credit"), "{read:?}");
    // the caller is told the connection ends here: a client that pooled it would send its
    // next request into the lingering socket, never answered
    assert!(
        read.to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{read:?}"
    );

    // the control: closing at once (no lingering) resets the connection under the caller's
    // write, which is what the lingering prevents
    let (addr, _stop, _server) =
        start(ListenerLimits::default().lingering(Duration::ZERO, Duration::ZERO)).await;
    let (written, _) = refused_while_writing(addr).await;
    assert!(
        written.is_err(),
        "without lingering the write should be reset"
    );
}

/// A caller that sent part of its body and then went quiet, its socket open: the server
/// answered and lingers on it.
async fn quiet_refused_caller(addr: std::net::SocketAddr) -> TcpStream {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(head(BODY_BYTES).as_bytes()).await.unwrap();
    tcp.write_all(&vec![b'x'; 1 << 20]).await.unwrap();
    // the answer and the server's FIN come; the caller keeps its socket open and silent
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(HANG, tcp.read(&mut buf)).await {
            Ok(Ok(0)) => break,
            Ok(Ok(n)) => seen.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => panic!("read failed: {e}"),
            Err(_) => panic!("no answer within {HANG:?}"),
        }
    }
    assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 402"));
    tcp
}

#[tokio::test]
async fn a_lingering_connection_does_not_hold_up_shutdown() {
    // lingering far longer than a hang: only the shutdown can end it in time
    let long = Duration::from_secs(600);
    let (addr, stop, server) = start(ListenerLimits::default().lingering(long, long)).await;
    let _quiet = quiet_refused_caller(addr).await;
    stop.send(()).unwrap();
    tokio::time::timeout(HANG, server)
        .await
        .expect("the server waited for a lingering connection")
        .unwrap();
}

#[tokio::test]
async fn a_lingering_connection_makes_room_at_the_cap() {
    let long = Duration::from_secs(600);
    let (addr, _stop, _server) = start(
        ListenerLimits::default()
            .max_connections(1)
            .lingering(long, long),
    )
    .await;
    let mut quiet = quiet_refused_caller(addr).await;
    // the only place under the cap is the lingering connection's: it is idle, so it is evicted
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut seen = Vec::new();
    tokio::time::timeout(HANG, tcp.read_to_end(&mut seen))
        .await
        .expect("the new caller was kept out")
        .unwrap();
    let seen = String::from_utf8_lossy(&seen);
    assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
    assert!(seen.ends_with("ok"), "{seen}");
    // and the evicted connection stopped lingering: its socket is closed, so the quiet caller's
    // next writes are reset (a lingering socket would take them for 600 s)
    let reset = async {
        let chunk = vec![b'x'; 64 << 10];
        loop {
            if quiet.write_all(&chunk).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(HANG, reset)
        .await
        .expect("the evicted connection kept lingering");
}

#[tokio::test]
async fn a_connection_busy_when_the_server_shuts_down_does_not_linger_past_it() {
    // a request in flight when the shutdown comes: the connection ends gracefully after its
    // answer (hyper shuts the write half), its peer keeps the socket open and silent
    let started = std::sync::Arc::new(tokio::sync::Notify::new());
    let release = std::sync::Arc::new(tokio::sync::Notify::new());
    let router = {
        let (started, release) = (started.clone(), release.clone());
        axum::Router::new().route(
            "/slow",
            get(move || async move {
                started.notify_one();
                release.notified().await;
                "done"
            }),
        )
    };
    let long = Duration::from_secs(600);
    let (addr, stop, server) =
        start_with(ListenerLimits::default().lingering(long, long), router).await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    tokio::time::timeout(HANG, started.notified())
        .await
        .expect("the request never reached the handler");
    stop.send(()).unwrap();
    // the listener is dropped just before every connection is told to close (one task, no
    // await between): once a connect is refused, this one has been told
    tokio::time::timeout(HANG, async {
        while TcpStream::connect(addr).await.is_ok() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the listener was never dropped");
    release.notify_one();
    let mut seen = Vec::new();
    tokio::time::timeout(HANG, tcp.read_to_end(&mut seen))
        .await
        .expect("no answer")
        .unwrap();
    let seen = String::from_utf8_lossy(&seen);
    assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
    assert!(seen.ends_with("done"), "{seen}");
    // `tcp` stays open and silent: the server must not linger on it now that it shuts down
    tokio::time::timeout(HANG, server)
        .await
        .expect("the server waited for a connection lingering after the shutdown")
        .unwrap();
    drop(tcp);
}
