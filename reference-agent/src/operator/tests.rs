#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;

#[test]
fn status_text_for_an_owner() {
    let v = json!({"node_id": "node_2", "name": "desk", "operator_id": "op_1",
        "connected": true, "routable": true, "models": ["smollm2"],
        "unlisted_models": ["llama3:8b"], "catalog_models": ["smollm2"], "in_flight": 1,
        "requests_served": 1, "earned_micros": 9, "operator_earned_micros": 1_234_567});
    assert_eq!(
        format_status(&v),
        "Node node_2 \"desk\" (operator op_1)\n\
             \x20 connection:  connected, routable (receiving requests)\n\
             \x20 models:      smollm2\n\
             \x20 not routed:  llama3:8b (not in the gateway's catalog: smollm2)\n\
             \x20 in flight:   1\n\
             \x20 served:      1 request\n\
             \x20 earned:      0.000009 by this node; 1.234567 by the operator in total (credits)\n"
    );
    let v = json!({"node_id": "node_2", "operator_id": "op_1", "connected": false,
        "routable": false, "models": [], "requests_served": 0});
    let text = format_status(&v);
    assert!(text.contains("NOT CONNECTED"), "{text}");
    assert!(text.contains("none routable"), "{text}");
    assert!(text.contains("0 requests"), "{text}");
    let v = json!({"node_id": "node_2", "operator_id": "op_1", "connected": true,
        "routable": true, "models": ["smollm2"], "requests_served": 3,
        "audit": [{"model": "smollm2", "verdict": "failed", "tokens_audited": 61,
            "events": 9, "statistic": 9.3, "fail_threshold": 9.2}]});
    let text = format_status(&v);
    assert!(
        text.contains("audit:       smollm2 failed (NOT ROUTED: the audit found another model; fix the weights, then ask the gateway's operator to re-verify); 61 tokens audited, 9 disagreed, statistic 9.30 (fails at 9.20)"),
        "{text}"
    );
}

#[test]
fn engine_urls_and_amounts() {
    assert_eq!(format_micros(0), "0.000000");
    assert_eq!(format_micros(1_000_000), "1.000000");
    assert!(parse_engine_url("http://127.0.0.1:8080").is_ok());
    assert!(parse_engine_url("https://127.0.0.1:8080").is_err());
    assert!(parse_engine_url("127.0.0.1:8080").is_err());
    assert_eq!(
        default_engine_url(EngineArg::Ollama),
        "http://127.0.0.1:11434"
    );
    assert_eq!(engine_arg(EngineKind::Sglang), EngineArg::Sglang);
}
