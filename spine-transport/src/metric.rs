//! Names of the tunnel's metrics, recorded through the [`metrics`] facade: an application that
//! installs a recorder (the reference gateway's Prometheus exporter) shows them; without one they
//! cost nothing.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | [`TUNNELS_CONNECTED`] | gauge | | tunnels past the handshake (probing, ready or unhealthy) |
//! | [`NODES_ROUTABLE`] | gauge | | tunnels whose node is routable (last health probes passed) |
//! | [`HANDSHAKES_ACCEPTED`] | counter | | handshakes accepted |
//! | [`HANDSHAKES_REJECTED`] | counter | `reason` | refusals: every [`crate::RefusalReason`] code, plus `tls` (TLS handshake failed or timed out) and `bad_upgrade` (not a valid WebSocket upgrade) |
//! | [`TAKEOVERS`] | counter | | new sessions that replaced a dead old one (reconnection race, design brief §4) |
//! | [`REQUESTS_FORWARDED`] | counter | | requests whose response head came back through a tunnel |
//! | [`REQUESTS_FAILED`] | counter | `reason` | `unknown_node`, `node_full`, `closed`, `timeout`, `error` (before the head); `body` (the body broke off after the head); `stalled` (failed before its first frame because its node was found stalled) |
//! | [`FORWARD_SECONDS`] | histogram | | time from sending a request down a tunnel to its response head, seconds |
//! | [`STREAMS_OPEN`] | gauge | | HTTP/2 streams open through all tunnels (requests in flight) |
//! | [`HEALTH_PROBE_FAILURES`] | counter | | failed health probes of ready or warming nodes |
//! | [`WRITE_STALLS`] | counter | | writes blocked past the write timeout (each kills its tunnel) |
//! | [`NODE_STALLS`] | counter | | nodes found stalled: nothing on any of their streams while a health probe timed out (each takes the node out of routing) |
//! | [`LISTENER_CONNECTIONS_CLOSED`] | counter | `listener`, `reason` | connections a [`crate::LimitedServer`] closed: `header_timeout` (no complete request head in time), `idle_timeout`, `tls_timeout`, `evicted` (idle, closed to make room at the connection cap), `cap` (refused at the cap, every connection busy) |

/// Gauge: tunnels past the handshake.
pub const TUNNELS_CONNECTED: &str = "spine_tunnels_connected";
/// Gauge: tunnels whose node is routable.
pub const NODES_ROUTABLE: &str = "spine_tunnel_nodes_routable";
/// Counter: handshakes accepted.
pub const HANDSHAKES_ACCEPTED: &str = "spine_tunnel_handshakes_accepted_total";
/// Counter, label `reason`: handshakes refused.
pub const HANDSHAKES_REJECTED: &str = "spine_tunnel_handshakes_rejected_total";
/// Counter: dead sessions replaced by a new one for the same node.
pub const TAKEOVERS: &str = "spine_tunnel_takeovers_total";
/// Counter: requests whose response head came back.
pub const REQUESTS_FORWARDED: &str = "spine_tunnel_requests_forwarded_total";
/// Counter, label `reason`: requests that failed in the tunnel.
pub const REQUESTS_FAILED: &str = "spine_tunnel_requests_failed_total";
/// Histogram: time to the response head through the tunnel, seconds.
pub const FORWARD_SECONDS: &str = "spine_tunnel_forward_seconds";
/// Gauge: HTTP/2 streams open through all tunnels.
pub const STREAMS_OPEN: &str = "spine_tunnel_streams_open";
/// Counter: failed health probes.
pub const HEALTH_PROBE_FAILURES: &str = "spine_tunnel_health_probe_failures_total";
/// Counter: writes blocked past the write timeout.
pub const WRITE_STALLS: &str = "spine_tunnel_write_stalls_total";
/// Counter: nodes found stalled (no progress on their streams, health probe timed out).
pub const NODE_STALLS: &str = "spine_tunnel_node_stalls_total";

/// Counter, labels `listener` and `reason`: connections closed by a listener's bounds.
pub const LISTENER_CONNECTIONS_CLOSED: &str = "spine_listener_connections_closed_total";

/// Suggested histogram buckets for [`FORWARD_SECONDS`], seconds.
pub const FORWARD_SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

pub(crate) fn listener_closed(listener: &'static str, reason: &'static str) {
    metrics::counter!(LISTENER_CONNECTIONS_CLOSED, "listener" => listener, "reason" => reason)
        .increment(1);
}

pub(crate) fn rejected(reason: &'static str) {
    metrics::counter!(HANDSHAKES_REJECTED, "reason" => reason).increment(1);
}

/// Sets every counter with a fixed label set to zero so dashboards see the series from the
/// start. Call after installing the recorder.
pub fn describe() {
    for r in crate::RefusalReason::ALL {
        metrics::counter!(HANDSHAKES_REJECTED, "reason" => r.as_str()).absolute(0);
    }
    for r in ["tls", "bad_upgrade"] {
        metrics::counter!(HANDSHAKES_REJECTED, "reason" => r).absolute(0);
    }
    for r in [
        "unknown_node",
        "node_full",
        "closed",
        "timeout",
        "error",
        "body",
        "stalled",
    ] {
        metrics::counter!(REQUESTS_FAILED, "reason" => r).absolute(0);
    }
    metrics::counter!(HANDSHAKES_ACCEPTED).absolute(0);
    metrics::counter!(TAKEOVERS).absolute(0);
    metrics::counter!(REQUESTS_FORWARDED).absolute(0);
    metrics::counter!(HEALTH_PROBE_FAILURES).absolute(0);
    metrics::counter!(WRITE_STALLS).absolute(0);
    metrics::counter!(NODE_STALLS).absolute(0);
}
