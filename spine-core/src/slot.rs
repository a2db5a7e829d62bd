use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::NodeId;

/// A shared slot for the node a request was handed to.
///
/// The metering layer puts one into the request extensions before calling the router; the router
/// fills it when it picks a node. The metering layer keeps a clone, so it knows the node even when
/// the caller goes away before the node's response head arrives (design brief §6: a request that
/// reached a node is never free). Cheap to clone: every clone shares the same slot.
///
/// It also carries the metering layer's verdict back to the router: when the metering layer
/// finds that the node's answer broke the rules (an SSE event that is not one JSON chunk, an
/// event over the size cap, a choice past its token cap), it calls
/// [`NodeSlot::report_node_fault`] before it stops reading, and the router scores the attempt as
/// the node's failure instead of a caller that went away.
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
pub struct NodeSlot(Arc<SlotInner>);

/// What the router runs when a node fault is reported: scores the attempt.
type FaultHook = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct SlotInner {
    node: Mutex<Option<NodeId>>,
    fault: AtomicBool,
    on_fault: Mutex<Option<FaultHook>>,
}

impl std::fmt::Debug for SlotInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeSlot")
            .field("node", &self.node)
            .field("fault", &self.fault)
            .finish_non_exhaustive()
    }
}

impl NodeSlot {
    /// An empty slot.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `node`, replacing any node recorded before.
    pub fn set(&self, node: NodeId) {
        *self.0.node.lock().unwrap_or_else(PoisonError::into_inner) = Some(node);
    }

    /// The node's answer broke the rules (see the type's docs): the router scores the attempt
    /// as the node's failure. Sticky: once reported, it stays reported.
    ///
    /// Runs the hook set with [`NodeSlot::on_node_fault`] (once, on the first report).
    pub fn report_node_fault(&self) {
        if self.0.fault.swap(true, Ordering::AcqRel) {
            return;
        }
        let hook = self
            .0
            .on_fault
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(hook) = hook {
            hook();
        }
    }

    /// Sets what a later [`NodeSlot::report_node_fault`] runs (the router: score the committed
    /// attempt as a failure), replacing an earlier hook. Runs at once when a fault was already
    /// reported.
    pub fn on_node_fault(&self, hook: impl FnOnce() + Send + 'static) {
        if self.node_fault_reported() {
            hook();
            return;
        }
        *self
            .0
            .on_fault
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Box::new(hook));
        // a report that raced with the store above: run the hook now if it is still there
        if self.node_fault_reported() {
            let hook = self
                .0
                .on_fault
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some(hook) = hook {
                hook();
            }
        }
    }

    /// Whether [`NodeSlot::report_node_fault`] was called on any clone.
    pub fn node_fault_reported(&self) -> bool {
        self.0.fault.load(Ordering::Acquire)
    }

    /// The node recorded, if any.
    pub fn get(&self) -> Option<NodeId> {
        self.0
            .node
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
mod tests;
