//! Plain HTTP/1.1 requests from the agent to the gateway's tunnel listener, beside the tunnel:
//! `POST /v1/enroll` (`join`) and `GET /v1/node/status` (`status`). Same host, port and TLS trust
//! as the tunnel itself.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;
use spine_transport::NodeIdentity;
use tokio::net::TcpStream;

/// Largest answer read from the gateway, bytes.
const MAX_ANSWER_BYTES: usize = 1024 * 1024;
/// Connect + TLS + answer, at most.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// Errors talking to the gateway's tunnel listener.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GatewayError {
    #[error("gateway url {0:?} is not ws(s)://host[:port][/path] or http(s)://host[:port]")]
    Url(String),
    #[error("cannot reach the gateway at {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("tls with the gateway failed: {0}")]
    Tls(#[source] std::io::Error),
    #[error("http with the gateway failed: {0}")]
    Http(#[source] hyper::Error),
    #[error("the gateway did not answer within {0:?}")]
    Timeout(Duration),
    #[error("invalid request: {0}")]
    Request(#[source] http::Error),
    #[error("the gateway's answer is not the expected json: {0}")]
    Json(#[source] serde_json::Error),
    #[error("the gateway refused: {status} {code}: {message}")]
    Refused {
        status: StatusCode,
        code: String,
        message: String,
    },
}

/// The gateway's tunnel listener: where `join` and `status` send their requests.
#[derive(Clone, Debug)]
pub(crate) struct GatewayEndpoint {
    host: String,
    port: u16,
    tls: Option<Arc<rustls::ClientConfig>>,
}

/// The parts of a gateway URL: `wss://host:port/…`, `ws://…`, `https://…` or `http://…`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct GatewayUrl {
    /// Whether the listener speaks TLS (`wss`/`https`).
    pub(crate) tls: bool,
    /// Host (brackets stripped from IPv6).
    pub(crate) host: String,
    /// Port; default 19000 (the tunnel listener's).
    pub(crate) port: u16,
}

impl GatewayUrl {
    /// Parses any of the accepted forms; the path is ignored.
    pub(crate) fn parse(url: &str) -> Result<Self, GatewayError> {
        let bad = || GatewayError::Url(url.to_owned());
        let uri: Uri = url.trim().parse().map_err(|_| bad())?;
        let tls = match uri.scheme_str() {
            Some("wss" | "https") => true,
            Some("ws" | "http") => false,
            _ => return Err(bad()),
        };
        let authority = uri.authority().ok_or_else(bad)?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        if host.is_empty() {
            return Err(bad());
        }
        Ok(Self {
            tls,
            host: host.to_owned(),
            port: authority.port_u16().unwrap_or(19000),
        })
    }

    /// The tunnel URL agents dial: `wss://host:port/v1/tunnel` (`ws://` without TLS).
    pub(crate) fn tunnel_url(&self) -> String {
        let scheme = if self.tls { "wss" } else { "ws" };
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        format!(
            "{scheme}://{host}:{}{}",
            self.port,
            spine_transport::TUNNEL_PATH
        )
    }
}

/// Refusal answers in OpenAI's error shape.
#[derive(serde::Deserialize)]
struct ErrorBody {
    error: ErrorFields,
}

#[derive(serde::Deserialize)]
struct ErrorFields {
    #[serde(default)]
    message: String,
    #[serde(default)]
    code: Option<String>,
}

impl GatewayEndpoint {
    /// The endpoint for `url`, trusting `tls` (required for `wss`/`https`).
    pub(crate) fn new(
        url: &GatewayUrl,
        tls: Option<Arc<rustls::ClientConfig>>,
    ) -> Result<Self, GatewayError> {
        if url.tls && tls.is_none() {
            return Err(GatewayError::Url(url.tunnel_url()));
        }
        Ok(Self {
            host: url.host.clone(),
            port: url.port,
            tls: if url.tls { tls } else { None },
        })
    }

    /// Sends one request and reads the JSON answer; non-2xx answers become
    /// [`GatewayError::Refused`] with the gateway's error code and message.
    pub(crate) async fn request_json(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, String)],
        body: Option<&serde_json::Value>,
    ) -> Result<serde_json::Value, GatewayError> {
        let (status, bytes) =
            tokio::time::timeout(REQUEST_TIMEOUT, self.request(method, path, headers, body))
                .await
                .map_err(|_| GatewayError::Timeout(REQUEST_TIMEOUT))??;
        if !status.is_success() {
            let (code, message) = match serde_json::from_slice::<ErrorBody>(&bytes) {
                Ok(e) => (e.error.code.unwrap_or_default(), e.error.message),
                Err(_) => (
                    String::new(),
                    String::from_utf8_lossy(&bytes).chars().take(200).collect(),
                ),
            };
            return Err(GatewayError::Refused {
                status,
                code,
                message,
            });
        }
        serde_json::from_slice(&bytes).map_err(GatewayError::Json)
    }

    async fn request(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, String)],
        body: Option<&serde_json::Value>,
    ) -> Result<(StatusCode, Bytes), GatewayError> {
        let addr = format!("{}:{}", self.host, self.port);
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|source| GatewayError::Connect {
                addr: addr.clone(),
                source,
            })?;
        let _ = tcp.set_nodelay(true);
        let authority = if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            addr
        };
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, authority);
        for (name, value) in headers {
            req = req.header(*name, value.as_str());
        }
        let bytes = match body {
            Some(v) => {
                req = req.header(http::header::CONTENT_TYPE, "application/json");
                Bytes::from(v.to_string())
            }
            None => Bytes::new(),
        };
        let req = req.body(Full::new(bytes)).map_err(GatewayError::Request)?;
        match &self.tls {
            Some(config) => {
                let name = rustls_pki_types::ServerName::try_from(self.host.clone())
                    .map_err(|_| GatewayError::Url(self.host.clone()))?;
                let stream = tokio_rustls::TlsConnector::from(config.clone())
                    .connect(name, tcp)
                    .await
                    .map_err(GatewayError::Tls)?;
                send(stream, req).await
            }
            None => send(tcp, req).await,
        }
    }
}

async fn send<S>(io: S, req: Request<Full<Bytes>>) -> Result<(StatusCode, Bytes), GatewayError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(GatewayError::Http)?;
    let conn = tokio::spawn(conn);
    let resp = sender.send_request(req).await.map_err(GatewayError::Http)?;
    let status = resp.status();
    let body = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
        .collect()
        .await
        .map_err(|e| GatewayError::Tls(std::io::Error::other(format!("reading the answer: {e}"))))?
        .to_bytes();
    conn.abort();
    Ok((status, body))
}

/// Keeps a tunnel up to one of several gateway instances (design brief §8), until `shutdown`.
///
/// Dials `clients` in order, starting with the first. When a tunnel ends (the instance went away,
/// e.g. `kill -9`) or a dial fails, the next URL is tried at once; only after every URL failed in
/// a row (or, with a single URL, after each end) does the agent wait, following the clients'
/// [`Backoff`](spine_transport::Backoff) (`min`..`max`; the full delay after a refusal, except
/// `duplicate_session`: `duplicate_session_retry`, 1 s, without doubling). With one
/// URL this is `TunnelClient::run_until`.
///
/// # Cancel safety
///
/// Dropping the future closes the tunnel at once; after `shutdown` completes, the live tunnel
/// drains gracefully (GOAWAY, requests in flight finish) before this returns.
pub(crate) async fn run_failover<S, F>(
    clients: Vec<spine_transport::TunnelClient>,
    backoff: (Duration, Duration),
    service: S,
    shutdown: F,
) where
    S: spine_transport::NodeService,
    F: std::future::Future<Output = ()>,
{
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let run = failover_loop(clients, backoff, service, stop_rx);
    tokio::pin!(run);
    tokio::select! {
        () = &mut run => return,
        () = shutdown => {}
    }
    let _ = stop_tx.send(true);
    run.await;
}

async fn failover_loop<S>(
    clients: Vec<spine_transport::TunnelClient>,
    (backoff_min, backoff_max): (Duration, Duration),
    service: S,
    stop: tokio::sync::watch::Receiver<bool>,
) where
    S: spine_transport::NodeService,
{
    let stopped = || {
        let mut rx = stop.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    if clients.is_empty() {
        return;
    }
    let n = clients.len();
    let mut backoff = spine_transport::Backoff::new(backoff_min, backoff_max);
    let mut i = 0usize;
    let mut failed_in_a_row = 0usize;
    loop {
        let client = &clients[i % n];
        let connected = tokio::select! {
            res = client.connect() => res,
            () = stopped() => return,
        };
        let delay = match connected {
            Ok(session) => {
                tracing::info!(node = %session.node_id(), gateway = i % n, "tunnel established");
                backoff.reset();
                failed_in_a_row = 0;
                match session.serve_until(service.clone(), stopped()).await {
                    Ok(()) => tracing::info!("tunnel closed"),
                    Err(e) => {
                        tracing::warn!(error = %spine_transport::ErrorChain(&e), "tunnel ended")
                    }
                }
                if *stop.borrow() {
                    return;
                }
                // another instance at once; the same one only after a pause
                (n == 1).then(|| backoff.next_jittered())
            }
            Err(e) => {
                failed_in_a_row += 1;
                let refused = e.is_refused();
                let duplicate =
                    e.refusal() == Some(spine_transport::RefusalReason::DuplicateSession);
                tracing::warn!(
                    error = %spine_transport::ErrorChain(&e),
                    gateway = i % n,
                    "tunnel connect failed"
                );
                (failed_in_a_row >= n).then(|| {
                    failed_in_a_row = 0;
                    if duplicate {
                        // usually a reconnection race or a standby waiting for the active
                        // agent to go: a short fixed interval, not the doubling backoff
                        client.config().duplicate_session_retry
                    } else if refused {
                        backoff.next_full()
                    } else {
                        backoff.next_jittered()
                    }
                })
            }
        };
        i = i.wrapping_add(1);
        if let Some(delay) = delay {
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = stopped() => return,
            }
        }
    }
}

/// The three headers that authenticate a status request, signed now
/// ([`spine_transport::node_status::status_headers`]).
pub(crate) fn status_headers(identity: &NodeIdentity) -> [(&'static str, String); 3] {
    spine_transport::node_status::status_headers(identity, spine_core::unix_time_ms())
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod failover_tests;
