//! A stalled stream on a live tunnel, end to end: a real gateway (`stream_idle_timeout_secs = 2`)
//! and a real agent in front of a fake engine that speaks real HTTP. The engine streams a role
//! chunk and one token, then sends nothing while keeping its connection open (the agent still
//! answers the gateway's PINGs). The caller's stream must end with an OpenAI-shaped error event
//! instead of hanging; the request settles (`upstream_failed`, nothing charged, hold released);
//! the node is scored as for a mid-request disconnect and its slot freed; the agent cancels the
//! engine request; and the next request, once the engine behaves, is served normally.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    add_node, assert_clean_stream, full, serve_fake_llama, sse, sse_data, tenant, text_of,
    FakeBody, Gateway, Tenant, CREDITS, ROLE_CHUNK,
};
use hyper::body::Frame;
use serde_json::{json, Value};
use spine_test_support::Engine;

fn content(text: &str) -> String {
    format!(
        "data: {{\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"smollm2\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}},\"finish_reason\":null}}]}}\n\n"
    )
}

const FINISH: &str = "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"smollm2\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n";

/// Sets its flag when dropped: the engine's response body went away (the agent cancelled).
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A fake llama-server: `/health`, `/v1/models`, and a `/v1/chat/completions` that stalls after
/// its first token while `stall` is set, and answers a short complete stream otherwise.
struct StallingEngine {
    url: String,
    stall: Arc<AtomicBool>,
    chats: Arc<AtomicU64>,
    /// Set when a stalled answer's body was dropped (its connection closed by the agent).
    cancelled: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for StallingEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
struct EngineState {
    stall: Arc<AtomicBool>,
    chats: Arc<AtomicU64>,
    cancelled: Arc<AtomicBool>,
}

async fn answer(state: EngineState, path: String) -> hyper::Response<FakeBody> {
    match path.as_str() {
        "/v1/chat/completions" => {
            state.chats.fetch_add(1, Ordering::SeqCst);
            let stall = state.stall.load(Ordering::SeqCst);
            let frames: Vec<String> = if stall {
                vec![ROLE_CHUNK.into(), content("Hello")]
            } else {
                vec![
                    ROLE_CHUNK.into(),
                    content("Hi"),
                    FINISH.into(),
                    "data: [DONE]\n\n".into(),
                ]
            };
            let guard = stall.then(|| DropFlag(state.cancelled.clone()));
            // 100 ms between frames so that each reaches the gateway as its own frame; after the
            // last one a stalled answer waits forever, its connection open (the guard lives in
            // the pending state until the body is dropped)
            let stream = futures_util::stream::unfold(
                (frames.into_iter(), guard),
                |(mut rest, guard)| async move {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    match rest.next() {
                        Some(frame) => Some((
                            Ok::<_, std::io::Error>(Frame::data(Bytes::from(frame))),
                            (rest, guard),
                        )),
                        None if guard.is_some() => {
                            std::future::pending::<()>().await;
                            None
                        }
                        None => None,
                    }
                },
            );
            sse(stream)
        }
        _ => full(404, "application/json", r#"{"error":"not found"}"#.into()),
    }
}

impl StallingEngine {
    async fn start() -> Self {
        let state = EngineState {
            stall: Arc::new(AtomicBool::new(true)),
            chats: Arc::new(AtomicU64::new(0)),
            cancelled: Arc::new(AtomicBool::new(false)),
        };
        let shared = state.clone();
        let (url, task) = serve_fake_llama(move |path, _| answer(shared.clone(), path)).await;
        Self {
            url,
            stall: state.stall,
            chats: state.chats,
            cancelled: state.cancelled,
            task,
        }
    }
}

/// One streamed chat: (request id, status, SSE data events). Fails the test if the stream has
/// not ended within 30 s.
async fn chat(gw: &Gateway, key: &str) -> (String, u16, Vec<String>) {
    let mut resp = gw
        .api_post(
            key,
            "/v1/chat/completions",
            &json!({"model":"smollm2","messages":[{"role":"user","content":"Say hi."}],"stream":true,"max_tokens":8}),
        )
        .await;
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let status = resp.status().as_u16();
    let mut body = Vec::new();
    let read = async {
        while let Some(chunk) = resp.chunk().await.unwrap() {
            body.extend_from_slice(&chunk);
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the caller's stream hung; received so far: {:?}",
                String::from_utf8_lossy(&body)
            )
        });
    (id, status, sse_data(&String::from_utf8_lossy(&body)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_stalled_after_its_first_token_is_cut_settled_and_scored() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start_with(dir.path(), &engine, "stream_idle_timeout_secs = 2").await;
    let fake = StallingEngine::start().await;

    let Tenant {
        operator,
        account,
        api_key,
    } = tenant(&gw).await;
    // one node: a real agent in front of the stalling engine
    let (node_id, agent) = add_node(&gw, dir.path(), &operator, &fake.url, "agent").await;
    let before = gw
        .node_view(&node_id)
        .await
        .unwrap_or_else(|| panic!("node not listed; agent stderr:\n{}", agent.stderr_tail(30)));
    assert_eq!(before["disconnects"], 0);
    let penalty_before = before["score_parts"]["failure_penalty"].as_f64().unwrap();
    assert!(penalty_before > 0.99, "{before}");

    // --- the stalled stream: cut after ~2 s with an error event, not retried ----------------
    let started = Instant::now();
    let (id, status, events) = chat(&gw, &api_key).await;
    let took = started.elapsed();
    assert_eq!(status, 200);
    assert!(
        took >= Duration::from_secs(2),
        "cut before the idle timeout: {took:?}"
    );
    assert_eq!(text_of(&events), "Hello", "{events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert!(last["error"]["message"].is_string(), "{events:?}");
    assert!(last["error"]["type"].is_string(), "{events:?}");
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    assert_eq!(fake.chats.load(Ordering::SeqCst), 1, "retried after commit");

    // settled: upstream_failed, nothing charged, hold released
    gw.failed_unbilled(&id).await;
    let balance = gw.balance_once_released(&account).await;
    assert_eq!(balance, (CREDITS, 0));

    // the node: scored as a mid-request disconnect, its slot freed
    let after = gw.node_view(&node_id).await.unwrap();
    assert_eq!(after["attempts"], 1, "{after}");
    assert_eq!(after["disconnects"], 1, "{after}");
    assert_eq!(after["in_flight"], 0, "{after}");
    let penalty_after = after["score_parts"]["failure_penalty"].as_f64().unwrap();
    assert!(penalty_after < 0.51, "{after}");
    assert!(
        after["score"].as_f64().unwrap() < before["score"].as_f64().unwrap(),
        "score did not drop: {before} → {after}"
    );

    // the tunnel stream was reset, so the agent dropped the engine request
    let mut cancelled = false;
    for _ in 0..100 {
        if fake.cancelled.load(Ordering::SeqCst) {
            cancelled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        cancelled,
        "the engine request was never cancelled; agent stderr:\n{}",
        agent.stderr_tail(30)
    );

    // --- the engine behaves again: the next request through the same node completes ---------
    fake.stall.store(false, Ordering::SeqCst);
    let (id, status, events) = chat(&gw, &api_key).await;
    assert_eq!(status, 200);
    assert_clean_stream(&events, "");
    let rec = gw.record(&id).await;
    assert_eq!(rec["outcome"], "completed", "{rec}");
    assert_eq!(rec["node"], node_id.as_str(), "{rec}");
    let debit = rec["debit_micros"].as_u64().unwrap();
    assert!(debit > 0, "{rec}");
    let balance = gw.balance_once_released(&account).await;
    assert_eq!(balance, (CREDITS - debit, 0));
    assert_eq!(fake.chats.load(Ordering::SeqCst), 2);
}

/// A stream still open when SIGTERM's grace period ends: the gateway ends it with its
/// `stream_bound_reached` error event, whole (the chunked body is not cut mid-frame), settles it
/// `cut_at_bound` (the caller pays the prompt and what was delivered, as its usage chunk said),
/// and then exits. Before, the public listener was aborted under the stream: the caller got a
/// broken chunked body and no error event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_open_when_the_shutdown_grace_ends_gets_an_error_event_and_settles() {
    const GRACE: &str = "shutdown_grace_secs = 2";
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start_with(dir.path(), &engine, GRACE).await;
    // an engine that streams one token every 100 ms, without end
    let (url, task) = serve_fake_llama(|path, _body| async move {
        if path != "/v1/chat/completions" {
            return full(404, "application/json", r#"{"error":"not found"}"#.into());
        }
        let frames = futures_util::stream::unfold(0u64, |n| async move {
            if n > 0 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let frame = if n == 0 {
                ROLE_CHUNK.to_owned()
            } else {
                content("tok")
            };
            Some((
                Ok::<_, std::io::Error>(Frame::data(Bytes::from(frame))),
                n + 1,
            ))
        });
        sse(frames)
    })
    .await;
    let Tenant {
        operator,
        account,
        api_key,
    } = tenant(&gw).await;
    let (_node_id, agent) = add_node(&gw, dir.path(), &operator, &url, "agent").await;

    let mut resp = gw
        .api_post(
            &api_key,
            "/v1/chat/completions",
            &json!({"model":"smollm2","messages":[{"role":"user","content":"Count."}],
                    "stream":true,"max_tokens":4000,"stream_options":{"include_usage":true}}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let mut body = resp.chunk().await.unwrap().unwrap().to_vec();

    let pid = gw.child.id().unwrap();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    // every chunk arrives whole: a body cut mid-chunk is an error here
    let read = async {
        loop {
            match resp.chunk().await {
                Ok(Some(chunk)) => body.extend_from_slice(&chunk),
                Ok(None) => break,
                Err(e) => panic!(
                    "the stream was cut mid-body: {e:?}\nreceived: {}\ngateway:\n{}",
                    String::from_utf8_lossy(&body),
                    gw.child.stderr_tail(30)
                ),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(600), read)
        .await
        .expect("the caller's stream never ended after the grace period");
    let events = sse_data(&String::from_utf8_lossy(&body));
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "stream_bound_reached", "{events:?}");
    let delivered = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter(|v| v["choices"][0]["delta"]["content"] == "tok")
        .count() as u64;
    assert!(delivered > 0, "{events:?}");
    // the bill the caller was shown, just before the error event
    let usage = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find(|v| v["usage"].is_object())
        .unwrap_or_else(|| panic!("no usage chunk: {events:?}"))["usage"]
        .clone();
    assert!(usage["completion_tokens"].as_u64().unwrap() > 0, "{usage}");
    gw.child
        .wait_for_stderr("gateway stopped", Duration::from_secs(600))
        .await
        .unwrap();
    drop(gw);
    drop(agent);
    task.abort();

    // same data dir, same ledger: settled once, at the bill the caller was shown
    let gw = Gateway::start_with(dir.path(), &engine, GRACE).await;
    let rec = gw.record(&id).await;
    assert_eq!(rec["outcome"], "cut_at_bound", "{rec}");
    for tokens in ["prompt_tokens", "completion_tokens"] {
        assert_eq!(rec["billed"][tokens], usage[tokens], "{tokens}: {rec}");
    }
    let debit = rec["debit_micros"].as_u64().unwrap();
    assert!(debit > 0, "{rec}");
    assert_eq!(gw.balance(&account).await, (CREDITS - debit, 0));
}

/// What a hostile engine keeps a stream alive with, none of it progress: a comment, an empty
/// delta, a role-only chunk, a usage-only chunk, a chunk with an empty delta.
fn alive_without_progress() -> Vec<String> {
    let chunk = |choice: Value| {
        format!(
            "data: {}\n\n",
            json!({"id":"x","object":"chat.completion.chunk","created":1,"model":"smollm2",
                "choices":[choice]})
        )
    };
    vec![
        ": ping\n\n".to_owned(),
        chunk(json!({"index":0,"delta":{"content":""},"finish_reason":null})),
        chunk(json!({"index":0,"delta":{"role":"assistant"},"finish_reason":null})),
        format!(
            "data: {}\n\n",
            json!({"id":"x","object":"chat.completion.chunk","created":1,"model":"smollm2",
                "choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}})
        ),
        chunk(json!({"index":0,"delta":{},"finish_reason":null})),
    ]
}

/// A node whose engine streams a role chunk and one token, then keeps the stream alive forever
/// (every 100 ms: comments, empty deltas, role-only and usage chunks) without a new token: the
/// gateway's silence bound never fires (bytes keep coming), its progress bound does. The
/// caller's stream ends with the `upstream_failed` error event (no `[DONE]`) after about
/// `stream_idle_timeout_secs`; the record keeps the delivered tokens (`upstream_failed`,
/// nothing charged); the node is scored as for a mid-request disconnect; the engine request is
/// cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_kept_alive_without_progress_is_cut_as_stalled_and_scored_as_a_disconnect() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start_with(dir.path(), &engine, "stream_idle_timeout_secs = 2").await;
    let cancelled = Arc::new(AtomicBool::new(false));
    let flag = cancelled.clone();
    let (url, task) = serve_fake_llama(move |path, _body| {
        let flag = flag.clone();
        async move {
            if path != "/v1/chat/completions" {
                return full(404, "application/json", r#"{"error":"not found"}"#.into());
            }
            let alive = alive_without_progress();
            let guard = DropFlag(flag);
            let frames = futures_util::stream::unfold((0usize, guard), move |(n, guard)| {
                let alive = alive.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let frame = match n {
                        0 => ROLE_CHUNK.to_owned(),
                        1 => content("Hello"),
                        _ => alive[(n - 2) % alive.len()].clone(),
                    };
                    Some((
                        Ok::<_, std::io::Error>(Frame::data(Bytes::from(frame))),
                        (n + 1, guard),
                    ))
                }
            });
            sse(frames)
        }
    })
    .await;
    let Tenant {
        operator,
        account,
        api_key,
    } = tenant(&gw).await;
    let (node_id, agent) = add_node(&gw, dir.path(), &operator, &url, "agent").await;
    let before = gw
        .node_view(&node_id)
        .await
        .unwrap_or_else(|| panic!("node not listed; agent stderr:\n{}", agent.stderr_tail(30)));
    assert_eq!(before["disconnects"], 0);

    let started = Instant::now();
    let (id, status, events) = chat(&gw, &api_key).await;
    let took = started.elapsed();
    assert_eq!(status, 200);
    assert!(took >= Duration::from_secs(2), "cut too early: {took:?}");
    assert!(took < Duration::from_secs(15), "cut too late: {took:?}");
    assert_eq!(text_of(&events), "Hello", "{events:?}");
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_failed", "{events:?}");
    assert_eq!(last["error"]["type"], "upstream_error", "{events:?}");
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no progress"),
        "{events:?}"
    );

    // the record: upstream_failed with the delivered token, nothing charged
    let rec = gw.record(&id).await;
    assert_eq!(rec["outcome"], "upstream_failed", "{rec}");
    let tok = spine_meter::ModelTokenizer::from_gguf(&engine.model_gguf).unwrap();
    assert_eq!(
        rec["billed"]["completion_tokens"].as_u64().unwrap(),
        tok.count_text("Hello"),
        "{rec}"
    );
    assert_eq!(rec["debit_micros"], 0, "{rec}");
    assert_eq!(gw.balance_once_released(&account).await, (CREDITS, 0));

    // the node: one attempt, scored as a mid-request disconnect, its slot freed
    let after = gw.node_view(&node_id).await.unwrap();
    assert_eq!(after["attempts"], 1, "{after}");
    assert_eq!(after["disconnects"], 1, "{after}");
    assert_eq!(after["in_flight"], 0, "{after}");
    assert!(
        after["score_parts"]["failure_penalty"].as_f64().unwrap() < 0.51,
        "{after}"
    );
    // the engine request was dropped
    let mut dropped = false;
    for _ in 0..100 {
        if cancelled.load(Ordering::SeqCst) {
            dropped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(dropped, "agent stderr:\n{}", agent.stderr_tail(30));
    task.abort();
}

/// A node whose engine answers a non-streamed request with a 200 head and then a body that
/// trickles (a byte every 100 ms, forever): never silent, never whole. Cut at
/// `response_body_timeout_secs`: the caller gets a 502 in OpenAI's shape, the request settles
/// `upstream_failed` (nothing charged) and the node is scored a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streamed_body_that_trickles_is_cut_at_its_total_bound() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start_with(dir.path(), &engine, "response_body_timeout_secs = 2").await;
    let (url, task) = serve_fake_llama(|path, _body| async move {
        if path != "/v1/chat/completions" {
            return full(404, "application/json", r#"{"error":"not found"}"#.into());
        }
        use http_body_util::BodyExt as _;
        let frames = futures_util::stream::unfold(0u64, |n| async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let frame = if n == 0 { "{\"id\":\"x\"," } else { " " };
            Some((
                Ok::<_, std::io::Error>(Frame::data(Bytes::from_static(frame.as_bytes()))),
                n + 1,
            ))
        });
        hyper::Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(http_body_util::StreamBody::new(frames).boxed())
            .unwrap()
    })
    .await;
    let Tenant {
        operator,
        account,
        api_key,
    } = tenant(&gw).await;
    let (node_id, _agent) = add_node(&gw, dir.path(), &operator, &url, "agent").await;

    let started = Instant::now();
    let resp = gw
        .api_post(
            &api_key,
            "/v1/chat/completions",
            &json!({"model":"smollm2","messages":[{"role":"user","content":"Say hi."}],"max_tokens":8}),
        )
        .await;
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let status = resp.status().as_u16();
    let body: Value = tokio::time::timeout(Duration::from_secs(30), resp.json())
        .await
        .expect("the answer hung")
        .unwrap();
    let took = started.elapsed();
    assert_eq!(status, 502, "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");
    assert!(body["error"]["type"].is_string(), "{body}");
    assert!(body["error"]["code"].is_string(), "{body}");
    assert!(took >= Duration::from_secs(2), "cut too early: {took:?}");
    assert!(took < Duration::from_secs(15), "cut too late: {took:?}");
    gw.failed_unbilled(&id).await;
    assert_eq!(gw.balance_once_released(&account).await, (CREDITS, 0));
    let node = gw.node_view(&node_id).await.unwrap();
    assert_eq!(node["attempts"], 1, "{node}");
    assert_eq!(node["failures"], 1, "{node}");
    assert_eq!(node["in_flight"], 0, "{node}");
    task.abort();
}
