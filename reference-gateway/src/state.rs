//! Shared state of the gateway's HTTP handlers.

use std::sync::Arc;

use spine_core::ModelId;
use spine_meter::Store;
use spine_router::NodeRegistry;

use spine_meter::limits::RateLimits;

/// The spine service stack as the handlers call it: meter → route → tunnel.
pub(crate) type Stack = tower::util::BoxCloneSyncService<
    http::Request<spine_core::BoxBody>,
    http::Response<spine_core::BoxBody>,
    spine_core::BoxError,
>;

/// What the public and admin handlers share.
pub(crate) struct AppState {
    pub(crate) store: Arc<dyn Store>,
    /// The meter's remembered refusals for lack of credit, dropped when credit is added.
    pub(crate) credit_refusals: spine_meter::meter::CreditRefusals,
    /// Keys already found in `store` ([`KeyCache`](spine_meter::keys::KeyCache)).
    pub(crate) keys: spine_meter::keys::KeyCache,
    pub(crate) registry: NodeRegistry,
    /// The live tunnels (connected nodes, routable or still in their warm-up probe).
    pub(crate) tunnels: spine_transport::Tunnels,
    pub(crate) stack: Stack,
    pub(crate) catalog_ids: Vec<ModelId>,
    /// Reads a body the handlers read themselves (`/v1/responses`) within the meter's bounds.
    pub(crate) body_gate: spine_meter::meter::BodyGate,
    pub(crate) admin_token: String,
    /// Per-key RPM/TPM limits (TPM also sits in the stack as the meter's admission hook).
    pub(crate) limits: Arc<RateLimits>,
    /// Audits nodes' models (design brief §10), when a catalog model has a reference.
    pub(crate) auditor: Option<spine_meter::audit::Auditor>,
    /// Renders `GET /metrics`.
    pub(crate) metrics: metrics_exporter_prometheus::PrometheusHandle,
}

impl AppState {
    /// The audit states of `node` (one per audited model), `[]` when nothing is audited.
    pub(crate) fn audit_json(&self, node: &spine_core::NodeId) -> serde_json::Value {
        self.auditor.as_ref().map_or_else(
            || serde_json::json!([]),
            |a| serde_json::json!(a.statuses_of(node)),
        )
    }
}
