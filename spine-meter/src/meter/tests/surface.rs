//! The request surface (issue 13): the allowlist, `developer` as `system`, the prefill refusal.

use super::*;

fn refused_member(err: &BoxError) -> Option<String> {
    match err.downcast_ref::<MeterError>() {
        Some(MeterError::BadRequest(spine_core::PeekError::UnrecognizedArgument { param })) => {
            Some(param.clone())
        }
        _ => None,
    }
}

#[tokio::test]
async fn members_outside_the_allowlist_are_400_and_never_forwarded() {
    let h = harness().await;
    let user = json!({"role":"user","content":"Hi"});
    for (extra, param) in [
        (json!({"n_predict": 300}), "n_predict"),
        (json!({"n_cmpl": null}), "n_cmpl"),
        (
            json!({"chat_template_kwargs": {"enable_thinking": true}}),
            "chat_template_kwargs",
        ),
        (
            json!({"continue_final_message": true}),
            "continue_final_message",
        ),
        (
            json!({"messages":[{"role":"user","content":"Hi","cache_control":{"type":"ephemeral"}}]}),
            "messages[0].cache_control",
        ),
        (
            json!({"messages":[user.clone()],"tools":[{"type":"function","function":{"name":"f","x":1}}]}),
            "tools[0].function.x",
        ),
    ] {
        let mut body = chat(true, None);
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let svc = h.service(200, "text/event-stream", Vec::new(), End::Eof);
        let err = svc.oneshot(request(param, &body)).await.unwrap_err();
        assert_eq!(refused_member(&err).as_deref(), Some(param), "{body}");
    }
    assert_eq!(h.upstream.lock().unwrap().as_ref(), None);
    let b = h.ledger.account(&h.account).await.unwrap();
    assert_eq!((b.balance_micros, b.held_micros), (START_MICROS, 0));
}

#[tokio::test]
async fn a_developer_message_is_sent_and_counted_as_system() {
    let mut h = harness().await;
    let body = capture_body("a_chat_nonstream.txt");
    let mut prompt_tokens = Vec::new();
    for role in ["developer", "system"] {
        let svc = h.service(200, "application/json", reads_of(&body, 100), End::Eof);
        let req = json!({"model":"smollm2","max_tokens":64,"messages":[
            {"role":role,"content":"Answer briefly."},
            {"role":"user","content":"Name three colors."}]});
        let resp = svc.oneshot(request(role, &req)).await.unwrap();
        assert_eq!(resp.status(), 200);
        drop(resp);
        let sent: Value =
            serde_json::from_slice(h.upstream.lock().unwrap().as_ref().unwrap()).unwrap();
        assert_eq!(sent["messages"][0]["role"], "system", "{sent}");
        assert_eq!(sent["messages"][0]["content"], "Answer briefly.");
        let (s, _) = h.settled().await;
        prompt_tokens.push(s.billed.prompt_tokens);
    }
    assert_eq!(prompt_tokens[0], prompt_tokens[1]);
}

#[tokio::test]
async fn an_assistant_message_last_is_a_refused_prefill() {
    let h = harness().await;
    let req = json!({"model":"smollm2","max_tokens":8,"messages":[
        {"role":"user","content":"Name three colors."},
        {"role":"assistant","content":"Red, "}]});
    let svc = h.service(200, "text/event-stream", Vec::new(), End::Eof);
    let err = svc.oneshot(request("prefill", &req)).await.unwrap_err();
    match err.downcast_ref::<MeterError>() {
        Some(MeterError::BadRequest(spine_core::PeekError::InvalidMessage { path, .. })) => {
            assert_eq!(path, "messages[1].role");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(h.upstream.lock().unwrap().as_ref(), None);
}

/// A `logit_bias` entry an engine reads as another token than the gateway: llama.cpp's
/// `strtol` into a 32-bit token (`"4294967299"`, `"-4294967293"` and the array id
/// `4294967299` are token 3, `<repo_name>`, a control token; `""` is token 0; a key cut at
/// its NUL), Python's `int` in vLLM and SGLang (`"٣"` is 3), their coercion of a string
/// bias. Each raised a control token past the check that refuses `{"3": 100}`: the node then
/// generates tokens shown as no text, billed nothing and flagged. Every such entry is
/// refused before any node; the OpenAI form and llama.cpp's integer pairs are served.
#[tokio::test]
async fn a_logit_bias_an_engine_reads_as_another_token_is_refused_before_the_node() {
    let h = harness().await;
    for bias in [
        json!({"4294967299": 100}),
        json!({"-4294967293": 100}),
        json!({"": 100}),
        json!({"3\u{0}": 100}),
        json!({"\u{663}": 100}),
        json!({"3_0": 100}),
        json!({"+3": 100}),
        json!({"3": "100"}),
        json!({"3": true}),
        json!([[4294967299u64, 100]]),
        json!([[-4294967293i64, 100]]),
        json!([["3", 100]]),
        json!("odd"),
    ] {
        let mut body = chat(true, None);
        body["logit_bias"] = bias.clone();
        let svc = h.service(200, "text/event-stream", Vec::new(), End::Eof);
        let err = svc.oneshot(request("bias", &body)).await.unwrap_err();
        assert!(
            matches!(
                err.downcast_ref::<MeterError>(),
                Some(MeterError::BadRequest(
                    spine_core::PeekError::InvalidField {
                        field: "logit_bias",
                        ..
                    }
                ))
            ),
            "{bias}: {err}"
        );
    }
    assert_eq!(h.upstream.lock().unwrap().as_ref(), None);
    h.assert_account_untouched().await;
    let body = capture_body("a_chat_nonstream.txt");
    for (i, bias) in [
        json!({"2": -100, "0": false}),
        json!({"0002": -100, "1000": 5}),
        json!([[2, -100], [1000, 5.5]]),
        json!({}),
        json!(null),
    ]
    .into_iter()
    .enumerate()
    {
        let mut req = chat(false, None);
        req["logit_bias"] = bias.clone();
        let svc = h.service(200, "application/json", reads_of(&body, 100), End::Eof);
        let resp = svc.oneshot(request(&format!("served{i}"), &req)).await;
        assert_eq!(
            resp.map(|r| r.status()).ok(),
            Some(http::StatusCode::OK),
            "{bias}"
        );
    }
}
