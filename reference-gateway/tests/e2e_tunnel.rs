//! The tunnel's lifecycle end to end with real processes: `reference-gateway` → TLS tunnel →
//! `reference-agent` → llama.cpp `llama-server`, at the gateway's default keepalive (HTTP/2 PING
//! every 10 s, 5 s timeout).
//!
//! - a frozen agent (SIGSTOP) is detected within 2 × the ping interval, and the stream in flight
//!   ends with an error well before 25 s instead of hanging;
//! - an agent restarted while its old session lingers (the old process frozen, so no close
//!   reaches the gateway) takes over and is routable again within 5 s (its health probe through
//!   the tunnel passed), with one session;
//! - SIGTERM drains: the stream in flight completes, then the agent exits and the node leaves.
//!
//! Cancellation on the real engine (the engine stops within 1 s of the caller leaving) is
//! `e2e_cancel.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod common;

use std::time::{Duration, Instant};

use common::Gateway;
use futures_util::StreamExt as _;
use serde_json::{json, Value};
use spine_test_support::{Child, Engine, LlamaServer};

fn signal(child: &Child, sig: &str) {
    let pid = child.id().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig} {pid}");
}

/// Whether the process has exited (a zombie not yet reaped counts as exited).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

async fn node_listed(gw: &Gateway, node_id: &str) -> bool {
    let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
    nodes["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n["node_id"] == node_id)
}

async fn stream_request(gw: &Gateway, key: &str, max_tokens: u32) -> reqwest::Response {
    let resp = gw
        .http
        .post(format!("{}/v1/chat/completions", gw.public))
        .bearer_auth(key)
        .json(
            &json!({"model": "smollm2", "stream": true, "max_tokens": max_tokens,
                      "logit_bias": {"0": -100, "2": -100}, "temperature": 0,
                      "messages": [{"role": "user", "content": "Tell a long story."}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp
}

/// How a stream ended: `Ok(text)` with the whole body, or `Err(text)` when the body broke off.
async fn drain(resp: reqwest::Response, limit: Duration) -> Result<String, String> {
    let mut body = resp.bytes_stream();
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, body.next()).await {
            Err(_) => panic!("the stream neither ended nor failed within {limit:?}: {text}"),
            Ok(None) => return Ok(text),
            Ok(Some(Ok(chunk))) => text.push_str(&String::from_utf8_lossy(&chunk)),
            Ok(Some(Err(e))) => return Err(format!("{text}\n<body error: {e}>")),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_agent_is_detected_and_its_stream_fails_promptly() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    let s = common::setup(&gw, dir.path(), &llama.url).await;

    let resp = stream_request(&gw, &s.api_key, 4000).await;
    let mut body = resp.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(!first.is_empty());

    signal(&s.agent, "-STOP");
    let frozen = Instant::now();
    let mut text = String::new();
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(30), body.next()).await {
            Err(_) => panic!("stream still open 30 s after the agent froze"),
            Ok(None) => break "end",
            Ok(Some(Ok(chunk))) => text.push_str(&String::from_utf8_lossy(&chunk)),
            Ok(Some(Err(_))) => break "error",
        }
    };
    let failed_after = frozen.elapsed();
    // an error the caller can see: a broken body, or an OpenAI-shaped error event
    assert!(
        ended == "error" || text.contains("\"error\""),
        "stream ended cleanly without an error after the agent froze: {text}"
    );
    assert!(failed_after < Duration::from_secs(25), "{failed_after:?}");

    let mut gone_after = None;
    for _ in 0..300 {
        if !node_listed(&gw, &s.node_id).await {
            gone_after = Some(frozen.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let gone_after = gone_after.expect("node still listed 30 s after freezing");
    // 2 × the 10 s ping interval
    assert!(gone_after <= Duration::from_secs(20), "{gone_after:?}");
    eprintln!(
        "frozen agent: stream failed after {failed_after:?}, node left routing after {gone_after:?}"
    );
    signal(&s.agent, "-CONT");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_agent_takes_over_a_lingering_session_within_5_s() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    let s = common::setup(&gw, dir.path(), &llama.url).await;
    let mut old = s.agent;

    // the old agent freezes: its connection stays open, no close reaches the gateway
    signal(&old, "-STOP");
    let restarted = Instant::now();
    let restarted_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let new = common::start_agent(&gw, &dir.path().join("node.key"), &llama.url, "agent-2");
    // serving again = the new session passed its health probe through the tunnel (engine
    // included) and the node is routable on it
    let mut served_after = None;
    while restarted.elapsed() < Duration::from_secs(15) {
        let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
        let on_new_session = nodes["data"].as_array().unwrap().iter().any(|n| {
            n["node_id"] == s.node_id.as_str()
                && n["tunnel"]["state"] == "ready"
                && n["tunnel"]["connected_at_unix_ms"].as_u64() >= Some(restarted_unix_ms)
        });
        if on_new_session {
            served_after = Some(restarted.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let served_after = served_after.unwrap_or_else(|| {
        panic!(
            "never routable again; agent-2 stderr:\n{}\ngateway:\n{}",
            new.stderr_tail(20),
            gw.child.stderr_tail(20)
        )
    });
    assert!(served_after < Duration::from_secs(5), "{served_after:?}");
    // and it answers (no time bound here: that is the engine's speed on this machine)
    let r = gw
        .http
        .post(format!("{}/v1/chat/completions", gw.public))
        .bearer_auth(&s.api_key)
        .json(&json!({"model": "smollm2", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let metrics = gw.metrics().await;
    assert_eq!(common::metric(&metrics, "spine_tunnels_connected"), 1.0);
    assert_eq!(
        common::metric(&metrics, "spine_tunnel_takeovers_total"),
        1.0
    );
    let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
    let listed: Vec<&Value> = nodes["data"].as_array().unwrap().iter().collect();
    assert_eq!(listed.len(), 1, "{nodes}");
    assert_eq!(listed[0]["tunnel"]["state"], "ready", "{nodes}");
    assert_eq!(listed[0]["tunnel"]["models"][0]["running"], true, "{nodes}");
    eprintln!("restarted agent serving again after {served_after:?}");
    old.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_stream_in_flight_then_the_agent_leaves() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    let s = common::setup(&gw, dir.path(), &llama.url).await;
    let pid = s.agent.id().unwrap();

    // few tokens: the agent drains for at most 30 s, and llama.cpp on a machine busy with other
    // builds has been seen to take longer than that for 64
    let resp = stream_request(&gw, &s.api_key, 24).await;
    signal(&s.agent, "-TERM");
    let body = drain(resp, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("the stream in flight broke off during the drain: {e}"));
    assert!(body.contains("data: [DONE]"), "{body}");
    assert!(!body.contains("\"error\""), "{body}");

    let mut left = false;
    for _ in 0..100 {
        if exited(pid) && !node_listed(&gw, &s.node_id).await {
            left = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(left, "agent:\n{}", s.agent.stderr_tail(20));
    s.agent
        .wait_for_stderr("draining the tunnel", Duration::from_secs(1))
        .await
        .unwrap();
}
