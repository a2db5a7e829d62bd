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
//! Errors are [`ApiError`]s (`crate::openai_error`): OpenAI's error shape, as the rest of the admin API answers.

use std::sync::Arc;

use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Json;
use axum::Router;
use http::StatusCode;
use serde::Deserialize;
use serde_json::json;
use spine_core::{AccountId, OperatorId};

use crate::keys;
use crate::ledger::{ConsoleRole, ConsoleUser};

use super::auth::{
    hash_in_turn, hash_password, new_token, password_turns, token_hash, PASSWORD_HASH_WAIT,
};
use super::ConsoleHost;
use crate::openai_error::{ApiBody, ApiError, ApiPath};

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

/// Issues a sign-in link for `user_id` with a fresh `token`; the path to open on the console
/// listener.
async fn issue_link(
    state: &dyn ConsoleHost,
    user_id: &str,
    token: &str,
) -> Result<String, crate::LedgerError> {
    let expires = spine_core::unix_time_ms().saturating_add(LINK_TTL_MS);
    state
        .store()
        .clone()
        .console()
        .create_console_link(&token_hash(token), user_id, expires)
        .await?;
    Ok(format!("/console/signin/link/{token}"))
}

/// A fresh sign-in link token.
fn link_token() -> Result<String, ApiError> {
    new_token().ok_or_else(|| ApiError::internal("no randomness available"))
}

/// `POST /admin/v1/console/users`.
async fn create_user<H: ConsoleHost>(
    State(state): State<Arc<H>>,
    ApiBody(body): ApiBody,
) -> Result<impl IntoResponse, ApiError> {
    let body: CreateUserBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid_request("invalid_json", format!("invalid JSON body: {e}"))
    })?;
    let email = body.email.trim().to_owned();
    if email.is_empty() || email.len() > 254 || !email.contains('@') {
        return Err(ApiError::invalid_request(
            "invalid_email",
            "email must be an address",
        ));
    }
    let role = match (body.account_id, body.operator_id, body.platform) {
        (Some(a), None, false) => ConsoleRole::Builder(AccountId::new(a)),
        (None, Some(o), false) => ConsoleRole::Operator(OperatorId::new(o)),
        (None, None, true) => ConsoleRole::Platform,
        _ => {
            return Err(ApiError::invalid_request(
                "invalid_role",
                "give exactly one of account_id (a builder), operator_id (a GPU operator) or \
                 platform: true (the platform's staff)",
            ))
        }
    };
    if body.password.is_none() && !body.sign_in_link {
        return Err(ApiError::invalid_request(
            "no_credential",
            "give a password, or sign_in_link: true, or both",
        ));
    }
    let password_hash = match body.password {
        Some(p) if p.len() < 12 || p.len() > 1024 => {
            return Err(ApiError::invalid_request(
                "weak_password",
                "password must be 12 to 1024 bytes",
            ))
        }
        Some(p) => Some(
            hash_in_turn(password_turns(), PASSWORD_HASH_WAIT, move || {
                hash_password(&p)
            })
            .await
            .map_err(|_| {
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "password_hashing_busy",
                    "password hashing is busy; retry",
                )
            })?
            .map_err(|_| ApiError::internal("password hashing failed"))?,
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
        .map_err(ApiError::from)?;
    let sign_in_path = if body.sign_in_link {
        let token = link_token()?;
        Some(
            issue_link(&*state, &user.user_id, &token)
                .await
                .map_err(ApiError::from)?,
        )
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
    ApiPath(id): ApiPath<String>,
) -> Result<impl IntoResponse, ApiError> {
    if !keys::valid_id(&id) {
        return Err(ApiError::not_found("no such console user"));
    }
    let token = link_token()?;
    // the link's one reference is its user: a refusal is an unknown user, unless the store
    // could not be reached (503, retry) or the id cannot be stored (400)
    let path = issue_link(&*state, &id, &token).await.map_err(|e| {
        if e.is_unavailable() || matches!(e, crate::LedgerError::InvalidText) {
            ApiError::from(e)
        } else {
            ApiError::not_found("no such console user")
        }
    })?;
    Ok((StatusCode::CREATED, Json(json!({ "sign_in_path": path }))))
}

/// `POST /admin/v1/console/users/{id}/revoke-sessions`.
async fn revoke_sessions<H: ConsoleHost>(
    State(state): State<Arc<H>>,
    ApiPath(id): ApiPath<String>,
) -> Result<impl IntoResponse, ApiError> {
    let revoked = state
        .store()
        .clone()
        .console()
        .revoke_console_sessions(&id)
        .await
        .map_err(ApiError::from)?;
    Ok(Json(json!({ "user_id": id, "revoked": revoked })))
}
