//! Prometheus metrics (`GET /metrics` on the admin listener), recorded with the `metrics` facade
//! and rendered by `metrics-exporter-prometheus`.
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `spine_http_requests_total` | `route`, `status` | public API answers (route = the matched path) |
//! | `spine_rate_limited_total` | `limit` (`requests`, `tokens`) | 429s from the per-key limits |
//! | `spine_rate_limit_degraded` | | gauge: 1 while Redis is unreachable and rate limits are per instance |
//! | `spine_rate_limit_redis_fallback_total` | | rate-limit decisions taken locally (Redis failed or timed out) |
//! | `spine_router_queue_depth` | `model` | gauge: requests waiting in the model's admission queue |
//! | `spine_router_queue_wait_seconds` | `model`, `result` (`served`, `timeout`, `left`, `evicted`, `failed`) | time spent queued |
//! | `spine_router_queue_total` | `result` (`queued`, `full` and the results above) | admission-queue events |
//!
//! The meter's and the auditor's series (outcomes, billed tokens, discrepancies, settlement
//! errors, TTFT, audits) are `spine_meter::metrics`'s; the router's and the tunnel's are
//! described by those crates.

use std::time::Duration;

use metrics::counter;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use spine_meter::metrics::{TTFT, TTFT_BUCKETS};

pub(crate) const HTTP_REQUESTS: &str = "spine_http_requests_total";
pub(crate) const RATE_LIMITED: &str = "spine_rate_limited_total";

/// Queue-wait buckets, seconds.
const QUEUE_WAIT_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
];

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
