//! The admin API's console calls ([`admin_routes`]; the reference gateway serves them on its
//! admin listener, behind its bearer admin token):
//!
//! - `POST /admin/v1/console/users` `{"email", "account_id" | "operator_id" | "platform": true,
//!   "password"?, "sign_in_link"?: true}` → `201 {"user_id", "email", "role", "owner_id",
//!   "sign_in_path"?}`: a console user of exactly one account (a builder), one operator or the
//!   platform (`owner_id` null); with `sign_in_link`, a
//!   one-time sign-in path (`/console/signin/link/<token>`, valid 24 h; only its hash is kept).
//! - `POST /admin/v1/console/users/{id}/sign-in-link` → `201 {"sign_in_path"}`: another link.
//! - `POST /admin/v1/console/users/{id}/revoke-sessions` → `{"revoked": n}`.
//!
//! Errors are [`AdminError`]s: OpenAI's error shape, as the rest of the admin API answers.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::IntoResponse;
use axum::response::Response;
use axum::routing::post;
use axum::Json;
use axum::Router;
use http::StatusCode;
use serde::Deserialize;
use serde_json::json;
use spine_core::{AccountId, OperatorId};

use crate::keys;
use crate::ledger::{ConsoleRole, ConsoleUser};

use super::auth::{hash_password, new_token, token_hash};
use super::ConsoleHost;
use crate::LedgerError;

/// The admin API's console calls (see the [module docs](self)) over `H`'s store, to merge into
/// the application's admin router: they check no credential themselves, so mount them behind
/// the admin API's authentication (the reference gateway's bearer admin token).
pub fn admin_routes<H: ConsoleHost>() -> Router<Arc<H>> {
    Router::new()
        .route("/admin/v1/console/users", post(create_user::<H>))
        .route(
            "/admin/v1/console/users/{id}/sign-in-link",
            post(create_link::<H>),
        )
        .route(
            "/admin/v1/console/users/{id}/revoke-sessions",
            post(revoke_sessions::<H>),
        )
}

/// An admin console call's refusal or failure, answered in OpenAI's error shape
/// (`{"error":{"message","type","param","code"}}`) with its status; a 503 carries
/// `Retry-After: 1`.
#[derive(Debug, Clone)]
pub struct AdminError {
    status: StatusCode,
    kind: &'static str,
    code: &'static str,
    message: String,
}

impl AdminError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: String) -> Self {
        Self {
            status,
            kind,
            code,
            message,
        }
    }

    fn invalid_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message.into(),
        )
    }

    fn not_found(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            message.into(),
        )
    }

    fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            "internal_error",
            message.into(),
        )
    }

    /// A store error: 404 for an unknown id, 409 for a duplicate or a reused idempotency key,
    /// 400 out of range, else 503 `ledger_unavailable` (logged).
    fn ledger(e: LedgerError) -> Self {
        match e {
            LedgerError::UnknownAccount(id) => Self::not_found(format!("no account '{id}'")),
            LedgerError::UnknownOperator(id) => Self::not_found(format!("no operator '{id}'")),
            LedgerError::UnknownNode(id) => Self::not_found(format!("no node '{id}'")),
            LedgerError::Duplicate { what } => Self::new(
                StatusCode::CONFLICT,
                "invalid_request_error",
                "conflict",
                format!("{what} already exists"),
            ),
            LedgerError::IdempotencyConflict { .. } => Self::new(
                StatusCode::CONFLICT,
                "invalid_request_error",
                "idempotency_conflict",
                format!("{e}: the key was already used for another account or amount"),
            ),
            LedgerError::OutOfRange => Self::invalid_request("out_of_range", e.to_string()),
            other => {
                tracing::error!(error = %other, "ledger error");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "api_error",
                    "ledger_unavailable",
                    "the ledger is unavailable".to_owned(),
                )
            }
        }
    }

    /// The HTTP status it is answered with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// OpenAI's `code` (`invalid_email`, `not_found`, `ledger_unavailable`, …).
    pub fn code(&self) -> &'static str {
        self.code
    }
}

impl std::fmt::Display for AdminError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.status, self.code, self.message)
    }
}

impl std::error::Error for AdminError {}

impl IntoResponse for AdminError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": null,
                "code": self.code,
            }
        });
        let mut r = (self.status, Json(body)).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut()
                .insert(http::header::RETRY_AFTER, http::HeaderValue::from(1u64));
        }
        r
    }
}

/// How long a sign-in link stays valid, milliseconds (24 h).
const LINK_TTL_MS: i64 = 24 * 3_600_000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateUserBody {
    email: String,
    #[serde(default)]
    account_id: Option<String>,
    #[serde(default)]
    operator_id: Option<String>,
    /// A user of the platform pages (neither an account nor an operator).
    #[serde(default)]
    platform: bool,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    sign_in_link: bool,
}

/// Issues a sign-in link for `user_id`; the path to open on the console listener.
async fn issue_link(state: &dyn ConsoleHost, user_id: &str) -> Result<String, AdminError> {
    let token = new_token().ok_or_else(|| AdminError::internal("no randomness available"))?;
    let expires = spine_core::unix_time_ms().saturating_add(LINK_TTL_MS);
    state
        .store()
        .clone()
        .console()
        .create_console_link(&token_hash(&token), user_id, expires)
        .await
        .map_err(AdminError::ledger)?;
    Ok(format!("/console/signin/link/{token}"))
}

/// `POST /admin/v1/console/users`.
async fn create_user<H: ConsoleHost>(
    State(state): State<Arc<H>>,
    body: axum::body::Bytes,
) -> Result<impl IntoResponse, AdminError> {
    let body: CreateUserBody = serde_json::from_slice(&body).map_err(|e| {
        AdminError::invalid_request("invalid_json", format!("invalid JSON body: {e}"))
    })?;
    let email = body.email.trim().to_owned();
    if email.is_empty() || email.len() > 254 || !email.contains('@') {
        return Err(AdminError::invalid_request(
            "invalid_email",
            "email must be an address",
        ));
    }
    let role = match (body.account_id, body.operator_id, body.platform) {
        (Some(a), None, false) => ConsoleRole::Builder(AccountId::new(a)),
        (None, Some(o), false) => ConsoleRole::Operator(OperatorId::new(o)),
        (None, None, true) => ConsoleRole::Platform,
        _ => {
            return Err(AdminError::invalid_request(
                "invalid_role",
                "give exactly one of account_id (a builder), operator_id (a GPU operator) or \
                 platform: true (the platform's staff)",
            ))
        }
    };
    if body.password.is_none() && !body.sign_in_link {
        return Err(AdminError::invalid_request(
            "no_credential",
            "give a password, or sign_in_link: true, or both",
        ));
    }
    let password_hash = match body.password {
        Some(p) if p.len() < 12 || p.len() > 1024 => {
            return Err(AdminError::invalid_request(
                "weak_password",
                "password must be 12 to 1024 bytes",
            ))
        }
        Some(p) => Some(
            tokio::task::spawn_blocking(move || hash_password(&p))
                .await
                .map_err(|_| AdminError::internal("password hashing failed"))?
                .map_err(|_| AdminError::internal("password hashing failed"))?,
        ),
        None => None,
    };
    let user = ConsoleUser {
        user_id: keys::new_id("cu"),
        email,
        role,
        password_hash,
        created_at_ms: 0,
    };
    state
        .store()
        .clone()
        .console()
        .create_console_user(&user)
        .await
        .map_err(AdminError::ledger)?;
    let sign_in_path = if body.sign_in_link {
        Some(issue_link(&*state, &user.user_id).await?)
    } else {
        None
    };
    let (role, owner) = match &user.role {
        ConsoleRole::Builder(a) => ("builder", Some(a.to_string())),
        ConsoleRole::Operator(o) => ("operator", Some(o.to_string())),
        ConsoleRole::Platform => ("platform", None),
    };
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "user_id": user.user_id,
            "email": user.email,
            "role": role,
            "owner_id": owner,
            "sign_in_path": sign_in_path,
        })),
    ))
}

/// `POST /admin/v1/console/users/{id}/sign-in-link`.
async fn create_link<H: ConsoleHost>(
    State(state): State<Arc<H>>,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, AdminError> {
    if !keys::valid_id(&id) {
        return Err(AdminError::not_found("no such console user"));
    }
    let path = issue_link(&*state, &id)
        .await
        .map_err(|_| AdminError::not_found("no such console user"))?;
    Ok((StatusCode::CREATED, Json(json!({ "sign_in_path": path }))))
}

/// `POST /admin/v1/console/users/{id}/revoke-sessions`.
async fn revoke_sessions<H: ConsoleHost>(
    State(state): State<Arc<H>>,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, AdminError> {
    let revoked = state
        .store()
        .clone()
        .console()
        .revoke_console_sessions(&id)
        .await
        .map_err(AdminError::ledger)?;
    Ok(Json(json!({ "user_id": id, "revoked": revoked })))
}
