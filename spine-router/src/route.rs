use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use spine_core::{BoxBody, BoxError, NodeSlot, RequestPeek};
use tower::{Layer, Service};

use crate::{InFlightLease, NodeRegistry, RouteError};

/// Applies [`Route`] to a service: picks the node for each request.
#[derive(Debug, Clone)]
pub struct RouteLayer {
    registry: NodeRegistry,
}

impl RouteLayer {
    /// A layer that picks nodes from `registry`.
    pub fn new(registry: NodeRegistry) -> Self {
        Self { registry }
    }
}

impl<S> Layer<S> for RouteLayer {
    type Service = Route<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Route {
            inner,
            registry: self.registry.clone(),
        }
    }
}

/// Picks a node for each request and hands the request to the inner (transport) service.
///
/// Reads the model from the [`RequestPeek`] request extension, inserts the picked
/// [`NodeId`](spine_core::NodeId) into the request extensions, records it in the request's
/// [`NodeSlot`] extension when there is one (the metering layer reads it if the caller goes away
/// before the response head), and keeps the request counted in flight on that node until the
/// response body ends or is dropped.
///
/// # Errors
///
/// A [`RouteError`] (boxed) when no node can be picked; the inner service's error otherwise.
#[derive(Debug, Clone)]
pub struct Route<S> {
    inner: S,
    registry: NodeRegistry,
}

impl<S> Route<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, registry: NodeRegistry) -> Self {
        Self { inner, registry }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, E> Service<http::Request<BoxBody>> for Route<S>
where
    S: Service<http::Request<BoxBody>, Response = http::Response<BoxBody>, Error = E>,
    E: Into<BoxError>,
{
    type Response = http::Response<BoxBody>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: http::Request<BoxBody>) -> Self::Future {
        let lease = match req.extensions().get::<RequestPeek>() {
            None => Err(RouteError::MissingPeek),
            Some(peek) => self.registry.pick(&peek.model),
        };
        match lease {
            Ok(lease) => {
                tracing::debug!(node = %lease.node(), "routed");
                if let Some(slot) = req.extensions().get::<NodeSlot>() {
                    slot.set(lease.node().clone());
                }
                req.extensions_mut().insert(lease.node().clone());
                ResponseFuture {
                    state: State::Called {
                        fut: self.inner.call(req),
                        lease: Some(lease),
                    },
                }
            }
            Err(e) => ResponseFuture {
                state: State::Refused { error: Some(e) },
            },
        }
    }
}

pin_project_lite::pin_project! {
    /// Response future of [`Route`].
    pub struct ResponseFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<F> {
        Called { #[pin] fut: F, lease: Option<InFlightLease> },
        Refused { error: Option<RouteError> },
    }
}

impl<F> std::fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<F, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<http::Response<BoxBody>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<http::Response<BoxBody>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Refused { error } => Poll::Ready(Err(match error.take() {
                Some(e) => e.into(),
                None => "route future polled after completion".into(),
            })),
            StateProj::Called { fut, lease } => {
                let resp = match std::task::ready!(fut.poll(cx)) {
                    Ok(resp) => resp,
                    Err(e) => return Poll::Ready(Err(e.into())),
                };
                let Some(lease) = lease.take() else {
                    return Poll::Ready(Err("route future polled after completion".into()));
                };
                Poll::Ready(Ok(resp.map(|inner| {
                    BoxBody::new(LeasedBody {
                        inner,
                        _lease: lease,
                    })
                })))
            }
        }
    }
}

/// A response body that holds the node's in-flight lease until it ends or is dropped.
struct LeasedBody {
    inner: BoxBody,
    _lease: InFlightLease,
}

impl Body for LeasedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use http_body_util::{BodyExt, Full};
    use spine_core::{EngineKind, ModelDescriptor, ModelId, NodeDescriptor, NodeId};
    use tower::ServiceExt;

    fn body(s: &'static str) -> BoxBody {
        BoxBody::new(Full::new(Bytes::from(s)).map_err(|e| match e {}))
    }

    fn peek(model: &str) -> RequestPeek {
        RequestPeek {
            model: ModelId::new(model),
            stream: false,
            include_usage: false,
            n: 1,
            max_tokens: None,
            prompt_cache_key: None,
        }
    }

    #[tokio::test]
    async fn inserts_node_and_holds_lease_until_body_is_done() {
        let registry = NodeRegistry::new();
        registry.node_ready(
            &NodeId::new("n1"),
            &NodeDescriptor {
                engine: EngineKind::LlamaCpp,
                models: vec![ModelDescriptor {
                    id: ModelId::new("m"),
                    max_context_tokens: None,
                }],
                vram_mib: 0,
                max_concurrency: 1,
                agent_version: "t".into(),
            },
        );
        let inner = tower::service_fn(|req: http::Request<BoxBody>| async move {
            let node = req.extensions().get::<NodeId>().cloned().unwrap();
            Ok::<_, BoxError>(http::Response::new(body(if node.as_str() == "n1" {
                "ok"
            } else {
                "wrong"
            })))
        });
        let svc = RouteLayer::new(registry.clone()).layer(inner);
        let mut req = http::Request::new(body(""));
        req.extensions_mut().insert(peek("m"));
        let slot = NodeSlot::new();
        req.extensions_mut().insert(slot.clone());
        let resp = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(slot.get(), Some(NodeId::new("n1")));
        assert_eq!(registry.snapshot()[0].in_flight, 1);
        // capacity 1: a second request is refused while the first body is alive
        let mut req2 = http::Request::new(body(""));
        req2.extensions_mut().insert(peek("m"));
        let refused_slot = NodeSlot::new();
        req2.extensions_mut().insert(refused_slot.clone());
        let err = svc.clone().oneshot(req2).await.unwrap_err();
        assert_eq!(
            err.downcast_ref::<RouteError>(),
            Some(&RouteError::AtCapacity(ModelId::new("m")))
        );
        // no node picked: the slot stays empty
        assert_eq!(refused_slot.get(), None);
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], b"ok");
        assert_eq!(registry.snapshot()[0].in_flight, 0);

        let req3 = http::Request::new(body(""));
        let err = svc.oneshot(req3).await.unwrap_err();
        assert_eq!(
            err.downcast_ref::<RouteError>(),
            Some(&RouteError::MissingPeek)
        );
    }
}
