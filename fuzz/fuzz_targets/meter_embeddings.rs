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

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use libfuzzer_sys::fuzz_target;
use spine_core::{BoxBody, BoxError, NodeId, RequestId};
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
        // the first byte sets the read size
        let step = usize::from(data.first().copied().unwrap_or(1)).max(1);
        let reads: Vec<Bytes> = data.chunks(step).map(Bytes::copy_from_slice).collect();
        let node = tower::service_fn(move |_req: http::Request<BoxBody>| {
            let reads = reads.clone();
            async move {
                let frames = futures_util::stream::iter(
                    reads
                        .into_iter()
                        .map(|b| Ok::<_, BoxError>(http_body::Frame::data(b))),
                );
                let mut resp = http::Response::new(BoxBody::new(StreamBody::new(frames)));
                resp.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/json"),
                );
                resp.extensions_mut().insert(NodeId::from("n"));
                Ok::<_, BoxError>(resp)
            }
        });
        let body = br#"{"model":"m","input":["hello there","a"]}"#;
        let mut req = http::Request::post("/v1/embeddings")
            .body(BoxBody::new(
                http_body_util::Full::new(Bytes::from_static(body)).map_err(|never| match never {}),
            ))
            .expect("request");
        req.extensions_mut().insert(RequestId::from("r"));
        req.extensions_mut().insert(account.clone());
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
