//! The exactness study's fixed CI subset against the real engine (`docs/metering.md`): 40
//! requests (greedy and sampled, streamed and not, `n: 2`, tools, English, code, emoji, CJK,
//! multi-turn), `max_tokens` at most 16 to keep it quick. Every prompt count must equal the
//! engine's; a completion may miss only in the documented way (a `stop` finish whose text the
//! model generated as more tokens than its canonical tokenization), at most once.
//!
//! Needs the engine and model from `scripts/setup.sh`; fails when they are missing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

#[path = "support/exactness.rs"]
mod exactness;

use serde_json::json;
use spine_meter::ModelTokenizer;

#[test]
fn billing_rules_match_the_engine_on_the_ci_subset() {
    let found = spine_test_support::Engine::discover().unwrap();
    let tok = ModelTokenizer::from_gguf(&found.model_gguf).unwrap();
    let engine = exactness::start_engine(&found.llama_server, &found.model_gguf);
    let port = engine.port;
    let mut cases = exactness::cases(40);
    for c in &mut cases {
        let original = c.body["max_tokens"].as_u64().unwrap();
        let m = original.min(16);
        c.body["max_tokens"] = json!(m);
        c.name = c
            .name
            .replace(&format!("max={original}"), &format!("max={m}"));
    }
    let results = exactness::run_all(port, &tok, &cases, 2);
    eprintln!("{}", exactness::table(&results));
    assert_eq!(results.len(), 40);
    let misses = documented_misses(&results);
    // One documented miss is what this subset gives (request 010); allow one more of the same
    // kind so a different sampling path on a loaded machine can't turn CI red. Any other kind of
    // miss fails above.
    assert!(
        misses.len() <= 2,
        "more misses than documented:\n{}",
        misses.join("\n")
    );
}

/// The Responses API's requests (`responses_cases`: the study's cases written as Responses
/// requests and translated as the gateway translates them) bill like the engine counts: every
/// prompt exact, a completion missing only in the documented way.
#[test]
fn translated_responses_requests_match_the_engine() {
    let found = spine_test_support::Engine::discover().unwrap();
    let tok = ModelTokenizer::from_gguf(&found.model_gguf).unwrap();
    let engine = exactness::start_engine(&found.llama_server, &found.model_gguf);
    let mut cases = exactness::responses_cases(24);
    for c in &mut cases {
        let m = c.body["max_tokens"].as_u64().unwrap().min(16);
        c.body["max_tokens"] = json!(m);
    }
    let results = exactness::run_all(engine.port, &tok, &cases, 2);
    eprintln!("{}", exactness::table(&results));
    assert!(results.len() >= 20, "{}", results.len());
    let misses = documented_misses(&results);
    assert!(misses.len() <= 2, "{}", misses.join("\n"));
}

/// Checks every prompt is exact and every completion miss is the documented kind (generated
/// non-canonically, so the engine counts more tokens than the text has; only on `stop`, as
/// `length` bills `max_tokens`); returns the misses' rows.
fn documented_misses(results: &[exactness::Measured]) -> Vec<String> {
    let mut misses = Vec::new();
    for m in results {
        assert_eq!(m.our_prompt, m.engine_prompt, "{}", exactness::row(m));
        if m.our_completion != m.engine_completion {
            let documented =
                m.finish.iter().all(|f| f == "stop") && m.engine_completion > m.our_completion;
            assert!(documented, "an undocumented miss: {}", exactness::row(m));
            misses.push(exactness::row(m));
        }
    }
    misses
}
