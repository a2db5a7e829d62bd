//! Shared state of the gateway's HTTP handlers.

use std::sync::Arc;

use spine_core::{ModelId, NodeId};
use spine_meter::enroll::{LiveNode, LiveNodes, NodeEnrollment};
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
    /// Node enrollment and the nodes' status (`spine_meter::enroll`) over [`Live`].
    pub(crate) enrollment: NodeEnrollment,
}

/// What is live now for the enrollment handlers: the router's routable nodes and the tunnels
/// (connected, routable or still in their warm-up probe).
pub(crate) struct Live {
    pub(crate) registry: NodeRegistry,
    pub(crate) tunnels: spine_transport::Tunnels,
}

impl LiveNodes for Live {
    fn live(&self, nodes: &[NodeId]) -> Vec<LiveNode> {
        let routable = self.registry.snapshot();
        let advertised = self.tunnels.connected();
        let ids =
            |models: &[spine_core::ModelDescriptor]| models.iter().map(|m| m.id.clone()).collect();
        nodes
            .iter()
            .map(|node| {
                let snap = routable.iter().find(|s| s.node_id == *node);
                LiveNode {
                    connected: self.tunnels.contains(node),
                    routable: snap.is_some(),
                    // the registry holds only the catalog models (main.rs `RegistryEvents`); the
                    // tunnel keeps what the node advertised
                    routed_models: snap.map(|s| ids(&s.descriptor.models)).unwrap_or_default(),
                    advertised_models: advertised
                        .iter()
                        .find(|(n, _)| n == node)
                        .map(|(_, d)| ids(&d.models))
                        .unwrap_or_default(),
                    in_flight: snap.map_or(0, |s| s.in_flight),
                }
            })
            .collect()
    }
}
