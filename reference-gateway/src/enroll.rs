//! Node enrollment and the node's own view of itself (design brief §7, issue 8).
//!
//! - Admin: `POST /admin/v1/operators/{id}/enrollments` → a one-time enrollment token. Only its
//!   SHA-256 is stored, with an expiry (default 24 h, at most 30 days); it registers one node.
//! - Tunnel listener: `POST /v1/enroll` `{"token", "public_key", "node_name"?}` redeems a token:
//!   the public key becomes a node of the token's operator (`201 {"node_id", "operator_id",
//!   "public_key", "catalog_models"}`). Unknown or expired token → 401, used → 409, key already
//!   registered → 409, all in OpenAI's error shape. Redeeming again with the same key returns the
//!   same node, so an agent that lost the answer can retry.
//! - Tunnel listener: `GET /v1/node/status`, authenticated by the node's own key (the agent has
//!   no admin token): headers `x-spine-node-key` (`ed25519:<base64url>`),
//!   `x-spine-timestamp-ms` (Unix ms, within ±60 s of the gateway's clock) and
//!   `x-spine-signature` (base64url ed25519 signature), checked by
//!   [`spine_transport::node_status::verify_status_headers`]. It answers this node's state as the gateway sees it: connected,
//!   routable, the routable models, requests served and earnings. The request is read-only, so a
//!   replay inside the window discloses only what the node itself may read.
//!
//! The catalog is the gateway's: a node advertises every model its engine serves, but only those
//! in the catalog are ever routed to it (a request for another model is refused with 404 before
//! routing); `catalog_models` in the enrollment answer and the status lets the agent and its owner
//! see which ones count.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::json;
use spine_core::{NodeId, OperatorId};
use spine_meter::keys;
use spine_meter::LedgerError;
use spine_transport::node_status::{verify_status_headers, NodeSignatureError};

use crate::api;
use crate::error::{ledger_error, ApiError};
use crate::state::AppState;

/// Default validity of an enrollment token, seconds (24 h).
pub(crate) const DEFAULT_ENROLLMENT_TTL_SECS: u64 = 24 * 3600;
/// Longest validity of an enrollment token, seconds (30 days).
pub(crate) const MAX_ENROLLMENT_TTL_SECS: u64 = 30 * 24 * 3600;

use spine_core::unix_time_ms as now_ms;

/// `/v1/enroll` and `/v1/node/status`, for the tunnel listener.
/// Largest `POST /v1/enroll` body, bytes: a token, a public key and a node name are a few
/// hundred bytes. The listener takes enrollments from anyone, before any check, so its bodies
/// are kept small (axum's default would buffer 2 MB for each of thousands of connections).
pub(crate) const MAX_ENROLL_BODY_BYTES: usize = 16 * 1024;

pub(crate) fn tunnel_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route(
            "/v1/enroll",
            post(enroll).layer(axum::extract::DefaultBodyLimit::max(MAX_ENROLL_BODY_BYTES)),
        )
        .route("/v1/node/status", get(node_status))
        .layer(axum::middleware::from_fn(api::request_id))
        .with_state(state)
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CreateEnrollmentBody {
    /// Validity, seconds; default 24 h.
    #[serde(default)]
    ttl_secs: Option<u64>,
}

/// `POST /admin/v1/operators/{id}/enrollments` (admin listener; the admin router checks the
/// token).
pub(crate) async fn create_enrollment(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let body: CreateEnrollmentBody = if body.iter().all(u8::is_ascii_whitespace) {
        CreateEnrollmentBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::invalid_request(
                "invalid_json",
                format!("expected {{\"ttl_secs\": <seconds>}} or no body: {e}"),
            )
        })?
    };
    let ttl_secs = body.ttl_secs.unwrap_or(DEFAULT_ENROLLMENT_TTL_SECS);
    if ttl_secs == 0 || ttl_secs > MAX_ENROLLMENT_TTL_SECS {
        return Err(ApiError::invalid_request(
            "invalid_ttl",
            format!("ttl_secs must be 1..={MAX_ENROLLMENT_TTL_SECS}"),
        ));
    }
    let operator = OperatorId::new(id);
    let token = keys::new_enrollment_token();
    // ttl ≤ 30 days: no overflow
    let expires_at_ms = now_ms().saturating_add((ttl_secs * 1000) as i64);
    state
        .store
        .create_enrollment(&operator, &keys::hash_api_key(&token), expires_at_ms)
        .await
        .map_err(ledger_error)?;
    tracing::info!(operator = %operator, expires_at_ms, "enrollment token issued");
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "token": token,
            "operator_id": operator,
            "expires_at_ms": expires_at_ms,
            "ttl_secs": ttl_secs,
        })),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EnrollBody {
    token: String,
    public_key: String,
    #[serde(default)]
    node_name: Option<String>,
    /// The models the agent's engine serves (as the agent will advertise them). When given and
    /// none is in the catalog, the token is NOT redeemed: the owner fixes the model name and
    /// joins again with the same token. Absent (older agents): not checked.
    #[serde(default)]
    models: Option<Vec<String>>,
}

/// A node name: 1–64 characters, no control characters.
fn valid_node_name(name: &str) -> bool {
    (1..=64).contains(&name.chars().count()) && !name.chars().any(char::is_control)
}

fn enroll_error(e: LedgerError) -> ApiError {
    match e {
        LedgerError::UnknownEnrollment => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_enrollment_token",
            "the enrollment token is not valid; ask the gateway's operator for a new one",
        ),
        LedgerError::EnrollmentExpired => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "enrollment_token_expired",
            "the enrollment token has expired; ask for a new one",
        ),
        LedgerError::EnrollmentUsed => ApiError::new(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "enrollment_token_used",
            "the enrollment token was already used by another node",
        ),
        LedgerError::Duplicate {
            what: "node public key",
        } => ApiError::new(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "node_key_registered",
            "this node key is already registered",
        ),
        other => ledger_error(other),
    }
}

/// `POST /v1/enroll` (tunnel listener).
async fn enroll(
    State(state): State<Arc<AppState>>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<impl IntoResponse, ApiError> {
    // past `MAX_ENROLL_BODY_BYTES` (or a body that failed to arrive): OpenAI's error shape,
    // never axum's plain-text rejection
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "request_too_large",
                format!("an enrollment body is at most {MAX_ENROLL_BODY_BYTES} bytes"),
            )
        } else {
            ApiError::invalid_request("invalid_body", format!("the body could not be read: {e}"))
        }
    })?;
    let body: EnrollBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid_request(
            "invalid_json",
            format!(
                "expected {{\"token\": <enrollment token>, \"public_key\": \"ed25519:…\", \"node_name\": <optional>}}: {e}"
            ),
        )
    })?;
    let key = spine_transport::parse_public_key_text(body.public_key.trim())
        .map_err(|e| ApiError::invalid_request("invalid_public_key", format!("public_key: {e}")))?;
    if let Some(name) = &body.node_name {
        if !valid_node_name(name) {
            return Err(ApiError::invalid_request(
                "invalid_node_name",
                "node_name must be 1-64 characters without control characters",
            ));
        }
    }
    if let Some(models) = &body.models {
        let listed = |m: &String| state.catalog_ids.iter().any(|c| c.as_str() == m);
        if !models.iter().any(listed) {
            let catalog: Vec<&str> = state.catalog_ids.iter().map(|c| c.as_str()).collect();
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request_error",
                "no_catalog_model",
                format!(
                    "none of the engine's models ({}) is in the gateway's catalog ({}); serve one under a catalog name (llama.cpp --alias, vLLM/SGLang --served-model-name, `ollama cp`) and join again with the same token: it was not used",
                    if models.is_empty() { "none".to_owned() } else { models.join(", ") },
                    catalog.join(", ")
                ),
            ));
        }
    }
    let text = spine_transport::public_key_text(&key);
    let enrollment = state
        .store
        .redeem_enrollment(
            &keys::hash_api_key(body.token.trim()),
            &text,
            body.node_name.as_deref(),
        )
        .await
        .map_err(enroll_error)?;
    tracing::info!(node = %enrollment.node, operator = %enrollment.operator, "node enrolled");
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "node_id": enrollment.node,
            "operator_id": enrollment.operator,
            "public_key": text,
            "catalog_models": state.catalog_ids,
        })),
    ))
}

fn signature_error(code: &'static str, message: &str) -> ApiError {
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        code,
        message.to_owned(),
    )
}

/// A refused status signature: 401 with its code and message.
fn node_signature_error(e: NodeSignatureError) -> ApiError {
    signature_error(e.code(), &e.to_string())
}

/// `GET /v1/node/status` (tunnel listener): this node as the gateway sees it.
async fn node_status(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<impl IntoResponse, ApiError> {
    let key_text = verify_status_headers(&headers, now_ms()).map_err(node_signature_error)?;
    let node = state
        .store
        .node_for_public_key(&key_text)
        .await
        .map_err(ledger_error)?
        .ok_or_else(|| {
            signature_error(
                "unknown_node",
                "this node key is not registered with the gateway",
            )
        })?;
    let operator = state
        .store
        .node_operator(&node)
        .await
        .map_err(ledger_error)?;
    let view = node_view(&state, &operator, &node).await?;
    let operator_earned = state
        .store
        .operator_earned_micros(&operator)
        .await
        .map_err(ledger_error)?;
    let mut out = view;
    out["operator_id"] = json!(operator);
    out["operator_earned_micros"] = json!(operator_earned);
    out["catalog_models"] = json!(state.catalog_ids);
    out["server_time_ms"] = json!(now_ms());
    Ok(Json(out))
}

/// One node of an operator as JSON: stored record (name, requests served, earnings) and live
/// state (connected, routable, models), for the status endpoint and `GET /admin/v1/operators/{id}`.
async fn node_view(
    state: &AppState,
    operator: &OperatorId,
    node: &NodeId,
) -> Result<serde_json::Value, ApiError> {
    let nodes = nodes_json(state, operator).await?;
    nodes
        .into_iter()
        .find(|n| n["node_id"] == json!(node))
        .ok_or_else(|| ApiError::internal("the node vanished from its operator's list"))
}

/// Every node of `operator` as JSON: `node_id`, `name`, `connected` (a live tunnel, routable or
/// still in its warm-up probe), `routable`, `models` (the catalog models it is routed for),
/// `unlisted_models` (served by its engine but not in the catalog: never routed), `in_flight`,
/// `requests_served`, `earned_micros`, `created_at_ms`.
pub(crate) async fn nodes_json(
    state: &AppState,
    operator: &OperatorId,
) -> Result<Vec<serde_json::Value>, ApiError> {
    let records = state
        .store
        .operator_nodes(operator)
        .await
        .map_err(ledger_error)?;
    let live = state.registry.snapshot();
    let connected = state.tunnels.connected();
    Ok(records
        .into_iter()
        .map(|r| {
            let snap = live.iter().find(|s| s.node_id == r.node_id);
            // the registry holds only the catalog models (main.rs `RegistryEvents`); the tunnel
            // keeps what the node advertised
            let models: Vec<_> = snap
                .map(|s| s.descriptor.models.iter().map(|m| m.id.clone()).collect())
                .unwrap_or_default();
            let unlisted: Vec<_> = connected
                .iter()
                .find(|(n, _)| *n == r.node_id)
                .map(|(_, d)| {
                    d.models
                        .iter()
                        .map(|m| m.id.clone())
                        .filter(|id| !state.catalog_ids.contains(id))
                        .collect()
                })
                .unwrap_or_default();
            json!({
                "node_id": r.node_id,
                "name": r.name,
                "connected": state.tunnels.contains(&r.node_id),
                "routable": snap.is_some(),
                "models": models,
                "unlisted_models": unlisted,
                "in_flight": snap.map_or(0, |s| s.in_flight),
                "requests_served": r.requests_served,
                "earned_micros": r.earned_micros,
                "created_at_ms": r.created_at_ms,
                "audit": state.audit_json(&r.node_id),
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// Every refusal of a status signature is a 401 with the library's code and message.
    #[test]
    fn refused_status_signatures_are_401() {
        for e in [
            NodeSignatureError::MissingHeader,
            NodeSignatureError::Stale,
            NodeSignatureError::DoesNotVerify,
        ] {
            let api = node_signature_error(e);
            assert_eq!(api.status, StatusCode::UNAUTHORIZED);
            assert_eq!(api.code, e.code());
            assert_eq!(api.message, e.to_string());
        }
    }

    #[test]
    fn node_names() {
        assert!(valid_node_name("desk-4090"));
        assert!(valid_node_name("Ünïcode ok"));
        assert!(!valid_node_name(""));
        assert!(!valid_node_name("a\nb"));
        assert!(!valid_node_name(&"x".repeat(65)));
    }
}
