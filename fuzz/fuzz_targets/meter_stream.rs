//! The metering layer's egress on a hostile node's stream: arbitrary bytes (in arbitrary reads)
//! answered as `text/event-stream` go through `MeterLayer` over an in-memory ledger. Whatever
//! the node sends, every event the caller gets is one JSON object (a chunk or an error) or
//! `[DONE]` or the gateway's keepalive comment, nothing panics, and the request settles with
//! nothing held.
//!
//! Needs the SmolLM2 GGUF like `token_count`.
#![no_main]
mod common;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let body = br#"{"model":"m","stream":true,"max_tokens":32,"n":2,"messages":[{"role":"user","content":"hi"}]}"#;
    common::meter_once(
        data,
        "text/event-stream",
        "/v1/chat/completions",
        body,
        |outcome| {
            let (_, out) = outcome.expect("response");
            for event in spine_meter::sse::parse_all(&out).expect("the caller's stream parses") {
                let data = event.data();
                assert!(event.is_utf8(), "{out:?}");
                if data == "[DONE]" {
                    continue;
                }
                let v: serde_json::Value =
                    serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data:?}"));
                assert!(v.is_object(), "{data:?}");
                assert!(
                    v.get("error").is_some() || v["choices"].is_array(),
                    "{data:?}"
                );
            }
        },
    );
});
