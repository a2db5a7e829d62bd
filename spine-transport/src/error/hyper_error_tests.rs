#![allow(clippy::expect_used)]

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use http_body_util::Empty;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::TunnelError;

/// A transport that works (writes vanish, reads wait) until `dead`, then fails every read
/// and write with a broken pipe, as a tunnel whose peer is gone.
#[derive(Clone, Default)]
struct Pipe {
    dead: Arc<AtomicBool>,
    reader: Arc<Mutex<Option<Waker>>>,
}

impl Pipe {
    fn kill(&self) {
        self.dead.store(true, Ordering::SeqCst);
        if let Some(w) = self.reader.lock().ok().and_then(|mut w| w.take()) {
            w.wake();
        }
    }
}

fn broken() -> std::io::Error {
    std::io::Error::from(std::io::ErrorKind::BrokenPipe)
}

impl AsyncRead for Pipe {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        _buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if let Ok(mut w) = self.reader.lock() {
            *w = Some(cx.waker().clone());
        }
        if self.dead.load(Ordering::SeqCst) {
            Poll::Ready(Err(broken()))
        } else {
            Poll::Pending
        }
    }
}

impl AsyncWrite for Pipe {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.dead.load(Ordering::SeqCst) {
            Poll::Ready(Err(broken()))
        } else {
            Poll::Ready(Ok(buf.len()))
        }
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn an_h2_connection_io_error_is_closed_for_requests_in_flight() {
    let pipe = Pipe::default();
    let (mut sender, conn) = hyper::client::conn::http2::handshake::<_, _, Empty<bytes::Bytes>>(
        TokioExecutor::new(),
        TokioIo::new(pipe.clone()),
    )
    .await
    .expect("handshake");
    let conn = tokio::spawn(conn);
    let req = http::Request::get("http://spine-node/health")
        .body(Empty::new())
        .expect("request");
    let in_flight = tokio::spawn(sender.send_request(req));
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    pipe.kill();
    let err = in_flight
        .await
        .expect("join")
        .expect_err("the request fails with its tunnel");
    let err = TunnelError::from_hyper(err);
    assert!(err.is_closed(), "in flight: {err}: {:?}", err.source);
    let err = conn
        .await
        .expect("join")
        .expect_err("the connection fails on a broken pipe");
    let err = TunnelError::from_hyper(err);
    assert!(err.is_closed(), "connection: {err}: {:?}", err.source);
}

#[test]
fn other_io_errors_are_not_closed() {
    assert!(super::io_closed(&std::io::Error::from(
        std::io::ErrorKind::ConnectionReset
    )));
    assert!(!super::io_closed(&std::io::Error::from(
        std::io::ErrorKind::PermissionDenied
    )));
}
