use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Uri};
use http_body_util::{BodyExt as _, Empty, Limited};
use hyper::client::conn::http2::SendRequest;
use spine_core::{BoxBody, NodeId};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::state::{SessionShared, Shared};
use super::{now_ms, TunnelState, HEALTH_PATH, PROBE_PATH};
use crate::metric;

/// The result of one health probe.
struct ProbeResult {
    healthy: bool,
    /// The model ids `GET /v1/models` listed, when it could be read.
    listed: Option<Vec<String>>,
    /// The health probe got no answer in time (rather than a bad status or an error).
    timed_out: bool,
}

/// Largest `GET /v1/models` answer read from a node, bytes.
const MAX_MODELS_BODY_BYTES: usize = 1024 * 1024;

/// `GET /health`, then (when healthy) `GET /v1/models`, through the tunnel.
async fn probe_health(sender: &mut SendRequest<BoxBody>, timeout: Duration) -> ProbeResult {
    let health = async {
        sender.ready().await?;
        let resp = sender.send_request(get_request(HEALTH_PATH)).await?;
        let status = resp.status();
        // read the (small) body so the stream ends cleanly
        let _ = Limited::new(resp.into_body(), 64 * 1024).collect().await;
        Ok::<_, hyper::Error>(status)
    };
    let mut timed_out = false;
    let healthy = match tokio::time::timeout(timeout, health).await {
        Ok(Ok(status)) if status.is_success() => true,
        Ok(Ok(status)) => {
            debug!(status = status.as_u16(), "health probe not ok");
            false
        }
        Ok(Err(e)) => {
            debug!(error = %e, "health probe failed");
            false
        }
        Err(_) => {
            debug!("health probe timed out");
            timed_out = true;
            false
        }
    };
    if !healthy {
        return ProbeResult {
            healthy,
            listed: None,
            timed_out,
        };
    }
    let models = async {
        sender.ready().await.ok()?;
        let resp = sender.send_request(get_request("/v1/models")).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = Limited::new(resp.into_body(), MAX_MODELS_BODY_BYTES)
            .collect()
            .await
            .ok()?
            .to_bytes();
        #[derive(serde::Deserialize)]
        struct List {
            data: Vec<Entry>,
        }
        #[derive(serde::Deserialize)]
        struct Entry {
            id: String,
        }
        let list: List = serde_json::from_slice(&body).ok()?;
        Some(list.data.into_iter().map(|e| e.id).collect::<Vec<_>>())
    };
    let listed = tokio::time::timeout(timeout, models).await.ok().flatten();
    ProbeResult {
        healthy,
        listed,
        timed_out: false,
    }
}

/// The session's health loop (design brief §4): probe every `health_probe_interval` until the
/// first success (then the node is ready), then every `health_check_interval`; after
/// `health_failures_to_leave` failures in a row the node leaves routing until a probe passes.
/// Never returns; the session ends by its connection ending or being replaced.
pub(super) async fn maintain(
    shared: &Shared,
    node: &NodeId,
    session_id: u64,
    session: &SessionShared,
    mut sender: SendRequest<BoxBody>,
) {
    let config = &shared.config;
    let stall_detection = !config.stall_timeout.is_zero();
    loop {
        let progress_before = session.progress.load(Ordering::Relaxed);
        let busy_before = session.streams_open.load(Ordering::Acquire) > 0;
        let result = if sender.is_closed() {
            ProbeResult {
                healthy: false,
                listed: None,
                timed_out: false,
            }
        } else {
            probe_health(&mut sender, config.health_probe_timeout).await
        };
        // Stalled: the probe timed out while requests were in flight and none of them received
        // anything meanwhile. Two signals agree that the engine is hung (a busy engine keeps
        // streaming, or answers its health probe), so one such probe takes the node out.
        let stalled = stall_detection
            && !result.healthy
            && result.timed_out
            && busy_before
            && session.streams_open.load(Ordering::Acquire) > 0
            && session.progress.load(Ordering::Relaxed) == progress_before;
        // A probe that timed out while every request stream was in use, with data still
        // arriving, says the node is busy, not that it is sick: an agent of this crate keeps a
        // stream free for probes, but a busy node must not leave routing even when it does not.
        let inconclusive = !stalled
            && !result.healthy
            && result.timed_out
            && session.streams_open.load(Ordering::Relaxed) >= session.max_streams;
        if inconclusive {
            debug!(%node, "health probe timed out while the node is full and streaming; not counted");
        } else if !result.healthy {
            metrics::counter!(metric::HEALTH_PROBE_FAILURES).increment(1);
        }
        let mut heartbeat = false;
        let warming = {
            let mut sessions = shared.sessions();
            let Some(s) = sessions.get_mut(node).filter(|s| s.id == session_id) else {
                return;
            };
            if inconclusive {
                // neither a pass nor a failure
            } else if result.healthy {
                s.consecutive_probe_failures = 0;
                s.last_probe_ok_unix_ms = Some(now_ms());
                s.models_running = s
                    .descriptor
                    .models
                    .iter()
                    .map(|m| {
                        result
                            .listed
                            .as_ref()
                            .is_none_or(|l| l.iter().any(|id| id == m.id.as_str()))
                    })
                    .collect();
                s.state = TunnelState::Ready;
                if !s.routable {
                    s.routable = true;
                    metrics::gauge!(metric::NODES_ROUTABLE).increment(1.0);
                    info!(%node, "node ready");
                    shared.events.node_ready(node, &s.descriptor);
                }
                heartbeat = true;
            } else {
                s.consecutive_probe_failures = s.consecutive_probe_failures.saturating_add(1);
                s.models_running.iter_mut().for_each(|r| *r = false);
                if s.state != TunnelState::Warming
                    && (stalled
                        || s.consecutive_probe_failures >= config.health_failures_to_leave.max(1))
                {
                    s.state = TunnelState::Unhealthy;
                    if s.routable {
                        s.routable = false;
                        metrics::gauge!(metric::NODES_ROUTABLE).decrement(1.0);
                        if stalled {
                            warn!(
                                %node,
                                streams_open = session.streams_open.load(Ordering::Relaxed),
                                "no progress on the node's streams and its health probe timed \
                                 out; node leaves routing"
                            );
                        } else {
                            warn!(
                                %node,
                                failures = s.consecutive_probe_failures,
                                "health probes failing; node leaves routing"
                            );
                        }
                        shared.events.node_gone(node);
                    }
                }
            }
            s.state == TunnelState::Warming
        };
        if stalled {
            metrics::counter!(metric::NODE_STALLS).increment(1);
            // streams that received nothing yet fail now, to be retried elsewhere
            session
                .stall
                .send_modify(|epoch| *epoch = epoch.wrapping_add(1));
        }
        if heartbeat {
            shared.heartbeat(node, session);
        }
        // Warming, failing or out of routing: probe often, so a failure is confirmed and a
        // recovered node comes back within about `health_probe_interval`; a ready node (or one
        // busy streaming) every `health_check_interval`.
        let wait = if warming || !(result.healthy || inconclusive) {
            config.health_probe_interval
        } else {
            config.health_check_interval
        };
        // A passing probe restarts the stall clock: a node busy with long non-streamed requests
        // (no bytes until the end) is probed once per `stall_timeout`, not every tick.
        let quiet_floor = if result.healthy {
            session.quiet_for()
        } else {
            Duration::ZERO
        };
        wait_or_stall(shared, node, session_id, session, wait, quiet_floor).await;
    }
}

/// Sleeps `wait`, but returns early, to probe at once, when the node is routable, has streams
/// open and has received nothing on them for `stall_timeout` (checked every
/// `health_probe_interval`). `quiet_floor`: the quiet time already accounted for by a passing
/// probe, which does not count again.
async fn wait_or_stall(
    shared: &Shared,
    node: &NodeId,
    session_id: u64,
    session: &SessionShared,
    wait: Duration,
    quiet_floor: Duration,
) {
    let config = &shared.config;
    let until = Instant::now() + wait;
    if config.stall_timeout.is_zero() {
        tokio::time::sleep_until(until).await;
        return;
    }
    let tick = config
        .health_probe_interval
        .min(config.stall_timeout)
        .max(Duration::from_millis(10));
    let mut floor = quiet_floor;
    loop {
        let now = Instant::now();
        if now >= until {
            return;
        }
        tokio::time::sleep_until(until.min(now + tick)).await;
        let quiet = session.quiet_for();
        if quiet < floor {
            // progress (or idle) since: the floor no longer applies
            floor = Duration::ZERO;
        }
        if quiet.saturating_sub(floor) >= config.stall_timeout {
            let routable = shared
                .sessions()
                .get(node)
                .is_some_and(|s| s.id == session_id && s.routable);
            if routable {
                debug!(%node, quiet_ms = quiet.as_millis() as u64, "no progress on the node's streams; probing now");
                return;
            }
        }
    }
}

/// Whether the old session answers a liveness probe (`GET` [`PROBE_PATH`], answered by the
/// agent's tunnel layer itself) or receives anything at all within `timeout`.
pub(super) async fn probe_alive(
    mut sender: SendRequest<BoxBody>,
    old: &SessionShared,
    timeout: Duration,
) -> bool {
    if sender.is_closed() {
        return false;
    }
    let before = old.activity.load(Ordering::Relaxed);
    let probe = async {
        sender.ready().await?;
        let resp = sender.send_request(get_request(PROBE_PATH)).await?;
        let _ = resp.into_body().collect().await;
        Ok::<_, hyper::Error>(())
    };
    match tokio::time::timeout(timeout, probe).await {
        Ok(Ok(())) => true,
        // a busy node may have no free stream for the probe, but its data keeps arriving
        Ok(Err(_)) | Err(_) => old.activity.load(Ordering::Relaxed) != before,
    }
}

/// A body-less `GET` of one of the paths the gateway probes a node on.
fn get_request(path: &'static str) -> Request<BoxBody> {
    let mut req = Request::new(Empty::<Bytes>::new().map_err(|e| match e {}).boxed_unsync());
    *req.uri_mut() = Uri::from_static(match path {
        PROBE_PATH => "http://spine-node/_spine/probe",
        "/v1/models" => "http://spine-node/v1/models",
        _ => "http://spine-node/health",
    });
    req
}
