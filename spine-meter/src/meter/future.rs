use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use spine_core::{BoxBody, BoxError};

type Inner = Pin<Box<dyn Future<Output = Result<http::Response<BoxBody>, BoxError>> + Send>>;

/// The response future of [`Meter`](super::Meter): buffers and counts the request, places the
/// hold, calls the inner service and wraps its response.
///
/// # Cancel safety
///
/// Dropped after the hold is placed but before the response head is returned, the request is
/// settled on a spawned task: `client_cancelled` with the node (the prompt is billed) when the
/// router had picked one, `rejected` (the hold released, nothing billed) otherwise.
pub struct ResponseFuture {
    pub(super) inner: Inner,
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl Future for ResponseFuture {
    type Output = Result<http::Response<BoxBody>, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}
