//! The metering layer on a hostile node's embeddings answer: arbitrary bytes (in arbitrary
//! reads) answered as `application/json` to `POST /v1/embeddings` go through `MeterLayer` over
//! an in-memory ledger. Whatever the node sends, the caller gets one JSON object: either
//! OpenAI's embeddings list with OpenAI's members only (`object`, `data` items of `object`,
//! `index`, `embedding`, `model`, `usage`) or OpenAI's error shape, or the layer refuses the
//! answer with a `MeterError` (which the gateway answers in that shape); nothing panics, and the
//! request settles with nothing held.
//!
//! Needs the SmolLM2 GGUF like `token_count`.
#![no_main]
mod common;

use libfuzzer_sys::fuzz_target;
use spine_meter::meter::MeterError;

fuzz_target!(|data: &[u8]| {
    let body = br#"{"model":"m","input":["hello there","a"]}"#;
    common::meter_once(
        data,
        "application/json",
        "/v1/embeddings",
        body,
        |outcome| {
            // a refused answer is a `MeterError`, which the gateway answers in OpenAI's error shape
            // (`openai_error::ApiError::from`, tested there)
            let (status, out) = match outcome {
                Ok(answer) => answer,
                Err(e) => {
                    assert!(
                        e.downcast_ref::<MeterError>().is_some(),
                        "not a MeterError: {e}"
                    );
                    return;
                }
            };
            let v: serde_json::Value =
                serde_json::from_slice(&out).unwrap_or_else(|e| panic!("{e}: {out:?}"));
            let object = v.as_object().unwrap_or_else(|| panic!("{v}"));
            if status.is_success() {
                assert!(
                    object
                        .keys()
                        .all(|k| ["object", "data", "model", "usage"].contains(&k.as_str())),
                    "{v}"
                );
                for item in v["data"].as_array().unwrap_or_else(|| panic!("{v}")) {
                    let item = item.as_object().unwrap_or_else(|| panic!("{v}"));
                    assert!(
                        item.keys()
                            .all(|k| ["object", "index", "embedding"].contains(&k.as_str())),
                        "{v}"
                    );
                }
            } else {
                assert!(v["error"].is_object(), "{status}: {v}");
            }
        },
    );
});
