use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};

use rand::Rng;
use serde::Serialize;
use spine_core::{ModelId, NodeDescriptor, NodeId};

/// Why no node could be picked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouteError {
    /// The request carries no [`RequestPeek`](spine_core::RequestPeek) extension: the metering
    /// layer must run before routing.
    #[error("request has no peeked model; the metering layer must run before routing")]
    MissingPeek,
    /// No routable node serves this model.
    #[error("no node serves model '{0}'")]
    NoNodeForModel(ModelId),
    /// Nodes serve the model but all of them are at their concurrency limit.
    #[error("all nodes serving model '{0}' are at capacity")]
    AtCapacity(ModelId),
}

#[derive(Debug)]
struct NodeEntry {
    descriptor: NodeDescriptor,
    in_flight: Arc<AtomicU32>,
}

/// The nodes this gateway instance can route to.
///
/// Cheap to clone (shared state). All methods are synchronous and never block on I/O; the lock is
/// held only for map operations.
#[derive(Debug, Clone, Default)]
pub struct NodeRegistry {
    nodes: Arc<RwLock<HashMap<NodeId, NodeEntry>>>,
    /// Usage discrepancies per node since this process started; kept across reconnects.
    discrepancies: Arc<RwLock<HashMap<NodeId, u64>>>,
}

/// A point-in-time view of one node, for admin APIs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeSnapshot {
    /// The node.
    pub node_id: NodeId,
    /// What the node said about itself in its handshake.
    pub descriptor: NodeDescriptor,
    /// Requests currently being served by the node through this gateway.
    pub in_flight: u32,
    /// Usage discrepancies recorded against the node since the gateway started
    /// ([`NodeRegistry::record_discrepancy`]).
    pub discrepancies: u64,
}

/// One request counted against a node's capacity; the count drops when this is dropped.
#[derive(Debug)]
pub struct InFlightLease {
    node: NodeId,
    counter: Arc<AtomicU32>,
}

impl InFlightLease {
    /// The node this lease is for.
    pub fn node(&self) -> &NodeId {
        &self.node
    }
}

impl Drop for InFlightLease {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::AcqRel);
    }
}

impl NodeRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `node` routable with `descriptor`, replacing what was known about it.
    ///
    /// Requests already in flight on the node keep counting against it.
    pub fn node_ready(&self, node: &NodeId, descriptor: &NodeDescriptor) {
        let mut nodes = self.nodes.write().unwrap_or_else(|e| e.into_inner());
        let in_flight = nodes
            .get(node)
            .map(|e| e.in_flight.clone())
            .unwrap_or_default();
        nodes.insert(
            node.clone(),
            NodeEntry {
                descriptor: descriptor.clone(),
                in_flight,
            },
        );
        tracing::info!(node = %node, models = descriptor.models.len(), "node routable");
    }

    /// Removes `node` from routing.
    pub fn node_gone(&self, node: &NodeId) {
        let removed = self
            .nodes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(node);
        if removed.is_some() {
            tracing::info!(node = %node, "node no longer routable");
        }
    }

    /// Models served by at least one routable node, sorted.
    pub fn models(&self) -> Vec<ModelId> {
        let nodes = self.nodes.read().unwrap_or_else(|e| e.into_inner());
        let mut models: Vec<ModelId> = nodes
            .values()
            .flat_map(|e| e.descriptor.models.iter().map(|m| m.id.clone()))
            .collect();
        models.sort();
        models.dedup();
        models
    }

    /// Records that `node`'s usage claim disagreed with the independent count beyond the
    /// tolerance (design brief §5, §6: it feeds the node's score). Counted whether or not the
    /// node is routable now.
    pub fn record_discrepancy(&self, node: &NodeId) {
        *self
            .discrepancies
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .entry(node.clone())
            .or_default() += 1;
    }

    /// Usage discrepancies recorded against `node` since the gateway started.
    pub fn discrepancies(&self, node: &NodeId) -> u64 {
        self.discrepancies
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(node)
            .copied()
            .unwrap_or(0)
    }

    /// Every routable node, sorted by id.
    pub fn snapshot(&self) -> Vec<NodeSnapshot> {
        let nodes = self.nodes.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<NodeSnapshot> = nodes
            .iter()
            .map(|(id, e)| NodeSnapshot {
                node_id: id.clone(),
                descriptor: e.descriptor.clone(),
                in_flight: e.in_flight.load(Ordering::Acquire),
                discrepancies: self.discrepancies(id),
            })
            .collect();
        out.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        out
    }

    /// Picks a routable node that serves `model` and has free capacity, uniformly at random, and
    /// counts one request in flight on it until the returned lease is dropped.
    ///
    /// # Errors
    ///
    /// [`RouteError::NoNodeForModel`] when no routable node serves the model,
    /// [`RouteError::AtCapacity`] when all that do are at their `max_concurrency`.
    pub fn pick(&self, model: &ModelId) -> Result<InFlightLease, RouteError> {
        let nodes = self.nodes.read().unwrap_or_else(|e| e.into_inner());
        let serving: Vec<(&NodeId, &NodeEntry)> = nodes
            .iter()
            .filter(|(_, e)| e.descriptor.serves(model))
            .collect();
        if serving.is_empty() {
            return Err(RouteError::NoNodeForModel(model.clone()));
        }
        let mut free: Vec<(&NodeId, &NodeEntry)> = serving
            .into_iter()
            .filter(|(_, e)| e.in_flight.load(Ordering::Acquire) < e.descriptor.max_concurrency)
            .collect();
        // Try in random order; a compare-and-swap loses only to a concurrent pick of the same node.
        while !free.is_empty() {
            let i = rand::rng().random_range(0..free.len());
            let (id, entry) = free.swap_remove(i);
            let max = entry.descriptor.max_concurrency;
            let reserved = entry
                .in_flight
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < max).then_some(n + 1)
                })
                .is_ok();
            if reserved {
                return Ok(InFlightLease {
                    node: id.clone(),
                    counter: entry.in_flight.clone(),
                });
            }
        }
        Err(RouteError::AtCapacity(model.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spine_core::{EngineKind, ModelDescriptor};

    fn desc(models: &[&str], max_concurrency: u32) -> NodeDescriptor {
        NodeDescriptor {
            engine: EngineKind::LlamaCpp,
            models: models
                .iter()
                .map(|m| ModelDescriptor {
                    id: ModelId::new(*m),
                    max_context_tokens: None,
                })
                .collect(),
            vram_mib: 0,
            max_concurrency,
            agent_version: "test".into(),
        }
    }

    #[test]
    fn picks_only_nodes_serving_the_model() {
        let r = NodeRegistry::new();
        r.node_ready(&NodeId::new("a"), &desc(&["m1"], 4));
        r.node_ready(&NodeId::new("b"), &desc(&["m2"], 4));
        for _ in 0..50 {
            let lease = r.pick(&ModelId::new("m2"));
            assert_eq!(lease.map(|l| l.node().clone()), Ok(NodeId::new("b")));
        }
        assert_eq!(
            r.pick(&ModelId::new("m3")).map(|l| l.node().clone()),
            Err(RouteError::NoNodeForModel(ModelId::new("m3")))
        );
        assert_eq!(r.models(), vec![ModelId::new("m1"), ModelId::new("m2")]);
    }

    #[test]
    fn capacity_is_enforced_and_released() {
        let r = NodeRegistry::new();
        r.node_ready(&NodeId::new("a"), &desc(&["m"], 2));
        let l1 = r.pick(&ModelId::new("m"));
        let l2 = r.pick(&ModelId::new("m"));
        assert!(l1.is_ok() && l2.is_ok());
        assert_eq!(
            r.pick(&ModelId::new("m")).map(|l| l.node().clone()),
            Err(RouteError::AtCapacity(ModelId::new("m")))
        );
        assert_eq!(r.snapshot()[0].in_flight, 2);
        drop(l1);
        assert_eq!(r.snapshot()[0].in_flight, 1);
        assert!(r.pick(&ModelId::new("m")).is_ok());
    }

    #[test]
    fn gone_nodes_are_not_picked() {
        let r = NodeRegistry::new();
        r.node_ready(&NodeId::new("a"), &desc(&["m"], 2));
        r.node_gone(&NodeId::new("a"));
        assert_eq!(
            r.pick(&ModelId::new("m")).map(|l| l.node().clone()),
            Err(RouteError::NoNodeForModel(ModelId::new("m")))
        );
        assert!(r.snapshot().is_empty());
    }

    #[test]
    fn both_nodes_get_traffic() {
        let r = NodeRegistry::new();
        r.node_ready(&NodeId::new("a"), &desc(&["m"], 1000));
        r.node_ready(&NodeId::new("b"), &desc(&["m"], 1000));
        let mut a = 0;
        let mut leases = Vec::new();
        for _ in 0..400 {
            let lease = r.pick(&ModelId::new("m"));
            if lease
                .as_ref()
                .map(|l| l.node().as_str() == "a")
                .unwrap_or(false)
            {
                a += 1;
            }
            leases.push(lease);
        }
        // 400 fair coin flips: P(outside 140..=260) < 1e-9
        assert!((140..=260).contains(&a), "a got {a} of 400");
    }

    #[test]
    fn discrepancies_are_counted_per_node_across_reconnects() {
        let r = NodeRegistry::new();
        let a = NodeId::new("a");
        r.node_ready(&a, &desc(&["m"], 1));
        r.record_discrepancy(&a);
        r.record_discrepancy(&a);
        r.record_discrepancy(&NodeId::new("b"));
        assert_eq!(r.snapshot()[0].discrepancies, 2);
        r.node_gone(&a);
        r.node_ready(&a, &desc(&["m"], 1));
        assert_eq!(r.snapshot()[0].discrepancies, 2);
        assert_eq!(r.discrepancies(&NodeId::new("b")), 1);
        assert_eq!(r.discrepancies(&NodeId::new("c")), 0);
    }
}
