//! OpenAI-shaped errors for an axum application: `{"error":{"message","type","param","code"}}`
//! with the right status and `Retry-After` (feature `axum`).
//!
//! [`ApiError`] is the answer a caller of an OpenAI-compatible endpoint gets. The meter's own
//! errors map onto it here ([`From<&MeterError>`](ApiError#impl-From<%26MeterError>-for-ApiError),
//! [`From<LedgerError>`](ApiError#impl-From<LedgerError>-for-ApiError), a node's non-2xx answer
//! through [`ApiError::from_node_response`], the Responses API's translation errors); errors of
//! the crates below the meter (the router's, the tunnel's) are the application's to map, with
//! [`ApiError::new`] and the constructors.

use axum::response::{IntoResponse, Response};
use axum::Json;
use http::StatusCode;
use serde_json::json;
use spine_core::{BoxBody, BoxError, RequestKind};

use crate::meter::MeterError;
use crate::node_error::NodeError;
use crate::responses::{ReshapeError, ResponsesError, TranslateError};
use crate::LedgerError;

/// An error as the caller sees it: the HTTP status, OpenAI's `type`, `code`, `message` and
/// `param`, and the `Retry-After` seconds. Answered by its [`IntoResponse`] impl.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// OpenAI's `type` (`invalid_request_error`, `api_error`, `insufficient_quota`, …).
    pub kind: &'static str,
    /// OpenAI's `code` (`invalid_api_key`, `model_not_found`, …).
    pub code: &'static str,
    /// What went wrong, for the caller.
    pub message: String,
    /// `Retry-After`, seconds: set on 429s; 503s get 1 when unset.
    pub retry_after_secs: Option<u64>,
    /// OpenAI's `param`: the request field at fault, when one is.
    pub param: Option<String>,
}

impl ApiError {
    /// An error with this status, `type`, `code` and message; no `param`, no `Retry-After`
    /// (a 503 still gets `Retry-After: 1` when answered).
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            kind,
            code,
            message: message.into(),
            retry_after_secs: None,
            param: None,
        }
    }

    /// Names the request field at fault (OpenAI's `param`).
    #[must_use]
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// 429 in OpenAI's shape: `type` is the limit hit (`requests` or `tokens`), `code`
    /// `rate_limit_exceeded`, with `Retry-After` when waiting helps.
    pub fn rate_limited(
        limit: &'static str,
        message: impl Into<String>,
        retry_after_secs: Option<u64>,
    ) -> Self {
        Self {
            retry_after_secs,
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                limit,
                "rate_limit_exceeded",
                message,
            )
        }
    }

    /// 400 `invalid_request_error` with `code`.
    pub fn invalid_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }

    /// 401 `invalid_api_key`, as OpenAI answers a missing or unknown key.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
        )
    }

    /// 404 `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            message,
        )
    }

    /// 405 `method_not_allowed` for `method` on `path`.
    pub fn method_not_allowed(method: &http::Method, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method_not_allowed",
            format!("{method} is not allowed on {path}"),
        )
    }

    /// 500 `internal_error`: the gateway's own fault.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            "internal_error",
            message,
        )
    }

    /// A node's non-2xx answer in OpenAI's shape: the node's message is kept, its status
    /// mapped ([`NodeError::read`], then [`From<NodeError>`](#impl-From<NodeError>-for-ApiError)).
    /// Reads the answer's body (bounded by [`NodeError::read`]).
    pub async fn from_node_response(resp: http::Response<BoxBody>) -> Self {
        Self::from(NodeError::read(resp).await)
    }

    /// The same error about a chat member, named as the Responses API names it
    /// ([`responses_param`](crate::responses::responses_param): `messages` → `input`, …).
    #[must_use]
    pub fn for_responses(self) -> Self {
        match self
            .param
            .as_deref()
            .and_then(crate::responses::responses_param)
        {
            Some(p) => self.with_param(p),
            None => self,
        }
    }

    /// The same error about the prompt, named as `kind`'s endpoint names it: `messages` is
    /// `prompt` on `/v1/completions` and `input` on `/v1/embeddings`.
    #[must_use]
    pub fn for_kind(self, kind: RequestKind) -> Self {
        if self.param.as_deref() != Some("messages") {
            return self;
        }
        match kind {
            RequestKind::Completions => self.with_param("prompt"),
            RequestKind::Embeddings => self.with_param("input"),
            _ => self,
        }
    }

    /// The answer as a response over [`BoxBody`], for a tower stack's callers.
    pub fn into_boxed_response(self) -> http::Response<BoxBody> {
        use http_body_util::BodyExt as _;
        self.into_response()
            .map(|b| BoxBody::new(b.map_err(BoxError::from)))
    }

    /// A metered chat answer that [`ResponsesAnswer::reshape`](crate::responses::ResponsesAnswer::reshape)
    /// could not re-shape: the node's failure (502, an incomplete answer) or the gateway's (500,
    /// logged).
    pub fn from_reshape(e: ReshapeError) -> Self {
        match e {
            ReshapeError::Incomplete => Self::new(
                StatusCode::BAD_GATEWAY,
                "api_error",
                "node_failure",
                e.to_string(),
            ),
            why => {
                tracing::error!(reason = %why, "cannot re-shape a metered chat answer as a response");
                Self::internal("cannot build the response object")
            }
        }
    }
}

/// The meter's refusals: 400 for a bad request (with `param`), 404 `model_not_found`, 402
/// `insufficient_quota`, 413 `request_too_large`, 429 for the key's limits, 503 when the ledger
/// or the body budget is out, 502 for a node's invalid answer.
impl From<&MeterError> for ApiError {
    fn from(e: &MeterError) -> Self {
        use spine_core::PeekError;
        match e {
            MeterError::BadRequest(inner @ PeekError::UnsupportedParameter { field }) => {
                Self::invalid_request("unsupported_parameter", inner.to_string())
                    .with_param(field.to_string())
            }
            MeterError::BadRequest(inner @ PeekError::UnrecognizedArgument { param }) => {
                Self::invalid_request("unsupported_parameter", inner.to_string())
                    .with_param(param.clone())
            }
            MeterError::BadRequest(inner @ PeekError::InvalidMessage { path, .. }) => {
                Self::invalid_request("invalid_request", inner.to_string()).with_param(path.clone())
            }
            MeterError::BadRequest(inner @ PeekError::InvalidField { field, .. }) => {
                Self::invalid_request("invalid_request", inner.to_string())
                    .with_param(field.to_string())
            }
            MeterError::BadRequest(inner) => {
                Self::invalid_request("invalid_request", inner.to_string())
            }
            MeterError::BodyTooLarge { .. } => Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "request_too_large",
                e.to_string(),
            ),
            MeterError::EmbeddingsRefused { param, message } => {
                Self::invalid_request("invalid_request", message.clone()).with_param(*param)
            }
            MeterError::EmbeddingsTooLarge { .. } => Self::new(
                StatusCode::BAD_GATEWAY,
                "server_error",
                "response_too_large",
                e.to_string(),
            ),
            MeterError::AnswerTooLarge { .. } => Self::new(
                StatusCode::BAD_GATEWAY,
                "server_error",
                "response_too_large",
                e.to_string(),
            ),
            MeterError::BodiesOverBudget { .. } | MeterError::SettlementsBehind { .. } => {
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "server_busy",
                    e.to_string(),
                )
            }
            MeterError::AccountBodiesOverBudget { .. }
            | MeterError::AccountSettlementsBehind { .. } => {
                Self::rate_limited("requests", e.to_string(), Some(1))
            }
            MeterError::UnknownModel(m) => Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!("The model '{m}' does not exist or you do not have access to it."),
            )
            .with_param("model"),
            MeterError::InsufficientCredit { .. } => Self::new(
                StatusCode::PAYMENT_REQUIRED,
                "insufficient_quota",
                "insufficient_quota",
                format!("{e}; add credits to your account"),
            ),
            MeterError::Ledger(_) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "api_error",
                "ledger_unavailable",
                "the ledger is unavailable; the request was not forwarded",
            ),
            MeterError::ContextLengthExceeded { .. } | MeterError::PromptOverContext { .. } => {
                Self::invalid_request("context_length_exceeded", e.to_string())
                    .with_param("messages")
            }
            MeterError::UpstreamInvalid(_) | MeterError::UpstreamBody(_) => Self::new(
                StatusCode::BAD_GATEWAY,
                "api_error",
                "node_failure",
                format!("the node sent an invalid response: {}", with_sources(e)),
            ),
            MeterError::MissingExtension(_) => Self::internal(e.to_string()),
            MeterError::AdmissionRefused(refusal) => Self::rate_limited(
                "tokens",
                refusal.reason.clone(),
                refusal.retry_after.map(ceil_secs),
            ),
            _ => Self::invalid_request("invalid_request", with_sources(e)),
        }
    }
}

/// A ledger error as an admin or enrollment handler answers it: 404 for an unknown id, 409 for
/// a duplicate or a reused idempotency key, 400 out of range or for a text with a NUL, else 503 `ledger_unavailable`
/// (logged; the caller gets no detail).
impl From<LedgerError> for ApiError {
    fn from(e: LedgerError) -> Self {
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
            LedgerError::InvalidText => Self::invalid_request(
                "invalid_text",
                "a text in the request (an id, an address, a key) holds a NUL character",
            ),
            other => {
                tracing::error!(error = %other, "ledger error");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "api_error",
                    "ledger_unavailable",
                    "the ledger is unavailable",
                )
            }
        }
    }
}

/// A node's non-2xx answer ([`NodeError`]): over the context → 400 `context_length_exceeded`
/// (`param` `messages`); 501 → 400 `unsupported_by_node` (the SDKs retry every 5xx, and asking
/// again changes nothing); another 4xx keeps its status, `upstream_rejected`; else 502
/// `node_failure`. The node's message is kept.
impl From<NodeError> for ApiError {
    fn from(e: NodeError) -> Self {
        let message = e.to_string();
        let (status, kind, code) = match e {
            NodeError::ContextLengthExceeded { .. } => {
                let e = Self::invalid_request("context_length_exceeded", message);
                return e.with_param("messages");
            }
            NodeError::Unsupported { .. } => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "unsupported_by_node",
            ),
            NodeError::Rejected { status, .. } => {
                (status, "invalid_request_error", "upstream_rejected")
            }
            _ => (StatusCode::BAD_GATEWAY, "api_error", "node_failure"),
        };
        Self::new(status, kind, code, message)
    }
}

/// A `/v1/responses` body that cannot be translated: 400 with the member at fault.
impl From<ResponsesError> for ApiError {
    fn from(e: ResponsesError) -> Self {
        let err = Self::invalid_request(e.code, e.message);
        match e.param {
            Some(param) => err.with_param(param),
            None => err,
        }
    }
}

/// A `/v1/responses` body that cannot be read or translated: 413 past the limit, else 400.
impl From<TranslateError> for ApiError {
    fn from(e: TranslateError) -> Self {
        match e {
            TranslateError::TooLarge { .. } => Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "request_too_large",
                e.to_string(),
            ),
            TranslateError::Invalid(e) => Self::from(e),
            e => Self::invalid_request("invalid_body", e.to_string()),
        }
    }
}

/// A path parameter axum could not extract (not valid UTF-8 once percent-decoded, not the
/// type asked for): 400 `invalid_path` with axum's reason, never axum's plain-text rejection.
/// (A route whose parameters do not match its handler is the application's fault: 500.)
impl From<axum::extract::rejection::PathRejection> for ApiError {
    fn from(e: axum::extract::rejection::PathRejection) -> Self {
        if e.status().is_server_error() {
            tracing::error!(error = %e.body_text(), "path parameters do not fit the handler");
            return Self::internal("the route's parameters could not be read");
        }
        Self::new(
            e.status(),
            "invalid_request_error",
            "invalid_path",
            e.body_text(),
        )
    }
}

/// A body axum could not read: 413 `request_too_large` past the route's limit
/// (`DefaultBodyLimit`), else `invalid_body` with axum's status and reason, never axum's
/// plain-text rejection.
impl From<axum::extract::rejection::BytesRejection> for ApiError {
    fn from(e: axum::extract::rejection::BytesRejection) -> Self {
        let status = e.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            return Self::new(
                status,
                "invalid_request_error",
                "request_too_large",
                format!("the request body is too large: {}", e.body_text()),
            );
        }
        Self::new(
            status,
            "invalid_request_error",
            "invalid_body",
            format!("the body could not be read: {}", e.body_text()),
        )
    }
}

/// axum's [`Path`](axum::extract::Path) whose rejection is an [`ApiError`]
/// ([`From<PathRejection>`](#impl-From<PathRejection>-for-ApiError)): for handlers that answer
/// in OpenAI's shape, whatever the URL holds (`%FF` is not a `String`).
#[derive(Debug, Clone)]
pub struct ApiPath<T>(pub T);

impl<T, S> axum::extract::FromRequestParts<S> for ApiPath<T>
where
    T: serde::de::DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        match <axum::extract::Path<T> as axum::extract::FromRequestParts<S>>::from_request_parts(
            parts, state,
        )
        .await
        {
            Ok(axum::extract::Path(v)) => Ok(Self(v)),
            Err(e) => Err(ApiError::from(e)),
        }
    }
}

/// The request's body as [`Bytes`](bytes::Bytes) (within the route's `DefaultBodyLimit`), its
/// rejection an [`ApiError`] ([`From<BytesRejection>`](#impl-From<BytesRejection>-for-ApiError)):
/// a body past the limit is 413 in OpenAI's shape, not axum's plain text.
#[derive(Debug, Clone)]
pub struct ApiBody(pub bytes::Bytes);

impl<S> axum::extract::FromRequest<S> for ApiBody
where
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        match <bytes::Bytes as axum::extract::FromRequest<S>>::from_request(req, state).await {
            Ok(b) => Ok(Self(b)),
            Err(e) => Err(ApiError::from(e)),
        }
    }
}

/// Whole seconds, rounded up, at least 1 (`Retry-After`).
pub fn ceil_secs(d: std::time::Duration) -> u64 {
    (d.as_secs() + u64::from(d.subsec_nanos() > 0)).max(1)
}

/// `error: source: source…`, so a caller sees why (e.g. which template field failed).
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

/// The JSON body, the status, and `Retry-After` (its seconds, or 1 on a 503 without them).
/// Sets `router`'s fallbacks to answers in OpenAI's error shape (axum's defaults are empty
/// bodies): an unknown URL is a 404 `not_found` ("Unknown `what`: METHOD /path"), a known
/// URL with a wrong method a 405 `method_not_allowed`. Call it after the routes are added (the
/// 405 applies to the routes registered before it).
pub fn with_openai_fallbacks<S>(router: axum::Router<S>, what: &'static str) -> axum::Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    router
        .method_not_allowed_fallback(|req: axum::extract::Request| async move {
            ApiError::method_not_allowed(req.method(), req.uri().path())
        })
        .fallback(move |req: axum::extract::Request| async move {
            ApiError::not_found(format!(
                "Unknown {what}: {} {}",
                req.method(),
                req.uri().path()
            ))
        })
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        });
        let mut resp = (self.status, Json(body)).into_response();
        let retry_after = match self.retry_after_secs {
            Some(secs) => Some(secs),
            None if self.status == StatusCode::SERVICE_UNAVAILABLE => Some(1),
            None => None,
        };
        if let Some(secs) = retry_after {
            resp.headers_mut()
                .insert(http::header::RETRY_AFTER, http::HeaderValue::from(secs));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn a_ledger_failure_at_hold_time_is_a_503_with_retry_after() {
        // (PostgreSQL unreachable is `LedgerError::Database`; every ledger failure before the
        // request is forwarded maps the same way)
        let api = ApiError::from(&MeterError::Ledger(LedgerError::Corrupt("accounts")));
        assert_eq!(api.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(api.code, "ledger_unavailable");
        let resp = api.into_response();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()[http::header::RETRY_AFTER], "1");
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap()
            .to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["error"]["code"], "ledger_unavailable");
        assert_eq!(json["error"]["type"], "api_error");
    }

    #[test]
    fn embeddings_refusals_are_400_with_their_param_and_a_cut_answer_502() {
        let api = ApiError::from(&MeterError::EmbeddingsRefused {
            param: "dimensions",
            message: "no".to_owned(),
        });
        assert_eq!(
            (api.status, api.kind, api.param.as_deref()),
            (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("dimensions")
            )
        );
        let api = ApiError::from(&MeterError::EmbeddingsTooLarge { limit_bytes: 9 });
        assert_eq!(
            (api.status, api.code),
            (StatusCode::BAD_GATEWAY, "response_too_large")
        );
        assert!(!api.message.contains("stream\":"), "{}", api.message);
    }

    #[test]
    fn a_ledger_behind_the_traffic_is_a_503_and_an_account_over_its_share_a_429() {
        let full = ApiError::from(&MeterError::SettlementsBehind { limit: 1_024 });
        assert_eq!(
            (full.status, full.kind, full.code, full.retry_after_secs),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "server_busy",
                None
            )
        );
        let resp =
            ApiError::from(&MeterError::AccountSettlementsBehind { limit: 256 }).into_response();
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers()[http::header::RETRY_AFTER], "1");
        let share = ApiError::from(&MeterError::AccountSettlementsBehind { limit: 256 });
        assert_eq!(
            (share.kind, share.code),
            ("requests", "rate_limit_exceeded")
        );
        assert_eq!(
            share.message,
            "this account has 256 requests waiting for their hold or settlement; retry shortly"
        );
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        use std::time::Duration;
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::ZERO), 1);
        assert_eq!(ceil_secs(Duration::from_millis(2001)), 3);
    }
}
