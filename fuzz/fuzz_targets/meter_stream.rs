//! The metering layer's egress on a hostile node's stream: arbitrary bytes (in arbitrary reads)
//! answered as `text/event-stream` go through `MeterLayer` over an in-memory ledger. Whatever
//! the node sends, every event the caller gets is one JSON object (a chunk or an error) or
//! `[DONE]` or the gateway's keepalive comment, nothing panics, and the request settles with
//! nothing held.
//!
//! Needs the SmolLM2 GGUF like `token_count`.
#![no_main]
mod common;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use libfuzzer_sys::fuzz_target;
use spine_core::{BoxBody, BoxError, NodeId, RequestId};
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
                    http::HeaderValue::from_static("text/event-stream"),
                );
                resp.extensions_mut().insert(NodeId::from("n"));
                Ok::<_, BoxError>(resp)
            }
        });
        let body = br#"{"model":"m","stream":true,"max_tokens":32,"n":2,"messages":[{"role":"user","content":"hi"}]}"#;
        let mut req = http::Request::post("/v1/chat/completions")
            .body(BoxBody::new(
                http_body_util::Full::new(Bytes::from_static(body)).map_err(|never| match never {}),
            ))
            .expect("request");
        req.extensions_mut().insert(RequestId::from("r"));
        req.extensions_mut().insert(account.clone());
        let resp = layer.layer(node).oneshot(req).await.expect("response");
        let out = resp.into_body().collect().await.expect("body").to_bytes();
        for event in spine_meter::sse::parse_all(&out).expect("the caller's stream parses") {
            let data = event.data();
            assert!(event.is_utf8(), "{out:?}");
            if data == "[DONE]" {
                continue;
            }
            let v: serde_json::Value =
                serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data:?}"));
            assert!(v.is_object(), "{data:?}");
            assert!(v.get("error").is_some() || v["choices"].is_array(), "{data:?}");
        }
        settlements.drain().await;
        assert_eq!(ledger.account(&account).await.expect("balance").held_micros, 0);
    });
});
