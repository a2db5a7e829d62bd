//! The node registry (design brief §5): the routable nodes, their capacity and scores, the
//! affinity table, and the pick. `acquire` holds the picks that may wait in the admission queue
//! ([`crate::queue`]); `ask` what a request asks of a pick.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::time::Duration;

use rand::Rng;
use serde::Serialize;
use spine_core::{ModelId, ModelTrust, NodeDescriptor, NodeId};
use tokio::time::Instant;

use crate::affinity::{AffinityKey, AffinityTable, StickyOutcome};
use crate::queue::WaitQueue;
use crate::score::{weight, ScoreConfig, ScoreParts, ScoreState};

mod acquire;
mod ask;
mod config;
mod draw;
mod error;
mod limit;
mod view;

use ask::QueuedAsk;
use draw::weighted_draw;
use limit::ConcurrencyLimit;

pub use ask::{Ask, Needs};
pub use config::RegistryConfig;
pub use error::RouteError;
pub use limit::Overload;
pub use view::{NodeView, StickyView};

/// Name of the sticky counter (`result` = `hit`, `miss`, `new`; design brief §5).
pub const STICKY_METRIC: &str = "spine_router_sticky_total";
/// Name of the attempt counter (`result` = `success`, `failure`, `disconnect`).
pub const ATTEMPTS_METRIC: &str = "spine_router_attempts_total";

/// Per-node statistics, kept across reconnects (a node cannot reset its score by reconnecting).
#[derive(Debug)]
struct NodeStats {
    score: ScoreState,
    attempts: u64,
    failures: u64,
    disconnects: u64,
    discrepancies: u64,
    sticky_hits: u64,
    sticky_misses: u64,
    /// The learned concurrency limit, kept across reconnects ([`limit`]).
    limit: Arc<ConcurrencyLimit>,
}

impl NodeStats {
    fn new(now: Instant) -> Self {
        Self {
            score: ScoreState::new(now),
            attempts: 0,
            failures: 0,
            disconnects: 0,
            discrepancies: 0,
            sticky_hits: 0,
            sticky_misses: 0,
            limit: Arc::default(),
        }
    }
}

#[derive(Debug)]
struct NodeEntry {
    descriptor: NodeDescriptor,
    in_flight: Arc<AtomicU32>,
    /// The node's learned concurrency limit (shared with its stats).
    limit: Arc<ConcurrencyLimit>,
    stats: Arc<Mutex<NodeStats>>,
}

#[derive(Debug)]
struct Inner {
    config: RegistryConfig,
    nodes: RwLock<HashMap<NodeId, NodeEntry>>,
    stats: Mutex<HashMap<NodeId, Arc<Mutex<NodeStats>>>>,
    affinity: Mutex<AffinityTable>,
    /// The admission queues, with the requests that wait in them (see [`crate::queue`]); lock
    /// order: `queue`, then `nodes`, then a node's `stats`.
    queue: WaitQueue<QueuedAsk, Result<Pick, RouteError>>,
    /// Who says whether a node may serve a model (the auditor); `None`: every node may.
    trust: TrustSlot,
}

/// The registry's [`ModelTrust`], if one was set.
#[derive(Default)]
struct TrustSlot(RwLock<Option<Arc<dyn ModelTrust>>>);

impl std::fmt::Debug for TrustSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = self.0.read().is_ok_and(|t| t.is_some());
        f.debug_struct("TrustSlot").field("set", &set).finish()
    }
}

/// The nodes this gateway instance can route to, their reliability scores (design brief §5) and
/// the conversation affinity table.
///
/// Cheap to clone (shared state). All methods are synchronous and never block on I/O; locks are
/// held only for map operations. Time is `tokio::time::Instant` (tests use the paused clock).
#[derive(Debug, Clone)]
pub struct NodeRegistry {
    inner: Arc<Inner>,
}

impl Default for NodeRegistry {
    fn default() -> Self {
        Self::with_config(RegistryConfig::default())
    }
}

/// A point-in-time view of one node, for admin APIs.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct NodeSnapshot {
    /// The node.
    pub node_id: NodeId,
    /// What the node said about itself in its handshake.
    pub descriptor: NodeDescriptor,
    /// Requests currently being served by the node through this gateway.
    pub in_flight: u32,
    /// The learned concurrency limit the node is routed by: at most its claimed
    /// `max_concurrency`, lowered when it shows overload (`registry::limit`).
    pub concurrency_limit: u32,
    /// The score and its parts now.
    pub score: ScoreParts,
    /// `max(min(vram_mib, max_vram_mib), 1)·(0.2 + 0.8·score)`: the node's relative chance in a
    /// pick.
    pub weight: f64,
    /// Attempts sent to the node (each retry is its own attempt).
    pub attempts: u64,
    /// Attempts that failed (before or after the first byte, disconnects included).
    pub failures: u64,
    /// Mid-request disconnects (the body broke after the response head).
    pub disconnects: u64,
    /// Usage discrepancies recorded against the node since the gateway started
    /// ([`NodeRegistry::record_discrepancy`]).
    pub discrepancies: u64,
    /// Requests routed here because their conversation was sticky to this node.
    pub sticky_hits: u64,
    /// Keyed requests whose sticky node was this one but could not take them.
    pub sticky_misses: u64,
    /// Live affinity entries pointing at this node.
    pub affinity_entries: u64,
}

/// One request counted against a node's capacity; the count drops when this is dropped, and
/// requests queued for the node's models are offered the freed slot.
#[derive(Debug)]
pub struct InFlightLease {
    node: NodeId,
    counter: Arc<AtomicU32>,
    registry: Weak<Inner>,
}

impl InFlightLease {
    /// The node this lease is for.
    pub fn node(&self) -> &NodeId {
        &self.node
    }

    /// Requests in flight on the node through this gateway now, this one included.
    pub fn node_in_flight(&self) -> u32 {
        self.counter.load(Ordering::Acquire)
    }
}

impl Drop for InFlightLease {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::AcqRel);
        if let Some(inner) = self.registry.upgrade() {
            if inner.queue.waiting() > 0 {
                NodeRegistry { inner }.slots_changed(&self.node, false);
            }
        }
    }
}

/// The result of [`NodeRegistry::pick_for`].
#[derive(Debug)]
#[non_exhaustive]
pub struct Pick {
    /// The node's in-flight lease.
    pub lease: InFlightLease,
    /// What the affinity table said.
    pub sticky: StickyOutcome,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How much lower an alternative's load must be for a sticky node at
/// [`RegistryConfig::affinity_yield_load`] to yield to it.
const STICKY_YIELD_MARGIN: f64 = 0.5;

/// `in_flight / limit` of a node with a free slot, `limit` its learned concurrency limit
/// (at most its `max_concurrency`, see [`limit`]); `None` when it is full.
fn load_of(entry: &NodeEntry) -> Option<f64> {
    let max = entry.concurrency_limit();
    let n = entry.in_flight.load(Ordering::Acquire);
    (n < max).then(|| f64::from(n) / f64::from(max))
}

fn reserve(entry: &NodeEntry) -> bool {
    let max = entry.concurrency_limit();
    entry
        .in_flight
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .is_ok()
}

impl NodeRegistry {
    /// An empty registry with [`RegistryConfig::default`].
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty registry with `config`.
    pub fn with_config(config: RegistryConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                affinity: Mutex::new(AffinityTable::new(
                    config.affinity_ttl,
                    config.max_affinity_entries,
                )),
                config,
                nodes: RwLock::default(),
                stats: Mutex::default(),
                queue: WaitQueue::new(config.queue),
                trust: TrustSlot::default(),
            }),
        }
    }

    /// Sets who decides whether a node may serve a model (design brief §10: the auditor; a
    /// node whose model audit `failed` counts as not serving that model). Replaces any earlier
    /// one; requests queued for a model are not re-examined until the next release or pick.
    pub fn set_model_trust(&self, trust: Arc<dyn ModelTrust>) {
        *self
            .inner
            .trust
            .0
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(trust);
    }

    fn trusted(&self, node: &NodeId, model: &ModelId) -> bool {
        self.inner
            .trust
            .0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_none_or(|t| t.routable(node, model))
    }

    /// The registry's settings.
    pub fn config(&self) -> &RegistryConfig {
        &self.inner.config
    }

    fn stats_of(&self, node: &NodeId) -> Arc<Mutex<NodeStats>> {
        lock(&self.inner.stats)
            .entry(node.clone())
            .or_insert_with(|| Arc::new(Mutex::new(NodeStats::new(Instant::now()))))
            .clone()
    }

    fn with_stats(&self, node: &NodeId, f: impl FnOnce(&mut NodeStats, &ScoreConfig, Instant)) {
        let stats = self.stats_of(node);
        let mut s = lock(&stats);
        f(&mut s, &self.inner.config.score, Instant::now());
    }

    /// Makes `node` routable with `descriptor`, replacing what was known about it. Counts as a
    /// liveness confirmation; the node's score history is kept from earlier sessions.
    ///
    /// Requests already in flight on the node keep counting against it.
    pub fn node_ready(&self, node: &NodeId, descriptor: &NodeDescriptor) {
        let stats = self.stats_of(node);
        let limit = {
            let mut s = lock(&stats);
            s.score.seen(Instant::now());
            s.limit.clone()
        };
        let mut nodes = self.inner.nodes.write().unwrap_or_else(|e| e.into_inner());
        let in_flight = nodes
            .get(node)
            .map(|e| e.in_flight.clone())
            .unwrap_or_default();
        nodes.insert(
            node.clone(),
            NodeEntry {
                descriptor: descriptor.clone(),
                in_flight,
                limit,
                stats,
            },
        );
        drop(nodes);
        tracing::info!(node = %node, models = descriptor.models.len(), "node routable");
        // a node that joins (or comes back with more slots) takes queued requests
        self.slots_changed(node, false);
    }

    /// Removes `node` from routing. Its statistics are kept for when it comes back.
    pub fn node_gone(&self, node: &NodeId) {
        let removed = self
            .inner
            .nodes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(node);
        if let Some(entry) = removed {
            tracing::info!(node = %node, "node no longer routable");
            // requests queued for models no node serves any more fail now, not at the deadline
            let models: Vec<ModelId> = entry.descriptor.models.into_iter().map(|m| m.id).collect();
            self.dispatch_models(&models, true);
        }
    }

    /// `node`'s free slots changed (a lease dropped, the node joined): serve the queues of its
    /// models. Cheap when nothing waits.
    pub(crate) fn slots_changed(&self, node: &NodeId, fail_unservable: bool) {
        if self.inner.queue.waiting() == 0 {
            return;
        }
        let models: Vec<ModelId> = {
            let nodes = self.inner.nodes.read().unwrap_or_else(|e| e.into_inner());
            match nodes.get(node) {
                Some(e) => e.descriptor.models.iter().map(|m| m.id.clone()).collect(),
                None => return,
            }
        };
        self.dispatch_models(&models, fail_unservable);
    }

    /// Free slots on routable nodes serving `model` (any capability).
    pub(crate) fn free_slots(&self, model: &ModelId) -> u64 {
        let nodes = self.inner.nodes.read().unwrap_or_else(|e| e.into_inner());
        nodes
            .iter()
            .filter(|(id, e)| e.descriptor.serves(model) && self.trusted(id, model))
            .map(|(_, e)| {
                u64::from(
                    e.concurrency_limit()
                        .saturating_sub(e.in_flight.load(Ordering::Acquire)),
                )
            })
            .sum()
    }

    /// The node's liveness was confirmed now (a tunnel keepalive answered): feeds
    /// `uptime_score(last_seen)`.
    pub fn heartbeat(&self, node: &NodeId) {
        self.with_stats(node, |s, _, now| s.score.seen(now));
    }

    /// Models served by at least one routable node, sorted.
    pub fn models(&self) -> Vec<ModelId> {
        let nodes = self.inner.nodes.read().unwrap_or_else(|e| e.into_inner());
        // a (node, model) the audits failed serves nothing (design brief §10): a model whose
        // only nodes failed is not listed
        let mut models: Vec<ModelId> = nodes
            .iter()
            .flat_map(|(id, e)| {
                e.descriptor
                    .models
                    .iter()
                    .filter(move |m| self.trusted(id, &m.id))
                    .map(|m| m.id.clone())
            })
            .collect();
        models.sort();
        models.dedup();
        models
    }

    /// Records that `node`'s usage claim disagreed with the independent count beyond the
    /// tolerance (design brief §5, §6). Counted whether or not the node is routable now, and fed
    /// to the score as one failed attempt (`success_rate_ema` and the failure penalty).
    pub fn record_discrepancy(&self, node: &NodeId) {
        self.with_stats(node, |s, cfg, now| {
            s.discrepancies += 1;
            s.score.failure(cfg, now);
        });
    }

    /// Usage discrepancies recorded against `node` since the gateway started.
    pub fn discrepancies(&self, node: &NodeId) -> u64 {
        lock(&self.inner.stats)
            .get(node)
            .map_or(0, |s| lock(s).discrepancies)
    }

    /// An attempt on `node` succeeded. `ttft` is its time to first token when the response was
    /// streamed (feeds the TTFT EMA); a success is also a liveness confirmation.
    pub fn record_success(&self, node: &NodeId, ttft: Option<Duration>) {
        metrics::counter!(ATTEMPTS_METRIC, "result" => "success").increment(1);
        self.with_stats(node, |s, cfg, now| {
            s.attempts += 1;
            s.score.success(cfg, now);
            if let Some(ttft) = ttft {
                s.score.ttft(cfg, ttft);
            }
        });
        self.limit_success(node, ttft);
    }

    /// An attempt on `node` failed without a mid-request disconnect: connect failure, 5xx / 408 /
    /// 429 answer, error event, empty stream, no first content in time.
    pub fn record_failure(&self, node: &NodeId) {
        metrics::counter!(ATTEMPTS_METRIC, "result" => "failure").increment(1);
        self.with_stats(node, |s, cfg, now| {
            s.attempts += 1;
            s.failures += 1;
            s.score.failure(cfg, now);
        });
    }

    /// The node's response body broke after its head (a mid-request disconnect): a failure, and
    /// the score is halved (floor 0.05, recovering; see [`crate::score`]).
    pub fn record_disconnect(&self, node: &NodeId) {
        metrics::counter!(ATTEMPTS_METRIC, "result" => "disconnect").increment(1);
        self.with_stats(node, |s, cfg, now| {
            s.attempts += 1;
            s.failures += 1;
            s.disconnects += 1;
            s.score.disconnect(cfg, now);
        });
    }

    /// The score of `node` now; `None` for a node never seen.
    pub fn score(&self, node: &NodeId) -> Option<ScoreParts> {
        let stats = lock(&self.inner.stats).get(node).cloned()?;
        let parts = lock(&stats)
            .score
            .parts(&self.inner.config.score, Instant::now());
        Some(parts)
    }

    /// The node's advertised VRAM, capped at [`RegistryConfig::max_vram_mib`].
    fn capped_vram(&self, e: &NodeEntry) -> u64 {
        e.descriptor.vram_mib.min(self.inner.config.max_vram_mib)
    }

    /// Every routable node, sorted by id.
    pub fn snapshot(&self) -> Vec<NodeSnapshot> {
        let now = Instant::now();
        let per_node = lock(&self.inner.affinity).entries_per_node(now);
        let nodes = self.inner.nodes.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<NodeSnapshot> = nodes
            .iter()
            .map(|(id, e)| {
                let s = lock(&e.stats);
                let score = s.score.parts(&self.inner.config.score, now);
                NodeSnapshot {
                    node_id: id.clone(),
                    descriptor: e.descriptor.clone(),
                    in_flight: e.in_flight.load(Ordering::Acquire),
                    concurrency_limit: e.concurrency_limit(),
                    weight: weight(self.capped_vram(e), score.score),
                    score,
                    attempts: s.attempts,
                    failures: s.failures,
                    disconnects: s.disconnects,
                    discrepancies: s.discrepancies,
                    sticky_hits: s.sticky_hits,
                    sticky_misses: s.sticky_misses,
                    affinity_entries: per_node.get(id).copied().unwrap_or(0),
                }
            })
            .collect();
        out.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        out
    }

    /// Picks a routable node that serves `model` and has free capacity and counts one request in
    /// flight on it until the returned lease is dropped. Load-aware (power of two choices): two
    /// nodes are drawn at random with probability proportional to their weight
    /// `max(min(vram_mib, max_vram_mib), 1)·(0.2 + 0.8·score)` (design brief §5), and the one
    /// with the lower load `in_flight / limit` (the learned concurrency limit) is taken (equal loads: the first draw,
    /// so idle nodes are picked by weight alone). Never waits: see [`NodeRegistry::acquire`].
    ///
    /// # Errors
    ///
    /// [`RouteError::NoNodeForModel`] when no routable node serves the model,
    /// [`RouteError::AtCapacity`] when all that do are at their learned concurrency limit.
    pub fn pick(&self, model: &ModelId) -> Result<InFlightLease, RouteError> {
        self.pick_for(model, None, &[]).map(|p| p.lease)
    }

    /// [`NodeRegistry::pick`] with conversation affinity and exclusions: when `key` maps to a
    /// routable node that serves `model`, is not in `exclude` and has a free slot, that node
    /// (a sticky hit); otherwise a weighted pick among the other candidates not in `exclude`.
    /// Counts `spine_router_sticky_total{result}` for keyed picks.
    ///
    /// The table is written by [`NodeRegistry::remember`] once a node has answered.
    ///
    /// # Errors
    ///
    /// As [`NodeRegistry::pick`]; excluded nodes count as not serving the model.
    pub fn pick_for(
        &self,
        model: &ModelId,
        key: Option<&AffinityKey>,
        exclude: &[NodeId],
    ) -> Result<Pick, RouteError> {
        let preferred = key.and_then(|key| self.local_preference(model, key));
        self.pick_inner(
            Ask {
                model,
                preferred: preferred.as_ref().map(Option::as_ref),
                exclude,
                needs: Needs::default(),
            },
            Instant::now(),
        )
    }

    /// What the in-memory affinity table says about `key` of `model`: `None` when affinity is
    /// disabled, `Some(None)` when the key has no live entry, `Some(Some(node))` otherwise.
    pub fn local_preference(&self, model: &ModelId, key: &AffinityKey) -> Option<Option<NodeId>> {
        let mut table = lock(&self.inner.affinity);
        table
            .enabled()
            .then(|| table.get(AffinityTable::slot(model, key), Instant::now()))
    }

    /// [`NodeRegistry::pick_for`] with the affinity lookup done elsewhere (an
    /// [`AffinityStore`](crate::AffinityStore) shared by several instances): `preferred` is
    /// `None` when the request has no affinity key (or affinity is disabled), `Some(None)` when
    /// the key has no live entry, `Some(Some(node))` when it names `node`. The in-memory table is
    /// not read.
    ///
    /// # Errors
    ///
    /// As [`NodeRegistry::pick_for`].
    pub fn pick_preferring(
        &self,
        model: &ModelId,
        preferred: Option<Option<&NodeId>>,
        exclude: &[NodeId],
    ) -> Result<Pick, RouteError> {
        let preferred = if self.inner.config.affinity_ttl.is_zero() {
            None
        } else {
            preferred
        };
        self.pick_inner(
            Ask {
                model,
                preferred,
                exclude,
                needs: Needs::default(),
            },
            Instant::now(),
        )
    }

    /// Whether `node` is routable now.
    pub fn contains(&self, node: &NodeId) -> bool {
        self.inner
            .nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(node)
    }

    /// The descriptor `node` is routable with, if it is.
    pub fn descriptor(&self, node: &NodeId) -> Option<NodeDescriptor> {
        self.inner
            .nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(node)
            .map(|e| e.descriptor.clone())
    }

    /// The nodes that could serve `ask` if they had a free slot, or why none could: no node
    /// serves the model, none answers the endpoint, none generates `n` > 1 choices, none has the
    /// context for the prompt.
    fn candidates<'n>(
        &self,
        nodes: &'n HashMap<NodeId, NodeEntry>,
        ask: &Ask<'_>,
    ) -> Result<Vec<(&'n NodeId, &'n NodeEntry)>, RouteError> {
        let mut any_model = false;
        let mut any_kind = false;
        let mut serving: Vec<(&NodeId, &NodeEntry, Option<u64>)> = Vec::new();
        for (id, e) in nodes {
            if ask.exclude.contains(id) {
                continue;
            }
            let Some(m) = e.descriptor.model(ask.model) else {
                continue;
            };
            // a failed model audit: the node does not serve this model (design brief §10)
            if !self.trusted(id, ask.model) {
                continue;
            }
            any_model = true;
            if ask.needs.kind.is_none_or(|k| m.serves_kind(k)) {
                any_kind = true;
                if ask.needs.choices <= 1 || e.descriptor.engine.generates_several_choices() {
                    serving.push((id, e, m.max_context_tokens));
                }
            }
        }
        if !any_model {
            return Err(RouteError::NoNodeForModel(ask.model.clone()));
        }
        if serving.is_empty() && any_kind {
            return Err(RouteError::SeveralChoicesUnsupported {
                model: ask.model.clone(),
                n: ask.needs.choices,
            });
        }
        if serving.is_empty() {
            return Err(match ask.needs.kind {
                Some(kind) => RouteError::Unsupported {
                    model: ask.model.clone(),
                    kind,
                },
                None => RouteError::NoNodeForModel(ask.model.clone()),
            });
        }
        let Some(prompt) = ask.needs.prompt_tokens else {
            return Ok(serving.into_iter().map(|(id, e, _)| (id, e)).collect());
        };
        // an unknown context fits (the metering layer checked the catalog's)
        let fitting: Vec<(&NodeId, &NodeEntry)> = serving
            .iter()
            .filter(|(_, _, ctx)| ctx.is_none_or(|c| prompt < c))
            .map(|(id, e, _)| (*id, *e))
            .collect();
        if fitting.is_empty() {
            let largest = serving.iter().filter_map(|(_, _, c)| *c).max().unwrap_or(0);
            return Err(RouteError::ContextLengthExceeded {
                model: ask.model.clone(),
                prompt_tokens: prompt,
                max_context_tokens: largest,
            });
        }
        Ok(fitting)
    }

    /// Whether `ask` could be served by some node with a free slot; the error says why not.
    pub(crate) fn servable(&self, ask: &Ask<'_>) -> Result<(), RouteError> {
        let nodes = self.inner.nodes.read().unwrap_or_else(|e| e.into_inner());
        self.candidates(&nodes, ask).map(|_| ())
    }

    fn lease(&self, node: &NodeId, entry: &NodeEntry) -> InFlightLease {
        InFlightLease {
            node: node.clone(),
            counter: entry.in_flight.clone(),
            registry: Arc::downgrade(&self.inner),
        }
    }

    /// One pick, no waiting: among the candidates with a free slot, only those at or above
    /// [`RegistryConfig::healthy_score`] when there are any (or, on a share
    /// [`RegistryConfig::probe_share`] of picks, only those below it); then the sticky node if
    /// it is among them and not overloaded (see [`RegistryConfig::affinity_yield_load`]), else a
    /// load-aware weighted pick.
    ///
    /// Sticky statistics are counted only when a node is picked (a request that waits in the
    /// queue is not counted once per try).
    pub(crate) fn pick_inner(&self, ask: Ask<'_>, now: Instant) -> Result<Pick, RouteError> {
        let nodes = self.inner.nodes.read().unwrap_or_else(|e| e.into_inner());
        let candidates = self.candidates(&nodes, &ask)?;
        let sticky = match &ask.preferred {
            None => StickyOutcome::NoKey,
            Some(None) => StickyOutcome::New,
            Some(Some(_)) => StickyOutcome::Miss,
        };
        let mut free: Vec<(&NodeId, &NodeEntry, f64, f64)> = Vec::new();
        let mut scores: Vec<f64> = Vec::new();
        for (id, e) in candidates {
            let Some(load) = load_of(e) else { continue };
            let score = lock(&e.stats)
                .score
                .parts(&self.inner.config.score, now)
                .score;
            free.push((id, e, weight(self.capped_vram(e), score), load));
            scores.push(score);
        }
        // tiers: a node under the healthy score gets only a probe share of the picks while a
        // healthier one has a free slot (its claimed VRAM could otherwise outweigh any score:
        // `weight` lowers it 5× at most); the probes let a recovered node prove it
        let healthy = self.inner.config.healthy_score;
        let (above, below) = scores.iter().fold((false, false), |(a, b), s| {
            (a || *s >= healthy, b || *s < healthy)
        });
        if above && below {
            let probe = rand::rng().random_bool(self.inner.config.probe_share.clamp(0.0, 1.0));
            let mut keep = scores.iter().map(|s| (*s >= healthy) != probe);
            free.retain(|_| keep.next().unwrap_or(true));
        }
        let preferred = match ask.preferred {
            Some(Some(node)) => Some(node),
            _ => None,
        };
        if let Some(node) = preferred {
            if let Some(&(id, entry, _, load)) = free.iter().find(|(id, ..)| *id == node) {
                let load_aware = self.inner.config.load_aware_pick;
                let yields = load_aware
                    && load >= self.inner.config.affinity_yield_load
                    && free
                        .iter()
                        .any(|(other, _, _, l)| *other != id && *l <= load - STICKY_YIELD_MARGIN);
                if !yields && reserve(entry) {
                    lock(&entry.stats).sticky_hits += 1;
                    metrics::counter!(STICKY_METRIC, "result" => "hit").increment(1);
                    return Ok(Pick {
                        lease: self.lease(id, entry),
                        sticky: StickyOutcome::Hit,
                    });
                }
                if yields {
                    free.retain(|(other, ..)| *other != id);
                }
            }
        }
        // Power of two choices: two weighted draws, the less loaded wins (ties: the first). A
        // compare-and-swap loses only to a concurrent pick of the same node, and then that node
        // is dropped from this pick.
        while !free.is_empty() {
            let Some(first) = weighted_draw(&free, None) else {
                break;
            };
            let second = if self.inner.config.load_aware_pick {
                weighted_draw(&free, Some(first))
            } else {
                None
            };
            let chosen = match second {
                Some(second) if free[second].3 < free[first].3 => second,
                _ => first,
            };
            let (id, entry, _, _) = free.swap_remove(chosen);
            if reserve(entry) {
                if sticky != StickyOutcome::NoKey {
                    metrics::counter!(STICKY_METRIC, "result" => sticky.as_str()).increment(1);
                }
                if let Some(node) = preferred {
                    if let Some(e) = nodes.get(node) {
                        lock(&e.stats).sticky_misses += 1;
                    }
                }
                return Ok(Pick {
                    lease: self.lease(id, entry),
                    sticky,
                });
            }
        }
        Err(RouteError::AtCapacity(ask.model.clone()))
    }

    /// Records that `node` served the conversation `key` of `model`: later picks with the key
    /// prefer it for the affinity TTL (refreshed on each hit). No-op when affinity is disabled.
    pub fn remember(&self, model: &ModelId, key: &AffinityKey, node: &NodeId) {
        lock(&self.inner.affinity).insert(
            AffinityTable::slot(model, key),
            node.clone(),
            Instant::now(),
        );
    }
}

#[cfg(test)]
mod tests;
