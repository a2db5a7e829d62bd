//! Request ids at the edge: a tower layer that gives every request a fresh
//! [`RequestId`](spine_core::RequestId) and
//! every response its `x-request-id` header.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::header::{HeaderName, HeaderValue};

/// The response header that names the request (`req_<24 hex>`).
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Gives every request a fresh [`RequestId`](spine_core::RequestId)
/// ([`new_request_id`](crate::keys::new_request_id))
/// in its extensions, and every response, errors included, its [`X_REQUEST_ID`] header. An id
/// the caller sent is never trusted: each request gets its own.
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestIdLayer;

impl<S> tower::Layer<S> for RequestIdLayer {
    type Service = RequestIdService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequestIdService { inner }
    }
}

/// The service of [`RequestIdLayer`].
#[derive(Clone, Debug)]
pub struct RequestIdService<S> {
    inner: S,
}

impl<S, B, RB> tower::Service<http::Request<B>> for RequestIdService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future = RequestIdFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let id = crate::keys::new_request_id();
        let header = HeaderValue::from_str(id.as_str()).ok();
        req.extensions_mut().insert(id);
        RequestIdFuture {
            inner: self.inner.call(req),
            header,
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`RequestIdService`]: the inner response with its `x-request-id`.
    pub struct RequestIdFuture<F> {
        #[pin]
        inner: F,
        header: Option<HeaderValue>,
    }
}

impl<F, RB, E> Future for RequestIdFuture<F>
where
    F: Future<Output = Result<http::Response<RB>, E>>,
{
    type Output = Result<http::Response<RB>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut resp = std::task::ready!(this.inner.poll(cx))?;
        if let Some(v) = this.header.take() {
            resp.headers_mut().insert(X_REQUEST_ID, v);
        }
        Poll::Ready(Ok(resp))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use spine_core::RequestId;
    use tower::{Layer as _, ServiceExt as _};

    #[tokio::test]
    async fn each_request_gets_its_own_id_in_its_extensions_and_its_answer() {
        let svc = RequestIdLayer.layer(tower::service_fn(|req: http::Request<()>| async move {
            let id = req.extensions().get::<RequestId>().unwrap().clone();
            Ok::<_, std::convert::Infallible>(http::Response::new(id))
        }));
        let first = svc.clone().oneshot(http::Request::new(())).await.unwrap();
        let second = svc.oneshot(http::Request::new(())).await.unwrap();
        assert_eq!(first.headers()[X_REQUEST_ID], first.body().as_str());
        assert!(first.body().as_str().starts_with("req_"));
        assert_ne!(first.body(), second.body());
    }
}
