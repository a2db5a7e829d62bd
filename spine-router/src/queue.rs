//! The admission queue: requests wait for a slot instead of failing when every candidate node
//! of their model is full.
//!
//! # Behaviour
//!
//! - [`NodeRegistry::acquire`] picks at once when it can. When every node that could serve the
//!   request (its model, endpoint and context; [`Needs`]) is at its `max_concurrency`, the request
//!   joins its model's queue and waits up to [`QueueConfig::max_wait`]; past it,
//!   [`RouteError::QueueTimeout`]. A model's queue holds at most [`QueueConfig::max_depth`]
//!   requests; past it, [`RouteError::QueueFull`]. Both carry a `retry_after` computed from the
//!   queue: its depth times the mean interval between two requests leaving it (clamped to
//!   1 s…`max_wait`).
//! - While a model has waiters, new requests for it queue behind them (no barging) and every
//!   freed slot goes to the queue: when an [`InFlightLease`](crate::InFlightLease) is dropped,
//!   when a node joins or comes back (possibly with more slots), the registry offers the node's
//!   free slots to the waiters of its models, in fair order; a waiter the freed node cannot serve
//!   (too small a context, no embeddings) is skipped, not blocking those behind it.
//! - **Fairness between accounts** (start-time fair queuing): each request gets a virtual start
//!   tag `max(V, F[class])` and moves its class's finish tag `F[class]` on by `1/weight`; the
//!   smallest start tag is served first and `V` becomes its tag. A class (the account) with 1,000
//!   waiting requests has tags V, V+1, … V+999, so a single request of another account, tagged V,
//!   is served after at most one request of each other waiting account. `weight`
//!   ([`QueueTicket::weight`], 1…1,000, e.g. a per-key priority) gives a class that share of
//!   the slots while several classes wait.
//! - **At the depth limit** the class with the most waiters gives up its newest place to a
//!   request of a class with fewer (that waiter gets [`RouteError::QueueFull`]); otherwise the
//!   newcomer is refused. One account's burst cannot keep another account out of the queue.
//! - **A caller that leaves** (its future dropped) leaves the queue at once and frees its place;
//!   the slot it would have had goes to the next waiter. The caller pays nothing: the metering
//!   layer above places its credit hold before routing and settles it `rejected` when no node
//!   was picked (held at enqueue, released on leave).
//! - **A node that goes away** while requests wait: waiters whose model no node serves any more
//!   (or no node that fits them) fail at once with the matching [`RouteError`], not at the
//!   deadline; the others keep waiting for the remaining nodes.
//! - A retry (after a node failed before its first byte) never waits: only a request's first
//!   attempt queues.
//!
//! # Several gateway instances
//!
//! Each instance queues for the nodes it routes to, against its own view of their in-flight
//! counts (the requests it sent them). Fairness between accounts holds within an instance; across
//! instances there is none beyond the load balancer's spread: an account whose burst lands on
//! instance A does not delay another's request on instance B, except through the nodes both
//! use (a node's tunnel admits at most `max_concurrency` streams in all, and a request refused
//! there is retried, not queued).
//!
//! # Metrics
//!
//! `spine_router_queue_depth{model}` (gauge), `spine_router_queue_wait_seconds{model,result}`
//! (histogram of the time spent queued, `result` = `served`, `timeout`, `left`, `evicted`,
//! `failed`), `spine_router_queue_total{result}` (`queued`, `full` and the results above).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use spine_core::{ModelId, NodeId};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::registry::{Ask, Needs};
use crate::{NodeRegistry, Pick, RouteError};

/// Gauge: requests waiting, per model.
pub const QUEUE_DEPTH_METRIC: &str = "spine_router_queue_depth";
/// Histogram: seconds a request spent in the queue, by model and result.
pub const QUEUE_WAIT_METRIC: &str = "spine_router_queue_wait_seconds";
/// Counter: queue events by result.
pub const QUEUE_METRIC: &str = "spine_router_queue_total";

/// Virtual-time units of one request of weight 1.
const SCALE: u64 = 1 << 20;
/// Largest [`QueueTicket::weight`] honoured.
pub const MAX_QUEUE_WEIGHT: u32 = 1000;

/// Settings of the admission queue ([`RegistryConfig::queue`](crate::RegistryConfig)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueConfig {
    /// Longest wait for a slot. Default 30 s; `Duration::ZERO` disables the queue (a request
    /// that finds every node full fails at once with [`RouteError::AtCapacity`]).
    pub max_wait: Duration,
    /// Most requests waiting per model. Default 1,024; 0 disables the queue.
    pub max_depth: usize,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            max_wait: Duration::from_secs(30),
            max_depth: 1024,
        }
    }
}

impl QueueConfig {
    fn enabled(&self) -> bool {
        !self.max_wait.is_zero() && self.max_depth > 0
    }
}

/// Whom a queued request belongs to, for fairness.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueTicket {
    /// The fairness class: the account (every request of an account shares one class).
    pub class: String,
    /// The class's share while several wait, 1…[`MAX_QUEUE_WEIGHT`] (0 counts as 1). Default 1.
    pub weight: u32,
}

/// A request extension that sets its [`QueueTicket::weight`] (e.g. from the API key's
/// priority); without it the weight is 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueWeight(pub u32);

/// A point-in-time view of one model's queue, for admin APIs.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct QueueSnapshot {
    /// The model.
    pub model: ModelId,
    /// Requests waiting now.
    pub depth: usize,
    /// Accounts (fairness classes) with requests waiting now.
    pub accounts_waiting: usize,
    /// How long the oldest waiting request has waited, ms.
    pub oldest_wait_ms: u64,
    /// Requests that got a node after waiting (since the gateway started).
    pub served: u64,
    /// Requests that waited the whole `max_wait`.
    pub timed_out: u64,
    /// Requests refused because the queue was full.
    pub refused_full: u64,
    /// Requests whose place went to another account's (at the depth limit).
    pub evicted: u64,
    /// Callers that left while waiting.
    pub left: u64,
    /// Mean wait of the requests served from the queue (exponential moving average), ms.
    pub mean_wait_ms: Option<u64>,
    /// The `Retry-After` a refusal would carry now, s.
    pub retry_after_secs: u64,
}

type Reply = Result<Pick, RouteError>;

#[derive(Debug)]
struct Waiter {
    class: Arc<str>,
    enqueued: Instant,
    preferred: Option<Option<NodeId>>,
    exclude: Vec<NodeId>,
    needs: Needs,
    tx: oneshot::Sender<Reply>,
}

#[derive(Debug, Default)]
struct ClassState {
    waiting: usize,
    last_finish: u64,
}

#[derive(Debug, Default)]
struct ModelQueue {
    /// By (start tag, arrival): the next to serve first.
    waiters: BTreeMap<(u64, u64), Waiter>,
    classes: HashMap<Arc<str>, ClassState>,
    vtime: u64,
    served: u64,
    timed_out: u64,
    refused_full: u64,
    evicted: u64,
    left: u64,
    wait_ema_ms: Option<f64>,
    /// Mean seconds between two requests leaving the queue for a node, while it is non-empty.
    interval_ema_secs: Option<f64>,
    /// When the last request left for a node (or the queue became non-empty).
    last_mark: Option<Instant>,
}

impl ModelQueue {
    fn remove(&mut self, key: (u64, u64)) -> Option<Waiter> {
        let w = self.waiters.remove(&key)?;
        if let Some(c) = self.classes.get_mut(&w.class) {
            c.waiting = c.waiting.saturating_sub(1);
            if c.waiting == 0 && c.last_finish <= self.vtime {
                self.classes.remove(&w.class);
            }
        }
        if self.waiters.is_empty() {
            // nothing waits: no class is ahead of another any more
            self.classes.clear();
            self.last_mark = None;
        }
        Some(w)
    }

    fn retry_after(&self, max_wait: Duration) -> Duration {
        let per = self.interval_ema_secs.unwrap_or(1.0);
        #[allow(clippy::cast_precision_loss)]
        let secs = (self.waiters.len().max(1) as f64 * per).ceil();
        let cap = max_wait.as_secs().max(1);
        Duration::from_secs(if secs.is_finite() {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let s = secs as u64;
            s.clamp(1, cap)
        } else {
            cap
        })
    }

    fn gauge(&self, model: &ModelId) {
        #[allow(clippy::cast_precision_loss)]
        let depth = self.waiters.len() as f64;
        metrics::gauge!(QUEUE_DEPTH_METRIC, "model" => model.as_str().to_owned()).set(depth);
    }
}

/// The queues of one registry.
#[derive(Debug, Default)]
pub(crate) struct Queues {
    models: HashMap<ModelId, ModelQueue>,
    seq: u64,
}

fn record_wait(model: &ModelId, result: &'static str, since: Instant) {
    metrics::histogram!(QUEUE_WAIT_METRIC, "model" => model.as_str().to_owned(), "result" => result)
        .record(since.elapsed().as_secs_f64());
    metrics::counter!(QUEUE_METRIC, "result" => result).increment(1);
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A place in a queue; leaves it when dropped (the caller went away).
struct Place<'r> {
    registry: &'r NodeRegistry,
    model: ModelId,
    key: (u64, u64),
    rx: oneshot::Receiver<Reply>,
}

impl Place<'_> {
    /// Leaves the queue; `false` when the place was already gone (served, failed or evicted:
    /// the answer is in `rx`).
    fn leave(&self, result: &'static str) -> bool {
        let mut queues = lock(&self.registry.inner.queues);
        let Some(q) = queues.models.get_mut(&self.model) else {
            return false;
        };
        let Some(w) = q.remove(self.key) else {
            return false;
        };
        match result {
            "timeout" => q.timed_out += 1,
            _ => q.left += 1,
        }
        q.gauge(&self.model);
        self.registry.inner.waiting.fetch_sub(1, Ordering::AcqRel);
        record_wait(&self.model, result, w.enqueued);
        true
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        // the lock is released before `rx` (and any pick sent into it) is dropped
        self.leave("left");
    }
}

impl NodeRegistry {
    /// Picks a node for `ask`, waiting in the model's admission queue (see [`crate::queue`])
    /// when every node that could serve it is full. `ticket`: the request's fairness class;
    /// `None` (or the queue disabled in [`QueueConfig`]) never waits, as
    /// [`NodeRegistry::pick_preferring`].
    ///
    /// # Errors
    ///
    /// [`RouteError::NoNodeForModel`], [`RouteError::Unsupported`],
    /// [`RouteError::ContextLengthExceeded`] at once (or while waiting, when the nodes that could
    /// serve it go away); [`RouteError::QueueFull`], [`RouteError::QueueTimeout`];
    /// [`RouteError::AtCapacity`] when not queued.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves the queue at once; no slot is held for it.
    pub async fn acquire(
        &self,
        ask: Ask<'_>,
        ticket: Option<&QueueTicket>,
    ) -> Result<Pick, RouteError> {
        let deadline = Instant::now() + self.inner.config.queue.max_wait;
        self.acquire_until(ask, ticket, deadline).await
    }

    /// As [`acquire`](Self::acquire), waiting at most until `deadline` (and never longer than
    /// [`QueueConfig::max_wait`]): the several attempts of one request share one deadline. A
    /// deadline already past does not wait.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire).
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire).
    pub async fn acquire_until(
        &self,
        ask: Ask<'_>,
        ticket: Option<&QueueTicket>,
        deadline: Instant,
    ) -> Result<Pick, RouteError> {
        let config = self.inner.config.queue;
        let ticket = ticket.filter(|_| Instant::now() < deadline);
        let Some(ticket) = ticket.filter(|_| config.enabled()) else {
            return self.pick_inner(ask, Instant::now());
        };
        let now = Instant::now();
        let (place, behind_others) = {
            let mut queues = lock(&self.inner.queues);
            let behind_others = queues
                .models
                .get(ask.model)
                .is_some_and(|q| !q.waiters.is_empty());
            if behind_others {
                // fail fast when no node could ever serve it; otherwise wait behind the others
                self.servable(&ask)?;
            } else {
                match self.pick_inner(ask, now) {
                    Err(RouteError::AtCapacity(_)) => {}
                    other => return other,
                }
            }
            let (tx, rx) = oneshot::channel();
            let key = self.enqueue(&mut queues, &ask, ticket, tx, now, config)?;
            (
                Place {
                    registry: self,
                    model: ask.model.clone(),
                    key,
                    rx,
                },
                behind_others,
            )
        };
        if behind_others {
            // a slot may be free that the waiters ahead cannot use, or this one is first now
            self.dispatch_models(std::slice::from_ref(ask.model), false);
        }
        self.wait(place, deadline.min(now + config.max_wait), config)
            .await
    }

    async fn wait(
        &self,
        mut place: Place<'_>,
        deadline: Instant,
        config: QueueConfig,
    ) -> Result<Pick, RouteError> {
        match tokio::time::timeout_at(deadline, &mut place.rx).await {
            Ok(Ok(reply)) => reply,
            // the registry dropped the place without an answer: only when it is itself gone
            Ok(Err(_)) => Err(RouteError::AtCapacity(place.model.clone())),
            Err(_) => {
                if !place.leave("timeout") {
                    // answered at the deadline: take it
                    if let Ok(reply) = place.rx.try_recv() {
                        return reply;
                    }
                }
                let retry_after = lock(&self.inner.queues)
                    .models
                    .get(&place.model)
                    .map_or(Duration::from_secs(1), |q| q.retry_after(config.max_wait));
                Err(RouteError::QueueTimeout {
                    model: place.model.clone(),
                    waited: config.max_wait,
                    retry_after,
                })
            }
        }
    }

    fn enqueue(
        &self,
        queues: &mut Queues,
        ask: &Ask<'_>,
        ticket: &QueueTicket,
        tx: oneshot::Sender<Reply>,
        now: Instant,
        config: QueueConfig,
    ) -> Result<(u64, u64), RouteError> {
        let q = queues.models.entry(ask.model.clone()).or_default();
        let class: Arc<str> = Arc::from(ticket.class.as_str());
        if q.waiters.len() >= config.max_depth {
            let mine = q.classes.get(&class).map_or(0, |c| c.waiting);
            let biggest = q
                .classes
                .iter()
                .max_by_key(|(_, c)| c.waiting)
                .map(|(k, c)| (k.clone(), c.waiting));
            let victim = match biggest {
                Some((big, n)) if n > mine.saturating_add(1) => q
                    .waiters
                    .iter()
                    .rev()
                    .find(|(_, w)| w.class == big)
                    .map(|(k, _)| *k),
                _ => None,
            };
            let retry_after = q.retry_after(config.max_wait);
            let Some(victim) = victim else {
                q.refused_full += 1;
                metrics::counter!(QUEUE_METRIC, "result" => "full").increment(1);
                return Err(RouteError::QueueFull {
                    model: ask.model.clone(),
                    retry_after,
                });
            };
            if let Some(w) = q.remove(victim) {
                q.evicted += 1;
                self.inner.waiting.fetch_sub(1, Ordering::AcqRel);
                record_wait(ask.model, "evicted", w.enqueued);
                // an error, no lease: nothing is dropped under the lock but the message
                let _ = w.tx.send(Err(RouteError::QueueFull {
                    model: ask.model.clone(),
                    retry_after,
                }));
            }
        }
        let weight = u64::from(ticket.weight.clamp(1, MAX_QUEUE_WEIGHT));
        if q.waiters.is_empty() {
            q.last_mark = Some(now);
        }
        let state = q.classes.entry(class.clone()).or_default();
        let start = q.vtime.max(state.last_finish);
        state.last_finish = start.saturating_add(SCALE / weight);
        state.waiting += 1;
        queues.seq += 1;
        let key = (start, queues.seq);
        q.waiters.insert(
            key,
            Waiter {
                class,
                enqueued: now,
                preferred: ask.preferred.map(|p| p.cloned()),
                exclude: ask.exclude.to_vec(),
                needs: ask.needs,
                tx,
            },
        );
        q.gauge(ask.model);
        self.inner.waiting.fetch_add(1, Ordering::AcqRel);
        metrics::counter!(QUEUE_METRIC, "result" => "queued").increment(1);
        Ok(key)
    }

    /// Offers free slots to the waiters of `models`, in fair order. `fail_unservable`: also
    /// scan when no slot is free, failing the waiters no routable node could serve any more.
    pub(crate) fn dispatch_models(&self, models: &[ModelId], fail_unservable: bool) {
        for model in models {
            // picks whose caller left between send and receive are dropped after the lock
            let mut orphans: Vec<Pick> = Vec::new();
            {
                let mut queues = lock(&self.inner.queues);
                let Some(q) = queues.models.get_mut(model) else {
                    continue;
                };
                if q.waiters.is_empty() {
                    continue;
                }
                let keys: Vec<(u64, u64)> = q.waiters.keys().copied().collect();
                let now = Instant::now();
                for key in keys {
                    if !fail_unservable && self.free_slots(model) == 0 {
                        break;
                    }
                    let Some(w) = q.waiters.get(&key) else {
                        continue;
                    };
                    let ask = Ask {
                        model,
                        preferred: w.preferred.as_ref().map(Option::as_ref),
                        exclude: &w.exclude,
                        needs: w.needs,
                    };
                    let reply = match self.pick_inner(ask, now) {
                        Err(RouteError::AtCapacity(_)) => continue,
                        other => other,
                    };
                    let Some(w) = q.remove(key) else {
                        // (cannot happen: the lock is held) never drop a lease under it
                        if let Ok(pick) = reply {
                            orphans.push(pick);
                        }
                        continue;
                    };
                    self.inner.waiting.fetch_sub(1, Ordering::AcqRel);
                    if reply.is_ok() {
                        q.vtime = q.vtime.max(key.0);
                        q.served += 1;
                        #[allow(clippy::cast_precision_loss)]
                        let waited_ms = now.duration_since(w.enqueued).as_millis() as f64;
                        q.wait_ema_ms = Some(
                            q.wait_ema_ms
                                .map_or(waited_ms, |e| 0.8 * e + 0.2 * waited_ms),
                        );
                        if let Some(mark) = q.last_mark {
                            let dt = now.duration_since(mark).as_secs_f64();
                            q.interval_ema_secs =
                                Some(q.interval_ema_secs.map_or(dt, |e| 0.8 * e + 0.2 * dt));
                        }
                        q.last_mark = (!q.waiters.is_empty()).then_some(now);
                        record_wait(model, "served", w.enqueued);
                    } else {
                        record_wait(model, "failed", w.enqueued);
                    }
                    if let Err(Ok(pick)) = w.tx.send(reply) {
                        orphans.push(pick);
                    }
                }
                q.gauge(model);
            }
            // each drop frees a slot and dispatches again, outside the lock
            drop(orphans);
        }
    }

    /// Every model's queue now, sorted by model.
    pub fn queue_snapshot(&self) -> Vec<QueueSnapshot> {
        let queues = lock(&self.inner.queues);
        let now = Instant::now();
        let max_wait = self.inner.config.queue.max_wait;
        let mut out: Vec<QueueSnapshot> = queues
            .models
            .iter()
            .map(|(model, q)| {
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let mean_wait_ms = q.wait_ema_ms.map(|m| m.round() as u64);
                QueueSnapshot {
                    model: model.clone(),
                    depth: q.waiters.len(),
                    accounts_waiting: q.classes.values().filter(|c| c.waiting > 0).count(),
                    oldest_wait_ms: q
                        .waiters
                        .values()
                        .map(|w| now.duration_since(w.enqueued))
                        .max()
                        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                    served: q.served,
                    timed_out: q.timed_out,
                    refused_full: q.refused_full,
                    evicted: q.evicted,
                    left: q.left,
                    mean_wait_ms,
                    retry_after_secs: q.retry_after(max_wait).as_secs(),
                }
            })
            .collect();
        out.sort_by(|a, b| a.model.cmp(&b.model));
        out
    }
}

#[cfg(test)]
mod tests;
