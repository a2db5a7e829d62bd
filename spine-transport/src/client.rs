//! Agent side of the tunnel: dial out, hand-shake, serve HTTP/2 to a local service, reconnect.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt as _, StreamExt as _};
use http::{Request, Response, Uri};
use http_body_util::BodyExt as _;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use spine_core::{BoxBody, BoxError, NodeDescriptor, NodeId};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;
use tracing::{debug, info, warn};

use crate::handshake::{decode_gateway_message, AgentMessage, GatewayMessage, Hello};
use crate::{NodeIdentity, RefusalReason, TunnelError, WsIo};

/// HTTP/2 streams the agent allows beyond its descriptor's `max_concurrency`: the gateway's probes
/// (`GET /health`, `GET /v1/models`, the takeover probe), and streams that have ended on the
/// gateway's side but that this end has not released yet (RFC 9113 §5.1.2 counts a stream until
/// both ends closed it, and the gateway opens the next request the moment the last one ended:
/// without room for that, the next stream is refused with `REFUSED_STREAM`). The gateway admits
/// at most `max_concurrency` requests itself.
const PROBE_STREAMS: u32 = 4;

/// The service an agent serves over its tunnel ([`TunnelClient::run`], [`TunnelSession::serve`]
/// and their variants): a cloneable tower service from a request of the gateway (hyper's
/// [`Incoming`](hyper::body::Incoming) body) to a response with a [`BoxBody`], whose error
/// converts into [`BoxError`] and whose future can move to another task.
///
/// Implemented for every such service (an axum `Router`, a `tower::service_fn`, a
/// `tower::ServiceBuilder` stack); it only names the bounds.
pub trait NodeService:
    tower::Service<
        Request<hyper::body::Incoming>,
        Response = Response<BoxBody>,
        Error: Into<BoxError>,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S> NodeService for S
where
    S: tower::Service<Request<hyper::body::Incoming>, Response = Response<BoxBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
{
}

/// Agent-side tunnel settings.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TunnelClientConfig {
    /// `wss://host:port/v1/tunnel`, or `ws://…` with [`allow_insecure_plaintext`]. Without a port,
    /// 443 for `wss` and 80 for `ws`.
    ///
    /// [`allow_insecure_plaintext`]: Self::allow_insecure_plaintext
    pub gateway_url: String,
    /// TLS settings for `wss://` (for example [`crate::client_config_with_ca`]). Required for
    /// `wss://`.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// Allows a plaintext `ws://` gateway URL. Everything, prompts included, then crosses the
    /// network in clear text. Default `false`.
    pub allow_insecure_plaintext: bool,
    /// The node's key pair.
    pub identity: NodeIdentity,
    /// What the node says about itself in the hello.
    pub descriptor: NodeDescriptor,
    /// First reconnection delay. Default 1 s.
    pub backoff_min: Duration,
    /// Largest reconnection delay. Default 30 s.
    pub backoff_max: Duration,
    /// Fixed wait before dialling again after a `duplicate_session` refusal (the gateway still
    /// holds a live-looking tunnel for this identity). Usually a reconnection race, or a
    /// standby agent waiting for the active one to die: retried on this short interval, not
    /// the doubling backoff, so a standby takes over within about this much after the gateway
    /// drops the old tunnel. Default 1 s.
    pub duplicate_session_retry: Duration,
    /// Bound on dialling, TLS, the WebSocket upgrade and the tunnel handshake, each. Default 10 s.
    pub connect_timeout: Duration,
    /// HTTP/2 PING interval towards the gateway (the gateway pings too). Default 10 s.
    pub keepalive_interval: Duration,
    /// A PING not acknowledged within this ends the tunnel, and the agent reconnects.
    /// Default 5 s (a dead gateway is noticed within 15 s).
    pub keepalive_timeout: Duration,
    /// A write to the tunnel blocked this long kills it. Default 5 s.
    pub write_timeout: Duration,
    /// Largest WebSocket message (and frame) accepted from the gateway, bytes. Default 1 MiB.
    pub max_ws_message_bytes: usize,
    /// Largest binary message written to the gateway, bytes. Default 64 KiB.
    pub max_write_message_bytes: usize,
    /// Largest HTTP/2 header list accepted in a request, bytes. Default 64 KiB.
    pub max_header_list_bytes: u32,
    /// The WebSocket read buffer, bytes (a chunk size, not a message limit). Default 4 KiB.
    pub ws_read_buffer_bytes: usize,
    /// WebSocket ping interval towards the gateway, for middleboxes. Default 20 s.
    pub ws_ping_interval: Duration,
    /// Local address to dial from (for example to pick an interface, or to spread many
    /// simulated nodes over several `127.0.0.x` sources in a load test). Default: any.
    pub local_addr: Option<std::net::IpAddr>,
    /// Graceful shutdown ([`TunnelClient::run_until`], [`TunnelSession::serve_until`]): how
    /// long requests in flight may take to finish after GOAWAY before the tunnel is closed
    /// anyway. Default 30 s.
    pub drain_timeout: Duration,
}

impl TunnelClientConfig {
    /// Settings with the documented defaults: TLS required, no TLS configuration yet.
    pub fn new(
        gateway_url: impl Into<String>,
        identity: NodeIdentity,
        descriptor: NodeDescriptor,
    ) -> Self {
        Self {
            gateway_url: gateway_url.into(),
            tls: None,
            allow_insecure_plaintext: false,
            identity,
            descriptor,
            backoff_min: Duration::from_secs(1),
            backoff_max: Duration::from_secs(30),
            duplicate_session_retry: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
            max_ws_message_bytes: 1024 * 1024,
            max_write_message_bytes: crate::ws_io::DEFAULT_MAX_WRITE_MESSAGE_BYTES,
            max_header_list_bytes: 64 * 1024,
            ws_read_buffer_bytes: 4 * 1024,
            ws_ping_interval: Duration::from_secs(20),
            local_addr: None,
            drain_timeout: Duration::from_secs(30),
        }
    }
}

#[derive(Clone, Debug)]
struct Target {
    url: String,
    host: String,
    port: u16,
    tls: Option<Arc<rustls::ClientConfig>>,
}

fn parse_target(config: &TunnelClientConfig) -> Result<Target, TunnelError> {
    let uri: Uri = config.gateway_url.parse().map_err(|e| {
        TunnelError::config()
            .with_detail("invalid gateway url")
            .with_source(e)
    })?;
    let (tls, default_port) = match uri.scheme_str() {
        Some("wss") => (true, 443),
        Some("ws") => (false, 80),
        _ => {
            return Err(
                TunnelError::config().with_detail("gateway url must start with wss:// or ws://")
            )
        }
    };
    let host = uri
        .host()
        .ok_or_else(|| TunnelError::config().with_detail("gateway url has no host"))?;
    // IPv6 literals come bracketed in URLs; sockets and TLS names want them bare.
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let tls = if tls {
        Some(config.tls.clone().ok_or_else(|| {
            TunnelError::config().with_detail("wss:// gateway url needs a tls configuration")
        })?)
    } else {
        if !config.allow_insecure_plaintext {
            return Err(TunnelError::config().with_detail(
                "ws:// gateway url is plaintext; allow it explicitly (insecure) or use wss://",
            ));
        }
        None
    };
    Ok(Target {
        url: config.gateway_url.clone(),
        port: uri.port_u16().unwrap_or(default_port),
        host,
        tls,
    })
}

/// Reconnection delays: exponential from a minimum to a maximum (design brief §4: 1 s → 30 s).
#[derive(Clone, Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    /// Starts at `min`; doubles up to `max` (at least `min`).
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max: max.max(min),
            current: min,
        }
    }

    /// Back to the minimum (after a tunnel was established).
    pub fn reset(&mut self) {
        self.current = self.min;
    }

    /// The full current delay; the next one doubles (capped). Used after a refusal: bad
    /// credentials do not get better quickly.
    pub fn next_full(&mut self) -> Duration {
        let delay = self.current;
        self.current = self.current.saturating_mul(2).min(self.max);
        delay
    }

    /// The current delay with "equal jitter": uniformly random in `[delay / 2, delay]`; the next
    /// one doubles (capped). Spreads reconnections of many agents after a gateway restart.
    pub fn next_jittered(&mut self) -> Duration {
        let delay = self.next_full();
        let half = delay / 2;
        half + half.mul_f64(rand::random::<f64>())
    }
}

use crate::chain::ErrorChain as Chain;

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// A boxed dialled stream (TLS or plain TCP).
struct BoxedIo(Box<dyn Io>);

impl AsyncRead for BoxedIo {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for BoxedIo {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

/// The agent's end of the tunnel (design brief §4): dials the gateway, proves its identity, and
/// serves HTTP/2 requests coming down the tunnel with a local service.
#[derive(Clone)]
pub struct TunnelClient {
    config: Arc<TunnelClientConfig>,
    target: Target,
}

impl fmt::Debug for TunnelClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TunnelClient")
            .field("gateway_url", &self.target.url)
            .field("public_key", &self.config.identity.public_key_text())
            .finish_non_exhaustive()
    }
}

async fn within<T, E>(
    timeout: Duration,
    fut: impl std::future::Future<Output = Result<T, E>>,
    on_err: impl FnOnce(E) -> TunnelError,
) -> Result<T, TunnelError> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(on_err(e)),
        Err(_) => Err(TunnelError::timeout()),
    }
}

fn refusal_from_close(frame: Option<&CloseFrame>) -> TunnelError {
    let Some(frame) = frame else {
        return TunnelError::closed().with_detail("gateway closed the tunnel during the handshake");
    };
    let reason = RefusalReason::from_close_code(u16::from(frame.code))
        .or_else(|| RefusalReason::parse(frame.reason.as_str()));
    match reason {
        Some(reason) => TunnelError::refused(reason),
        None => TunnelError::closed().with_detail(format!(
            "gateway closed the tunnel during the handshake (code {}, reason {:?})",
            u16::from(frame.code),
            frame.reason.as_str()
        )),
    }
}

/// TCP connection to `host:port`, from `local` when given.
async fn dial(
    host: &str,
    port: u16,
    local: Option<std::net::IpAddr>,
) -> std::io::Result<TcpStream> {
    let Some(local) = local else {
        return TcpStream::connect((host, port)).await;
    };
    let mut last = None;
    for addr in tokio::net::lookup_host((host, port)).await? {
        if addr.is_ipv4() != local.is_ipv4() {
            continue;
        }
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.bind(std::net::SocketAddr::new(local, 0))?;
        match socket.connect(addr).await {
            Ok(tcp) => return Ok(tcp),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::AddrNotAvailable,
            "no gateway address of the local address's family",
        )
    }))
}

/// The next handshake message from the gateway; a close becomes a refusal.
async fn next_gateway_message(
    ws: &mut WebSocketStream<BoxedIo>,
) -> Result<GatewayMessage, TunnelError> {
    loop {
        match ws.next().await {
            Some(Ok(Message::Text(text))) => {
                return decode_gateway_message(text.as_bytes()).map_err(|e| {
                    TunnelError::protocol()
                        .with_detail("malformed gateway handshake message")
                        .with_source(e)
                })
            }
            Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
            Some(Ok(Message::Binary(_))) => {
                return Err(
                    TunnelError::protocol().with_detail("binary message during the handshake")
                )
            }
            Some(Ok(Message::Close(frame))) => return Err(refusal_from_close(frame.as_ref())),
            Some(Err(e)) => return Err(TunnelError::closed().with_source(e)),
            None => return Err(TunnelError::closed()),
        }
    }
}

impl TunnelClient {
    /// A client for `config`.
    ///
    /// # Errors
    ///
    /// [`TunnelError::is_config`] when the gateway URL is not `wss://` or `ws://`, when `wss://`
    /// comes without a TLS configuration, or when `ws://` is not explicitly allowed.
    pub fn new(config: TunnelClientConfig) -> Result<Self, TunnelError> {
        let target = parse_target(&config)?;
        if target.tls.is_none() {
            warn!(
                gateway = %target.url,
                "plaintext tunnel: prompts and completions cross the network unencrypted"
            );
        }
        Ok(Self {
            config: Arc::new(config),
            target,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &TunnelClientConfig {
        &self.config
    }

    /// Dials the gateway and completes the handshake: TCP (`TCP_NODELAY`), TLS, WebSocket
    /// upgrade, challenge, signed hello, acceptance.
    ///
    /// # Errors
    ///
    /// [`TunnelError::is_refused`] with [`TunnelError::refusal`] when the gateway refused the
    /// handshake; [`TunnelError::is_connect`] when dialling, TLS or the upgrade failed;
    /// [`TunnelError::is_timeout`] when a step took longer than `connect_timeout`;
    /// [`TunnelError::is_protocol`] / [`TunnelError::is_closed`] when the gateway broke off.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future closes the connection being set up.
    pub async fn connect(&self) -> Result<TunnelSession, TunnelError> {
        let config = &self.config;
        let timeout = config.connect_timeout;
        let target = &self.target;
        let tcp = within(
            timeout,
            dial(&target.host, target.port, config.local_addr),
            |e| TunnelError::connect().with_source(e),
        )
        .await?;
        if let Err(e) = tcp.set_nodelay(true) {
            debug!(error = %e, "set TCP_NODELAY failed");
        }
        let io = match &target.tls {
            Some(tls) => {
                let name =
                    rustls_pki_types::ServerName::try_from(target.host.clone()).map_err(|e| {
                        TunnelError::config()
                            .with_detail("gateway host is not a valid tls server name")
                            .with_source(e)
                    })?;
                let connector = tokio_rustls::TlsConnector::from(tls.clone());
                let stream = within(timeout, connector.connect(name, tcp), |e| {
                    TunnelError::connect().with_detail("tls").with_source(e)
                })
                .await?;
                BoxedIo(Box::new(stream))
            }
            None => BoxedIo(Box::new(tcp)),
        };
        let ws_config = crate::server::ws_config(
            config.max_ws_message_bytes,
            config.ws_read_buffer_bytes,
            config.max_write_message_bytes,
        );
        let (mut ws, _resp) = within(
            timeout,
            tokio_tungstenite::client_async_with_config(target.url.as_str(), io, Some(ws_config)),
            |e| {
                TunnelError::connect()
                    .with_detail("websocket upgrade")
                    .with_source(e)
            },
        )
        .await?;

        let challenge = match within(timeout, next_gateway_message(&mut ws), |e| e).await? {
            GatewayMessage::Challenge(c) => c,
            _ => {
                return Err(TunnelError::protocol().with_detail("expected a challenge"));
            }
        };
        // signed for the host this agent dialled: a gateway reached under another name (a
        // rogue relaying the real one's challenge) gets a hello useless anywhere else
        let hello = Hello::sign(
            &config.identity,
            &challenge,
            &target.host,
            config.descriptor.clone(),
        );
        let hello = serde_json::to_string(&AgentMessage::Hello(hello))
            .map_err(|e| TunnelError::protocol().with_source(e))?;
        within(timeout, ws.send(Message::text(hello)), |e| {
            TunnelError::closed().with_source(e)
        })
        .await?;
        let node_id = match within(timeout, next_gateway_message(&mut ws), |e| e).await? {
            GatewayMessage::Accepted(a) => a.node_id,
            _ => return Err(TunnelError::protocol().with_detail("expected an acceptance")),
        };
        Ok(TunnelSession {
            ws,
            node_id,
            config: self.config.clone(),
        })
    }

    /// [`connect`](Self::connect), then [`TunnelSession::serve`] until the tunnel ends.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect) and [`TunnelSession::serve`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future closes the connection being set up, or the tunnel once it serves;
    /// requests in flight then fail on the gateway side.
    pub async fn connect_once<S>(&self, service: S) -> Result<(), TunnelError>
    where
        S: NodeService,
    {
        let session = self.connect().await?;
        info!(node = %session.node_id(), gateway = %self.target.url, "tunnel established");
        session.serve(service).await
    }

    /// Keeps a tunnel up forever: connect, serve until the tunnel ends, wait, reconnect.
    ///
    /// Waits follow [`Backoff`] from `backoff_min` to `backoff_max`: jittered after a failed dial
    /// or a tunnel that ended, the full delay after a refusal (design brief §4) except
    /// `duplicate_session`, retried every `duplicate_session_retry` (1 s); back to the
    /// minimum once a tunnel is established. Never returns; drop the future to stop (abruptly:
    /// see [`run_until`](Self::run_until) for a graceful stop).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future closes the tunnel; requests in flight fail on the gateway side.
    pub async fn run<S>(self, service: S)
    where
        S: NodeService,
    {
        self.run_until(service, std::future::pending::<()>()).await;
    }

    /// As [`run`](Self::run), until `shutdown` completes; then stops gracefully: the live tunnel
    /// (if any) sends HTTP/2 GOAWAY so the gateway opens no new stream, requests in flight get
    /// up to `drain_timeout` to finish, and the WebSocket is closed with a close frame.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future closes the tunnel at once; requests in flight fail on the gateway
    /// side.
    pub async fn run_until<S, F>(self, service: S, shutdown: F)
    where
        S: NodeService,
        F: std::future::Future<Output = ()>,
    {
        let shutdown = Shutdown::new(shutdown);
        tokio::pin!(shutdown);
        let mut backoff = Backoff::new(self.config.backoff_min, self.config.backoff_max);
        loop {
            let connected = tokio::select! {
                res = self.connect() => res,
                () = shutdown.as_mut().wait() => return,
            };
            let delay = match connected {
                Ok(session) => {
                    info!(node = %session.node_id(), gateway = %self.target.url, "tunnel established");
                    backoff.reset();
                    match session
                        .serve_until(service.clone(), shutdown.as_mut().wait())
                        .await
                    {
                        Ok(()) => info!("tunnel closed"),
                        Err(e) => warn!(error = %Chain(&e), "tunnel ended"),
                    }
                    if shutdown.is_done() {
                        return;
                    }
                    backoff.next_jittered()
                }
                Err(e) if e.refusal() == Some(RefusalReason::DuplicateSession) => {
                    let delay = self.config.duplicate_session_retry;
                    info!(
                        retry_in_ms = delay.as_millis() as u64,
                        "gateway holds another tunnel for this node (duplicate_session)"
                    );
                    delay
                }
                Err(e) if e.is_refused() => {
                    let delay = backoff.next_full();
                    warn!(
                        reason = e.refusal().map_or("unknown", |r| r.as_str()),
                        retry_in_ms = delay.as_millis() as u64,
                        "gateway refused the tunnel"
                    );
                    delay
                }
                Err(e) => {
                    let delay = backoff.next_jittered();
                    warn!(error = %Chain(&e), retry_in_ms = delay.as_millis() as u64, "tunnel connect failed");
                    delay
                }
            };
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = shutdown.as_mut().wait() => return,
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// A shutdown future that can be awaited many times and remembers that it fired.
    struct Shutdown<F> {
        #[pin]
        inner: F,
        done: bool,
    }
}

impl<F: std::future::Future<Output = ()>> Shutdown<F> {
    fn new(inner: F) -> Self {
        Self { inner, done: false }
    }

    fn is_done(&self) -> bool {
        self.done
    }

    /// Completes when the shutdown future has (now or earlier).
    fn wait(self: std::pin::Pin<&mut Self>) -> impl std::future::Future<Output = ()> + '_ {
        let mut this = Some(self);
        std::future::poll_fn(move |cx| {
            let Some(s) = this.as_mut() else {
                return std::task::Poll::Ready(());
            };
            let p = s.as_mut().project();
            if *p.done {
                return std::task::Poll::Ready(());
            }
            match p.inner.poll(cx) {
                std::task::Poll::Ready(()) => {
                    *p.done = true;
                    this = None;
                    std::task::Poll::Ready(())
                }
                std::task::Poll::Pending => std::task::Poll::Pending,
            }
        })
    }
}

/// An accepted tunnel, before it serves.
pub struct TunnelSession {
    ws: WebSocketStream<BoxedIo>,
    node_id: NodeId,
    config: Arc<TunnelClientConfig>,
}

impl fmt::Debug for TunnelSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TunnelSession")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

impl TunnelSession {
    /// The node id the gateway accepted this key as.
    pub fn node_id(&self) -> &NodeId {
        &self.node_id
    }

    /// Serves HTTP/2 over the tunnel with `service` until the tunnel ends.
    ///
    /// Advertises `SETTINGS_MAX_CONCURRENT_STREAMS` = the descriptor's `max_concurrency` (at
    /// least 1), pings the gateway every `keepalive_interval` of silence, sends WebSocket pings
    /// every `ws_ping_interval`. Each request runs in its own task; a stream reset by the gateway
    /// drops the service's response future and body (cancelling the engine request). The
    /// gateway's liveness probe ([`crate::PROBE_PATH`]) is answered here, never reaching
    /// `service`.
    ///
    /// # Errors
    ///
    /// [`TunnelError::is_closed`] / [`TunnelError::is_timeout`] when the tunnel ends uncleanly.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future closes the tunnel.
    pub async fn serve<S>(self, service: S) -> Result<(), TunnelError>
    where
        S: NodeService,
    {
        self.serve_until(service, std::future::pending::<()>())
            .await
    }

    /// As [`serve`](Self::serve), until `shutdown` completes; then drains gracefully: HTTP/2
    /// GOAWAY (the gateway opens no new stream), requests in flight get up to `drain_timeout`
    /// to finish, then the WebSocket is closed with a close frame.
    ///
    /// # Errors
    ///
    /// As [`serve`](Self::serve); [`TunnelError::is_timeout`] when requests were still in
    /// flight at the end of `drain_timeout` (the tunnel is closed anyway).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future closes the tunnel at once.
    pub async fn serve_until<S, F>(self, service: S, shutdown: F) -> Result<(), TunnelError>
    where
        S: NodeService,
        F: std::future::Future<Output = ()>,
    {
        let config = &self.config;
        let io = WsIo::new(self.ws)
            .with_write_timeout(config.write_timeout)
            .with_max_write_message_bytes(config.max_write_message_bytes)
            .with_ping_interval(config.ws_ping_interval);
        let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            // a few streams more than the gateway uses for requests: the gateway's health and
            // liveness probes never wait behind a full node's requests, and a stream released
            // late here does not refuse the next request
            .max_concurrent_streams(
                config
                    .descriptor
                    .max_concurrency
                    .max(1)
                    .saturating_add(PROBE_STREAMS),
            )
            .keep_alive_interval(config.keepalive_interval)
            .keep_alive_timeout(config.keepalive_timeout)
            .max_header_list_size(config.max_header_list_bytes)
            .max_send_buf_size(256 * 1024);
        let conn = builder.serve_connection(
            TokioIo::new(io),
            TowerToHyperService::new(ProbeAnswer { inner: service }),
        );
        tokio::pin!(conn);
        tokio::pin!(shutdown);
        tokio::select! {
            res = conn.as_mut() => return res.map_err(TunnelError::from_hyper),
            () = &mut shutdown => {}
        }
        info!(
            drain_timeout_ms = config.drain_timeout.as_millis() as u64,
            "draining the tunnel: GOAWAY sent, finishing requests in flight"
        );
        conn.as_mut().graceful_shutdown();
        match tokio::time::timeout(config.drain_timeout, conn.as_mut()).await {
            Ok(res) => res.map_err(TunnelError::from_hyper),
            Err(_) => {
                warn!("requests still in flight after the drain timeout; closing the tunnel");
                Err(TunnelError::timeout().with_detail("drain timeout"))
            }
        }
    }
}

/// Answers the gateway's liveness probe ([`crate::PROBE_PATH`]) with 204; passes everything
/// else to the inner service.
#[derive(Clone)]
struct ProbeAnswer<S> {
    inner: S,
}

impl<S> tower::Service<Request<hyper::body::Incoming>> for ProbeAnswer<S>
where
    S: tower::Service<Request<hyper::body::Incoming>, Response = Response<BoxBody>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
{
    type Response = Response<BoxBody>;
    type Error = BoxError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Response<BoxBody>, BoxError>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<hyper::body::Incoming>) -> Self::Future {
        if req.uri().path() == crate::PROBE_PATH {
            let mut resp = Response::new(
                http_body_util::Empty::<bytes::Bytes>::new()
                    .map_err(|e| match e {})
                    .boxed_unsync(),
            );
            *resp.status_mut() = http::StatusCode::NO_CONTENT;
            return Box::pin(std::future::ready(Ok(resp)));
        }
        let fut = self.inner.call(req);
        Box::pin(async move { fut.await.map_err(Into::into).map(crate::join::joined) })
    }
}

#[cfg(test)]
mod tests;
