//! Billing of tool calls, reasoning and `length` finishes through the layer, and the SSE
//! keepalive on tokio's paused clock.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use spine_core::{AccountId, BoxBody, BoxError, StreamOutcome};
use spine_test_support::body_fn;
use tokio::sync::mpsc;
use tower::{Layer, ServiceExt};

use super::*;
use crate::ledger::Settlement;
use crate::test_support::{
    chat_request, next_settled, node_response, smollm_catalog, smollm_tokenizer, FundedLedger,
    RecordedEvents, SettledRx,
};
use crate::Price;
use crate::TokenCounter as _;

const PRICE: Price = Price {
    input_micros_per_mtok: 1_000_000,
    output_micros_per_mtok: 2_000_000,
};

/// A node body fed from a channel: each message is one read; the sender dropped ends it.
fn fed(mut rx: mpsc::UnboundedReceiver<Bytes>) -> BoxBody {
    BoxBody::new(body_fn(move |cx| {
        rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }))
}

struct Setup {
    layer: MeterLayer,
    settled: SettledRx,
    events: Arc<RecordedEvents>,
    node: spine_core::NodeId,
}

async fn setup() -> Setup {
    setup_with_context(2048).await
}

async fn setup_with_context(max_context_tokens: u64) -> Setup {
    let FundedLedger { ledger, node, .. } = FundedLedger::new(1_000_000).await;
    let (events, settled) = RecordedEvents::new();
    let catalog = smollm_catalog(PRICE, max_context_tokens);
    let layer = MeterLayer::new(ledger, catalog).events(events.clone());
    Setup {
        layer,
        settled,
        events,
        node,
    }
}

impl Setup {
    /// Sends `req` through the layer to a node answering `content_type` with `body`.
    async fn send(
        &self,
        req: &Value,
        content_type: &'static str,
        body: BoxBody,
    ) -> http::Response<BoxBody> {
        let node = self.node.clone();
        let body = Arc::new(Mutex::new(Some(body)));
        let inner = tower::service_fn(move |req: http::Request<BoxBody>| {
            let node = node.clone();
            let body = body.lock().unwrap().take().unwrap();
            async move {
                drop(req.into_body().collect().await?);
                Ok::<_, BoxError>(node_response(node, content_type, body))
            }
        });
        let bytes = Bytes::from(serde_json::to_vec(req).unwrap());
        let req = chat_request("r1", AccountId::from("acct"), bytes);
        self.layer.layer(inner).oneshot(req).await.unwrap()
    }

    /// Streams `req` to a node whose answer is fed from the returned sender, one read a
    /// message; dropping the sender ends it.
    async fn send_fed(
        &self,
        req: &Value,
    ) -> (mpsc::UnboundedSender<Bytes>, http::Response<BoxBody>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let resp = self.send(req, "text/event-stream", fed(rx)).await;
        (tx, resp)
    }

    async fn settled(&mut self) -> Settlement {
        next_settled(&mut self.settled).await.0
    }
}

fn full(v: &Value) -> BoxBody {
    spine_test_support::full(serde_json::to_vec(v).unwrap())
}

fn sse(events: &[Value]) -> BoxBody {
    let mut text = String::new();
    for e in events {
        text.push_str(&format!("data: {e}\n\n"));
    }
    text.push_str("data: [DONE]\n\n");
    spine_test_support::full(text)
}

const PROMPT: u64 = 34; // "Name three colors." rendered

fn chat(max_tokens: Option<u64>, stream: bool) -> Value {
    let mut v =
        json!({"model":"smollm2","messages":[{"role":"user","content":"Name three colors."}]});
    if let Some(m) = max_tokens {
        v["max_tokens"] = json!(m);
    }
    if stream {
        v["stream"] = json!(true);
    }
    v
}

#[tokio::test]
async fn non_streamed_tool_calls_and_reasoning_are_billed() {
    let mut s = setup().await;
    let t = smollm_tokenizer();
    let args = r#"{"city":"Paris","unit":"celsius"}"#;
    let resp = s
        .send(
            &chat(Some(200), false),
            "application/json",
            full(&json!({"id":"c1","object":"chat.completion","choices":[{"index":0,
                "finish_reason":"tool_calls","message":{"role":"assistant","content":null,
                "reasoning_content":"Need the weather tool.",
                "tool_calls":[{"id":"t1","type":"function","function":{"name":"get_weather","arguments":args}}]}}],
                "usage":{"prompt_tokens":34,"completion_tokens":40,"total_tokens":74}})),
        )
        .await;
    let body: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let want = t.count_text("Need the weather tool.")
        + t.count_text("get_weather")
        + t.count_text(args)
        + 1;
    assert!(want > 15, "{want}");
    assert_eq!(body["usage"]["completion_tokens"].as_u64(), Some(want));
    let st = s.settled().await;
    assert_eq!(
        (
            st.outcome,
            st.billed.prompt_tokens,
            st.billed.completion_tokens
        ),
        (StreamOutcome::Completed, PROMPT, want)
    );
    // the engine's 40 includes the wrapper syntax its parser removed: within the allowance
    assert!(!st.discrepancy, "{want} vs 40");
    assert!(s.events.1.lock().unwrap().is_empty());
}

#[tokio::test]
async fn streamed_tool_call_deltas_are_billed() {
    let mut s = setup().await;
    let t = smollm_tokenizer();
    let chunk = |delta: Value, finish: Value| json!({"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":delta,"finish_reason":finish}]});
    let resp = s
        .send(
            &chat(Some(200), true),
            "text/event-stream",
            sse(&[
                chunk(json!({"role":"assistant","content":null}), Value::Null),
                chunk(json!({"reasoning_content":"Use the tool."}), Value::Null),
                chunk(
                    json!({"tool_calls":[{"index":0,"id":"t1","type":"function","function":{"name":"get_weather","arguments":""}}]}),
                    Value::Null,
                ),
                chunk(json!({"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]}), Value::Null),
                chunk(json!({"tool_calls":[{"index":0,"function":{"arguments":"\"Paris\"}"}}]}), Value::Null),
                chunk(json!({}), json!("tool_calls")),
            ]),
        )
        .await;
    let out = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(out.ends_with(b"data: [DONE]\n\n"));
    let want = t.count_text("Use the tool.")
        + t.count_text("get_weather")
        + t.count_text(r#"{"city":"Paris"}"#)
        + 1;
    let st = s.settled().await;
    assert_eq!(
        (st.outcome, st.billed.completion_tokens),
        (StreamOutcome::Completed, want)
    );
}

#[tokio::test]
async fn a_caller_gone_mid_tool_call_pays_the_arguments_delivered() {
    let mut s = setup().await;
    let t = smollm_tokenizer();
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(Bytes::from(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\"}}]},\"finish_reason\":null}]}\n\n",
    ))
    .unwrap();
    let resp = s
        .send(&chat(Some(200), true), "text/event-stream", fed(rx))
        .await;
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(first.starts_with(b"data: "));
    drop(body);
    let st = s.settled().await;
    assert_eq!(
        (st.outcome, st.billed.completion_tokens),
        (
            StreamOutcome::ClientCancelled,
            t.count_text("get_weather") + t.count_text(r#"{"city":"#)
        )
    );
    drop(tx);
}

#[tokio::test]
async fn a_stream_cut_at_the_tool_call_bound_bills_what_was_delivered() {
    // an honest engine can be asked for more tool calls than the gateway lets one streamed
    // choice carry: the cut is the gateway's, so the caller pays what it got and the node is
    // not at fault (before, the caller got 128 calls free and the node was penalised)
    let mut s = setup_with_context(32_768).await;
    let t = smollm_tokenizer();
    let calls = MAX_TOOL_CALLS_PER_CHOICE + 2;
    let chunks: Vec<Value> = (0..calls)
        .map(|i| {
            json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":i,"id":format!("t{i}"),"type":"function","function":{"name":"lookup","arguments":"{\"id\":1}"}}]},"finish_reason":null}]})
        })
        .chain([json!({"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]})])
        .collect();
    let mut req = chat(Some(30_000), true);
    req["stream_options"] = json!({"include_usage": true});
    let resp = s.send(&req, "text/event-stream", sse(&chunks)).await;
    let all = resp.into_body().collect().await.unwrap().to_bytes();
    let all = String::from_utf8(all.to_vec()).unwrap();
    let events: Vec<&str> = all
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    let delivered = events.iter().filter(|e| e.contains("\"lookup\"")).count();
    assert_eq!(delivered, MAX_TOOL_CALLS_PER_CHOICE + 1, "{all}");
    let err: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(err["error"]["code"], "stream_bound_reached", "{err}");
    assert!(!all.contains("[DONE]"));
    let st = s.settled().await;
    // the caller asked for usage: its bill comes in the usage chunk before the error event
    let usage: Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]), "{usage}");
    assert_eq!(
        usage["usage"]["completion_tokens"].as_u64(),
        Some(st.billed.completion_tokens)
    );
    // the delivered names and arguments, without the wrapper allowance of a completed bill
    // (as for a cancel)
    let per_call = t.count_text("lookup") + t.count_text(r#"{"id":1}"#);
    assert_eq!(
        (st.outcome, st.billed.completion_tokens),
        (StreamOutcome::CutAtBound, per_call * delivered as u64)
    );
    assert!(st.outcome.is_billed());
}

#[tokio::test]
async fn a_non_streamed_body_is_delivered_whatever_its_tool_calls() {
    let mut s = setup_with_context(32_768).await;
    let calls: Vec<Value> = (0..MAX_TOOL_CALLS_PER_CHOICE + 2)
        .map(|i| json!({"id":format!("t{i}"),"type":"function","function":{"name":"lookup","arguments":"{}"}}))
        .collect();
    let body = json!({"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":calls},"finish_reason":"tool_calls"}]});
    let resp = s
        .send(&chat(Some(30_000), false), "application/json", full(&body))
        .await;
    assert_eq!(resp.status(), 200);
    let out: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(
        out["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        MAX_TOOL_CALLS_PER_CHOICE + 2
    );
    assert_eq!(s.settled().await.outcome, StreamOutcome::Completed);
}

#[tokio::test]
async fn a_stream_past_the_total_bound_bills_what_was_delivered() {
    let mut s = setup().await;
    s.layer = s.layer.clone().max_stream_duration(Duration::from_secs(60));
    let t = smollm_tokenizer();
    let (tx, resp) = s.send_fed(&chat(Some(64), true)).await;
    tokio::time::pause();
    let start = tokio::time::Instant::now();
    let mut body = resp.into_body();
    tx.send(Bytes::from_static(
        b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello there\"},\"finish_reason\":null}]}\n\n",
    ))
    .unwrap();
    assert!(next(&mut body).await.starts_with(b"data: {"));
    // the node stays silent (keepalives) until the bound ends the stream
    let mut last = Bytes::new();
    while let Some(f) = body.frame().await {
        last = f.unwrap().into_data().unwrap();
    }
    assert_near(start.elapsed(), 60);
    let err: Value = serde_json::from_slice(
        last.strip_prefix(b"data: ")
            .unwrap()
            .strip_suffix(b"\n\n")
            .unwrap(),
    )
    .unwrap();
    assert_eq!(err["error"]["code"], "stream_bound_reached", "{err}");
    // the ledger's thread is not tokio's: back to the real clock before waiting on it
    tokio::time::resume();
    let st = s.settled().await;
    assert_eq!(
        (st.outcome, st.billed.completion_tokens),
        (StreamOutcome::CutAtBound, t.count_text("Hello there"))
    );
    drop(tx);
}

#[tokio::test]
async fn a_length_finish_bills_the_delivered_text_plus_its_allowance() {
    let t = smollm_tokenizer();
    let text = "1. Red\n2. Blue\n3. Green"; // 11 tokens, 23 bytes
    assert_eq!(t.count_text(text), 11);
    // (max_tokens, billed completion, discrepancy): min(L, 11 + 3 + max(2, L / 50)); a claim
    // of L is not flagged while the text has the bytes to be L tokens (L <= 23 + 3); past
    // that the finish is flagged and the text's 11 tokens are billed, without the allowance
    for (max_tokens, want, flagged) in [
        (11u64, 11u64, false),
        (14, 14, false),
        (26, 16, false),
        (40, 11, true),
    ] {
        for stream in [false, true] {
            let mut s = setup().await;
            let body = if stream {
                sse(&[
                    json!({"choices":[{"index":0,"delta":{"content":text},"finish_reason":null}]}),
                    json!({"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}),
                    json!({"choices":[],"usage":{"prompt_tokens":34,"completion_tokens":max_tokens,"total_tokens":34 + max_tokens}}),
                ])
            } else {
                full(&json!({"choices":[{"index":0,"finish_reason":"length",
                    "message":{"role":"assistant","content":text}}],
                    "usage":{"prompt_tokens":34,"completion_tokens":max_tokens,"total_tokens":34 + max_tokens}}))
            };
            let ct = if stream {
                "text/event-stream"
            } else {
                "application/json"
            };
            let resp = s.send(&chat(Some(max_tokens), stream), ct, body).await;
            drop(resp.into_body().collect().await.unwrap());
            let st = s.settled().await;
            assert_eq!(
                (st.outcome, st.billed.completion_tokens, st.discrepancy),
                (StreamOutcome::Completed, want, flagged),
                "max_tokens {max_tokens} stream {stream}"
            );
            assert_eq!(s.events.1.lock().unwrap().len(), usize::from(flagged));
        }
    }
    // no max_tokens: the engine's own context may have stopped it; the text's count
    let mut s = setup().await;
    let resp = s
        .send(
            &chat(None, false),
            "application/json",
            full(&json!({"choices":[{"index":0,"finish_reason":"length",
                "message":{"role":"assistant","content":text}}]})),
        )
        .await;
    drop(resp.into_body().collect().await.unwrap());
    let st = s.settled().await;
    assert_eq!((st.billed.completion_tokens, st.discrepancy), (11, false));
}

/// `elapsed` is `secs` seconds, give or take the timer wheel's millisecond rounding.
fn assert_near(elapsed: Duration, secs: u64) {
    let want = Duration::from_secs(secs);
    assert!(
        elapsed >= want && elapsed <= want + Duration::from_millis(5),
        "{elapsed:?} vs {want:?}"
    );
}

async fn next(body: &mut BoxBody) -> Bytes {
    body.frame().await.unwrap().unwrap().into_data().unwrap()
}

#[tokio::test]
async fn keepalive_comments_while_the_node_is_silent() {
    let s = setup().await;
    let (tx, resp) = s.send_fed(&chat(Some(64), true)).await;
    // the hold is placed; from here on time is tokio's paused clock
    tokio::time::pause();
    let start = tokio::time::Instant::now();
    let mut body = resp.into_body();
    // long prefill: nothing from the node; a comment after 15 s, and again 15 s later
    assert_eq!(&next(&mut body).await[..], b": keepalive\n\n");
    assert_near(start.elapsed(), 15);
    assert_eq!(&next(&mut body).await[..], b": keepalive\n\n");
    assert_near(start.elapsed(), 30);
    // the node's own ping comments are dropped, its events forwarded
    tokio::time::advance(Duration::from_secs(10)).await;
    tx.send(Bytes::from_static(b": ping\n\ndata: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n")).unwrap();
    let ev = next(&mut body).await;
    assert!(ev.starts_with(b"data: {"), "{ev:?}");
    assert_near(start.elapsed(), 40);
    // the timer restarts after every frame: the next comment is 15 s after the event
    assert_eq!(&next(&mut body).await[..], b": keepalive\n\n");
    assert_near(start.elapsed(), 55);
    // then the stream ends: [DONE] written by the gateway, no id: lines anywhere
    tx.send(Bytes::from_static(
        b"id: 7\ndata: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    ))
    .unwrap();
    drop(tx);
    let mut rest = Vec::new();
    while let Some(f) = body.frame().await {
        rest.extend_from_slice(&f.unwrap().into_data().unwrap());
    }
    let rest = String::from_utf8(rest).unwrap();
    assert_eq!(
        rest,
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n"
    );
}

#[tokio::test]
async fn a_node_failing_mid_stream_gets_an_openai_error_event() {
    let mut s = setup().await;
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(Bytes::from_static(
        b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n",
    ))
    .unwrap();
    drop(tx);
    let resp = s
        .send(&chat(Some(64), true), "text/event-stream", fed(rx))
        .await;
    let all = resp.into_body().collect().await.unwrap().to_bytes();
    let all = String::from_utf8(all.to_vec()).unwrap();
    let last = all.trim_end().rsplit("\n\n").next().unwrap();
    let err: Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(err["error"]["code"], "upstream_failed");
    assert_eq!(err["error"]["type"], "upstream_error");
    assert!(!all.contains("[DONE]"));
    let st = s.settled().await;
    assert_eq!(st.outcome, StreamOutcome::UpstreamFailed);
}

/// TTFT (recorded with the settlement, shown in the console's request log) is the time from
/// admission to the first chunk with generated text: a role-only chunk does not count. (Real
/// clock: the SQLite ledger's pool cannot run on a paused one; the bounds hold on any machine.)
#[tokio::test]
async fn ttft_is_the_time_to_the_first_generated_text() {
    let mut s = setup().await;
    let (tx, rx) = mpsc::unbounded_channel();
    let before = tokio::time::Instant::now();
    let resp = s
        .send(&chat(Some(20), true), "text/event-stream", fed(rx))
        .await;
    let mut body = resp.into_body();
    let chunk = |delta: Value| {
        Bytes::from(format!(
            "data: {}\n\n",
            json!({"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":delta,"finish_reason":null}]})
        ))
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    tx.send(chunk(json!({"role":"assistant","content":""})))
        .unwrap();
    body.frame().await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    tx.send(chunk(json!({"content":"Red"}))).unwrap();
    body.frame().await.unwrap().unwrap();
    let upper = u64::try_from(before.elapsed().as_millis()).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    tx.send(Bytes::from(format!(
        "data: {}\n\ndata: [DONE]\n\n",
        json!({"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]})
    )))
    .unwrap();
    drop(tx);
    drop(body.collect().await.unwrap());
    let st = s.settled().await;
    assert_eq!(st.outcome, StreamOutcome::Completed);
    let ttft = st.ttft_ms.unwrap();
    // after both sleeps (the role chunk does not count), before the content chunk was read
    assert!((250..=upper).contains(&ttft), "{ttft} not in 250..={upper}");
}

/// Issue 13's attacker, F7: a node that pads each chunk with megabytes the SDK does not show
/// (`delta.audio`) for a few billed tokens is cut past the stream's byte bound (1 MiB plus 8 KiB
/// a token of the cap) as at fault: `upstream_failed`, nothing billed.
#[tokio::test]
async fn a_stream_padded_with_megabytes_outside_the_text_is_cut_as_the_nodes_fault() {
    let padding = "x".repeat(600 * 1024);
    let events: Vec<serde_json::Value> = (0..4)
        .map(|_| {
            json!({"choices":[{"index":0,"delta":{"content":"a","audio":{"data":padding}},"finish_reason":null}]})
        })
        .chain([json!({"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]})])
        .collect();
    let mut s = setup().await;
    let resp = s
        .send(&chat(Some(16), true), "text/event-stream", sse(&events))
        .await;
    let got = resp.into_body().collect().await.unwrap().to_bytes();
    // the bound is 1 MiB + (16 + 16) × 8 KiB: the second 600 KiB chunk passes it
    assert!(got.len() < 2 * 1024 * 1024, "{} bytes delivered", got.len());
    // the caller's stream ends with the gateway's error event (code `upstream_failed`), no
    // `[DONE]`
    let text = String::from_utf8_lossy(&got);
    assert!(!text.contains("[DONE]"));
    let last = text
        .trim_end()
        .rsplit("\n\n")
        .next()
        .and_then(|ev| ev.strip_prefix("data: "))
        .unwrap();
    let last: Value = serde_json::from_str(last).unwrap();
    assert_eq!(last["error"]["code"], "upstream_failed", "{last}");
    // the record names the one token delivered before the cut ("a"); `upstream_failed` is
    // never paid
    let st = s.settled().await;
    assert_eq!(
        (st.outcome, st.billed.completion_tokens),
        (StreamOutcome::UpstreamFailed, 1)
    );
    // an honest stream of the same request is untouched
    let mut s = setup().await;
    let small: Vec<serde_json::Value> = vec![
        json!({"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}),
        json!({"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}),
    ];
    let resp = s
        .send(&chat(Some(16), true), "text/event-stream", sse(&small))
        .await;
    drop(resp.into_body().collect().await.unwrap());
    assert_eq!(s.settled().await.outcome, StreamOutcome::Completed);
}

/// Bills `answer` (a complete chat answer claiming `claimed` completion tokens) for `req` on a
/// fresh ledger: (billed completion tokens, whether a discrepancy was reported).
async fn billed_for(req: &Value, content: &str, claimed: u64) -> (u64, bool) {
    let mut s = setup().await;
    let resp = s
        .send(
            req,
            "application/json",
            full(
                &json!({"id":"c1","object":"chat.completion","choices":[{"index":0,
                "finish_reason":"stop","message":{"role":"assistant","content":content}}],
                "usage":{"prompt_tokens":PROMPT,"completion_tokens":claimed,
                         "total_tokens":PROMPT + claimed}}),
            ),
        )
        .await;
    drop(resp.into_body().collect().await.unwrap());
    let st = s.settled().await;
    assert_eq!(st.outcome, StreamOutcome::Completed);
    let flagged = !s.events.1.lock().unwrap().is_empty();
    (st.billed.completion_tokens, flagged)
}

/// Under a grammar (JSON mode) an honest engine may spell its text in more tokens than the
/// canonical count (measured on llama.cpp: up to +9 on natural `json_object` answers, 915 for
/// an array of booleans counting far fewer, 204 for a pinned 272-byte text that counts 62), and
/// llama.cpp's JSON answer drops up to 76 bytes of white space and fence around the JSON: the
/// node's claim is billed within one token per byte plus the EOS, a held-back tail and those
/// 76; a claim padded past that is billed at the bound and flagged. A `logit_bias` on a normal
/// token (no grammar) bounds it by `count + count / 8 + 16` plus the occurrences of the
/// token's text (bytes + 3 each).
#[tokio::test]
async fn a_grammar_bills_the_claim_within_the_measured_allowance() {
    let content = r#"{"name": "Tom", "colors": ["red", "green", "blue"], "count": 3}"#;
    let plain = chat(Some(400), false);
    let (count, flagged) = billed_for(&plain, content, 0).await;
    assert!(flagged, "an unconstrained claim of 0 is a discrepancy");
    let (billed, _) = billed_for(&plain, content, 400).await;
    assert_eq!(
        billed, count,
        "unconstrained: the count, whatever the claim"
    );

    let mut json_mode = plain.clone();
    json_mode["response_format"] = json!({"type": "json_object"});
    let most = count + 16 + count / 8;
    // an honest engine's few extra tokens are billed as claimed, unflagged
    assert_eq!(
        billed_for(&json_mode, content, count + 10).await,
        (count + 10, false)
    );
    assert_eq!(billed_for(&json_mode, content, most).await, (most, false));
    // a padded claim: billed at the bound, flagged
    let grammar_bound = content.len() as u64 + 4 + 76;
    assert_eq!(
        billed_for(&json_mode, content, 400).await,
        (grammar_bound, true)
    );
    // a claim below the count: the count
    assert_eq!(billed_for(&json_mode, content, 1).await.0, count);

    let mut banned = plain.clone();
    banned["logit_bias"] = json!({"1000": -100});
    let text = smollm_tokenizer().token_text(1000).unwrap();
    let pinned = content.matches(&*text).count() as u64 * (text.len() as u64 + 3);
    let bound = (most + pinned).min(content.len() as u64 + 4);
    let (billed, flagged) = billed_for(&banned, content, 400).await;
    assert_eq!((billed, flagged), (bound, true), "{text:?}");
    let (billed, flagged) = billed_for(&banned, content, bound).await;
    assert_eq!(
        (billed, flagged),
        (bound, false),
        "within the bound: the claim"
    );
}

/// A schema that pins the text (`const`) makes an honest llama.cpp spell it in pieces the
/// model would never choose: measured, 204 tokens generated (`stop`) for a 272-byte text that
/// counts 62. Billed within the measured allowance (`count + 16 + count / 8`) the caller got
/// 118 tokens free per request and the honest node was flagged as padding. And its JSON
/// answer drops white space around the JSON: a `pattern` schema delivered `"   "` (5 bytes)
/// for 25 tokens generated. Both are billed as claimed, unflagged.
#[tokio::test]
async fn a_grammar_pinning_its_text_bills_the_tokens_the_engine_generated() {
    let pinned = format!(
        "\"{}\"",
        "The quick brown fox jumps over the lazy dog. ".repeat(6)
    );
    let mut req = chat(Some(400), false);
    req["response_format"] = json!({"type":"json_schema","json_schema":{"name":"x",
        "schema":{"const":"The quick brown fox jumps over the lazy dog. ".repeat(6)}}});
    let (count, _) = billed_for(&chat(Some(400), false), &pinned, 0).await;
    assert!(count + 16 + count / 8 < 204, "{count}");
    assert_eq!(billed_for(&req, &pinned, 204).await, (204, false));
    req["response_format"] = json!({"type":"json_schema","json_schema":{"name":"x",
        "schema":{"type":"string","pattern":"^ +$"}}});
    assert_eq!(billed_for(&req, "\"   \"", 25).await, (25, false));
    // a caller who leaves before the end pays by the byte, as under token-level constraints
    let mut s = setup().await;
    let (tx, rx) = mpsc::unbounded_channel();
    let chunk = json!({"choices":[{"index":0,"delta":{"content":pinned},"finish_reason":null}]});
    tx.send(Bytes::from(format!("data: {chunk}\n\n"))).unwrap();
    req["stream"] = json!(true);
    let resp = s.send(&req, "text/event-stream", fed(rx)).await;
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(first.starts_with(b"data: "));
    drop(body);
    let st = s.settled().await;
    assert_eq!(st.outcome, StreamOutcome::ClientCancelled);
    drop(tx);
    assert_eq!(st.billed.completion_tokens, pinned.len() as u64 + 4);
}

/// A `stop` finish on a request with `stop` strings may have generated a matched stop string
/// the caller never gets (OpenAI's semantics; llama.cpp counts it in `usage`): the node's claim
/// is billed within the longest stop string's bytes + 1 of the count; a claim padded past that
/// is billed at the bound and flagged, and without stop strings the count is the bill.
#[tokio::test]
async fn a_stop_string_bills_the_claim_within_its_bytes() {
    let content = "The answer is 42.";
    let plain = chat(Some(400), false);
    let (count, _) = billed_for(&plain, content, 0).await;
    assert_eq!(billed_for(&plain, content, count + 30).await, (count, true));

    let mut with_stop = plain.clone();
    with_stop["stop"] = json!(["\n\n", "THE END OF THE STORY"]);
    let most = count + "THE END OF THE STORY".len() as u64 + 1;
    // an honest engine that generated the stop string: billed as claimed, unflagged
    assert_eq!(
        billed_for(&with_stop, content, count + 6).await,
        (count + 6, false)
    );
    assert_eq!(billed_for(&with_stop, content, most).await, (most, false));
    // padded past the longest stop string: billed at the bound, flagged
    assert_eq!(billed_for(&with_stop, content, 400).await, (most, true));
    // a claim below the count: the count
    assert_eq!(billed_for(&with_stop, content, 1).await.0, count);
    // one stop string as a plain string
    with_stop["stop"] = json!("THE END");
    assert_eq!(
        billed_for(&with_stop, content, 400).await,
        (count + "THE END".len() as u64 + 1, true)
    );
}

/// A JSON answer of 301 bytes, like the one a hostile node behind the real agent answered on
/// llama.cpp (305 bytes counting 69, claimed 382 and billed 382, unflagged, under a negligible
/// `logit_bias`).
const PADDED_JSON: &str = r#"{"city": "Paris", "country": "France", "population": 2102650, "landmarks": ["Eiffel Tower", "Louvre Museum", "Notre-Dame Cathedral", "Arc de Triomphe"], "description": "Paris is the capital of France, known for its art, fashion, gastronomy and culture.", "founded": "3rd century BC", "river": "Seine"}"#;

/// JSON's structure, pinned by no literal, is spelled in more tokens than its canonical count:
/// measured 2026-12-04 on the real llama.cpp behind the real agent, a schema of an array of
/// 200 booleans (`minItems` 200, default temperature) generated 915 tokens for 1,402 bytes of
/// `false, false, …`, which `count + count / 8 + 16` had billed at 620 and flagged (295 free
/// tokens for the caller, an honest node accused). Under a grammar, JSON mode and plain
/// schemas included, the honest claim is billed within the byte bound, unflagged.
#[tokio::test]
async fn json_modes_structure_is_billed_as_the_engine_generated_it() {
    let answer = format!("{{\"a\": [{}]}}", ["false"; 200].join(", "));
    let (count, _) = billed_for(&chat(Some(2000), false), &answer, 0).await;
    let claim = answer.len() as u64 * 2 / 3;
    assert!(
        claim > count + count / 8 + 16 + 76,
        "{claim} {count}: the claim must lie past the allowance for a count"
    );
    let schema = json!({"type":"object","properties":{"a":{"type":"array",
        "items":{"type":"boolean"},"minItems":200}},"required":["a"]});
    for constraint in [
        json!({"response_format": {"type": "json_object"}}),
        json!({"response_format": {"type":"json_schema","json_schema":{"name":"b","schema":schema}}}),
        json!({"json_schema": schema}),
        json!({"format": schema}),
    ] {
        let mut req = chat(Some(2000), false);
        for (k, v) in constraint.as_object().unwrap() {
            req[k] = v.clone();
        }
        assert_eq!(
            billed_for(&req, &answer, claim).await,
            (claim, false),
            "{constraint}"
        );
    }
}

/// A negligible `logit_bias` (`{"1234": -1}`) bounds the claim by the natural allowance plus
/// the occurrences of the biased token's text, not by the bytes.
#[tokio::test]
async fn a_tiny_logit_bias_padding_claim_is_clamped() {
    let (count, _) = billed_for(&chat(Some(800), false), PADDED_JSON, 0).await;
    let text = smollm_tokenizer().token_text(1234).unwrap();
    let pinned = PADDED_JSON.matches(&*text).count() as u64 * (text.len() as u64 + 3);
    let most = count + count / 8 + 16 + pinned;
    let padded = PADDED_JSON.len() as u64 + 4;
    assert!(most < padded, "{most} {padded} {text:?}");
    let mut req = chat(Some(800), false);
    req["logit_bias"] = json!({"1234": -1});
    assert_eq!(billed_for(&req, PADDED_JSON, padded).await, (most, true));
    assert_eq!(billed_for(&req, PADDED_JSON, most).await, (most, false));
}

/// +100 on the one-letter token `e` makes an honest llama.cpp emit `e` token after token:
/// measured, 400 tokens generated for a 400-byte text that counts 200. Each `e` is a pinned
/// text (1 byte + 3): the claim is billed as made.
#[tokio::test]
async fn a_bias_on_a_one_letter_token_bills_the_tokens_generated() {
    let t = smollm_tokenizer();
    let e = (0..60_000u32)
        .find(|id| t.token_text(*id).as_deref() == Some("e"))
        .unwrap();
    let text = "e".repeat(400);
    let mut req = chat(Some(400), false);
    req["logit_bias"] = json!({ e.to_string(): 100 });
    assert_eq!(billed_for(&req, &text, 400).await, (400, false));
}

/// A schema with a keyword that can pin any text (`pattern`, `format`, `anyOf`, ...) keeps
/// the byte bound: `"^ +$"` made an honest llama.cpp spell `"   "` in 25 tokens.
#[tokio::test]
async fn a_schema_with_a_pattern_keeps_the_byte_bound() {
    let mut req = chat(Some(800), false);
    req["response_format"] = json!({"type":"json_schema","json_schema":{"name":"x",
        "schema":{"type":"object","properties":{"a":{"type":"string","pattern":"^x+$"}}}}});
    let answer = format!(r#"{{"a": "{}"}}"#, "x".repeat(200));
    let bound = answer.len() as u64 + 4 + 76;
    assert_eq!(billed_for(&req, &answer, bound).await, (bound, false));
    req["response_format"] = json!({"type":"json_schema","json_schema":{"name":"x",
        "schema":{"anyOf":[{"const":"a"},{"type":"string"}]}}});
    assert_eq!(billed_for(&req, &answer, bound).await, (bound, false));
}
