//! Faults end to end (issue 14): a real gateway and real agents over real tunnels, in front of
//! fake engines that speak real HTTP and misbehave where a real engine cannot be made to, and
//! real llama.cpp engines stopped with SIGSTOP.
//!
//! - a stream that breaks before its first token, with no other node: the caller gets the
//!   documented 502 `node_failure`, never a 500, and pays nothing;
//! - a hung engine (SIGSTOP) with its slots full leaves routing within the stated bound, and
//!   later requests are served by the other node.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    missing_docs
)]

mod common;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    add_node, fake_llama_meta, full, serve_fake_engine, sse, tenant, FakeBody, Gateway, CREDITS,
};
use http_body_util::BodyExt as _;
use hyper::body::{Frame, Incoming};
use serde_json::{json, Value};
use spine_test_support::{Engine, LlamaServer};

const ROLE_CHUNK: &str = "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"smollm2\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null},\"finish_reason\":null}]}\n\n";

/// A fake llama-server whose chat streams send the role chunk and then break (the connection
/// is cut) before any token. Counts the chat requests.
async fn break_before_first_token(
    chats: Arc<AtomicU64>,
    req: hyper::Request<Incoming>,
) -> Result<hyper::Response<FakeBody>, Infallible> {
    let path = req.uri().path().to_owned();
    let _ = req.into_body().collect().await;
    if let Some(meta) = fake_llama_meta(&path) {
        return Ok(meta);
    }
    Ok(match path.as_str() {
        "/v1/chat/completions" => {
            chats.fetch_add(1, Ordering::SeqCst);
            let frames: Vec<Result<Frame<Bytes>, std::io::Error>> = vec![
                Ok(Frame::data(Bytes::from_static(ROLE_CHUNK.as_bytes()))),
                Err(std::io::Error::other("engine crashed")),
            ];
            let stream = futures_util::stream::unfold(frames.into_iter(), |mut rest| async move {
                let next = rest.next()?;
                tokio::time::sleep(Duration::from_millis(100)).await;
                Some((next, rest))
            });
            sse(stream)
        }
        _ => full(404, "application/json", r#"{"error":"not found"}"#.into()),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_broken_before_its_first_token_is_a_502_not_a_500() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let chats = Arc::new(AtomicU64::new(0));
    let counter = chats.clone();
    let (url, task) =
        serve_fake_engine(move |req| break_before_first_token(counter.clone(), req)).await;
    let gw = Gateway::start(dir.path(), &engine).await;
    let t = tenant(&gw).await;
    let (_node, _agent) = add_node(&gw, dir.path(), &t.operator, &url, "broken").await;
    for stream in [true, false] {
        let resp = gw
            .api_post(
                &t.api_key,
                "/v1/chat/completions",
                &json!({"model":"smollm2","max_tokens":8,"stream":stream,
                        "messages":[{"role":"user","content":"hi"}]}),
            )
            .await;
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap();
        assert_eq!(status, 502, "stream={stream}: {body}");
        assert_eq!(body["error"]["code"], "node_failure", "{body}");
        assert_eq!(body["error"]["type"], "api_error", "{body}");
        assert!(
            !body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("error reading a body"),
            "{body}"
        );
    }
    // one node: each request reached it once (no other node to retry on)
    assert_eq!(chats.load(Ordering::SeqCst), 2);
    // nothing charged, nothing held
    assert_eq!(gw.balance_once_released(&t.account).await, (CREDITS, 0));
    task.abort();
}

/// `kill -<signal> <pid>`.
fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} {pid}");
}

/// A process stopped with SIGSTOP, continued (SIGCONT) when dropped, so a failing test never
/// leaves a stopped engine behind.
struct Stopped(u32);

impl Stopped {
    fn stop(pid: u32) -> Self {
        signal(pid, "STOP");
        Self(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .arg("-CONT")
            .arg(self.0.to_string())
            .status();
    }
}

async fn routable(gw: &Gateway, node: &str) -> bool {
    let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
    nodes["data"]
        .as_array()
        .is_some_and(|a| a.iter().any(|n| n["node_id"] == node))
}

/// A long streamed chat, read up to its first token; the response is
/// returned still streaming.
async fn long_stream(gw: &Gateway, key: &str) -> reqwest::Response {
    let mut resp = gw
        .api_post(
            key,
            "/v1/chat/completions",
            // the end tokens banned: it runs to max_tokens, holding its slot (a model that
            // stopped early freed one and failed the slots-full precondition once)
            &json!({"model":"smollm2","stream":true,"max_tokens":1500,
                    "logit_bias":{"0":-100,"2":-100},
                    "messages":[{"role":"user","content":"Count from 1 to 1000, one number per line."}]}),
        )
        .await;
    if resp.status() != 200 {
        panic!("{}: {}", resp.status(), resp.text().await.unwrap());
    }
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("\"content\":\"") {
        let chunk = tokio::time::timeout(Duration::from_secs(120), resp.chunk())
            .await
            .expect("first token in time")
            .unwrap()
            .expect("stream open");
        seen.extend_from_slice(&chunk);
    }
    resp
}

/// SIGSTOP of a node's engine with its slots full (issue 14): the node leaves routing within the
/// stated bound (`node_stall_timeout_secs` 5 s + 1 s + 5 s probe = 11 s; asserted ≤ 15 s), later
/// requests are served by the other node without waiting, and after SIGCONT the node comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_engine_with_full_slots_leaves_routing_within_15_s() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let llama_a = LlamaServer::start(&engine, 2).await.unwrap();
    let llama_b = LlamaServer::start(&engine, 2).await.unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    let t = tenant(&gw).await;
    // node A alone first, so that its two slots (agent --max-concurrency 2) fill with streams
    let (node_a, _agent_a) = add_node(&gw, dir.path(), &t.operator, &llama_a.url, "a").await;
    let stuck_1 = long_stream(&gw, &t.api_key).await;
    let stuck_2 = long_stream(&gw, &t.api_key).await;
    let (node_b, _agent_b) = add_node(&gw, dir.path(), &t.operator, &llama_b.url, "b").await;
    let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
    let a_in_flight = nodes["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node_id"] == node_a.as_str())
        .map(|n| n["in_flight"].clone());
    assert_eq!(a_in_flight, Some(json!(2)), "{nodes}");

    // the engine hangs mid-generation
    let stopped = Stopped::stop(llama_a.child.id().unwrap());
    let hung_at = Instant::now();
    while routable(&gw, &node_a).await {
        assert!(
            hung_at.elapsed() < Duration::from_secs(60),
            "node A still routable 60 s after its engine hung"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let left_after = hung_at.elapsed();
    println!("hung node left routing after {left_after:?}");
    assert!(left_after <= Duration::from_secs(15), "{left_after:?}");
    assert!(routable(&gw, &node_b).await);

    // later requests go to node B, with no wait for node A
    for _ in 0..3 {
        let started = Instant::now();
        let resp = gw
            .api_post(
                &t.api_key,
                "/v1/chat/completions",
                &json!({"model":"smollm2","max_tokens":4,
                        "messages":[{"role":"user","content":"Say hi."}]}),
            )
            .await;
        let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        assert_eq!(resp.status(), 200);
        let _ = resp.bytes().await;
        let took = started.elapsed();
        println!("request served in {took:?}");
        assert!(took < Duration::from_secs(15), "{took:?}");
        let rec = gw.record(&id).await;
        assert_eq!(rec["node"], node_b.as_str(), "{rec}");
    }

    // the engine resumes: the node comes back once a probe passes (probed every 1 s while out)
    drop(stopped);
    let resumed_at = Instant::now();
    while !routable(&gw, &node_a).await {
        assert!(
            resumed_at.elapsed() < Duration::from_secs(60),
            "node A not back 60 s after SIGCONT"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("node back {:?} after SIGCONT", resumed_at.elapsed());
    drop((stuck_1, stuck_2));
    // nothing stays held once the streams are gone
    let (_, held) = gw.balance_once_released(&t.account).await;
    assert_eq!(held, 0);
}
