use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use spine_core::{BoxBody, BoxError};

/// Response future of [`Route`](super::Route).
///
/// # Cancel safety
///
/// Dropping it before the response is returned (the caller went away) leaves the admission
/// queue if the request waits there, releases the picked node's in-flight slot, and drops the
/// inner service's future or the node's answer (over a tunnel, its stream is reset, which
/// cancels the engine request). The attempt in progress is not scored, nor are earlier
/// answer-type failures still waiting for a verdict; failures scored at once stay scored.
pub struct ResponseFuture {
    pub(super) inner:
        Pin<Box<dyn Future<Output = Result<http::Response<BoxBody>, BoxError>> + Send>>,
}

impl std::fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl Future for ResponseFuture {
    type Output = Result<http::Response<BoxBody>, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}
