//! The admission queue: requests wait for a slot instead of failing when every candidate node
//! of their model is full.
//!
//! # Behaviour
//!
//! - [`NodeRegistry::acquire`](crate::NodeRegistry::acquire) picks at once when it can. When
//!   every node that could serve the request (its model, endpoint and context;
//!   [`Needs`](crate::Needs)) is at its `max_concurrency`, the request joins its model's queue
//!   and waits up to [`QueueConfig::max_wait`]; past it,
//!   [`RouteError::QueueTimeout`](crate::RouteError::QueueTimeout). A model's queue holds at most
//!   [`QueueConfig::max_depth`] requests; past it,
//!   [`RouteError::QueueFull`](crate::RouteError::QueueFull). Both carry a `retry_after` computed
//!   from the queue: its depth times the mean interval between two requests leaving it (clamped to
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
//!   request of a class with fewer (that waiter gets
//!   [`RouteError::QueueFull`](crate::RouteError::QueueFull)); otherwise the newcomer is refused.
//!   One account's burst cannot keep another account out of the queue.
//! - **A caller that leaves** (its future dropped) leaves the queue at once and frees its place;
//!   the slot it would have had goes to the next waiter. The caller pays nothing: the metering
//!   layer above places its credit hold before routing and settles it `rejected` when no node
//!   was picked (held at enqueue, released on leave).
//! - **A node that goes away** while requests wait: waiters whose model no node serves any more
//!   (or no node that fits them) fail at once with the matching
//!   [`RouteError`](crate::RouteError), not at the deadline; the others keep waiting for the
//!   remaining nodes.
//! - A retry (after a node failed before its first byte) never waits: only a request's first
//!   attempt queues.
//!
//! # Parts
//!
//! This module keeps the waiters: who waits for which model, in what order, for how long, and
//! the statistics and metrics of each model's queue. It knows nothing of nodes: the registry
//! decides whether a request can be served now, what a waiter is answered, and when a slot
//! frees, and offers it to the waiters through this module.
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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde::Serialize;
use spine_core::ModelId;
use tokio::sync::oneshot;
use tokio::time::Instant;

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
    /// that finds every node full fails at once with
    /// [`RouteError::AtCapacity`](crate::RouteError::AtCapacity)).
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
    /// Whether a request may wait at all (a `max_wait` and a `max_depth` above zero).
    pub(crate) fn enabled(&self) -> bool {
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

/// Why a request got no reply from whoever serves the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unserved {
    /// The model's queue is at [`QueueConfig::max_depth`] and no place could be freed for the
    /// request's class, or its place went to another class's request. `retry_after`: the
    /// queue's estimate of when a place frees (1 s…`max_wait`).
    Full { retry_after: Duration },
    /// The request waited until its deadline. `retry_after` as for `Full`.
    Timeout { retry_after: Duration },
    /// The queue was dropped while the request waited.
    Closed,
}

/// What a waiter is told: the reply of whoever offered it a slot (`R`), or why none came.
pub(crate) type Answer<R> = Result<R, Unserved>;

/// What whoever serves the queue makes of one waiter when a slot may be free
/// ([`WaitQueue::wake`]).
#[derive(Debug)]
pub(crate) enum Offer<R> {
    /// Nothing for this one now (the free slots do not fit it): it keeps its place, and the
    /// waiters behind it are offered the slots.
    Skip,
    /// Served: `R` is its reply, and it counts as `served`.
    Serve(R),
    /// It can never be served as things stand: `R` is its reply, and it counts as `failed`.
    Fail(R),
}

/// One waiting request: its class, when it came, what it asks (`T`) and where its answer goes.
#[derive(Debug)]
struct Waiter<T, R> {
    class: Arc<str>,
    enqueued: Instant,
    ask: T,
    tx: oneshot::Sender<Answer<R>>,
}

#[derive(Debug, Default)]
struct ClassState {
    waiting: usize,
    last_finish: u64,
}

/// One model's queue and its statistics.
#[derive(Debug)]
struct ModelQueue<T, R> {
    /// By (start tag, arrival): the next to serve first.
    waiters: BTreeMap<(u64, u64), Waiter<T, R>>,
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

impl<T, R> Default for ModelQueue<T, R> {
    fn default() -> Self {
        Self {
            waiters: BTreeMap::new(),
            classes: HashMap::new(),
            vtime: 0,
            served: 0,
            timed_out: 0,
            refused_full: 0,
            evicted: 0,
            left: 0,
            wait_ema_ms: None,
            interval_ema_secs: None,
            last_mark: None,
        }
    }
}

impl<T, R> ModelQueue<T, R> {
    fn remove(&mut self, key: (u64, u64)) -> Option<Waiter<T, R>> {
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

    /// The waiter of start tag `key.0`, enqueued at `enqueued`, was served at `now` (and has
    /// been removed): the virtual time, the count and the wait and interval EMAs move on.
    fn served_at(&mut self, key: (u64, u64), enqueued: Instant, now: Instant) {
        self.vtime = self.vtime.max(key.0);
        self.served += 1;
        #[allow(clippy::cast_precision_loss)]
        let waited_ms = now.duration_since(enqueued).as_millis() as f64;
        self.wait_ema_ms = Some(
            self.wait_ema_ms
                .map_or(waited_ms, |e| 0.8 * e + 0.2 * waited_ms),
        );
        if let Some(mark) = self.last_mark {
            let dt = now.duration_since(mark).as_secs_f64();
            self.interval_ema_secs =
                Some(self.interval_ema_secs.map_or(dt, |e| 0.8 * e + 0.2 * dt));
        }
        self.last_mark = (!self.waiters.is_empty()).then_some(now);
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

    fn snapshot(&self, model: &ModelId, now: Instant, max_wait: Duration) -> QueueSnapshot {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let mean_wait_ms = self.wait_ema_ms.map(|m| m.round() as u64);
        QueueSnapshot {
            model: model.clone(),
            depth: self.waiters.len(),
            accounts_waiting: self.classes.values().filter(|c| c.waiting > 0).count(),
            oldest_wait_ms: self
                .waiters
                .values()
                .map(|w| now.duration_since(w.enqueued))
                .max()
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            served: self.served,
            timed_out: self.timed_out,
            refused_full: self.refused_full,
            evicted: self.evicted,
            left: self.left,
            mean_wait_ms,
            retry_after_secs: self.retry_after(max_wait).as_secs(),
        }
    }
}

#[derive(Debug)]
struct Queues<T, R> {
    models: HashMap<ModelId, ModelQueue<T, R>>,
    /// Arrivals so far, over all models: the second half of a waiter's key.
    seq: u64,
}

fn record_wait(model: &ModelId, result: &'static str, since: Instant) {
    metrics::histogram!(QUEUE_WAIT_METRIC, "model" => model.as_str().to_owned(), "result" => result)
        .record(since.elapsed().as_secs_f64());
    metrics::counter!(QUEUE_METRIC, "result" => result).increment(1);
}

/// The fair waiting lists of one registry, one per model, with their statistics and metrics.
///
/// `T`: what a waiter asks for, kept while it waits and shown to whoever offers it a slot
/// ([`wake`](Self::wake)); `R`: the reply a waiter gets when it is served or fails. The queue
/// knows nothing of nodes or slots: whoever owns it decides when to enqueue (and what to answer
/// at once instead), and calls `wake` when capacity may have freed.
///
/// Locking: one mutex over all the lists. `enqueue`'s `admit` and `wake`'s closures run under
/// it (so whoever owns the queue takes its own locks after this one, never before).
#[derive(Debug)]
pub(crate) struct WaitQueue<T, R> {
    config: QueueConfig,
    queues: Mutex<Queues<T, R>>,
    /// Requests waiting in any list (read without the lock on every release).
    waiting: AtomicUsize,
}

/// The outcome of [`WaitQueue::enqueue`].
pub(crate) enum Enqueued<'q, T, R> {
    /// `admit` answered at once; nothing waits.
    Answered(R),
    /// The model's queue is at its depth and no place could be freed for this class; counted
    /// as `full`. `retry_after` as for [`Unserved::Full`].
    Full { retry_after: Duration },
    /// The request has a place. `behind_others`: other requests of the model were waiting
    /// already (a free slot they cannot use may suit this one: offer it with `wake`).
    Waiting {
        place: Place<'q, T, R>,
        behind_others: bool,
    },
}

impl<T, R> WaitQueue<T, R> {
    /// An empty queue with `config`.
    pub(crate) fn new(config: QueueConfig) -> Self {
        Self {
            config,
            queues: Mutex::new(Queues {
                models: HashMap::new(),
                seq: 0,
            }),
            waiting: AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queues<T, R>> {
        self.queues.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Requests waiting now, in all models' lists (no lock taken).
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Puts a request of `ticket`'s class in `model`'s list at `now`, unless `admit` answers it
    /// at once. `admit` runs under the queue's lock and is told whether others of the model are
    /// waiting already; it returns what the request asks for (`Ok`, to wait) or its reply
    /// (`Err`, not to wait). At the depth limit the class with the most waiters gives up its
    /// newest place (that waiter is answered [`Unserved::Full`]) when it has at least two more
    /// waiters than this class; otherwise the request is refused ([`Enqueued::Full`]).
    pub(crate) fn enqueue(
        &self,
        model: &ModelId,
        ticket: &QueueTicket,
        now: Instant,
        admit: impl FnOnce(bool) -> Result<T, R>,
    ) -> Enqueued<'_, T, R> {
        let mut guard = self.lock();
        let queues = &mut *guard;
        let behind_others = queues
            .models
            .get(model)
            .is_some_and(|q| !q.waiters.is_empty());
        let ask = match admit(behind_others) {
            Ok(ask) => ask,
            Err(reply) => return Enqueued::Answered(reply),
        };
        let q = queues.models.entry(model.clone()).or_default();
        let class: Arc<str> = Arc::from(ticket.class.as_str());
        if q.waiters.len() >= self.config.max_depth {
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
            let retry_after = q.retry_after(self.config.max_wait);
            let Some(victim) = victim else {
                q.refused_full += 1;
                metrics::counter!(QUEUE_METRIC, "result" => "full").increment(1);
                return Enqueued::Full { retry_after };
            };
            if let Some(w) = q.remove(victim) {
                q.evicted += 1;
                self.waiting.fetch_sub(1, Ordering::AcqRel);
                record_wait(model, "evicted", w.enqueued);
                // no reply of the server's: nothing is dropped under the lock but the message
                let _ = w.tx.send(Err(Unserved::Full { retry_after }));
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
        let (tx, rx) = oneshot::channel();
        q.waiters.insert(
            key,
            Waiter {
                class,
                enqueued: now,
                ask,
                tx,
            },
        );
        q.gauge(model);
        self.waiting.fetch_add(1, Ordering::AcqRel);
        metrics::counter!(QUEUE_METRIC, "result" => "queued").increment(1);
        Enqueued::Waiting {
            place: Place {
                queue: self,
                model: model.clone(),
                key,
                rx,
            },
            behind_others,
        }
    }

    /// Offers `model`'s waiters a slot, in fair order: `offer` is asked about each (with the
    /// time of this round) and says whether it is served, fails or is skipped. Before each,
    /// `has_slot` is asked whether a slot may still be free; `scan_all` asks every waiter
    /// regardless (to fail those that can never be served). Both closures run under the queue's
    /// lock; replies whose caller has left are dropped after it.
    pub(crate) fn wake(
        &self,
        model: &ModelId,
        scan_all: bool,
        mut has_slot: impl FnMut() -> bool,
        mut offer: impl FnMut(&T, Instant) -> Offer<R>,
    ) {
        // replies whose caller left between send and receive are dropped after the lock: a
        // reply may hold a slot, whose release wakes the queue again
        let mut orphans: Vec<R> = Vec::new();
        {
            let mut queues = self.lock();
            let Some(q) = queues.models.get_mut(model) else {
                return;
            };
            if q.waiters.is_empty() {
                return;
            }
            let keys: Vec<(u64, u64)> = q.waiters.keys().copied().collect();
            let now = Instant::now();
            for key in keys {
                if !scan_all && !has_slot() {
                    break;
                }
                let Some(w) = q.waiters.get(&key) else {
                    continue;
                };
                let (reply, served) = match offer(&w.ask, now) {
                    Offer::Skip => continue,
                    Offer::Serve(reply) => (reply, true),
                    Offer::Fail(reply) => (reply, false),
                };
                let Some(w) = q.remove(key) else {
                    // (cannot happen: the lock is held) never drop a reply under it
                    orphans.push(reply);
                    continue;
                };
                self.waiting.fetch_sub(1, Ordering::AcqRel);
                if served {
                    q.served_at(key, w.enqueued, now);
                    record_wait(model, "served", w.enqueued);
                } else {
                    record_wait(model, "failed", w.enqueued);
                }
                if let Err(Ok(reply)) = w.tx.send(Ok(reply)) {
                    orphans.push(reply);
                }
            }
            q.gauge(model);
        }
        drop(orphans);
    }

    /// Every model's list now, sorted by model.
    pub(crate) fn snapshot(&self) -> Vec<QueueSnapshot> {
        let queues = self.lock();
        let now = Instant::now();
        let mut out: Vec<QueueSnapshot> = queues
            .models
            .iter()
            .map(|(model, q)| q.snapshot(model, now, self.config.max_wait))
            .collect();
        out.sort_by(|a, b| a.model.cmp(&b.model));
        out
    }

    /// `model`'s `Retry-After` now: 1 s when nothing of it was ever queued.
    fn retry_after(&self, model: &ModelId) -> Duration {
        self.lock()
            .models
            .get(model)
            .map_or(Duration::from_secs(1), |q| {
                q.retry_after(self.config.max_wait)
            })
    }
}

/// A request's place in a [`WaitQueue`]; leaves it when dropped (the caller went away).
pub(crate) struct Place<'q, T, R> {
    queue: &'q WaitQueue<T, R>,
    model: ModelId,
    key: (u64, u64),
    rx: oneshot::Receiver<Answer<R>>,
}

impl<T, R> Place<'_, T, R> {
    /// Waits for the answer until `deadline`; past it, leaves the queue (counted as `timeout`)
    /// and answers [`Unserved::Timeout`], unless the answer came at the deadline.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the place: the request leaves the queue at once (counted as
    /// `left`), and a reply sent meanwhile is dropped after the queue's lock is released.
    pub(crate) async fn wait(mut self, deadline: Instant) -> Answer<R> {
        match tokio::time::timeout_at(deadline, &mut self.rx).await {
            Ok(Ok(answer)) => answer,
            // the queue dropped the place without an answer: only when it is itself gone
            Ok(Err(_)) => Err(Unserved::Closed),
            Err(_) => {
                if !self.leave("timeout") {
                    // answered at the deadline: take it
                    if let Ok(answer) = self.rx.try_recv() {
                        return answer;
                    }
                }
                Err(Unserved::Timeout {
                    retry_after: self.queue.retry_after(&self.model),
                })
            }
        }
    }

    /// Leaves the queue; `false` when the place was already gone (served, failed or evicted:
    /// the answer is in `rx`).
    fn leave(&self, result: &'static str) -> bool {
        let mut queues = self.queue.lock();
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
        self.queue.waiting.fetch_sub(1, Ordering::AcqRel);
        record_wait(&self.model, result, w.enqueued);
        true
    }
}

impl<T, R> Drop for Place<'_, T, R> {
    fn drop(&mut self) {
        // the lock is released before `rx` (and any reply sent into it) is dropped
        self.leave("left");
    }
}

#[cfg(test)]
mod tests;
