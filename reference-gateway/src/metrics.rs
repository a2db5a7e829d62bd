//! Prometheus metrics (`GET /metrics` on the admin listener), recorded with the `metrics` facade
//! and rendered by `metrics-exporter-prometheus`.
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `spine_http_requests_total` | `route`, `status` | public API answers (route = the matched path) |
//! | `spine_request_outcomes_total` | `outcome` | settled requests: `completed`, `client_cancelled`, `cut_at_bound`, `upstream_failed`, `rejected` |
//! | `spine_billed_prompt_tokens_total` | `model` | prompt tokens paid for (`completed`, `client_cancelled`, `cut_at_bound`) |
//! | `spine_billed_completion_tokens_total` | `model` | completion tokens paid for |
//! | `spine_usage_discrepancies_total` | `node` | node claims beyond the tolerance (design brief §6) |
//! | `spine_settlement_errors_total` | | failed settlement attempts (each is retried) |
//! | `spine_rate_limited_total` | `limit` (`requests`, `tokens`) | 429s from the per-key limits |
//! | `spine_rate_limit_degraded` | | gauge: 1 while Redis is unreachable and rate limits are per instance |
//! | `spine_rate_limit_redis_fallback_total` | | rate-limit decisions taken locally (Redis failed or timed out) |
//! | `spine_ttft_seconds` | `route` | time to first byte of a 2xx body (streamed: the first event) |
//! | `spine_router_queue_depth` | `model` | gauge: requests waiting in the model's admission queue |
//! | `spine_router_queue_wait_seconds` | `model`, `result` (`served`, `timeout`, `left`, `evicted`, `failed`) | time spent queued |
//! | `spine_router_queue_total` | `result` (`queued`, `full` and the results above) | admission-queue events |
//! | `spine_audit_verdict` | `node`, `model`, `verdict` | gauge: 1 for the (node, model)'s current verdict, 0 for the others (design brief §10) |
//! | `spine_audit_tokens` | `node`, `model` | gauge: completion tokens audited |
//! | `spine_audit_statistic` | `node`, `model` | gauge: the test statistic Λ (fails at `spine_audit_fail_threshold`) |
//! | `spine_audit_fail_threshold` | | gauge: Λ at which a node's model fails |
//! | `spine_audit_requests_total` | `result` (`offered`, `sampled`, `dropped_queue_full`, `not_auditable`, `audited`, `inconclusive`) | audit sampling and scoring; `inconclusive`: the reference was down, slow or answered garbage |

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use metrics::{counter, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use spine_core::BoxError;
use spine_meter::meter::{DiscrepancyReport, MeterEvents};
use spine_meter::{LedgerError, SettleResult, Settlement};
use spine_router::NodeRegistry;

pub(crate) const HTTP_REQUESTS: &str = "spine_http_requests_total";
pub(crate) const OUTCOMES: &str = "spine_request_outcomes_total";
pub(crate) const BILLED_PROMPT: &str = "spine_billed_prompt_tokens_total";
pub(crate) const BILLED_COMPLETION: &str = "spine_billed_completion_tokens_total";
pub(crate) const DISCREPANCIES: &str = "spine_usage_discrepancies_total";
pub(crate) const SETTLE_ERRORS: &str = "spine_settlement_errors_total";
pub(crate) const RATE_LIMITED: &str = "spine_rate_limited_total";
pub(crate) const TTFT: &str = "spine_ttft_seconds";

/// Queue-wait buckets, seconds.
const QUEUE_WAIT_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
];

/// TTFT buckets, seconds.
const TTFT_BUCKETS: &[f64] = &[0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Sets the audit series from the auditor's state (called before each render).
pub(crate) fn record_audits(auditor: Option<&spine_meter::audit::Auditor>) {
    use spine_core::AuditVerdict as V;
    let Some(auditor) = auditor else { return };
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
    ] {
        counter!("spine_audit_requests_total", "result" => result).absolute(n);
    }
}

/// Installs the process-wide recorder and keeps its histograms drained.
pub(crate) fn install() -> Result<PrometheusHandle, Box<dyn std::error::Error + Send + Sync>> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(TTFT.to_owned()), TTFT_BUCKETS)?
        .set_buckets_for_metric(
            Matcher::Full(spine_router::queue::QUEUE_WAIT_METRIC.to_owned()),
            QUEUE_WAIT_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full(spine_transport::metric::FORWARD_SECONDS.to_owned()),
            spine_transport::metric::FORWARD_SECONDS_BUCKETS,
        )?
        .install_recorder()?;
    // every series the dashboards expect exists from the start, at 0
    for limit in ["requests", "tokens"] {
        counter!(RATE_LIMITED, "limit" => limit).absolute(0);
    }
    counter!(SETTLE_ERRORS).absolute(0);
    for result in [
        "queued", "full", "served", "timeout", "left", "evicted", "failed",
    ] {
        counter!(spine_router::queue::QUEUE_METRIC, "result" => result).absolute(0);
    }
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// Metering events → counters, and discrepancies to the router's per-node count.
pub(crate) struct GatewayEvents {
    pub(crate) registry: NodeRegistry,
}

impl MeterEvents for GatewayEvents {
    fn on_discrepancy(&self, report: &DiscrepancyReport) {
        let node = report
            .node
            .as_ref()
            .map_or_else(|| "none".to_owned(), |n| n.as_str().to_owned());
        counter!(DISCREPANCIES, "node" => node).increment(1);
        if let Some(node) = &report.node {
            self.registry.record_discrepancy(node);
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

pin_project_lite::pin_project! {
    /// A response body that records the time to its first data frame in `spine_ttft_seconds`.
    pub(crate) struct TtftBody<B> {
        #[pin]
        inner: B,
        start: Option<(Instant, &'static str)>,
    }
}

impl<B> TtftBody<B> {
    pub(crate) fn new(inner: B, start: Instant, route: &'static str) -> Self {
        Self {
            inner,
            start: Some((start, route)),
        }
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
