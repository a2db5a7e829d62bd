use std::convert::Infallible;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::WebSocketStream;
use tracing::{debug, Instrument as _};

use super::session::run_session;
use super::state::Shared;
use crate::metric;

/// Body of the upgrade service's responses.
pub type UpgradeBody = Full<Bytes>;

pub(super) fn plain(status: StatusCode, text: &'static str) -> Response<UpgradeBody> {
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
///
/// [`TunnelServer::upgrade_service`]: super::TunnelServer::upgrade_service
#[derive(Clone)]
pub struct TunnelUpgrade {
    pub(super) shared: Arc<Shared>,
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
