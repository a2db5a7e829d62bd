//! The accepted socket as the idle bound sees it: [`WriteWatched`] notes writes that block.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use super::{ms_since, Conn};

pin_project_lite::pin_project! {
    /// The accepted socket, watched for writes that block: while one is pending the
    /// connection is draining a response and the idle bound leaves it alone.
    pub(super) struct WriteWatched<IO> {
        #[pin]
        io: IO,
        conn: Arc<Conn>,
        epoch: Instant,
    }
}

impl<IO> WriteWatched<IO> {
    pub(super) fn new(io: IO, conn: Arc<Conn>, epoch: Instant) -> Self {
        Self { io, conn, epoch }
    }

    /// Records the outcome of one write (or flush) to the socket. Only a change of state
    /// touches the shared counters: the common case (a write that completes on a connection
    /// that was not blocked) is one relaxed load.
    fn note<T>(conn: &Conn, epoch: Instant, polled: &Poll<std::io::Result<T>>) {
        let blocked = conn.write_blocked.load(Ordering::Relaxed);
        match polled {
            Poll::Pending if !blocked => conn.write_blocked.store(true, Ordering::Release),
            Poll::Ready(_) if blocked => {
                conn.idle_since_ms.store(ms_since(epoch), Ordering::Relaxed);
                conn.write_blocked.store(false, Ordering::Release);
                // the idle deadline is computed afresh
                conn.request_ended.notify_one();
            }
            _ => {}
        }
    }
}

impl<IO: AsyncRead> AsyncRead for WriteWatched<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.project().io.poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite> AsyncWrite for WriteWatched<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.project();
        let polled = this.io.poll_write(cx, buf);
        Self::note(this.conn, *this.epoch, &polled);
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.project();
        let polled = this.io.poll_write_vectored(cx, bufs);
        Self::note(this.conn, *this.epoch, &polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.project();
        let polled = this.io.poll_flush(cx);
        Self::note(this.conn, *this.epoch, &polled);
        polled
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().io.poll_shutdown(cx)
    }
}
