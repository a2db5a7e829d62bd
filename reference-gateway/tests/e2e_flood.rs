//! Issue 13's zero-credit flood, measured through the real binaries (gateway → TLS tunnel →
//! agent → a fake engine answering at once): paid requests' latency alone, then with three
//! zero-credit senders of 4 MiB prompts beside them, side by side in one run. A measurement,
//! not a check of the machine's speed: `#[ignore]`d in CI; run with
//! `cargo test -p reference-gateway --test e2e_flood -- --ignored --nocapture`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{add_node, fake_llama_meta, full, serve_fake_engine, tenant, Gateway};
use serde_json::{json, Value};
use spine_test_support::Engine;

async fn paid_latencies(gw: &Gateway, key: &str, n: usize) -> Vec<Duration> {
    let body =
        json!({"model":"smollm2","max_tokens":8,"messages":[{"role":"user","content":"Say hi."}]});
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let resp = gw.api_post(key, "/v1/chat/completions", &body).await;
        assert_eq!(resp.status(), 200);
        let _ = resp.bytes().await.unwrap();
        out.push(t.elapsed());
    }
    out.sort();
    out
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: cargo test -p reference-gateway --test e2e_flood -- --ignored --nocapture"]
async fn paid_latency_with_and_without_a_zero_credit_flood() {
    let engine = Engine::discover().unwrap();
    let (url, _task) = serve_fake_engine(|req: hyper::Request<hyper::body::Incoming>| async move {
        if let Some(meta) = fake_llama_meta(req.uri().path()) {
            return Ok(meta);
        }
        use http_body_util::BodyExt as _;
        let _ = req.into_body().collect().await;
        let answer = json!({"id":"c","object":"chat.completion","created":1,"model":"smollm2",
            "choices":[{"index":0,"message":{"role":"assistant","content":"Hi!"},"finish_reason":"stop"}]});
        Ok(full(200, "application/json", answer.to_string()))
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let gw = Arc::new(Gateway::start(dir.path(), &engine).await);
    let t = tenant(&gw).await;
    let (_node, _agent) = add_node(&gw, dir.path(), &t.operator, &url, "node").await;
    let (s, broke) = gw.admin_post("/admin/v1/accounts", json!({})).await;
    assert_eq!(s, 201);
    let broke = broke["id"].as_str().unwrap().to_owned();
    let (_, key) = gw
        .admin_post(&format!("/admin/v1/accounts/{broke}/keys"), json!({}))
        .await;
    let broke_key = key["key"].as_str().unwrap().to_owned();
    let _ = paid_latencies(&gw, &t.api_key, 20).await; // warm up
    let alone = paid_latencies(&gw, &t.api_key, 300).await;
    // three senders of 4 MiB prompts from an account with nothing
    let stop = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(AtomicU64::new(0));
    let prompt =
        "The quick brown fox jumps over the lazy dog. ".repeat((4 * 1024 * 1024 - 1024) / 45);
    let big: Value =
        json!({"model":"smollm2","max_tokens":8,"messages":[{"role":"user","content":prompt}]});
    let senders: Vec<_> = (0..3)
        .map(|_| {
            let (gw, key, big, stop, refused) = (
                gw.clone(),
                broke_key.clone(),
                big.clone(),
                stop.clone(),
                refused.clone(),
            );
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let resp = gw.api_post(&key, "/v1/chat/completions", &big).await;
                    assert_eq!(resp.status(), 402);
                    refused.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let flood_start = Instant::now();
    let flooded = paid_latencies(&gw, &t.api_key, 300).await;
    stop.store(true, Ordering::Relaxed);
    for s in senders {
        s.await.unwrap();
    }
    let refused = refused.load(Ordering::Relaxed);
    eprintln!(
        "paid chat, ms: alone p50 {:.2} p99 {:.2}; beside 3 zero-credit senders of 4 MiB prompts p50 {:.2} p99 {:.2} ({refused} refused, {:.0} refused/s)",
        pct(&alone, 0.5),
        pct(&alone, 0.99),
        pct(&flooded, 0.5),
        pct(&flooded, 0.99),
        refused as f64 / flood_start.elapsed().as_secs_f64()
    );
    assert!(refused > 0);
}
