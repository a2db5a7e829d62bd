//! Independent counts against a real llama.cpp `llama-server`.
//!
//! Needs the engine and model from `scripts/setup.sh` (`SPINE_LLAMA_SERVER`, `SPINE_MODEL_GGUF`, or
//! their default cache paths); fails when they are missing or anything is off.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

#[path = "support/exactness.rs"]
mod exactness;

use serde_json::{json, Value};
use spine_meter::ModelTokenizer;

fn cases() -> Vec<Value> {
    let m = |v: Value| json!({ "model": "smollm2", "messages": v });
    vec![
        m(json!([{"role":"user","content":"Name three colors."}])),
        m(
            json!([{"role":"system","content":"You are a terse assistant."},{"role":"user","content":"List three colors, numbered."}]),
        ),
        m(json!([{"role":"user","content":"What is 12345 * 678?"}])),
        m(
            json!([{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello! How can I help?"},{"role":"user","content":"Tell me a joke about cats."}]),
        ),
        m(json!([{"role":"user","content":"Translate to French: 你好, 世界 🙂 — naïve café"}])),
        m(json!([{"role":"user","content":"  leading and trailing spaces \n\n with\ttabs  "}])),
        m(
            json!([{"role":"user","content":"literal <|im_start|>assistant tokens <|im_end|> inside"}]),
        ),
        m(
            json!([{"role":"user","content":[{"type":"text","text":"Part one."},{"type":"text","text":"Part two."}]}]),
        ),
        m(
            json!([{"role":"system","content":"Be brief."},{"role":"user","content":"Write the numbers 1 to 20 separated by commas."}]),
        ),
        m(json!([{"role":"user","content":"Say only the word yes."}])),
        m(
            json!([{"role":"user","content":"```rust\nfn main() { println!(\"hi\"); }\n```\nExplain."}]),
        ),
        m(json!([{"role":"user","content":"Ünïcödé ünd émojis 👨‍👩‍👧 and 2024-01-01T00:00:00Z"}])),
    ]
}

#[test]
fn independent_counts_match_llama_server() {
    // Fails (never skips) when the engine or model is missing: run scripts/setup.sh.
    let found = spine_test_support::Engine::discover().unwrap();
    let tok = ModelTokenizer::from_gguf(&found.model_gguf).unwrap();
    let engine = exactness::start_engine(&found.llama_server, &found.model_gguf);
    let port = engine.port;

    let (mut n, mut prompt_exact, mut completion_exact, mut completion_vs_tokenize) = (0, 0, 0, 0);
    let mut failures = Vec::new();
    for (i, case) in cases().into_iter().enumerate() {
        // 1. template
        let (st, body) = exactness::http(port, "POST", "/apply-template", Some(&case));
        assert_eq!(st, 200);
        let engine_prompt = serde_json::from_slice::<Value>(&body).unwrap()["prompt"]
            .as_str()
            .unwrap()
            .to_owned();
        let ours = tok.render_chat(&case).unwrap();
        if ours != engine_prompt {
            failures.push(format!(
                "case {i}: template differs:\nours   {ours:?}\nengine {engine_prompt:?}"
            ));
        }
        // 2. tokenize
        let (_, body) = exactness::http(
            port,
            "POST",
            "/tokenize",
            Some(&json!({"content": engine_prompt, "add_special": false, "parse_special": true})),
        );
        let engine_tokens = serde_json::from_slice::<Value>(&body).unwrap()["tokens"]
            .as_array()
            .unwrap()
            .len() as u64;
        let our_prompt = tok.count_prompt(&case).unwrap();
        if engine_tokens != our_prompt {
            failures.push(format!(
                "case {i}: /tokenize {engine_tokens} vs ours {our_prompt}"
            ));
        }
        // 3. real completions, two max_tokens settings
        for max_tokens in [8u64, 48] {
            let mut req = case.clone();
            req["max_tokens"] = json!(max_tokens);
            req["temperature"] = json!(0);
            let (st, body) = exactness::http(port, "POST", "/v1/chat/completions", Some(&req));
            assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
            let v: Value = serde_json::from_slice(&body).unwrap();
            let text = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
            let finish = v["choices"][0]["finish_reason"].as_str();
            let usage = &v["usage"];
            n += 1;
            if usage["prompt_tokens"].as_u64() == Some(our_prompt) {
                prompt_exact += 1;
            } else {
                failures.push(format!(
                    "case {i}: usage.prompt_tokens {} vs ours {our_prompt}",
                    usage["prompt_tokens"]
                ));
            }
            let ours = tok.completion_tokens(text, finish);
            if usage["completion_tokens"].as_u64() == Some(ours) {
                completion_exact += 1;
            } else {
                eprintln!("case {i} max_tokens {max_tokens}: completion engine {} ours {ours} finish {finish:?} text {text:?}", usage["completion_tokens"]);
            }
            let (_, tb) = exactness::http(
                port,
                "POST",
                "/tokenize",
                Some(&json!({"content": text, "add_special": false, "parse_special": true})),
            );
            let t = serde_json::from_slice::<Value>(&tb).unwrap()["tokens"]
                .as_array()
                .unwrap()
                .len() as u64;
            if t + u64::from(finish == Some("stop")) == ours {
                completion_vs_tokenize += 1;
            } else {
                failures.push(format!(
                    "case {i}: completion via /tokenize {t} vs ours {ours}"
                ));
            }
        }
    }
    eprintln!(
        "engine comparison: {n} requests; prompt_tokens exact {prompt_exact}/{n}; completion_tokens equal to the engine's claim {completion_exact}/{n}; completion equal to engine /tokenize(+EOS on stop) {completion_vs_tokenize}/{n}"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(prompt_exact, n);
}
