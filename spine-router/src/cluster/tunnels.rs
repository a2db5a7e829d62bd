//! A gateway's tunnels wired to the router: [`RegistryEvents`] (the tunnel's lifecycle feeding
//! the registry and, with several instances, the shared directory), [`tunnel_route_layer`]
//! (the tunnels' and the cluster's failures sorted for routing) and [`tunnel_dispatch`].

use std::sync::{Arc, OnceLock};

use spine_core::{ModelId, NodeDescriptor, NodeId};
use spine_transport::TunnelEvents;

use super::Cluster;
use crate::NodeRegistry;

/// The tunnel's [`TunnelEvents`] as the registry's: a ready node is registered with only the
/// catalog models its engine serves (the others could never be billed), a gone node leaves,
/// and each heartbeat confirms it. Once the instance has joined a cluster (the slot is set;
/// tunnels are accepted only after that) local nodes are also published in, and withdrawn
/// from, the shared directory, with their whole descriptor: each instance filters by its own
/// catalog.
#[derive(Clone)]
pub struct RegistryEvents {
    registry: NodeRegistry,
    catalog: Vec<ModelId>,
    cluster: Arc<OnceLock<Cluster>>,
}

impl RegistryEvents {
    /// Events into `registry` for the models of `catalog`; `cluster`, once set, publishes too
    /// (leave it empty on one instance).
    pub fn new(
        registry: NodeRegistry,
        catalog: Vec<ModelId>,
        cluster: Arc<OnceLock<Cluster>>,
    ) -> Self {
        Self {
            registry,
            catalog,
            cluster,
        }
    }
}

impl std::fmt::Debug for RegistryEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryEvents")
            .field("catalog", &self.catalog)
            .field("cluster", &self.cluster.get().is_some())
            .finish_non_exhaustive()
    }
}

impl TunnelEvents for RegistryEvents {
    fn node_ready(&self, node: &NodeId, descriptor: &NodeDescriptor) {
        let mut listed = descriptor.clone();
        listed.models.retain(|m| self.catalog.contains(&m.id));
        self.registry.node_ready(node, &listed);
        if let Some(cluster) = self.cluster.get() {
            cluster.local_ready(node, descriptor);
        }
    }

    fn node_gone(&self, node: &NodeId) {
        self.registry.node_gone(node);
        if let Some(cluster) = self.cluster.get() {
            cluster.local_gone(node);
        }
    }

    fn node_heartbeat(&self, node: &NodeId) {
        self.registry.heartbeat(node);
    }
}

/// The gateway's route layer over tunnels, one instance or several: the router's
/// [`RouteLayer`](crate::RouteLayer) with the tunnels' and the cluster's failures sorted, and,
/// with a cluster, the affinity table shared in Redis (`affinity_ttl_secs`).
///
/// - Not the node's fault (retried, not scored): a node at the tunnel's per-node stream limit
///   (the gateway's own limit), and a remote node's owner gone or unreachable
///   ([`ClusterError::not_node_fault`](super::ClusterError::not_node_fault)).
/// - Momentarily full (the same node is picked again after a short pause): a stream slot
///   released a moment late, an HTTP/2 `REFUSED_STREAM`, or the owner's `node_full`.
pub fn tunnel_route_layer(
    registry: NodeRegistry,
    cluster: Option<&Cluster>,
    affinity_ttl_secs: u64,
) -> crate::RouteLayer {
    use spine_transport::TunnelError;
    let mut route = crate::RouteLayer::new(registry)
        .not_node_fault(|e| {
            e.downcast_ref::<TunnelError>()
                .is_some_and(TunnelError::is_node_full)
                || super::ClusterError::not_node_fault(e)
        })
        .node_full(|e| {
            e.downcast_ref::<TunnelError>()
                .is_some_and(|e| e.is_node_full() || e.is_stream_refused())
                || super::ClusterError::is_node_full(e)
        });
    if let Some(cluster) = cluster {
        let affinity = super::RedisAffinity::new(cluster.clone(), affinity_ttl_secs);
        route = route.affinity_store(Arc::new(affinity));
    }
    route
}

/// The service below the router: with a cluster, its dispatch (a local node's tunnel, or the
/// forwarder to a remote node's owner, [`cluster_service`](super::cluster_service)); else the
/// local tunnels alone.
pub fn tunnel_dispatch(
    cluster: Option<&Cluster>,
    tunnels: &spine_transport::Tunnels,
) -> tower::util::BoxCloneSyncService<
    http::Request<spine_core::BoxBody>,
    http::Response<spine_core::BoxBody>,
    spine_core::BoxError,
> {
    use tower::ServiceExt as _;
    match cluster {
        Some(cluster) => tower::util::BoxCloneSyncService::new(super::cluster_service(cluster)),
        None => tower::util::BoxCloneSyncService::new(
            spine_transport::TunnelService::new(tunnels.clone())
                .map_err(spine_core::BoxError::from),
        ),
    }
}

/// Why an instance could not join ([`join`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JoinError {
    /// `redis_url` is not a Redis URL.
    #[error("redis_url")]
    RedisUrl(#[source] redis::RedisError),
    /// The internal listener could not be bound.
    #[error(transparent)]
    Bind(#[from] std::io::Error),
}

/// Joins the cluster as [`Cluster::start`] does (the series described first,
/// [`describe`](super::describe)), with the internal listener bound at
/// `config.internal_listen` ([`spine_transport::bind_listener`]) and advertised at
/// `internal_advertise`, else its bound address; forwarded bodies are bounded at
/// `max_request_body_bytes`. Returns the cluster and the internal listener to serve
/// ([`serve_internal`](super::serve_internal)). A Redis that does not answer is logged, not
/// an error.
///
/// # Errors
///
/// [`JoinError`]: a `redis_url` that does not parse, a listener that cannot be bound.
///
/// # Cancel safety
///
/// As [`Cluster::start`].
pub async fn join(
    config: &super::ClusterConfig,
    registry: NodeRegistry,
    catalog: Vec<ModelId>,
    tunnels: spine_transport::Tunnels,
    max_request_body_bytes: usize,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(Cluster, tokio::net::TcpListener), JoinError> {
    super::describe();
    let redis = super::connect_redis(&config.redis_url).map_err(JoinError::RedisUrl)?;
    let internal = spine_transport::bind_listener(config.internal_listen)?;
    let internal_addr = match &config.internal_advertise {
        Some(a) => a.clone(),
        None => internal.local_addr()?.to_string(),
    };
    let cluster = Cluster::start(
        config,
        redis,
        internal_addr,
        registry,
        catalog,
        tunnels,
        shutdown,
    )
    .await;
    cluster.set_max_request_body_bytes(max_request_body_bytes);
    if cluster.redis_down() {
        tracing::warn!("Redis unreachable at start; serving local nodes until it answers");
    }
    tracing::info!(instance_id = cluster.instance_id(), "multi-instance mode");
    Ok((cluster, internal))
}
