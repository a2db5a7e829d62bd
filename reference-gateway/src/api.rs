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
use http::header;
use http_body_util::BodyExt;
use serde_json::json;
use spine_core::{BoxBody, BoxError, RequestContext, RequestId, RequestKind};
use spine_meter::limits::KeyHash;
use spine_meter::meter::caller_response;
use spine_meter::metrics::TtftBody;
use spine_meter::openai_error::{with_openai_fallbacks, ApiError};
use spine_meter::request_id::RequestIdLayer;
use spine_meter::responses::ResponsesAnswer;
use tower::ServiceExt;

use crate::error::stack_error;
use crate::metrics::{HTTP_REQUESTS, RATE_LIMITED};
use crate::state::{AppState, Stack};

pub(crate) fn router(state: Arc<AppState>) -> Router {
    let routes = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(list_models))
        // model ids may hold '/' (`org/name`): the rest of the path is the id
        .route("/v1/models/{*id}", get(retrieve_model));
    with_openai_fallbacks(routes, "request URL")
        .layer(RequestIdLayer)
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

async fn list_models(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let authorization = req.headers().get(header::AUTHORIZATION);
    if let Err(e) = state.keys.authenticate(&*state.store, authorization).await {
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
    let authorization = req.headers().get(header::AUTHORIZATION);
    if let Err(e) = state.keys.authenticate(&*state.store, authorization).await {
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

/// A metered chat answer as the Responses answer the caller asked for
/// ([`ResponsesAnswer::reshape`]); what cannot be re-shaped is the node's failure (502) or the
/// gateway's (500).
async fn into_responses_answer(
    resp: http::Response<BoxBody>,
    answer: ResponsesAnswer,
) -> http::Response<BoxBody> {
    match answer.reshape(resp).await {
        Ok(resp) => resp,
        Err(e) => ApiError::from_reshape(e).into_boxed_response(),
    }
}

/// Authenticates, applies the key's RPM limit, and sends the request through the metered stack
/// to a node at `kind`'s path (a `/v1/responses` request translated first).
async fn proxy(state: &AppState, req: Request, kind: RequestKind, surface: Surface) -> Response {
    let started = std::time::Instant::now();
    let authorization = req.headers().get(header::AUTHORIZATION);
    let (account, key) = match state.keys.authenticate(&*state.store, authorization).await {
        Ok((account, key_hash)) => (account, KeyHash(key_hash)),
        Err(e) => return e.into_response(),
    };
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
        Surface::Responses => {
            let id = request_id.as_ref().map_or("", RequestId::as_str);
            // read within the meter's bounds (a caller that cannot pay is refused before its
            // body is parsed here, as on the other endpoints), then translated
            let body = BoxBody::new(body.map_err(BoxError::from));
            let bytes = match state.body_gate.read(&account, body).await {
                Ok(bytes) => bytes,
                Err(e) => return ApiError::from(&e).into_response(),
            };
            match spine_meter::responses::translate_body(&bytes, id) {
                Ok((body, answer)) => (body, Some(answer)),
                Err(e) => return ApiError::from(e).into_response(),
            }
        }
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
            spine_meter::ledger::note_serving_node(&state.store, request_id_copy, &resp);
            match responses {
                Some(answer) if resp.status().is_success() => {
                    let resp = into_responses_answer(resp, answer).await;
                    into_client_response(resp, started, route).await
                }
                Some(_) => {
                    let err = ApiError::from_node_response(resp).await;
                    err.for_responses().into_response()
                }
                None => into_client_response(resp, started, route).await,
            }
        }
        Err(e) => {
            let err = match surface {
                Surface::Responses => stack_error(&e).for_responses(),
                Surface::Native => stack_error(&e).for_kind(kind),
            };
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

/// The node's response as the caller gets it ([`caller_response`]), its body timed
/// ([`TtftBody`]); a non-2xx answer in OpenAI's shape ([`ApiError::from_node_response`]).
async fn into_client_response(
    resp: http::Response<BoxBody>,
    started: std::time::Instant,
    route: &'static str,
) -> Response {
    if !resp.status().is_success() {
        return ApiError::from_node_response(resp).await.into_response();
    }
    caller_response(resp).map(|body| Body::new(TtftBody::new(body, started, route)))
}
