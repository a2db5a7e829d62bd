use std::time::Duration;

use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

/// Gateway-side tunnel settings (design brief §4 limits). Defaults are listed per field and in
/// `docs/operations.md`.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TunnelServerConfig {
    /// This gateway instance's id, sent in every challenge. Default `spine-gateway`.
    pub gateway_id: String,
    /// The host names agents reach this gateway under (compared with
    /// [`crate::handshake::gateway_name`]'s canonical form). A hello signed for any other name is
    /// refused `wrong_gateway`. Default `localhost`, `127.0.0.1` and `::1`.
    pub public_names: Vec<String>,
    /// Bound on each phase of accepting a tunnel: the TLS handshake, the HTTP upgrade request, and
    /// the wait for the hello after the challenge. Default 10 s.
    pub handshake_timeout: Duration,
    /// A hello that arrives later than this after its challenge is refused as
    /// `stale_challenge`. Default 5 s.
    pub challenge_max_age: Duration,
    /// HTTP/2 PING interval, sent when nothing was received for this long (any received frame
    /// counts as liveness). Default 10 s.
    pub keepalive_interval: Duration,
    /// A PING not acknowledged within this closes the tunnel as dead. Default 5 s, so a silent
    /// agent is detected within `keepalive_interval + keepalive_timeout` = 15 s, under the
    /// 2 × interval the design brief asks.
    pub keepalive_timeout: Duration,
    /// WebSocket ping interval, for middleboxes that watch WebSocket traffic. Default 20 s.
    pub ws_ping_interval: Duration,
    /// A write to the tunnel blocked this long kills it. Default 5 s.
    pub write_timeout: Duration,
    /// Largest WebSocket message (and frame) accepted from an agent, bytes. Default 1 MiB.
    pub max_ws_message_bytes: usize,
    /// Largest binary message written to an agent, bytes. Default 64 KiB.
    pub max_write_message_bytes: usize,
    /// The WebSocket read buffer, bytes (tungstenite's default is 128 KiB per connection, the
    /// main cost of an idle tunnel). Default 4 KiB; it is a chunk size, not a message limit.
    pub ws_read_buffer_bytes: usize,
    /// Largest HTTP/2 header list accepted in a response, bytes. Default 64 KiB.
    pub max_header_list_bytes: u32,
    /// Cap on the streams one node may have open at once, whatever it advertises; the effective
    /// per-node limit is `min(advertised max_concurrency, this)`, at least 1. Default 256.
    pub max_streams_per_node: u32,
    /// Wait between health probes until the first one succeeds. Default 1 s.
    pub health_probe_interval: Duration,
    /// Bound on one health probe. Default 5 s.
    pub health_probe_timeout: Duration,
    /// Wait between health probes of a node that has become ready. Default 10 s.
    pub health_check_interval: Duration,
    /// Consecutive failed probes after which a ready node leaves routing (its tunnel stays up
    /// and probing continues; one passing probe brings it back). Default 2.
    pub health_failures_to_leave: u32,
    /// Reconnection race: how long a new session waits for the old session of the same node to
    /// answer a liveness probe before replacing it. Default 2 s.
    pub takeover_probe_timeout: Duration,
    /// Stall detection: a routable node with streams open that has received no response head
    /// and no body frame on any of them for this long is probed at once (checked every
    /// `health_probe_interval`); when that probe (or any probe) times out while the node's
    /// streams are open and still nothing arrives, the engine is hung: the node leaves routing
    /// at once (no second failure needed: two signals agree) and its streams that have received
    /// nothing yet fail with [`TunnelError::is_stalled`], so a router retries them elsewhere.
    /// A hung node with requests in flight is therefore out of routing within
    /// `stall_timeout + health_probe_interval + health_probe_timeout` (11 s by default); one
    /// passing probe brings it back. `Duration::ZERO` disables it (a timed-out probe on a full
    /// node is then never counted, as before). Default 5 s.
    ///
    /// [`TunnelError::is_stalled`]: crate::TunnelError::is_stalled
    pub stall_timeout: Duration,
}

impl Default for TunnelServerConfig {
    fn default() -> Self {
        Self {
            gateway_id: "spine-gateway".to_owned(),
            public_names: vec![
                "localhost".to_owned(),
                "127.0.0.1".to_owned(),
                "::1".to_owned(),
            ],
            handshake_timeout: Duration::from_secs(10),
            challenge_max_age: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(5),
            ws_ping_interval: Duration::from_secs(20),
            write_timeout: Duration::from_secs(5),
            max_ws_message_bytes: 1024 * 1024,
            max_write_message_bytes: crate::ws_io::DEFAULT_MAX_WRITE_MESSAGE_BYTES,
            ws_read_buffer_bytes: 4 * 1024,
            max_header_list_bytes: 64 * 1024,
            max_streams_per_node: 256,
            health_probe_interval: Duration::from_secs(1),
            health_probe_timeout: Duration::from_secs(5),
            health_check_interval: Duration::from_secs(10),
            health_failures_to_leave: 2,
            takeover_probe_timeout: Duration::from_secs(2),
            stall_timeout: Duration::from_secs(5),
        }
    }
}

impl TunnelServerConfig {
    /// The WebSocket settings for accepted tunnels: message and frame limits, a small read
    /// buffer, and writes flushed per message.
    pub(crate) fn ws_config(&self) -> WebSocketConfig {
        ws_config(
            self.max_ws_message_bytes,
            self.ws_read_buffer_bytes,
            self.max_write_message_bytes,
        )
    }
}

/// How many bytes of messages the WebSocket keeps before it writes them without waiting for a
/// flush: 16 KiB. A busy tunnel's batch leaves in writes of at least this size; an idle
/// tunnel's write buffer (a `Vec` that tungstenite never shrinks) stays near one message.
const WS_WRITE_BUFFER_BYTES: usize = 16 * 1024;

/// The WebSocket settings both ends use: `max_message_bytes` for messages and frames,
/// `read_buffer_bytes` read chunks, messages kept in the write buffer until a flush (or until
/// [`WS_WRITE_BUFFER_BYTES`] wait: [`WsIo`](crate::WsIo) puts a flush off by one turn of the
/// scheduler, so the messages that other tasks queue meanwhile leave in the same `writev`), and
/// at most 4 × the message limit queued for writing — never less than the write buffer plus one
/// message of `max_write_message_bytes` (and its frame header), which the sink takes while it
/// is ready.
pub(crate) fn ws_config(
    max_message_bytes: usize,
    read_buffer_bytes: usize,
    max_write_message_bytes: usize,
) -> WebSocketConfig {
    let one_more_message = WS_WRITE_BUFFER_BYTES
        .saturating_add(max_write_message_bytes)
        .saturating_add(64);
    let max_write_buffer = max_message_bytes
        .saturating_mul(4)
        .max(64 * 1024)
        .max(one_more_message.saturating_mul(2));
    WebSocketConfig::default()
        .max_message_size(Some(max_message_bytes))
        .max_frame_size(Some(max_message_bytes))
        .read_buffer_size(read_buffer_bytes.max(256))
        .write_buffer_size(WS_WRITE_BUFFER_BYTES)
        .max_write_buffer_size(max_write_buffer)
}
