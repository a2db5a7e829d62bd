//! Every handed fixture through the real binaries: `reference-gateway` → TLS tunnel →
//! `reference-agent` → a [`ReplayEngine`] that writes the fixture's exact upstream bytes in its
//! reads. For each llama.cpp streaming capture and each case of `fixtures/hostile-streams.json`,
//! the client stream and the request record (outcome, billed, claimed, discrepancy, cost) are
//! checked against the case's stated expectation (DESIGN.md §6) and the billing rules.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod common;

use std::time::Duration;

use common::{cost, Gateway};
use serde_json::{json, Value};
use spine_meter::tokenizer::{CompletionRule, GeneratedText};
use spine_meter::ModelTokenizer;
use spine_test_support::{stdout_of, workspace_path, Engine, ReplayEngine, Scripted};

/// One fixture: the request the client sends, the upstream reads, what must happen.
struct Fixture {
    id: String,
    request: Value,
    reads: Vec<Vec<u8>>,
    expect: Value,
}

fn b64(text: &str) -> Vec<u8> {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in text.bytes().filter(|&c| c != b'=') {
        acc = (acc << 6) | A.iter().position(|&a| a == c).unwrap() as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

fn base_request() -> Value {
    json!({"model": "smollm2", "messages": [{"role": "user", "content": "Name three colors."}]})
}

fn fixtures() -> Vec<Fixture> {
    let mut out = Vec::new();
    // llama.cpp captures: the body after the HTTP head, in 37-byte reads (events split anywhere)
    for (name, include_usage, max_tokens) in [
        ("b_chat_stream_usage.txt", Some(true), 64),
        ("b2_chat_stream_usage_stop.txt", Some(true), 64),
        ("b3_chat_stream_usage_length.txt", Some(true), 5),
        ("b4_stream_with_sse_ping.txt", Some(true), 8),
        ("c_chat_stream_nousage.txt", None, 64),
        ("c2_chat_stream_usage_false.txt", Some(false), 64),
    ] {
        let raw = std::fs::read(workspace_path(&format!("fixtures/llama.cpp/{name}"))).unwrap();
        let start = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map(|p| p + 4)
            .or_else(|| raw.windows(2).position(|w| w == b"\n\n").map(|p| p + 2))
            .unwrap();
        let mut request = base_request();
        request["stream"] = json!(true);
        request["max_tokens"] = json!(max_tokens);
        if let Some(u) = include_usage {
            request["stream_options"] = json!({"include_usage": u});
        }
        out.push(Fixture {
            id: name.to_owned(),
            request,
            reads: raw[start..].chunks(37).map(<[u8]>::to_vec).collect(),
            expect: json!({"outcome": "completed", "client_gets_usage": include_usage == Some(true)}),
        });
    }
    let hostile: Value = serde_json::from_slice(
        &std::fs::read(workspace_path("fixtures/hostile-streams.json")).unwrap(),
    )
    .unwrap();
    for case in hostile["cases"].as_array().unwrap() {
        let mut request = base_request();
        request["stream"] = json!(true);
        if let Some(extra) = case["request"].as_object() {
            for (k, v) in extra {
                request[k] = v.clone();
            }
        }
        out.push(Fixture {
            id: case["id"].as_str().unwrap().to_owned(),
            request,
            reads: case["reads_b64"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| b64(r.as_str().unwrap()))
                .collect(),
            expect: case["expect"].clone(),
        });
    }
    out
}

/// What the client saw: the text, finish reasons, usage chunks, error events, `[DONE]`.
#[derive(Debug, Default)]
struct ClientStream {
    generated: GeneratedText,
    finish: Option<String>,
    usage: Vec<Value>,
    errors: Vec<Value>,
    non_json: Vec<String>,
    done: bool,
}

/// The `data` of each event, parsed as a conforming SSE client does.
fn sse_data(body: &str) -> Vec<String> {
    spine_meter::sse::parse_all(body.as_bytes())
        .unwrap()
        .iter()
        .map(|e| e.data().to_owned())
        .collect()
}

fn read_client_stream(body: &str) -> ClientStream {
    let mut out = ClientStream::default();
    for data in sse_data(body) {
        assert!(!out.done, "an event after [DONE]: {body:?}");
        if data == "[DONE]" {
            out.done = true;
            continue;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(&data) else {
            out.non_json.push(data);
            continue;
        };
        if !chunk["error"].is_null() {
            out.errors.push(chunk["error"].clone());
        }
        if !chunk["usage"].is_null() {
            out.usage.push(chunk["usage"].clone());
        }
        for c in chunk["choices"].as_array().into_iter().flatten() {
            out.generated.push_choice_json(c);
            if let Some(f) = c["finish_reason"].as_str() {
                out.finish = Some(f.to_owned());
            }
        }
    }
    out
}

/// The usage chunk the client got, whole.
fn usage_chunk(body: &str) -> Option<Value> {
    sse_data(body)
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|c| !c["usage"].is_null())
}

/// The egress rules every stream from the gateway follows (hostile case H05).
fn assert_egress_rules(id: &str, body: &str) {
    for line in body.split(['\r', '\n']) {
        let ok = line.is_empty()
            || line.starts_with("data: ")
            || line == ": keepalive"
            || line == "data:";
        assert!(ok, "{id}: the gateway wrote {line:?}");
        if let Some(data) = line.strip_prefix("data: ") {
            assert!(!data.starts_with(':'), "{id}: data starting with ':'");
        }
        assert!(
            line != "data:" && line != "data: ",
            "{id}: an empty data line"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fixture_through_gateway_tunnel_and_agent() {
    let engine = Engine::discover().unwrap();
    let tok = ModelTokenizer::from_gguf(&engine.model_gguf).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let replay = ReplayEngine::start().await.unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    let s = common::setup(&gw, dir.path(), &replay.url).await;
    let http = reqwest::Client::new();
    let context = tok.context_length_tokens().unwrap();

    let mut checked = Vec::new();
    for f in fixtures() {
        replay.push(Scripted {
            delay: Duration::from_millis(2),
            ..Scripted::sse(f.reads.clone())
        });
        let resp = http
            .post(format!("{}/v1/chat/completions", gw.public))
            .bearer_auth(&s.api_key)
            .json(&f.request)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{}", f.id);
        let request_id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        let body = resp.text().await.unwrap();
        let id = f.id.as_str();
        let client = read_client_stream(&body);
        let e = &f.expect;
        assert_egress_rules(id, &body);

        // --- what the node received ------------------------------------------------------------
        let upstream: Value = serde_json::from_slice(replay.requests().last().unwrap()).unwrap();
        assert_eq!(upstream["stream_options"]["include_usage"], true, "{id}");
        if let Some(want) = e.get("upstream_stream_options") {
            assert_eq!(&upstream["stream_options"], want, "{id}");
        }

        // --- the client stream -------------------------------------------------------------------
        if let Some(text) = e["client_text"].as_str() {
            assert_eq!(client.generated.content(), text, "{id}: {body}");
        }
        // every event the caller gets is one JSON object (or [DONE])
        assert!(
            client.non_json.is_empty(),
            "{id}: not JSON: {:?}",
            client.non_json
        );
        if let Some(events) = e["events"].as_array() {
            // parser-level case: its events are not chunks, so they never reach the client as
            // they were: the gateway's error event instead
            let data: Vec<String> = sse_data(&body);
            assert!(
                !data.iter().any(|d| d == events[0].as_str().unwrap()),
                "{id}: {body}"
            );
            assert!(!client.errors.is_empty(), "{id}: {body}");
        }
        for never in e["client_never_sees"].as_array().into_iter().flatten() {
            let never = never.as_str().unwrap();
            assert!(
                !body.contains(never),
                "{id}: the client saw {never:?}: {body}"
            );
        }
        if let Some(want) = e["client_error_contains"].as_str() {
            let last = client
                .errors
                .last()
                .unwrap_or_else(|| panic!("{id}: {body}"));
            assert!(
                last["message"].as_str().unwrap().contains(want),
                "{id}: {body}"
            );
            assert_eq!(last["code"], "upstream_failed", "{id}: {body}");
        }
        if let Some(shape) = e["usage_chunk"].as_object() {
            let chunk = usage_chunk(&body).unwrap_or_else(|| panic!("{id}: {body}"));
            for (k, v) in shape {
                assert_eq!(&chunk[k], v, "{id}: usage chunk {k}: {chunk}");
            }
            assert_eq!(chunk["choices"], json!([]), "{id}: {chunk}");
        }
        let outcome = e["outcome"].as_str().unwrap_or(if client.finish.is_some() {
            "completed"
        } else {
            "upstream_failed"
        });
        if outcome == "completed" {
            assert!(client.done, "{id}: the gateway writes [DONE]: {body}");
            assert!(client.errors.is_empty(), "{id}: {body}");
        } else {
            assert!(
                !client.done,
                "{id}: no fake [DONE] on a failed stream: {body}"
            );
            let last = client
                .errors
                .last()
                .unwrap_or_else(|| panic!("{id}: {body}"));
            assert!(
                last["message"].is_string(),
                "{id}: OpenAI-shaped error: {body}"
            );
        }
        let asked_usage = f.request["stream_options"]["include_usage"] == true;
        if let Some(gets) = e["client_gets_usage"].as_bool() {
            assert_eq!(gets, asked_usage, "{id}: the case's own expectation");
        }

        // --- the record ----------------------------------------------------------------------
        let rec = gw.record(&request_id).await;
        assert_eq!(rec["outcome"], outcome, "{id}: {rec}");
        let prompt = tok.count_prompt(&f.request).unwrap();
        let max_tokens = f.request["max_tokens"].as_u64();
        let cap = max_tokens.map_or(context - prompt, |m| m.min(context - prompt));
        let completed = outcome == "completed";
        let bill = tok.bill_completion(
            &client.generated,
            client.finish.as_deref(),
            CompletionRule {
                max_tokens,
                cap_tokens: cap,
                completed,
            },
        );
        assert_eq!(
            rec["billed"]["prompt_tokens"].as_u64(),
            Some(prompt),
            "{id}: {rec}"
        );
        assert_eq!(
            rec["billed"]["completion_tokens"].as_u64(),
            Some(bill.tokens),
            "{id}: {rec}"
        );
        // bounds that do not come from the harness's own count of what the client saw
        let billed_completion = rec["billed"]["completion_tokens"].as_u64().unwrap();
        if let Some(min) = e["min_completion_tokens"].as_u64() {
            assert!(
                billed_completion >= min,
                "{id}: billed {billed_completion} < {min}: {rec}"
            );
        }
        if let Some(max) = e["max_completion_tokens"].as_u64() {
            assert!(
                billed_completion <= max,
                "{id}: billed {billed_completion} > {max}: {rec}"
            );
        }
        if let Some(claim) = e.get("claimed_usage") {
            assert_eq!(
                rec["claimed"]["prompt_tokens"], claim["prompt_tokens"],
                "{id}"
            );
            assert_eq!(
                rec["claimed"]["completion_tokens"], claim["completion_tokens"],
                "{id}"
            );
        }
        if let Some(d) = e["discrepancy"].as_bool() {
            assert_eq!(rec["discrepancy"].as_bool(), Some(d), "{id}: {rec}");
        }
        let (c, o, fee) = if completed {
            cost(prompt, bill.tokens)
        } else {
            (0, 0, 0)
        };
        assert_eq!(rec["cost_micros"].as_u64(), Some(c), "{id}: {rec}");
        assert_eq!(rec["debit_micros"].as_u64(), Some(c), "{id}: {rec}");
        assert_eq!(
            rec["operator_credit_micros"].as_u64(),
            Some(o),
            "{id}: {rec}"
        );
        assert_eq!(rec["fee_micros"].as_u64(), Some(fee), "{id}: {rec}");
        // the usage chunk the client gets carries the billed counts, once, only when asked
        if asked_usage && completed {
            assert_eq!(client.usage.len(), 1, "{id}: {body}");
            assert_eq!(
                client.usage[0]["prompt_tokens"].as_u64(),
                Some(prompt),
                "{id}"
            );
            assert_eq!(
                client.usage[0]["completion_tokens"].as_u64(),
                Some(bill.tokens),
                "{id}"
            );
        } else {
            assert!(client.usage.is_empty(), "{id}: usage not asked for: {body}");
        }
        checked.push(format!("{id}: {outcome}, billed {prompt}+{}", bill.tokens));
    }
    let (_, held) = gw.balance(&s.account).await;
    assert_eq!(held, 0, "every hold released");
    eprintln!("{}", checked.join("\n"));
    // every fixture checked: the six llama.cpp captures and each hostile case (H01–H34)
    assert_eq!(checked.len(), fixtures().len());
    assert_eq!(checked.len(), 6 + 35);
}

/// The official OpenAI Python SDK parses every stream the gateway sends for every fixture:
/// content, an error event it raises as `APIError`, never an exception of its own (a stream it
/// cannot parse); the record agrees with what the SDK saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdk_parses_every_fixture_stream() {
    sdk_parses_every_fixture(false).await;
}

/// The same fixtures through `/v1/responses` (each chat request sent as the Responses request
/// it stands for) with the SDK's `responses.stream()` helper, whose accumulator checks the
/// event sequence: never an exception of the SDK's own; an error exactly when the record is
/// not `completed`; the delivered text where the fixture states it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdk_parses_every_fixture_stream_as_responses() {
    sdk_parses_every_fixture(true).await;
}

async fn sdk_parses_every_fixture(responses: bool) {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let replay = ReplayEngine::start().await.unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    let s = common::setup(&gw, dir.path(), &replay.url).await;
    let all = fixtures();
    for f in &all {
        replay.push(Scripted {
            delay: Duration::from_millis(2),
            ..Scripted::sse(f.reads.clone())
        });
    }
    let requests: Vec<Value> = all.iter().map(|f| f.request.clone()).collect();
    let list = dir.path().join("requests.json");
    std::fs::write(&list, serde_json::to_vec(&requests).unwrap()).unwrap();
    let out = tokio::process::Command::new(&engine.python)
        .arg(workspace_path("scripts/sdk_stream_check.py"))
        .arg(format!("{}/v1", gw.public))
        .arg(&s.api_key)
        .arg(&list)
        .args(responses.then_some("--responses"))
        .output()
        .await
        .unwrap();
    let results: Vec<Value> =
        serde_json::from_slice(&stdout_of(out, "sdk_stream_check.py failed: ")).unwrap();
    assert_eq!(results.len(), all.len());
    for (f, r) in all.iter().zip(&results) {
        let id = &f.id;
        assert!(
            r["crash"].is_null(),
            "{id}: the SDK could not parse the stream: {r}"
        );
        let request_id = r["request_id"]
            .as_str()
            .unwrap_or_else(|| panic!("{id}: {r}"));
        let rec = gw.record(request_id).await;
        match rec["outcome"].as_str().unwrap() {
            "completed" => assert!(r["error"].is_null(), "{id}: {r} {rec}"),
            _ => assert!(
                r["error"].is_string(),
                "{id}: the SDK saw no error: {r} {rec}"
            ),
        }
        if let Some(text) = f.expect["client_text"].as_str() {
            assert_eq!(r["text"], text, "{id}: {r}");
        }
    }
    let (_, held) = gw.balance(&s.account).await;
    assert_eq!(held, 0, "every hold released");
}
