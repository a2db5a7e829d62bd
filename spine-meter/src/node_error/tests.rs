use super::*;

fn classify(status: u16, body: &str) -> NodeError {
    let status = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::IM_A_TEAPOT);
    NodeError::classify(status, body.as_bytes())
}

#[test]
fn engine_errors_are_classified_as_clients_branch_on_them() {
    // llama.cpp (the pinned server's own words and type)
    assert!(matches!(
        classify(
            400,
            r#"{"error":{"code":400,"message":"request (9000 tokens) exceeds the available context size (2048 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9000,"n_ctx":2048}}"#
        ),
        NodeError::ContextLengthExceeded { .. }
    ));
    // vLLM
    assert_eq!(
        classify(
            400,
            r#"{"object":"error","message":"This model's maximum context length is 2048 tokens. However, you requested 9000 tokens.","type":"BadRequestError","param":null,"code":400}"#
        ),
        NodeError::ContextLengthExceeded {
            message: "This model's maximum context length is 2048 tokens. However, you requested 9000 tokens.".into()
        }
    );
    assert_eq!(
        classify(
            400,
            r#"{"object":"error","message":"max_tokens must be at least 1","type":"BadRequestError"}"#
        ),
        NodeError::Rejected {
            status: http::StatusCode::BAD_REQUEST,
            message: "max_tokens must be at least 1".into()
        }
    );
    let unsupported = classify(
        501,
        r#"{"error":{"code":501,"message":"tools param requires --jinja flag","type":"not_supported_error"}}"#,
    );
    assert_eq!(
        unsupported.to_string(),
        "the node's engine does not support this request: tools param requires --jinja flag"
    );
    assert!(matches!(
        classify(422, "{}"),
        NodeError::Rejected { status, .. } if status.as_u16() == 422
    ));
    assert_eq!(
        classify(500, "boom").to_string(),
        "the node's engine failed (500 Internal Server Error): boom"
    );
    // a 5xx that mentions the context is still the node's failure
    assert!(matches!(
        classify(500, "context size"),
        NodeError::Failed { .. }
    ));
}

#[test]
fn a_long_message_is_cut_at_a_char_boundary() {
    let body = format!(r#"{{"error":{{"message":"{}"}}}}"#, "é".repeat(1000));
    let NodeError::Failed { message, .. } = classify(502, &body) else {
        unreachable!("a 502 is the node's failure")
    };
    assert!(message.ends_with('…'));
    assert!(message.len() <= MAX_NODE_MESSAGE_BYTES + '…'.len_utf8());
}
