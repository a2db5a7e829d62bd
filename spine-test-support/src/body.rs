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

/// The bounds the router's and the meter's layers ask of the service behind them, as the suites
/// fake a node (upstream of the layer) with one: requests and responses with bodies `B`
/// ([`BoxBody`] unless said), `BoxError`, a `Send` future. Implemented for every such service
/// (`fn upstream() -> impl UpstreamService`). Not the node's own local service, which the tunnel
/// serves: that is `spine_transport::NodeService`.
pub trait UpstreamService<B = BoxBody>:
    tower::Service<
        http::Request<B>,
        Response = http::Response<B>,
        Error = BoxError,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S, B> UpstreamService<B> for S where
    S: tower::Service<
            http::Request<B>,
            Response = http::Response<B>,
            Error = BoxError,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}
