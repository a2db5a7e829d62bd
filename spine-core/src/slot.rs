use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
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

/// Why the metering layer judged a committed answer the node's fault: tells the router how to
/// score the attempt (design brief §5, "what feeds the score").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NodeFault {
    /// The answer broke the rules (an SSE event that is not one JSON chunk, an event over the
    /// size cap, a choice past its token cap, an invalid body): scored as a failed attempt.
    Broke,
    /// The stream kept its connection alive (comments, empty deltas, role-only or usage
    /// chunks) but made no progress for the stall bound: scored as a mid-request disconnect.
    Stalled,
}

impl NodeFault {
    fn to_u8(self) -> u8 {
        match self {
            Self::Broke => 1,
            Self::Stalled => 2,
        }
    }

    fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::Broke),
            2 => Some(Self::Stalled),
            _ => None,
        }
    }
}

/// What the router runs when a node fault is reported: scores the attempt.
type FaultHook = Box<dyn FnOnce(NodeFault) + Send>;

/// What the router runs when a stream's longest pause is reported.
type PauseHook = Box<dyn FnOnce(std::time::Duration) + Send>;

#[derive(Default)]
struct SlotInner {
    node: Mutex<Option<NodeId>>,
    /// The recorded node's context window for the request's model; 0: unknown.
    context_tokens: AtomicU64,
    /// 0: no fault; else [`NodeFault::to_u8`] of the first one reported.
    fault: AtomicU8,
    on_fault: Mutex<Option<FaultHook>>,
    on_pause: Mutex<Option<PauseHook>>,
    /// The longest pause reported, µs + 1 (0: none reported).
    pause_us: AtomicU64,
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

    /// Records the context window the recorded node reports for the request's model (`None`:
    /// unknown), replacing any recorded before: the metering layer caps each choice's
    /// completion by it, as it caps it by the catalog's (an engine's slot that fills ends the
    /// choice with `length` before `max_tokens`).
    pub fn set_context_tokens(&self, tokens: Option<u64>) {
        self.0
            .context_tokens
            .store(tokens.unwrap_or(0), Ordering::Release);
    }

    /// The context window recorded with [`NodeSlot::set_context_tokens`], if known.
    pub fn context_tokens(&self) -> Option<u64> {
        Some(self.0.context_tokens.load(Ordering::Acquire)).filter(|t| *t > 0)
    }

    /// The node's answer broke the rules (see the type's docs): the router scores the attempt
    /// as the node's failure. Sticky: once reported, it stays reported.
    ///
    /// Same as [`NodeSlot::report`] with [`NodeFault::Broke`].
    pub fn report_node_fault(&self) {
        self.report(NodeFault::Broke);
    }

    /// Reports a node fault of the given kind. Sticky: only the first report counts (its kind
    /// is the one [`NodeSlot::node_fault`] gives and the hook gets).
    ///
    /// Runs the hook set with [`NodeSlot::on_node_fault`] (once, on the first report).
    pub fn report(&self, fault: NodeFault) {
        if self
            .0
            .fault
            .compare_exchange(0, fault.to_u8(), Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        self.run_hook(fault);
    }

    /// Sets what a later [`NodeSlot::report`] runs (the router: score the committed attempt
    /// by the fault's kind), replacing an earlier hook. Runs at once when a fault was already
    /// reported.
    pub fn on_node_fault(&self, hook: impl FnOnce(NodeFault) + Send + 'static) {
        if let Some(fault) = self.node_fault() {
            hook(fault);
            return;
        }
        *self
            .0
            .on_fault
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Box::new(hook));
        // a report that raced with the store above: run the hook now if it is still there
        if let Some(fault) = self.node_fault() {
            self.run_hook(fault);
        }
    }

    /// Takes the hook set with [`NodeSlot::on_node_fault`], if one is still there, and runs it
    /// with `fault` (outside the lock): a hook runs at most once.
    fn run_hook(&self, fault: NodeFault) {
        let hook = self
            .0
            .on_fault
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(hook) = hook {
            hook(fault);
        }
    }

    /// Whether a node fault was reported on any clone.
    pub fn node_fault_reported(&self) -> bool {
        self.node_fault().is_some()
    }

    /// The first node fault reported on any clone, if any.
    pub fn node_fault(&self) -> Option<NodeFault> {
        NodeFault::from_u8(self.0.fault.load(Ordering::Acquire))
    }

    /// The metering layer's word, once a streamed answer ended well, on the longest time the
    /// node went without progress (new text, a finish) after its first content, excluding time
    /// the caller held a frame: runs the hook set with [`NodeSlot::on_pause`] (once). A long
    /// pause is a request that waited in the node's queue after a first token sent at once
    /// (the router lowers the node's learned concurrency limit).
    pub fn report_pause(&self, longest: std::time::Duration) {
        let us = u64::try_from(longest.as_micros()).unwrap_or(u64::MAX - 1);
        self.0.pause_us.store(us + 1, Ordering::Release);
        let hook = self
            .0
            .on_pause
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(hook) = hook {
            hook(longest);
        }
    }

    /// The pause reported with [`NodeSlot::report_pause`], if one was.
    pub fn longest_pause(&self) -> Option<std::time::Duration> {
        match self.0.pause_us.load(Ordering::Acquire) {
            0 => None,
            us => Some(std::time::Duration::from_micros(us - 1)),
        }
    }

    /// Sets what [`NodeSlot::report_pause`] runs, replacing an earlier hook.
    pub fn on_pause(&self, hook: impl FnOnce(std::time::Duration) + Send + 'static) {
        *self
            .0
            .on_pause
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Box::new(hook));
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
