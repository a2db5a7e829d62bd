//! A node that refuses requests (400 / 413 / 422), end to end: a real gateway, real agents over
//! real tunnels, in front of fake engines that speak real HTTP. A node's refusal is retried on
//! another node: when that node serves the request, the refusing node is scored and the caller
//! is charged once; when the other node refuses too, the request was bad: the refusal goes to
//! the caller in OpenAI's error shape and neither node is scored.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{add_node, full, serve_fake_llama, sse, sse_data, tenant, Gateway, Tenant, CREDITS};
use hyper::body::Frame;
use serde_json::{json, Value};
use spine_test_support::Engine;

/// A fake engine: refuses every chat with `status` while `refuse` is set, else streams "Hi".
struct Engine2 {
    url: String,
    refuse: Arc<AtomicBool>,
    chats: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Engine2 {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Engine2 {
    async fn start(refuse: bool, status: u16) -> Self {
        let refuse = Arc::new(AtomicBool::new(refuse));
        let chats = Arc::new(AtomicU64::new(0));
        let (r, c) = (refuse.clone(), chats.clone());
        let (url, task) = serve_fake_llama(move |path, _body| {
            let (r, c) = (r.clone(), c.clone());
            async move {
                if path != "/v1/chat/completions" {
                    return full(404, "application/json", r#"{"error":"not found"}"#.into());
                }
                c.fetch_add(1, Ordering::SeqCst);
                if r.load(Ordering::SeqCst) {
                    return full(
                        status,
                        "application/json",
                        json!({"error":{"code":status,"message":"the request is not acceptable","type":"invalid_request_error"}})
                            .to_string(),
                    );
                }
                let chunk = |delta: Value, finish: Value| {
                    format!(
                        "data: {}\n\n",
                        json!({"id":"x","object":"chat.completion.chunk","created":1,"model":"smollm2",
                            "choices":[{"index":0,"delta":delta,"finish_reason":finish}]})
                    )
                };
                let frames = vec![
                    chunk(json!({"role":"assistant","content":null}), Value::Null),
                    chunk(json!({"content":"Hi"}), Value::Null),
                    chunk(json!({}), json!("stop")),
                    "data: [DONE]\n\n".to_owned(),
                ];
                sse(futures_util::stream::iter(frames.into_iter().map(|f| {
                    Ok::<_, std::io::Error>(Frame::data(Bytes::from(f)))
                })))
            }
        })
        .await;
        Self {
            url,
            refuse,
            chats,
            task,
        }
    }
}

async fn chat(gw: &Gateway, key: &str, i: usize) -> (String, u16, String) {
    let resp = gw
        .api_post(
            key,
            "/v1/chat/completions",
            &json!({"model":"smollm2","stream":true,"max_tokens":4,
                "messages":[{"role":"user","content":format!("Say hi, number {i}.")}]}),
        )
        .await;
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let status = resp.status().as_u16();
    let body = tokio::time::timeout(Duration::from_secs(30), resp.text())
        .await
        .expect("the answer hung")
        .unwrap();
    (id, status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_node_is_retried_and_scored_and_two_refusals_pass_through_unscored() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    let Tenant {
        operator,
        account,
        api_key,
    } = tenant(&gw).await;
    let refuser = Engine2::start(true, 422).await;
    let server = Engine2::start(false, 400).await;
    let (bad, _bad_agent) = add_node(&gw, dir.path(), &operator, &refuser.url, "refuser").await;
    let (good, _good_agent) = add_node(&gw, dir.path(), &operator, &server.url, "server").await;

    // --- one node refuses everything: every request is served by the other, charged once -----
    let mut ids = Vec::new();
    for i in 0..40 {
        let (id, status, body) = chat(&gw, &api_key, i).await;
        assert_eq!(status, 200, "{body}");
        let events = sse_data(&body);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
        assert!(!body.contains("\"error\""), "{body}");
        ids.push(id);
        if refuser.chats.load(Ordering::SeqCst) >= 3 {
            break;
        }
    }
    let refusals = refuser.chats.load(Ordering::SeqCst);
    assert!(refusals >= 1, "the refusing node was never picked");
    let bad_view = gw.node_view(&bad).await.unwrap();
    assert_eq!(bad_view["attempts"], refusals, "{bad_view}");
    assert_eq!(bad_view["failures"], refusals, "{bad_view}");
    let debits = gw.completed_on(&ids, &good).await;
    assert!(debits > 0);
    assert_eq!(
        gw.balance_once_released(&account).await,
        (CREDITS - debits, 0)
    );

    // --- both refuse: the request was bad; the refusal passes through, nobody is scored -------
    server.refuse.store(true, Ordering::SeqCst);
    // the last served attempt is recorded when its body is dropped, a moment after the caller
    // read it
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before: Vec<Value> = vec![
        gw.node_view(&bad).await.unwrap(),
        gw.node_view(&good).await.unwrap(),
    ];
    let (server_before, refuser_before) = (
        server.chats.load(Ordering::SeqCst),
        refuser.chats.load(Ordering::SeqCst),
    );
    let (id, status, body) = chat(&gw, &api_key, 1000).await;
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|_| panic!("{body}"));
    assert!(status == 400 || status == 422, "{status} {body}");
    assert_eq!(v["error"]["code"], "upstream_rejected", "{body}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
    assert!(v["error"]["message"].is_string(), "{body}");
    // tried on both nodes, once each
    assert_eq!(
        server.chats.load(Ordering::SeqCst) + refuser.chats.load(Ordering::SeqCst),
        server_before + refuser_before + 2
    );
    for (node, before) in [&bad, &good].into_iter().zip(&before) {
        let after = gw.node_view(node).await.unwrap();
        assert_eq!(after["attempts"], before["attempts"], "{after}");
        assert_eq!(after["failures"], before["failures"], "{after}");
    }
    let rec = gw.record(&id).await;
    assert_eq!(rec["debit_micros"], 0, "{rec}");
    assert_eq!(
        gw.balance_once_released(&account).await,
        (CREDITS - debits, 0)
    );
}
