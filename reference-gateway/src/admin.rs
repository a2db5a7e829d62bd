//! The admin API (design brief §7): accounts, keys (with their rate limits), credits, operators,
//! nodes, request records, and `GET /metrics` (Prometheus).
//!
//! Every route needs `Authorization: Bearer <admin_token>`. Bodies and answers are JSON; errors use
//! the OpenAI error shape like the public API.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::{header, HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use spine_core::{AccountId, ModelId, OperatorId, RequestId};

use crate::state::AppState;
use spine_meter::limits::KeyHash;
use spine_meter::openai_error::{with_openai_fallbacks, ApiBody, ApiError, ApiPath};
use spine_meter::KeyLimits;
use spine_meter::{enroll, keys};

pub(crate) fn router(state: Arc<AppState>) -> Router {
    let routes = Router::new()
        .route("/admin/v1/accounts", post(create_account))
        .route("/admin/v1/accounts/{id}", get(get_account))
        .route("/admin/v1/accounts/{id}/keys", post(create_key))
        .route("/admin/v1/accounts/{id}/credits", post(add_credits))
        .route("/admin/v1/operators", post(create_operator))
        // nodes and their operators (`spine_meter::enroll`)
        .route(
            "/admin/v1/operators/{id}",
            get(enroll::operator).with_state(state.enrollment.clone()),
        )
        .route(
            "/admin/v1/operators/{id}/enrollments",
            post(enroll::create_enrollment).with_state(state.enrollment.clone()),
        )
        .route(
            "/admin/v1/nodes",
            (post(enroll::register_node).with_state(state.enrollment.clone())).get(list_nodes),
        )
        .route("/admin/v1/nodes/{id}/reverify", post(reverify_node))
        .route("/admin/v1/queues", get(list_queues))
        .route("/admin/v1/requests/{id}", get(get_request))
        // console users and sign-in links (spine_meter::console)
        .merge(spine_meter::console::admin_routes::<AppState>())
        .route("/metrics", get(render_metrics));
    with_openai_fallbacks(routes, "admin URL")
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_admin,
        ))
        .layer(spine_meter::request_id::RequestIdLayer)
        .with_state(state)
}

async fn require_admin(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(keys::bearer_token)
        .unwrap_or("");
    // Compare digests so the comparison time does not depend on how much of the token matched.
    let mut resp =
        if Sha256::digest(presented.as_bytes()) != Sha256::digest(state.admin_token.as_bytes()) {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "invalid_admin_token",
                "admin API needs 'Authorization: Bearer <admin token>'",
            )
            .into_response()
        } else {
            next.run(req).await
        };
    // admin answers carry new API keys, sign-in links and enrollment tokens: no cache keeps them
    resp.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    resp
}

/// Parses an optional JSON body; an empty body is `{}`.
fn parse_body<T: for<'de> Deserialize<'de> + Default>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid_request("invalid_json", format!("invalid JSON body: {e}")))
}

/// The caller's id if valid, else a fresh `<prefix>_…` id.
fn checked_id(id: Option<String>, prefix: &str) -> Result<String, ApiError> {
    match id {
        None => Ok(keys::new_id(prefix)),
        Some(id) if keys::valid_id(&id) => Ok(id),
        Some(_) => Err(ApiError::invalid_request(
            "invalid_id",
            "id must be 1-64 characters of [A-Za-z0-9_.-]",
        )),
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    #[serde(default)]
    id: Option<String>,
}

async fn create_account(
    State(state): State<Arc<AppState>>,
    ApiBody(body): ApiBody,
) -> Result<impl IntoResponse, ApiError> {
    let body: CreateBody = parse_body(&body)?;
    let id = AccountId::new(checked_id(body.id, "acct")?);
    state.store.create_account(&id).await?;
    Ok((StatusCode::CREATED, Json(json!({"id": id}))))
}

async fn account_json(state: &AppState, id: &AccountId) -> Result<Value, ApiError> {
    let b = state.store.account(id).await?;
    Ok(json!({
        "id": id,
        "balance_micros": b.balance_micros,
        "held_micros": b.held_micros,
        "available_micros": b.available_micros,
    }))
}

async fn get_account(State(state): State<Arc<AppState>>, ApiPath(id): ApiPath<String>) -> Response {
    account_json(&state, &AccountId::new(id))
        .await
        .map(Json)
        .into_response()
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CreateKeyBody {
    /// Requests per minute; absent: the gateway default; 0: unlimited.
    #[serde(default)]
    rpm_limit: Option<u32>,
    /// Tokens per minute; absent: the gateway default; 0: unlimited.
    #[serde(default)]
    tpm_limit: Option<u64>,
}

async fn create_key(
    State(state): State<Arc<AppState>>,
    ApiPath(id): ApiPath<String>,
    ApiBody(body): ApiBody,
) -> Result<impl IntoResponse, ApiError> {
    let body: CreateKeyBody = parse_body(&body)?;
    let account = AccountId::new(id);
    let key = keys::new_api_key();
    let key_hash = keys::hash_api_key(&key);
    state.store.create_api_key(&account, &key_hash).await?;
    let key_hash = KeyHash(key_hash);
    state
        .limits
        .set_key_limits(
            &key_hash,
            KeyLimits {
                rpm_limit: body.rpm_limit,
                tpm_limit: body.tpm_limit,
            },
        )
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "cannot save key limits");
            ApiError::internal("the key was created but its limits could not be saved")
        })?;
    let (rpm_limit, tpm_limit) = state.limits.effective(&key_hash);
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "account_id": account,
            "key": key,
            "rpm_limit": rpm_limit,
            "tpm_limit": tpm_limit,
        })),
    ))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CreditsBody {
    amount_micros: u64,
    #[serde(default)]
    idempotency_key: Option<String>,
}

async fn add_credits(
    State(state): State<Arc<AppState>>,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    ApiBody(body): ApiBody,
) -> Result<impl IntoResponse, ApiError> {
    let body: CreditsBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid_request(
            "invalid_json",
            format!("expected {{\"amount_micros\": <u64>, \"idempotency_key\": <string>}}: {e}"),
        )
    })?;
    let key = body
        .idempotency_key
        .or_else(|| {
            headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
        .ok_or_else(|| {
            ApiError::invalid_request(
                "missing_idempotency_key",
                "credits need an idempotency key (body 'idempotency_key' or header 'Idempotency-Key')",
            )
        })?;
    if body.amount_micros == 0 {
        return Err(ApiError::invalid_request(
            "invalid_amount",
            "amount_micros must be positive",
        ));
    }
    let account = AccountId::new(id);
    let applied = state
        .store
        .add_credits(&account, body.amount_micros, &key)
        .await?;
    // a refusal remembered on the old balance must not refuse the next request
    state.credit_refusals.credit_added(&account);
    let mut out = account_json(&state, &account).await?;
    out["applied"] = Value::Bool(applied);
    Ok(Json(out))
}

async fn create_operator(
    State(state): State<Arc<AppState>>,
    ApiBody(body): ApiBody,
) -> Result<impl IntoResponse, ApiError> {
    let body: CreateBody = parse_body(&body)?;
    let id = OperatorId::new(checked_id(body.id, "op")?);
    state.store.create_operator(&id).await?;
    Ok((StatusCode::CREATED, Json(json!({"id": id}))))
}

/// The admission queue of each model that has queued a request since the gateway started.
async fn list_queues(State(state): State<Arc<AppState>>) -> Response {
    Json(json!({ "object": "list", "data": state.registry.queue_snapshot() })).into_response()
}

/// The routable nodes (`spine_router::NodeView`) with their tunnel's state, streams open and
/// per-model running status (spine-transport) and their model audits (design brief §10).
async fn list_nodes(State(state): State<Arc<AppState>>) -> Response {
    let nodes = state.registry.snapshot();
    let data: Vec<Value> = nodes
        .iter()
        .map(|n| {
            let tunnel = state.tunnels.status(&n.node_id);
            let audit = state.enrollment.audit_json(&n.node_id);
            json!(n.view(json!({ "tunnel": tunnel, "audit": audit })))
        })
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

#[derive(Deserialize, Default)]
struct ReverifyBody {
    /// The model to re-verify; absent: every audited model of the node.
    #[serde(default)]
    model: Option<String>,
}

/// `POST /admin/v1/nodes/{id}/reverify` `{"model": …}`: the node's operator re-verified it
/// (e.g. replaced its weights): its test starts over, `unverified`, and it is routed again.
async fn reverify_node(
    State(state): State<Arc<AppState>>,
    ApiPath(id): ApiPath<String>,
    ApiBody(body): ApiBody,
) -> Response {
    let body: ReverifyBody = match parse_body(&body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let Some(auditor) = &state.auditor else {
        return ApiError::not_found("no model is audited (no catalog model sets reference_url)")
            .into_response();
    };
    let node = spine_core::NodeId::new(id.as_str());
    let models: Vec<ModelId> = match body.model {
        Some(m) => vec![ModelId::new(m.as_str())],
        None => auditor
            .statuses_of(&node)
            .into_iter()
            .map(|s| s.model)
            .collect(),
    };
    let reset: Vec<&ModelId> = models
        .iter()
        .filter(|m| auditor.reverify(&node, m))
        .collect();
    tracing::info!(node = %node, models = ?reset, "audit restarted by the admin");
    Json(json!({ "node_id": node, "reverified_models": reset })).into_response()
}

async fn get_request(State(state): State<Arc<AppState>>, ApiPath(id): ApiPath<String>) -> Response {
    match state
        .store
        .request_record(RequestId::new(id.as_str()))
        .await
    {
        Ok(Some(record)) => Json(record).into_response(),
        Ok(None) => ApiError::not_found(format!("no settled request '{id}'")).into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// `GET /metrics`: Prometheus text format (see `metrics.rs` for the series).
async fn render_metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        {
            if let Some(auditor) = &state.auditor {
                spine_meter::metrics::record_audits(auditor);
            }
            state.metrics.render()
        },
    )
        .into_response()
}
