use super::*;

#[test]
fn reads_fields_and_defaults() {
    let p = RequestPeek::from_json(br#"{"model":"smollm2","messages":[]}"#);
    assert_eq!(
        p,
        Ok(RequestPeek {
            model: ModelId::new("smollm2"),
            stream: false,
            include_usage: false,
            n: 1,
            max_tokens: None,
            prompt_cache_key: None,
            conversation_key: p.as_ref().ok().and_then(|p| p.conversation_key),
            tokenization_constrained: false,
        })
    );
    assert!(p.is_ok_and(|p| p.conversation_key.is_some()));
    let p = RequestPeek::from_json(
        br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"n":2,
            "max_tokens":7,"max_completion_tokens":7,"prompt_cache_key":"k"}"#,
    );
    assert_eq!(
        p,
        Ok(RequestPeek {
            model: ModelId::new("m"),
            stream: true,
            include_usage: true,
            n: 2,
            max_tokens: Some(7),
            prompt_cache_key: Some("k".into()),
            conversation_key: None,
            tokenization_constrained: false,
        })
    );
}

#[test]
fn nulls_mean_defaults() {
    let p = RequestPeek::from_json(
        br#"{"model":"m","stream":null,"stream_options":null,"n":null,"max_tokens":null}"#,
    );
    assert_eq!(
        p.map(|p| (p.stream, p.include_usage, p.n, p.max_tokens)),
        Ok((false, false, 1, None))
    );
}

#[test]
fn rejects_bad_bodies_with_exact_errors() {
    assert!(matches!(
        RequestPeek::from_json(b"{"),
        Err(PeekError::NotJson(_))
    ));
    assert_eq!(RequestPeek::from_json(b"[1]"), Err(PeekError::NotObject));
    assert_eq!(RequestPeek::from_json(b"{}"), Err(PeekError::MissingModel));
    assert_eq!(
        RequestPeek::from_json(br#"{"model":5}"#),
        Err(PeekError::InvalidField {
            field: "model",
            expected: "a non-empty string"
        })
    );
    assert_eq!(
        RequestPeek::from_json(br#"{"model":"m","stream":"yes"}"#),
        Err(PeekError::InvalidField {
            field: "stream",
            expected: "a boolean"
        })
    );
    assert_eq!(
        RequestPeek::from_json(br#"{"model":"m","n":0}"#),
        Err(PeekError::InvalidField {
            field: "n",
            expected: "an integer >= 1"
        })
    );
    assert_eq!(
        RequestPeek::from_json(br#"{"model":"m","max_tokens":-1}"#),
        Err(PeekError::InvalidField {
            field: "max_tokens",
            expected: "an integer >= 1"
        })
    );
}

#[test]
fn token_limits_are_at_least_one_and_agree_and_echo_is_refused() {
    // SGLang reads `max_completion_tokens or max_tokens`: a 0 would fall through to the other
    for (body, field) in [
        (&br#"{"model":"m","max_tokens":0}"#[..], "max_tokens"),
        (
            br#"{"model":"m","max_completion_tokens":0}"#,
            "max_completion_tokens",
        ),
        (
            br#"{"model":"m","max_completion_tokens":0,"max_tokens":4096}"#,
            "max_completion_tokens",
        ),
        (
            br#"{"model":"m","max_completion_tokens":8,"max_tokens":4096}"#,
            "max_tokens",
        ),
    ] {
        assert!(
            matches!(RequestPeek::from_json(body), Err(PeekError::InvalidField { field: f, .. }) if f == field),
            "{}",
            String::from_utf8_lossy(body)
        );
    }
    assert_eq!(
        RequestPeek::from_json(br#"{"model":"m","max_completion_tokens":8,"max_tokens":8}"#)
            .map(|p| p.max_tokens),
        Ok(Some(8))
    );
    assert_eq!(
        RequestPeek::from_json(br#"{"model":"m","prompt":"hi","echo":true}"#),
        Err(PeekError::UnsupportedParameter { field: "echo" })
    );
    for ok in [
        &br#"{"model":"m","echo":false}"#[..],
        br#"{"model":"m","echo":null}"#,
    ] {
        assert!(RequestPeek::from_json(ok).is_ok());
    }
    assert!(matches!(
        RequestPeek::from_json(br#"{"model":"m","echo":"yes"}"#),
        Err(PeekError::InvalidField { field: "echo", .. })
    ));
}

fn msg_err(body: serde_json::Value) -> Result<(), PeekError> {
    validate_chat_messages(&body)
}

fn at(path: &str, reason: &'static str) -> Result<(), PeekError> {
    Err(PeekError::InvalidMessage {
        path: path.to_owned(),
        reason,
    })
}

#[test]
fn engine_generation_fields_are_refused_by_name_and_null_is_absent() {
    for field in ENGINE_GENERATION_FIELDS {
        let body = format!(r#"{{"model":"m","max_tokens":1,"{field}":300}}"#);
        assert_eq!(
            RequestPeek::from_json(body.as_bytes()),
            Err(PeekError::UnsupportedParameter { field }),
            "{field}"
        );
        let body = format!(r#"{{"model":"m","{field}":null}}"#);
        assert!(RequestPeek::from_json(body.as_bytes()).is_ok(), "{field}");
    }
    // Ollama's options object, any content
    assert_eq!(
        RequestPeek::from_json(br#"{"model":"m","options":{"num_predict":300}}"#),
        Err(PeekError::UnsupportedParameter { field: "options" })
    );
    // a field given twice is ambiguous (engines take the last, serde the first): refused
    assert!(matches!(
        RequestPeek::from_json(br#"{"model":"m","max_tokens":1,"max_tokens":300}"#),
        Err(PeekError::NotJson(_))
    ));
    assert!(matches!(
        RequestPeek::from_json(br#"{"model":"m","n":1,"n":2}"#),
        Err(PeekError::NotJson(_))
    ));
}

#[test]
fn valid_messages_pass() {
    use serde_json::json;
    assert_eq!(
        msg_err(json!({"messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},
            {"role":"assistant","tool_calls":[{"id":"c2"}]},
            {"role":"tool","tool_call_id":"c1","content":"42"}
        ]})),
        Ok(())
    );
}

#[test]
fn malformed_messages_name_the_exact_path() {
    use serde_json::json;
    let m = "expected a non-empty array of message objects";
    assert_eq!(msg_err(json!({"model":"m"})), at("messages", m));
    assert_eq!(msg_err(json!({"messages":[]})), at("messages", m));
    assert_eq!(msg_err(json!({"messages":"hi"})), at("messages", m));
    assert_eq!(msg_err(json!([])), Err(PeekError::NotObject));
    assert_eq!(
        msg_err(json!({"messages":["hi"]})),
        at("messages[0]", "expected an object")
    );
    assert_eq!(
        msg_err(json!({"messages":[{"content":"x"}]})),
        at("messages[0].role", "expected a string")
    );
    assert_eq!(
        msg_err(json!({"messages":[{"role":1,"content":"x"}]})),
        at("messages[0].role", "expected a string")
    );
    assert_eq!(
        msg_err(json!({"messages":[{"role":"user","content":"ok"},{"role":"user","content":5}]})),
        at("messages[1].content", CONTENT_EXPECTED)
    );
    assert_eq!(
        msg_err(json!({"messages":[{"role":"user","content":{"text":"x"}}]})),
        at("messages[0].content", CONTENT_EXPECTED)
    );
    assert_eq!(
        msg_err(json!({"messages":[{"role":"user"}]})),
        at("messages[0].content", CONTENT_EXPECTED)
    );
    assert_eq!(
        msg_err(json!({"messages":[{"role":"user","content":null,"tool_calls":[{"id":"c"}]}]})),
        at("messages[0].content", CONTENT_EXPECTED)
    );
    assert_eq!(
        msg_err(json!({"messages":[{"role":"assistant","content":null,"tool_calls":[]}]})),
        at("messages[0].content", CONTENT_EXPECTED)
    );
    assert_eq!(
        msg_err(
            json!({"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]}]})
        ),
        at(
            "messages[0].content[1].type",
            "unsupported content part type for this model"
        )
    );
    assert_eq!(
        msg_err(json!({"messages":[{"role":"user","content":[{"type":"text"}]}]})),
        at("messages[0].content[0].text", "expected a string")
    );
    assert_eq!(
        msg_err(json!({"messages":[{"role":"user","content":[{"text":"a"}]}]})),
        at("messages[0].content[0].type", "expected a string")
    );
    assert_eq!(
        msg_err(json!({"messages":[{"role":"user","content":["a"]}]})),
        at("messages[0].content[0]", "expected an object")
    );
    assert_eq!(
        PeekError::InvalidMessage {
            path: "messages[0].content[1].type".into(),
            reason: "unsupported content part type for this model"
        }
        .to_string(),
        "invalid value for 'messages[0].content[1].type': unsupported content part type for this model"
    );
}

#[test]
fn prompt_shapes_split_like_llama_cpp() {
    use serde_json::json;
    use PromptSegment::{Text, TokenIds};
    let b = json!({"prompt": "hi"});
    assert_eq!(prompt_inputs(&b, "prompt"), Ok(vec![vec![Text("hi")]]));
    let b = json!({"prompt": ["a", "b"]});
    assert_eq!(
        prompt_inputs(&b, "prompt"),
        Ok(vec![vec![Text("a")], vec![Text("b")]])
    );
    let b = json!({"input": [1, 2, 3]});
    assert_eq!(prompt_inputs(&b, "input"), Ok(vec![vec![TokenIds(3)]]));
    let b = json!({"prompt": [[1, 2], [3], ["x", 4, 5]]});
    assert_eq!(
        prompt_inputs(&b, "prompt"),
        Ok(vec![
            vec![TokenIds(2)],
            vec![TokenIds(1)],
            vec![Text("x"), TokenIds(2)]
        ])
    );
    let b = json!({"prompt": [7, "x", 8]});
    assert_eq!(
        prompt_inputs(&b, "prompt"),
        Ok(vec![vec![TokenIds(1), Text("x"), TokenIds(1)]])
    );
    let bad = |field| {
        Err(PeekError::InvalidField {
            field,
            expected: PROMPT_EXPECTED,
        })
    };
    for b in [
        json!({}),
        json!({"prompt": null}),
        json!({"prompt": 5}),
        json!({"prompt": []}),
        json!({"prompt": [[]]}),
        json!({"prompt": [{"a": 1}]}),
        json!({"prompt": [-1]}),
        json!({"prompt": [1.5]}),
        json!({"prompt": [[1, [2]]]}),
    ] {
        assert_eq!(prompt_inputs(&b, "prompt"), bad("prompt"), "{b}");
    }
    assert_eq!(
        prompt_inputs(&json!([1]), "input"),
        Err(PeekError::NotObject)
    );
}

#[test]
fn kinds_by_path() {
    for k in [
        RequestKind::ChatCompletions,
        RequestKind::Completions,
        RequestKind::Embeddings,
    ] {
        assert_eq!(RequestKind::from_path(k.path()), Some(k));
    }
    assert_eq!(RequestKind::from_path("/v1/models"), None);
}

fn key(body: serde_json::Value) -> Option<u64> {
    RequestPeek::from_json(body.to_string().as_bytes())
        .ok()
        .and_then(|p| p.conversation_key)
}

#[test]
fn conversation_key_is_the_same_on_every_turn_of_one_chat() {
    use serde_json::json;
    let sys = json!({"role":"system","content":"You are terse."});
    let u1 = json!({"role":"user","content":"Tell me about Rust."});
    let a1 = json!({"role":"assistant","content":"A systems language."});
    let u2 = json!({"role":"user","content":"And tokio?"});
    let turn1 = key(json!({"model":"m","messages":[sys, u1]}));
    let turn2 = key(json!({"model":"m","stream":true,"messages":[sys, u1, a1, u2]}));
    assert!(turn1.is_some());
    assert_eq!(turn1, turn2);
    // text parts hash like the same string split in parts, whitespace in the JSON is ignored
    let parts = json!({"role":"user","content":[{"type":"text","text":"Tell me about Rust."}]});
    assert_eq!(key(json!({"model":"m","messages":[sys, parts]})), turn1);
    let spaced = br#"{ "model" : "m", "messages" : [ {"role":"system","content":"You are terse."},
        {"content":"Tell me about Rust.","role":"user"} ] }"#;
    assert_eq!(
        RequestPeek::from_json(spaced)
            .ok()
            .and_then(|p| p.conversation_key),
        turn1
    );
}

#[test]
fn conversation_key_differs_by_model_and_opening() {
    use serde_json::json;
    let u1 = json!({"role":"user","content":"hi"});
    let base = key(json!({"model":"m","messages":[u1]}));
    assert_ne!(key(json!({"model":"m2","messages":[u1]})), base);
    assert_ne!(
        key(json!({"model":"m","messages":[{"role":"user","content":"hi!"}]})),
        base
    );
    assert_ne!(
        key(json!({"model":"m","messages":[{"role":"system","content":"x"}, u1]})),
        base
    );
    // field boundaries: role "us"+"er..." must not equal role "user"
    assert_ne!(
        key(json!({"model":"m","messages":[{"role":"us","content":"erhi"}]})),
        key(json!({"model":"m","messages":[{"role":"user","content":"hi"}]}))
    );
    // no messages, or a malformed array: no key, and no error from the peek
    assert_eq!(key(json!({"model":"m","prompt":"hi"})), None);
    assert_eq!(key(json!({"model":"m","messages":"hi"})), None);
    assert_eq!(key(json!({"model":"m","messages":[1]})), None);
    assert!(RequestPeek::from_json(br#"{"model":"m","messages":[1]}"#).is_ok());
}

proptest::proptest! {
    #[test]
    fn never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
        let _ = RequestPeek::from_json(&bytes);
    }
}

#[test]
fn answer_sizes_past_openais_bounds_are_refused() {
    let peek = |body: &str| RequestPeek::from_json(body.as_bytes());
    for ok in [
        r#"{"model":"m","logprobs":true,"top_logprobs":20}"#,
        r#"{"model":"m","top_logprobs":0,"n_probs":20}"#,
        r#"{"model":"m","prompt":"x","logprobs":5}"#,
        r#"{"model":"m","logprobs":null,"top_logprobs":null}"#,
        r#"{"model":"m","max_tokens":2147483647}"#,
    ] {
        assert!(peek(ok).is_ok(), "{ok}");
    }
    for (bad, field) in [
        (
            r#"{"model":"m","logprobs":true,"top_logprobs":21}"#,
            "top_logprobs",
        ),
        (r#"{"model":"m","top_logprobs":49152}"#, "top_logprobs"),
        (r#"{"model":"m","top_logprobs":-1}"#, "top_logprobs"),
        (r#"{"model":"m","n_probs":100}"#, "n_probs"),
        (r#"{"model":"m","prompt":"x","logprobs":6}"#, "logprobs"),
        (r#"{"model":"m","logprobs":"yes"}"#, "logprobs"),
        (r#"{"model":"m","max_tokens":2147483648}"#, "max_tokens"),
        (
            r#"{"model":"m","max_completion_tokens":4294967297}"#,
            "max_completion_tokens",
        ),
    ] {
        let got = peek(bad);
        assert!(
            matches!(&got, Err(PeekError::InvalidField { field: f, .. }) if *f == field),
            "{bad}: {got:?}"
        );
    }
}

#[test]
fn sampling_constraints_mark_the_request() {
    let constrained =
        |body: &str| RequestPeek::from_json(body.as_bytes()).map(|p| p.tokenization_constrained);
    for body in [
        r#"{"model":"m","logit_bias":{"27244":100}}"#,
        r#"{"model":"m","logit_bias":"odd"}"#,
        r#"{"model":"m","response_format":{"type":"json_object"}}"#,
        r#"{"model":"m","response_format":{"type":"json_schema","json_schema":{}}}"#,
        r#"{"model":"m","grammar":"root ::= \"x\""}"#,
        r#"{"model":"m","json_schema":{}}"#,
        r#"{"model":"m","guided_regex":"a+"}"#,
        r#"{"model":"m","guided_choice":["a"]}"#,
        r#"{"model":"m","structured_outputs":{"regex":"a"}}"#,
        r#"{"model":"m","ebnf":"x"}"#,
        r#"{"model":"m","format":"json"}"#,
    ] {
        assert_eq!(constrained(body), Ok(true), "{body}");
    }
    for body in [
        r#"{"model":"m"}"#,
        r#"{"model":"m","logit_bias":{}}"#,
        r#"{"model":"m","logit_bias":null,"grammar":null}"#,
        r#"{"model":"m","response_format":{"type":"text"}}"#,
    ] {
        assert_eq!(constrained(body), Ok(false), "{body}");
    }
}
