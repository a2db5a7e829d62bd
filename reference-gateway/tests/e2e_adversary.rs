//! An adversary's review, end to end through the real binaries (gateway → TLS tunnel → agent)
//! in front of a hostile fake engine speaking real HTTP: what a node can make the gateway do
//! that an honest engine never would.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    add_node, full, gateway_with_node, header, post_json, serve_fake_llama, sse, sse_data, tenant,
    Gateway,
};
use hyper::body::Frame;
use serde_json::{json, Value};
use spine_test_support::Engine;

fn chunk(choice: &Value) -> String {
    format!(
        "data: {}\n\n",
        json!({"id":"x","object":"chat.completion.chunk","created":1,"model":"smollm2",
            "choices":[choice]})
    )
}

/// Sets its flag when dropped: the engine's response body went away.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Posts a streamed chat and reads the whole answer (at most 60 s): `(request id, status,
/// data payloads, how long it took)`.
async fn stream_chat(
    gw: &Gateway,
    key: &str,
    body: &Value,
) -> (String, u16, Vec<String>, Duration) {
    let started = Instant::now();
    let mut resp = gw.api_post(key, "/v1/chat/completions", body).await;
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let status = resp.status().as_u16();
    let mut got = Vec::new();
    let read = async {
        while let Ok(Some(c)) = resp.chunk().await {
            got.extend_from_slice(&c);
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(60), read).await;
    let text = String::from_utf8_lossy(&got).into_owned();
    (id, status, sse_data(&text), started.elapsed())
}

/// A node that streams one token and `finish_reason: "stop"`, then repeats the same finished
/// chunk every 100 ms forever: no new text, nothing but a finish it already sent. That is no
/// progress, and the stream must be cut at `stream_idle_timeout_secs` as a stream kept alive
/// with empty deltas is (`e2e_stall`); instead each repeated finish counts as progress and the
/// caller's stream (and the node's slot) is held until `max_stream_duration_secs` (an hour by
/// default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_repeating_its_finish_without_end_is_cut_as_stalled() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start_with(dir.path(), &engine, "stream_idle_timeout_secs = 2").await;
    let dropped = Arc::new(AtomicBool::new(false));
    let flag = dropped.clone();
    let (url, task) = serve_fake_llama(move |path, _body| {
        let flag = flag.clone();
        async move {
            if path != "/v1/chat/completions" {
                return full(404, "application/json", r#"{"error":"not found"}"#.into());
            }
            let guard = DropFlag(flag);
            let frames = futures_util::stream::unfold((0usize, guard), move |(n, guard)| async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let frame = match n {
                    0 => chunk(&json!({"index":0,"delta":{"role":"assistant","content":"Hello"},"finish_reason":null})),
                    _ => chunk(&json!({"index":0,"delta":{},"finish_reason":"stop"})),
                };
                Some((
                    Ok::<_, std::io::Error>(Frame::data(Bytes::from(frame))),
                    (n + 1, guard),
                ))
            });
            sse(frames)
        }
    })
    .await;
    let t = tenant(&gw).await;
    let (_node, _agent) = add_node(&gw, dir.path(), &t.operator, &url, "refinish").await;
    let body = json!({"model":"smollm2","messages":[{"role":"user","content":"Say hi."}],
        "stream":true,"max_tokens":8});
    let (id, status, events, took) = stream_chat(&gw, &t.api_key, &body).await;
    assert_eq!(status, 200);
    assert!(
        took < Duration::from_secs(15),
        "a stream repeating its finish was held {took:?} ({} events) past the 2 s progress bound",
        events.len()
    );
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_failed", "{events:?}");
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    gw.failed_unbilled(&id).await;
    // the engine's request was dropped
    for _ in 0..100 {
        if dropped.load(Ordering::SeqCst) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        dropped.load(Ordering::SeqCst),
        "the engine request was never dropped"
    );
    task.abort();
}

/// A node that answers `n: 1` with a second choice of index 0 beside the first: the caller's
/// SDK reads `choices[0]` ("Paris.", 3 tokens), yet the bill counted the hidden one's 100
/// tokens of padding too (seen: billed 104 completion tokens, the operator paid its share;
/// the claim of 3 flagged, but the money moved). Streamed, the same two choices in one chunk:
/// a client printing `chunk.choices[0].delta.content` never sees the second. Either is the
/// node's fault: refused, nothing paid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_padding_a_duplicate_choice_index_is_not_paid_for_it() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    let pad = "pad ".repeat(100);
    let (url, _task) = serve_fake_llama(move |_path, body| {
        let pad = pad.clone();
        async move {
            let v: Value = serde_json::from_slice(&body).unwrap_or_default();
            if v["stream"] == true {
                let mut out = format!(
                    "data: {}\n\n",
                    json!({"id":"x","object":"chat.completion.chunk","created":1,"model":"smollm2","choices":[
                        {"index":0,"delta":{"role":"assistant","content":"Paris."},"finish_reason":null},
                        {"index":0,"delta":{"content":pad},"finish_reason":null}]})
                );
                out.push_str(&chunk(&json!({"index":0,"delta":{},"finish_reason":"stop"})));
                out.push_str("data: [DONE]\n\n");
                return full(200, "text/event-stream", out);
            }
            let msg = |text: &str| json!({"index":0,"message":{"role":"assistant","content":text},"finish_reason":"stop"});
            full(200, "application/json", json!({"id":"p","object":"chat.completion","created":1,"model":"smollm2",
                "choices":[msg("Paris."), msg(&pad)],
                "usage":{"prompt_tokens":20,"completion_tokens":3,"total_tokens":23}}).to_string())
        }
    })
    .await;
    let t = tenant(&gw).await;
    let (_node, _agent) = add_node(&gw, dir.path(), &t.operator, &url, "dup").await;
    for streamed in [false, true] {
        let body = json!({"model":"smollm2","messages":[{"role":"user","content":"Hi"}],
            "max_tokens":1000,"stream":streamed});
        let resp = gw.api_post(&t.api_key, "/v1/chat/completions", &body).await;
        let status = resp.status().as_u16();
        let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        let answer = resp.text().await.unwrap();
        let rec = gw.record(&id).await;
        assert_eq!(
            rec["outcome"], "upstream_failed",
            "streamed {streamed}: {rec}\n{answer}"
        );
        assert_eq!(rec["debit_micros"], 0, "{rec}");
        if streamed {
            assert_eq!(status, 200);
            let last: Value = serde_json::from_str(sse_data(&answer).last().unwrap()).unwrap();
            assert_eq!(last["error"]["code"], "upstream_failed", "{answer}");
        } else {
            assert_eq!(status, 502, "{answer}");
            let e: Value = serde_json::from_str(&answer).unwrap();
            assert!(e["error"]["message"].is_string(), "{answer}");
        }
    }
    assert_eq!(
        gw.balance_once_released(&t.account).await,
        (common::CREDITS, 0)
    );
    assert_eq!(gw.earned(&t.operator).await, 0);
}

/// A caller with little credit fires many streamed requests at once, and leaves some of them
/// mid-stream: the balance never goes below zero, every hold is released, and the ledger
/// balances (Σ debits = what the account paid = operator credits + fees).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_with_little_credit_cannot_overdraw_in_parallel() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    // a slow honest-looking stream: 40 words, one every 20 ms
    let (url, _task) = serve_fake_llama(move |_path, _body| async move {
        let frames = futures_util::stream::unfold(0usize, move |n| async move {
            if n > 42 {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            let frame = match n {
                0..=39 => chunk(&json!({"index":0,"delta":{"content":" word"},"finish_reason":null})),
                40 => chunk(&json!({"index":0,"delta":{},"finish_reason":"stop"})),
                41 => format!("data: {}\n\n", json!({"id":"x","object":"chat.completion.chunk","created":1,"model":"smollm2","choices":[],
                    "usage":{"prompt_tokens":31,"completion_tokens":41,"total_tokens":72}})),
                _ => "data: [DONE]\n\n".to_owned(),
            };
            Some((Ok::<_, std::io::Error>(Frame::data(Bytes::from(frame))), n + 1))
        });
        sse(frames)
    })
    .await;
    let t = tenant(&gw).await;
    let (_node, _agent) =
        common::add_node_with(&gw, dir.path(), &t.operator, &url, "slow", 64).await;
    // each request holds ≤ 31·0.15 + 64·0.6 ≈ 43 micros; 300 micros pays for about 7 at once
    let (account, key) = common::account_with_credit(&gw, 300).await;
    let mut tasks = Vec::new();
    for i in 0..40 {
        let http = gw.http.clone();
        let url = format!("{}/v1/chat/completions", gw.public);
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            let body = json!({"model":"smollm2","messages":[{"role":"user","content":"Say hi."}],
                "stream":true,"max_tokens":64});
            let mut resp = post_json(&http, &url, &key, &body).await;
            let status = resp.status().as_u16();
            let id = header(&resp, "x-request-id");
            let mut got = 0;
            while let Ok(Some(c)) = resp.chunk().await {
                got += c.len();
                // every third caller leaves mid-stream
                if i % 3 == 0 && got > 600 {
                    break;
                }
            }
            (status, id)
        }));
    }
    let mut ok = Vec::new();
    let mut refused = 0;
    for task in tasks {
        let (status, id) = task.await.unwrap();
        match status {
            200 => ok.push(id.unwrap()),
            402 | 429 => refused += 1,
            s => panic!("status {s}"),
        }
    }
    let (balance, held) = gw.balance_once_released(&account).await;
    eprintln!(
        "{} served, {refused} refused; balance {balance}, held {held}",
        ok.len()
    );
    assert_eq!(held, 0);
    let mut debits = 0u64;
    for id in &ok {
        let rec = gw.record(id).await;
        debits += rec["debit_micros"].as_u64().unwrap();
        assert!(
            rec["debit_micros"].as_u64() <= rec["hold_micros"].as_u64(),
            "{rec}"
        );
    }
    assert_eq!(
        300 - balance,
        debits,
        "the account paid other than its debits"
    );
    let ledger = common::LedgerDb::open(dir.path(), None).await;
    assert_eq!(
        ledger
            .int("SELECT COUNT(*) FROM holds WHERE state = 'held'")
            .await,
        0
    );
    assert_eq!(
        ledger
            .int("SELECT CAST(COALESCE(SUM(amount_micros), 0) AS BIGINT) FROM ledger_entries")
            .await,
        0
    );
}

/// A gateway with one node on a real llama-server (2 slots), and a tenant.
struct OneNode {
    gw: Gateway,
    t: common::Tenant,
    node: String,
    _agent: spine_test_support::Child,
    _llama: spine_test_support::LlamaServer,
    _dir: tempfile::TempDir,
}

impl OneNode {
    async fn start() -> Self {
        let engine = Engine::discover().unwrap();
        let llama = spine_test_support::LlamaServer::start(&engine, 2)
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (gw, t, node, agent) = gateway_with_node(dir.path(), &engine, &llama.url, "node").await;
        Self {
            gw,
            t,
            node,
            _agent: agent,
            _llama: llama,
            _dir: dir,
        }
    }

    /// Posts `body`; asserts a 400 `invalid_request_error` naming `param`, the request never
    /// served (a 200 panics with its record).
    async fn assert_refused(&self, path: &str, body: &Value, param: &str) {
        let resp = self.gw.api_post(&self.t.api_key, path, body).await;
        let status = resp.status().as_u16();
        let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        let answer = resp.text().await.unwrap();
        if status == 200 {
            let rec = self.gw.record(&id).await;
            panic!("{path} {body}: served: {answer}\nrecord: {rec}");
        }
        assert_eq!(status, 400, "{body}: {answer}");
        let e: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(e["error"]["param"], param, "{answer}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{answer}");
    }
}

/// A caller raises a control token with `logit_bias` (`{"3": 100}`: `<repo_name>`, special in
/// SmolLM2's vocabulary, not an end-of-generation token). The honest llama.cpp then generates
/// `max_tokens` of it, each rendered as no text: measured, 50 tokens, `content: ""`,
/// `finish_reason: "length"`, its usage 50. The gateway counted the request unconstrained (a
/// bias on special tokens only is taken for an EOS ban) and billed what it saw: 0 completion
/// tokens, and flagged the honest node's `length` as unsupported by its text (a discrepancy
/// that lowers its score). A caller could so get the work free and mark every node a liar.
/// Raising a control token is refused before any node (400 naming `logit_bias`), as is a bias
/// on an id past the vocabulary; banning a control token (the EOS ban) is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_raising_a_control_token_is_refused_before_any_node() {
    let one = OneNode::start().await;
    for (path, bias) in [
        ("/v1/chat/completions", json!({"3": 100})),
        ("/v1/chat/completions", json!({" 3": 100})),
        ("/v1/chat/completions", json!([[3, 100]])),
        // llama.cpp reads each of these as token 3 too (`strtol` into a 32-bit token, a key
        // cut at its NUL, an array id cast to 32 bits): measured, 20 tokens of no text each
        ("/v1/chat/completions", json!({"4294967299": 100})),
        ("/v1/chat/completions", json!({"-4294967293": 100})),
        ("/v1/chat/completions", json!({"3\u{0}": 100})),
        ("/v1/chat/completions", json!([[4_294_967_299u64, 100]])),
        ("/v1/completions", json!({"1": 50})),
        // ids past SmolLM2's 49,152: llama.cpp ignores them, the meter would read them as
        // tokens it cannot spell and bill the claim within the loosest bound (GPT-2's EOS,
        // 50256, is a ban clients send out of habit; a hostile node was paid 800 for 159)
        ("/v1/chat/completions", json!({"50256": -100})),
        ("/v1/completions", json!({"49152": -100})),
    ] {
        let mut body = if path == "/v1/completions" {
            json!({"model":"smollm2","prompt":"Say hi"})
        } else {
            json!({"model":"smollm2","messages":[{"role":"user","content":"Say hi"}]})
        };
        body["max_tokens"] = json!(50);
        body["logit_bias"] = bias;
        one.assert_refused(path, &body, "logit_bias").await;
    }
    let (gw, t, node) = (&one.gw, &one.t, &one.node);
    // the EOS ban is served and billed as an unconstrained request; the node is not flagged
    let body = json!({"model":"smollm2","messages":[{"role":"user","content":"Say hi"}],
        "max_tokens":20,"logit_bias":{"2": -100}});
    let resp = gw.api_post(&t.api_key, "/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let _ = resp.text().await.unwrap();
    let rec = gw.record(&id).await;
    assert_eq!(rec["outcome"], "completed", "{rec}");
    assert_eq!(rec["discrepancy"], false, "{rec}");
    assert_eq!(gw.node(node).await["discrepancies"], 0);
}

/// The same through llama.cpp's grammar: GBNF names tokens (`<[3]>`, `<|im_end|>`), so
/// `root ::= ("a" <[3]>)+` with the end-of-generation tokens banned made the honest engine
/// generate `max_tokens` (50) tokens delivering 25 bytes of `a` (measured, usage 50,
/// `length`). Billed as a grammar on the text, the gateway paid count + 16 and flagged the
/// honest node's `length` as unsupported. A grammar naming tokens is a token-level
/// constraint the gateway cannot meter: refused before any node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grammar_naming_tokens_is_refused_before_any_node() {
    let one = OneNode::start().await;
    for grammar in [
        r#"root ::= ("a" <[3]>)+"#,
        r#"root ::= ("a" <repo_name>)+"#,
        "root ::= (\"a\" !<[97]>)+",
    ] {
        let body = json!({"model":"smollm2","messages":[{"role":"user","content":"Say hi"}],
            "max_tokens":50,"grammar":grammar,"logit_bias":{"0":-100,"2":-100}});
        one.assert_refused("/v1/chat/completions", &body, "grammar")
            .await;
    }
    let (gw, t) = (&one.gw, &one.t);
    // a grammar on characters only (`<` inside a literal or a class is a character) is served
    let body = json!({"model":"smollm2","messages":[{"role":"user","content":"Say hi"}],
        "max_tokens":8,"grammar":"root ::= \"<[3]>\" [<>a-z]+ # <x>\n"});
    let resp = gw.api_post(&t.api_key, "/v1/chat/completions", &body).await;
    let status = resp.status();
    let answer = resp.text().await.unwrap();
    assert_eq!(status, 200, "{answer}");
}

/// Tool calls in shapes OpenAI's SDKs cannot read: `function.arguments` an object (seen:
/// delivered to the caller as is, a chunk outside OpenAI's shape, billed only the name's
/// tokens, 2), a streamed `index` that is a string (seen: delivered, billed 103). Each is the
/// node's fault: the stream ends with the error event, nothing paid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_outside_openais_shape_are_the_nodes_fault() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    let (url, _task) = serve_fake_llama(move |_path, body| async move {
        let v: Value = serde_json::from_slice(&body).unwrap_or_default();
        let pad = "pad ".repeat(100);
        let call = match v["user"].as_str() {
            Some("object-arguments") => {
                json!({"index":0,"id":"c1","type":"function","function":{"name":"f","arguments":{"a":pad}}})
            }
            _ => json!({"index":"0","id":"c1","type":"function","function":{"name":"f","arguments":pad}}),
        };
        if v["stream"] == true {
            let mut out = chunk(&json!({"index":0,"delta":{"role":"assistant","tool_calls":[call]},"finish_reason":null}));
            out.push_str(&chunk(&json!({"index":0,"delta":{},"finish_reason":"tool_calls"})));
            out.push_str("data: [DONE]\n\n");
            return full(200, "text/event-stream", out);
        }
        let mut call = call;
        call.as_object_mut().unwrap().remove("index");
        full(200, "application/json", json!({"id":"p","object":"chat.completion","created":1,"model":"smollm2",
            "choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[call]},"finish_reason":"tool_calls"}]}).to_string())
    })
    .await;
    let t = tenant(&gw).await;
    let (_node, _agent) = add_node(&gw, dir.path(), &t.operator, &url, "tools").await;
    for (user, streamed) in [
        ("object-arguments", true),
        ("object-arguments", false),
        ("string-index", true),
    ] {
        let body = json!({"model":"smollm2","messages":[{"role":"user","content":"Hi"}],
            "max_tokens":1000,"stream":streamed,"user":user,
            "tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]});
        let resp = gw.api_post(&t.api_key, "/v1/chat/completions", &body).await;
        let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        let answer = resp.text().await.unwrap();
        let rec = gw.record(&id).await;
        assert_eq!(
            rec["outcome"], "upstream_failed",
            "{user} {streamed}: {rec}\n{answer}"
        );
        assert_eq!(rec["debit_micros"], 0, "{rec}");
    }
    assert_eq!(gw.earned(&t.operator).await, 0);
}

/// A `/v1/completions` request to a real llama-server through the gateway: prompt `1, 2, …, 29`,
/// `temperature` 0, one stop string `", 30, 31, …, {last}"`. Returns the request's record and
/// the node's discrepancy count.
async fn stop_string_run(last: u32, max_tokens: u32, stream: bool) -> (Value, u64) {
    let one = OneNode::start().await;
    let (gw, t) = (&one.gw, &one.t);
    let list = |from: u32, to: u32| {
        (from..to)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let body = json!({"model":"smollm2","prompt":list(1, 30),"max_tokens":max_tokens,
        "temperature":0,"stop":[format!(", {}", list(30, last))],"stream":stream});
    let resp = gw.api_post(&t.api_key, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let answer = resp.text().await.unwrap();
    let rec = gw.record(&id).await;
    assert_eq!(rec["outcome"], "completed", "{rec}\n{answer}");
    let discrepancies = gw.node(&one.node).await["discrepancies"].as_u64().unwrap();
    (rec, discrepancies)
}

/// A caller whose `stop` string the answer keeps matching in part: llama.cpp holds back a
/// partial stop-string match while streaming and, when generation ends on `max_tokens`, never
/// sends it. Measured on the honest engine: `/v1/completions`, prompt `1, 2, …, 29`,
/// `max_tokens` 30, `temperature` 0, `stop` `[", 30, 31, …, 199"]`, streamed: no text at all,
/// `finish_reason: "length"`, usage 30 completion tokens (non-streamed, the same request
/// delivers `, 30, 31, …, 36, `). The gateway billed 0 completion tokens and flagged the honest
/// node (a `length` finish whose 0 bytes cannot be 30 tokens): any caller could so mark every
/// node a liar and have its work for nothing. The `length` rule now allows for the longest
/// stop string held back, and the claim is billed within it. (Stop sequences are now at most
/// 128 bytes: the run uses `", 30, 31, …, 59"`, 120 bytes, which the 30 tokens never pass.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_held_back_does_not_flag_an_honest_node() {
    let (rec, discrepancies) = stop_string_run(60, 30, true).await;
    assert_eq!(rec["claimed"]["completion_tokens"], 30, "{rec}");
    // the tokens it generated are paid: the held-back text was the caller's stop string
    assert_eq!(rec["billed"]["completion_tokens"], 30, "{rec}");
    assert_eq!(rec["discrepancy"], false, "an honest node flagged: {rec}");
    assert_eq!(discrepancies, 0);
}

/// The same stop string matched whole: the engine generates it and counts it, but never sends
/// it. Measured on the honest engine, non-streamed: prompt `1, 2, …, 29`, `max_tokens` 200,
/// `stop` `[", 30, 31, …, 59"]`: text `""`, `finish_reason: "stop"`, usage 120 completion
/// tokens. The gateway billed 1 (the EOS rule) and flagged the honest node (claim 120). The caller
/// learned for one token that the model generates its stop string (a scoring oracle, what
/// refusing `echo: true` keeps from it) and marked the node a liar. A `stop` finish on a
/// request with `stop` strings now bills the claim within the longest one's bytes + 1
/// (`docs/metering.md` §2, "Stop strings").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_matched_whole_is_paid_and_does_not_flag_an_honest_node() {
    let (rec, discrepancies) = stop_string_run(60, 200, false).await;
    let claimed = rec["claimed"]["completion_tokens"].as_u64().unwrap();
    assert!(claimed > 100, "{rec}");
    assert_eq!(rec["discrepancy"], false, "an honest node flagged: {rec}");
    // within the longest stop string's bytes + 1 of the text's count: the claim, exactly
    assert_eq!(
        rec["billed"]["completion_tokens"].as_u64().unwrap(),
        claimed,
        "{claimed} tokens generated, billed {rec}"
    );
    assert_eq!(discrepancies, 0);
}
