//! Choices against what was asked: several prompts (llama.cpp's usage is one task's), `n`'s
//! range, a requested choice missing, content after a choice finished, index-less choices.

use super::*;

/// `/v1/completions` with the two prompts of the report: `"x"` and a sentence repeated.
fn two_prompts(stream: bool) -> Value {
    let mut v = json!({"model":"smollm2","max_tokens":1,
        "prompt":["x","the cat sat on the mat the cat sat on the mat the cat sat on the mat the cat sat on the mat the cat sat on the mat the cat sat on the mat the cat sat on the mat the cat sat on the mat "]});
    if stream {
        v["stream"] = json!(true);
    }
    v
}

/// `POST /v1/completions` with `body`.
fn cmpl_request(id: &str, body: &Value) -> http::Request<BoxBody> {
    let mut req = request(id, body);
    *req.uri_mut() = http::Uri::from_static("/v1/completions");
    req
}

/// One completion choice as llama.cpp answers it (one task: one prompt, one choice).
fn cmpl_choice(index: u64, text: &str, finish: Option<&str>) -> Value {
    json!({"text":text,"index":index,"logprobs":null,"finish_reason":finish})
}

/// A streamed chat (`n` 1) answered with `stream` as the node's whole body: what the caller got.
async fn streamed_chat(h: &mut Harness, id: &str, stream: String) -> String {
    let svc = h.service(200, "text/event-stream", vec![stream.into()], End::Eof);
    let resp = svc.oneshot(request(id, &chat(true, None))).await.unwrap();
    String::from_utf8(frames(resp.into_body()).await.concat().to_vec()).unwrap()
}

#[tokio::test]
async fn a_claim_for_the_first_prompt_of_several_is_not_a_discrepancy() {
    // non-streamed, as llama.cpp answers several prompts (server-context.cpp: the first task's
    // result with the other tasks' choices appended; its usage is task 0's)
    let answer = |usage: Value| {
        json!({"id":"c","object":"text_completion","created":1,"model":"smollm2",
            "choices":[cmpl_choice(0, " the", Some("length")), cmpl_choice(1, " the", Some("length"))],
            "usage":usage})
    };
    // (claimed prompt, claimed completion, flagged)
    for (prompt, completion, flagged) in
        [(1, 1, false), (50, 2, false), (1, 40, true), (20, 1, true)]
    {
        let mut h = harness().await;
        let body = serde_json::to_vec(&answer(json!({"prompt_tokens":prompt,
            "completion_tokens":completion,"total_tokens":prompt + completion})))
        .unwrap();
        let svc = h.service(200, "application/json", vec![body.into()], End::Eof);
        let resp = svc
            .oneshot(cmpl_request("multi", &two_prompts(false)))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        drop(frames(resp.into_body()).await);
        let (s, _) = h.settled().await;
        assert_eq!(
            (
                s.outcome,
                s.billed.prompt_tokens,
                s.billed.completion_tokens,
                s.discrepancy
            ),
            (StreamOutcome::Completed, 50, 2, flagged),
            "claim {prompt}/{completion}"
        );
    }
    // streamed: every task's final chunk carries that task's usage; the latest is the claim,
    // whichever task finished last
    for last in [0u64, 1] {
        let mut h = harness().await;
        let usage = |i: u64| {
            let p = if i == 0 { 1 } else { 49 };
            json!({"prompt_tokens":p,"completion_tokens":1,"total_tokens":p + 1})
        };
        let chunk = |i: u64| {
            format!(
                "data: {}\n\n",
                json!({"id":"c","object":"text_completion","created":1,"model":"smollm2",
                    "choices":[cmpl_choice(i, " the", Some("length"))],"usage":usage(i)})
            )
        };
        let stream = [chunk(1 - last), chunk(last), "data: [DONE]\n\n".to_owned()].concat();
        let svc = h.service(200, "text/event-stream", vec![stream.into()], End::Eof);
        let resp = svc
            .oneshot(cmpl_request("multis", &two_prompts(true)))
            .await
            .unwrap();
        drop(frames(resp.into_body()).await);
        let (s, _) = h.settled().await;
        assert_eq!(
            (
                s.outcome,
                s.billed.prompt_tokens,
                s.billed.completion_tokens,
                s.discrepancy
            ),
            (StreamOutcome::Completed, 50, 2, false),
            "task {last} last"
        );
    }
}

#[tokio::test]
async fn n_past_openais_bound_is_refused_before_any_node_and_any_hold() {
    let h = harness().await;
    for n in [129u64, 2_147_483_648] {
        let mut body = chat(false, None);
        body["n"] = json!(n);
        let svc = h.service(200, "application/json", Vec::new(), End::Eof);
        let err = svc.oneshot(request("n", &body)).await.unwrap_err();
        let meter = err.downcast_ref::<MeterError>().expect("a meter error");
        assert!(
            matches!(
                meter,
                MeterError::BadRequest(spine_core::PeekError::InvalidField { field: "n", .. })
            ),
            "n {n}: {meter}"
        );
        #[cfg(feature = "axum")]
        {
            let api = crate::openai_error::ApiError::from(meter);
            assert_eq!(
                (api.status.as_u16(), api.kind, api.param.as_deref()),
                (400, "invalid_request_error", Some("n")),
                "n {n}"
            );
        }
    }
    assert_eq!(h.upstream.lock().unwrap().as_ref(), None);
    h.assert_account_untouched().await;
}

#[tokio::test]
async fn a_node_answering_fewer_choices_than_n_is_at_fault() {
    // non-streamed: n = 3, one choice back
    let mut body = chat(false, None);
    body["n"] = json!(3);
    let json_answer_is_a_free_node_fault = |answer: Value, what: &'static str| {
        let body = body.clone();
        async move {
            let mut h = harness().await;
            let svc = h.service(
                200,
                "application/json",
                vec![serde_json::to_vec(&answer).unwrap().into()],
                End::Eof,
            );
            let res = svc.oneshot(request(&what.replace(' ', "-"), &body)).await;
            super::answer::assert_free_node_fault(&mut h, res, what).await;
        }
    };
    json_answer_is_a_free_node_fault(
        json!({"id":"c","object":"chat.completion","created":1,"model":"smollm2",
        "choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"Red"}}],
        "usage":{"prompt_tokens":34,"completion_tokens":2,"total_tokens":36}}),
        "one of three choices",
    )
    .await;
    // choices 0 and 2 of three: the missing one in the middle counts too
    json_answer_is_a_free_node_fault(
        json!({"id":"c","object":"chat.completion","choices":[
        {"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"Red"}},
        {"index":2,"finish_reason":"stop","message":{"role":"assistant","content":"Blue"}}]}),
        "choices 0 and 2 of three",
    )
    .await;

    // streamed: one choice of three finishes, then [DONE]
    let mut h = harness().await;
    body["stream"] = json!(true);
    let stream = [
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Red\"},\"finish_reason\":null}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: [DONE]\n\n",
    ]
    .concat();
    let svc = h.service(200, "text/event-stream", vec![stream.into()], End::Eof);
    let resp = svc.oneshot(request("fewers", &body)).await.unwrap();
    let got = String::from_utf8(frames(resp.into_body()).await.concat().to_vec()).unwrap();
    assert!(got.contains("upstream_failed"), "{got}");
    assert!(!got.contains("[DONE]"), "{got}");
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, r.debit_micros),
        (StreamOutcome::UpstreamFailed, 0)
    );
}

#[tokio::test]
async fn content_after_a_choices_finish_is_the_nodes_fault_never_forwarded_or_billed() {
    let after = "pad ".repeat(10);
    let ok = [
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Red\"},\"finish_reason\":null}]}\n\n".to_owned(),
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n".to_owned(),
    ];
    for late in [
        json!({"index":0,"delta":{"content":after},"finish_reason":null}),
        json!({"index":0,"delta":{"content":after},"finish_reason":"stop"}),
        json!({"index":0,"delta":{"tool_calls":[{"index":0,"id":"c","type":"function",
            "function":{"name":"f","arguments":"{}"}}]},"finish_reason":null}),
    ] {
        let mut h = harness().await;
        let stream = [
            ok[0].clone(),
            ok[1].clone(),
            format!("data: {}\n\n", json!({"choices":[late]})),
            "data: [DONE]\n\n".to_owned(),
        ]
        .concat();
        let got = streamed_chat(&mut h, "late", stream).await;
        assert!(!got.contains("pad") && !got.contains("tool_calls"), "{got}");
        assert!(
            got.contains("upstream_failed") && !got.contains("[DONE]"),
            "{got}"
        );
        let (s, r) = h.settled().await;
        assert_eq!(
            (s.outcome, s.billed.completion_tokens, r.debit_micros),
            (StreamOutcome::UpstreamFailed, 1, 0),
            "{late}"
        );
    }
    // the finish repeated without content is no fault
    let mut h = harness().await;
    let stream = [
        ok[0].clone(),
        ok[1].clone(),
        ok[1].clone(),
        "data: [DONE]\n\n".to_owned(),
    ]
    .concat();
    streamed_chat(&mut h, "again", stream).await;
    assert_eq!(h.settled().await.0.outcome, StreamOutcome::Completed);
}

#[tokio::test]
async fn a_streamed_choice_without_an_index_is_the_nodes_fault() {
    for first in [
        // forwarded as it came before
        json!([{"delta":{"content":"Red"},"finish_reason":null}]),
        json!([{"index":null,"delta":{"content":"Red"},"finish_reason":null}]),
        // the second index-less choice was silently dropped
        json!([{"delta":{"content":"Red"},"finish_reason":null},
            {"delta":{"content":"Blue"},"finish_reason":null}]),
    ] {
        let mut h = harness().await;
        let stream = [
            format!("data: {}\n\n", json!({"choices":first})),
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n"
                .to_owned(),
            "data: [DONE]\n\n".to_owned(),
        ]
        .concat();
        let got = streamed_chat(&mut h, "noindex", stream).await;
        assert!(
            !got.contains("Red") && got.contains("upstream_failed"),
            "{got}"
        );
        let (s, r) = h.settled().await;
        assert_eq!(
            (s.outcome, r.debit_micros),
            (StreamOutcome::UpstreamFailed, 0),
            "{first}"
        );
    }
}

#[test]
fn a_choice_index_past_u64_is_out_of_range_and_a_fraction_not_an_integer() {
    use super::super::node_json::{read_choices, TextMember};
    let read = |index: &str| {
        let raw = serde_json::value::RawValue::from_string(format!(
            r#"[{{"index":{index},"delta":{{"content":"x"}},"finish_reason":null}}]"#
        ))
        .unwrap();
        read_choices(&raw, TextMember::Delta).map(|r| r[0].index)
    };
    for index in [
        "1099511627776.0",
        "1.099511627776e12",
        "18446744073709551616",
        "-1",
    ] {
        assert_eq!(
            read(index),
            Err("a choice's index is out of range"),
            "{index}"
        );
    }
    for index in ["1.5", "\"0\"", "true"] {
        assert_eq!(
            read(index),
            Err("a choice's index is not an integer"),
            "{index}"
        );
    }
    // an index the caller did not ask for is read, and dropped later (never billed)
    assert_eq!(read("1099511627776"), Ok(1_099_511_627_776));
}

#[tokio::test]
async fn the_routed_nodes_context_caps_the_completion_like_the_catalogs() {
    use crate::TokenCounter;
    // the catalog says 2048; the routed node's slot holds 60: a 34-token prompt leaves 26
    let tokenizer = crate::test_support::smollm_tokenizer();
    let mut text = String::new();
    for i in 0.. {
        let next = format!("{text}red {i}, ");
        if tokenizer.count_text(&next) > 26 {
            break;
        }
        text = next;
    }
    let generated = tokenizer.count_text(&text);
    assert!(generated >= 24, "{generated}");
    for node_context in [None, Some(60u64)] {
        let mut h = harness().await;
        let answer = json!({"id":"c","object":"chat.completion","created":1,"model":"smollm2",
            "choices":[{"index":0,"finish_reason":"length",
                "message":{"role":"assistant","content":text}}],
            "usage":{"prompt_tokens":34,"completion_tokens":generated,"total_tokens":34 + generated}});
        let body = Bytes::from(serde_json::to_vec(&answer).unwrap());
        let node = h.node.clone();
        let inner = tower::service_fn(move |req: http::Request<BoxBody>| {
            let (node, body) = (node.clone(), body.clone());
            async move {
                if let Some(slot) = req.extensions().get::<spine_core::NodeSlot>() {
                    slot.set(node.clone());
                    slot.set_context_tokens(node_context);
                }
                let body = BoxBody::new(replay(vec![body], End::Eof));
                Ok::<_, BoxError>(node_response(node, "application/json", body))
            }
        });
        let svc = h.layer(2048).layer(inner);
        let resp = svc
            .oneshot(request("ctx", &chat(false, None)))
            .await
            .unwrap();
        drop(frames(resp.into_body()).await);
        let (s, _) = h.settled().await;
        assert_eq!(s.billed.prompt_tokens, 34);
        match node_context {
            // the catalog's cap (64): a text of fewer bytes than 64 tokens cannot be a
            // `length` finish, so the honest node is flagged
            None => assert!(s.discrepancy, "{:?}", s.billed),
            // the node's cap: the node filled its slot, billed as claimed, not flagged
            Some(_) => assert_eq!(
                (s.outcome, s.billed.completion_tokens, s.discrepancy),
                (StreamOutcome::Completed, 26.min(generated + 5), false),
            ),
        }
    }
}

/// A complete answer's choice without an `index` keeps its place (its position is its index)
/// and reaches the caller with that `index`, which the caller's SDK reads (it was forwarded
/// without one).
#[tokio::test]
async fn a_complete_answers_choice_without_an_index_reaches_the_caller_with_its_position() {
    let mut h = harness().await;
    let mut body = chat(false, None);
    body["n"] = json!(2);
    let answer = json!({"id":"c","object":"chat.completion","created":1,"model":"smollm2",
        "choices":[
            {"finish_reason":"stop","message":{"role":"assistant","content":"Red"}},
            {"index":null,"finish_reason":"stop","message":{"role":"assistant","content":"Blue"}}]});
    let svc = h.service(
        200,
        "application/json",
        vec![serde_json::to_vec(&answer).unwrap().into()],
        End::Eof,
    );
    let resp = svc.oneshot(request("noindex-json", &body)).await.unwrap();
    assert_eq!(resp.status(), 200);
    let got: Value = serde_json::from_slice(&frames(resp.into_body()).await.concat()).unwrap();
    let indexes: Vec<_> = got["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["index"].as_u64(), c["message"]["content"].as_str()))
        .collect();
    assert_eq!(
        indexes,
        [(Some(0), Some("Red")), (Some(1), Some("Blue"))],
        "{got}"
    );
    assert_eq!(h.settled().await.0.outcome, StreamOutcome::Completed);
}
