//! A node as an admin API lists it.

use serde::Serialize;
use spine_core::{EngineKind, ModelDescriptor, NodeId};

use super::NodeSnapshot;
use crate::score::ScoreParts;

/// One routable node in the shape the reference gateway's `GET /admin/v1/nodes` lists it
/// ([`NodeSnapshot::view`]): what it said in its handshake, its requests in flight and usage
/// discrepancies, and the routing state (design brief §5): the score, its parts, the pick
/// weight, attempts, failures, disconnects and sticky statistics. `extra` (flattened at the
/// end) carries what other crates know of the node: the gateway adds its tunnel's state
/// (spine-transport) and its model audits (spine-meter).
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct NodeView<'a, E: Serialize> {
    /// The node.
    pub node_id: &'a NodeId,
    /// Always `routable`: only routable nodes are in the registry.
    pub state: &'static str,
    /// Its engine.
    pub engine: &'a EngineKind,
    /// The catalog models it is routed for.
    pub models: &'a [ModelDescriptor],
    /// Its self-reported VRAM, MiB.
    pub vram_mib: u64,
    /// The concurrency the tunnel enforces (the node's claim).
    pub max_concurrency: u32,
    /// The concurrency it is routed by: learned, at most `max_concurrency` (lowered when it
    /// shows overload).
    pub concurrency_limit: u32,
    /// The agent's version.
    pub agent_version: &'a str,
    /// Requests in flight on it through this gateway.
    pub in_flight: u32,
    /// Usage discrepancies recorded against it since the gateway started.
    pub discrepancies: u64,
    /// Its score now, 0..=1.
    pub score: f64,
    /// The score's parts.
    pub score_parts: &'a ScoreParts,
    /// Its relative chance in a pick.
    pub weight: f64,
    /// Attempts sent to it.
    pub attempts: u64,
    /// Attempts that failed.
    pub failures: u64,
    /// Mid-request disconnects.
    pub disconnects: u64,
    /// Conversation affinity: `hits`, `misses`, `affinity_entries`.
    pub sticky: StickyView,
    /// What the application adds (flattened; an object).
    #[serde(flatten)]
    pub extra: E,
}

/// The sticky statistics of a [`NodeView`].
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StickyView {
    /// Requests routed here because their conversation was sticky to this node.
    pub hits: u64,
    /// Keyed requests whose sticky node was this one but could not take them.
    pub misses: u64,
    /// Live affinity entries pointing at this node.
    pub affinity_entries: u64,
}

impl NodeSnapshot {
    /// This node as an admin API lists it, with `extra` (an object: its members are appended).
    pub fn view<E: Serialize>(&self, extra: E) -> NodeView<'_, E> {
        NodeView {
            node_id: &self.node_id,
            state: "routable",
            engine: &self.descriptor.engine,
            models: &self.descriptor.models,
            vram_mib: self.descriptor.vram_mib,
            max_concurrency: self.descriptor.max_concurrency,
            concurrency_limit: self.concurrency_limit,
            agent_version: &self.descriptor.agent_version,
            in_flight: self.in_flight,
            discrepancies: self.discrepancies,
            score: self.score.score,
            score_parts: &self.score,
            weight: self.weight,
            attempts: self.attempts,
            failures: self.failures,
            disconnects: self.disconnects,
            sticky: StickyView {
                hits: self.sticky_hits,
                misses: self.sticky_misses,
                affinity_entries: self.affinity_entries,
            },
            extra,
        }
    }
}
