//! Gateway side of the tunnel: accept, verify, hold one HTTP/2 client per node.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt as _;
use http::{header, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt as _, Empty, Full, Limited};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use spine_core::{BoxBody, BoxError, ModelId, NodeDescriptor, NodeId};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};
use tokio_tungstenite::WebSocketStream;
use tracing::{debug, info, warn, Instrument as _};

use crate::handshake::{decode_hello, Accepted, Challenge, GatewayMessage};
use crate::serve::{LimitedServer, ListenerLimits, TimedBody};
use crate::{metric, RefusalReason, TunnelError, WsIo};

/// The path agents upgrade on.
pub const TUNNEL_PATH: &str = "/v1/tunnel";

/// The path of the health probe sent through a new tunnel; the agent maps it to its engine's
/// health endpoint.
pub const HEALTH_PATH: &str = "/health";

/// The path of the liveness probe the gateway sends down an existing tunnel when a new session
/// for the same node arrives (reconnection race, design brief §4). The agent's tunnel layer
/// answers it itself with `204 No Content`, without involving its engine.
pub const PROBE_PATH: &str = "/_spine/probe";

/// Authority put in the URI of every request sent down a tunnel (the agent ignores it and talks
/// to its one configured engine).
const TUNNEL_AUTHORITY: &str = "spine-node";

/// Decides whether a public key belongs to a registered node (the gateway's node store).
pub trait NodeAuthenticator: Send + Sync + 'static {
    /// The node registered under `public_key_text` (canonical form, [`crate::public_key_text`]).
    ///
    /// Called only after the hello's signature verified, so a caller cannot probe which keys are
    /// registered without holding the secret key.
    ///
    /// # Errors
    ///
    /// The refusal to send: [`RefusalReason::UnknownKey`] for an unregistered or revoked key,
    /// [`RefusalReason::Internal`] when the store cannot answer.
    fn authenticate<'a>(
        &'a self,
        public_key_text: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<NodeId, RefusalReason>> + Send + 'a>>;
}

/// A fixed set of registered keys, for tests and small deployments.
#[derive(Clone, Debug, Default)]
pub struct StaticAuthenticator {
    keys: HashMap<String, NodeId>,
}

impl StaticAuthenticator {
    /// An authenticator that knows no key.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `public_key_text` as `node`.
    pub fn with_key(mut self, public_key_text: impl Into<String>, node: NodeId) -> Self {
        self.keys.insert(public_key_text.into(), node);
        self
    }
}

impl NodeAuthenticator for StaticAuthenticator {
    fn authenticate<'a>(
        &'a self,
        public_key_text: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<NodeId, RefusalReason>> + Send + 'a>> {
        let res = self
            .keys
            .get(public_key_text)
            .cloned()
            .ok_or(RefusalReason::UnknownKey);
        Box::pin(std::future::ready(res))
    }
}

/// Tunnel lifecycle notifications, for the router's registry.
///
/// For one node, `node_ready` and `node_gone` alternate: `node_ready` (routable), then
/// `node_gone` (not routable: the tunnel closed, was found dead, was taken over by a new session,
/// or its health probes failed), then `node_ready` again (probes recovered, or a new session
/// warmed up). Both are called while the tunnel server holds its session table's lock, which is
/// what keeps them ordered: keep them short, non-blocking, and never call back into
/// [`Tunnels`] from them.
pub trait TunnelEvents: Send + Sync + 'static {
    /// The node's tunnel is up and its health probe through the tunnel (`GET /health`)
    /// returned 2xx: the node may be routed to (design brief §4). `descriptor` is the one the
    /// node sent, except that its `max_concurrency` is clamped to the tunnel's stream limit
    /// (`min(advertised, max_streams_per_node)`, at least 1), so a router admitting up to it
    /// never sends a request the tunnel refuses as full.
    fn node_ready(&self, node: &NodeId, descriptor: &NodeDescriptor);

    /// The node may no longer be routed to; called once after each `node_ready`.
    fn node_gone(&self, node: &NodeId);

    /// Liveness of `node` was just confirmed: a health probe passed or a response head came
    /// back through its tunnel. At most about once per second per node; never before the
    /// node's first `node_ready`. For a reliability score's uptime part. Default: ignored.
    fn node_heartbeat(&self, node: &NodeId) {
        let _ = node;
    }
}

/// Ignores every event.
impl TunnelEvents for () {
    fn node_ready(&self, _node: &NodeId, _descriptor: &NodeDescriptor) {}
    fn node_gone(&self, _node: &NodeId) {}
}

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
        ws_config(self.max_ws_message_bytes, self.ws_read_buffer_bytes)
    }
}

/// The WebSocket settings both ends use: `max_message_bytes` for messages and frames,
/// `read_buffer_bytes` read chunks, no write batching (each message is written at once; the
/// HTTP/2 layer above batches), and at most 4 × the message limit queued for writing.
pub(crate) fn ws_config(max_message_bytes: usize, read_buffer_bytes: usize) -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(max_message_bytes))
        .max_frame_size(Some(max_message_bytes))
        .read_buffer_size(read_buffer_bytes.max(256))
        .write_buffer_size(0)
        .max_write_buffer_size(max_message_bytes.saturating_mul(4).max(64 * 1024))
}

/// Where a tunnel stands, as shown in [`TunnelStatus::state`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TunnelState {
    /// Accepted; no health probe has passed yet (not routable).
    Warming,
    /// The last health probes passed: routable.
    Ready,
    /// Was ready, then `health_failures_to_leave` probes in a row failed (not routable; probing
    /// continues).
    Unhealthy,
}

/// One model of a node, as its last health probe saw it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ModelStatus {
    /// The model id, as in the node's descriptor.
    pub model: ModelId,
    /// Whether the engine is up and lists this model in `GET /v1/models` (when the engine's
    /// model list cannot be read, whether the engine's health probe passed).
    pub running: bool,
}

/// A node's tunnel as the gateway sees it ([`Tunnels::status`]); serialises to JSON for admin
/// APIs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TunnelStatus {
    /// Warming, ready or unhealthy.
    pub state: TunnelState,
    /// When the tunnel was accepted, milliseconds since the Unix epoch.
    pub connected_at_unix_ms: u64,
    /// When a health probe last passed, milliseconds since the Unix epoch.
    pub last_probe_ok_unix_ms: Option<u64>,
    /// Health probes failed in a row since the last one that passed.
    pub consecutive_probe_failures: u32,
    /// HTTP/2 streams open now (requests in flight through this tunnel).
    pub streams_open: u32,
    /// The per-node stream limit the gateway enforces.
    pub max_streams: u32,
    /// Per-model running status.
    pub models: Vec<ModelStatus>,
}

/// Per-session state shared between the session task, the table, and requests in flight.
struct SessionShared {
    streams_open: AtomicU32,
    max_streams: u32,
    /// Incremented for every WebSocket message received.
    activity: Arc<AtomicU64>,
    /// Response heads and body frames received on this session's request streams (not its
    /// probes): the engine's progress.
    progress: AtomicU64,
    /// When progress was last seen (or the node went from idle to busy), milliseconds since
    /// `epoch`.
    last_progress_ms: AtomicU64,
    epoch: Instant,
    /// Bumped each time the node is found stalled; streams that have received nothing yet fail
    /// when it changes.
    stall: tokio::sync::watch::Sender<u64>,
    last_heartbeat_ms: AtomicU64,
    /// Fired to end the session (it was taken over).
    kill: Notify,
}

impl SessionShared {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A response head or body frame arrived on a request stream.
    fn progressed(&self) {
        self.progress.fetch_add(1, Ordering::Relaxed);
        self.last_progress_ms
            .store(self.now_ms(), Ordering::Relaxed);
    }

    /// How long the node has had streams open with nothing received; zero when idle.
    fn quiet_for(&self) -> Duration {
        if self.streams_open.load(Ordering::Acquire) == 0 {
            return Duration::ZERO;
        }
        let last = self.last_progress_ms.load(Ordering::Relaxed);
        Duration::from_millis(self.now_ms().saturating_sub(last))
    }
}

struct Session {
    id: u64,
    descriptor: NodeDescriptor,
    /// `None` while the session is reserved (accepted, HTTP/2 not yet set up).
    sender: Option<SendRequest<BoxBody>>,
    /// Reported with `node_ready` and not yet `node_gone`.
    routable: bool,
    state: TunnelState,
    connected_at_unix_ms: u64,
    last_probe_ok_unix_ms: Option<u64>,
    consecutive_probe_failures: u32,
    models_running: Vec<bool>,
    shared: Arc<SessionShared>,
}

struct Shared {
    config: TunnelServerConfig,
    auth: Arc<dyn NodeAuthenticator>,
    events: Arc<dyn TunnelEvents>,
    sessions: Mutex<HashMap<NodeId, Session>>,
    next_session_id: AtomicU64,
}

impl Shared {
    fn sessions(&self) -> MutexGuard<'_, HashMap<NodeId, Session>> {
        // A panic while holding this lock cannot leave the map inconsistent (single inserts and
        // removes), so a poisoned lock is still usable.
        self.sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Emits `node_heartbeat`, at most once per second per session.
    fn heartbeat(&self, node: &NodeId, session: &SessionShared) {
        let now = now_ms();
        let last = session.last_heartbeat_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 1000
            && session
                .last_heartbeat_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.events.node_heartbeat(node);
        }
    }
}

/// The gateway's tunnel listener (design brief §4).
///
/// Answers `GET /v1/tunnel` WebSocket upgrades, verifies the signed handshake, and keeps one
/// HTTP/2 client connection per node, reachable through [`Tunnels`]. Serve it alone with
/// [`serve`](Self::serve), or mount [`upgrade_service`](Self::upgrade_service) in an axum (or any
/// tower) router and serve that with [`serve_listener`].
#[derive(Clone)]
pub struct TunnelServer {
    shared: Arc<Shared>,
}

impl fmt::Debug for TunnelServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TunnelServer")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl TunnelServer {
    /// A tunnel server that asks `auth` about keys and tells `events` about nodes.
    pub fn new(
        config: TunnelServerConfig,
        auth: Arc<dyn NodeAuthenticator>,
        events: Arc<dyn TunnelEvents>,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                config,
                auth,
                events,
                sessions: Mutex::new(HashMap::new()),
                next_session_id: AtomicU64::new(1),
            }),
        }
    }

    /// The send half: the live tunnels, to send requests down.
    pub fn tunnels(&self) -> Tunnels {
        Tunnels {
            shared: self.shared.clone(),
        }
    }

    /// The tower service answering the tunnel's WebSocket upgrade, to mount at [`TUNNEL_PATH`]
    /// in a router, e.g. `axum::Router::new().route_service(TUNNEL_PATH, server.upgrade_service())`.
    ///
    /// The HTTP server it runs under must support upgrades (hyper's `with_upgrades`,
    /// [`serve_listener`], `axum::serve`).
    pub fn upgrade_service(&self) -> TunnelUpgrade {
        TunnelUpgrade {
            shared: self.shared.clone(),
        }
    }

    /// Runs the accept loop on `listener`, answering only [`TUNNEL_PATH`] (404 elsewhere); see
    /// [`serve_listener`] to serve other routes beside it.
    ///
    /// `tls = None` serves plaintext `ws://`; the reference gateway passes `None` only behind an
    /// explicitly insecure flag.
    ///
    /// # Errors
    ///
    /// As [`serve_listener`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops accepting; tunnels already accepted keep running.
    pub async fn serve(
        self,
        listener: TcpListener,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> std::io::Result<()> {
        let timeout = self.shared.config.handshake_timeout;
        let limits = ListenerLimits::default()
            .header_read_timeout(timeout)
            .tls_handshake_timeout(timeout);
        let upgrade = self.upgrade_service();
        let service = tower::service_fn(move |req: Request<TimedBody>| {
            let mut upgrade = upgrade.clone();
            async move {
                if req.uri().path() != TUNNEL_PATH {
                    return Ok::<_, Infallible>(plain(StatusCode::NOT_FOUND, "not found\n"));
                }
                tower::Service::call(&mut upgrade, req).await
            }
        });
        serve_listener(listener, tls, limits, service).await
    }
}

/// Serves HTTP/1.1 with upgrades on `listener` (TLS unless `tls` is `None`) with `service`, for
/// example an axum `Router` holding [`TunnelServer::upgrade_service`] at [`TUNNEL_PATH`] beside
/// other routes, under `limits` ([`LimitedServer`]: connection cap, header, body, idle and TLS
/// handshake timeouts, `TCP_NODELAY`). A connection counts against the cap until its upgrade to
/// a tunnel. TLS failures count in [`crate::metric::HANDSHAKES_REJECTED`] with reason `tls`.
///
/// # Errors
///
/// None today: the loop runs until the future is dropped. The `Result` leaves room for fatal
/// listener errors.
///
/// # Cancel safety
///
/// Dropping the future stops accepting; connections already accepted keep running.
pub async fn serve_listener<S, B>(
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: ListenerLimits,
    service: S,
) -> std::io::Result<()>
where
    S: tower::Service<Request<TimedBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    LimitedServer::new("tunnel", limits)
        .tls(tls)
        .http1_only()
        .serve(listener, service, std::future::pending())
        .await
}

/// Body of the upgrade service's responses.
pub type UpgradeBody = Full<Bytes>;

fn plain(status: StatusCode, text: &'static str) -> Response<UpgradeBody> {
    let mut resp = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

fn header_has_token<B>(req: &Request<B>, name: header::HeaderName, token: &str) -> bool {
    req.headers().get_all(name).iter().any(|v| {
        v.to_str().is_ok_and(|s| {
            s.split(',')
                .any(|part| part.trim().eq_ignore_ascii_case(token))
        })
    })
}

/// The tunnel's WebSocket upgrade as a tower service ([`TunnelServer::upgrade_service`]).
///
/// Answers `101 Switching Protocols` to a valid `GET` WebSocket upgrade (whatever the path it
/// is mounted at) and runs the tunnel on the upgraded connection; `405` for other methods, `426`
/// without a WebSocket upgrade, `400` without a key. Works for any request body type, so it
/// mounts in axum as is.
#[derive(Clone)]
pub struct TunnelUpgrade {
    shared: Arc<Shared>,
}

impl fmt::Debug for TunnelUpgrade {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TunnelUpgrade").finish_non_exhaustive()
    }
}

impl<B: Send + 'static> tower::Service<Request<B>> for TunnelUpgrade {
    type Response = Response<UpgradeBody>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<UpgradeBody>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        std::future::ready(Ok(upgrade(self.shared.clone(), req)))
    }
}

/// Answers one upgrade request: 101 for a valid upgrade, an error status otherwise.
fn upgrade<B>(shared: Arc<Shared>, mut req: Request<B>) -> Response<UpgradeBody> {
    if req.method() != Method::GET {
        metric::rejected("bad_upgrade");
        let mut resp = plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        resp.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET"));
        return resp;
    }
    let is_upgrade = header_has_token(&req, header::CONNECTION, "upgrade")
        && header_has_token(&req, header::UPGRADE, "websocket");
    let version_ok = req
        .headers()
        .get(header::SEC_WEBSOCKET_VERSION)
        .is_some_and(|v| v.as_bytes() == b"13");
    if !is_upgrade || !version_ok {
        metric::rejected("bad_upgrade");
        let mut resp = plain(StatusCode::UPGRADE_REQUIRED, "websocket upgrade required\n");
        resp.headers_mut()
            .insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        resp.headers_mut().insert(
            header::SEC_WEBSOCKET_VERSION,
            HeaderValue::from_static("13"),
        );
        return resp;
    }
    let Some(key) = req.headers().get(header::SEC_WEBSOCKET_KEY) else {
        metric::rejected("bad_upgrade");
        return plain(StatusCode::BAD_REQUEST, "missing sec-websocket-key\n");
    };
    let Ok(accept) = HeaderValue::from_str(&derive_accept_key(key.as_bytes())) else {
        metric::rejected("bad_upgrade");
        return plain(StatusCode::BAD_REQUEST, "bad sec-websocket-key\n");
    };

    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(
        async move {
            match on_upgrade.await {
                Ok(upgraded) => {
                    let ws = WebSocketStream::from_raw_socket(
                        TokioIo::new(upgraded),
                        Role::Server,
                        Some(shared.config.ws_config()),
                    )
                    .await;
                    run_session(shared, ws).await;
                }
                Err(e) => debug!(error = %e, "websocket upgrade failed"),
            }
        }
        .in_current_span(),
    );

    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
    resp
}

fn now_ms() -> u64 {
    u64::try_from(spine_core::unix_time_ms()).unwrap_or(0)
}

/// Closes `ws` with the refusal's code and reason, then drains it briefly so the close
/// handshake completes.
async fn refuse<S>(ws: &mut WebSocketStream<S>, reason: RefusalReason)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    info!(reason = reason.as_str(), "tunnel refused");
    metric::rejected(reason.as_str());
    let frame = CloseFrame {
        code: CloseCode::from(reason.close_code()),
        reason: Utf8Bytes::from_static(reason.as_str()),
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        if ws.close(Some(frame)).await.is_ok() {
            while let Some(Ok(_)) = ws.next().await {}
        }
    })
    .await;
}

enum HelloWait {
    Text(Utf8Bytes),
    Refuse(RefusalReason),
    Gone,
}

async fn next_text<S>(ws: &mut WebSocketStream<S>) -> HelloWait
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    loop {
        match ws.next().await {
            Some(Ok(Message::Text(text))) => return HelloWait::Text(text),
            Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
            Some(Ok(Message::Binary(_))) => {
                return HelloWait::Refuse(RefusalReason::MalformedHandshake)
            }
            Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return HelloWait::Gone,
        }
    }
}

/// What a new session found in the table for its node.
enum Slot {
    /// Reserved for the new session.
    Reserved(Arc<SessionShared>),
    /// Another session is still setting up: refuse.
    Busy,
    /// A live-looking session to probe first.
    Probe {
        id: u64,
        sender: SendRequest<BoxBody>,
        old: Arc<SessionShared>,
    },
}

/// The tunnel after the upgrade: handshake, then the HTTP/2 session.
async fn run_session<S>(shared: Arc<Shared>, mut ws: WebSocketStream<S>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let config = &shared.config;
    let challenge = match Challenge::generate(&config.gateway_id, now_ms()) {
        Ok(c) => c,
        Err(e) => {
            warn!(error = %e, "cannot generate challenge");
            refuse(&mut ws, RefusalReason::Internal).await;
            return;
        }
    };
    let challenge_json = match serde_json::to_string(&GatewayMessage::Challenge(challenge.clone()))
    {
        Ok(json) => json,
        Err(e) => {
            warn!(error = %e, "cannot encode challenge");
            return;
        }
    };
    if let Err(e) = futures_util::SinkExt::send(&mut ws, Message::text(challenge_json)).await {
        debug!(error = %e, "sending challenge failed");
        return;
    }
    let sent_at = Instant::now();

    let text = match tokio::time::timeout(config.handshake_timeout, next_text(&mut ws)).await {
        Err(_) => return refuse(&mut ws, RefusalReason::HandshakeTimeout).await,
        Ok(HelloWait::Gone) => {
            debug!("agent left during the handshake");
            return;
        }
        Ok(HelloWait::Refuse(reason)) => return refuse(&mut ws, reason).await,
        Ok(HelloWait::Text(text)) => text,
    };
    let hello = match decode_hello(text.as_bytes()) {
        Ok(hello) => hello,
        Err(reason) => return refuse(&mut ws, reason).await,
    };
    if sent_at.elapsed() > config.challenge_max_age {
        return refuse(&mut ws, RefusalReason::StaleChallenge).await;
    }
    if let Err(reason) = hello.verify(&challenge) {
        return refuse(&mut ws, reason).await;
    }
    if !config
        .public_names
        .iter()
        .any(|n| crate::handshake::gateway_name(n) == hello.gateway_name)
    {
        let name: String = hello.gateway_name.chars().take(100).collect();
        info!(gateway_name = %name, "hello signed for another gateway name");
        return refuse(&mut ws, RefusalReason::WrongGateway).await;
    }
    let node = match shared.auth.authenticate(&hello.public_key).await {
        Ok(node) => node,
        Err(reason) => return refuse(&mut ws, reason).await,
    };
    tracing::Span::current().record("node", tracing::field::display(&node));

    // One session per node (design brief §4, reconnection race). When the node already has a
    // session, probe it: if it answers (or anything arrives on it) within the takeover probe
    // timeout it is live and this one is refused; otherwise it is closed and this one takes over.
    let session_id = shared.next_session_id.fetch_add(1, Ordering::Relaxed);
    let max_streams = hello
        .descriptor
        .max_concurrency
        .clamp(1, config.max_streams_per_node.max(1));
    // The router admits up to the descriptor's max_concurrency: hand it (events, `connected`)
    // the limit the tunnel enforces, not the one the node advertised.
    let mut descriptor = hello.descriptor.clone();
    descriptor.max_concurrency = max_streams;
    let session_shared = loop {
        match reserve(&shared, &node, session_id, &descriptor, max_streams) {
            Slot::Reserved(s) => break s,
            Slot::Busy => return refuse(&mut ws, RefusalReason::DuplicateSession).await,
            Slot::Probe { id, sender, old } => {
                if probe_alive(sender, &old, config.takeover_probe_timeout).await {
                    info!(%node, "node already has a live tunnel; refusing the new one");
                    return refuse(&mut ws, RefusalReason::DuplicateSession).await;
                }
                let replaced = {
                    let mut sessions = shared.sessions();
                    match sessions.get(&node) {
                        Some(s) if s.id == id => {
                            let old = sessions.remove(&node);
                            if let Some(old) = old {
                                metrics::gauge!(metric::TUNNELS_CONNECTED).decrement(1.0);
                                if old.routable {
                                    metrics::gauge!(metric::NODES_ROUTABLE).decrement(1.0);
                                    shared.events.node_gone(&node);
                                }
                                old.shared.kill.notify_one();
                            }
                            true
                        }
                        _ => false,
                    }
                };
                if replaced {
                    metrics::counter!(metric::TAKEOVERS).increment(1);
                    info!(%node, "old tunnel did not answer its probe; the new one takes over");
                }
                // loop: reserve again (another racer may have taken the slot meanwhile)
            }
        }
    };

    let session = SessionGuard {
        shared: shared.clone(),
        node: node.clone(),
        id: session_id,
    };
    let accepted = GatewayMessage::Accepted(Accepted {
        node_id: node.clone(),
    });
    let sent = match serde_json::to_string(&accepted) {
        Ok(json) => futures_util::SinkExt::send(&mut ws, Message::text(json))
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = sent {
        debug!(error = %e, "sending acceptance failed");
        return session.end();
    }
    metrics::counter!(metric::HANDSHAKES_ACCEPTED).increment(1);
    info!(
        %node,
        engine = hello.descriptor.engine.as_str(),
        models = hello.descriptor.models.len(),
        max_concurrency = hello.descriptor.max_concurrency,
        max_streams,
        "tunnel accepted"
    );

    let io = WsIo::new(ws)
        .with_write_timeout(config.write_timeout)
        .with_max_write_message_bytes(config.max_write_message_bytes)
        .with_ping_interval(config.ws_ping_interval)
        .with_activity(session_shared.activity.clone())
        .with_kill({
            let session_shared = session_shared.clone();
            async move { session_shared.kill.notified().await }
        });
    let mut builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(config.keepalive_interval)
        .keep_alive_timeout(config.keepalive_timeout)
        .keep_alive_while_idle(true)
        .max_header_list_size(config.max_header_list_bytes)
        // bounded per-stream send buffering towards a slow node
        .max_send_buf_size(256 * 1024);
    let (sender, conn) = match builder.handshake::<_, BoxBody>(TokioIo::new(io)).await {
        Ok(pair) => pair,
        Err(e) => {
            warn!(error = %e, "http/2 handshake over the tunnel failed");
            return session.end();
        }
    };
    let mut conn = tokio::spawn(conn);
    {
        let mut sessions = shared.sessions();
        if let Some(s) = sessions.get_mut(&node).filter(|s| s.id == session_id) {
            s.sender = Some(sender.clone());
        }
    }

    tokio::select! {
        res = &mut conn => match res {
            Ok(Ok(())) => info!(%node, "tunnel closed"),
            Ok(Err(e)) => info!(%node, error = %e, "tunnel ended"),
            Err(e) => warn!(%node, error = %e, "tunnel task failed"),
        },
        () = maintain(&shared, &node, session_id, &session_shared, sender) => {
            // replaced by a new session: the killed stream fails the requests in flight and
            // ends the connection
            info!(%node, "tunnel replaced by a new session");
            if tokio::time::timeout(Duration::from_secs(1), &mut conn).await.is_err() {
                conn.abort();
            }
        }
    }
    session.end();
}

/// Reserves `node`'s slot in the table for a new session, or says what is in the way.
fn reserve(
    shared: &Shared,
    node: &NodeId,
    session_id: u64,
    descriptor: &NodeDescriptor,
    max_streams: u32,
) -> Slot {
    let mut sessions = shared.sessions();
    match sessions.get(node) {
        Some(s) => match &s.sender {
            None => Slot::Busy,
            Some(sender) => Slot::Probe {
                id: s.id,
                sender: sender.clone(),
                old: s.shared.clone(),
            },
        },
        None => {
            let session_shared = Arc::new(SessionShared {
                streams_open: AtomicU32::new(0),
                max_streams,
                activity: Arc::new(AtomicU64::new(0)),
                progress: AtomicU64::new(0),
                last_progress_ms: AtomicU64::new(0),
                epoch: Instant::now(),
                stall: tokio::sync::watch::Sender::new(0),
                last_heartbeat_ms: AtomicU64::new(0),
                kill: Notify::new(),
            });
            sessions.insert(
                node.clone(),
                Session {
                    id: session_id,
                    descriptor: descriptor.clone(),
                    sender: None,
                    routable: false,
                    state: TunnelState::Warming,
                    connected_at_unix_ms: now_ms(),
                    last_probe_ok_unix_ms: None,
                    consecutive_probe_failures: 0,
                    models_running: vec![false; descriptor.models.len()],
                    shared: session_shared.clone(),
                },
            );
            metrics::gauge!(metric::TUNNELS_CONNECTED).increment(1.0);
            Slot::Reserved(session_shared)
        }
    }
}

/// Whether the old session answers a liveness probe (`GET` [`PROBE_PATH`], answered by the
/// agent's tunnel layer itself) or receives anything at all within `timeout`.
async fn probe_alive(
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

fn get_request(path: &'static str) -> Request<BoxBody> {
    let mut req = Request::new(Empty::<Bytes>::new().map_err(|e| match e {}).boxed_unsync());
    *req.uri_mut() = Uri::from_static(match path {
        PROBE_PATH => "http://spine-node/_spine/probe",
        "/v1/models" => "http://spine-node/v1/models",
        _ => "http://spine-node/health",
    });
    req
}

/// Removes a session from the table (only if it is still this one) when the session ends, and
/// reports `node_gone` if it was routable.
struct SessionGuard {
    shared: Arc<Shared>,
    node: NodeId,
    id: u64,
}

impl SessionGuard {
    fn end(self) {
        // the work happens in Drop, so a panicking or cancelled session task cleans up too
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        let mut sessions = self.shared.sessions();
        let removed = match sessions.get(&self.node) {
            Some(s) if s.id == self.id => sessions.remove(&self.node),
            _ => None,
        };
        if let Some(s) = removed {
            metrics::gauge!(metric::TUNNELS_CONNECTED).decrement(1.0);
            if s.routable {
                metrics::gauge!(metric::NODES_ROUTABLE).decrement(1.0);
                info!(node = %self.node, "node gone");
                self.shared.events.node_gone(&self.node);
            }
        }
    }
}

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
async fn maintain(
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

/// The send half of a [`TunnelServer`]: the live tunnels, by node.
#[derive(Clone)]
pub struct Tunnels {
    shared: Arc<Shared>,
}

impl fmt::Debug for Tunnels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tunnels")
            .field("sessions", &self.shared.sessions().len())
            .finish()
    }
}

impl Tunnels {
    /// The nodes that are routable (reported by [`TunnelEvents::node_ready`] and not gone
    /// since) with the descriptor each sent in its handshake, sorted by node id. As in
    /// `node_ready`, the descriptor's `max_concurrency` is the limit the tunnel enforces:
    /// `min(advertised, max_streams_per_node)`, at least 1.
    pub fn connected(&self) -> Vec<(NodeId, NodeDescriptor)> {
        let mut nodes: Vec<_> = self
            .shared
            .sessions()
            .iter()
            .filter(|(_, s)| s.routable)
            .map(|(n, s)| (n.clone(), s.descriptor.clone()))
            .collect();
        nodes.sort_by(|a, b| a.0.cmp(&b.0));
        nodes
    }

    /// Whether `node` has a live tunnel (warming, ready or unhealthy).
    pub fn contains(&self, node: &NodeId) -> bool {
        self.shared.sessions().contains_key(node)
    }

    /// How many tunnels are up (past the handshake).
    pub fn len(&self) -> usize {
        self.shared.sessions().len()
    }

    /// Whether no tunnel is up.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `node`'s tunnel state, stream counts and per-model running status; `None` when it has no
    /// tunnel.
    pub fn status(&self, node: &NodeId) -> Option<TunnelStatus> {
        let sessions = self.shared.sessions();
        let s = sessions.get(node)?;
        Some(TunnelStatus {
            state: s.state,
            connected_at_unix_ms: s.connected_at_unix_ms,
            last_probe_ok_unix_ms: s.last_probe_ok_unix_ms,
            consecutive_probe_failures: s.consecutive_probe_failures,
            streams_open: s.shared.streams_open.load(Ordering::Relaxed),
            max_streams: s.shared.max_streams,
            models: s
                .descriptor
                .models
                .iter()
                .zip(s.models_running.iter())
                .map(|(m, running)| ModelStatus {
                    model: m.id.clone(),
                    running: *running,
                })
                .collect(),
        })
    }

    /// Sends `req` down `node`'s tunnel as a new HTTP/2 stream and returns the node's response,
    /// whose body streams as the node sends it.
    ///
    /// The request's URI is rewritten to `http://spine-node/<path and query>`; hyper strips
    /// connection-specific headers, which HTTP/2 forbids. The gateway enforces the node's stream
    /// limit itself (`min(max_concurrency, max_streams_per_node)`): a request for a full node is
    /// refused at once, before any byte goes down the tunnel.
    ///
    /// # Errors
    ///
    /// [`TunnelError::is_unknown_node`] when the node has no live tunnel;
    /// [`TunnelError::is_node_full`] when its streams are all in use;
    /// [`TunnelError::is_closed`] when the tunnel closes before the response head arrives;
    /// [`TunnelError::is_timeout`] when keepalive declares the tunnel dead. Errors after the head
    /// arrive as body errors (a boxed [`hyper::Error`]).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future (or, later, the response body) resets the HTTP/2 stream, which
    /// cancels the request on the node.
    pub async fn send(
        &self,
        node: &NodeId,
        mut req: Request<BoxBody>,
    ) -> Result<Response<BoxBody>, TunnelError> {
        let found = {
            let sessions = self.shared.sessions();
            sessions
                .get(node)
                .and_then(|s| Some((s.sender.clone()?, s.shared.clone())))
        };
        let Some((mut sender, session)) = found else {
            metrics::counter!(metric::REQUESTS_FAILED, "reason" => "unknown_node").increment(1);
            return Err(TunnelError::unknown_node().with_detail(node.as_str()));
        };
        let Some(stream) = StreamGuard::acquire(session.clone()) else {
            metrics::counter!(metric::REQUESTS_FAILED, "reason" => "node_full").increment(1);
            return Err(TunnelError::node_full().with_detail(node.as_str()));
        };
        let path_and_query = req
            .uri()
            .path_and_query()
            .map_or("/", |pq| pq.as_str())
            .to_owned();
        *req.uri_mut() = Uri::builder()
            .scheme("http")
            .authority(TUNNEL_AUTHORITY)
            .path_and_query(path_and_query)
            .build()
            .map_err(|e| TunnelError::protocol().with_source(e))?;
        let started = Instant::now();
        let mut stall = stream.stall_signal();
        let res = tokio::select! {
            res = async {
                sender.ready().await?;
                sender.send_request(req).await
            } => res,
            () = &mut stall => {
                metrics::counter!(metric::REQUESTS_FAILED, "reason" => "stalled").increment(1);
                return Err(TunnelError::stalled().with_detail(node.as_str()));
            }
        };
        let resp = match res {
            Ok(resp) => resp,
            Err(e) => {
                let err = TunnelError::from_hyper(e);
                let reason = if err.is_closed() {
                    "closed"
                } else if err.is_timeout() {
                    "timeout"
                } else {
                    "error"
                };
                metrics::counter!(metric::REQUESTS_FAILED, "reason" => reason).increment(1);
                return Err(err);
            }
        };
        metrics::histogram!(metric::FORWARD_SECONDS).record(started.elapsed().as_secs_f64());
        metrics::counter!(metric::REQUESTS_FORWARDED).increment(1);
        session.progressed();
        self.shared.heartbeat(node, &session);
        Ok(resp.map(|body| {
            StreamBody {
                inner: body,
                stall: Some(stall),
                stream,
            }
            .boxed_unsync()
        }))
    }

    /// A tower [`Service`](tower::Service) over these tunnels.
    pub fn service(&self) -> TunnelService {
        TunnelService {
            tunnels: self.clone(),
        }
    }
}

/// One stream counted against its node's limit and the open-streams gauge until dropped.
struct StreamGuard {
    session: Arc<SessionShared>,
}

impl StreamGuard {
    fn acquire(session: Arc<SessionShared>) -> Option<Self> {
        let max = session.max_streams;
        let before = session
            .streams_open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        if before == 0 {
            // idle → busy: the stall clock starts now
            session
                .last_progress_ms
                .store(session.now_ms(), Ordering::Relaxed);
        }
        metrics::gauge!(metric::STREAMS_OPEN).increment(1.0);
        Some(Self { session })
    }

    /// Completes when the node is found stalled after this stream was opened.
    fn stall_signal(&self) -> StallSignal {
        let mut rx = self.session.stall.subscribe();
        Box::pin(async move {
            if rx.changed().await.is_err() {
                // the session is gone; its connection's end fails the stream
                std::future::pending::<()>().await;
            }
        })
    }
}

/// See [`StreamGuard::stall_signal`].
type StallSignal = Pin<Box<dyn Future<Output = ()> + Send>>;

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.session.streams_open.fetch_sub(1, Ordering::AcqRel);
        metrics::gauge!(metric::STREAMS_OPEN).decrement(1.0);
    }
}

pin_project_lite::pin_project! {
    /// A response body from a tunnel: holds its stream's slot until it ends or is dropped,
    /// counts its frames as the node's progress and a body that breaks off, and fails with
    /// [`TunnelError::is_stalled`] when the node is found stalled before its first frame.
    struct StreamBody {
        #[pin]
        inner: Incoming,
        // until the first frame
        stall: Option<StallSignal>,
        stream: StreamGuard,
    }
}

impl http_body::Body for StreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        match polled {
            Poll::Ready(Some(Err(e))) => {
                metrics::counter!(metric::REQUESTS_FAILED, "reason" => "body").increment(1);
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(Some(Ok(frame))) => {
                *this.stall = None;
                this.stream.session.progressed();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                let stalled = this
                    .stall
                    .as_mut()
                    .is_some_and(|stall| stall.as_mut().poll(cx).is_ready());
                if !stalled {
                    return Poll::Pending;
                }
                *this.stall = None;
                metrics::counter!(metric::REQUESTS_FAILED, "reason" => "stalled").increment(1);
                Poll::Ready(Some(Err(Box::new(TunnelError::stalled()))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A tower service that sends each request down the tunnel of the node named in its extensions.
///
/// The target is the [`NodeId`] in the request's extensions (the routing layer puts it there);
/// the same `NodeId` is inserted into the response's extensions.
#[derive(Clone, Debug)]
pub struct TunnelService {
    tunnels: Tunnels,
}

impl TunnelService {
    /// A service over `tunnels`.
    pub fn new(tunnels: Tunnels) -> Self {
        Self { tunnels }
    }
}

impl tower::Service<Request<BoxBody>> for TunnelService {
    type Response = Response<BoxBody>;
    type Error = TunnelError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<BoxBody>, TunnelError>> + Send>>;

    /// Always ready: capacity is per node, and the node is known only per request.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<BoxBody>) -> Self::Future {
        let tunnels = self.tunnels.clone();
        Box::pin(async move {
            let Some(node) = req.extensions().get::<NodeId>().cloned() else {
                return Err(TunnelError::missing_target());
            };
            let mut resp = tunnels.send(&node, req).await?;
            resp.extensions_mut().insert(node);
            Ok(resp)
        })
    }
}

#[cfg(test)]
mod tests;
