//! A bounded HTTP server loop for every listener of a gateway: the tunnel listener, a public
//! API, an admin API, an internal listener.
//!
//! What an unauthenticated peer can hold is bounded ([`ListenerLimits`]):
//!
//! - **Connections**: at most `max_connections` at once. At the cap a new connection makes room
//!   by closing the connection that has been idle (no request in flight) the longest; when every
//!   connection has a request in flight the new one is closed at once. So idle connections
//!   (a flood of them, or slowloris clients that never finish a request head) can never keep a
//!   paying caller out, and a request in flight is never cut to make room. The evicted
//!   connection's place is handed to the new one at once (the accept loop never waits for it
//!   to wind down), so for a moment a few connections being closed may exceed the cap.
//! - **Request heads**: a connection must deliver a complete request head within
//!   `header_read_timeout` of being accepted (after TLS), and on HTTP/1.1 within it of the
//!   previous response ending (hyper's own header timeout); otherwise it is closed.
//! - **Request bodies**: a request body must arrive whole within `body_read_timeout` of its head;
//!   past it, reading the body fails with [`BodyReadTimeout`] (the handler answers its error and
//!   the connection closes).
//! - **Idle connections**: a connection with no request in flight for `idle_timeout` is closed
//!   (HTTP/1.1 and HTTP/2). A connection whose socket is still draining a response (the last
//!   write to it did not complete: the peer reads slowly, or not yet) is not idle: an answer
//!   that was generated, billed and settled is not cut because its reader is slow. Its idle
//!   clock starts when the socket accepts the last bytes. At the cap such a connection can
//!   still be evicted, as an idle one.
//! - **TLS**: the handshake must finish within `tls_handshake_timeout`.
//! - **Lingering close**: a connection the server ends while its peer is still sending (an
//!   answer given before the request body was read: a refusal, a 413, a body timeout) has its
//!   write half shut first, then what the peer still sends is discarded (without a copy on
//!   Linux) until the peer closes, for at most `lingering_time` (`lingering_timeout` between
//!   reads): closing at once would reset the connection and the peer, still writing, would see
//!   a broken pipe instead of the answer. A lingering connection keeps its place under the cap
//!   but is idle: evictable, and ended at once when the server shuts down.
//!
//! Every accepted socket gets `TCP_NODELAY`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use spine_core::BoxError;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tracing::{debug, info, warn, Instrument as _};

use crate::metric;

/// Bounds on what the peers of one listener may hold; see the [module docs](self). Defaults are
/// listed per field and in `docs/operations.md`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListenerLimits {
    /// A request head must be complete within this of the connection's start (after TLS) or,
    /// on HTTP/1.1, of the previous response's end. Default 15 s.
    pub header_read_timeout: Duration,
    /// A request body must arrive whole within this of its head. Default 60 s.
    pub body_read_timeout: Duration,
    /// A connection with no request in flight for this long is closed. Default 60 s.
    pub idle_timeout: Duration,
    /// The TLS handshake must finish within this (TLS listeners only). Default 10 s.
    pub tls_handshake_timeout: Duration,
    /// Most connections open at once; at the cap the longest-idle one is closed to make room,
    /// or the new one when none is idle. At least 1. Default 4096.
    pub max_connections: usize,
    /// How long, in all, a connection the server closed while its peer may still be sending
    /// (an answer given before the request body was read) keeps discarding what the peer
    /// sends before the socket is closed, so that the peer reads the answer rather than a TCP
    /// reset (see [`LimitedServer`]). Default 30 s (nginx's `lingering_time`).
    pub lingering_time: Duration,
    /// Lingering ends when the peer sends nothing for this long. Default 5 s (nginx's
    /// `lingering_timeout`).
    pub lingering_timeout: Duration,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(15),
            body_read_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            tls_handshake_timeout: Duration::from_secs(10),
            max_connections: 4096,
            lingering_time: Duration::from_secs(30),
            lingering_timeout: Duration::from_secs(5),
        }
    }
}

impl ListenerLimits {
    /// Sets [`header_read_timeout`](Self::header_read_timeout).
    pub fn header_read_timeout(mut self, timeout: Duration) -> Self {
        self.header_read_timeout = timeout;
        self
    }
    /// Sets [`body_read_timeout`](Self::body_read_timeout).
    pub fn body_read_timeout(mut self, timeout: Duration) -> Self {
        self.body_read_timeout = timeout;
        self
    }
    /// Sets [`idle_timeout`](Self::idle_timeout).
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }
    /// Sets [`tls_handshake_timeout`](Self::tls_handshake_timeout).
    pub fn tls_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.tls_handshake_timeout = timeout;
        self
    }
    /// Sets [`max_connections`](Self::max_connections).
    pub fn max_connections(mut self, max: usize) -> Self {
        self.max_connections = max;
        self
    }
    /// Sets [`lingering_time`](Self::lingering_time) and
    /// [`lingering_timeout`](Self::lingering_timeout) (zero: close at once).
    pub fn lingering(mut self, time: Duration, timeout: Duration) -> Self {
        self.lingering_time = time;
        self.lingering_timeout = timeout;
        self
    }
}

pub use body::{BodyReadTimeout, TimedBody};

/// One accepted connection, as the cap and the idle bound see it.
struct Conn {
    /// Requests whose response has not ended.
    in_flight: AtomicU32,
    /// Of those, requests whose body has not all arrived yet.
    receiving: AtomicU32,
    /// Requests started on this connection.
    served: AtomicU64,
    /// When the last request ended, the socket last accepted bytes after a blocked write, or
    /// the connection started: ms since the listener started.
    idle_since_ms: AtomicU64,
    /// The last write to the socket returned `Pending`: a response is still draining.
    write_blocked: AtomicBool,
    /// Fired to close the connection: at once when idle, gracefully otherwise.
    close: Notify,
    /// Set (before `close` fires) once the connection is told to close: a notification taken
    /// while it was busy is not seen again, and the lingering after its graceful end must not
    /// start.
    closing: AtomicBool,
    /// Fired when a request ends, so the connection's idle deadline is computed afresh.
    request_ended: Notify,
    /// The connection's place under the cap: released when it ends, or handed to a new
    /// connection when it is evicted.
    permit: Mutex<Option<OwnedSemaphorePermit>>,
}

impl Conn {
    /// No request in flight, or every one still receiving its body.
    fn is_evictable(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) <= self.receiving.load(Ordering::Acquire)
    }

    /// A request in flight, or a response still draining into a slow socket.
    fn is_busy(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) > 0 || self.write_blocked.load(Ordering::Acquire)
    }

    /// Tells the connection to close (evicted, or the server shutting down).
    fn tell_close(&self) {
        self.closing.store(true, Ordering::Release);
        self.close.notify_one();
    }

    fn take_permit(&self) -> Option<OwnedSemaphorePermit> {
        self.permit
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}

/// Decrements the connection's requests in flight when the response ends (or is dropped).
struct InFlight {
    conn: Arc<Conn>,
    epoch: Instant,
}

impl InFlight {
    fn start(conn: Arc<Conn>, epoch: Instant) -> Self {
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        conn.served.fetch_add(1, Ordering::Relaxed);
        Self { conn, epoch }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.conn
            .idle_since_ms
            .store(ms_since(self.epoch), Ordering::Relaxed);
        self.conn.in_flight.fetch_sub(1, Ordering::AcqRel);
        // a permit is stored when the connection task is not waiting yet: never lost
        self.conn.request_ended.notify_one();
    }
}

fn ms_since(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
}

pin_project_lite::pin_project! {
    /// A response body that keeps its request counted in flight until it ends.
    pub struct TrackedBody<B> {
        #[pin]
        inner: B,
        guard: Option<InFlightGuard>,
    }
}

/// Opaque in-flight marker held by a [`TrackedBody`].
pub struct InFlightGuard(#[allow(dead_code)] InFlight);

impl fmt::Debug for InFlightGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("InFlightGuard")
    }
}

impl<B> fmt::Debug for TrackedBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackedBody").finish_non_exhaustive()
    }
}

impl<B> Body for TrackedBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            this.guard.take();
        }
        polled.map(|f| f.map(|r| r.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The open connections of one listener.
struct Registry {
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        // single inserts and removes: a poisoned map is still consistent
        self.conns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Tells the connection idle the longest to close and takes its place under the cap
    /// (handed over at once: the accept loop never waits for the victim to wind down); `None`
    /// when none is idle. A connection whose every request in flight is still receiving its
    /// body counts as idle: a peer that sends a head and then trickles (or withholds) its body
    /// would otherwise keep its place until the body timeout, and enough of them would keep
    /// every paying caller out. Such a connection is closed at once, its requests unanswered
    /// (nothing was done for them: their body never arrived).
    fn evict_oldest_idle(&self) -> Option<OwnedSemaphorePermit> {
        let mut conns = self.lock();
        loop {
            let id = conns
                .iter()
                .filter(|(_, c)| c.is_evictable())
                .min_by_key(|(_, c)| c.idle_since_ms.load(Ordering::Relaxed))
                .map(|(id, _)| *id)?;
            let victim = conns.remove(&id)?;
            victim.tell_close();
            if let Some(permit) = victim.take_permit() {
                return Some(permit);
            }
            // ended meanwhile: its permit went back to the semaphore; look again
        }
    }

    fn close_all(&self) {
        for c in self.lock().values() {
            c.tell_close();
        }
    }
}

/// The service a [`LimitedServer`] serves: a cloneable tower service from a request with a
/// [`TimedBody`] to a response with body `B`, which never fails (errors are answers) and whose
/// future can move to the connection's task.
///
/// Implemented for every such service (an axum `Router`, a `tower::service_fn`); it only names
/// the bounds.
pub trait ListenerService<B>:
    tower::Service<
        Request<TimedBody>,
        Response = Response<B>,
        Error = Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S, B> ListenerService<B> for S
where
    S: tower::Service<Request<TimedBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
}

/// The address of the peer a request came from: [`LimitedServer`] puts it in every request's
/// extensions (for per-client limits, e.g. a sign-in rate limit per IP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerAddr(pub std::net::SocketAddr);

/// Serves HTTP (1.1 and HTTP/2 with prior knowledge, with upgrades) on a listener under
/// [`ListenerLimits`]; see the [module docs](self).
///
/// ```no_run
/// # async fn example(app: axum::Router) -> std::io::Result<()> {
/// use spine_transport::{LimitedServer, ListenerLimits};
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
/// LimitedServer::new("public", ListenerLimits::default())
///     .serve(listener, app, std::future::pending())
///     .await
/// # }
/// ```
pub struct LimitedServer {
    name: &'static str,
    limits: ListenerLimits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    http: auto::Builder<TokioExecutor>,
}

impl fmt::Debug for LimitedServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitedServer")
            .field("name", &self.name)
            .field("limits", &self.limits)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl LimitedServer {
    /// A plaintext server; `name` labels its logs and the [`metric::LISTENER_CONNECTIONS_CLOSED`]
    /// counter.
    pub fn new(name: &'static str, limits: ListenerLimits) -> Self {
        let mut http = auto::Builder::new(TokioExecutor::new());
        http.http1()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout);
        http.http2().timer(TokioTimer::new());
        Self {
            name,
            limits,
            tls: None,
            http,
        }
    }

    /// Serves TLS with `config` (`None`: plaintext).
    pub fn tls(mut self, config: Option<Arc<rustls::ServerConfig>>) -> Self {
        self.tls = config.map(tokio_rustls::TlsAcceptor::from);
        self
    }

    /// The HTTP settings (hyper-util's auto builder), to tune HTTP/2 or allow one protocol only.
    /// The header read timeout and the timer are set already.
    pub fn http_mut(&mut self) -> &mut auto::Builder<TokioExecutor> {
        &mut self.http
    }

    /// Serves HTTP/1.1 only (no HTTP/2 prior knowledge).
    pub fn http1_only(mut self) -> Self {
        self.http = self.http.http1_only();
        self
    }

    /// Serves HTTP/2 (prior knowledge) only.
    pub fn http2_only(mut self) -> Self {
        self.http = self.http.http2_only();
        self
    }

    /// Accepts on `listener` and serves `service` until `shutdown` completes, then stops
    /// accepting, closes idle connections, lets requests in flight finish and returns once
    /// every connection has ended (an idle connection evicted just before may still be closing
    /// its socket).
    ///
    /// Each connection runs in its own task; its errors are logged and never end the loop, nor
    /// do accept errors (such as running out of file descriptors), which are logged and retried
    /// after 100 ms.
    ///
    /// # Errors
    ///
    /// None today. The `Result` leaves room for fatal listener errors.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops accepting; connections already accepted keep running, under
    /// their bounds.
    pub async fn serve<S, B, F>(
        self,
        listener: TcpListener,
        service: S,
        shutdown: F,
    ) -> std::io::Result<()>
    where
        S: ListenerService<B>,
        B: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
        F: Future<Output = ()> + Send,
    {
        let name = self.name;
        let max = self.limits.max_connections.clamp(1, 1 << 24);
        let permits = Arc::new(Semaphore::new(max));
        let registry = Arc::new(Registry {
            conns: Mutex::new(HashMap::new()),
        });
        let shared = Arc::new(ConnShared {
            name,
            limits: self.limits,
            tls: self.tls,
            http: self.http,
            epoch: Instant::now(),
        });
        if let Ok(addr) = listener.local_addr() {
            info!(listener = name, %addr, max_connections = max, "listening");
        }
        let mut next_id = 0u64;
        tokio::pin!(shutdown);
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(conn) => conn,
                    Err(e) => {
                        warn!(listener = name, error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                () = &mut shutdown => break,
            };
            let permit = match permits.clone().try_acquire_owned() {
                Ok(permit) => permit,
                // at the cap: the longest-idle connection makes room, else the new one goes
                Err(_) => match registry.evict_oldest_idle() {
                    Some(permit) => {
                        metric::listener_closed(name, "evicted");
                        permit
                    }
                    None => match permits.clone().try_acquire_owned() {
                        // one ended while the registry was searched
                        Ok(permit) => permit,
                        Err(_) => {
                            metric::listener_closed(name, "cap");
                            debug!(
                                listener = name,
                                %peer,
                                "connection cap reached, all busy: refused"
                            );
                            continue;
                        }
                    },
                },
            };
            next_id = next_id.wrapping_add(1);
            let id = next_id;
            let conn = Arc::new(Conn {
                in_flight: AtomicU32::new(0),
                receiving: AtomicU32::new(0),
                served: AtomicU64::new(0),
                idle_since_ms: AtomicU64::new(ms_since(shared.epoch)),
                write_blocked: AtomicBool::new(false),
                close: Notify::new(),
                closing: AtomicBool::new(false),
                request_ended: Notify::new(),
                permit: Mutex::new(Some(permit)),
            });
            registry.lock().insert(id, conn.clone());
            let registry = registry.clone();
            let shared = shared.clone();
            let service = service.clone();
            let span = tracing::debug_span!("conn", listener = name, %peer);
            tokio::spawn(
                async move {
                    shared.run(tcp, peer, conn.clone(), service).await;
                    registry.lock().remove(&id);
                    // back to the semaphore, unless an eviction handed it on already
                    drop(conn.take_permit());
                }
                .instrument(span),
            );
        }
        drop(listener);
        registry.close_all();
        // every connection returns its permit when it ends
        let _all = permits
            .acquire_many_owned(u32::try_from(max).unwrap_or(u32::MAX))
            .await;
        info!(listener = name, "stopped");
        Ok(())
    }
}

struct ConnShared {
    name: &'static str,
    limits: ListenerLimits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    http: auto::Builder<TokioExecutor>,
    epoch: Instant,
}

impl ConnShared {
    async fn run<S, B>(
        &self,
        tcp: TcpStream,
        peer: std::net::SocketAddr,
        conn: Arc<Conn>,
        service: S,
    ) where
        S: ListenerService<B>,
        B: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
    {
        if let Err(e) = tcp.set_nodelay(true) {
            debug!(error = %e, "set TCP_NODELAY failed");
        }
        let slot = Arc::new(linger::LingerSlot::default());
        self.serve_tcp(
            linger::Lingering::new(tcp, slot.clone()),
            peer,
            &conn,
            service,
        )
        .await;
        // hyper shut the connection while its peer was still open: discard what it still sends
        if let Some(tcp) = slot.take() {
            if !self.limits.lingering_time.is_zero() {
                debug!("lingering");
                linger::linger(
                    tcp,
                    &conn,
                    self.limits.lingering_time,
                    self.limits.lingering_timeout,
                )
                .await;
            }
        }
    }

    async fn serve_tcp<S, B>(
        &self,
        tcp: linger::Lingering,
        peer: std::net::SocketAddr,
        conn: &Arc<Conn>,
        service: S,
    ) where
        S: ListenerService<B>,
        B: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
    {
        let conn = conn.clone();
        // below TLS: the socket's writes are the ones a slow reader blocks
        let tcp = io::WriteWatched::new(tcp, conn.clone(), self.epoch);
        match &self.tls {
            Some(acceptor) => {
                let accepted = tokio::select! {
                    r = tokio::time::timeout(self.limits.tls_handshake_timeout, acceptor.accept(tcp)) => r,
                    () = conn.close.notified() => {
                        debug!("closed during the tls handshake (evicted or shutting down)");
                        return;
                    }
                };
                match accepted {
                    Ok(Ok(tls)) => {
                        conn.idle_since_ms
                            .store(ms_since(self.epoch), Ordering::Relaxed);
                        self.serve_io(tls, peer, conn, service).await;
                    }
                    Ok(Err(e)) => {
                        metric::rejected("tls");
                        debug!(error = %e, "tls handshake failed");
                    }
                    Err(_) => {
                        metric::rejected("tls");
                        metric::listener_closed(self.name, "tls_timeout");
                        debug!("tls handshake timed out");
                    }
                }
            }
            None => self.serve_io(tcp, peer, conn, service).await,
        }
    }

    async fn serve_io<IO, S, B>(
        &self,
        io: IO,
        peer: std::net::SocketAddr,
        conn: Arc<Conn>,
        service: S,
    ) where
        IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        S: ListenerService<B>,
        B: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
    {
        let body_timeout = self.limits.body_read_timeout;
        let epoch = self.epoch;
        let tracked = conn.clone();
        let hyper_service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let guard = InFlightGuard(InFlight::start(tracked.clone(), epoch));
            let (parts, body) = req.into_parts();
            let (body, whole) = TimedBody::new(body, body_timeout, &tracked);
            let mut req = Request::from_parts(parts, body);
            req.extensions_mut().insert(PeerAddr(peer));
            let http1 = req.version() <= http::Version::HTTP_11;
            let call = tower::ServiceExt::oneshot(service.clone(), req);
            async move {
                let mut resp = match call.await {
                    Ok(resp) => resp,
                    Err(never) => match never {},
                };
                // answered before its body was read whole (a refusal): the connection ends
                // after this answer (the rest of the body is lingered away, not parsed as the
                // next request), and the peer is told so that it does not send another on it
                if http1 && whole.is_some_and(|w| !w.load(Ordering::Acquire)) {
                    resp.headers_mut().insert(
                        http::header::CONNECTION,
                        http::HeaderValue::from_static("close"),
                    );
                }
                Ok::<_, Infallible>(resp.map(|inner| TrackedBody {
                    inner,
                    guard: Some(guard),
                }))
            }
        });
        let connection = self
            .http
            .serve_connection_with_upgrades(TokioIo::new(io), hyper_service);
        tokio::pin!(connection);
        let mut graceful = false;
        loop {
            let idle_bound = if conn.served.load(Ordering::Relaxed) == 0 {
                self.limits.header_read_timeout
            } else {
                self.limits.idle_timeout
            };
            let idle_since = conn.idle_since_ms.load(Ordering::Relaxed);
            let busy = conn.is_busy();
            // busy: look again when the request ends or the socket drains (`request_ended`),
            // or after a full bound
            let wake = if busy {
                Instant::now() + idle_bound
            } else {
                epoch + Duration::from_millis(idle_since) + idle_bound
            };
            tokio::select! {
                res = connection.as_mut() => {
                    if let Err(e) = res {
                        // hyper's own head timer (HTTP/1.1) may fire before this loop's
                        if e.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_timeout) {
                            metric::listener_closed(self.name, "header_timeout");
                        }
                        debug!(error = %e, "connection ended with an error");
                    }
                    return;
                }
                // the deadline moves: computed afresh at the top of the loop
                () = conn.request_ended.notified() => {}
                () = conn.close.notified() => {
                    if conn.is_evictable() {
                        debug!("idle connection closed (evicted or shutting down)");
                        return;
                    }
                    if !graceful {
                        graceful = true;
                        connection.as_mut().graceful_shutdown();
                    }
                }
                () = tokio::time::sleep_until(wake) => {
                    let idle_ms = ms_since(epoch).saturating_sub(conn.idle_since_ms.load(Ordering::Relaxed));
                    if !conn.is_busy() && u128::from(idle_ms) >= idle_bound.as_millis()
                    {
                        let reason = if conn.served.load(Ordering::Relaxed) == 0 {
                            "header_timeout"
                        } else {
                            "idle_timeout"
                        };
                        metric::listener_closed(self.name, reason);
                        debug!(reason, "connection closed");
                        if reason == "idle_timeout" && !graceful {
                            // a peer that used the connection gets a clean end (HTTP/2 GOAWAY),
                            // briefly
                            connection.as_mut().graceful_shutdown();
                            let _ = tokio::time::timeout(Duration::from_secs(1), connection.as_mut()).await;
                        }
                        return;
                    }
                }
            }
        }
    }
}

mod body;
mod io;
mod linger;
#[cfg(test)]
mod tests;
