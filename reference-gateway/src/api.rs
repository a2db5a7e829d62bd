//! The public OpenAI-compatible API: `POST /v1/chat/completions`, `POST /v1/completions`,
//! `POST /v1/embeddings`, `POST /v1/responses` (all metered; responses over the chat path,
//! [`spine_meter::responses`]), `GET /v1/models`, `GET /v1/models/{id}`.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::header::{self, HeaderName, HeaderValue};
use http_body_util::BodyExt;
use serde_json::json;
use spine_core::{AccountId, BoxBody, BoxError, RequestContext, RequestId, RequestKind};
use tower::ServiceExt;

use crate::auth;
use crate::error::ApiError;
use crate::metrics::{TtftBody, HTTP_REQUESTS, RATE_LIMITED};
use crate::state::{AppState, Stack};
use spine_meter::limits::KeyHash;

pub(crate) const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

pub(crate) fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(list_models))
        // model ids may hold '/' (`org/name`): the rest of the path is the id
        .route("/v1/models/{*id}", get(retrieve_model))
        .fallback(unknown_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn(request_id))
        .layer(axum::middleware::from_fn(count_http))
        .with_state(state)
}

/// The `route` label of a public path: one of the served routes, else `other`.
fn route_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/embeddings" => "/v1/embeddings",
        "/v1/responses" => "/v1/responses",
        "/v1/models" => "/v1/models",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        _ => "other",
    }
}

/// Counts every public answer in `spine_http_requests_total{route,status}`.
async fn count_http(req: Request, next: Next) -> Response {
    let route = route_label(req.uri().path());
    let resp = next.run(req).await;
    metrics::counter!(HTTP_REQUESTS, "route" => route, "status" => resp.status().as_u16().to_string())
        .increment(1);
    resp
}

/// Gives every request a fresh [`RequestId`] and every response its `x-request-id` header.
pub(crate) async fn request_id(mut req: Request, next: Next) -> Response {
    let id = auth::new_request_id();
    req.extensions_mut().insert(id.clone());
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(id.as_str()) {
        resp.headers_mut().insert(X_REQUEST_ID, v);
    }
    resp
}

async fn unknown_route(req: Request) -> ApiError {
    ApiError::not_found(format!(
        "Unknown request URL: {} {}",
        req.method(),
        req.uri().path()
    ))
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        http::StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

/// SHA-256 of the bearer token, if the request has one.
fn presented_key_hash(headers: &http::HeaderMap) -> Option<String> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(auth::bearer_token)
        .map(auth::hash_api_key)
}

async fn authenticate(state: &AppState, key_hash: Option<String>) -> Result<AccountId, ApiError> {
    let key_hash = key_hash.ok_or_else(ApiError::unauthorized)?;
    if let Some(account) = state.keys.get(&key_hash) {
        return Ok(account);
    }
    match state.store.account_for_key_hash(&key_hash).await {
        Ok(Some(account)) => {
            state.keys.insert(key_hash, account.clone());
            Ok(account)
        }
        Ok(None) => Err(ApiError::unauthorized()),
        Err(e) => {
            tracing::error!(error = %e, "key lookup failed");
            Err(ApiError::new(
                http::StatusCode::SERVICE_UNAVAILABLE,
                "api_error",
                "ledger_unavailable",
                "the account store is unavailable",
            ))
        }
    }
}

async fn list_models(State(state): State<Arc<AppState>>, req: Request) -> Response {
    if let Err(e) = authenticate(&state, presented_key_hash(req.headers())).await {
        return e.into_response();
    }
    let served = state.registry.models();
    let data: Vec<_> = state
        .catalog_ids
        .iter()
        .filter(|id| served.contains(id))
        .map(model_object)
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// The model object OpenAI's `GET /v1/models` lists and `GET /v1/models/{id}` returns.
fn model_object(id: &spine_core::ModelId) -> serde_json::Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "spine"})
}

/// `GET /v1/models/{id}` (`models.retrieve`): the model when it is in the catalog and a node
/// serves it now, else 404 `model_not_found`, as OpenAI answers.
async fn retrieve_model(
    State(state): State<Arc<AppState>>,
    id: Result<axum::extract::Path<String>, axum::extract::rejection::PathRejection>,
    req: Request,
) -> Response {
    if let Err(e) = authenticate(&state, presented_key_hash(req.headers())).await {
        return e.into_response();
    }
    let id = match id {
        Ok(axum::extract::Path(id)) => id,
        Err(e) => return ApiError::invalid_request("invalid_path", e.body_text()).into_response(),
    };
    let served = state.registry.models();
    match state
        .catalog_ids
        .iter()
        .find(|m| m.as_str() == id && served.contains(m))
    {
        Some(model) => Json(model_object(model)).into_response(),
        None => ApiError::new(
            http::StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("The model '{id}' does not exist or no node serves it now"),
        )
        .with_param("model")
        .into_response(),
    }
}

async fn chat_completions(State(state): State<Arc<AppState>>, req: Request) -> Response {
    proxy(&state, req, RequestKind::ChatCompletions, Surface::Native).await
}

async fn completions(State(state): State<Arc<AppState>>, req: Request) -> Response {
    proxy(&state, req, RequestKind::Completions, Surface::Native).await
}

async fn embeddings(State(state): State<Arc<AppState>>, req: Request) -> Response {
    proxy(&state, req, RequestKind::Embeddings, Surface::Native).await
}

/// `POST /v1/responses`: translated into a chat completion, metered and routed as one, and
/// translated back ([`spine_meter::responses`]).
async fn responses(State(state): State<Arc<AppState>>, req: Request) -> Response {
    proxy(
        &state,
        req,
        RequestKind::ChatCompletions,
        Surface::Responses,
    )
    .await
}

/// The API shape the caller speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Surface {
    /// The endpoint of the request kind itself.
    Native,
    /// OpenAI's Responses API over the chat completion path.
    Responses,
}

/// A Responses request's body translated into a chat completion body, and what its answer
/// needs; or the caller's error.
async fn translate_responses(
    state: &AppState,
    body: Body,
    request_id: Option<&RequestId>,
) -> Result<(BoxBody, ResponsesAnswer), ApiError> {
    let limit = state.max_request_body_bytes;
    let bytes = match http_body_util::Limited::new(body, limit).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(ApiError::new(
                http::StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "request_too_large",
                format!("request body larger than {limit} bytes"),
            ))
        }
        Err(e) => {
            return Err(ApiError::invalid_request(
                "invalid_body",
                format!("cannot read the request body: {e}"),
            ))
        }
    };
    let translation = spine_meter::responses::chat_request(&bytes).map_err(|e| {
        let err = ApiError::invalid_request(e.code, e.message);
        match e.param {
            Some(param) => err.with_param(param),
            None => err,
        }
    })?;
    let meta = spine_meter::responses::ResponseMeta::new(
        request_id.map_or("", RequestId::as_str),
        translation.echo,
    );
    let body = http_body_util::Full::new(bytes::Bytes::from(translation.chat_body))
        .map_err(|never| match never {});
    Ok((
        BoxBody::new(body),
        ResponsesAnswer {
            meta,
            stream: translation.stream,
        },
    ))
}

/// Buffers a whole body (one the meter has already bounded). A plain function returning a
/// boxed future: collecting a `BoxBody` inside an async fn trips rustc's higher-ranked check
/// on its `dyn Error` (as `spine_meter`'s own body buffering notes).
fn collect_bytes(
    body: BoxBody,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<bytes::Bytes, String>> + Send>> {
    use std::future::Future as _;
    let mut collect = Box::pin(body.collect());
    Box::pin(std::future::poll_fn(move |cx| {
        collect
            .as_mut()
            .poll(cx)
            .map(|r| r.map(|c| c.to_bytes()).map_err(|e| e.to_string()))
    }))
}

/// What a `/v1/responses` answer needs: its meta, and whether the caller asked for a stream.
struct ResponsesAnswer {
    meta: spine_meter::responses::ResponseMeta,
    stream: bool,
}

/// An error about a chat member, named as the Responses API names it.
fn responses_param(mut err: ApiError) -> ApiError {
    let renamed = match err.param.as_deref() {
        Some("messages") => Some("input"),
        Some("max_tokens" | "max_completion_tokens") => Some("max_output_tokens"),
        _ => None,
    };
    if let Some(p) = renamed {
        err = err.with_param(p);
    }
    err
}

/// A metered chat answer as the Responses answer the caller asked for: a stream re-shaped as
/// it flows, a JSON body (already buffered by the meter) converted whole. A node that answered
/// in the other shape (a whole body to a streamed request, or a stream to one that was not)
/// is re-shaped too: the request is already metered, so the caller gets what it paid for in
/// the shape its SDK expects.
async fn into_responses_answer(
    resp: http::Response<BoxBody>,
    answer: ResponsesAnswer,
) -> http::Response<BoxBody> {
    use spine_meter::responses::{chat_json_as_stream, response_from_chat, ResponsesSse};
    if !resp.status().is_success() {
        return resp;
    }
    let ResponsesAnswer { meta, stream } = answer;
    let streamed = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let (mut parts, body) = resp.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    let sse = HeaderValue::from_static("text/event-stream");
    match (stream, streamed) {
        (true, true) => {
            let body = ResponsesSse::new(body, meta);
            return http::Response::from_parts(parts, BoxBody::new(body));
        }
        (true, false) => {
            let whole = collect_bytes(body).await.unwrap_or_default();
            let chat = http_body_util::Full::new(chat_json_as_stream(&whole))
                .map_err(|never| match never {});
            let body = ResponsesSse::new(BoxBody::new(chat), meta);
            parts.headers.insert(header::CONTENT_TYPE, sse);
            return http::Response::from_parts(parts, BoxBody::new(body));
        }
        (false, true) => {
            // the stream converted, and its final response object is the answer
            let events = collect_bytes(BoxBody::new(ResponsesSse::new(body, meta)))
                .await
                .unwrap_or_default();
            let last = String::from_utf8_lossy(&events)
                .split("\n\n")
                .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
                .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
                .filter(|v| v["type"] != "error")
                .last();
            // a failed answer that was billed (cut at a gateway bound: its usage is there) is
            // returned as the failed response object, since the caller pays for its output
            let bytes = match last {
                Some(v)
                    if v["response"]["status"] != "failed"
                        || v["response"]["usage"].is_object() =>
                {
                    v["response"].to_string()
                }
                _ => {
                    return ApiError::new(
                        http::StatusCode::BAD_GATEWAY,
                        "api_error",
                        "node_failure",
                        "the node's answer ended before it was complete",
                    )
                    .into_response()
                    .map(|b| BoxBody::new(b.map_err(BoxError::from)));
                }
            };
            parts.headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            let body = http_body_util::Full::new(bytes::Bytes::from(bytes))
                .map_err(|never| match never {});
            return http::Response::from_parts(parts, BoxBody::new(body));
        }
        (false, false) => {}
    }
    let converted = match collect_bytes(body).await {
        Ok(bytes) => response_from_chat(&bytes, &meta),
        Err(e) => Err(e),
    };
    let bytes = match converted {
        Ok(v) => bytes::Bytes::from(v.to_string()),
        Err(why) => {
            tracing::error!(reason = %why, "cannot re-shape a metered chat answer as a response");
            return ApiError::internal("cannot build the response object")
                .into_response()
                .map(|b| BoxBody::new(b.map_err(BoxError::from)));
        }
    };
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body = http_body_util::Full::new(bytes).map_err(|never| match never {});
    http::Response::from_parts(parts, BoxBody::new(body))
}

/// Authenticates, applies the key's RPM limit, and sends the request through the metered stack
/// to a node at `kind`'s path (a `/v1/responses` request translated first).
async fn proxy(state: &AppState, req: Request, kind: RequestKind, surface: Surface) -> Response {
    let started = std::time::Instant::now();
    let key_hash = presented_key_hash(req.headers());
    let account = match authenticate(state, key_hash.clone()).await {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    // authenticated, so the key is known
    let key = KeyHash(key_hash.unwrap_or_default());
    if let Err(refused) = state.limits.check_rpm(&key).await {
        metrics::counter!(RATE_LIMITED, "limit" => "requests").increment(1);
        return ApiError::rate_limited("requests", refused.message, refused.retry_after_secs)
            .into_response();
    }
    let request_id = req.extensions().get::<RequestId>().cloned();
    let content_type_ok = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.to_ascii_lowercase().starts_with("application/json"))
        .unwrap_or(true);
    if !content_type_ok {
        return ApiError::invalid_request(
            "invalid_content_type",
            "request body must be application/json",
        )
        .into_response();
    }

    // A fresh upstream request: only the body and the content type travel to the node; the
    // caller's key and other headers never do. `X-Session-Id` rides as an extension for the
    // router's conversation affinity (design brief §5).
    let (parts, body) = req.into_parts();
    let (body, responses) = match surface {
        Surface::Native => (BoxBody::new(body.map_err(BoxError::from)), None),
        Surface::Responses => match translate_responses(state, body, request_id.as_ref()).await {
            Ok((body, meta)) => (body, Some(meta)),
            Err(e) => return e.into_response(),
        },
    };
    let route = match surface {
        Surface::Native => kind.path(),
        Surface::Responses => "/v1/responses",
    };
    let session = parts
        .headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .map(|v| spine_router::SessionId(v.to_owned()));
    let mut upstream = http::Request::builder()
        .method(http::Method::POST)
        .uri(kind.path())
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .unwrap_or_else(|_| http::Request::new(BoxBody::default()));
    // the request's context, typed once here: the meter and the router read it (the separate
    // extensions stay for the rate limiter's `KeyHash` and the library's fallbacks)
    if let Some(id) = &request_id {
        let mut context = RequestContext::new(id.clone(), account.clone(), kind).with_key(&key.0);
        if let Some(session) = &session {
            context = context.with_session(&session.0);
        }
        upstream.extensions_mut().insert(context);
    }
    upstream.extensions_mut().insert(account);
    upstream.extensions_mut().insert(key);
    let request_id_copy = request_id.clone();
    if let Some(id) = request_id {
        upstream.extensions_mut().insert(id);
    }
    if let Some(session) = session {
        upstream.extensions_mut().insert(session);
    }

    match call_stack(state.stack.clone(), upstream).await {
        Ok(resp) => {
            note_serving_node(state, request_id_copy, &resp);
            match responses {
                Some(answer) if resp.status().is_success() => {
                    let resp = into_responses_answer(resp, answer).await;
                    into_client_response(resp, started, route).await
                }
                Some(_) => {
                    let err = node_error(resp).await;
                    responses_param(err).into_response()
                }
                None => into_client_response(resp, started, route).await,
            }
        }
        Err(e) => {
            let mut err = ApiError::from_stack(&e);
            if surface == Surface::Responses {
                err = responses_param(err);
            } else if err.param.as_deref() == Some("messages")
                && kind != RequestKind::ChatCompletions
            {
                // the prompt of the other endpoints is `prompt` / `input`
                let param = if kind == RequestKind::Completions {
                    "prompt"
                } else {
                    "input"
                };
                err = err.with_param(param);
            }
            if err.code == "rate_limit_exceeded" {
                metrics::counter!(RATE_LIMITED, "limit" => "tokens").increment(1);
            }
            if err.status.is_server_error() {
                tracing::warn!(error = %e, status = %err.status, "request failed");
            }
            err.into_response()
        }
    }
}

/// A streamed answer has begun: records its node and the counted prompt on the request's hold
/// (`Ledger::note_hold`), off the response path, so that if this process dies before the
/// stream settles, the sweep's record names the node that served it and the prompt it read. One small write per
/// streamed request; a non-streamed answer is settled as it is returned, so it needs none.
fn note_serving_node(
    state: &AppState,
    request_id: Option<RequestId>,
    resp: &http::Response<BoxBody>,
) {
    let streamed = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let node = resp.extensions().get::<spine_core::NodeId>().cloned();
    let known = resp
        .extensions()
        .get::<spine_meter::meter::CountedUsage>()
        .map(|c| c.0);
    let (Some(request_id), Some(node), true) =
        (request_id, node, streamed && resp.status().is_success())
    else {
        return;
    };
    let store = state.store.clone();
    tokio::spawn(async move {
        let note = spine_meter::HoldNote {
            node: Some(node),
            known,
        };
        if let Err(e) = store.note_hold(request_id, note).await {
            tracing::debug!(error = %e, "noting the serving node on the hold failed");
        }
    });
}

/// Largest node error body read to extract its message, bytes.
const MAX_NODE_ERROR_BYTES: usize = 64 * 1024;
/// Longest node error message passed on to the caller, bytes (the rest is cut, with `…`).
const MAX_NODE_MESSAGE_BYTES: usize = 1024;

/// A node's non-2xx answer in OpenAI's error shape: the node's message is kept, its status mapped
/// ([`node_error_shape`]).
async fn node_error(resp: http::Response<BoxBody>) -> ApiError {
    let status = resp.status();
    let mut body = resp.into_body();
    let mut buf = Vec::new();
    while buf.len() < MAX_NODE_ERROR_BYTES {
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                }
            }
            Some(Err(_)) | None => break,
        }
    }
    node_error_shape(status, &buf)
}

/// The caller's error for a node's non-2xx `status` with body `body`:
///
/// - an engine saying the prompt is over its context (llama.cpp's `exceed_context_size_error`,
///   or a 4xx message about the context length as vLLM, SGLang and Ollama word it) → 400
///   `context_length_exceeded`, `param` `messages`, as OpenAI answers;
/// - 501 (the engine does not support what was asked, e.g. tools without `--jinja`) → 400
///   `unsupported_by_node`: the SDKs retry every 5xx, and asking again changes nothing (other
///   nodes were already tried by the router);
/// - any other 4xx keeps its status, `upstream_rejected`; anything else is 502 `node_failure`.
fn node_error_shape(status: http::StatusCode, body: &[u8]) -> ApiError {
    let parsed = serde_json::from_slice::<serde_json::Value>(body).ok();
    // OpenAI's `{"error":{…}}`, or vLLM's / SGLang's top-level `{"object":"error",…}`
    let field = |name: &str| {
        parsed
            .as_ref()
            .and_then(|v| {
                v.pointer(&format!("/error/{name}"))
                    .or_else(|| (v["object"] == "error").then(|| v.get(name)).flatten())
            })
            .and_then(|m| m.as_str())
            .map(str::to_owned)
    };
    let mut message = field("message")
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned());
    if message.len() > MAX_NODE_MESSAGE_BYTES {
        let mut end = MAX_NODE_MESSAGE_BYTES;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push('…');
    }
    let lower = message.to_ascii_lowercase();
    let over_context = field("type").as_deref() == Some("exceed_context_size_error")
        || (status.is_client_error()
            && (lower.contains("context length")
                || lower.contains("context size")
                || lower.contains("context window")
                || lower.contains("maximum context")));
    if over_context {
        ApiError::new(
            http::StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "context_length_exceeded",
            format!("the prompt is over the node's context window: {message}"),
        )
        .with_param("messages")
    } else if status == http::StatusCode::NOT_IMPLEMENTED {
        ApiError::new(
            http::StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "unsupported_by_node",
            format!("the node's engine does not support this request: {message}"),
        )
    } else if status.is_client_error() {
        ApiError::new(
            status,
            "invalid_request_error",
            "upstream_rejected",
            format!("the node's engine refused the request: {message}"),
        )
    } else {
        ApiError::new(
            http::StatusCode::BAD_GATEWAY,
            "api_error",
            "node_failure",
            format!("the node's engine failed ({status}): {message}"),
        )
    }
}

/// Calls the stack behind a boxed future, which keeps the `dyn Error` lifetimes inside the
/// stack's types out of the handler's future (rustc cannot prove the handler `Send` otherwise).
pub(crate) fn call_stack(
    stack: Stack,
    req: http::Request<BoxBody>,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<http::Response<BoxBody>, BoxError>> + Send>,
> {
    Box::pin(stack.oneshot(req))
}

/// The node's response as the caller gets it: status, content type and body; the node's other
/// headers (server, keep-alive, length of a body the meter may rewrite) stay behind.
async fn into_client_response(
    resp: http::Response<BoxBody>,
    started: std::time::Instant,
    route: &'static str,
) -> Response {
    if !resp.status().is_success() {
        return node_error(resp).await.into_response();
    }
    let (parts, body) = resp.into_parts();
    let mut out = Response::new(Body::new(TtftBody::new(body, started, route)));
    *out.status_mut() = parts.status;
    let content_type = parts.headers.get(header::CONTENT_TYPE).cloned();
    let is_sse = content_type
        .as_ref()
        .and_then(|v| v.to_str().ok())
        .map(|v| v.starts_with("text/event-stream"))
        .unwrap_or(false);
    if let Some(ct) = content_type {
        out.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    if is_sse {
        out.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        out.headers_mut().insert(
            HeaderName::from_static("x-accel-buffering"),
            HeaderValue::from_static("no"),
        );
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_get_the_codes_clients_branch_on() {
        let shape = |status: u16, body: &str| {
            let e = node_error_shape(http::StatusCode::from_u16(status).unwrap(), body.as_bytes());
            (e.status.as_u16(), e.code)
        };
        // llama.cpp (the pinned server's own words and type)
        assert_eq!(
            shape(
                400,
                r#"{"error":{"code":400,"message":"request (9000 tokens) exceeds the available context size (2048 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9000,"n_ctx":2048}}"#
            ),
            (400, "context_length_exceeded")
        );
        // vLLM
        assert_eq!(
            shape(
                400,
                r#"{"object":"error","message":"This model's maximum context length is 2048 tokens. However, you requested 9000 tokens.","type":"BadRequestError","param":null,"code":400}"#
            ),
            (400, "context_length_exceeded")
        );
        assert_eq!(
            shape(
                400,
                r#"{"object":"error","message":"max_tokens must be at least 1","type":"BadRequestError"}"#
            ),
            (400, "upstream_rejected")
        );
        assert_eq!(
            shape(
                501,
                r#"{"error":{"code":501,"message":"tools param requires --jinja flag","type":"not_supported_error"}}"#
            ),
            (400, "unsupported_by_node")
        );
        assert_eq!(shape(422, "{}"), (422, "upstream_rejected"));
        assert_eq!(shape(500, "boom"), (502, "node_failure"));
        // a 5xx that mentions the context is still the node's failure
        assert_eq!(shape(500, "context size"), (502, "node_failure"));
    }
}
