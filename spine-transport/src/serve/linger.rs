//! Lingering close, as nginx's `lingering_close` does it: when the server closes a connection
//! whose peer may still be sending (an answer given before the request body was read, such as
//! a refusal for lack of credit, a 413, a body timeout), closing the socket at once with
//! unread bytes in it makes the kernel send a TCP reset, and a caller still writing its body
//! sees a broken pipe or a reset instead of the answer (the SDKs then retry). So the write
//! half is shut first (the answer and a FIN go out), and what the peer still sends is
//! discarded until it closes, for at most [`ListenerLimits::lingering_time`] in all and
//! [`ListenerLimits::lingering_timeout`] between reads.
//!
//! On Linux the discarding reads use `MSG_TRUNC`, which drops the bytes in the kernel without
//! copying them into the process (tcp(7)): refusing a 4 MiB body costs the gateway a few
//! system calls, not a 4 MiB copy.
//!
//! [`ListenerLimits::lingering_time`]: super::ListenerLimits::lingering_time
//! [`ListenerLimits::lingering_timeout`]: super::ListenerLimits::lingering_timeout

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::Conn;

/// Where a [`Lingering`] socket leaves its stream when it is dropped after a clean shutdown
/// with the peer still open: the connection's task takes it from here and lingers.
#[derive(Default)]
pub(super) struct LingerSlot(Mutex<Option<TcpStream>>);

impl LingerSlot {
    pub(super) fn take(&self) -> Option<TcpStream> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    fn put(&self, tcp: TcpStream) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(tcp);
    }
}

/// The accepted TCP socket, watched for the two facts lingering needs: the server shut its
/// write half (hyper ended the connection cleanly) and the peer has not closed its own (no
/// end of stream read). When both hold at drop, the stream goes to the [`LingerSlot`].
pub(super) struct Lingering {
    tcp: Option<TcpStream>,
    shut_down: bool,
    peer_closed: bool,
    slot: Arc<LingerSlot>,
}

impl Lingering {
    pub(super) fn new(tcp: TcpStream, slot: Arc<LingerSlot>) -> Self {
        Self {
            tcp: Some(tcp),
            shut_down: false,
            peer_closed: false,
            slot,
        }
    }

    fn tcp(&mut self) -> std::io::Result<Pin<&mut TcpStream>> {
        match self.tcp.as_mut() {
            Some(tcp) => Ok(Pin::new(tcp)),
            // only `drop` takes it
            None => Err(std::io::ErrorKind::NotConnected.into()),
        }
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        if self.shut_down && !self.peer_closed {
            if let Some(tcp) = self.tcp.take() {
                self.slot.put(tcp);
            }
        }
    }
}

impl AsyncRead for Lingering {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let asked = buf.remaining() > 0;
        let polled = match this.tcp() {
            Ok(tcp) => tcp.poll_read(cx, buf),
            Err(e) => return Poll::Ready(Err(e)),
        };
        match &polled {
            // end of stream (or a broken socket): nothing to linger for
            Poll::Ready(Ok(())) if asked && buf.filled().len() == before => this.peer_closed = true,
            Poll::Ready(Err(_)) => this.peer_closed = true,
            _ => {}
        }
        polled
    }
}

impl AsyncWrite for Lingering {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut().tcp() {
            Ok(tcp) => tcp.poll_write(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut().tcp() {
            Ok(tcp) => tcp.poll_write_vectored(cx, bufs),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.as_ref().is_some_and(AsyncWrite::is_write_vectored)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut().tcp() {
            Ok(tcp) => tcp.poll_flush(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let polled = match this.tcp() {
            Ok(tcp) => tcp.poll_shutdown(cx),
            Err(e) => return Poll::Ready(Err(e)),
        };
        if matches!(polled, Poll::Ready(Ok(()))) {
            this.shut_down = true;
        }
        polled
    }
}

/// Bytes one discarding read may drop. The buffer is never written on Linux (`MSG_TRUNC`), so
/// its (zero) pages are never touched.
const DISCARD_BYTES: usize = 256 * 1024;

/// Discards what the peer of `tcp` (its write half already shut) still sends, until it closes,
/// [`lingering_timeout`](super::ListenerLimits::lingering_timeout) passes without a byte,
/// `lingering_time` passes in all, or the connection is told to close (evicted at the cap, or
/// the server shutting down). Then the socket is dropped.
///
/// # Cancel safety
///
/// Dropping the future closes the socket.
pub(super) async fn linger(
    tcp: TcpStream,
    conn: &Conn,
    lingering_time: Duration,
    lingering_timeout: Duration,
) {
    // told to close already (that notification was taken while the connection was busy): no
    // lingering; a later one is stored by `notify_one` and seen below
    if conn.closing.load(std::sync::atomic::Ordering::Acquire) {
        return;
    }
    let end = Instant::now() + lingering_time;
    // zeroed (calloc: fresh zero pages, never touched as the kernel never writes them), so
    // that no slice over uninitialised bytes is ever made
    let mut scratch = vec![0u8; DISCARD_BYTES];
    loop {
        let now = Instant::now();
        // checked here too: a peer that keeps the socket full never lets `readable` wait
        if now >= end {
            return;
        }
        let wait = end.min(now + lingering_timeout);
        tokio::select! {
            ready = tokio::time::timeout_at(wait, tcp.readable()) => match ready {
                Ok(Ok(())) => {}
                // quiet too long, or the socket failed
                Err(_) | Ok(Err(_)) => return,
            },
            () = conn.close.notified() => return,
        }
        match tcp.try_io(tokio::io::Interest::READABLE, || {
            discard(&tcp, &mut scratch)
        }) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

/// One read that drops what it reads: without copying on Linux (`MSG_TRUNC`).
#[cfg(unix)]
fn discard(tcp: &TcpStream, scratch: &mut [u8]) -> std::io::Result<usize> {
    #[cfg(target_os = "linux")]
    let flags = rustix::net::RecvFlags::TRUNC;
    #[cfg(not(target_os = "linux"))]
    let flags = rustix::net::RecvFlags::empty();
    rustix::net::recv(tcp, scratch, flags)
        .map(|(_, len)| len)
        .map_err(std::io::Error::from)
}

#[cfg(not(unix))]
fn discard(tcp: &TcpStream, scratch: &mut [u8]) -> std::io::Result<usize> {
    tcp.try_read(scratch)
}
