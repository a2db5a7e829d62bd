//! Read-ahead: the node's answer is read at the node's pace into a bounded per-stream buffer, so
//! a slow caller holds gateway memory (bounded) instead of the node's slot (issue 14).
//!
//! [`ReadAheadLayer`] sits above [`Route`](crate::Route) (below the metering layer): each
//! response body is pumped by a task of its own into a buffer of at most
//! [`ReadAheadLayer::new`]'s `max_buffer_bytes`, and the caller's side reads from that buffer.
//! The data frames the node's body has ready together, as many as the buffer has room for, are
//! joined into one (never a wait for more), so a busy stream pays the buffer's per-frame costs
//! once per batch of events rather than once per event.
//! When the node's stream ends, the task drops the node's body at once, which releases the
//! node's in-flight lease and its tunnel stream: the slot is free when generation ends, not when
//! the caller has read everything. While the buffer is full the task stops reading, so a caller
//! that reads nothing at all still holds the slot, once more than `max_buffer_bytes` are
//! waiting (HTTP/2 flow control then slows the node).
//!
//! What sits above (the meter) sees frames when the *caller* takes them: it counts, and bills,
//! what was delivered. A caller that leaves with bytes still in the buffer is billed
//! `client_cancelled` for what it received, not for what the node generated into the buffer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt as _;
use spine_core::{BoxBody, BoxError};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tower::{Layer, Service};

/// Default per-stream buffer: 4 MiB (about 20,000 tokens of SSE chunks).
pub const DEFAULT_READ_AHEAD_BYTES: usize = 4 * 1024 * 1024;

/// What each buffered frame counts for at least, bytes: a frame's own overhead (the channel
/// entry and its `Bytes`), so that a node sending empty frames cannot grow the buffer without
/// bound.
const FRAME_OVERHEAD_BYTES: usize = 64;

/// Adds [`ReadAhead`]: each response body is read ahead of the caller into a bounded buffer.
#[derive(Clone, Copy, Debug)]
pub struct ReadAheadLayer {
    max_buffer_bytes: usize,
}

impl ReadAheadLayer {
    /// Buffers at most `max_buffer_bytes` of each response body (at least one frame's worth
    /// is always let through; see the module docs). `0` turns read-ahead off: bodies pass as
    /// they are.
    pub fn new(max_buffer_bytes: usize) -> Self {
        Self { max_buffer_bytes }
    }
}

impl Default for ReadAheadLayer {
    /// [`DEFAULT_READ_AHEAD_BYTES`].
    fn default() -> Self {
        Self::new(DEFAULT_READ_AHEAD_BYTES)
    }
}

impl<S> Layer<S> for ReadAheadLayer {
    type Service = ReadAhead<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ReadAhead {
            inner,
            max_buffer_bytes: self.max_buffer_bytes,
        }
    }
}

/// Reads each response body ahead of the caller into a bounded buffer ([`ReadAheadLayer`]).
#[derive(Clone, Debug)]
pub struct ReadAhead<S> {
    inner: S,
    max_buffer_bytes: usize,
}

impl<S> ReadAhead<S> {
    spine_core::inner_service_accessors!(inner: S);
}

impl<S, ReqBody> Service<http::Request<ReqBody>> for ReadAhead<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<BoxBody>>,
{
    type Response = http::Response<BoxBody>;
    type Error = S::Error;
    type Future = ReadAheadFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        ReadAheadFuture {
            inner: self.inner.call(req),
            max_buffer_bytes: self.max_buffer_bytes,
        }
    }
}

pin_project_lite::pin_project! {
    /// Response future of [`ReadAhead`]: the inner response, its body read ahead.
    #[derive(Debug)]
    pub struct ReadAheadFuture<F> {
        #[pin]
        inner: F,
        max_buffer_bytes: usize,
    }
}

impl<F, E> Future for ReadAheadFuture<F>
where
    F: Future<Output = Result<http::Response<BoxBody>, E>>,
{
    type Output = Result<http::Response<BoxBody>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let max = *this.max_buffer_bytes;
        this.inner
            .poll(cx)
            .map_ok(|resp| resp.map(|body| read_ahead(body, max)))
    }
}

/// `body`, read ahead into a buffer of at most `max_buffer_bytes` by a task of its own; `body`
/// itself when there is nothing to read ahead (it has ended, or `max_buffer_bytes` is 0).
///
/// Must be called within a tokio runtime (it spawns the task).
pub fn read_ahead(body: BoxBody, max_buffer_bytes: usize) -> BoxBody {
    if max_buffer_bytes == 0 || body.is_end_stream() {
        return body;
    }
    let budget = max_buffer_bytes.clamp(FRAME_OVERHEAD_BYTES, Semaphore::MAX_PERMITS);
    let permits = Arc::new(Semaphore::new(budget));
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(pump(body, tx, permits, budget));
    BoxBody::new(ReadAheadBody { rx, done: false })
}

type Buffered = (Result<Frame<Bytes>, BoxError>, Option<OwnedSemaphorePermit>);

/// Reads `body` into `tx` while the buffer has room; ends (dropping `body`) when `body` ends or
/// breaks, or when the reader is gone.
/// What a data frame of `len` bytes counts for in the buffer.
fn cost(len: usize, budget: usize) -> u32 {
    u32::try_from(len.max(FRAME_OVERHEAD_BYTES).min(budget)).unwrap_or(u32::MAX)
}

/// What the frames joined into one buffered frame count for at most (see `join_ready`): 16 KiB.
const JOIN_MAX_BYTES: usize = 16 * 1024;

async fn pump(
    mut body: BoxBody,
    tx: mpsc::UnboundedSender<Buffered>,
    permits: Arc<Semaphore>,
    budget: usize,
) {
    // a frame read from the node that found no room in the buffer, or followed data
    let mut held: Option<Result<Frame<Bytes>, BoxError>> = None;
    loop {
        let next = match held.take() {
            Some(frame) => Some(frame),
            None => tokio::select! {
                next = body.frame() => next,
                () = tx.closed() => return,
            },
        };
        let frame = match next {
            None => return,
            Some(Ok(frame)) => frame,
            Some(Err(e)) => {
                let _ = tx.send((Err(e), None));
                return;
            }
        };
        let first_cost = cost(frame.data_ref().map_or(0, Bytes::len), budget);
        let mut permit = tokio::select! {
            permit = permits.clone().acquire_many_owned(first_cost) => permit.ok(),
            () = tx.closed() => return,
        };
        let (frame, ended) = match frame.into_data() {
            Ok(first) => {
                join_ready(&mut body, first, &permits, &mut permit, budget, &mut held).await
            }
            Err(frame) => (frame, false),
        };
        if tx.send((Ok(frame), permit)).is_err() || ended {
            return;
        }
    }
}

/// `first` and the data frames `body` has ready now (polled once each, never awaited) that fit
/// in the buffer's room, joined into one frame; their permits are merged into `permit`. The
/// join stops once its frames count for [`JOIN_MAX_BYTES`] (each at least
/// `FRAME_OVERHEAD_BYTES`, so a flood of empty frames ends it too). A frame that does not fit, a
/// non-data frame or an error goes to `held`. Also says whether `body` ended.
///
/// The frame is one allocation of exactly its length, joined or alone, so what it holds is what
/// its permits count (a buffer with spare capacity, or a slice of a larger one, would hold more
/// memory than it is charged for).
///
/// So a busy stream pays the buffer's per-frame costs (a permit, a channel send, a wake-up of
/// the caller's connection, a chunk written to the caller) once per batch of events, and a
/// frame that arrives alone is passed on at once.
async fn join_ready(
    body: &mut BoxBody,
    first: Bytes,
    permits: &Arc<Semaphore>,
    permit: &mut Option<OwnedSemaphorePermit>,
    budget: usize,
    held: &mut Option<Result<Frame<Bytes>, BoxError>>,
) -> (Frame<Bytes>, bool) {
    let mut counted = cost(first.len(), budget) as usize;
    let mut parts: Vec<Bytes> = Vec::new();
    let mut ended = false;
    while counted < JOIN_MAX_BYTES && !body.is_end_stream() {
        // one poll: `Pending` leaves the pump's waker with the body (at worst a spurious wake)
        let polled =
            std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *body).poll_frame(cx))).await;
        let next = match polled {
            Poll::Pending => break,
            Poll::Ready(None) => {
                ended = true;
                break;
            }
            Poll::Ready(Some(next)) => next,
        };
        let data = match next.map(Frame::into_data) {
            Ok(Ok(data)) => data,
            Ok(Err(frame)) => {
                *held = Some(Ok(frame));
                break;
            }
            Err(e) => {
                *held = Some(Err(e));
                break;
            }
        };
        let data_cost = cost(data.len(), budget);
        let Ok(more) = permits.clone().try_acquire_many_owned(data_cost) else {
            *held = Some(Ok(Frame::data(data)));
            break;
        };
        match permit {
            Some(permit) => permit.merge(more),
            None => *permit = Some(more),
        }
        counted = counted.saturating_add(data_cost as usize);
        parts.push(data);
    }
    // a frame alone is copied too: the node's frame is a slice of the HTTP/2 connection's read
    // buffer, and would keep all of it alive while it waits here, counted by its length (a node
    // sending tiny frames between fillers could hold many times the buffer's bound)
    let joined = spine_core::concat_exact(std::iter::once(&first).chain(&parts));
    (Frame::data(joined), ended)
}

/// The caller's side of a read-ahead body: frames as the pump buffered them.
///
/// # End of stream
///
/// Ends after the node's body ended and every buffered frame was taken; an error of the node's
/// body comes after the frames before it. Dropping it stops the pump, which drops the node's
/// body (the node's stream is reset, as when a caller leaves).
struct ReadAheadBody {
    rx: mpsc::UnboundedReceiver<Buffered>,
    done: bool,
}

impl Body for ReadAheadBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some((frame, permit))) => {
                // the bytes leave the buffer: room for the pump
                drop(permit);
                if frame.is_err() {
                    self.done = true;
                }
                Poll::Ready(Some(frame))
            }
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests;
