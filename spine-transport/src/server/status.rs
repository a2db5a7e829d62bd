use spine_core::ModelId;

/// Where a tunnel stands, as shown in [`TunnelStatus::state`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TunnelState {
    /// Accepted; no health probe has passed yet (not routable).
    Warming,
    /// The last health probes passed: routable.
    Ready,
    /// Was ready, then `health_failures_to_leave` probes in a row failed (not routable; probing
    /// continues).
    Unhealthy,
}

/// One model of a node, as its last health probe saw it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ModelStatus {
    /// The model id, as in the node's descriptor.
    pub model: ModelId,
    /// Whether the engine is up and lists this model in `GET /v1/models` (when the engine's
    /// model list cannot be read, whether the engine's health probe passed).
    pub running: bool,
}

/// A node's tunnel as the gateway sees it ([`Tunnels::status`]); serialises to JSON for admin
/// APIs.
///
/// [`Tunnels::status`]: super::Tunnels::status
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct TunnelStatus {
    /// Warming, ready or unhealthy.
    pub state: TunnelState,
    /// When the tunnel was accepted, milliseconds since the Unix epoch.
    pub connected_at_unix_ms: u64,
    /// When a health probe last passed, milliseconds since the Unix epoch.
    pub last_probe_ok_unix_ms: Option<u64>,
    /// Health probes failed in a row since the last one that passed.
    pub consecutive_probe_failures: u32,
    /// HTTP/2 streams open now (requests in flight through this tunnel).
    pub streams_open: u32,
    /// The per-node stream limit the gateway enforces.
    pub max_streams: u32,
    /// Per-model running status.
    pub models: Vec<ModelStatus>,
}
