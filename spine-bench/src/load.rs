//! A load generator for OpenAI-compatible endpoints: open loop at a fixed request rate, or
//! closed loop (a fixed number of connections sending back to back) for maximum throughput.
//!
//! **No coordinated omission.** In open loop, request `i` is scheduled at `start + i / rate`;
//! its latency is measured from that scheduled time, not from when it was actually sent, so a
//! server that stalls is charged for every request that should have gone out during the stall
//! (Gil Tene's correction, as wrk2 does it). The schedule runs on a dedicated OS thread that
//! sleeps with `nanosleep` (tens of microseconds of jitter rather than tokio's 1 ms timer
//! granularity) and hands each request to the tokio runtime. At most
//! [`RunConfig::max_in_flight`] requests are outstanding; a scheduled request above that cap is
//! not sent and counts as `dropped` (the target cannot sustain the rate).
//!
//! **What is recorded** (all in microseconds, HdrHistogram, 3 significant digits):
//! - `latency`: scheduled send (open loop) or actual send (closed loop) → last body byte;
//! - `ttft`: the same start → the first complete SSE event (streamed runs);
//! - `itl_gap`: the gap between consecutive content events as the client receives them (events
//!   that arrive in the same read after the first get 0);
//! - `event_delay`: per content event, arrival wall-clock time minus the `x_sent_ns` stamp the
//!   mock engine put in it ([`crate::mock`]) — the per-event delivery delay; the difference
//!   between a path and the direct path is the per-event latency the path adds. Empty when the
//!   path strips the stamp.
//!
//! A request counts as `ok` when the status is 2xx and, streamed, the body ends with a
//! `data: [DONE]` event; anything else (status, transport error, timeout, missing `[DONE]`) is an
//! `error`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{header, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// Open loop: the p99 latency above which a rate counts as not sustained, µs (1 s).
pub const SUSTAINED_P99_MICROS: f64 = 1_000_000.0;

/// The endpoint under test.
#[derive(Clone, Debug)]
pub struct Target {
    /// Short name used in reports (`direct`, `spine`, `litellm`).
    pub name: String,
    /// Full URL of the completion endpoint, e.g. `http://127.0.0.1:8080/v1/chat/completions`.
    pub url: Uri,
    /// Sent as `Authorization: Bearer <key>` when set.
    pub api_key: Option<String>,
}

/// How load is offered.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// A fixed request rate, requests per second, latency from the scheduled send time.
    Open {
        /// Offered rate, requests per second.
        rate_per_sec: f64,
    },
    /// `concurrency` workers, each sending its next request when the previous one ended.
    Closed {
        /// Number of concurrent workers (and connections).
        concurrency: usize,
    },
}

/// One run's settings.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Open or closed loop.
    pub mode: Mode,
    /// How long load is offered.
    pub duration: Duration,
    /// Per-request timeout (counts as an error).
    pub timeout: Duration,
    /// Open loop: most requests outstanding at once; above it a scheduled request is dropped.
    pub max_in_flight: usize,
    /// The JSON request body.
    pub body: Bytes,
    /// Whether the body asks for a stream (the response must then end with `[DONE]`).
    pub stream: bool,
    /// Open loop: requests at least this slow (µs) are listed in [`Report::slow_requests`]
    /// with their scheduled time, and stream events whose delay (arrival − the engine's
    /// `x_sent_ns` stamp) is at least this in [`Report::slow_events`], to see whether the tail
    /// comes in bursts and where in a stream. `None`: none listed.
    pub slow_micros: Option<u64>,
}

/// A chat completion request body: one short user message, `max_tokens`, streamed or not
/// (streamed requests ask for `stream_options.include_usage`, as metered clients do).
pub fn chat_body(model: &str, stream: bool, max_tokens: u64) -> Bytes {
    let mut body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say the word the, many times."}],
        "max_tokens": max_tokens,
        "stream": stream,
    });
    if stream {
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    Bytes::from(body.to_string())
}

/// Percentiles of one histogram, microseconds.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Percentiles {
    /// Samples recorded.
    pub count: u64,
    /// Median, µs.
    pub p50_micros: f64,
    /// 90th percentile, µs.
    pub p90_micros: f64,
    /// 99th percentile, µs.
    pub p99_micros: f64,
    /// 99.9th percentile, µs.
    pub p999_micros: f64,
    /// Largest sample, µs.
    pub max_micros: f64,
}

impl Percentiles {
    fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let q = |q: f64| h.value_at_quantile(q) as f64;
        Self {
            count: h.len(),
            p50_micros: q(0.50),
            p90_micros: q(0.90),
            p99_micros: q(0.99),
            p999_micros: q(0.999),
            max_micros: h.max() as f64,
        }
    }
}

/// The result of one run, one JSON object per line in `spine-load run`'s output.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// The target's name.
    pub target: String,
    /// A free label for grouping (`non_streamed`, `stream_throughput`, …).
    pub scenario: String,
    /// How load was offered.
    pub mode: Mode,
    /// Whether requests were streamed.
    pub stream: bool,
    /// Seconds of offered load (open loop: the schedule; closed loop: until the last worker
    /// stopped).
    pub elapsed_secs: f64,
    /// Requests that completed correctly.
    pub ok: u64,
    /// Requests that failed (status, transport, timeout, missing `[DONE]`).
    pub errors: u64,
    /// `errors` by the answer's HTTP status (`0`: no answer head — a transport error or a
    /// timeout before it; a `200` whose body failed or lacked `[DONE]` counts under `200`), so
    /// a report says what failed (e.g. 429 refusals vs 503 overload).
    #[serde(default)]
    pub error_statuses: std::collections::BTreeMap<u16, u64>,
    /// Open loop: scheduled requests not sent because `max_in_flight` were outstanding.
    pub dropped: u64,
    /// `ok / elapsed_secs`.
    pub ok_per_sec: f64,
    /// SSE events received (streamed runs).
    pub events: u64,
    /// `events / elapsed_secs`.
    pub events_per_sec: f64,
    /// Request latency.
    pub latency: Percentiles,
    /// Time to the first event (streamed runs).
    pub ttft: Percentiles,
    /// Client-side gap between consecutive content events.
    pub itl_gap: Percentiles,
    /// Per content event: arrival minus the engine's send stamp.
    pub event_delay: Percentiles,
    /// CPU seconds (user + system) the watched processes used during the run
    /// (`/proc/<pid>/stat`, all threads), when pids were given.
    pub watched_cpu_secs: Option<f64>,
    /// [`Report::sustained`], stored for scripts reading the JSON line.
    #[serde(default)]
    pub sustained: bool,
    /// Open loop with [`RunConfig::slow_micros`]: `(scheduled send − start of the run, latency)`
    /// of each slow request, µs, in the order they finished (at most [`MAX_SLOW_LISTED`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slow_requests: Vec<(u64, u64)>,
    /// Open loop with [`RunConfig::slow_micros`], streamed: `(scheduled send of the stream −
    /// start of the run, µs; the event's index among the stream's stamped events; its delay,
    /// µs)` of each slow event (at most [`MAX_SLOW_LISTED`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slow_events: Vec<(u64, u32, u64)>,
}

/// Most slow requests one report lists.
pub const MAX_SLOW_LISTED: usize = 100_000;

impl Report {
    /// One human-readable line: counts, rates and latency percentiles.
    pub fn summary(&self) -> String {
        format!(
            "{:8} {:18} ok {} err {} dropped {} | {:.0} req/s {:.0} ev/s | p50 {:.2} ms p99 {:.2} ms{}",
            self.target,
            self.scenario,
            self.ok,
            self.errors,
            self.dropped,
            self.ok_per_sec,
            self.events_per_sec,
            self.latency.p50_micros / 1000.0,
            self.latency.p99_micros / 1000.0,
            if self.sustained() { "" } else { " (not sustained)" }
        ) + &if self.error_statuses.is_empty() {
            String::new()
        } else {
            format!(" | errors by status {}", self.error_statuses_text())
        }
    }

    /// The errors by HTTP status, `"429: 12, 0: 1"` (`0`: no answer head); `""` without errors.
    pub fn error_statuses_text(&self) -> String {
        let by: Vec<String> = self
            .error_statuses
            .iter()
            .map(|(status, n)| format!("{status}: {n}"))
            .collect();
        by.join(", ")
    }

    /// Whether the target kept up: at most 1 % errors and drops, and, in open loop, at least
    /// 95 % of the offered rate completed with a p99 latency under [`SUSTAINED_P99_MICROS`]
    /// (a queue that grows during the run shows as a p99 of seconds).
    pub fn sustained(&self) -> bool {
        let total = self.ok + self.errors + self.dropped;
        let errors_ok = total > 0 && (self.errors + self.dropped) * 100 <= total;
        match self.mode {
            Mode::Open { rate_per_sec } => {
                errors_ok
                    && self.ok_per_sec >= 0.95 * rate_per_sec
                    && self.latency.p99_micros <= SUSTAINED_P99_MICROS
            }
            Mode::Closed { .. } => errors_ok,
        }
    }
}

#[derive(Debug)]
struct Histograms {
    latency: Histogram<u64>,
    ttft: Histogram<u64>,
    itl_gap: Histogram<u64>,
    event_delay: Histogram<u64>,
}

fn histogram() -> Result<Histogram<u64>, hdrhistogram::CreationError> {
    // 1 µs .. 1 hour, 3 significant digits
    Histogram::new_with_bounds(1, 3_600_000_000, 3)
}

/// What one request measured.
#[derive(Debug, Default)]
struct Sample {
    ok: bool,
    /// The answer's HTTP status; 0 before an answer head arrived.
    status: u16,
    latency_micros: u64,
    ttft_micros: Option<u64>,
    gaps_micros: Vec<u64>,
    delays_micros: Vec<u64>,
    events: u64,
}

#[derive(Debug)]
struct Shared {
    hist: Mutex<Histograms>,
    ok: AtomicU64,
    errors: AtomicU64,
    error_statuses: Mutex<std::collections::BTreeMap<u16, u64>>,
    dropped: AtomicU64,
    events: AtomicU64,
    in_flight: AtomicUsize,
    slow: Mutex<Vec<(u64, u64)>>,
    slow_events: Mutex<Vec<(u64, u32, u64)>>,
}

impl Shared {
    fn record(&self, s: Sample) {
        if !s.ok {
            self.errors.fetch_add(1, Ordering::Relaxed);
            *self
                .error_statuses
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(s.status)
                .or_default() += 1;
            return;
        }
        self.ok.fetch_add(1, Ordering::Relaxed);
        self.events.fetch_add(s.events, Ordering::Relaxed);
        let mut h = self.hist.lock().unwrap_or_else(PoisonError::into_inner);
        h.latency.saturating_record(s.latency_micros.max(1));
        if let Some(t) = s.ttft_micros {
            h.ttft.saturating_record(t.max(1));
        }
        for g in s.gaps_micros {
            h.itl_gap.saturating_record(g.max(1));
        }
        for d in s.delays_micros {
            h.event_delay.saturating_record(d.max(1));
        }
    }
}

/// The HTTP client the generator uses: hyper's pooled HTTP/1.1 client with `TCP_NODELAY`.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A client with `TCP_NODELAY`, keep-alive and an idle pool large enough for `connections`.
pub fn client(connections: usize) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(connections.max(1))
        .pool_idle_timeout(Duration::from_secs(90))
        .build(connector)
}

fn wall_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Whether an SSE event carries generated text (a non-empty `content` or `text` string).
fn is_content_event(ev: &[u8]) -> bool {
    for key in [&b"\"content\":\""[..], &b"\"text\":\""[..]] {
        if let Some(i) = find(ev, key) {
            if ev.get(i + key.len()).is_some_and(|&b| b != b'"') {
                return true;
            }
        }
    }
    false
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The mock engine's `x_sent_ns:<digits>` stamp in an event (in its `system_fingerprint`), if
/// any.
fn sent_ns(ev: &[u8]) -> Option<u128> {
    const KEY: &[u8] = b"x_sent_ns:";
    let i = find(ev, KEY)? + KEY.len();
    let digits = ev[i..].iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&ev[i..i + digits]).ok()?.parse().ok()
}

async fn one(client: &HttpClient, target: &Target, cfg: &RunConfig, start: Instant) -> Sample {
    let mut sample = Sample::default();
    let mut req = Request::post(target.url.clone())
        .header(header::CONTENT_TYPE, "application/json")
        .header(
            header::HOST,
            target.url.authority().map_or("", |a| a.as_str()),
        );
    if let Some(key) = &target.api_key {
        req = req.header(header::AUTHORIZATION, format!("Bearer {key}"));
    }
    let Ok(req) = req.body(Full::new(cfg.body.clone())) else {
        return sample;
    };
    let Ok(resp) = client.request(req).await else {
        return sample;
    };
    sample.status = resp.status().as_u16();
    let success = resp.status().is_success();
    let mut body = resp.into_body();
    let mut pending: Vec<u8> = Vec::new();
    let mut last_content: Option<Instant> = None;
    let mut saw_done = false;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return sample;
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if !cfg.stream {
            continue;
        }
        let now = Instant::now();
        let now_ns = wall_ns();
        pending.extend_from_slice(&data);
        let mut first_in_read = true;
        while let Some(end) = find(&pending, b"\n\n") {
            let ev: Vec<u8> = pending.drain(..end + 2).collect();
            sample.events += 1;
            if sample.ttft_micros.is_none() {
                sample.ttft_micros = Some(micros(now.saturating_duration_since(start)));
            }
            if ev.starts_with(b"data: [DONE]") {
                saw_done = true;
            }
            if is_content_event(&ev) {
                if let Some(prev) = last_content {
                    let gap = if first_in_read {
                        micros(now.saturating_duration_since(prev))
                    } else {
                        0
                    };
                    sample.gaps_micros.push(gap);
                }
                last_content = Some(now);
                first_in_read = false;
                if let Some(sent) = sent_ns(&ev) {
                    let d = now_ns.saturating_sub(sent) / 1000;
                    sample
                        .delays_micros
                        .push(u64::try_from(d).unwrap_or(u64::MAX));
                }
            }
        }
    }
    sample.latency_micros = micros(Instant::now().saturating_duration_since(start));
    sample.ok = success && (!cfg.stream || saw_done);
    sample
}

/// CPU seconds (user + system, all threads) of `pid` from `/proc/<pid>/stat`; `None` when it
/// cannot be read (not Linux, process gone). Assumes `USER_HZ` = 100, Linux's fixed value.
pub fn process_cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // fields after the parenthesised command name; utime and stime are fields 14 and 15
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

fn cpu_total(pids: &[u32]) -> Option<f64> {
    if pids.is_empty() {
        return None;
    }
    pids.iter().map(|&p| process_cpu_secs(p)).sum()
}

/// Runs one measurement against `target` and returns its report.
///
/// `watch_pids`: processes whose CPU time is reported (the system under test).
///
/// # Errors
///
/// Only when a histogram cannot be created (never for the fixed bounds used).
///
/// # Cancel safety
///
/// Not cancel safe: dropping the future leaves the open-loop schedule thread to finish on its
/// own (it stops at the end of `cfg.duration`).
pub async fn run(
    client: &HttpClient,
    target: &Target,
    scenario: &str,
    cfg: &RunConfig,
    watch_pids: &[u32],
) -> Result<Report, hdrhistogram::CreationError> {
    let shared = Arc::new(Shared {
        hist: Mutex::new(Histograms {
            latency: histogram()?,
            ttft: histogram()?,
            itl_gap: histogram()?,
            event_delay: histogram()?,
        }),
        ok: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        error_statuses: Mutex::new(std::collections::BTreeMap::new()),
        dropped: AtomicU64::new(0),
        events: AtomicU64::new(0),
        in_flight: AtomicUsize::new(0),
        slow: Mutex::new(Vec::new()),
        slow_events: Mutex::new(Vec::new()),
    });
    let cpu_before = cpu_total(watch_pids);
    let started = Instant::now();
    let elapsed = match cfg.mode {
        Mode::Open { rate_per_sec } => {
            open_loop(client, target, cfg, rate_per_sec, &shared).await;
            cfg.duration
        }
        Mode::Closed { concurrency } => {
            closed_loop(client, target, cfg, concurrency, &shared).await;
            started.elapsed()
        }
    };
    let cpu_after = cpu_total(watch_pids);
    let h = shared.hist.lock().unwrap_or_else(PoisonError::into_inner);
    let secs = elapsed.as_secs_f64().max(1e-9);
    let ok = shared.ok.load(Ordering::Relaxed);
    let events = shared.events.load(Ordering::Relaxed);
    let mut report = Report {
        target: target.name.clone(),
        scenario: scenario.to_owned(),
        mode: cfg.mode,
        stream: cfg.stream,
        elapsed_secs: secs,
        ok,
        errors: shared.errors.load(Ordering::Relaxed),
        error_statuses: std::mem::take(
            &mut *shared
                .error_statuses
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        ),
        dropped: shared.dropped.load(Ordering::Relaxed),
        ok_per_sec: ok as f64 / secs,
        events,
        events_per_sec: events as f64 / secs,
        latency: Percentiles::of(&h.latency),
        ttft: Percentiles::of(&h.ttft),
        itl_gap: Percentiles::of(&h.itl_gap),
        event_delay: Percentiles::of(&h.event_delay),
        watched_cpu_secs: cpu_before.zip(cpu_after).map(|(b, a)| a - b),
        sustained: false,
        slow_requests: std::mem::take(
            &mut *shared.slow.lock().unwrap_or_else(PoisonError::into_inner),
        ),
        slow_events: std::mem::take(
            &mut *shared
                .slow_events
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        ),
    };
    report.sustained = report.sustained();
    Ok(report)
}

async fn open_loop(
    client: &HttpClient,
    target: &Target,
    cfg: &RunConfig,
    rate_per_sec: f64,
    shared: &Arc<Shared>,
) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let interval = Duration::from_secs_f64(1.0 / rate_per_sec.max(1e-3));
    let duration = cfg.duration;
    let origin = Instant::now() + Duration::from_millis(5);
    let origin_std = origin.into_std();
    // the schedule: nanosleep on its own thread, each due time handed to the runtime
    let scheduler = std::thread::spawn(move || {
        let mut i: u32 = 0;
        loop {
            let due = origin_std + interval.saturating_mul(i);
            if due.duration_since(origin_std) >= duration {
                break;
            }
            let now = std::time::Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if tx.send(Instant::from_std(due)).is_err() {
                break;
            }
            i = i.saturating_add(1);
        }
    });
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(due) = rx.recv().await {
        if shared.in_flight.load(Ordering::Relaxed) >= cfg.max_in_flight {
            shared.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        shared.in_flight.fetch_add(1, Ordering::Relaxed);
        let (client, target, cfg, shared) = (
            client.clone(),
            target.clone(),
            cfg.clone(),
            Arc::clone(shared),
        );
        tasks.spawn(async move {
            let sample = tokio::time::timeout(cfg.timeout, one(&client, &target, &cfg, due))
                .await
                .unwrap_or_default();
            if let Some(t) = cfg.slow_micros.filter(|_| sample.ok) {
                let at = micros(due.saturating_duration_since(origin));
                if sample.latency_micros >= t {
                    let mut slow = shared.slow.lock().unwrap_or_else(PoisonError::into_inner);
                    if slow.len() < MAX_SLOW_LISTED {
                        slow.push((at, sample.latency_micros));
                    }
                }
                let mut slow = shared
                    .slow_events
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                for (i, &d) in sample.delays_micros.iter().enumerate() {
                    if d >= t && slow.len() < MAX_SLOW_LISTED {
                        slow.push((at, u32::try_from(i).unwrap_or(u32::MAX), d));
                    }
                }
            }
            shared.record(sample);
            shared.in_flight.fetch_sub(1, Ordering::Relaxed);
        });
        // reap finished tasks so the set does not grow without bound
        while tasks.try_join_next().is_some() {}
    }
    let _ = scheduler.join();
    while tasks.join_next().await.is_some() {}
}

async fn closed_loop(
    client: &HttpClient,
    target: &Target,
    cfg: &RunConfig,
    concurrency: usize,
    shared: &Arc<Shared>,
) {
    let end = Instant::now() + cfg.duration;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (client, target, cfg, shared) = (
            client.clone(),
            target.clone(),
            cfg.clone(),
            Arc::clone(shared),
        );
        tasks.spawn(async move {
            while Instant::now() < end {
                let start = Instant::now();
                let sample = tokio::time::timeout(cfg.timeout, one(&client, &target, &cfg, start))
                    .await
                    .unwrap_or_default();
                shared.record(sample);
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::mock::{MockConfig, MockEngine};

    #[test]
    fn event_helpers() {
        let ev = br#"data: {"choices":[{"delta":{"content":" the"}}],"system_fingerprint":"x_sent_ns:1234567"}"#;
        assert!(is_content_event(ev));
        assert_eq!(sent_ns(ev), Some(1_234_567));
        assert!(!is_content_event(
            br#"data: {"choices":[{"delta":{"content":""}}]}"#
        ));
        assert!(is_content_event(br#"data: {"choices":[{"text":"x"}]}"#));
        assert_eq!(sent_ns(b"data: [DONE]"), None);
    }

    #[test]
    fn sustained_needs_the_rate_and_few_errors() {
        let mut r = Report {
            target: "t".into(),
            scenario: "s".into(),
            mode: Mode::Open {
                rate_per_sec: 100.0,
            },
            stream: false,
            elapsed_secs: 1.0,
            ok: 99,
            errors: 0,
            error_statuses: Default::default(),
            dropped: 0,
            ok_per_sec: 99.0,
            events: 0,
            events_per_sec: 0.0,
            latency: Percentiles::default(),
            ttft: Percentiles::default(),
            itl_gap: Percentiles::default(),
            event_delay: Percentiles::default(),
            watched_cpu_secs: None,
            sustained: false,
            slow_requests: Vec::new(),
            slow_events: Vec::new(),
        };
        assert!(r.sustained());
        r.dropped = 2;
        assert!(!r.sustained());
        r.dropped = 0;
        r.ok_per_sec = 90.0;
        assert!(!r.sustained());
    }

    #[tokio::test]
    async fn open_and_closed_loop_against_the_mock() {
        let engine = MockEngine::bind(
            ([127, 0, 0, 1], 0).into(),
            MockConfig {
                completion_tokens: 8,
                ..MockConfig::default()
            },
        )
        .await
        .unwrap();
        let target = Target {
            name: "direct".into(),
            url: format!("http://{}/v1/chat/completions", engine.addr())
                .parse()
                .unwrap(),
            api_key: None,
        };
        let c = client(8);
        let open = RunConfig {
            mode: Mode::Open {
                rate_per_sec: 200.0,
            },
            duration: Duration::from_millis(250),
            timeout: Duration::from_secs(5),
            max_in_flight: 100,
            body: chat_body("smollm2", true, 8),
            stream: true,
            slow_micros: Some(0),
        };
        let r = run(&c, &target, "stream", &open, &[std::process::id()])
            .await
            .unwrap();
        // 250 ms at 200 req/s: exactly 50 scheduled requests, every one answered
        assert_eq!(r.ok + r.errors + r.dropped, 50);
        assert_eq!(r.ok, 50, "{r:?}");
        // 8 content + finish + usage + [DONE] per stream
        assert_eq!(r.events, 50 * 11);
        assert_eq!(r.event_delay.count, 50 * 8);
        assert_eq!(r.itl_gap.count, 50 * 7);
        assert_eq!(r.ttft.count, 50);
        assert!(r.watched_cpu_secs.is_some());
        // every request is at least 0 µs slow: each listed once, at its scheduled time
        let mut at: Vec<u64> = r.slow_requests.iter().map(|(t, _)| t / 5_000).collect();
        at.sort_unstable();
        assert_eq!(at, (0..50).collect::<Vec<u64>>());
        // and every stamped event of each stream, with its index in the stream
        assert_eq!(r.slow_events.len(), 50 * 8);
        for i in 0..8 {
            assert_eq!(r.slow_events.iter().filter(|e| e.1 == i).count(), 50);
        }
        let closed = RunConfig {
            mode: Mode::Closed { concurrency: 4 },
            stream: false,
            body: chat_body("smollm2", false, 8),
            ..open
        };
        let r = run(&c, &target, "closed", &closed, &[]).await.unwrap();
        assert!(r.ok > 0);
        assert_eq!(r.errors, 0);
        assert_eq!(r.latency.count, r.ok);
        assert!(r.sustained());
        assert!(r.error_statuses.is_empty(), "{r:?}");
        // every answer a 404: each failure counted under its status
        let missing = Target {
            url: format!("http://{}/v1/no-such-path", engine.addr())
                .parse()
                .unwrap(),
            ..target
        };
        let r = run(&c, &missing, "missing", &closed, &[]).await.unwrap();
        assert_eq!(r.ok, 0);
        assert!(r.errors > 0);
        assert_eq!(
            r.error_statuses,
            std::collections::BTreeMap::from([(404, r.errors)])
        );
        assert!(!r.sustained());
        engine.shutdown();
    }
}
