//! The node directory (design brief §3, §8): where is a node's tunnel — on this gateway
//! instance, on another one, or nowhere known.
//!
//! With several gateway instances every instance routes over every node of the cluster, but a
//! node's tunnel ends on one instance only. [`NodeDirectory`] answers where;
//! [`DirectoryDispatch`] is the tower service below [`Route`](crate::Route) that asks it and sends
//! the request to a *local* service (usually `spine_transport::TunnelService`) or to a *remote*
//! one (usually an HTTP/2 forwarder to the owning instance), which finds the owner in the
//! request's extensions as a [`RemoteOwner`].

use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use spine_core::{BoxError, NodeId};
use tower::{Service, ServiceExt};

/// A boxed future returned by [`NodeDirectory`].
pub type DirectoryFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send + 'a>>;

/// The instance holding a node's tunnel, as [`NodeDirectory::locate`] found it.
///
/// [`DirectoryDispatch`] puts it into the request's extensions before calling the remote
/// service.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RemoteOwner {
    /// The owning instance's id.
    pub instance: String,
    /// The address the remote service dials for it (e.g. `10.0.0.7:9443`).
    pub address: String,
}

impl RemoteOwner {
    /// The owner `instance`, reachable at `address`.
    pub fn new(instance: impl Into<String>, address: impl Into<String>) -> Self {
        Self {
            instance: instance.into(),
            address: address.into(),
        }
    }
}

/// Where a node's tunnel is.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NodeLocation {
    /// On this instance: the local service serves it.
    Local,
    /// On another instance, alive as far as the directory checked: the remote service serves
    /// it.
    Remote(RemoteOwner),
    /// Nowhere the directory knows (the node left, or its entry expired).
    Unknown,
}

/// Where each node's tunnel is, in a deployment of several gateway instances (e.g. a directory
/// kept in Redis; the reference gateway's `Cluster`).
///
/// One instance alone needs none: every routable node's tunnel is local.
pub trait NodeDirectory: Send + Sync + Debug {
    /// Where `node`'s tunnel is now.
    ///
    /// An implementation checks what it must before answering [`NodeLocation::Remote`] (the
    /// reference gateway reads the owner's liveness key), so that a dead owner fails at once
    /// rather than at a connect timeout.
    ///
    /// # Errors
    ///
    /// The owner is known to be gone, or the directory could not be asked. The error reaches the
    /// router unchanged, before any byte of the request left this instance: the application
    /// recognises it with [`RouteLayer::not_node_fault`](crate::RouteLayer::not_node_fault) so
    /// that the router retries another node without scoring this one.
    ///
    /// # Cancel safety
    ///
    /// [`DirectoryDispatch`] drops the future unfinished when the request's caller goes away; a
    /// lookup must leave the directory as it was.
    fn locate<'a>(&'a self, node: &'a NodeId) -> DirectoryFuture<'a, NodeLocation>;
}

/// Why [`DirectoryDispatch`] sent a request nowhere.
///
/// Neither is the node's fault: [`DirectoryError::not_node_fault`] says so to the router.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DirectoryError {
    /// The request carries no [`NodeId`] extension (the router always puts one).
    #[error("request names no node")]
    MissingNode,
    /// The directory does not know the node ([`NodeLocation::Unknown`]).
    #[error("node is not known to this instance")]
    UnknownNode(NodeId),
}

impl DirectoryError {
    /// Whether `err` is a [`DirectoryError`]: a request sent nowhere, which the router should
    /// retry on another node without scoring this one. For
    /// [`RouteLayer::not_node_fault`](crate::RouteLayer::not_node_fault), combined with the
    /// application's own checks.
    pub fn not_node_fault(err: &BoxError) -> bool {
        err.downcast_ref::<DirectoryError>().is_some()
    }
}

/// A boxed future returned by [`DirectoryDispatch`].
pub type DispatchFuture<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send>>;

/// A tower service that sends each request to where its node's tunnel is.
///
/// Reads the [`NodeId`] in the request's extensions (put there by [`Route`](crate::Route), as
/// `spine_transport::TunnelService` reads it), asks the [`NodeDirectory`], then
/// - [`NodeLocation::Local`] → calls the local service `L`;
/// - [`NodeLocation::Remote`] → inserts the [`RemoteOwner`] into the request's extensions and
///   calls the remote service `R`;
/// - [`NodeLocation::Unknown`] → fails with [`DirectoryError::UnknownNode`].
///
/// Errors: the directory's own error unchanged, [`DirectoryError`], or the called service's
/// error boxed. A response carries the [`NodeId`] extension.
///
/// Always ready: each call drives a clone of the chosen service with
/// [`ServiceExt::oneshot`] (readiness is per node, and the node is known only per request).
#[derive(Clone, Debug)]
pub struct DirectoryDispatch<L, R> {
    directory: Arc<dyn NodeDirectory>,
    local: L,
    remote: R,
}

impl<L, R> DirectoryDispatch<L, R> {
    /// Dispatches over `directory` to `local` and `remote`.
    pub fn new(directory: Arc<dyn NodeDirectory>, local: L, remote: R) -> Self {
        Self {
            directory,
            local,
            remote,
        }
    }
}

impl<L, R, B, RB> Service<http::Request<B>> for DirectoryDispatch<L, R>
where
    L: Service<http::Request<B>, Response = http::Response<RB>> + Clone + Send + 'static,
    L::Error: Into<BoxError>,
    L::Future: Send,
    R: Service<http::Request<B>, Response = http::Response<RB>> + Clone + Send + 'static,
    R::Error: Into<BoxError>,
    R::Future: Send,
    B: Send + 'static,
    RB: Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = BoxError;
    type Future = DispatchFuture<http::Response<RB>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let directory = Arc::clone(&self.directory);
        let local = self.local.clone();
        let remote = self.remote.clone();
        Box::pin(async move {
            let Some(node) = req.extensions().get::<NodeId>().cloned() else {
                return Err(DirectoryError::MissingNode.into());
            };
            let mut resp = match directory.locate(&node).await? {
                NodeLocation::Local => local.oneshot(req).await.map_err(Into::into)?,
                NodeLocation::Remote(owner) => {
                    req.extensions_mut().insert(owner);
                    remote.oneshot(req).await.map_err(Into::into)?
                }
                NodeLocation::Unknown => return Err(DirectoryError::UnknownNode(node).into()),
            };
            resp.extensions_mut().insert(node);
            Ok(resp)
        })
    }
}

#[cfg(test)]
mod tests;
