//! The auditor: samples completed requests per node, scores them on a reference off the request
//! path, runs one test per (node, model) and answers the router's [`ModelTrust`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use bytes::Bytes;
use rand::Rng;
use serde::Serialize;
use spine_core::{AuditVerdict, ModelId, ModelTrust, NodeId, RequestId, RequestKind};
use std::collections::VecDeque;

use tokio::sync::Notify;

use super::node_logprobs::{
    judge_node_list, logprob_observations, missing_observation, NodeList, NodeLogprobs,
    TokenVocabulary,
};
use super::reference::{ForceQuery, Reference, ReferenceQuery};
use super::request::{auditable, AuditPrompt, NotAuditable};
use super::score::{observations, SamplingMode, ScoreConfig};
use super::sprt::{Observation, Sprt, SprtConfig};

/// A completed request offered for audit: what the node delivered for choice 0.
#[derive(Clone, Debug, PartialEq)]
pub struct AuditSample {
    /// The request.
    pub request_id: RequestId,
    /// The node that served it.
    pub node: NodeId,
    /// The model asked for.
    pub model: ModelId,
    /// The endpoint.
    pub kind: RequestKind,
    /// The caller's request body, as forwarded.
    pub request_body: Bytes,
    /// Choice 0's delivered `content` (`text` for completions), at most
    /// [`AuditTap::max_completion_bytes`] of it.
    pub completion: String,
    /// The request carried [`AuditAlways`] (a challenge): audited whatever the coin says.
    pub always: bool,
    /// Choice 0's logprobs as the node reported them, when the tap asked for them
    /// ([`AuditTap::node_logprobs`]); `None` when not asked.
    pub node_logprobs: Option<NodeLogprobs>,
}

/// A request extension: audit this request whatever the sampling rate says. The reference
/// gateway's challenges carry it (design brief §10); callers cannot set extensions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AuditAlways;

/// Where the metering layer offers completed requests for audit (design brief §10).
///
/// `offer` is called once per completed request whose choice 0 delivered plain text (no tool
/// calls, no reasoning), after the caller has been answered, on the settlement path: it must not
/// block (the [`Auditor`] flips a coin and queues, dropping when its queue is full).
pub trait AuditTap: Send + Sync + 'static {
    /// Most bytes of choice 0's text worth capturing per request.
    fn max_completion_bytes(&self) -> usize;
    /// A completed request, for the tap to audit or not.
    fn offer(&self, sample: AuditSample);

    /// Whether nodes serving `model` are asked for their logprobs ([`super::node_logprobs`]):
    /// the metering layer then adds `logprobs` to the body it forwards when the caller did not
    /// ask for them, removes them from the answer, and hands choice 0's list to
    /// [`offer`](Self::offer). Default `false`.
    fn node_logprobs(&self, model: &ModelId) -> bool {
        let _ = model;
        false
    }

    /// Most logprob entries worth capturing per request (the metering layer also stops at
    /// [`MAX_NODE_TOKENS`](super::node_logprobs::MAX_NODE_TOKENS)). Default 0.
    fn max_node_tokens(&self) -> usize {
        0
    }

    /// Whether the operator's credit for a request `node` served for `model` is held in escrow
    /// until the audit's verdict ([`Settlement::earnings_held`](crate::Settlement)). Asked at
    /// every settlement with a node; default `false`.
    fn earnings_held(&self, node: &NodeId, model: &ModelId) -> bool {
        let _ = (node, model);
        false
    }
}

/// Hooks the [`Auditor`] calls; every method has a no-op default, and `()` implements the
/// trait. Called on the auditor's worker task, outside its locks: do not block (spawn I/O).
pub trait AuditEvents: Send + Sync + 'static {
    /// A (node, model)'s verdict changed from `from` to `to` (a worker's audit moved it; not
    /// [`Auditor::reverify`]). The reference gateway pays the escrowed earnings on `→ passing`
    /// and forfeits them on `→ failed`.
    fn on_verdict(&self, node: &NodeId, model: &ModelId, from: AuditVerdict, to: AuditVerdict) {
        let _ = (node, model, from, to);
    }
}

impl AuditEvents for () {}

/// Settings of an [`Auditor`]. [`Default`] gives the documented values.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct AuditConfig {
    /// Share of a `passing` node's completed requests audited. Default 0.02.
    pub rate_passing: f64,
    /// Share audited while a node's model is `unverified` (new nodes). Default 0.25.
    pub rate_unverified: f64,
    /// Share audited while `suspect`. Default 0.5.
    pub rate_suspect: f64,
    /// Most completion tokens scored per audit (the first ones). Default 256.
    pub max_tokens: usize,
    /// Samples waiting for the reference; more are dropped (counted). Default 64.
    pub queue: usize,
    /// Samples of one (node, model) waiting at once; more of that pair are dropped (counted).
    /// With the round-robin below, traffic to some nodes (a flood an adversary pays for) cannot
    /// crowd out the audits of others. Default 2.
    pub queue_per_pair: usize,
    /// Audits scored at once (reference requests in flight). Default 1.
    pub concurrency: usize,
    /// Longest one scoring may take before the audit is inconclusive. Default 120 s.
    pub timeout: Duration,
    /// The test's error and design rates.
    pub sprt: SprtConfig,
    /// The statistics' constants.
    pub score: ScoreConfig,
}

impl Default for AuditConfig {
    fn default() -> Self {
        Self {
            rate_passing: 0.02,
            rate_unverified: 0.25,
            rate_suspect: 0.5,
            max_tokens: 256,
            queue: 64,
            queue_per_pair: 2,
            concurrency: 1,
            timeout: Duration::from_secs(120),
            sprt: SprtConfig::default(),
            score: ScoreConfig::default(),
        }
    }
}

impl AuditConfig {
    /// Sets all three audit rates to `rate` (tests, benchmarks: audit everything).
    pub fn with_rate(mut self, rate: f64) -> Self {
        self.rate_passing = rate;
        self.rate_unverified = rate;
        self.rate_suspect = rate;
        self
    }

    /// Sets the test's rates.
    pub fn with_sprt(mut self, sprt: SprtConfig) -> Self {
        self.sprt = sprt;
        self
    }
}

/// The audit state of one (node, model), for admin views and metrics.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AuditStatus {
    /// The node.
    pub node: NodeId,
    /// The model.
    pub model: ModelId,
    /// The verdict now.
    pub verdict: AuditVerdict,
    /// Scored positions (completion tokens) so far.
    pub tokens_audited: u64,
    /// Of which events ([`Observation::is_event`](super::Observation::is_event)): greedy, the
    /// reference's clear top-1 did not continue the text; sampled, the text's surprisal
    /// exceeded its bound at that position (common for honest nodes too: the evidence is
    /// `statistic`).
    pub events: u64,
    /// The test statistic Λ now.
    pub statistic: f64,
    /// Λ at or above which the verdict is `failed`.
    pub fail_threshold: f64,
    /// Λ at or below which the verdict is `passing`.
    pub pass_threshold: f64,
    /// Requests scored.
    pub audits: u64,
    /// Audits the reference could not score (down, slow, garbage): never the node's fault.
    pub inconclusive: u64,
}

/// Counters of the auditor, for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AuditCounters {
    /// Requests offered.
    pub offered: u64,
    /// Offered requests the coin chose.
    pub sampled: u64,
    /// Chosen but dropped: the queue was full.
    pub dropped_queue_full: u64,
    /// Chosen but not auditable (constrained sampling, tools, temperature > 1, …).
    pub not_auditable: u64,
    /// Scored by the reference.
    pub audited: u64,
    /// The reference could not score them.
    pub inconclusive: u64,
    /// Positions scored.
    pub tokens_scored: u64,
    /// Audits scored on the node's own logprobs ([`super::node_logprobs`]).
    pub node_logprobs_audits: u64,
    /// Of which the node, asked for its logprobs, sent none or a list that is not its
    /// delivered text (one event each).
    pub node_logprobs_missing: u64,
    /// Of which the node's list, not cut by the capture's bound, spelled less of its delivered
    /// text than an honest llama.cpp's would ([`super::node_logprobs::honest_tail`]; one event
    /// each, as a missing list).
    pub node_logprobs_short: u64,
}

#[derive(Debug, Default)]
struct Counters {
    offered: AtomicU64,
    sampled: AtomicU64,
    dropped_queue_full: AtomicU64,
    not_auditable: AtomicU64,
    audited: AtomicU64,
    inconclusive: AtomicU64,
    tokens_scored: AtomicU64,
    node_logprobs_audits: AtomicU64,
    node_logprobs_missing: AtomicU64,
    node_logprobs_short: AtomicU64,
}

#[derive(Clone, Copy, Debug, Default)]
struct Pair {
    sprt: Sprt,
    audits: u64,
    inconclusive: u64,
    /// When the last audit of the pair ended (scored or inconclusive).
    last_audit: Option<tokio::time::Instant>,
}

type PairKey = (NodeId, ModelId);

struct Inner {
    config: AuditConfig,
    reference: Arc<dyn Reference>,
    events: Arc<dyn AuditEvents>,
    /// The reference vocabularies of the models whose nodes report their logprobs.
    vocabularies: HashMap<ModelId, Arc<TokenVocabulary>>,
    pairs: Mutex<HashMap<PairKey, Pair>>,
    queue: Mutex<AuditQueue>,
    /// Wakes a worker when a sample is queued, and every worker when the auditor is dropped.
    wake: Arc<Notify>,
    counters: Counters,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.wake.notify_waiters();
    }
}

/// Samples waiting for the reference: one queue per (node, model), served round-robin.
#[derive(Debug, Default)]
struct AuditQueue {
    per_pair: HashMap<PairKey, VecDeque<AuditSample>>,
    /// Pairs with samples waiting, in serving order.
    order: VecDeque<PairKey>,
    total: usize,
}

impl AuditQueue {
    /// Queues `sample` unless the pair or the whole queue is full; whether it was queued.
    fn push(&mut self, sample: AuditSample, per_pair: usize, total: usize) -> bool {
        let key = (sample.node.clone(), sample.model.clone());
        let q = self.per_pair.entry(key.clone()).or_default();
        if q.len() >= per_pair.max(1) || self.total >= total.max(1) {
            if q.is_empty() {
                self.per_pair.remove(&key);
            }
            return false;
        }
        if q.is_empty() {
            self.order.push_back(key);
        }
        q.push_back(sample);
        self.total += 1;
        true
    }

    /// The next sample: the first waiting pair's oldest, that pair then goes to the back.
    fn pop(&mut self) -> Option<AuditSample> {
        let key = self.order.pop_front()?;
        let q = self.per_pair.get_mut(&key)?;
        let sample = q.pop_front();
        if q.is_empty() {
            self.per_pair.remove(&key);
        } else {
            self.order.push_back(key);
        }
        self.total -= usize::from(sample.is_some());
        sample
    }
}

/// Samples completed requests, scores them on a [`Reference`] off the request path, and keeps a
/// sequential test per (node, model) (design brief §10; the statistics in [`super::score`], the
/// test in [`super::sprt`]).
///
/// Which requests are audited is decided after they completed, by a coin whose bias follows the
/// node's verdict ([`AuditConfig`]); the node cannot tell an audited request from any other, and
/// nothing about the caller's response changes. A reference that is down, slow or answers
/// garbage makes the audit inconclusive (counted per pair and in [`AuditCounters`]), never a
/// verdict. Implements [`AuditTap`] for the metering layer and [`ModelTrust`] for the router.
///
/// Cheap to clone (shared state). The workers end when the last clone is dropped.
#[derive(Clone)]
pub struct Auditor {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Auditor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auditor")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Auditor {
    /// An auditor scoring on `reference`, its workers spawned on the current tokio runtime.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn spawn(config: AuditConfig, reference: Arc<dyn Reference>) -> Self {
        Self::spawn_with(config, reference, Arc::new(()))
    }

    /// As [`Auditor::spawn`], calling `events` on verdict changes.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn spawn_with(
        config: AuditConfig,
        reference: Arc<dyn Reference>,
        events: Arc<dyn AuditEvents>,
    ) -> Self {
        Self::spawn_with_node_logprobs(config, reference, events, HashMap::new())
    }

    /// As [`Auditor::spawn_with`]; the models in `vocabularies` are audited on their nodes'
    /// own logprobs ([`super::node_logprobs`]: the tap asks for them, [`Reference::force`]
    /// scores them), each with its reference's vocabulary.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn spawn_with_node_logprobs(
        config: AuditConfig,
        reference: Arc<dyn Reference>,
        events: Arc<dyn AuditEvents>,
        vocabularies: HashMap<ModelId, Arc<TokenVocabulary>>,
    ) -> Self {
        let wake = Arc::new(Notify::new());
        let inner = Arc::new(Inner {
            config,
            reference,
            events,
            vocabularies,
            pairs: Mutex::default(),
            queue: Mutex::default(),
            wake: wake.clone(),
            counters: Counters::default(),
        });
        for _ in 0..config.concurrency.max(1) {
            tokio::spawn(worker(Arc::downgrade(&inner), wake.clone()));
        }
        Self { inner }
    }

    /// The settings.
    pub fn config(&self) -> &AuditConfig {
        &self.inner.config
    }

    fn pairs(&self) -> std::sync::MutexGuard<'_, HashMap<PairKey, Pair>> {
        self.inner
            .pairs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The verdict of `node` for `model` (`unverified` when never audited).
    pub fn verdict(&self, node: &NodeId, model: &ModelId) -> AuditVerdict {
        self.pairs()
            .get(&(node.clone(), model.clone()))
            .map_or(AuditVerdict::Unverified, |p| {
                p.sprt.verdict(&self.inner.config.sprt)
            })
    }

    /// Every audited (node, model), sorted by node then model.
    pub fn statuses(&self) -> Vec<AuditStatus> {
        let sprt = self.inner.config.sprt;
        let mut out: Vec<AuditStatus> = self
            .pairs()
            .iter()
            .map(|((node, model), p)| AuditStatus {
                node: node.clone(),
                model: model.clone(),
                verdict: p.sprt.verdict(&sprt),
                tokens_audited: p.sprt.observations,
                events: p.sprt.events,
                statistic: p.sprt.llr,
                fail_threshold: sprt.fail_threshold(),
                pass_threshold: sprt.pass_threshold(),
                audits: p.audits,
                inconclusive: p.inconclusive,
            })
            .collect();
        out.sort_by(|a, b| (&a.node, &a.model).cmp(&(&b.node, &b.model)));
        out
    }

    /// The audit states of `node`.
    pub fn statuses_of(&self, node: &NodeId) -> Vec<AuditStatus> {
        self.statuses()
            .into_iter()
            .filter(|s| &s.node == node)
            .collect()
    }

    /// The counters.
    pub fn counters(&self) -> AuditCounters {
        let c = &self.inner.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        AuditCounters {
            offered: l(&c.offered),
            sampled: l(&c.sampled),
            dropped_queue_full: l(&c.dropped_queue_full),
            not_auditable: l(&c.not_auditable),
            audited: l(&c.audited),
            inconclusive: l(&c.inconclusive),
            tokens_scored: l(&c.tokens_scored),
            node_logprobs_audits: l(&c.node_logprobs_audits),
            node_logprobs_missing: l(&c.node_logprobs_missing),
            node_logprobs_short: l(&c.node_logprobs_short),
        }
    }

    /// Starts `node`'s test for `model` over (the operator re-verified it): `unverified`, routed
    /// again, audited at the `unverified` rate. Returns whether there was a state to reset.
    pub fn reverify(&self, node: &NodeId, model: &ModelId) -> bool {
        self.pairs()
            .remove(&(node.clone(), model.clone()))
            .is_some()
    }

    /// Scores one sample now, on the calling task (the workers' step; public for benchmarks
    /// and for callers that schedule audits themselves). Returns the verdict after it, or
    /// `None` when the sample was not auditable or the reference could not score it.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the audit; nothing is recorded.
    pub async fn audit_now(&self, sample: AuditSample) -> Option<AuditVerdict> {
        audit_one(&self.inner, sample).await
    }

    /// Whether `node`'s `model` should be challenged: not `failed`, and no audit of it ended
    /// in the last `quiet` (never audited counts as quiet).
    pub fn is_quiet(&self, node: &NodeId, model: &ModelId, quiet: Duration) -> bool {
        match self.pairs().get(&(node.clone(), model.clone())) {
            None => true,
            Some(p) => !p.sprt.rejected && p.last_audit.is_none_or(|t| t.elapsed() >= quiet),
        }
    }

    fn rate_for(&self, node: &NodeId, model: &ModelId) -> f64 {
        let c = &self.inner.config;
        match self.verdict(node, model) {
            AuditVerdict::Passing => c.rate_passing,
            AuditVerdict::Suspect => c.rate_suspect,
            AuditVerdict::Failed => 0.0,
            _ => c.rate_unverified,
        }
    }
}

impl AuditTap for Auditor {
    fn max_completion_bytes(&self) -> usize {
        // the longest tokens of the catalog's vocabularies are far under 64 bytes
        self.inner.config.max_tokens.saturating_mul(64)
    }

    fn earnings_held(&self, node: &NodeId, model: &ModelId) -> bool {
        self.verdict(node, model) == AuditVerdict::Suspect
    }

    fn node_logprobs(&self, model: &ModelId) -> bool {
        self.inner.vocabularies.contains_key(model)
    }

    fn max_node_tokens(&self) -> usize {
        self.inner.config.max_tokens
    }

    fn offer(&self, sample: AuditSample) {
        let c = &self.inner.counters;
        c.offered.fetch_add(1, Ordering::Relaxed);
        let rate = if sample.always && self.verdict(&sample.node, &sample.model).routable() {
            1.0
        } else {
            self.rate_for(&sample.node, &sample.model)
        };
        if rate <= 0.0 || !rand::rng().random_bool(rate.min(1.0)) {
            return;
        }
        c.sampled.fetch_add(1, Ordering::Relaxed);
        let config = &self.inner.config;
        let queued = self
            .inner
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(sample, config.queue_per_pair, config.queue);
        if queued {
            self.inner.wake.notify_one();
        } else {
            c.dropped_queue_full.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl ModelTrust for Auditor {
    fn routable(&self, node: &NodeId, model: &ModelId) -> bool {
        self.verdict(node, model).routable()
    }
}

async fn worker(inner: Weak<Inner>, wake: Arc<Notify>) {
    loop {
        let notified = wake.notified();
        let sample = {
            let Some(inner) = inner.upgrade() else { return };
            let sample = inner
                .queue
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            sample.map(|sample| (inner, sample))
        };
        match sample {
            Some((inner, sample)) => {
                audit_one(&inner, sample).await;
            }
            None => notified.await,
        }
    }
}

async fn audit_one(inner: &Inner, sample: AuditSample) -> Option<AuditVerdict> {
    let counters = &inner.counters;
    let config = &inner.config;
    let req = match auditable(sample.kind, &sample.request_body) {
        Ok(r) => r,
        Err(why) => {
            counters.not_auditable.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(request_id = %sample.request_id, ?why, "not auditable");
            let _: NotAuditable = why;
            return None;
        }
    };
    let key = (sample.node.clone(), sample.model.clone());
    let obs = match (
        inner.vocabularies.get(&sample.model),
        sample.node_logprobs.as_ref(),
    ) {
        (Some(vocab), Some(node)) => {
            counters
                .node_logprobs_audits
                .fetch_add(1, Ordering::Relaxed);
            node_logprob_observations(inner, vocab, node, &sample, req.prompt).await
        }
        _ => {
            let query = ReferenceQuery {
                model: sample.model.clone(),
                prompt: req.prompt,
                completion: sample.completion.clone(),
                max_tokens: config.max_tokens,
            };
            text_observations(inner, &query, req.mode).await
        }
    };
    let mut pairs = inner.pairs.lock().unwrap_or_else(PoisonError::into_inner);
    let pair = pairs.entry(key).or_default();
    pair.last_audit = Some(tokio::time::Instant::now());
    let obs = match obs {
        Ok(obs) => obs,
        Err(why) => {
            pair.inconclusive += 1;
            counters.inconclusive.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(request_id = %sample.request_id, node = %sample.node, error = %why, "audit inconclusive");
            return None;
        }
    };
    let before = pair.sprt.verdict(&config.sprt);
    for o in &obs {
        pair.sprt.observe(&config.sprt, *o);
    }
    pair.audits += 1;
    counters.audited.fetch_add(1, Ordering::Relaxed);
    counters
        .tokens_scored
        .fetch_add(obs.len() as u64, Ordering::Relaxed);
    let after = pair.sprt.verdict(&config.sprt);
    let (tokens_audited, events, statistic) =
        (pair.sprt.observations, pair.sprt.events, pair.sprt.llr);
    drop(pairs);
    if after != before {
        tracing::warn!(
            node = %sample.node,
            model = %sample.model,
            from = before.as_str(),
            to = after.as_str(),
            tokens_audited,
            events,
            statistic,
            "audit verdict changed"
        );
        inner
            .events
            .on_verdict(&sample.node, &sample.model, before, after);
    }
    Some(after)
}

/// The rank/PIT statistic of the delivered text ([`super::score`]).
async fn text_observations(
    inner: &Inner,
    query: &ReferenceQuery,
    mode: SamplingMode,
) -> Result<Vec<Observation>, String> {
    let config = &inner.config;
    match tokio::time::timeout(config.timeout, inner.reference.score(query)).await {
        Ok(Ok(tokens)) => observations(&tokens, query.completion.as_bytes(), mode, &config.score)
            .map_err(|e| e.to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("the reference took over {:?}", config.timeout)),
    }
}

/// The node's claimed logprobs against the reference's ([`super::node_logprobs`]): one event
/// for a missing, misaligned or short list, else one observation per scored position (a list
/// in another vocabulary: both, [`NodeList::Foreign`]).
async fn node_logprob_observations(
    inner: &Inner,
    vocab: &TokenVocabulary,
    node: &NodeLogprobs,
    sample: &AuditSample,
    prompt: AuditPrompt,
) -> Result<Vec<Observation>, String> {
    let config = &inner.config;
    let event = |counter: &AtomicU64| {
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(vec![missing_observation()])
    };
    let mut out = Vec::new();
    let aligned = match judge_node_list(
        vocab,
        node,
        sample.completion.as_bytes(),
        &sample.request_body,
        config.max_tokens,
    ) {
        NodeList::Aligned(a) => a,
        NodeList::Foreign { at, by_bytes } => {
            tracing::info!(request_id = %sample.request_id, node = %sample.node, at = at.0, "node logprobs in another vocabulary: scored by their bytes");
            inner
                .counters
                .node_logprobs_missing
                .fetch_add(1, Ordering::Relaxed);
            out.push(missing_observation());
            by_bytes
        }
        NodeList::Short {
            covered_bytes,
            delivered_bytes,
        } => {
            tracing::info!(request_id = %sample.request_id, node = %sample.node, covered_bytes, delivered_bytes, "node logprobs short");
            return event(&inner.counters.node_logprobs_short);
        }
        other => {
            tracing::info!(request_id = %sample.request_id, node = %sample.node, error = ?node.error, list = ?other, "node sent no usable logprobs, or a list that is not its text");
            return event(&inner.counters.node_logprobs_missing);
        }
    };
    if aligned.scored() == 0 {
        return Ok(out);
    }
    let query = ForceQuery {
        model: sample.model.clone(),
        prompt,
        tokens: aligned.tokens,
    };
    let forced = match tokio::time::timeout(config.timeout, inner.reference.force(&query)).await {
        Ok(Ok(r)) if r.len() == aligned.logprobs.len() => Ok(r),
        Ok(Ok(r)) => Err(format!(
            "the reference forced {} of {} tokens",
            r.len(),
            aligned.logprobs.len()
        )),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("the reference took over {:?}", config.timeout)),
    };
    let reference = match forced {
        Ok(r) => r,
        // a list in another vocabulary is an event without the reference
        Err(e) if !out.is_empty() => {
            tracing::info!(request_id = %sample.request_id, node = %sample.node, error = %e, "reference failed: the foreign list's event only");
            return Ok(out);
        }
        Err(e) => return Err(e),
    };
    out.extend(logprob_observations(
        &aligned.logprobs,
        &reference,
        config.score.logprob_event_nats,
    ));
    Ok(out)
}
