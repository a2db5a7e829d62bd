use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Sink, Stream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::WebSocketStream;

/// Default cap on the payload of one binary message [`WsIo`] writes: 64 KiB.
pub const DEFAULT_MAX_WRITE_MESSAGE_BYTES: usize = 64 * 1024;

/// A byte stream over a WebSocket's binary messages: tokio [`AsyncRead`] + [`AsyncWrite`].
///
/// The tunnel runs HTTP/2 over this after the handshake (design brief §4).
///
/// - Reading yields the payloads of binary messages, in order, across message boundaries.
///   Pings are answered with pongs by the WebSocket layer and, like pongs, skipped. A close
///   message or the end of the stream reads as EOF. A text message is an error
///   ([`io::ErrorKind::InvalidData`]): after the handshake only binary messages are allowed.
/// - Writing sends each write as one binary message of at most
///   [`max_write_message_bytes`](Self::with_max_write_message_bytes) bytes (a longer buffer is
///   written partially, as `AsyncWrite` allows). Flush flushes the WebSocket; shutdown sends a
///   close message.
/// - A flush after writes is put off once: the first `poll_flush` wakes its own task and
///   answers `Pending`, so every task already ready runs first and the frames they queue (other
///   streams' events, on a busy tunnel) leave with these in one flush; the next `poll_flush`
///   flushes. Alone on the runtime, that costs one more poll of the connection task and no
///   waiting. (With the WebSocket's write buffer on, see `ws_config`, a flush is what writes.)
/// - With a [write timeout](Self::with_write_timeout), a write or flush that stays blocked for
///   that long fails with [`io::ErrorKind::TimedOut`], which kills the connection above it
///   (design brief §4: any write blocked 5 s kills the tunnel); the stall is counted in the
///   [`crate::metric::WRITE_STALLS`] metric. Only a flush that completes counts as progress:
///   messages the WebSocket (or TLS) layer still takes into its buffers while the socket is
///   blocked do not restart the timeout.
/// - With a [ping interval](Self::with_ping_interval), a WebSocket ping is sent every interval
///   while the stream is being read, so middleboxes that watch WebSocket traffic see it alive.
/// - With an [activity counter](Self::with_activity), every message received (data, ping, pong)
///   increments it: activity in either direction counts as liveness.
pub struct WsIo<S> {
    ws: WebSocketStream<S>,
    read_buf: Bytes,
    read_eof: bool,
    max_write_message_bytes: usize,
    write_timeout: Option<Duration>,
    write_deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The sink's last `poll_ready` was `Pending`: its next `Ready` means a flush completed.
    sink_blocked: bool,
    /// Messages were written since the last completed flush.
    unflushed: bool,
    /// The next `poll_flush` flushes: this one was put off once already.
    flush_put_off: bool,
    activity: Option<Arc<AtomicU64>>,
    ping_interval: Option<tokio::time::Interval>,
    ping_due: bool,
    kill: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    killed: bool,
}

impl<S> WsIo<S> {
    /// Wraps a WebSocket whose handshake messages (if any) have been exchanged.
    pub fn new(ws: WebSocketStream<S>) -> Self {
        Self {
            ws,
            read_buf: Bytes::new(),
            read_eof: false,
            max_write_message_bytes: DEFAULT_MAX_WRITE_MESSAGE_BYTES,
            write_timeout: None,
            write_deadline: None,
            sink_blocked: false,
            unflushed: false,
            flush_put_off: false,
            activity: None,
            ping_interval: None,
            ping_due: false,
            kill: None,
            killed: false,
        }
    }

    /// Breaks the stream once `kill` completes: reads and writes then fail with
    /// [`io::ErrorKind::ConnectionAborted`], so the connection above fails every request in
    /// flight at once (used when a new session takes a node over). Default: none.
    pub fn with_kill(mut self, kill: impl Future<Output = ()> + Send + 'static) -> Self {
        self.kill = Some(Box::pin(kill));
        self
    }

    fn poll_killed(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if !self.killed {
            let kill = self.kill.as_mut()?;
            if kill.as_mut().poll(cx).is_pending() {
                return None;
            }
            // a completed future must not be polled again
            self.kill = None;
            self.killed = true;
        }
        Some(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "tunnel closed: replaced by a new session",
        ))
    }

    /// Sends a WebSocket ping every `interval` (the first one `interval` after this call) while
    /// the stream is read. Default: none.
    pub fn with_ping_interval(mut self, interval: Duration) -> Self {
        let interval = interval.max(Duration::from_millis(1));
        let mut timer = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.ping_interval = Some(timer);
        self
    }

    /// Increments `counter` for every WebSocket message received. Default: none.
    pub fn with_activity(mut self, counter: Arc<AtomicU64>) -> Self {
        self.activity = Some(counter);
        self
    }

    /// Fails writes and flushes blocked for longer than `timeout`. Default: no timeout.
    pub fn with_write_timeout(mut self, timeout: Duration) -> Self {
        self.write_timeout = Some(timeout);
        self
    }

    /// Caps the payload of each binary message written (minimum 1). Default
    /// [`DEFAULT_MAX_WRITE_MESSAGE_BYTES`]; keep it below the peer's maximum message size.
    pub fn with_max_write_message_bytes(mut self, max: usize) -> Self {
        self.max_write_message_bytes = max.max(1);
        self
    }

    /// The WebSocket.
    pub fn get_ref(&self) -> &WebSocketStream<S> {
        &self.ws
    }

    /// The WebSocket, mutably. Sending messages on it interleaves with the byte stream.
    pub fn get_mut(&mut self) -> &mut WebSocketStream<S> {
        &mut self.ws
    }

    /// The WebSocket; bytes already received but not yet read are lost.
    pub fn into_inner(self) -> WebSocketStream<S> {
        self.ws
    }
}

impl<S> fmt::Debug for WsIo<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WsIo")
            .field("buffered_read_bytes", &self.read_buf.len())
            .field("read_eof", &self.read_eof)
            .field("max_write_message_bytes", &self.max_write_message_bytes)
            .field("write_timeout", &self.write_timeout)
            .finish_non_exhaustive()
    }
}

fn to_io(err: tungstenite::Error) -> io::Error {
    match err {
        tungstenite::Error::Io(e) => e,
        tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed => {
            io::Error::new(io::ErrorKind::BrokenPipe, err)
        }
        other => io::Error::other(other),
    }
}

impl<S> WsIo<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    /// Handles a `Pending` write-side poll: arms the deadline on first use, fails once it passes.
    fn poll_blocked(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let Some(timeout) = self.write_timeout else {
            return Poll::Pending;
        };
        let deadline = self
            .write_deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        ready!(deadline.as_mut().poll(cx));
        self.write_deadline = None;
        metrics::counter!(crate::metric::WRITE_STALLS).increment(1);
        tracing::warn!(
            timeout_ms = timeout.as_millis() as u64,
            "tunnel write blocked, giving up"
        );
        Poll::Ready(io::Error::new(
            io::ErrorKind::TimedOut,
            "tunnel write blocked past the write timeout",
        ))
    }
}

impl<S> WsIo<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    /// Queues a WebSocket ping when one is due and the sink has room; never blocks the read.
    fn poll_ping(&mut self, cx: &mut Context<'_>) {
        let Some(timer) = self.ping_interval.as_mut() else {
            return;
        };
        while timer.poll_tick(cx).is_ready() {
            self.ping_due = true;
        }
        if !self.ping_due {
            return;
        }
        if let Poll::Ready(Ok(())) = Pin::new(&mut self.ws).poll_ready(cx) {
            if Pin::new(&mut self.ws)
                .start_send(Message::Ping(Bytes::new()))
                .is_ok()
            {
                self.ping_due = false;
                // a pending flush completes on the next read or write; tungstenite flushes
                // queued frames whenever it is polled
                let _ = Pin::new(&mut self.ws).poll_flush(cx);
            }
        }
    }
}

impl<S> AsyncRead for WsIo<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(e) = this.poll_killed(cx) {
            return Poll::Ready(Err(e));
        }
        if !this.read_eof {
            this.poll_ping(cx);
        }
        loop {
            if !this.read_buf.is_empty() {
                let n = this.read_buf.len().min(buf.remaining());
                buf.put_slice(&this.read_buf.split_to(n));
                return Poll::Ready(Ok(()));
            }
            if this.read_eof {
                return Poll::Ready(Ok(()));
            }
            let msg = ready!(Pin::new(&mut this.ws).poll_next(cx));
            if let (Some(Ok(_)), Some(counter)) = (&msg, &this.activity) {
                counter.fetch_add(1, Ordering::Relaxed);
            }
            match msg {
                Some(Ok(Message::Binary(bytes))) => this.read_buf = bytes,
                Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
                Some(Ok(Message::Close(_))) | None => this.read_eof = true,
                Some(Ok(Message::Text(_))) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "text message on the tunnel after the handshake",
                    )))
                }
                Some(Err(tungstenite::Error::ConnectionClosed)) => this.read_eof = true,
                Some(Err(e)) => return Poll::Ready(Err(to_io(e))),
            }
        }
    }
}

impl<S> AsyncWrite for WsIo<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Some(e) = this.poll_killed(cx) {
            return Poll::Ready(Err(e));
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        match Pin::new(&mut this.ws).poll_ready(cx) {
            Poll::Ready(Ok(())) => {
                // `Ready` alone is no progress: the sink stays ready after a flush that blocked
                // (TLS holds the bytes) and takes one more message into its buffers without a
                // byte reaching the socket. Only `Ready` after `Pending` (its flush completed)
                // is, as is a completed `poll_flush`.
                if std::mem::take(&mut this.sink_blocked) {
                    this.write_deadline = None;
                }
            }
            Poll::Ready(Err(e)) => return Poll::Ready(Err(to_io(e))),
            Poll::Pending => {
                this.sink_blocked = true;
                return this.poll_blocked(cx).map(Err);
            }
        }
        let n = buf.len().min(this.max_write_message_bytes);
        Pin::new(&mut this.ws)
            .start_send(Message::Binary(Bytes::copy_from_slice(&buf[..n])))
            .map_err(to_io)?;
        this.unflushed = true;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.unflushed && !this.flush_put_off {
            // the tasks ready now run before this one is polled again (a task that wakes
            // itself goes to the back of tokio's run queue)
            this.flush_put_off = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        match Pin::new(&mut this.ws).poll_flush(cx) {
            Poll::Ready(r) => {
                this.unflushed = false;
                this.flush_put_off = false;
                this.write_deadline = None;
                this.sink_blocked = false;
                Poll::Ready(r.map_err(to_io))
            }
            Poll::Pending => this.poll_blocked(cx).map(Err),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.ws).poll_close(cx) {
            Poll::Ready(Ok(()))
            | Poll::Ready(Err(
                tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed,
            )) => {
                this.write_deadline = None;
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => {
                this.write_deadline = None;
                Poll::Ready(Err(to_io(e)))
            }
            Poll::Pending => this.poll_blocked(cx).map(Err),
        }
    }
}

#[cfg(test)]
mod tests;
