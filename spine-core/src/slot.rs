use std::sync::{Arc, Mutex, PoisonError};

use crate::NodeId;

/// A shared slot for the node a request was handed to.
///
/// The metering layer puts one into the request extensions before calling the router; the router
/// fills it when it picks a node. The metering layer keeps a clone, so it knows the node even when
/// the caller goes away before the node's response head arrives (design brief §6: a request that
/// reached a node is never free). Cheap to clone: every clone shares the same slot.
///
/// ```
/// use spine_core::{NodeId, NodeSlot};
///
/// let slot = NodeSlot::new();
/// let router_side = slot.clone();
/// assert_eq!(slot.get(), None);
/// router_side.set(NodeId::new("node_1"));
/// assert_eq!(slot.get(), Some(NodeId::new("node_1")));
/// ```
#[derive(Clone, Debug, Default)]
pub struct NodeSlot(Arc<Mutex<Option<NodeId>>>);

impl NodeSlot {
    /// An empty slot.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `node`, replacing any node recorded before.
    pub fn set(&self, node: NodeId) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(node);
    }

    /// The node recorded, if any.
    pub fn get(&self) -> Option<NodeId> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The prompt's token count as the metering layer measured it: the longest prompt of the request
/// (the one that must fit a node's context window). The metering layer puts it into the request
/// extensions before calling the router, which routes only to nodes whose context holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PromptTokens(pub u64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_one_slot_and_set_replaces() {
        let a = NodeSlot::new();
        let b = a.clone();
        assert_eq!(b.get(), None);
        a.set(NodeId::new("n1"));
        assert_eq!(b.get(), Some(NodeId::new("n1")));
        b.set(NodeId::new("n2"));
        assert_eq!(a.get(), Some(NodeId::new("n2")));
        // an unrelated slot stays empty
        assert_eq!(NodeSlot::new().get(), None);
    }
}
