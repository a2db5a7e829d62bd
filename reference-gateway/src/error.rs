//! OpenAI-shaped errors: `{"error":{"message","type","param","code"}}` with the right status.
//!
//! Only this binary maps library errors to HTTP statuses (STYLE.md, Errors).

use axum::response::{IntoResponse, Response};
use axum::Json;
use http::StatusCode;
use serde_json::json;
use spine_core::BoxError;
use spine_meter::meter::MeterError;
use spine_meter::LedgerError;
use spine_router::cluster::RelayError;
use spine_router::RouteError;
use spine_transport::TunnelError;

/// An error as the caller sees it.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) kind: &'static str,
    pub(crate) code: &'static str,
    pub(crate) message: String,
    /// `Retry-After`, seconds: set on 429s; 503s get 1 when unset.
    pub(crate) retry_after_secs: Option<u64>,
    /// OpenAI's `param`: the request field at fault, when one is.
    pub(crate) param: Option<String>,
}

impl ApiError {
    pub(crate) fn new(
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
    pub(crate) fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// 429 in OpenAI's shape: `type` is the limit hit (`requests` or `tokens`), `code`
    /// `rate_limit_exceeded`, with `Retry-After` when waiting helps.
    pub(crate) fn rate_limited(
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

    pub(crate) fn invalid_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }

    pub(crate) fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
        )
    }

    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            message,
        )
    }

    /// 503 `no_capacity`: the node picked (and any retried) had no free stream. The internal
    /// node id stays out of the caller's answer.
    fn nodes_full() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "api_error",
            "no_capacity",
            "every node that could serve this request is at its concurrency limit; try again later",
        )
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            "internal_error",
            message,
        )
    }

    /// Maps an error from the spine service stack (meter → route → tunnel).
    pub(crate) fn from_stack(err: &BoxError) -> Self {
        if let Some(e) = err.downcast_ref::<MeterError>() {
            return Self::from_meter(e);
        }
        if let Some(e) = err.downcast_ref::<RouteError>() {
            return match e {
                RouteError::NoNodeForModel(m) => Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "api_error",
                    "no_capacity",
                    format!("no node serving model '{m}' is connected right now; try again later"),
                ),
                RouteError::AtCapacity(m) => Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "api_error",
                    "no_capacity",
                    format!("every node serving model '{m}' is busy; try again later"),
                ),
                RouteError::QueueFull { model, retry_after } => Self {
                    retry_after_secs: Some(ceil_secs(*retry_after)),
                    ..Self::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "api_error",
                        "queue_full",
                        format!(
                            "every node serving model '{model}' is busy and the queue for it is full; try again later"
                        ),
                    )
                },
                RouteError::QueueTimeout {
                    model,
                    waited,
                    retry_after,
                } => Self {
                    retry_after_secs: Some(ceil_secs(*retry_after)),
                    ..Self::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "api_error",
                        "queue_timeout",
                        format!(
                            "every node serving model '{model}' stayed busy for {} s; try again later",
                            waited.as_secs()
                        ),
                    )
                },
                RouteError::ContextLengthExceeded { .. } => {
                    Self::invalid_request("context_length_exceeded", e.to_string())
                        .with_param("messages")
                }
                RouteError::Unsupported { model, kind } => Self::invalid_request(
                    "unsupported_endpoint",
                    format!(
                        "no node serving model '{model}' answers {}; use an endpoint the model supports",
                        kind.path()
                    ),
                ),
                RouteError::FirstContentTimeout(d) => Self::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "api_error",
                    "node_timeout",
                    format!(
                        "no node started answering within {} s; try again later",
                        d.as_secs()
                    ),
                ),
                // a body error: the meter ends the caller's stream with its error event; this
                // arm is for completeness (no head is ever built from it)
                RouteError::StreamIdleTimeout(d) => Self::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "api_error",
                    "node_timeout",
                    format!(
                        "the node sent nothing for {} s after the response began",
                        d.as_secs()
                    ),
                ),
                _ => Self::internal(e.to_string()),
            };
        }
        if let Some(e) = err.downcast_ref::<TunnelError>() {
            if e.is_node_full() || e.is_stream_refused() {
                // refused before any byte went down the tunnel
                return Self::nodes_full();
            }
            return Self::new(
                StatusCode::BAD_GATEWAY,
                "api_error",
                "node_failure",
                format!("the node failed before responding: {e}"),
            );
        }
        if let Some(e) = err.downcast_ref::<spine_router::cluster::ClusterError>() {
            // multi-instance mode: the node's instance was gone or refused, before any byte
            if matches!(e, spine_router::cluster::ClusterError::NodeFull) {
                return Self::nodes_full();
            }
            return Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "api_error",
                "node_unavailable",
                format!("no node could take the request: {e}"),
            );
        }
        if let Some(e) = err.downcast_ref::<spine_router::DirectoryError>() {
            // multi-instance mode: the directory no longer knew the node, before any byte
            return Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "api_error",
                "node_unavailable",
                format!("no node could take the request: {e}"),
            );
        }
        // Anything else came up from below the router: a node's body that broke before its
        // first token on the last attempt (hyper's "error reading a body from connection"), an
        // I/O error of the node's stream. Every such failure is the node's, before the first
        // byte: 502 `node_failure`, never a 500 with the library's message.
        Self::new(
            StatusCode::BAD_GATEWAY,
            "api_error",
            "node_failure",
            "the node failed before its answer began; try again",
        )
    }

    fn from_meter(e: &MeterError) -> Self {
        match e {
            MeterError::BadRequest(
                inner @ spine_core::PeekError::UnsupportedParameter { field },
            ) => Self::invalid_request("unsupported_parameter", inner.to_string())
                .with_param(field.to_string()),
            MeterError::BadRequest(
                inner @ spine_core::PeekError::UnrecognizedArgument { param },
            ) => Self::invalid_request("unsupported_parameter", inner.to_string())
                .with_param(param.clone()),
            MeterError::BadRequest(inner @ spine_core::PeekError::InvalidMessage { path, .. }) => {
                Self::invalid_request("invalid_request", inner.to_string()).with_param(path.clone())
            }
            MeterError::BadRequest(inner @ spine_core::PeekError::InvalidField { field, .. }) => {
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
            MeterError::AnswerTooLarge { .. } => Self::new(
                StatusCode::BAD_GATEWAY,
                "server_error",
                "response_too_large",
                e.to_string(),
            ),
            MeterError::BodiesOverBudget { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "server_busy",
                e.to_string(),
            ),
            MeterError::AccountBodiesOverBudget { .. } => {
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
                refusal
                    .retry_after
                    .map(|d| (d.as_secs() + u64::from(d.subsec_nanos() > 0)).max(1)),
            ),
            _ => Self::invalid_request("invalid_request", with_sources(e)),
        }
    }
}

/// A ledger error as the admin and enrollment handlers answer it: 404 for an unknown id, 409
/// for a duplicate or a reused idempotency key, 400 out of range, else 503 (logged).
pub(crate) fn ledger_error(e: LedgerError) -> ApiError {
    match e {
        LedgerError::UnknownAccount(id) => ApiError::not_found(format!("no account '{id}'")),
        LedgerError::UnknownOperator(id) => ApiError::not_found(format!("no operator '{id}'")),
        LedgerError::UnknownNode(id) => ApiError::not_found(format!("no node '{id}'")),
        LedgerError::Duplicate { what } => ApiError::new(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "conflict",
            format!("{what} already exists"),
        ),
        LedgerError::IdempotencyConflict { .. } => ApiError::new(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "idempotency_conflict",
            format!("{e}: the key was already used for another account or amount"),
        ),
        LedgerError::OutOfRange => ApiError::invalid_request("out_of_range", e.to_string()),
        other => {
            tracing::error!(error = %other, "ledger error");
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "api_error",
                "ledger_unavailable",
                "the ledger is unavailable",
            )
        }
    }
}

/// Whole seconds, rounded up, at least 1 (`Retry-After`).
fn ceil_secs(d: std::time::Duration) -> u64 {
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

/// The internal listener's answer to a [`RelayError`] (multi-instance mode): its status in
/// OpenAI's error shape; `spine_router::cluster::serve_internal` adds `x-spine-refusal`.
pub(crate) fn relay_error_response(e: &RelayError) -> http::Response<spine_core::BoxBody> {
    use http_body_util::BodyExt as _;
    // the status is the instances' protocol (the library's); the type follows it
    let status = e.status();
    let kind = if status.is_server_error() {
        "api_error"
    } else {
        "invalid_request_error"
    };
    let message = match e {
        RelayError::NodeFailure(source) => format!("{e}: {source}"),
        _ => e.to_string(),
    };
    ApiError::new(status, kind, e.code(), message)
        .into_response()
        .map(|b| spine_core::BoxBody::new(b.map_err(BoxError::from)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The internal listener's answers: the library's protocol status (the forwarder reads 413
    /// as "over the owner's body limit"), OpenAI's error shape, the error's code.
    #[tokio::test]
    async fn relay_errors_are_answered_with_their_protocol_status_in_openai_shape() {
        use http_body_util::BodyExt as _;
        use spine_router::cluster::RelayRefusal;
        let cases = [
            (
                RelayError::Refused(RelayRefusal::TooLarge),
                413,
                "invalid_request_error",
            ),
            (
                RelayError::Refused(RelayRefusal::BadSignature),
                401,
                "invalid_request_error",
            ),
            (
                RelayError::Refused(RelayRefusal::ReplayCacheFull),
                503,
                "api_error",
            ),
            (
                RelayError::Refused(RelayRefusal::BodyError),
                400,
                "invalid_request_error",
            ),
            (RelayError::MissingNodeId, 400, "invalid_request_error"),
            (RelayError::MethodNotAllowed, 405, "invalid_request_error"),
            (RelayError::NodeMoved, 503, "api_error"),
            (RelayError::NodeFull, 503, "api_error"),
        ];
        for (e, status, kind) in cases {
            let resp = relay_error_response(&e);
            assert_eq!(resp.status().as_u16(), status, "{e}");
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["error"]["type"], kind, "{e}");
            assert_eq!(v["error"]["code"], e.code(), "{e}");
        }
    }

    /// The class behind "500 error reading a body from connection": whatever error the stack
    /// returns that is not the gateway's own (a node's broken body, an I/O error) is the node's
    /// failure before the first byte, 502 `node_failure`, with no library message.
    #[test]
    fn an_unrecognised_stack_error_is_a_502_node_failure() {
        let errors: Vec<BoxError> = vec![
            Box::new(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "error reading a body from connection",
            )),
            "stream broke".into(),
        ];
        for err in errors {
            let api = ApiError::from_stack(&err);
            assert_eq!(api.status, StatusCode::BAD_GATEWAY);
            assert_eq!((api.kind, api.code), ("api_error", "node_failure"));
            assert_eq!(
                api.message,
                "the node failed before its answer began; try again"
            );
        }
        // a wiring bug stays a 500
        let err: BoxError = Box::new(RouteError::MissingPeek);
        assert_eq!(
            ApiError::from_stack(&err).status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    #[tokio::test]
    async fn a_ledger_failure_at_hold_time_is_a_503_with_retry_after() {
        // (PostgreSQL unreachable is `LedgerError::Database`; every ledger failure before the
        // request is forwarded maps the same way)
        let err: BoxError = Box::new(MeterError::Ledger(spine_meter::LedgerError::Corrupt(
            "accounts",
        )));
        let api = ApiError::from_stack(&err);
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
}
