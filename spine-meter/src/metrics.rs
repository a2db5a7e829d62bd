//! The meter's Prometheus series, recorded with the `metrics` facade (feature `metrics`; the
//! application installs the recorder and renders them).
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `spine_request_outcomes_total` | `outcome` | settled requests: `completed`, `client_cancelled`, `cut_at_bound`, `upstream_failed`, `rejected` |
//! | `spine_billed_prompt_tokens_total` | `model` | prompt tokens paid for (`completed`, `client_cancelled`, `cut_at_bound`) |
//! | `spine_billed_completion_tokens_total` | `model` | completion tokens paid for |
//! | `spine_usage_discrepancies_total` | `node` | node claims beyond the tolerance (design brief §6) |
//! | `spine_settlement_errors_total` | | failed settlement attempts (each is retried) |
//! | `spine_ttft_seconds` | `route` | time to first byte of a 2xx body (streamed: the first event) |
//! | `spine_ledger_commits_total` | | the SQLite file store's group commits (each one `COMMIT` of a batch of writes) |
//! | `spine_ledger_committed_writes_total` | | write transactions committed by them (÷ commits = writes per batch) |
//! | `spine_unsettled_requests` | | gauge: requests whose hold or settlement is not committed yet (bounded by `MeterConfig::max_unsettled_requests`) |
//! | `spine_audit_verdict` | `node`, `model`, `verdict` | gauge: 1 for the (node, model)'s current verdict, 0 for the others (design brief §10) |
//! | `spine_audit_tokens` | `node`, `model` | gauge: completion tokens audited |
//! | `spine_audit_statistic` | `node`, `model` | gauge: the test statistic Λ (fails at `spine_audit_fail_threshold`) |
//! | `spine_audit_fail_threshold` | | gauge: Λ at which a node's model fails |
//! | `spine_audit_requests_total` | `result` (`offered`, `sampled`, `dropped_queue_full`, `not_auditable`, `audited`, `inconclusive`, `node_logprobs`, `node_logprobs_missing`, `node_logprobs_short`) | audit sampling and scoring; `inconclusive`: the reference was down, slow or answered garbage; `node_logprobs`: audits scored on the node's own logprobs, `node_logprobs_missing`: of which the node sent none or a list that is not its text, `node_logprobs_short`: of which the list covered less of the text than an honest llama.cpp's (one event each) |

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use metrics::{counter, histogram};
use spine_core::{BoxError, NodeId};

use crate::meter::{DiscrepancyReport, MeterEvents};
use crate::{LedgerError, SettleResult, Settlement};

/// `spine_request_outcomes_total{outcome}`.
pub const OUTCOMES: &str = "spine_request_outcomes_total";
/// `spine_billed_prompt_tokens_total{model}`.
pub const BILLED_PROMPT: &str = "spine_billed_prompt_tokens_total";
/// `spine_billed_completion_tokens_total{model}`.
pub const BILLED_COMPLETION: &str = "spine_billed_completion_tokens_total";
/// `spine_usage_discrepancies_total{node}`.
pub const DISCREPANCIES: &str = "spine_usage_discrepancies_total";
/// `spine_settlement_errors_total`.
pub const SETTLE_ERRORS: &str = "spine_settlement_errors_total";
/// `spine_ledger_commits_total`: the SQLite file store's group commits.
pub const LEDGER_COMMITS: &str = "spine_ledger_commits_total";
/// `spine_ledger_committed_writes_total`: write transactions committed by
/// [`LEDGER_COMMITS`].
pub const LEDGER_COMMITTED_WRITES: &str = "spine_ledger_committed_writes_total";
/// `spine_unsettled_requests`: requests whose hold or settlement is not committed yet (a
/// gauge; bounded by `MeterConfig::max_unsettled_requests`).
pub const UNSETTLED_REQUESTS: &str = "spine_unsettled_requests";
/// `spine_ttft_seconds{route}` (a histogram).
pub const TTFT: &str = "spine_ttft_seconds";
/// Buckets of [`TTFT`], seconds.
pub const TTFT_BUCKETS: &[f64] = &[0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Called with the node of each usage discrepancy (e.g. to lower its routing score).
type DiscrepancyHook = Arc<dyn Fn(&NodeId) + Send + Sync>;

/// The meter's [`MeterEvents`] as counters: outcomes, billed tokens, settlement errors and
/// discrepancies (each also logged, and handed to the hook of
/// [`on_discrepancy`](Self::on_discrepancy)).
#[derive(Clone, Default)]
pub struct MeterMetrics {
    on_discrepancy: Option<DiscrepancyHook>,
}

impl std::fmt::Debug for MeterMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeterMetrics")
            .field("on_discrepancy", &self.on_discrepancy.is_some())
            .finish()
    }
}

impl MeterMetrics {
    /// Counts every event; [`SETTLE_ERRORS`] exists from the start, at 0.
    pub fn new() -> Self {
        counter!(SETTLE_ERRORS).absolute(0);
        Self::default()
    }

    /// Also calls `hook` with the node of each discrepancy.
    pub fn on_discrepancy(mut self, hook: impl Fn(&NodeId) + Send + Sync + 'static) -> Self {
        self.on_discrepancy = Some(Arc::new(hook));
        self
    }
}

impl MeterEvents for MeterMetrics {
    fn on_discrepancy(&self, report: &DiscrepancyReport) {
        let node = report
            .node
            .as_ref()
            .map_or_else(|| "none".to_owned(), |n| n.as_str().to_owned());
        counter!(DISCREPANCIES, "node" => node).increment(1);
        if let (Some(node), Some(hook)) = (&report.node, &self.on_discrepancy) {
            hook(node);
        }
        tracing::warn!(
            request_id = %report.request_id,
            node = ?report.node,
            billed_prompt = report.billed.prompt_tokens,
            billed_completion = report.billed.completion_tokens,
            claimed_prompt = report.claimed.prompt_tokens,
            claimed_completion = report.claimed.completion_tokens,
            "usage discrepancy"
        );
    }

    fn on_settled(&self, settlement: &Settlement, result: &SettleResult) {
        if result.already_settled {
            return;
        }
        counter!(OUTCOMES, "outcome" => settlement.outcome.as_str()).increment(1);
        if settlement.outcome.is_billed() {
            let model = settlement.model.as_str().to_owned();
            counter!(BILLED_PROMPT, "model" => model.clone())
                .increment(settlement.billed.prompt_tokens);
            counter!(BILLED_COMPLETION, "model" => model)
                .increment(settlement.billed.completion_tokens);
        }
    }

    fn on_settle_error(&self, _settlement: &Settlement, _error: &LedgerError) {
        counter!(SETTLE_ERRORS).increment(1);
    }
}

/// Sets the audit series from `auditor`'s state; call it before each render.
pub fn record_audits(auditor: &crate::audit::Auditor) {
    use spine_core::AuditVerdict as V;
    let mut threshold = None;
    for s in auditor.statuses() {
        let (node, model) = (s.node.to_string(), s.model.to_string());
        for v in [V::Unverified, V::Passing, V::Suspect, V::Failed] {
            metrics::gauge!("spine_audit_verdict", "node" => node.clone(), "model" => model.clone(), "verdict" => v.as_str())
                .set(if v == s.verdict { 1.0 } else { 0.0 });
        }
        metrics::gauge!("spine_audit_tokens", "node" => node.clone(), "model" => model.clone())
            .set(s.tokens_audited as f64);
        metrics::gauge!("spine_audit_statistic", "node" => node, "model" => model).set(s.statistic);
        threshold = Some(s.fail_threshold);
    }
    if let Some(t) = threshold {
        metrics::gauge!("spine_audit_fail_threshold").set(t);
    }
    let c = auditor.counters();
    for (result, n) in [
        ("offered", c.offered),
        ("sampled", c.sampled),
        ("dropped_queue_full", c.dropped_queue_full),
        ("not_auditable", c.not_auditable),
        ("audited", c.audited),
        ("inconclusive", c.inconclusive),
        ("node_logprobs", c.node_logprobs_audits),
        ("node_logprobs_missing", c.node_logprobs_missing),
        ("node_logprobs_short", c.node_logprobs_short),
    ] {
        counter!("spine_audit_requests_total", "result" => result).absolute(n);
    }
}

pin_project_lite::pin_project! {
    /// A response body that records the time from `start` to its first data frame in
    /// [`TTFT`]`{route}`, once.
    ///
    /// # End of stream
    ///
    /// Forwards `is_end_stream` and `size_hint`; records nothing for a body without data.
    pub struct TtftBody<B> {
        #[pin]
        inner: B,
        start: Option<(Instant, &'static str)>,
    }
}

impl<B> TtftBody<B> {
    /// Wraps `inner`, timed from `start`, labelled `route`.
    pub fn new(inner: B, start: Instant, route: &'static str) -> Self {
        Self {
            inner,
            start: Some((start, route)),
        }
    }
}

impl<B: std::fmt::Debug> std::fmt::Debug for TtftBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TtftBody")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<B> Body for TtftBody<B>
where
    B: Body<Data = Bytes, Error = BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if frame.is_data() {
                if let Some((start, route)) = this.start.take() {
                    histogram!(TTFT, "route" => route).record(start.elapsed().as_secs_f64());
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
