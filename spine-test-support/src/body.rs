//! In-memory bodies and the service shape the routing and metering suites fake a node with.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::{BodyExt as _, Full};
use spine_core::{BoxBody, BoxError};

/// `bytes` as a whole [`BoxBody`] (one data frame).
pub fn full(bytes: impl Into<Bytes>) -> BoxBody {
    BoxBody::new(Full::new(bytes.into()).map_err(|never| match never {}))
}

/// A body that yields its scripted frames one per poll (a data frame, or an error), then ends —
/// or, after [`ScriptedBody::hang`], never yields again (a node or sender that stalls).
///
/// # End of stream
///
/// `None` once the script is spent, unless it hangs; an error frame is yielded once, in its
/// place in the script.
#[derive(Debug, Default)]
pub struct ScriptedBody {
    frames: VecDeque<Result<Bytes, String>>,
    hang: bool,
}

impl ScriptedBody {
    /// Data frames, one per read, then the end.
    pub fn data<B: Into<Bytes>>(reads: impl IntoIterator<Item = B>) -> Self {
        Self::frames(reads.into_iter().map(|b| Ok(b.into())))
    }

    /// Frames: `Ok` is a data frame, `Err` a body error with that message.
    pub fn frames(frames: impl IntoIterator<Item = Result<Bytes, String>>) -> Self {
        Self {
            frames: frames.into_iter().collect(),
            hang: false,
        }
    }

    /// The script, then a body error with `message`.
    #[must_use]
    pub fn fail(mut self, message: impl Into<String>) -> Self {
        self.frames.push_back(Err(message.into()));
        self
    }

    /// The script, then nothing, ever (no end of stream).
    #[must_use]
    pub fn hang(mut self) -> Self {
        self.hang = true;
        self
    }
}

impl Body for ScriptedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.frames.pop_front() {
            Some(frame) => Poll::Ready(Some(frame.map(Frame::data).map_err(BoxError::from))),
            None if self.hang => Poll::Pending,
            None => Poll::Ready(None),
        }
    }
}

/// The result of one poll of a body: a frame, an error, the end (`None`), or `Pending`.
pub type PollFrame = Poll<Option<Result<Frame<Bytes>, BoxError>>>;

/// A body whose every [`Body::poll_frame`] calls `poll` with the task's context: a test's node
/// or sender that keeps state between frames (a countdown, a timer, a channel) without a
/// hand-written `Body` impl.
///
/// # End of stream
///
/// Ends when `poll` returns `Ready(None)`; it is not polled again after that by a well-behaved
/// reader. Says nothing of its length ([`Body::size_hint`] and [`Body::is_end_stream`] keep their
/// defaults: unknown, not ended). `Pending` must come with `cx`'s waker registered, as for any
/// body.
pub fn body_fn<F>(poll: F) -> BodyFn<F>
where
    F: FnMut(&mut Context<'_>) -> PollFrame + Unpin,
{
    BodyFn(poll)
}

/// The body [`body_fn`] makes.
pub struct BodyFn<F>(F);

impl<F> std::fmt::Debug for BodyFn<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BodyFn")
    }
}

impl<F: FnMut(&mut Context<'_>) -> PollFrame + Unpin> Body for BodyFn<F> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> PollFrame {
        (self.get_mut().0)(cx)
    }
}

/// Sends each of `chunks` on `tx`, one at a time, and asserts that `body` yields it whole as its
/// next data frame within `wait` each: a stream relayed chunk by chunk (each chunk arrives before
/// the next one is even produced), not buffered.
///
/// # Panics
///
/// The channel is closed, a frame is late, the body ends or fails, or a frame is not the chunk
/// just sent.
#[allow(clippy::panic)]
pub async fn assert_streams_each<B>(
    tx: &tokio::sync::mpsc::Sender<Bytes>,
    body: &mut B,
    chunks: &[&'static str],
    wait: std::time::Duration,
) where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    for chunk in chunks {
        let chunk = Bytes::from_static(chunk.as_bytes());
        if tx.send(chunk.clone()).await.is_err() {
            panic!("the channel of {chunk:?} is closed");
        }
        let frame = match tokio::time::timeout(wait, body.frame()).await {
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(e))) => panic!("the body failed before {chunk:?}: {e:?}"),
            Ok(None) => panic!("the body ended before {chunk:?}"),
            Err(_) => panic!("{chunk:?} not relayed within {wait:?}"),
        };
        assert_eq!(frame.into_data().ok(), Some(chunk));
    }
}
