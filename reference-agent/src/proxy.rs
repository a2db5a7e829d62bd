//! The service the agent serves over the tunnel: an allowlisted proxy to the one local engine
//! (design brief §9).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use spine_core::{BoxBody, BoxError};
use tracing::{debug, warn};

use crate::engine::{join, EngineClient, RequestGuard};

/// Largest request body the proxy buffers to check it ([`RequestGuard`]), bytes (64 MiB).
const MAX_CHECKED_BODY_BYTES: usize = 64 * 1024 * 1024;

/// The one field of a request body the guard reads; serde_json still checks the whole document.
#[derive(serde::Deserialize)]
struct ModelField {
    #[serde(default)]
    model: Option<String>,
}

/// Where an allowed request goes on the engine: the path, or the engine's health path.
fn allowed_target(method: &Method, path: &str, health_path: &'static str) -> Option<&'static str> {
    match (method, path) {
        (&Method::POST, "/v1/chat/completions") => Some("/v1/chat/completions"),
        (&Method::POST, "/v1/completions") => Some("/v1/completions"),
        (&Method::POST, "/v1/embeddings") => Some("/v1/embeddings"),
        (&Method::GET, "/v1/models") => Some("/v1/models"),
        (&Method::GET, "/health") => Some(health_path),
        _ => None,
    }
}

/// Headers never forwarded in either direction: hop-by-hop (RFC 9110 §7.6.1) and proxy headers.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

fn is_stripped(name: &HeaderName, request: bool) -> bool {
    let n = name.as_str();
    HOP_BY_HOP.contains(&n)
        || n == "upgrade"
        || n.starts_with("proxy-")
        || n.starts_with("x-spine-")
        || (request && (n == "authorization" || n == "host"))
}

/// Copies `headers` minus hop-by-hop headers, those the `Connection` header names, every
/// `x-spine-*` header (both ways: only the gateway sets them, so an engine cannot fake, say, an
/// owner's `x-spine-refusal`) and (for requests) `authorization` and `host`.
fn filter_headers(headers: &HeaderMap, request: bool) -> HeaderMap {
    let named_by_connection: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect();
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        if is_stripped(name, request) || named_by_connection.iter().any(|t| t == name.as_str()) {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

fn json_error(status: StatusCode, message: &str, kind: &str, code: &str) -> Response<BoxBody> {
    let body = serde_json::json!({
        "error": { "message": message, "type": kind, "code": code }
    });
    let mut resp = Response::new(
        Full::new(Bytes::from(body.to_string()))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// What the engine is doing, as the proxy sees it: requests in flight (sent to the engine and
/// not yet answered whole or dropped) and when the engine last sent a byte of an answer. The
/// SIGTERM drain reads it to tell an engine that is working (bytes flow) from one that hangs.
#[derive(Debug)]
pub(crate) struct EngineActivity {
    started: std::time::Instant,
    in_flight: std::sync::atomic::AtomicUsize,
    /// Milliseconds after `started` of the engine's last answer byte (or of a request sent).
    last_byte_ms: std::sync::atomic::AtomicU64,
}

impl Default for EngineActivity {
    fn default() -> Self {
        Self {
            started: std::time::Instant::now(),
            in_flight: std::sync::atomic::AtomicUsize::new(0),
            last_byte_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl EngineActivity {
    fn touch(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_byte_ms
            .store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// Requests in flight at the engine.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How long since the engine last sent a byte of an answer (or was sent a request).
    pub(crate) fn quiet_for(&self) -> std::time::Duration {
        let last = self.last_byte_ms.load(std::sync::atomic::Ordering::Relaxed);
        self.started
            .elapsed()
            .saturating_sub(std::time::Duration::from_millis(last))
    }
}

/// One request in flight at the engine: counted from its sending until its answer's body ends
/// or is dropped.
struct InFlight(std::sync::Arc<EngineActivity>);

impl InFlight {
    fn start(activity: &std::sync::Arc<EngineActivity>) -> Self {
        activity
            .in_flight
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        activity.touch();
        Self(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

pin_project_lite::pin_project! {
    /// An engine answer's body that notes each frame in [`EngineActivity`].
    struct ActivityBody {
        #[pin]
        inner: BoxBody,
        guard: InFlight,
    }
}

impl http_body::Body for ActivityBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &polled {
            this.guard.0.touch();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The allowlisted proxy from the tunnel to the engine.
#[derive(Clone, Debug)]
pub(crate) struct EngineProxy {
    client: EngineClient,
    engine: Uri,
    health_path: &'static str,
    guard: RequestGuard,
    /// The model ids the engine serves (for the guard).
    models: std::sync::Arc<[spine_core::ModelId]>,
    activity: std::sync::Arc<EngineActivity>,
}

impl EngineProxy {
    pub(crate) fn new(client: EngineClient, engine: Uri, health_path: &'static str) -> Self {
        Self {
            client,
            engine,
            health_path,
            guard: RequestGuard::default(),
            models: std::sync::Arc::from(Vec::new()),
            activity: std::sync::Arc::default(),
        }
    }

    /// What the engine is doing through this proxy (shared by its clones).
    pub(crate) fn activity(&self) -> std::sync::Arc<EngineActivity> {
        self.activity.clone()
    }

    /// Checks `POST` bodies as `guard` says before the engine sees them (an engine quirk, see
    /// [`RequestGuard`]): malformed JSON → 400 `invalid_json`, a `model` not among `models` →
    /// 404 `model_not_found`, a body over 64 MiB → 413.
    pub(crate) fn with_guard(
        mut self,
        guard: RequestGuard,
        models: Vec<spine_core::ModelId>,
    ) -> Self {
        self.guard = guard;
        self.models = std::sync::Arc::from(models);
        self
    }

    /// The checked body, or the error answer (see [`EngineProxy::with_guard`]). Never logs the
    /// body.
    async fn checked_body(&self, body: Incoming) -> Result<Bytes, Response<BoxBody>> {
        let bytes = match http_body_util::Limited::new(body, MAX_CHECKED_BODY_BYTES)
            .collect()
            .await
        {
            Ok(c) => c.to_bytes(),
            Err(e) => {
                let too_large = e
                    .downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some();
                return Err(if too_large {
                    json_error(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "the request body is too large for this node",
                        "invalid_request_error",
                        "request_too_large",
                    )
                } else {
                    json_error(
                        StatusCode::BAD_REQUEST,
                        "the request body could not be read",
                        "invalid_request_error",
                        "invalid_body",
                    )
                });
            }
        };
        // an object (serde would also read a struct from an array)
        let is_object = bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
        let model = match serde_json::from_slice::<ModelField>(&bytes) {
            Ok(f) if is_object => f.model,
            _ => {
                warn!("refused a request body that is not a JSON object");
                return Err(json_error(
                    StatusCode::BAD_REQUEST,
                    "the request body is not a valid JSON object",
                    "invalid_request_error",
                    "invalid_json",
                ));
            }
        };
        if !model
            .as_deref()
            .is_some_and(|m| self.models.iter().any(|s| s.as_str() == m))
        {
            let model: String = model.unwrap_or_default().chars().take(100).collect();
            warn!(%model, "refused a request for a model this node's engine does not serve");
            return Err(json_error(
                StatusCode::NOT_FOUND,
                "this node does not serve the requested model",
                "invalid_request_error",
                "model_not_found",
            ));
        }
        Ok(bytes)
    }

    /// Forwards an allowed request (query string dropped, headers filtered, the body of a `GET`
    /// or `HEAD` dropped with its `content-length`) and streams the engine's response back as it
    /// arrives; 403 for anything else, 502 when the engine cannot be
    /// reached. Never logs bodies.
    pub(crate) async fn handle(&self, req: Request<Incoming>) -> Response<BoxBody> {
        let method = req.method().clone();
        let Some(target) = allowed_target(&method, req.uri().path(), self.health_path) else {
            let path: String = req.uri().path().chars().take(200).collect();
            warn!(%method, %path, "refused a tunnel request outside the engine allowlist");
            return json_error(
                StatusCode::FORBIDDEN,
                "this path is not served by the node",
                "invalid_request_error",
                "path_not_allowed",
            );
        };
        let uri = match join(&self.engine, target) {
            Ok(uri) => uri,
            Err(e) => {
                warn!(error = %e, "cannot build the engine url");
                return json_error(
                    StatusCode::BAD_GATEWAY,
                    "the node's engine url is invalid",
                    "server_error",
                    "engine_unreachable",
                );
            }
        };
        let (mut parts, body) = req.into_parts();
        // a body read whole here can be sent again (see `spine_core::closed_before_answer`)
        let mut replay: Option<Bytes> = None;
        let body = if parts.method == Method::GET || parts.method == Method::HEAD {
            // never a body on GET/HEAD: a naive engine could read it as the next request
            // (request smuggling); dropped unread, and its length with it
            parts.headers.remove(header::CONTENT_LENGTH);
            drop(body);
            Full::new(Bytes::new())
                .map_err(|e| match e {})
                .boxed_unsync()
        } else if self.guard.check_json_and_model && parts.method == Method::POST {
            match self.checked_body(body).await {
                Ok(bytes) => {
                    replay = Some(bytes.clone());
                    full(bytes)
                }
                Err(refusal) => return refusal,
            }
        } else {
            body.map_err(BoxError::from).boxed_unsync()
        };
        let headers = filter_headers(&parts.headers, true);
        let upstream = |body: BoxBody| {
            let mut upstream = Request::new(body);
            *upstream.method_mut() = parts.method.clone();
            *upstream.uri_mut() = uri.clone();
            *upstream.headers_mut() = headers.clone();
            upstream
        };

        debug!(%method, path = target, "forwarding to the engine");
        let in_flight = InFlight::start(&self.activity);
        let mut answer = self.client.request(upstream(body)).await;
        if let (Err(e), Some(bytes)) = (&answer, replay) {
            if spine_core::closed_before_answer(e) {
                // a pooled keep-alive connection the engine closed as the request went out
                // (llama.cpp closes idle ones after 5 s): the engine never read it; once more
                // on a fresh connection
                debug!(error = %e, path = target, "engine connection was stale; sending again");
                answer = self.client.request(upstream(full(bytes))).await;
            }
        }
        match answer {
            Ok(resp) => {
                let (mut parts, body) = resp.into_parts();
                parts.headers = filter_headers(&parts.headers, false);
                debug!(
                    status = parts.status.as_u16(),
                    path = target,
                    "engine answered"
                );
                let body = ActivityBody {
                    inner: body.map_err(BoxError::from).boxed_unsync(),
                    guard: in_flight,
                };
                Response::from_parts(parts, BoxBody::new(body))
            }
            Err(e) => {
                warn!(error = %e, path = target, "engine unreachable");
                json_error(
                    StatusCode::BAD_GATEWAY,
                    "the node's engine is unreachable",
                    "server_error",
                    "engine_unreachable",
                )
            }
        }
    }
}

/// A body of bytes already read.
fn full(bytes: Bytes) -> BoxBody {
    Full::new(bytes).map_err(|e| match e {}).boxed_unsync()
}

impl tower::Service<Request<Incoming>> for EngineProxy {
    type Response = Response<BoxBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<BoxBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.handle(req).await) })
    }
}

#[cfg(test)]
mod tests;
