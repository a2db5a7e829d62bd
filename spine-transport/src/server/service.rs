use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Request, Response};
use spine_core::{BoxBody, NodeId};

use super::Tunnels;
use crate::TunnelError;

/// A tower service that sends each request down the tunnel of the node named in its extensions.
///
/// The target is the [`NodeId`] in the request's extensions (the routing layer puts it there);
/// the same `NodeId` is inserted into the response's extensions.
#[derive(Clone, Debug)]
pub struct TunnelService {
    pub(super) tunnels: Tunnels,
}

impl TunnelService {
    /// A service over `tunnels`.
    pub fn new(tunnels: Tunnels) -> Self {
        Self { tunnels }
    }
}

impl tower::Service<Request<BoxBody>> for TunnelService {
    type Response = Response<BoxBody>;
    type Error = TunnelError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<BoxBody>, TunnelError>> + Send>>;

    /// Always ready: capacity is per node, and the node is known only per request.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<BoxBody>) -> Self::Future {
        let tunnels = self.tunnels.clone();
        Box::pin(async move {
            let Some(node) = req.extensions().get::<NodeId>().cloned() else {
                return Err(TunnelError::missing_target());
            };
            let mut resp = tunnels.send(&node, req).await?;
            resp.extensions_mut().insert(node);
            Ok(resp)
        })
    }
}
