use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use rand::Rng;
use serde::Serialize;
use spine_core::{ModelId, NodeDescriptor, NodeId};
use tokio::time::Instant;

use crate::affinity::{AffinityKey, AffinityTable, StickyOutcome};
use crate::score::{weight, ScoreConfig, ScoreParts, ScoreState};

/// Name of the sticky counter (`result` = `hit`, `miss`, `new`; design brief §5).
pub const STICKY_METRIC: &str = "spine_router_sticky_total";
/// Name of the attempt counter (`result` = `success`, `failure`, `disconnect`).
pub const ATTEMPTS_METRIC: &str = "spine_router_attempts_total";

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
    /// The last attempt's node sent nothing the caller could get (no head, or no first content)
    /// within the first-content deadline ([`RouteConfig::first_content_timeout`](crate::RouteConfig)).
    #[error("no first content from the node within {0:?}")]
    FirstContentTimeout(Duration),
    /// A committed response's node sent nothing for this long
    /// ([`RouteConfig::stream_idle_timeout`](crate::RouteConfig)): a body error, after bytes
    /// reached the caller, so never retried.
    #[error("node sent nothing for {} s after the response began", .0.as_secs())]
    StreamIdleTimeout(Duration),
}

/// Settings of a [`NodeRegistry`]. [`Default`] gives the documented values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RegistryConfig {
    /// The score's constants (see [`ScoreConfig`]).
    pub score: ScoreConfig,
    /// How long a conversation sticks to its node after its last request. Default 30 min;
    /// `Duration::ZERO` disables affinity.
    pub affinity_ttl: Duration,
    /// Most affinity entries kept (about 100 bytes each). Default 1,000,000.
    pub max_affinity_entries: usize,
    /// Most VRAM, MiB, a node's self-reported `vram_mib` counts for in its pick weight: a node
    /// cannot take nearly all traffic by claiming huge VRAM in its hello. Default 196,608
    /// (192 GiB).
    pub max_vram_mib: u64,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            score: ScoreConfig::default(),
            affinity_ttl: Duration::from_secs(30 * 60),
            max_affinity_entries: 1_000_000,
            max_vram_mib: 196_608,
        }
    }
}

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
        }
    }
}

#[derive(Debug)]
struct NodeEntry {
    descriptor: NodeDescriptor,
    in_flight: Arc<AtomicU32>,
    stats: Arc<Mutex<NodeStats>>,
}

#[derive(Debug)]
struct Inner {
    config: RegistryConfig,
    nodes: RwLock<HashMap<NodeId, NodeEntry>>,
    stats: Mutex<HashMap<NodeId, Arc<Mutex<NodeStats>>>>,
    affinity: Mutex<AffinityTable>,
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
pub struct NodeSnapshot {
    /// The node.
    pub node_id: NodeId,
    /// What the node said about itself in its handshake.
    pub descriptor: NodeDescriptor,
    /// Requests currently being served by the node through this gateway.
    pub in_flight: u32,
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

/// The result of [`NodeRegistry::pick_for`].
#[derive(Debug)]
pub struct Pick {
    /// The node's in-flight lease.
    pub lease: InFlightLease,
    /// What the affinity table said.
    pub sticky: StickyOutcome,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn reserve(entry: &NodeEntry) -> bool {
    let max = entry.descriptor.max_concurrency;
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
            }),
        }
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
        lock(&stats).score.seen(Instant::now());
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
                stats,
            },
        );
        tracing::info!(node = %node, models = descriptor.models.len(), "node routable");
    }

    /// Removes `node` from routing. Its statistics are kept for when it comes back.
    pub fn node_gone(&self, node: &NodeId) {
        let removed = self
            .inner
            .nodes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(node);
        if removed.is_some() {
            tracing::info!(node = %node, "node no longer routable");
        }
    }

    /// The node's liveness was confirmed now (a tunnel keepalive answered): feeds
    /// `uptime_score(last_seen)`.
    pub fn heartbeat(&self, node: &NodeId) {
        self.with_stats(node, |s, _, now| s.score.seen(now));
    }

    /// Models served by at least one routable node, sorted.
    pub fn models(&self) -> Vec<ModelId> {
        let nodes = self.inner.nodes.read().unwrap_or_else(|e| e.into_inner());
        let mut models: Vec<ModelId> = nodes
            .values()
            .flat_map(|e| e.descriptor.models.iter().map(|m| m.id.clone()))
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

    /// Picks a routable node that serves `model` and has free capacity, at random with
    /// probability proportional to its weight `max(min(vram_mib, max_vram_mib), 1)·(0.2 + 0.8·score)` (design brief
    /// §5), and counts one request in flight on it until the returned lease is dropped.
    ///
    /// # Errors
    ///
    /// [`RouteError::NoNodeForModel`] when no routable node serves the model,
    /// [`RouteError::AtCapacity`] when all that do are at their `max_concurrency`.
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
        let now = Instant::now();
        let preferred = match key {
            Some(key) => {
                let mut table = lock(&self.inner.affinity);
                if table.enabled() {
                    Some(table.get(AffinityTable::slot(model, key), now))
                } else {
                    None
                }
            }
            None => None,
        };
        self.pick_inner(model, preferred.as_ref().map(Option::as_ref), exclude, now)
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
        self.pick_inner(model, preferred, exclude, Instant::now())
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

    fn pick_inner(
        &self,
        model: &ModelId,
        preferred: Option<Option<&NodeId>>,
        exclude: &[NodeId],
        now: Instant,
    ) -> Result<Pick, RouteError> {
        let nodes = self.inner.nodes.read().unwrap_or_else(|e| e.into_inner());
        let sticky = match &preferred {
            None => StickyOutcome::NoKey,
            Some(None) => StickyOutcome::New,
            Some(Some(_)) => StickyOutcome::Miss,
        };
        if let Some(Some(node)) = preferred {
            if let Some(entry) = nodes.get(node) {
                if entry.descriptor.serves(model) && !exclude.contains(node) && reserve(entry) {
                    lock(&entry.stats).sticky_hits += 1;
                    metrics::counter!(STICKY_METRIC, "result" => "hit").increment(1);
                    return Ok(Pick {
                        lease: InFlightLease {
                            node: node.clone(),
                            counter: entry.in_flight.clone(),
                        },
                        sticky: StickyOutcome::Hit,
                    });
                }
                lock(&entry.stats).sticky_misses += 1;
            }
        }
        if sticky != StickyOutcome::NoKey {
            metrics::counter!(STICKY_METRIC, "result" => sticky.as_str()).increment(1);
        }
        let serving: Vec<(&NodeId, &NodeEntry)> = nodes
            .iter()
            .filter(|(id, e)| e.descriptor.serves(model) && !exclude.contains(id))
            .collect();
        if serving.is_empty() {
            return Err(RouteError::NoNodeForModel(model.clone()));
        }
        let mut free: Vec<(&NodeId, &NodeEntry, f64)> = serving
            .into_iter()
            .filter(|(_, e)| e.in_flight.load(Ordering::Acquire) < e.descriptor.max_concurrency)
            .map(|(id, e)| {
                let score = lock(&e.stats)
                    .score
                    .parts(&self.inner.config.score, now)
                    .score;
                (id, e, weight(self.capped_vram(e), score))
            })
            .collect();
        // Weighted draw; a compare-and-swap loses only to a concurrent pick of the same node,
        // and then that node is dropped from this draw.
        while !free.is_empty() {
            let total: f64 = free.iter().map(|(_, _, w)| w).sum();
            let mut i = 0;
            if total.is_finite() && total > 0.0 {
                let mut r = rand::rng().random_range(0.0..total);
                while i + 1 < free.len() && r >= free[i].2 {
                    r -= free[i].2;
                    i += 1;
                }
            } else {
                i = rand::rng().random_range(0..free.len());
            }
            let (id, entry, _) = free.swap_remove(i);
            if reserve(entry) {
                return Ok(Pick {
                    lease: InFlightLease {
                        node: id.clone(),
                        counter: entry.in_flight.clone(),
                    },
                    sticky,
                });
            }
        }
        Err(RouteError::AtCapacity(model.clone()))
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
mod tests {
    use super::*;
    use spine_core::{EngineKind, ModelDescriptor};

    pub(crate) fn desc(models: &[&str], max_concurrency: u32) -> NodeDescriptor {
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
    fn excluded_nodes_are_not_picked() {
        let r = NodeRegistry::new();
        r.node_ready(&NodeId::new("a"), &desc(&["m"], 9));
        r.node_ready(&NodeId::new("b"), &desc(&["m"], 9));
        for _ in 0..50 {
            let p = r.pick_for(&ModelId::new("m"), None, &[NodeId::new("a")]);
            assert_eq!(p.map(|p| p.lease.node().clone()), Ok(NodeId::new("b")));
        }
        assert_eq!(
            r.pick_for(
                &ModelId::new("m"),
                None,
                &[NodeId::new("a"), NodeId::new("b")]
            )
            .map(|p| p.sticky),
            Err(RouteError::NoNodeForModel(ModelId::new("m")))
        );
    }

    #[test]
    fn claimed_vram_is_capped_in_the_weight() {
        let r = NodeRegistry::with_config(RegistryConfig {
            max_vram_mib: 1024,
            ..RegistryConfig::default()
        });
        let mut liar = desc(&["m"], 10_000);
        liar.vram_mib = u64::MAX / 2;
        let mut honest = desc(&["m"], 10_000);
        honest.vram_mib = 1024;
        r.node_ready(&NodeId::new("liar"), &liar);
        r.node_ready(&NodeId::new("honest"), &honest);
        let snap = r.snapshot();
        assert_eq!(snap[0].weight, snap[1].weight, "{snap:?}");
        // the claim counts up to the cap and no further: about half the picks each
        let mut liar_picks = 0u32;
        let mut leases = Vec::new();
        for _ in 0..2000 {
            let lease = r.pick(&ModelId::new("m"));
            assert!(lease.is_ok());
            if let Ok(lease) = lease {
                liar_picks += u32::from(lease.node().as_str() == "liar");
                leases.push(lease);
            }
        }
        assert!((800..1200).contains(&liar_picks), "{liar_picks}");
        // the default cap is 192 GiB
        assert_eq!(RegistryConfig::default().max_vram_mib, 196_608);
    }

    #[tokio::test(start_paused = true)]
    async fn affinity_hit_miss_and_overwrite() {
        let r = NodeRegistry::new();
        let m = ModelId::new("m");
        r.node_ready(&NodeId::new("a"), &desc(&["m"], 1));
        r.node_ready(&NodeId::new("b"), &desc(&["m"], 1));
        let key = AffinityKey::PromptCacheKey("chat-1".into());
        let first = r.pick_for(&m, Some(&key), &[]);
        let Ok(first) = first else {
            unreachable!("two free nodes")
        };
        assert_eq!(first.sticky, StickyOutcome::New);
        let node = first.lease.node().clone();
        r.remember(&m, &key, &node);
        drop(first);
        for _ in 0..20 {
            let p = r
                .pick_for(&m, Some(&key), &[])
                .map(|p| (p.lease.node().clone(), p.sticky));
            assert_eq!(p, Ok((node.clone(), StickyOutcome::Hit)));
        }
        // sticky node full: miss, the other node, the entry still points at the old node
        let busy = r.pick_for(&m, Some(&key), &[]);
        assert!(busy.is_ok());
        let other = r
            .pick_for(&m, Some(&key), &[])
            .map(|p| (p.lease.node().clone(), p.sticky));
        assert!(matches!(&other, Ok((n, StickyOutcome::Miss)) if *n != node));
        drop(busy);
        drop(other);
        // sticky node gone: miss, and the caller overwrites
        r.node_gone(&node);
        let p = r.pick_for(&m, Some(&key), &[]);
        let Ok(p) = p else {
            unreachable!("one free node")
        };
        assert_eq!(p.sticky, StickyOutcome::Miss);
        let new_node = p.lease.node().clone();
        assert_ne!(new_node, node);
        r.remember(&m, &key, &new_node);
        drop(p);
        let p = r
            .pick_for(&m, Some(&key), &[])
            .map(|p| (p.lease.node().clone(), p.sticky));
        assert_eq!(p, Ok((new_node.clone(), StickyOutcome::Hit)));
        // the key is per model
        r.node_ready(&NodeId::new("c"), &desc(&["m2"], 1));
        let p = r
            .pick_for(&ModelId::new("m2"), Some(&key), &[])
            .map(|p| p.sticky);
        assert_eq!(p, Ok(StickyOutcome::New));
        let snap = r.snapshot();
        let b = snap.iter().find(|s| s.node_id == new_node);
        assert_eq!(b.map(|s| (s.sticky_hits, s.affinity_entries)), Some((1, 1)));
    }

    #[tokio::test(start_paused = true)]
    async fn affinity_expires_after_ttl() {
        let r = NodeRegistry::with_config(RegistryConfig {
            affinity_ttl: Duration::from_secs(60),
            ..RegistryConfig::default()
        });
        let m = ModelId::new("m");
        r.node_ready(&NodeId::new("a"), &desc(&["m"], 4));
        let key = AffinityKey::Conversation(1);
        r.remember(&m, &key, &NodeId::new("a"));
        tokio::time::advance(Duration::from_secs(59)).await;
        assert_eq!(
            r.pick_for(&m, Some(&key), &[]).map(|p| p.sticky),
            Ok(StickyOutcome::Hit)
        );
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(
            r.pick_for(&m, Some(&key), &[]).map(|p| p.sticky),
            Ok(StickyOutcome::New)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn stats_feed_the_score_and_survive_reconnects() {
        let r = NodeRegistry::new();
        let a = NodeId::new("a");
        r.node_ready(&a, &desc(&["m"], 1));
        r.record_discrepancy(&a);
        r.record_discrepancy(&a);
        r.record_discrepancy(&NodeId::new("b"));
        let s = &r.snapshot()[0];
        assert_eq!(s.discrepancies, 2);
        assert!((s.score.success_rate_ema - 0.64).abs() < 1e-9);
        r.record_success(&a, Some(Duration::from_millis(500)));
        r.record_failure(&a);
        r.record_disconnect(&a);
        r.node_gone(&a);
        r.node_ready(&a, &desc(&["m"], 1));
        let s = &r.snapshot()[0];
        assert_eq!(
            (s.discrepancies, s.attempts, s.failures, s.disconnects),
            (2, 3, 2, 1)
        );
        assert_eq!(s.score.ttft_ema_ms, Some(500.0));
        assert!(s.score.failure_penalty < 0.51);
        assert_eq!(r.discrepancies(&NodeId::new("b")), 1);
        assert_eq!(r.discrepancies(&NodeId::new("c")), 0);
        // heartbeats keep uptime at 1; silence lowers it
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!((r.snapshot()[0].score.uptime_score - 0.5).abs() < 1e-6);
        r.heartbeat(&a);
        assert!((r.snapshot()[0].score.uptime_score - 1.0).abs() < 1e-9);
    }
}
