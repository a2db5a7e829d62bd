//! Issue 13 end to end: a caller who wants free tokens and a node that pads its bill, through the
//! real binaries (gateway → TLS tunnel → agent) in front of the real llama.cpp engine and a
//! padding fake engine speaking real HTTP.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod common;

use std::time::Duration;

use common::{
    full, gateway_with_node, json_of, serve_fake_llama, sse_data, EngineCounter, Gateway,
};
use serde_json::{json, Value};
use spine_core::ENGINE_GENERATION_FIELDS;
use spine_meter::tokenizer::length_allowance_tokens;
use spine_meter::ModelTokenizer;
use spine_test_support::{Engine, LlamaServer};

/// Every choice's delivered text of a chat or completions answer, streamed or not.
fn delivered(body: &str, streamed: bool) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut push = |c: &Value, text: &str| {
        let i = c["index"].as_u64().unwrap() as usize;
        if out.len() <= i {
            out.resize(i + 1, String::new());
        }
        out[i].push_str(text);
    };
    if streamed {
        for data in sse_data(body) {
            if data == "[DONE]" {
                continue;
            }
            let chunk: Value = serde_json::from_str(&data).unwrap();
            for c in chunk["choices"].as_array().into_iter().flatten() {
                let text = c["delta"]["content"]
                    .as_str()
                    .or(c["text"].as_str())
                    .unwrap_or("");
                push(c, text);
            }
        }
    } else {
        let v: Value = serde_json::from_str(body).unwrap();
        for c in v["choices"].as_array().unwrap() {
            let text = c["message"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .unwrap_or("");
            push(c, text);
        }
    }
    out
}

/// POSTs the chat `body` (`streamed` as it says) with `api_key`, asserts a 200 and returns
/// choice 0's delivered text and the request's record.
async fn chat_and_record(
    gw: &Gateway,
    api_key: &str,
    body: &Value,
    streamed: bool,
) -> (String, Value) {
    let resp = gw.api_post(api_key, "/v1/chat/completions", body).await;
    assert_eq!(resp.status(), 200, "streamed {streamed}: {body}");
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let text = resp.text().await.unwrap();
    let got = delivered(&text, streamed).remove(0);
    (got, gw.record(&id).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_aliases_are_refused_and_nothing_is_delivered_beyond_the_bill() {
    let engine = Engine::discover().unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (gw, t, _node, _agent) = gateway_with_node(dir.path(), &engine, &llama.url, "node").await;
    let (balance_before, _) = gw.balance(&t.account).await;

    // every engine field that changes how many tokens or choices are generated: a 400, never
    // forwarded, nothing held or billed
    for field in ENGINE_GENERATION_FIELDS {
        for (path, streamed) in [
            ("/v1/chat/completions", false),
            ("/v1/chat/completions", true),
            ("/v1/completions", false),
            ("/v1/completions", true),
        ] {
            let mut body = if path == "/v1/completions" {
                json!({"model":"smollm2","prompt":"Once upon a time","max_tokens":1})
            } else {
                json!({"model":"smollm2","messages":[{"role":"user","content":"Tell a story."}],"max_tokens":1})
            };
            body["stream"] = json!(streamed);
            body[field] = if field == "options" {
                json!({"num_predict": 300})
            } else if field == "ignore_eos" || field == "use_beam_search" {
                json!(true)
            } else {
                json!(300)
            };
            let resp = gw.api_post(&t.api_key, path, &body).await;
            assert_eq!(resp.status(), 400, "{field} {path}");
            let e: Value = resp.json().await.unwrap();
            assert_eq!(e["error"]["code"], "unsupported_parameter", "{field}: {e}");
            assert!(
                e["error"]["message"].as_str().unwrap().contains(field),
                "{field}: {e}"
            );
            assert_eq!(e["error"]["param"], field, "{e}");
        }
    }
    // the OpenAI fields that would let an engine pick another limit, or send the prompt back
    // as generated text: `echo`, a 0 limit (SGLang falls through to the other), two limits
    // that disagree
    for (extra, code, param) in [
        (json!({"echo": true}), "unsupported_parameter", "echo"),
        (json!({"max_tokens": 0}), "invalid_request", "max_tokens"),
        (
            json!({"max_completion_tokens": 0, "max_tokens": 300}),
            "invalid_request",
            "max_completion_tokens",
        ),
        (
            json!({"max_completion_tokens": 1, "max_tokens": 300}),
            "invalid_request",
            "max_tokens",
        ),
        // answers too large for the gateway's buffer were work the caller never paid for
        (
            json!({"logprobs": true, "top_logprobs": 49152}),
            "invalid_request",
            "top_logprobs",
        ),
        (json!({"n_probs": 100}), "unsupported_parameter", "n_probs"),
        // OpenAI's bound on n: 2^31 placed a hold of 10.5e12 µ
        (json!({"n": 129}), "invalid_request", "n"),
        (json!({"n": 2_147_483_648u64}), "invalid_request", "n"),
        // a limit engines would read as a wrapped 32-bit integer
        (
            json!({"max_tokens": 4_294_967_297u64}),
            "invalid_request",
            "max_tokens",
        ),
    ] {
        for path in ["/v1/chat/completions", "/v1/completions"] {
            let mut body = if path == "/v1/completions" {
                json!({"model":"smollm2","prompt":"Once upon a time"})
            } else {
                json!({"model":"smollm2","messages":[{"role":"user","content":"Tell a story."}]})
            };
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            let resp = gw.api_post(&t.api_key, path, &body).await;
            assert_eq!(resp.status(), 400, "{extra} {path}");
            let e: Value = resp.json().await.unwrap();
            assert_eq!(e["error"]["code"], code, "{extra}: {e}");
            assert!(
                e["error"]["message"].as_str().unwrap().contains(param),
                "{extra}: {e}"
            );
            assert_eq!(e["error"]["param"], param, "{extra}: {e}");
        }
    }
    assert_eq!(gw.balance(&t.account).await, (balance_before, 0));

    // what the engine then delivers is never more than what is billed, counted by the engine
    for (path, streamed, extra) in [
        ("/v1/chat/completions", false, json!({"max_tokens": 1})),
        ("/v1/chat/completions", true, json!({"max_tokens": 1})),
        ("/v1/chat/completions", true, json!({"max_tokens": 24})),
        ("/v1/completions", false, json!({"max_tokens": 3, "n": 2})),
        ("/v1/completions", true, json!({"max_tokens": 3, "n": 2})),
    ] {
        let mut body = if path == "/v1/completions" {
            json!({"model":"smollm2","prompt":"Once upon a time"})
        } else {
            json!({"model":"smollm2","messages":[{"role":"user","content":"Tell a long story."}]})
        };
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body["stream"] = json!(streamed);
        let resp = gw.api_post(&t.api_key, path, &body).await;
        assert_eq!(resp.status(), 200, "{body}");
        let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        let text = resp.text().await.unwrap();
        let choices = delivered(&text, streamed);
        let n = body["n"].as_u64().unwrap_or(1) as usize;
        assert!(
            choices.len() <= n,
            "{path}: {} choices for n {n}",
            choices.len()
        );
        let counter = EngineCounter {
            url: llama.url.clone(),
            http: reqwest::Client::new(),
        };
        let mut engine_count = 0;
        for c in &choices {
            // the engine's own tokenizer (`/tokenize`)
            engine_count += counter.tokens(c).await;
        }
        let rec = gw.record(&id).await;
        assert_eq!(rec["outcome"], "completed", "{rec}");
        let billed = rec["billed"]["completion_tokens"].as_u64().unwrap();
        assert!(
            engine_count <= billed,
            "{path} {extra}: delivered {engine_count} tokens, billed {billed}: {rec}"
        );
        let max = body["max_tokens"].as_u64().unwrap() * n as u64;
        assert!(billed <= max, "{rec}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_padding_length_finishes_is_billed_by_the_delivered_text() {
    let engine = Engine::discover().unwrap();
    let tok = ModelTokenizer::from_gguf(&engine.model_gguf).unwrap();
    let padding = "x".repeat(1000);
    let pad = padding.clone();
    // a node that answers every chat with 1,000 × "x" and finish_reason "length", claiming
    // max_tokens (1,000) completion tokens, streamed and not
    let (url, _task) = serve_fake_llama(move |_path, body| {
        let pad = pad.clone();
        async move {
            let v: Value = serde_json::from_slice(&body).unwrap();
            let usage = json!({"prompt_tokens": 20, "completion_tokens": 1000, "total_tokens": 1020});
            if v["stream"] == true {
                let mut out = String::new();
                for piece in pad.as_bytes().chunks(100) {
                    let chunk = json!({"id":"p","object":"chat.completion.chunk","created":1,"model":"smollm2",
                        "choices":[{"index":0,"delta":{"content":std::str::from_utf8(piece).unwrap()},"finish_reason":null}]});
                    out.push_str(&format!("data: {chunk}\n\n"));
                }
                let fin = json!({"id":"p","object":"chat.completion.chunk","created":1,"model":"smollm2",
                    "choices":[{"index":0,"delta":{},"finish_reason":"length"}],"usage":usage});
                out.push_str(&format!("data: {fin}\n\ndata: [DONE]\n\n"));
                return full(200, "text/event-stream", out);
            }
            let answer = json!({"id":"p","object":"chat.completion","created":1,"model":"smollm2",
                "choices":[{"index":0,"message":{"role":"assistant","content":pad},"finish_reason":"length"}],
                "usage":usage});
            full(200, "application/json", answer.to_string())
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let (gw, t, _node, _agent) = gateway_with_node(dir.path(), &engine, &url, "padder").await;
    let text_tokens = tok.count_text(&padding);
    let want = text_tokens + length_allowance_tokens(1000);
    assert!(want < 1000, "{want}");
    for streamed in [false, true] {
        let body = json!({"model":"smollm2","messages":[{"role":"user","content":"Hi"}],
            "max_tokens":1000,"stream":streamed});
        let resp = gw.api_post(&t.api_key, "/v1/chat/completions", &body).await;
        assert_eq!(resp.status(), 200);
        let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        let _ = resp.text().await.unwrap();
        let mut rec = gw.record(&id).await;
        for _ in 0..100 {
            if rec["outcome"].is_string() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            rec = gw.record(&id).await;
        }
        assert_eq!(rec["outcome"], "completed", "{rec}");
        assert_eq!(
            rec["billed"]["completion_tokens"].as_u64(),
            Some(want),
            "streamed {streamed}: {rec}"
        );
        assert_eq!(rec["claimed"]["completion_tokens"].as_u64(), Some(1000));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_streaming_a_gibibyte_is_cut_at_its_bound_with_bounded_gateway_memory() {
    use bytes::Bytes;
    use hyper::body::Frame;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let engine = Engine::discover().unwrap();
    let sent = Arc::new(AtomicU64::new(0));
    let counter = sent.clone();
    // a node that streams content without end, up to 1 GiB, in 64 KiB events
    let (url, _task) = serve_fake_llama(move |_path, _body| {
        let counter = counter.clone();
        async move {
            let text = "lorem ipsum dolor sit amet ".repeat(64 * 1024 / 27);
            let chunk = json!({"id":"g","object":"chat.completion.chunk","created":1,"model":"smollm2",
                "choices":[{"index":0,"delta":{"content":text},"finish_reason":null}]});
            let event = Bytes::from(format!("data: {chunk}\n\n"));
            let total = (1u64 << 30) / event.len() as u64;
            let stream = futures_util::stream::iter((0..total).map(move |_| {
                counter.fetch_add(event.len() as u64, Ordering::Relaxed);
                Ok::<_, std::io::Error>(Frame::data(event.clone()))
            }));
            common::sse(stream)
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let (gw, t, _node, _agent) = gateway_with_node(dir.path(), &engine, &url, "flood").await;
    // warm up the paths once with an honest-size answer cut the same way
    let body = json!({"model":"smollm2","messages":[{"role":"user","content":"Hi"}],
        "max_tokens":1000,"stream":true});
    let before = gw.rss_kib();
    let mut peak = before;
    let resp = gw.api_post(&t.api_key, "/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let mut resp = resp;
    let mut got = Vec::new();
    while let Some(chunk) = resp.chunk().await.unwrap() {
        got.extend_from_slice(&chunk);
        peak = peak.max(gw.rss_kib());
    }
    peak = peak.max(gw.rss_kib());
    let text = String::from_utf8(got).unwrap();
    let last: Value = serde_json::from_str(sse_data(&text).last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_failed", "{last}");
    let rec = gw.record(&id).await;
    assert_eq!(rec["outcome"], "upstream_failed", "{rec}");
    assert_eq!(rec["debit_micros"].as_u64(), Some(0), "{rec}");
    let pulled = sent.load(Ordering::Relaxed);
    eprintln!(
        "1 GiB flood: the engine wrote {} KiB before the cut; gateway RSS {before} → peak {peak} KiB (+{} KiB)",
        pulled / 1024,
        peak - before
    );
    assert!(
        pulled < 256 << 20,
        "the stream was not cut near its bound: {pulled} bytes"
    );
    assert!(
        peak - before < 32 * 1024,
        "gateway RSS grew {} KiB",
        peak - before
    );
}

/// `/v1/responses` against a node that answers in the other shape: a whole body to a streamed
/// request is re-shaped into the stream the caller asked for, with the billed usage; a stream
/// to a request that asked for none is the node's fault (502, nothing paid). And a node padding a streamed choice past the tool-call bound is cut,
/// the caller pays what it got, the operator earns nothing (`cut_at_bound`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_are_reshaped_and_a_tool_call_padder_is_not_paid() {
    let engine = Engine::discover().unwrap();
    let (url, _task) = serve_fake_llama(move |_path, body| async move {
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let usage = json!({"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12});
        let prompt = v["messages"].to_string();
        if prompt.contains("pad") {
            // 200 tool calls in one streamed choice
            let mut out = String::new();
            for i in 0..200 {
                let chunk = json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":i,"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":null}]});
                out.push_str(&format!("data: {chunk}\n\n"));
            }
            out.push_str("data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\ndata: [DONE]\n\n");
            return full(200, "text/event-stream", out);
        }
        if v["stream"] == true {
            // a whole body to a streamed request
            let answer = json!({"id":"p","object":"chat.completion","created":1,"model":"smollm2",
                "choices":[{"index":0,"message":{"role":"assistant","content":"Hello there"},"finish_reason":"stop"}],
                "usage":usage});
            return full(200, "application/json", answer.to_string());
        }
        // a stream to a request that was not
        let out = format!(
            "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
            json!({"choices":[{"index":0,"delta":{"content":"Hello there"},"finish_reason":null}]}),
            json!({"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":usage}),
        );
        full(200, "text/event-stream", out)
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let (gw, t, _node, _agent) = gateway_with_node(dir.path(), &engine, &url, "reshaper").await;

    // a stream to a request that asked for none is the node's fault (the SDK could not read it
    // on the chat path): refused, nothing paid
    let body = json!({"model": "smollm2", "input": "Hi", "max_output_tokens": 16, "stream": false});
    let resp = gw.api_post(&t.api_key, "/v1/responses", &body).await;
    assert_eq!(resp.status(), 502);
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    gw.failed_unbilled(&id).await;
    // a whole body to a streamed request: re-shaped into the stream the caller asked for
    {
        let stream = true;
        let body =
            json!({"model": "smollm2", "input": "Hi", "max_output_tokens": 16, "stream": stream});
        let resp = gw.api_post(&t.api_key, "/v1/responses", &body).await;
        assert_eq!(resp.status(), 200);
        let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        let content_type = resp.headers()["content-type"].to_str().unwrap().to_owned();
        let text = resp.text().await.unwrap();
        let rec = gw.record(&id).await;
        assert_eq!(rec["outcome"], "completed", "{rec}");
        let object: Value = if stream {
            assert!(
                content_type.starts_with("text/event-stream"),
                "{content_type}"
            );
            let last: Value = serde_json::from_str(sse_data(&text).last().unwrap()).unwrap();
            assert_eq!(last["type"], "response.completed", "{text}");
            last["response"].clone()
        } else {
            assert!(
                content_type.starts_with("application/json"),
                "{content_type}"
            );
            serde_json::from_str(&text).unwrap()
        };
        assert_eq!(
            object["output"][0]["content"][0]["text"], "Hello there",
            "{object}"
        );
        assert_eq!(
            object["usage"]["output_tokens"], rec["billed"]["completion_tokens"],
            "{object} {rec}"
        );
        assert_eq!(
            object["usage"]["input_tokens"],
            rec["billed"]["prompt_tokens"]
        );
    }

    // the tool-call padder: cut at 128 calls, the caller pays what it got, the operator nothing
    let body = json!({"model": "smollm2", "max_tokens": 4000, "stream": true,
        "messages": [{"role": "user", "content": "pad"}]});
    let resp = gw.api_post(&t.api_key, "/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let text = resp.text().await.unwrap();
    let last: Value = serde_json::from_str(sse_data(&text).last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "stream_bound_reached", "{last}");
    let rec = gw.record(&id).await;
    assert_eq!(rec["outcome"], "cut_at_bound", "{rec}");
    assert!(
        rec["billed"]["completion_tokens"].as_u64().unwrap() > 0,
        "{rec}"
    );
    assert!(rec["debit_micros"].as_u64().unwrap() > 0, "{rec}");
    assert_eq!(rec["operator_credit_micros"], 0, "{rec}");
}

/// Issue 13's attacker review: a node that puts text where the caller's SDK does not read it,
/// or answers in the other mode. A complete chat answer is read from `message` only, a chunk
/// from `delta` only, a completion from `text` only; text in another member is the node's fault
/// (never billed), a `null` other member is absent. A stream answering a request that asked for
/// one JSON body is the node's fault too: the SDK cannot read it. One JSON body answering a
/// request that asked for a stream goes out as the stream asked for (the SDK would read no SSE
/// event from it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_answering_where_the_sdk_does_not_read_is_not_paid_for_it() {
    let engine = Engine::discover().unwrap();
    let tok = ModelTokenizer::from_gguf(&engine.model_gguf).unwrap();
    let shown = "Paris is the capital of France, and it has been for a very long time. ".repeat(12);
    let answer_text = shown.clone();
    // the caller's prompt names the behaviour
    let (url, _task) = serve_fake_llama(move |path, body| {
        let shown = answer_text.clone();
        async move {
            let v: Value = serde_json::from_slice(&body).unwrap();
            let mode = v["messages"][0]["content"]
                .as_str()
                .or(v["prompt"].as_str())
                .unwrap_or("")
                .to_owned();
            let chunk = |choice: Value| {
                let c = json!({"id":"p","object":"chat.completion.chunk","created":1,"model":"smollm2","choices":[choice]});
                format!("data: {c}\n\n")
            };
            match (path.as_str(), mode.as_str()) {
                (_, "delta-pad") => full(200, "application/json", json!({"id":"p","object":"chat.completion","created":1,"model":"smollm2",
                    "choices":[{"index":0,"delta":{"content":"pad ".repeat(500)},"message":{"role":"assistant","content":"Paris."},"finish_reason":"stop"}]}).to_string()),
                (_, "delta-null") => full(200, "application/json", json!({"id":"p","object":"chat.completion","created":1,"model":"smollm2",
                    "choices":[{"index":0,"delta":null,"message":{"role":"assistant","content":shown},"finish_reason":"stop"}]}).to_string()),
                (_, "json-for-sse") => full(200, "application/json", json!({"id":"p","object":"chat.completion","created":1,"model":"smollm2",
                    "choices":[{"index":0,"message":{"role":"assistant","content":shown},"finish_reason":"stop"}]}).to_string()),
                (_, "sse-for-json") => full(200, "text/event-stream", format!("{}{}data: [DONE]\n\n",
                    chunk(json!({"index":0,"delta":{"content":shown},"finish_reason":null})),
                    chunk(json!({"index":0,"delta":{},"finish_reason":"stop"})))),
                ("/v1/completions", _) => full(200, "text/event-stream", format!("{}{}data: [DONE]\n\n",
                    chunk(json!({"index":0,"text":shown,"delta":null,"message":null,"finish_reason":null})),
                    chunk(json!({"index":0,"text":"","finish_reason":"stop"})))),
                _ => full(404, "application/json", r#"{"error":"not found"}"#.into()),
            }
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let (gw, t, _node, _agent) = gateway_with_node(dir.path(), &engine, &url, "misplacer").await;
    let shown_tokens = tok.count_text(&shown);

    // text beside the message, where the SDK never looks: refused, nothing paid
    for mode in ["delta-pad", "sse-for-json"] {
        let body = json!({"model":"smollm2","messages":[{"role":"user","content":mode}],"max_tokens":2000});
        let resp = gw.api_post(&t.api_key, "/v1/chat/completions", &body).await;
        assert_eq!(resp.status(), 502, "{mode}");
        let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        let e: Value = resp.json().await.unwrap();
        assert!(e["error"]["message"].is_string(), "{mode}: {e}");
        let rec = gw.record(&id).await;
        assert_eq!(rec["outcome"], "upstream_failed", "{mode}: {rec}");
        assert_eq!(rec["debit_micros"], 0, "{mode}: {rec}");
    }
    // one JSON body answering a request that asked for a stream: the SDK would read no event
    // from it; the caller gets the stream it asked for, the text billed
    let body = json!({"model":"smollm2","messages":[{"role":"user","content":"json-for-sse"}],
        "max_tokens":2000,"stream":true,"stream_options":{"include_usage":true}});
    let resp = gw.api_post(&t.api_key, "/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let text = resp.text().await.unwrap();
    assert_eq!(delivered(&text, true)[0], shown, "{text}");
    assert_eq!(
        sse_data(&text).last().map(String::as_str),
        Some("[DONE]"),
        "{text}"
    );
    let rec = gw.record(&id).await;
    assert_eq!(rec["outcome"], "completed", "{rec}");
    assert_eq!(
        rec["billed"]["completion_tokens"],
        shown_tokens + 1,
        "{rec}"
    );
    // `delta: null` beside the message: the message, which the SDK shows, is what is billed
    let body = json!({"model":"smollm2","messages":[{"role":"user","content":"delta-null"}],"max_tokens":2000});
    let resp = gw.api_post(&t.api_key, "/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let answer: Value = resp.json().await.unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], shown.as_str());
    assert_eq!(answer["usage"]["completion_tokens"], shown_tokens + 1);
    let rec = gw.record(&id).await;
    assert_eq!(rec["outcome"], "completed", "{rec}");
    assert_eq!(
        rec["billed"]["completion_tokens"],
        shown_tokens + 1,
        "{rec}"
    );
    // a streamed completion's `text` beside null chat members: billed by the text
    let body = json!({"model":"smollm2","prompt":"text-stream","max_tokens":2000,"stream":true});
    let resp = gw.api_post(&t.api_key, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let text = resp.text().await.unwrap();
    assert_eq!(delivered(&text, true)[0], shown, "{text}");
    let rec = gw.record(&id).await;
    assert_eq!(rec["outcome"], "completed", "{rec}");
    assert_eq!(
        rec["billed"]["completion_tokens"],
        shown_tokens + 1,
        "{rec}"
    );
}

/// Issue 13's attacker review: with `logit_bias` and a grammar a caller can make an honest
/// llama.cpp spell a text in more tokens than its canonical tokenization (here the one-token
/// word " telecommunications" banned, so every repetition takes several tokens). The bill of
/// such a constrained request follows the engine's own count, within what the text can be;
/// before, it followed the canonical count and the operator was paid a fraction of the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_constraining_tokenization_pays_for_the_tokens_generated() {
    let engine = Engine::discover().unwrap();
    let tok = ModelTokenizer::from_gguf(&engine.model_gguf).unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (gw, t, _node, _agent) = gateway_with_node(dir.path(), &engine, &llama.url, "node").await;
    let word = " telecommunications";
    let ids = json_of(
        reqwest::Client::new()
            .post(format!("{}/tokenize", llama.url))
            .json(&json!({"content": word})),
    )
    .await;
    let ids = ids["tokens"].as_array().unwrap().clone();
    assert_eq!(
        ids.len(),
        1,
        "{word} is one token of this vocabulary: {ids:?}"
    );
    const MAX: u64 = 40;
    for streamed in [false, true] {
        let body = json!({"model":"smollm2","messages":[{"role":"user","content":"Go."}],
            "max_tokens":MAX,"stream":streamed,"temperature":0,
            "grammar": format!("root ::= (\"{word}\")+"),
            "logit_bias": {ids[0].to_string(): -100}});
        let (got, rec) = chat_and_record(&gw, &t.api_key, &body, streamed).await;
        assert!(got.starts_with(word), "{got:?}");
        let canonical = tok.count_text(&got);
        // the text was spelled in more tokens than it counts: the old bill is below the work
        assert!(
            canonical + length_allowance_tokens(MAX) < MAX,
            "not constrained enough to tell: {canonical} for {got:?}"
        );
        assert_eq!(rec["outcome"], "completed", "{rec}");
        assert_eq!(rec["claimed"]["completion_tokens"], MAX, "{rec}");
        assert_eq!(
            rec["billed"]["completion_tokens"], MAX,
            "streamed {streamed}: {rec}"
        );
        assert_eq!(rec["discrepancy"], false, "{rec}");
    }
    // JSON mode alone (a grammar on the text, no token-level bias): the honest engine's few
    // extra tokens are billed as it claims them, unflagged, within the count's allowance
    for (i, streamed) in [false, true, false, true].into_iter().enumerate() {
        let body = json!({"model":"smollm2","max_tokens":120,"stream":streamed,"temperature":0.8,
            "seed": i,
            "messages":[{"role":"user","content":"Describe a cat as JSON with name, age and color."}],
            "response_format":{"type":"json_object"}});
        let (got, rec) = chat_and_record(&gw, &t.api_key, &body, streamed).await;
        assert_eq!(rec["outcome"], "completed", "{rec}");
        assert_eq!(rec["discrepancy"], false, "{rec}");
        assert_eq!(
            rec["billed"]["completion_tokens"], rec["claimed"]["completion_tokens"],
            "{rec}"
        );
        let canonical = tok.count_text(&got);
        assert!(
            rec["billed"]["completion_tokens"].as_u64().unwrap()
                <= canonical + 1 + 16 + canonical / 8,
            "{rec}"
        );
    }
    // a schema that pins the text (OpenAI's `const`): the honest engine spells it in pieces the
    // model would never choose (measured: 204 tokens for a 272-byte text that counts 62), and a
    // `pattern` schema's answer loses the white space the engine generated after the JSON
    // (measured: `"   "` for 25 tokens); each billed as the engine claims it, unflagged
    let pinned = "The quick brown fox jumps over the lazy dog. ".repeat(6);
    for (schema, streamed) in [
        (json!({"const": pinned}), false),
        (json!({"const": pinned}), true),
        (json!({"type": "string", "pattern": "^ +$"}), false),
    ] {
        let body = json!({"model":"smollm2","max_tokens":400,"stream":streamed,"temperature":0,
            "messages":[{"role":"user","content":"Write anything"}],
            "response_format":{"type":"json_schema","json_schema":{"name":"x","schema":schema}}});
        let (got, rec) = chat_and_record(&gw, &t.api_key, &body, streamed).await;
        assert_eq!(rec["outcome"], "completed", "{rec}");
        let claimed = rec["claimed"]["completion_tokens"].as_u64().unwrap();
        let canonical = tok.count_text(&got);
        // the measured allowance this replaces could not pay for it
        assert!(
            claimed > canonical + 1 + 16 + (canonical + 1) / 8,
            "not pinned enough to tell: {claimed} for {got:?}"
        );
        assert_eq!(rec["billed"]["completion_tokens"], claimed, "{rec}");
        assert_eq!(rec["discrepancy"], false, "{rec}");
    }
}

/// The request surface on the real llama.cpp: a `developer` message is served, its prompt
/// counted as the engine counted it (no discrepancy: the node read `system`, as the meter
/// rendered it); an assistant prefill, an engine alias set to `null` and an unknown member of a
/// message are 400s in OpenAI's shape, never forwarded, nothing held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn developer_messages_are_served_and_the_surface_is_an_allowlist() {
    let engine = Engine::discover().unwrap();
    let llama = LlamaServer::start(&engine, 1).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (gw, t, _node, _agent) = gateway_with_node(dir.path(), &engine, &llama.url, "node").await;
    for streamed in [false, true] {
        let body = json!({"model":"smollm2","max_tokens":8,"stream":streamed,
            "stream_options": if streamed { json!({"include_usage": true}) } else { Value::Null },
            "messages":[{"role":"developer","content":"Answer in one word."},
                {"role":"user","content":"What color is the sky?"}]});
        let resp = gw.api_post(&t.api_key, "/v1/chat/completions", &body).await;
        assert_eq!(resp.status(), 200, "streamed {streamed}");
        let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        let _ = resp.text().await.unwrap();
        let rec = gw.record(&id).await;
        assert_eq!(rec["outcome"], "completed", "{rec}");
        assert_eq!(
            rec["billed"]["prompt_tokens"], rec["claimed"]["prompt_tokens"],
            "{rec}"
        );
        assert_eq!(rec["discrepancy"], false, "{rec}");
    }
    let (balance, _) = gw.balance(&t.account).await;
    let user = json!({"role":"user","content":"Name three colors."});
    for (body, code, param) in [
        (
            json!({"model":"smollm2","max_tokens":8,
                "messages":[user.clone(), {"role":"assistant","content":"Red, "}]}),
            "invalid_request",
            "messages[1].role",
        ),
        (
            json!({"model":"smollm2","max_tokens":8,"n_predict":null,"messages":[user.clone()]}),
            "unsupported_parameter",
            "n_predict",
        ),
        (
            json!({"model":"smollm2","max_tokens":8,
                "messages":[{"role":"user","content":"hi","cache_control":{"type":"ephemeral"}}]}),
            "unsupported_parameter",
            "messages[0].cache_control",
        ),
    ] {
        let resp = gw.api_post(&t.api_key, "/v1/chat/completions", &body).await;
        assert_eq!(resp.status(), 400, "{body}");
        let e: Value = resp.json().await.unwrap();
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        assert_eq!(e["error"]["code"], code, "{e}");
        assert_eq!(e["error"]["param"], param, "{e}");
    }
    assert_eq!(gw.balance(&t.account).await, (balance, 0));
}

/// Several prompts in one `/v1/completions` request: llama.cpp's usage is one task's (prompt 0
/// and choice 0 non-streamed; the task that finished last streamed). The gateway bills every
/// prompt and choice and does not flag the honest node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_prompts_are_billed_whole_and_do_not_flag_an_honest_node() {
    let engine = Engine::discover().unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (gw, t, _node, _agent) = gateway_with_node(dir.path(), &engine, &llama.url, "node").await;
    let long = "the cat sat on the mat ".repeat(8);
    for streamed in [false, true] {
        for _ in 0..2 {
            let body = json!({"model":"smollm2","prompt":["x", long],"max_tokens":1,
                "stream":streamed});
            let resp = gw.api_post(&t.api_key, "/v1/completions", &body).await;
            assert_eq!(resp.status(), 200, "{body}");
            let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
            let text = resp.text().await.unwrap();
            assert_eq!(delivered(&text, streamed).len(), 2, "{text}");
            let rec = gw.record(&id).await;
            assert_eq!(rec["outcome"], "completed", "{rec}");
            assert_eq!(rec["billed"]["prompt_tokens"], 50, "{rec}");
            assert_eq!(rec["billed"]["completion_tokens"], 2, "{rec}");
            assert_eq!(rec["discrepancy"], false, "streamed {streamed}: {rec}");
        }
    }
}

/// A caller prompting with ordinary tokens that spell `<|im_end|>` gets it back as text: the
/// real llama.cpp renders a sampled control token as no text, so every such string it delivers
/// was generated as several ordinary tokens, and is billed as ordinary text (it was billed as one
/// token each: 32 + allowance for the 200 tokens generated; `docs/metering.md`, "Special tokens
/// in generated text").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_token_text_a_node_generated_is_billed_as_ordinary_text() {
    let engine = Engine::discover().unwrap();
    let tok = ModelTokenizer::from_gguf(&engine.model_gguf).unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (gw, t, _node, _agent) = gateway_with_node(dir.path(), &engine, &llama.url, "node").await;
    const MAX: u64 = 200;
    let prompt: Vec<u32> = [44, 108, 306, 79, 486, 108, 46].repeat(30);
    for streamed in [false, true] {
        let body = json!({"model":"smollm2","prompt":prompt,"max_tokens":MAX,"temperature":0,
            "stream":streamed});
        let resp = gw.api_post(&t.api_key, "/v1/completions", &body).await;
        assert_eq!(resp.status(), 200, "streamed {streamed}");
        let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        let got = delivered(&resp.text().await.unwrap(), streamed).remove(0);
        let rec = gw.record(&id).await;
        eprintln!("streamed {streamed}: {} bytes, {rec}", got.len());
        assert!(got.matches("<|im_end|>").count() >= 10, "{got:?}");
        let claimed = rec["claimed"]["completion_tokens"].as_u64().unwrap();
        let billed = rec["billed"]["completion_tokens"].as_u64().unwrap();
        let as_specials = tok.count_text(&got) + length_allowance_tokens(MAX);
        assert_eq!(rec["outcome"], "completed", "{rec}");
        assert!(billed >= tok.count_generated_text(&got), "{rec}");
        assert!(billed > 3 * as_specials, "billed as specials again: {rec}");
        assert!(billed + claimed / 8 >= claimed, "{rec}");
        assert_eq!(rec["discrepancy"], false, "{rec}");
    }
}

/// A caller's `logit_bias` that makes the real llama.cpp write text counting more tokens than
/// it generated (token 478, `"ell"`, over and over: about 1.5 tokens each when counted) was
/// cut as the honest node's fault past `max_tokens`: the caller read the answer free
/// (`upstream_failed`) and the node was scored. The cap is judged on the fewest tokens that
/// spell the text: the answer completes, the caller pays the tokens generated, the node is
/// neither faulted nor flagged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_a_caller_biases_to_count_past_the_cap_is_billed_not_free() {
    let engine = Engine::discover().unwrap();
    let tok = ModelTokenizer::from_gguf(&engine.model_gguf).unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (gw, t, node, _agent) = gateway_with_node(dir.path(), &engine, &llama.url, "node").await;
    const MAX: u64 = 200;
    for streamed in [false, true] {
        let body = json!({"model":"smollm2","max_tokens":MAX,"temperature":0,"stream":streamed,
            "logit_bias":{"478":13,"2":-100,"0":-100},
            "messages":[{"role":"user","content":"Write a haiku about the sea."}]});
        let resp = gw.api_post(&t.api_key, "/v1/chat/completions", &body).await;
        assert_eq!(resp.status(), 200, "streamed {streamed}");
        let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        let text = resp.text().await.unwrap();
        assert!(!text.contains("\"error\""), "streamed {streamed}: {text}");
        let got = delivered(&text, streamed).remove(0);
        let rec = gw.record(&id).await;
        eprintln!("streamed {streamed}: {} bytes, {rec}", got.len());
        // the case: counted past the cap and its slack, generated within it
        let (count, fewest) = tok.count_generated_text_and_fewest(&got);
        assert!(count > MAX + MAX / 10, "{count}: {got:?}");
        assert!(fewest <= MAX, "{fewest}");
        assert_eq!(rec["outcome"], "completed", "{rec}");
        assert_eq!(rec["billed"]["completion_tokens"], MAX, "{rec}");
        assert_eq!(rec["discrepancy"], false, "{rec}");
        let prompt = rec["billed"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(
            rec["debit_micros"].as_u64(),
            Some(common::cost(prompt, MAX).0),
            "{rec}"
        );
    }
    let n = gw.node(&node).await;
    assert_eq!(
        (&n["failures"], &n["discrepancies"]),
        (&json!(0), &json!(0)),
        "{n}"
    );
}
