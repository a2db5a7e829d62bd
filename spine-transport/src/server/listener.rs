use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, StatusCode};
use spine_core::BoxError;
use tokio::net::TcpListener;

use super::state::Shared;
use super::upgrade::plain;
use super::{
    NodeAuthenticator, TunnelEvents, TunnelServerConfig, TunnelUpgrade, Tunnels, TUNNEL_PATH,
};
use crate::serve::{LimitedServer, ListenerLimits, ListenerService, TimedBody};

/// The gateway's tunnel listener (design brief §4).
///
/// Answers `GET /v1/tunnel` WebSocket upgrades, verifies the signed handshake, and keeps one
/// HTTP/2 client connection per node, reachable through [`Tunnels`]. Serve it alone with
/// [`serve`](Self::serve), or mount [`upgrade_service`](Self::upgrade_service) in an axum (or any
/// tower) router and serve that with [`serve_listener`].
#[derive(Clone)]
pub struct TunnelServer {
    pub(super) shared: Arc<Shared>,
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
    S: ListenerService<B>,
    B: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    LimitedServer::new("tunnel", limits)
        .tls(tls)
        .http1_only()
        .serve(listener, service, std::future::pending())
        .await
}
