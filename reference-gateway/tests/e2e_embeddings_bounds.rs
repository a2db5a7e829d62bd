//! `/v1/embeddings` bounds end to end (a real gateway, a real agent over a real tunnel, a fake
//! hostile engine): what the gateway cannot honestly answer — more than 2,048 inputs, more inputs
//! than an answer of SmolLM2's 576-element vectors can fit the 16 MiB response buffer,
//! `dimensions` other than 576 — is refused 400 before any node is asked and before any hold;
//! what is answered reaches the caller rebuilt from OpenAI's members only.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::{add_node, full, serve_fake_llama, tenant, Gateway, Tenant, CREDITS};
use serde_json::{json, Value};
use spine_test_support::Engine;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_the_gateway_cannot_answer_are_refused_before_the_node_and_extras_stripped() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    let Tenant {
        operator,
        account,
        api_key,
    } = tenant(&gw).await;
    // a hostile engine: one vector per input, with members OpenAI's answer does not have
    let asked = Arc::new(AtomicU64::new(0));
    let counted = asked.clone();
    let (url, _task) = serve_fake_llama(move |path, body| {
        let counted = counted.clone();
        async move {
            if path != "/v1/embeddings" {
                return full(404, "application/json", r#"{"error":"not found"}"#.into());
            }
            let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            if req["input"] != "ping" {
                counted.fetch_add(1, Ordering::SeqCst);
            }
            let inputs = req["input"].as_array().map_or(1, Vec::len);
            let data: Vec<Value> = (0..inputs)
                .map(|i| {
                    json!({"object":"embedding","index":i,"embedding":[0.25,-0.5],
                    "text":"t".repeat(10_000),"<script>":"alert(1)"})
                })
                .collect();
            full(
                200,
                "application/json",
                json!({"object":"list","model":"smollm2","extra":"x".repeat(1000),"data":data,
                    "usage":{"prompt_tokens":inputs,"total_tokens":inputs}})
                .to_string(),
            )
        }
    })
    .await;
    let (_node, _agent) = add_node(&gw, dir.path(), &operator, &url, "hostile").await;

    for (body, param) in [
        (json!({"model":"smollm2","input":vec!["a"; 2049]}), "input"),
        (json!({"model":"smollm2","input":vec!["a"; 1400]}), "input"),
        (
            json!({"model":"smollm2","input":"a","dimensions":4}),
            "dimensions",
        ),
    ] {
        let resp = gw.api_post(&api_key, "/v1/embeddings", &body).await;
        assert_eq!(resp.status(), 400);
        let e: Value = resp.json().await.unwrap();
        assert_eq!(e["error"]["param"], param, "{e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(!message.contains("\"stream\""), "{message}");
    }
    assert_eq!(
        asked.load(Ordering::SeqCst),
        0,
        "a refused request reached the node"
    );
    assert_eq!(gw.balance(&account).await, (CREDITS, 0));

    // answered: OpenAI's members only
    let resp = gw
        .api_post(
            &api_key,
            "/v1/embeddings",
            &json!({"model":"smollm2","input":["red","green"]}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let got: Value = resp.json().await.unwrap();
    let billed = got["usage"]["prompt_tokens"].clone();
    assert_eq!(
        got,
        json!({"object":"list","data":[
                {"object":"embedding","index":0,"embedding":[0.25,-0.5]},
                {"object":"embedding","index":1,"embedding":[0.25,-0.5]}
            ],
            "model":"smollm2","usage":{"prompt_tokens":billed,"total_tokens":billed}})
    );
    assert_eq!(asked.load(Ordering::SeqCst), 1);
}
