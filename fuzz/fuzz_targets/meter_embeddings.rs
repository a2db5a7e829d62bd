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

use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use spine_meter::meter::MeterError;
use tower::{Layer, ServiceExt};

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (layer, ledger, account) = common::metered().await;
        let settlements = layer.settlements();
        let node = common::node_answering(data, "application/json");
        let body = br#"{"model":"m","input":["hello there","a"]}"#;
        let req = common::request("/v1/embeddings", body, &account);
        // a refused answer is a `MeterError`, which the gateway answers in OpenAI's error shape
        // (`openai_error::ApiError::from`, tested there)
        let resp = match layer.layer(node).oneshot(req).await {
            Ok(resp) => Some(resp),
            Err(e) => {
                assert!(
                    e.downcast_ref::<MeterError>().is_some(),
                    "not a MeterError: {e}"
                );
                None
            }
        };
        if let Some(resp) = resp {
            let status = resp.status();
            let out = resp.into_body().collect().await.expect("body").to_bytes();
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
        }
        settlements.drain().await;
        assert_eq!(
            ledger.account(&account).await.expect("balance").held_micros,
            0
        );
    });
});
