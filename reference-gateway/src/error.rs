//! Error mapping: the errors of the crates below the meter (router, tunnel, cluster) in OpenAI's
//! shape ([`ApiError`], `spine_meter::openai_error`, which maps the meter's own errors).
//!
//! Only this binary maps those library errors to HTTP statuses (STYLE.md, Errors).

use http::StatusCode;
use spine_core::BoxError;
use spine_meter::meter::MeterError;
use spine_meter::openai_error::ceil_secs;
pub(crate) use spine_meter::openai_error::ApiError;
use spine_router::cluster::RelayError;
use spine_router::RouteError;
use spine_transport::TunnelError;

/// 503 `no_capacity`: the node picked (and any retried) had no free stream. The internal
/// node id stays out of the caller's answer.
fn nodes_full() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "api_error",
        "no_capacity",
        "every node that could serve this request is at its concurrency limit; try again later",
    )
}

/// Maps an error from the spine service stack (meter → route → tunnel).
pub(crate) fn stack_error(err: &BoxError) -> ApiError {
    if let Some(e) = err.downcast_ref::<MeterError>() {
        return ApiError::from(e);
    }
    if let Some(e) = err.downcast_ref::<RouteError>() {
        return match e {
            RouteError::NoNodeForModel(m) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "api_error",
                "no_capacity",
                format!("no node serving model '{m}' is connected right now; try again later"),
            ),
            RouteError::AtCapacity(m) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "api_error",
                "no_capacity",
                format!("every node serving model '{m}' is busy; try again later"),
            ),
            RouteError::QueueFull { model, retry_after } => ApiError {
                retry_after_secs: Some(ceil_secs(*retry_after)),
                ..ApiError::new(
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
            } => ApiError {
                retry_after_secs: Some(ceil_secs(*retry_after)),
                ..ApiError::new(
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
                ApiError::invalid_request("context_length_exceeded", e.to_string())
                    .with_param("messages")
            }
            RouteError::Unsupported { model, kind } => ApiError::invalid_request(
                "unsupported_endpoint",
                format!(
                    "no node serving model '{model}' answers {}; use an endpoint the model supports",
                    kind.path()
                ),
            ),
            RouteError::SeveralChoicesUnsupported { model, n } => ApiError::invalid_request(
                "unsupported_value",
                format!(
                    "no node serving model '{model}' generates several choices per request (n = {n}); send n = 1"
                ),
            )
            .with_param("n"),
            RouteError::FirstContentTimeout(d) => ApiError::new(
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
            RouteError::StreamIdleTimeout(d) => ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "api_error",
                "node_timeout",
                format!(
                    "the node sent nothing for {} s after the response began",
                    d.as_secs()
                ),
            ),
            _ => ApiError::internal(e.to_string()),
        };
    }
    if let Some(e) = err.downcast_ref::<TunnelError>() {
        if e.is_node_full() || e.is_stream_refused() {
            // refused before any byte went down the tunnel
            return nodes_full();
        }
        return ApiError::new(
            StatusCode::BAD_GATEWAY,
            "api_error",
            "node_failure",
            format!("the node failed before responding: {e}"),
        );
    }
    if let Some(e) = err.downcast_ref::<spine_router::cluster::ClusterError>() {
        // multi-instance mode: the node's instance was gone or refused, before any byte
        if matches!(e, spine_router::cluster::ClusterError::NodeFull) {
            return nodes_full();
        }
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "api_error",
            "node_unavailable",
            format!("no node could take the request: {e}"),
        );
    }
    if let Some(e) = err.downcast_ref::<spine_router::DirectoryError>() {
        // multi-instance mode: the directory no longer knew the node, before any byte
        return ApiError::new(
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
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "api_error",
        "node_failure",
        "the node failed before its answer began; try again",
    )
}

/// The internal listener's answer to a [`RelayError`] (multi-instance mode): its status in
/// OpenAI's error shape; `spine_router::cluster::serve_internal` adds `x-spine-refusal`.
pub(crate) fn relay_error_response(e: &RelayError) -> http::Response<spine_core::BoxBody> {
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
    ApiError::new(status, kind, e.code(), message).into_boxed_response()
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
            let api = stack_error(&err);
            assert_eq!(api.status, StatusCode::BAD_GATEWAY);
            assert_eq!((api.kind, api.code), ("api_error", "node_failure"));
            assert_eq!(
                api.message,
                "the node failed before its answer began; try again"
            );
        }
        // a wiring bug stays a 500
        let err: BoxError = Box::new(RouteError::MissingPeek);
        assert_eq!(stack_error(&err).status, StatusCode::INTERNAL_SERVER_ERROR);
    }

    /// `n` > 1 with only engines that generate one choice: the caller's 400 naming `n`, not a
    /// node failure the SDKs would retry.
    #[test]
    fn several_choices_no_node_generates_is_a_400_on_n() {
        let err: BoxError = Box::new(RouteError::SeveralChoicesUnsupported {
            model: spine_core::ModelId::new("smollm2"),
            n: 3,
        });
        let api = stack_error(&err);
        assert_eq!(api.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            (api.kind, api.code),
            ("invalid_request_error", "unsupported_value")
        );
        assert_eq!(api.param.as_deref(), Some("n"));
        assert!(api.message.contains("n = 3"), "{}", api.message);
    }
}
