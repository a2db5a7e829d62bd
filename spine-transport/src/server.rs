//! Gateway side of the tunnel: accept, verify, hold one HTTP/2 client per node.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt as _;
use http::{header, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt as _, Empty, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use spine_core::{BoxBody, BoxError, NodeDescriptor, NodeId};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};
use tokio_tungstenite::WebSocketStream;
use tracing::{debug, info, warn, Instrument as _};

use crate::handshake::{decode_hello, Accepted, Challenge, GatewayMessage};
use crate::{RefusalReason, TunnelError, WsIo};

/// The path agents upgrade on.
pub const TUNNEL_PATH: &str = "/v1/tunnel";

/// The path of the health probe sent through a new tunnel; the agent maps it to its engine's
/// health endpoint.
pub const HEALTH_PATH: &str = "/health";

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
/// For one node, calls alternate: `node_ready`, then `node_gone`, then (after a reconnection)
/// `node_ready` again. Calls are made from the tunnel's own task; keep them short and
/// non-blocking.
pub trait TunnelEvents: Send + Sync + 'static {
    /// The node's tunnel is up and its first health probe through the tunnel (`GET /health`)
    /// returned 2xx: the node may be routed to (design brief §4).
    fn node_ready(&self, node: &NodeId, descriptor: &NodeDescriptor);

    /// The node's tunnel closed or was found dead; called once after each `node_ready`.
    fn node_gone(&self, node: &NodeId);
}

/// Ignores every event.
impl TunnelEvents for () {
    fn node_ready(&self, _node: &NodeId, _descriptor: &NodeDescriptor) {}
    fn node_gone(&self, _node: &NodeId) {}
}

/// Gateway-side tunnel settings (design brief §4 limits).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TunnelServerConfig {
    /// This gateway instance's id, sent in every challenge. Default `spine-gateway`.
    pub gateway_id: String,
    /// Bound on each phase of accepting a tunnel: the TLS handshake, the HTTP upgrade request, and
    /// the wait for the hello after the challenge. Default 10 s.
    pub handshake_timeout: Duration,
    /// A hello that arrives later than this after its challenge is refused as
    /// `stale_challenge`. Default 5 s.
    pub challenge_max_age: Duration,
    /// HTTP/2 PING interval, sent even when the tunnel is idle. Default 10 s.
    pub keepalive_interval: Duration,
    /// A PING not acknowledged within this closes the tunnel as dead. Default 20 s.
    pub keepalive_timeout: Duration,
    /// A write to the tunnel blocked this long kills it. Default 5 s.
    pub write_timeout: Duration,
    /// Largest WebSocket message (and frame) accepted from an agent, bytes. Default 1 MiB.
    pub max_ws_message_bytes: usize,
    /// Largest binary message written to an agent, bytes. Default 64 KiB.
    pub max_write_message_bytes: usize,
    /// Largest HTTP/2 header list accepted in a response, bytes. Default 64 KiB.
    pub max_header_list_bytes: u32,
    /// Wait between health probes until the first one succeeds. Default 1 s.
    pub health_probe_interval: Duration,
    /// Bound on one health probe. Default 5 s.
    pub health_probe_timeout: Duration,
}

impl Default for TunnelServerConfig {
    fn default() -> Self {
        Self {
            gateway_id: "spine-gateway".to_owned(),
            handshake_timeout: Duration::from_secs(10),
            challenge_max_age: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(20),
            write_timeout: Duration::from_secs(5),
            max_ws_message_bytes: 1024 * 1024,
            max_write_message_bytes: crate::ws_io::DEFAULT_MAX_WRITE_MESSAGE_BYTES,
            max_header_list_bytes: 64 * 1024,
            health_probe_interval: Duration::from_secs(1),
            health_probe_timeout: Duration::from_secs(5),
        }
    }
}

struct Session {
    id: u64,
    descriptor: NodeDescriptor,
    /// `None` while the session is reserved (accepted, HTTP/2 not yet set up).
    sender: Option<SendRequest<BoxBody>>,
    ready: bool,
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
}

/// The gateway's tunnel listener (design brief §4).
///
/// Accepts TLS (or, only when the caller passes no TLS configuration, plaintext) connections,
/// answers `GET /v1/tunnel` WebSocket upgrades, verifies the signed handshake, and keeps one
/// HTTP/2 client connection per node, reachable through [`Tunnels`].
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

    /// Runs the accept loop on `listener`.
    ///
    /// `tls = None` serves plaintext `ws://`; the reference gateway passes `None` only behind an
    /// explicitly insecure flag. Every accepted socket gets `TCP_NODELAY`. Each connection runs in
    /// its own task; errors of one connection are logged and never end the loop, nor do accept
    /// errors (such as running out of file descriptors), which are logged and retried after
    /// 100 ms.
    ///
    /// # Errors
    ///
    /// None today: the loop runs until the future is dropped. The `Result` leaves room for fatal
    /// listener errors.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops accepting; tunnels already accepted keep running.
    pub async fn serve(
        self,
        listener: TcpListener,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> std::io::Result<()> {
        let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
        if let Ok(addr) = listener.local_addr() {
            info!(%addr, tls = acceptor.is_some(), "tunnel listener started");
        }
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(conn) => conn,
                Err(e) => {
                    warn!(error = %e, "tunnel accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            if let Err(e) = tcp.set_nodelay(true) {
                debug!(%peer, error = %e, "set TCP_NODELAY failed");
            }
            let shared = self.shared.clone();
            let acceptor = acceptor.clone();
            let span = tracing::info_span!("tunnel", %peer, node = tracing::field::Empty);
            tokio::spawn(
                async move {
                    match acceptor {
                        Some(acceptor) => {
                            let timeout = shared.config.handshake_timeout;
                            match tokio::time::timeout(timeout, acceptor.accept(tcp)).await {
                                Ok(Ok(tls)) => serve_http1(shared, tls).await,
                                Ok(Err(e)) => debug!(error = %e, "tls handshake failed"),
                                Err(_) => debug!("tls handshake timed out"),
                            }
                        }
                        None => serve_http1(shared, tcp).await,
                    }
                }
                .instrument(span),
            );
        }
    }
}

type UpgradeBody = Full<Bytes>;

async fn serve_http1<IO>(shared: Arc<Shared>, io: IO)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let header_timeout = shared.config.handshake_timeout;
    let service = hyper::service::service_fn(move |req| {
        let resp = upgrade(shared.clone(), req);
        std::future::ready(Ok::<_, Infallible>(resp))
    });
    let res = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades()
        .await;
    if let Err(e) = res {
        debug!(error = %e, "tunnel http/1 connection ended with error");
    }
}

fn plain(status: StatusCode, text: &'static str) -> Response<UpgradeBody> {
    let mut resp = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

fn header_has_token(
    req: &Request<hyper::body::Incoming>,
    name: header::HeaderName,
    token: &str,
) -> bool {
    req.headers().get_all(name).iter().any(|v| {
        v.to_str().is_ok_and(|s| {
            s.split(',')
                .any(|part| part.trim().eq_ignore_ascii_case(token))
        })
    })
}

/// Answers one HTTP/1.1 request on the tunnel listener: 101 for a valid upgrade on
/// [`TUNNEL_PATH`], an error status otherwise.
fn upgrade(shared: Arc<Shared>, mut req: Request<hyper::body::Incoming>) -> Response<UpgradeBody> {
    if req.uri().path() != TUNNEL_PATH {
        return plain(StatusCode::NOT_FOUND, "not found\n");
    }
    if req.method() != Method::GET {
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
        return plain(StatusCode::BAD_REQUEST, "missing sec-websocket-key\n");
    };
    let Ok(accept) = HeaderValue::from_str(&derive_accept_key(key.as_bytes())) else {
        return plain(StatusCode::BAD_REQUEST, "bad sec-websocket-key\n");
    };

    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(
        async move {
            match on_upgrade.await {
                Ok(upgraded) => {
                    let ws_config = WebSocketConfig::default()
                        .max_message_size(Some(shared.config.max_ws_message_bytes))
                        .max_frame_size(Some(shared.config.max_ws_message_bytes));
                    let ws = WebSocketStream::from_raw_socket(
                        TokioIo::new(upgraded),
                        Role::Server,
                        Some(ws_config),
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
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Closes `ws` with the refusal's code and reason, then drains it briefly so the close
/// handshake completes.
async fn refuse<S>(ws: &mut WebSocketStream<S>, reason: RefusalReason)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    info!(reason = reason.as_str(), "tunnel refused");
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
    let node = match shared.auth.authenticate(&hello.public_key).await {
        Ok(node) => node,
        Err(reason) => return refuse(&mut ws, reason).await,
    };
    tracing::Span::current().record("node", tracing::field::display(&node));

    // One session per node. Minimal rule for now: a second session for a node with a live one is
    // refused. Design brief §4 asks for more: probe the old session and let the new one take over
    // when the old one does not answer promptly (dirty loss not yet detected by keepalive). That
    // takeover is a later change; until then a reconnecting agent is refused for up to
    // ~keepalive_interval + keepalive_timeout after a dirty loss, and retries after its backoff.
    let session_id = shared.next_session_id.fetch_add(1, Ordering::Relaxed);
    let reserved = {
        let mut sessions = shared.sessions();
        match sessions.entry(node.clone()) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(Session {
                    id: session_id,
                    descriptor: hello.descriptor.clone(),
                    sender: None,
                    ready: false,
                });
                true
            }
        }
    };
    if !reserved {
        return refuse(&mut ws, RefusalReason::DuplicateSession).await;
    }

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
    info!(
        %node,
        engine = hello.descriptor.engine.as_str(),
        models = hello.descriptor.models.len(),
        max_concurrency = hello.descriptor.max_concurrency,
        "tunnel accepted"
    );

    let io = WsIo::new(ws)
        .with_write_timeout(config.write_timeout)
        .with_max_write_message_bytes(config.max_write_message_bytes);
    let mut builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(config.keepalive_interval)
        .keep_alive_timeout(config.keepalive_timeout)
        .keep_alive_while_idle(true)
        .max_header_list_size(config.max_header_list_bytes);
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

    // Routable only after the first health probe through the tunnel succeeds.
    let ready = tokio::select! {
        healthy = probe_until_healthy(&shared, sender) => healthy,
        _ = &mut conn => false,
    };
    if ready {
        let descriptor = {
            let mut sessions = shared.sessions();
            sessions
                .get_mut(&node)
                .filter(|s| s.id == session_id)
                .map(|s| {
                    s.ready = true;
                    s.descriptor.clone()
                })
        };
        if let Some(descriptor) = descriptor {
            info!(%node, "node ready");
            shared.events.node_ready(&node, &descriptor);
        }
        match conn.await {
            Ok(Ok(())) => info!(%node, "tunnel closed"),
            Ok(Err(e)) => info!(%node, error = %e, "tunnel ended"),
            Err(e) => warn!(%node, error = %e, "tunnel task failed"),
        }
    } else {
        info!(%node, "tunnel ended before the node became ready");
    }
    session.end();
}

/// Removes a session from the map (only if it is still this one) when the session ends, and
/// reports `node_gone` if it had been reported ready.
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
        let removed = {
            let mut sessions = self.shared.sessions();
            match sessions.get(&self.node) {
                Some(s) if s.id == self.id => sessions.remove(&self.node),
                _ => None,
            }
        };
        if removed.is_some_and(|s| s.ready) {
            info!(node = %self.node, "node gone");
            self.shared.events.node_gone(&self.node);
        }
    }
}

/// Probes `GET /health` through the tunnel until it answers 2xx (`true`) or the tunnel closes
/// (`false`).
async fn probe_until_healthy(shared: &Shared, mut sender: SendRequest<BoxBody>) -> bool {
    let config = &shared.config;
    loop {
        if sender.is_closed() {
            return false;
        }
        let probe = async {
            sender.ready().await?;
            let req = Request::get(Uri::from_static("http://spine-node/health"))
                .body(Empty::<Bytes>::new().map_err(|e| match e {}).boxed_unsync());
            let req = match req {
                Ok(req) => req,
                // a static request always builds
                Err(_) => return Ok(StatusCode::INTERNAL_SERVER_ERROR),
            };
            let resp = sender.send_request(req).await?;
            let status = resp.status();
            // read the (small) body so the stream ends cleanly
            let _ = resp.into_body().collect().await;
            Ok::<_, hyper::Error>(status)
        };
        match tokio::time::timeout(config.health_probe_timeout, probe).await {
            Ok(Ok(status)) if status.is_success() => return true,
            Ok(Ok(status)) => debug!(status = status.as_u16(), "health probe not ok"),
            Ok(Err(e)) => debug!(error = %e, "health probe failed"),
            Err(_) => debug!("health probe timed out"),
        }
        tokio::time::sleep(config.health_probe_interval).await;
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
    /// The nodes that are ready (reported by [`TunnelEvents::node_ready`] and not yet gone) with
    /// the descriptor each sent in its handshake, sorted by node id.
    pub fn connected(&self) -> Vec<(NodeId, NodeDescriptor)> {
        let mut nodes: Vec<_> = self
            .shared
            .sessions()
            .iter()
            .filter(|(_, s)| s.ready)
            .map(|(n, s)| (n.clone(), s.descriptor.clone()))
            .collect();
        nodes.sort_by(|a, b| a.0.cmp(&b.0));
        nodes
    }

    /// Whether `node` has a live tunnel (ready or still being probed).
    pub fn contains(&self, node: &NodeId) -> bool {
        self.shared.sessions().contains_key(node)
    }

    /// Sends `req` down `node`'s tunnel as a new HTTP/2 stream and returns the node's response,
    /// whose body streams as the node sends it.
    ///
    /// The request's URI is rewritten to `http://spine-node/<path and query>`; hyper strips
    /// connection-specific headers, which HTTP/2 forbids. When the node's advertised
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` is reached, the request waits for a free stream.
    ///
    /// # Errors
    ///
    /// [`TunnelError::is_unknown_node`] when the node has no live tunnel;
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
        let sender = {
            let sessions = self.shared.sessions();
            sessions.get(node).and_then(|s| s.sender.clone())
        };
        let Some(mut sender) = sender else {
            return Err(TunnelError::unknown_node().with_detail(node.as_str()));
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
        sender.ready().await.map_err(TunnelError::from_hyper)?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(TunnelError::from_hyper)?;
        Ok(resp.map(|body| body.map_err(|e| Box::new(e) as BoxError).boxed_unsync()))
    }

    /// A tower [`Service`](tower::Service) over these tunnels.
    pub fn service(&self) -> TunnelService {
        TunnelService {
            tunnels: self.clone(),
        }
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
