use spine_core::{NodeDescriptor, NodeId};

/// Tunnel lifecycle notifications, for the router's registry.
///
/// For one node, `node_ready` and `node_gone` alternate: `node_ready` (routable), then
/// `node_gone` (not routable: the tunnel closed, was found dead, was taken over by a new session,
/// or its health probes failed), then `node_ready` again (probes recovered, or a new session
/// warmed up). Both are called while the tunnel server holds its session table's lock, which is
/// what keeps them ordered: keep them short, non-blocking, and never call back into
/// [`Tunnels`] from them.
///
/// [`Tunnels`]: super::Tunnels
pub trait TunnelEvents: Send + Sync + 'static {
    /// The node's tunnel is up and its health probe through the tunnel (`GET /health`)
    /// returned 2xx: the node may be routed to (design brief §4). `descriptor` is the one the
    /// node sent, except that its `max_concurrency` is clamped to the tunnel's stream limit
    /// (`min(advertised, max_streams_per_node)`, at least 1), so a router admitting up to it
    /// never sends a request the tunnel refuses as full.
    fn node_ready(&self, node: &NodeId, descriptor: &NodeDescriptor);

    /// The node may no longer be routed to; called once after each `node_ready`.
    fn node_gone(&self, node: &NodeId);

    /// Liveness of `node` was just confirmed: a health probe passed or a response head came
    /// back through its tunnel. At most about once per second per node; never before the
    /// node's first `node_ready`. For a reliability score's uptime part. Default: ignored.
    fn node_heartbeat(&self, node: &NodeId) {
        let _ = node;
    }
}

/// Ignores every event.
impl TunnelEvents for () {
    fn node_ready(&self, _node: &NodeId, _descriptor: &NodeDescriptor) {}
    fn node_gone(&self, _node: &NodeId) {}
}
