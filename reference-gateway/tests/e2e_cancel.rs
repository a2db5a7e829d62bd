//! A caller that leaves mid-stream, end to end against the real engine: `reference-gateway` →
//! TLS tunnel → `reference-agent` → llama.cpp `llama-server`. The request settles
//! `client_cancelled` with the prompt plus exactly the tokens delivered, and the engine stops
//! generating within 1 s (its `GET /slots` shows no slot processing).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod common;

use std::time::{Duration, Instant};

use common::{cost, EngineCounter, Gateway};
use futures_util::StreamExt as _;
use serde_json::{json, Value};
use spine_meter::sse::SseParser;
use spine_test_support::{Engine, LlamaServer};

async fn slots_busy(http: &reqwest::Client, llama_url: &str) -> usize {
    let slots: Value = http
        .get(format!("{llama_url}/slots"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    slots
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["is_processing"] == true)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caller_gone_mid_stream_pays_prompt_plus_delivered_and_the_engine_stops() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    let s = common::setup(&gw, dir.path(), &llama.url).await;
    let counter = EngineCounter {
        url: llama.url.clone(),
        http: reqwest::Client::new(),
    };
    let http = reqwest::Client::new();
    let messages = json!([{"role": "user", "content": "Write a long story about a dragon."}]);

    let resp = http
        .post(format!("{}/v1/chat/completions", gw.public))
        .bearer_auth(&s.api_key)
        .json(
            &json!({"model": "smollm2", "stream": true, "max_tokens": 1000, "ignore_eos": true,
                      "temperature": 0, "messages": messages}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let request_id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();

    // read until six pieces of content arrived, parsing events as they complete
    let mut body = resp.bytes_stream();
    let mut parser = SseParser::new();
    let mut events = Vec::new();
    let mut text = String::new();
    let mut pieces = 0;
    let mut first_piece = None;
    while pieces < 6 {
        let chunk = body.next().await.unwrap().unwrap();
        parser.feed(&chunk, &mut events).unwrap();
        for ev in events.drain(..) {
            let Ok(v) = serde_json::from_str::<Value>(ev.data()) else {
                continue;
            };
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                text.push_str(c);
                pieces += 1;
                first_piece.get_or_insert_with(Instant::now);
            }
        }
    }
    // llama.cpp notices a closed connection when it next sends a token: on a loaded machine the
    // bound is two token intervals when that is more than 1 s
    let token_interval = first_piece.unwrap().elapsed() / 5;
    let bound = Duration::from_secs(1).max(token_interval * 2);
    assert_eq!(
        slots_busy(&http, &llama.url).await,
        1,
        "the engine is generating"
    );
    // the caller leaves
    drop(body);
    let left = Instant::now();
    loop {
        if slots_busy(&http, &llama.url).await == 0 {
            break;
        }
        assert!(
            left.elapsed() < bound,
            "the engine still generates {:?} after the caller left (tokens every {token_interval:?})",
            left.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stopped_after = left.elapsed();

    let rec = gw.record(&request_id).await;
    let prompt = counter.prompt(&messages).await;
    let delivered = counter.tokens(&text).await;
    assert_eq!(rec["outcome"], "client_cancelled", "{rec}");
    assert_eq!(
        rec["billed"]["prompt_tokens"].as_u64(),
        Some(prompt),
        "{rec}"
    );
    assert_eq!(
        rec["billed"]["completion_tokens"].as_u64(),
        Some(delivered),
        "delivered {text:?}: {rec}"
    );
    let (c, o, f) = cost(prompt, delivered);
    assert_eq!(rec["cost_micros"].as_u64(), Some(c), "{rec}");
    assert_eq!(rec["debit_micros"].as_u64(), Some(c), "{rec}");
    assert_eq!(rec["operator_credit_micros"].as_u64(), Some(o), "{rec}");
    assert_eq!(rec["fee_micros"].as_u64(), Some(f), "{rec}");
    assert_eq!(gw.balance(&s.account).await, (common::CREDITS - c, 0));
    eprintln!(
        "cancelled after {delivered} delivered tokens; engine idle {stopped_after:?} after the caller left (tokens every {token_interval:?})"
    );
}
