//! `/v1/completions` and `/v1/embeddings` end to end (gateway → TLS tunnel → agent → a real
//! llama.cpp started with `--embeddings --pooling mean`, which serves chat, completions and
//! embeddings at once), per-key RPM/TPM limits, and `GET /metrics` after known traffic.
//!
//! Every billed count is checked against the ENGINE's own count (its `/tokenize`, and the usage
//! it claims), never against spine's tokenizer.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use spine_test_support::{Engine, LlamaServer};

/// What the test sent and was billed, to check `/metrics` against.
#[derive(Default)]
struct Traffic {
    completions_200: u64,
    embeddings_200: u64,
    completed: u64,
    billed_prompt: u64,
    billed_completion: u64,
    discrepancies: u64,
    spent: u64,
}

impl Traffic {
    fn settled(&mut self, rec: &Value) {
        assert_eq!(rec["outcome"], "completed", "{rec}");
        self.completed += 1;
        self.billed_prompt += rec["billed"]["prompt_tokens"].as_u64().unwrap();
        self.billed_completion += rec["billed"]["completion_tokens"].as_u64().unwrap();
        self.discrepancies += u64::from(rec["discrepancy"].as_bool().unwrap());
        self.spent += rec["debit_micros"].as_u64().unwrap();
    }
}

fn request_id(resp: &reqwest::Response) -> String {
    resp.headers()["x-request-id"].to_str().unwrap().to_owned()
}

/// `(text, finish_reason)` per choice index from a completions SSE body, and its usage chunks.
fn completion_stream(body: &str) -> (Vec<(String, Option<String>)>, Vec<Value>) {
    let events = sse_data(body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let mut choices: Vec<(String, Option<String>)> = Vec::new();
    let mut usage = Vec::new();
    for e in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(e).unwrap();
        if !chunk["usage"].is_null() {
            usage.push(chunk["usage"].clone());
        }
        for c in chunk["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            if choices.len() <= i {
                choices.resize(i + 1, (String::new(), None));
            }
            choices[i].0.push_str(c["text"].as_str().unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                choices[i].1 = Some(f.to_owned());
            }
        }
    }
    (choices, usage)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_embeddings_limits_and_metrics() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let llama = LlamaServer::start_with_args(&engine, 2, &["--embeddings", "--pooling", "mean"])
        .await
        .unwrap();
    // gateway-wide defaults apply to keys without their own limits
    let gw = Gateway::start_with(
        dir.path(),
        &engine,
        "default_rpm_limit = 1000\ndefault_tpm_limit = 0",
    )
    .await;
    let counter = EngineCounter {
        url: llama.url.clone(),
        http: reqwest::Client::new(),
    };
    let s = setup(&gw, dir.path(), &llama.url).await;
    let mut t = Traffic::default();

    completions(&gw, &counter, &s, &mut t).await;
    embeddings(&gw, &counter, &s, &mut t).await;
    let refused = limits(&gw, &s, &mut t).await;
    check_metrics(&gw, &s, &t, refused).await;
    // the ledger agrees with everything the test saw billed
    assert_eq!(gw.balance(&s.account).await, (CREDITS - t.spent, 0));
    drop(s.agent);
}

async fn completions(gw: &Gateway, counter: &EngineCounter, s: &Setup, t: &mut Traffic) {
    let prompt = "The capital of France is";
    // BOS is whatever the engine adds for this model (none for SmolLM2: 5 tokens)
    let want_prompt = counter.prompt_tokens(prompt).await;
    assert_eq!(want_prompt, 5);

    // --- non-streamed ------------------------------------------------------------------------
    let resp = gw
        .api_post(
            &s.api_key,
            "/v1/completions",
            &json!({"model": "smollm2", "prompt": prompt, "max_tokens": 12, "temperature": 0}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let id = request_id(&resp);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["object"], "text_completion");
    let text = body["choices"][0]["text"].as_str().unwrap();
    let finish = body["choices"][0]["finish_reason"].as_str().unwrap();
    let want_completion = counter.completion(text, finish).await;
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": want_prompt, "completion_tokens": want_completion,
               "total_tokens": want_prompt + want_completion})
    );
    let rec = gw.record(&id).await;
    assert_eq!(rec["billed"]["prompt_tokens"].as_u64(), Some(want_prompt));
    assert_eq!(
        rec["billed"]["completion_tokens"].as_u64(),
        Some(want_completion)
    );
    // the engine's own usage claim agrees
    assert_eq!(rec["claimed"], rec["billed"], "{rec}");
    assert_eq!(rec["discrepancy"], false);
    assert_split(&rec, want_prompt, want_completion);
    t.settled(&rec);
    t.completions_200 += 1;

    // --- streamed, with and without include_usage --------------------------------------------
    for include_usage in [true, false] {
        let mut req = json!({"model": "smollm2", "prompt": prompt, "max_tokens": 10,
                             "temperature": 0, "stream": true});
        if include_usage {
            req["stream_options"] = json!({"include_usage": true});
        }
        let resp = gw.api_post(&s.api_key, "/v1/completions", &req).await;
        assert_eq!(resp.status(), 200);
        assert!(resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let id = request_id(&resp);
        let (choices, usage) = completion_stream(&resp.text().await.unwrap());
        assert_eq!(choices.len(), 1);
        let (text, finish) = &choices[0];
        let want_completion = counter
            .completion(text, finish.as_deref().expect("a finish_reason"))
            .await;
        if include_usage {
            assert_eq!(
                usage,
                vec![
                    json!({"prompt_tokens": want_prompt, "completion_tokens": want_completion,
                            "total_tokens": want_prompt + want_completion})
                ]
            );
        } else {
            // the engine puts usage on its final chunk; the caller did not ask for it
            assert!(usage.is_empty(), "{usage:?}");
        }
        let rec = gw.record(&id).await;
        assert_eq!(rec["billed"]["prompt_tokens"].as_u64(), Some(want_prompt));
        assert_eq!(
            rec["billed"]["completion_tokens"].as_u64(),
            Some(want_completion)
        );
        assert_eq!(rec["claimed"], rec["billed"], "{rec}");
        t.settled(&rec);
        t.completions_200 += 1;
    }

    // --- token ids: each id is one token, no BOS added ------------------------------------------
    let resp = gw
        .api_post(
            &s.api_key,
            "/v1/completions",
            &json!({"model": "smollm2", "prompt": [504, 3575, 282], "max_tokens": 3}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let id = request_id(&resp);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    let rec = gw.record(&id).await;
    assert_eq!(rec["claimed"]["prompt_tokens"], 3);
    t.settled(&rec);
    t.completions_200 += 1;

    // --- two prompts × n = 2: four choices, prompts counted once each ------------------------
    let prompts = ["The capital of France is", "Once upon a time"];
    let resp = gw
        .api_post(
            &s.api_key,
            "/v1/completions",
            &json!({"model": "smollm2", "prompt": prompts, "n": 2, "max_tokens": 4,
                    "temperature": 0}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let id = request_id(&resp);
    let body: Value = resp.json().await.unwrap();
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    // the engine's count per choice: a `length` finish generated exactly max_tokens (the
    // text alone can re-tokenize shorter), else the text's tokens (+ EOS on `stop`)
    let mut want_completion = 0;
    for c in choices {
        want_completion += match c["finish_reason"].as_str().unwrap() {
            "length" => 4,
            finish => {
                counter
                    .completion(c["text"].as_str().unwrap(), finish)
                    .await
            }
        };
    }
    let want_prompt =
        counter.prompt_tokens(prompts[0]).await + counter.prompt_tokens(prompts[1]).await;
    assert_eq!(
        (
            body["usage"]["prompt_tokens"].as_u64(),
            body["usage"]["completion_tokens"].as_u64()
        ),
        (Some(want_prompt), Some(want_completion))
    );
    let rec = gw.record(&id).await;
    assert_eq!(rec["billed"]["prompt_tokens"].as_u64(), Some(want_prompt));
    assert_eq!(
        rec["billed"]["completion_tokens"].as_u64(),
        Some(want_completion)
    );
    // llama.cpp reports the usage of the FIRST task only when a request fans out
    assert_eq!(
        rec["claimed"]["prompt_tokens"].as_u64(),
        Some(counter.prompt_tokens(prompts[0]).await)
    );
    t.settled(&rec);
    t.completions_200 += 1;

    // --- malformed prompts are refused, never forwarded --------------------------------------
    for bad in [
        json!([]),
        json!(""),
        json!({"text": "x"}),
        json!([[1, [2]]]),
    ] {
        let resp = gw
            .api_post(
                &s.api_key,
                "/v1/completions",
                &json!({"model": "smollm2", "prompt": bad}),
            )
            .await;
        assert_eq!(resp.status(), 400, "{bad}");
        let e: Value = resp.json().await.unwrap();
        assert_eq!(e["error"]["type"], "invalid_request_error");
    }
}

async fn embeddings(gw: &Gateway, counter: &EngineCounter, s: &Setup, t: &mut Traffic) {
    // --- one input ---------------------------------------------------------------------------
    let input = "The quick brown fox jumps over the lazy dog.";
    let want = counter.prompt_tokens(input).await;
    let resp = gw
        .api_post(
            &s.api_key,
            "/v1/embeddings",
            &json!({"model": "smollm2", "input": input}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let id = request_id(&resp);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["object"], "list");
    assert_eq!(body["data"].as_array().unwrap().len(), 1);
    assert_eq!(body["data"][0]["embedding"].as_array().unwrap().len(), 576);
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": want, "total_tokens": want})
    );
    let rec = gw.record(&id).await;
    assert_eq!(
        rec["billed"],
        json!({"prompt_tokens": want, "completion_tokens": 0})
    );
    assert_eq!(rec["claimed"], rec["billed"], "{rec}");
    assert_split(&rec, want, 0);
    t.settled(&rec);
    t.embeddings_200 += 1;

    // --- a batch: input tokens summed, one vector per input ----------------------------------
    let inputs = [
        "Hello world 2024!",
        "<|im_start|>user<|im_end|>",
        "Name three colors.",
    ];
    let mut want = 0;
    for i in inputs {
        want += counter.prompt_tokens(i).await;
    }
    let resp = gw
        .api_post(
            &s.api_key,
            "/v1/embeddings",
            &json!({"model": "smollm2", "input": inputs, "encoding_format": "float"}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let id = request_id(&resp);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["data"].as_array().unwrap().len(), 3);
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": want, "total_tokens": want})
    );
    let rec = gw.record(&id).await;
    assert_eq!(rec["billed"]["prompt_tokens"].as_u64(), Some(want));
    assert_eq!(rec["claimed"], rec["billed"], "{rec}");
    t.settled(&rec);
    t.embeddings_200 += 1;

    // --- an empty input is refused before the node -------------------------------------------
    let resp = gw
        .api_post(
            &s.api_key,
            "/v1/embeddings",
            &json!({"model": "smollm2", "input": [""]}),
        )
        .await;
    assert_eq!(resp.status(), 400);
}

/// RPM and TPM refusals; returns the 429s sent: (requests, tokens).
async fn limits(gw: &Gateway, s: &Setup, t: &mut Traffic) -> (u64, u64) {
    let cheap = json!({"model": "smollm2", "prompt": "Hi", "max_tokens": 1});

    // a key without its own limits gets the gateway defaults
    let (status, key) = gw
        .admin_post(&format!("/admin/v1/accounts/{}/keys", s.account), json!({}))
        .await;
    assert_eq!(status, 201);
    assert_eq!(
        (key["rpm_limit"].as_u64(), key["tpm_limit"].as_u64()),
        (Some(1000), Some(0))
    );

    // --- RPM: rpm_limit 2 → the 3rd request within the minute is a 429 -----------------------
    let (status, key) = gw
        .admin_post(
            &format!("/admin/v1/accounts/{}/keys", s.account),
            json!({"rpm_limit": 2}),
        )
        .await;
    assert_eq!(status, 201, "{key}");
    assert_eq!(key["rpm_limit"], 2);
    let rpm_key = key["key"].as_str().unwrap().to_owned();
    for _ in 0..2 {
        let resp = gw.api_post(&rpm_key, "/v1/completions", &cheap).await;
        assert_eq!(resp.status(), 200);
        let id = request_id(&resp);
        drop(resp.bytes().await.unwrap());
        t.settled(&gw.record(&id).await);
        t.completions_200 += 1;
    }
    let resp = gw.api_post(&rpm_key, "/v1/completions", &cheap).await;
    assert_eq!(resp.status(), 429);
    let retry_after: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // GCRA: one request comes back every 30 s
    assert!((1..=30).contains(&retry_after), "Retry-After {retry_after}");
    let e: Value = resp.json().await.unwrap();
    assert_eq!(e["error"]["type"], "requests");
    assert_eq!(e["error"]["code"], "rate_limit_exceeded");
    // another key of the same account is not affected
    let resp = gw.api_post(&s.api_key, "/v1/completions", &cheap).await;
    assert_eq!(resp.status(), 200);
    let id = request_id(&resp);
    drop(resp.bytes().await.unwrap());
    t.settled(&gw.record(&id).await);
    t.completions_200 += 1;

    // --- TPM: reserves prompt + max_tokens before forwarding ---------------------------------
    let (status, key) = gw
        .admin_post(
            &format!("/admin/v1/accounts/{}/keys", s.account),
            json!({"tpm_limit": 100}),
        )
        .await;
    assert_eq!(status, 201);
    let tpm_key = key["key"].as_str().unwrap().to_owned();
    // 5 + 90 = 95 of 100 reserved at admission; a ban on the end tokens makes it use them all.
    // The bucket refills at 100/60 tokens/s, so a second request of 95 fits only ~54 s after the
    // first was admitted. It is sent while the first still streams (its first event is in, so it
    // was admitted and its 95 are reserved): what separates the two is the first's time to first
    // token, not its whole generation (which took over 50 s in a debug build beside two busy
    // llama-servers, and let the refill admit the second).
    let long = json!({"model": "smollm2", "prompt": "The capital of France is",
                      "max_tokens": 90, "logit_bias": {"0": -100, "2": -100}});
    let before = gw.balance_once_released(&s.account).await;
    assert_eq!(before.1, 0, "nothing held before the first");
    let mut first = gw
        .api_post(
            &tpm_key,
            "/v1/completions",
            &json!({
            "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 90,
            "logit_bias": {"0": -100, "2": -100}, "stream": true,
            "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(first.status(), 200);
    let first_id = request_id(&first);
    let mut first_body = Vec::new();
    while first_body.is_empty() {
        first_body.extend_from_slice(&first.chunk().await.unwrap().expect("a first event"));
    }
    // the same again needs 95; at most 5 + refill is there
    let resp = gw.api_post(&tpm_key, "/v1/completions", &long).await;
    assert_eq!(resp.status(), 429);
    let refused_id = request_id(&resp);
    let retry_after: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry_after), "Retry-After {retry_after}");
    let e: Value = resp.json().await.unwrap();
    assert_eq!(e["error"]["type"], "tokens");
    assert_eq!(e["error"]["code"], "rate_limit_exceeded");
    // refused before the hold: no record (and below: nothing held or debited but the first's bill)
    let (status, _) = gw
        .admin_get(&format!("/admin/v1/requests/{refused_id}"))
        .await;
    assert_eq!(status, 404);
    // the first runs to its end and is billed what it used
    while let Some(chunk) = first.chunk().await.unwrap() {
        first_body.extend_from_slice(&chunk);
    }
    assert!(
        String::from_utf8(first_body)
            .unwrap()
            .ends_with("data: [DONE]\n\n"),
        "the first stream ends cleanly"
    );
    let rec = gw.record(&first_id).await;
    let used = rec["billed"]["prompt_tokens"].as_u64().unwrap()
        + rec["billed"]["completion_tokens"].as_u64().unwrap();
    assert!(used > 80, "{rec}");
    let debit = rec["debit_micros"].as_u64().unwrap();
    assert_eq!(
        gw.balance_once_released(&s.account).await,
        (before.0 - debit, 0),
        "only the first was held and debited"
    );
    t.settled(&rec);
    t.completions_200 += 1;
    // a request larger than the whole budget never fits: 429 without Retry-After
    let resp = gw
        .api_post(
            &tpm_key,
            "/v1/completions",
            &json!({"model": "smollm2", "prompt": "Hi", "max_tokens": 200}),
        )
        .await;
    assert_eq!(resp.status(), 429);
    assert!(resp.headers().get("retry-after").is_none());
    let e: Value = resp.json().await.unwrap();
    assert_eq!(e["error"]["type"], "tokens");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("Request too large"),
        "{e}"
    );
    (1, 2)
}

/// The counters after the known traffic above: every value exact.
async fn check_metrics(gw: &Gateway, s: &Setup, t: &Traffic, refused: (u64, u64)) {
    let completions_200 = t.completions_200;
    let completed = t.completed;
    // settlement counters are bumped right after the commit: poll briefly
    let mut text = String::new();
    for _ in 0..100 {
        text = gw.metrics().await;
        if metric(
            &text,
            r#"spine_request_outcomes_total{outcome="completed"}"#,
        ) == completed as f64
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = |series: &str| metric(&text, series);
    assert_eq!(
        m(r#"spine_request_outcomes_total{outcome="completed"}"#),
        completed as f64,
        "{text}"
    );
    assert_eq!(
        m(r#"spine_http_requests_total{route="/v1/completions",status="200"}"#),
        completions_200 as f64
    );
    assert_eq!(
        m(r#"spine_http_requests_total{route="/v1/embeddings",status="200"}"#),
        t.embeddings_200 as f64
    );
    assert_eq!(
        m(r#"spine_http_requests_total{route="/v1/completions",status="400"}"#),
        4.0
    );
    assert_eq!(
        m(r#"spine_http_requests_total{route="/v1/embeddings",status="400"}"#),
        1.0
    );
    assert_eq!(
        m(r#"spine_http_requests_total{route="/v1/completions",status="429"}"#),
        (refused.0 + refused.1) as f64
    );
    assert_eq!(
        m(r#"spine_rate_limited_total{limit="requests"}"#),
        refused.0 as f64
    );
    assert_eq!(
        m(r#"spine_rate_limited_total{limit="tokens"}"#),
        refused.1 as f64
    );
    assert_eq!(m("spine_settlement_errors_total"), 0.0);
    assert_eq!(
        m(r#"spine_request_outcomes_total{outcome="upstream_failed"}"#),
        0.0
    );
    // billed tokens: exactly what the records billed
    assert_eq!(
        m(r#"spine_billed_prompt_tokens_total{model="smollm2"}"#),
        t.billed_prompt as f64
    );
    assert_eq!(
        m(r#"spine_billed_completion_tokens_total{model="smollm2"}"#),
        t.billed_completion as f64
    );
    // discrepancies: metric, node registry and records agree
    let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
    let node = &nodes["data"][0];
    assert_eq!(node["node_id"], s.node_id.as_str());
    let on_node = node["discrepancies"].as_u64().unwrap();
    assert_eq!(on_node, t.discrepancies, "{node}");
    assert_eq!(
        m(&format!(
            r#"spine_usage_discrepancies_total{{node="{}"}}"#,
            s.node_id
        )),
        on_node as f64
    );
    // TTFT histogram observed every 2xx body
    assert_eq!(
        m(r#"spine_ttft_seconds_count{route="/v1/completions"}"#),
        completions_200 as f64
    );
}
