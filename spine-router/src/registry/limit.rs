//! A node's learned concurrency limit: how many requests it is sent at once, at most its
//! claimed `max_concurrency`.
//!
//! A node's `max_concurrency` is its own word. A node that claims 256 slots and serves one
//! request at a time looks empty to a load-aware pick (`in_flight / max_concurrency` stays
//! near 0), so a burst goes to it and waits in its queue until the first-content deadline. The
//! registry therefore learns the limit it routes by, additive-increase / multiplicative-decrease
//! as TCP's congestion window (RFC 5681 §3.1; Jacobson 1988):
//!
//! - it starts at the claim (an honest node is never held below what it says until it shows
//!   overload, so a burst to a new node is not slowed);
//! - **decrease:** an overload signal ([`Overload`]) sets it to half of `min(limit, in_flight)`
//!   (at least 1), at most once per [`RegistryConfig::overload_backoff`] (the requests of one
//!   burst time out together, and one halving per round trip is TCP's rule too). The signals:
//!   - an attempt that sent nothing within the first-content deadline while the node had other
//!     requests in flight (one slow request shows no queue), counted only once another node
//!     served that request (late on every node it tried, the request itself is slow: a caller's
//!     long prompt must not shrink honest nodes);
//!   - a streamed answer that paused after its first token longer than a first token may take
//!     ([`RegistryConfig::overload_pause`]: it waited in the node's queue after a first token
//!     sent at once);
//!   - a node's `429` / `503` answer;
//! - **increase:** a success while the node was using its limit (`in_flight ≥ limit − 1`, TCP's
//!   "cwnd-limited" rule: room never used proves nothing) adds `1 / limit`, i.e. one slot per
//!   `limit` such successes in a row, up to the claim; a success whose first token came later
//!   than [`RegistryConfig::limit_growth_max_ttft`] waited in the node's queue: it breaks the
//!   row (the credit starts again), so a node that queues stops growing short of the deadline.
//!
//! The load a pick compares is `in_flight / limit`, and a node at its limit takes no more
//! requests (they wait in the gateway's queue or go to another node). The limit is kept while a
//! node reconnects, as its score is.
//!
//! Known gap: only streamed requests have a first-content deadline and pauses; a node that
//! queues non-streamed requests is slow, never late, and its limit is not lowered (its answers
//! still arrive).
//!
//! [`RegistryConfig::overload_backoff`]: crate::RegistryConfig::overload_backoff
//! [`RegistryConfig::overload_pause`]: crate::RegistryConfig::overload_pause
//! [`RegistryConfig::limit_growth_max_ttft`]: crate::RegistryConfig::limit_growth_max_ttft

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use spine_core::NodeId;
use tokio::time::Instant;

use super::{lock, NodeEntry, NodeRegistry};

/// What showed that a node has fewer slots than it was sent requests
/// ([`NodeRegistry::record_overload`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Overload {
    /// An attempt sent no first content within the first-content deadline, and another node
    /// then served the request: a sign of a queue only while the node had other requests in
    /// flight.
    Late {
        /// Requests the node had in flight when the attempt was late, itself included.
        in_flight: u32,
    },
    /// The node answered `429` or `503`: it says it is full.
    Refused,
    /// A streamed answer paused longer than a first token may take
    /// ([`NodeRegistry::record_pause`]): a sign of a queue while the node has other requests
    /// in flight.
    Paused,
}

/// A node's learned concurrency limit (module docs). Shared by the node's registry entries
/// across reconnects.
#[derive(Debug)]
pub(crate) struct ConcurrencyLimit {
    /// The limit, requests; `u32::MAX` until first lowered (the claim rules).
    limit: AtomicU32,
    state: Mutex<LimitState>,
}

#[derive(Debug, Default)]
struct LimitState {
    /// When the limit was last lowered.
    last_decrease: Option<Instant>,
    /// Successes at the limit since it last grew.
    credit: u32,
}

impl Default for ConcurrencyLimit {
    fn default() -> Self {
        Self {
            limit: AtomicU32::new(u32::MAX),
            state: Mutex::new(LimitState::default()),
        }
    }
}

impl ConcurrencyLimit {
    /// The limit for a node that claims `claimed` slots.
    pub(crate) fn of(&self, claimed: u32) -> u32 {
        self.limit.load(Ordering::Acquire).min(claimed)
    }

    /// An overload signal with `in_flight` requests on the node: halves
    /// `min(limit, in_flight)` (at least 1) unless lowered within `backoff` of `now`.
    /// Whether the limit changed.
    fn overloaded(&self, claimed: u32, in_flight: u32, now: Instant, backoff: Duration) -> bool {
        let mut state = lock(&self.state);
        // whatever the backoff, the row of successes that grows the limit starts again
        state.credit = 0;
        if state
            .last_decrease
            .is_some_and(|at| now.saturating_duration_since(at) < backoff)
        {
            return false;
        }
        let limit = self.of(claimed);
        let lowered = (limit.min(in_flight) / 2).max(1);
        state.last_decrease = Some(now);
        self.limit.store(lowered, Ordering::Release);
        lowered != limit
    }

    /// A success whose first token was late: the row of successes that grows the limit starts
    /// again.
    fn queued(&self) {
        lock(&self.state).credit = 0;
    }

    /// A success with `in_flight` requests on the node (this one included): one slot more per
    /// `limit` successes while the node uses its limit, up to `claimed`. Whether it grew.
    fn succeeded(&self, claimed: u32, in_flight: u32) -> bool {
        let limit = self.of(claimed);
        if limit >= claimed || in_flight.saturating_add(1) < limit {
            return false;
        }
        let mut state = lock(&self.state);
        state.credit += 1;
        if state.credit < limit {
            return false;
        }
        state.credit = 0;
        let grown = limit + 1;
        self.limit.store(
            if grown >= claimed { u32::MAX } else { grown },
            Ordering::Release,
        );
        true
    }
}

impl NodeEntry {
    /// The number of requests this node is sent at once: its learned limit.
    pub(super) fn concurrency_limit(&self) -> u32 {
        self.limit.of(self.descriptor.max_concurrency)
    }
}

impl NodeRegistry {
    /// `node` showed overload (`why`): lowers its learned concurrency limit (module docs of
    /// `registry::limit`), unless `why` is [`Overload::Late`] with no other request in flight
    /// then.
    /// Does not score the node (the caller records the failure).
    pub fn record_overload(&self, node: &NodeId, why: Overload) {
        let lowered = {
            let nodes = self.inner.nodes.read().unwrap_or_else(|e| e.into_inner());
            let Some(entry) = nodes.get(node) else {
                return;
            };
            let in_flight = match why {
                Overload::Late { in_flight } if in_flight < 2 => return,
                Overload::Late { in_flight } => in_flight,
                Overload::Refused => entry.in_flight.load(Ordering::Acquire),
                // this answer's lease may be gone: the others in flight, and it
                Overload::Paused => match entry.in_flight.load(Ordering::Acquire) {
                    0 => return,
                    n => n + 1,
                },
            };
            let claimed = entry.descriptor.max_concurrency;
            entry
                .limit
                .overloaded(
                    claimed,
                    in_flight,
                    Instant::now(),
                    self.inner.config.overload_backoff,
                )
                .then(|| entry.concurrency_limit())
        };
        if let Some(limit) = lowered {
            tracing::info!(node = %node, limit, ?why, "node overloaded: concurrency limit lowered");
        }
    }

    /// A streamed answer of `node` ended well after going `longest` without progress at most
    /// once its first content came: past [`RegistryConfig::overload_pause`] (when set) it
    /// waited in the node's queue, an overload signal as a late first token is (a node that
    /// sends every request's first token at once and serves them one at a time is never late).
    /// Not scored: the answer was whole.
    ///
    /// [`RegistryConfig::overload_pause`]: crate::RegistryConfig::overload_pause
    pub fn record_pause(&self, node: &NodeId, longest: Duration) {
        let max = self.inner.config.overload_pause;
        if max.is_zero() || longest <= max {
            return;
        }
        self.record_overload(node, Overload::Paused);
    }

    /// A success on `node` with its time to first token (streamed): grows its learned limit
    /// when it was in use and the first token came in time (module docs).
    pub(super) fn limit_success(&self, node: &NodeId, ttft: Option<Duration>) {
        let max_ttft = self.inner.config.limit_growth_max_ttft;
        let late = !max_ttft.is_zero() && ttft.is_some_and(|t| t > max_ttft);
        let grown = {
            let nodes = self.inner.nodes.read().unwrap_or_else(|e| e.into_inner());
            let Some(entry) = nodes.get(node) else {
                return;
            };
            let in_flight = entry.in_flight.load(Ordering::Acquire);
            if late {
                entry.limit.queued();
                return;
            }
            entry
                .limit
                .succeeded(entry.descriptor.max_concurrency, in_flight)
        };
        if grown {
            // a queued request may fit now
            self.slots_changed(node, false);
        }
    }

    /// `node`'s learned concurrency limit now; `None` for a node not routable.
    pub fn concurrency_limit(&self, node: &NodeId) -> Option<u32> {
        let nodes = self.inner.nodes.read().unwrap_or_else(|e| e.into_inner());
        nodes.get(node).map(NodeEntry::concurrency_limit)
    }
}

#[cfg(test)]
mod tests;
