//! Nodes and their operators as axum handlers over the [`Store`]: node enrollment, the node's
//! own view of itself, and the admin's node registration and operator view (design brief §7,
//! issue 8; feature `enroll`).
//!
//! - Admin: `POST /admin/v1/nodes` ([`register_node`]) registers a node's public key directly;
//!   `GET /admin/v1/operators/{id}` ([`operator`]) shows the operator's earnings and nodes.
//! - Admin: `POST /admin/v1/operators/{id}/enrollments` ([`create_enrollment`]) → a one-time
//!   enrollment token. Only its SHA-256 is stored, with an expiry (default 24 h, at most 30
//!   days); it registers one node.
//! - Tunnel listener ([`NodeEnrollment::tunnel_router`]): `POST /v1/enroll` `{"token",
//!   "public_key", "proof", "node_name"?}` redeems a token: the public key becomes a node of
//!   the token's operator (`201 {"node_id", "operator_id", "public_key", "catalog_models"}`).
//!   No `proof` (the key's signature over the token) → 400, one that does not verify → 401,
//!   both before the token is looked at; unknown or
//!   expired token → 401, used → 409, key already registered → 409, all in OpenAI's error shape
//!   ([`ApiError`]). Redeeming again with the same key returns the same node, so an agent that
//!   lost the answer can retry.
//! - Tunnel listener: `GET /v1/node/status`, authenticated by the node's own key (the agent has
//!   no admin token): headers `x-spine-node-key` (`ed25519:<base64url>`),
//!   `x-spine-timestamp-ms` (Unix ms, within ±60 s of the gateway's clock) and
//!   `x-spine-signature` (base64url ed25519 signature), checked by
//!   [`spine_transport::node_status::verify_status_headers`]. It answers this node's state as
//!   the gateway sees it: connected, routable, the routable models, requests served and
//!   earnings. The request is read-only, so a replay inside the window discloses only what the
//!   node itself may read.
//!
//! The catalog is the gateway's: a node advertises every model its engine serves, but only those
//! in the catalog are ever routed to it (a request for another model is refused with 404 before
//! routing); `catalog_models` in the enrollment answer and the status lets the agent and its owner
//! see which ones count. What is live now (tunnels, routing) comes from the application through
//! [`LiveNodes`]: this crate knows neither the router nor the tunnel listener.

use std::sync::Arc;

use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::json;
use spine_core::unix_time_ms as now_ms;
use spine_core::{ModelId, NodeId, OperatorId};
use spine_transport::node_status::{verify_status_headers, NodeSignatureError};

use crate::audit::Auditor;
use crate::keys;
use crate::openai_error::{ApiBody, ApiError, ApiPath};
use crate::{LedgerError, Store};

/// Default validity of an enrollment token, seconds (24 h).
pub const DEFAULT_ENROLLMENT_TTL_SECS: u64 = 24 * 3600;
/// Longest validity of an enrollment token, seconds (30 days).
pub const MAX_ENROLLMENT_TTL_SECS: u64 = 30 * 24 * 3600;

/// Largest `POST /v1/enroll` body, bytes: a token, a public key and a node name are a few
/// hundred bytes. The listener takes enrollments from anyone, before any check, so its bodies
/// are kept small (axum's default would buffer 2 MB for each of thousands of connections).
pub const MAX_ENROLL_BODY_BYTES: usize = 16 * 1024;

/// One node as the application's router and tunnels see it now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LiveNode {
    /// A tunnel to it is up (routable or still in its warm-up probe).
    pub connected: bool,
    /// The router may pick it now.
    pub routable: bool,
    /// The catalog models it is routed for (empty when it is not routable).
    pub routed_models: Vec<ModelId>,
    /// Every model its engine serves, as its tunnel advertised them (empty until the tunnel is
    /// past its warm-up).
    pub advertised_models: Vec<ModelId>,
    /// Requests it serves now through this gateway.
    pub in_flight: u32,
}

/// Which nodes are connected and routable now: the application's router and tunnel listener
/// (the reference gateway: `spine_router::NodeRegistry` and `spine_transport::Tunnels`).
pub trait LiveNodes: Send + Sync {
    /// The live state of each of `nodes`, in their order; a node with no tunnel is
    /// [`LiveNode::default`]. Called once per answer, so one look at the live state serves it.
    fn live(&self, nodes: &[NodeId]) -> Vec<LiveNode>;
}

/// What the enrollment and node-status handlers read: the store, the catalog, the live nodes
/// and the auditor (each node's audit states). Cheap to clone.
#[derive(Clone)]
pub struct NodeEnrollment {
    store: Arc<dyn Store>,
    catalog: Arc<[ModelId]>,
    live: Arc<dyn LiveNodes>,
    auditor: Option<Auditor>,
}

impl std::fmt::Debug for NodeEnrollment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeEnrollment")
            .field("catalog", &self.catalog)
            .finish_non_exhaustive()
    }
}

impl NodeEnrollment {
    /// The handlers' state over `store`, the `catalog`'s model ids, what is `live` now and the
    /// `auditor`, if models are audited.
    pub fn new(
        store: Arc<dyn Store>,
        catalog: Vec<ModelId>,
        live: Arc<dyn LiveNodes>,
        auditor: Option<Auditor>,
    ) -> Self {
        Self {
            store,
            catalog: catalog.into(),
            live,
            auditor,
        }
    }

    /// `POST /v1/enroll` (bodies up to [`MAX_ENROLL_BODY_BYTES`]) and `GET /v1/node/status`,
    /// for the listener agents dial, with a fallback (404) and a wrong method (405) in OpenAI's
    /// error shape: merge it into a router without a fallback of its own. The application adds
    /// its own layers (request ids).
    pub fn tunnel_router(self) -> Router {
        let routes = Router::new()
            .route(
                "/v1/enroll",
                post(enroll).layer(axum::extract::DefaultBodyLimit::max(MAX_ENROLL_BODY_BYTES)),
            )
            .route("/v1/node/status", get(node_status));
        // anyone can reach this listener: every answer, a wrong URL or method too, is in
        // OpenAI's error shape
        crate::openai_error::with_openai_fallbacks(routes, "URL").with_state(self)
    }

    /// Every node of `operator` as JSON: `node_id`, `name`, `connected` (a live tunnel,
    /// routable or still in its warm-up probe), `routable`, `models` (the catalog models it is
    /// routed for), `unlisted_models` (served by its engine but not in the catalog: never
    /// routed), `in_flight`, `requests_served`, `earned_micros`, `created_at_ms`, `audit` (its
    /// audit states, `[]` when nothing is audited).
    ///
    /// # Errors
    ///
    /// The store's, as [`ApiError`] (404 for an unknown operator).
    pub async fn operator_nodes(
        &self,
        operator: &OperatorId,
    ) -> Result<Vec<serde_json::Value>, ApiError> {
        let records = self.store.operator_nodes(operator).await?;
        let ids: Vec<NodeId> = records.iter().map(|r| r.node_id.clone()).collect();
        let live = self.live.live(&ids);
        Ok(records
            .into_iter()
            .zip(live)
            .map(|(r, live)| {
                let unlisted: Vec<&ModelId> = live
                    .advertised_models
                    .iter()
                    .filter(|id| !self.catalog.contains(id))
                    .collect();
                json!({
                    "node_id": r.node_id,
                    "name": r.name,
                    "connected": live.connected,
                    "routable": live.routable,
                    "models": live.routed_models,
                    "unlisted_models": unlisted,
                    "in_flight": live.in_flight,
                    "requests_served": r.requests_served,
                    "earned_micros": r.earned_micros,
                    "created_at_ms": r.created_at_ms,
                    "audit": self.audit_json(&r.node_id),
                })
            })
            .collect())
    }

    /// The audit states of `node` (one per audited model), `[]` when nothing is audited.
    pub fn audit_json(&self, node: &NodeId) -> serde_json::Value {
        self.auditor
            .as_ref()
            .map_or_else(|| json!([]), |a| json!(a.statuses_of(node)))
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CreateEnrollmentBody {
    /// Validity, seconds; default 24 h.
    #[serde(default)]
    ttl_secs: Option<u64>,
}

/// `POST /admin/v1/operators/{id}/enrollments` `{"ttl_secs"?}` (or no body): a one-time token
/// for operator `id`, `201 {"token", "operator_id", "expires_at_ms", "ttl_secs"}`. The
/// application checks the admin's credentials before it (`post(create_enrollment).with_state(…)`
/// on its admin router).
///
/// # Errors
///
/// 400 for a bad body or a TTL outside 1 s..=30 days, 404 for an unknown operator, 503 when the
/// store fails.
pub async fn create_enrollment(
    State(state): State<NodeEnrollment>,
    ApiPath(id): ApiPath<String>,
    ApiBody(body): ApiBody,
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
        .await?;
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

/// `GET /admin/v1/operators/{id}`: the operator's earnings, the requests its nodes served and
/// each node ([`NodeEnrollment::operator_nodes`]: connected / routable / models now, requests
/// served and credits so far), `{"id", "earned_micros", "requests_served", "nodes"}`. Behind
/// the application's admin check, as [`create_enrollment`].
///
/// # Errors
///
/// 404 for an unknown operator, 503 when the store fails.
pub async fn operator(
    State(state): State<NodeEnrollment>,
    ApiPath(id): ApiPath<String>,
) -> Result<impl IntoResponse, ApiError> {
    let id = OperatorId::new(id);
    let earned = state.store.operator_earned_micros(&id).await?;
    let nodes = state.operator_nodes(&id).await?;
    let requests_served: u64 = nodes
        .iter()
        .filter_map(|n| n["requests_served"].as_u64())
        .sum();
    Ok(Json(json!({
        "id": id,
        "earned_micros": earned,
        "requests_served": requests_served,
        "nodes": nodes,
    })))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RegisterNodeBody {
    operator_id: String,
    public_key: String,
}

/// `POST /admin/v1/nodes` `{"operator_id", "public_key": "ed25519:…"}`: registers the key as a
/// node of the operator without an enrollment token, `201 {"node_id", "public_key"}` (the key's
/// canonical text). Behind the application's admin check, as [`create_enrollment`].
///
/// # Errors
///
/// 400 for a bad body or key, 404 for an unknown operator, 409 for a key already registered,
/// 503 when the store fails.
pub async fn register_node(
    State(state): State<NodeEnrollment>,
    ApiBody(body): ApiBody,
) -> Result<impl IntoResponse, ApiError> {
    let body: RegisterNodeBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid_request(
            "invalid_json",
            format!("expected {{\"operator_id\": <id>, \"public_key\": \"ed25519:…\"}}: {e}"),
        )
    })?;
    let text = canonical_public_key(&body.public_key)?;
    let node = state
        .store
        .register_node(&OperatorId::new(body.operator_id), &text)
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"node_id": node, "public_key": text})),
    ))
}

/// The canonical text form of a node's public key (`ed25519:<base64url>`), stored so that the
/// tunnel's lookup matches byte for byte; 400 `invalid_public_key` for anything else.
fn canonical_public_key(text: &str) -> Result<String, ApiError> {
    let key = spine_transport::parse_public_key_text(text.trim())
        .map_err(|e| ApiError::invalid_request("invalid_public_key", format!("public_key: {e}")))?;
    Ok(spine_transport::public_key_text(&key))
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
    /// The node key's signature over the token
    /// ([`spine_transport::node_status::enrollment_proof`]): proves the enrolling party holds
    /// the key, so a token cannot register another node's key.
    #[serde(default)]
    proof: Option<String>,
}

/// A node name: 1–64 characters, no control characters.
fn valid_node_name(name: &str) -> bool {
    (1..=64).contains(&name.chars().count()) && !name.chars().any(char::is_control)
}

/// A refused redemption: 401 for an unknown or expired token, 409 for a used one or a key
/// already registered; any other ledger error as [`From<LedgerError>`](ApiError).
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
        other => ApiError::from(other),
    }
}

/// `POST /v1/enroll` (tunnel listener).
async fn enroll(
    State(state): State<NodeEnrollment>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<impl IntoResponse, ApiError> {
    // past `MAX_ENROLL_BODY_BYTES` (or a body that failed to arrive): OpenAI's error shape,
    // never axum's plain-text rejection
    let body = body.map_err(|e| {
        let mut err = ApiError::from(e);
        if err.status == StatusCode::PAYLOAD_TOO_LARGE {
            err.message = format!("an enrollment body is at most {MAX_ENROLL_BODY_BYTES} bytes");
        }
        err
    })?;
    let body: EnrollBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid_request(
            "invalid_json",
            format!(
                "expected {{\"token\": <enrollment token>, \"public_key\": \"ed25519:…\", \"proof\": <signature>, \"node_name\": <optional>}}: {e}"
            ),
        )
    })?;
    let text = canonical_public_key(&body.public_key)?;
    // checked before the token is looked at: a wrong proof never spends it
    let Some(proof) = body.proof.as_deref() else {
        return Err(ApiError::invalid_request(
            "enrollment_proof_required",
            "send \"proof\": the node key's signature over the token (spine_transport::node_status::enrollment_proof; reference-agent join sends it)",
        )
        .with_param("proof"));
    };
    spine_transport::node_status::verify_enrollment_proof(&text, &body.token, proof)
        .map_err(|e| signature_error(e.code(), &format!("proof: {e}")))?;
    if let Some(name) = &body.node_name {
        if !valid_node_name(name) {
            return Err(ApiError::invalid_request(
                "invalid_node_name",
                "node_name must be 1-64 characters without control characters",
            ));
        }
    }
    if let Some(models) = &body.models {
        let listed = |m: &String| state.catalog.iter().any(|c| c.as_str() == m);
        if !models.iter().any(listed) {
            let catalog: Vec<&str> = state.catalog.iter().map(|c| c.as_str()).collect();
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
            "catalog_models": &*state.catalog,
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
    State(state): State<NodeEnrollment>,
    headers: HeaderMap,
) -> Result<impl IntoResponse, ApiError> {
    let key_text = verify_status_headers(&headers, now_ms()).map_err(node_signature_error)?;
    let node = state
        .store
        .node_for_public_key(&key_text)
        .await?
        .ok_or_else(|| {
            signature_error(
                "unknown_node",
                "this node key is not registered with the gateway",
            )
        })?;
    let operator = state.store.node_operator(&node).await?;
    // one node of its operator's list: stored record (name, requests served, earnings) and
    // live state (connected, routable, models)
    let mut out = state
        .operator_nodes(&operator)
        .await?
        .into_iter()
        .find(|n| n["node_id"] == json!(node))
        .ok_or_else(|| ApiError::internal("the node vanished from its operator's list"))?;
    let operator_earned = state.store.operator_earned_micros(&operator).await?;
    out["operator_id"] = json!(operator);
    out["operator_earned_micros"] = json!(operator_earned);
    out["catalog_models"] = json!(&*state.catalog);
    out["server_time_ms"] = json!(now_ms());
    Ok(Json(out))
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
