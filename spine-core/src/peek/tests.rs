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
        &br#"{"model":"m","prompt":"hi","echo":false}"#[..],
        br#"{"model":"m","prompt":"hi","echo":null}"#,
    ] {
        assert!(RequestPeek::from_json(ok).is_ok());
    }
    assert!(matches!(
        RequestPeek::from_json(br#"{"model":"m","prompt":"hi","echo":"yes"}"#),
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
fn engine_generation_fields_are_refused_by_the_allowlist_even_null() {
    for kind in [RequestKind::ChatCompletions, RequestKind::Completions] {
        for field in ENGINE_GENERATION_FIELDS {
            for value in ["300", "null", "true", r#"{"num_predict":300}"#] {
                let body = format!(r#"{{"model":"m","max_tokens":1,"{field}":{value}}}"#);
                let got = RequestPeek::for_endpoint(kind, body.as_bytes());
                let refused = match &got {
                    Err(PeekError::UnrecognizedArgument { param }) => param == field,
                    // OpenAI's own `best_of` (completions): documented, not served
                    Err(PeekError::UnsupportedParameter { field: f }) => *f == field,
                    _ => false,
                };
                // a documented-but-not-served member set to null is absent
                let null_ok = value == "null" && field == "best_of" && got.is_ok();
                assert!(refused || null_ok, "{kind:?} {field}={value}: {got:?}");
            }
        }
    }
    // a field given twice is ambiguous (engines take the last, serde the first): refused
    assert!(matches!(
        RequestPeek::from_json(br#"{"model":"m","max_tokens":1,"max_tokens":300}"#),
        Err(PeekError::NotJson(_))
    ));
    assert!(matches!(
        RequestPeek::from_json(br#"{"model":"m","n":1,"n":2}"#),
        Err(PeekError::NotJson(_))
    ));
    assert!(matches!(
        RequestPeek::from_json(br#"{"model":"m","n":1,"\u006e":2}"#),
        Err(PeekError::NotJson(_))
    ));
}

#[test]
fn every_member_outside_the_endpoints_allowlist_is_refused_with_its_name() {
    let refused = |kind, body: &str| match RequestPeek::for_endpoint(kind, body.as_bytes()) {
        Err(PeekError::UnrecognizedArgument { param }) => Some(param),
        _ => None,
    };
    let chat = RequestKind::ChatCompletions;
    let text = RequestKind::Completions;
    let embed = RequestKind::Embeddings;
    for (kind, body, param) in [
        // engine switches that change what is generated or rendered
        (
            chat,
            r#"{"model":"m","chat_template_kwargs":{"enable_thinking":true}}"#,
            "chat_template_kwargs",
        ),
        (
            chat,
            r#"{"model":"m","continue_final_message":true}"#,
            "continue_final_message",
        ),
        (
            chat,
            r#"{"model":"m","add_generation_prompt":false}"#,
            "add_generation_prompt",
        ),
        (chat, r#"{"model":"m","n_probs":5}"#, "n_probs"),
        (
            chat,
            r#"{"model":"m","timings_per_token":true}"#,
            "timings_per_token",
        ),
        (text, r#"{"model":"m","prompt":"x","n_keep":-1}"#, "n_keep"),
        (
            text,
            r#"{"model":"m","prompt":"x","cache_prompt":null}"#,
            "cache_prompt",
        ),
        // escaped names are read unescaped
        (chat, r#"{"model":"m","n_pr\u0065dict":9}"#, "n_predict"),
        // another endpoint's members
        (chat, r#"{"model":"m","prompt":"x"}"#, "prompt"),
        (chat, r#"{"model":"m","echo":false}"#, "echo"),
        (
            text,
            r#"{"model":"m","prompt":"x","messages":[]}"#,
            "messages",
        ),
        (
            text,
            r#"{"model":"m","prompt":"x","reasoning_effort":"low"}"#,
            "reasoning_effort",
        ),
        (text, r#"{"model":"m","prompt":"x","tools":[]}"#, "tools"),
        (
            embed,
            r#"{"model":"m","input":"x","stream":false}"#,
            "stream",
        ),
        (
            embed,
            r#"{"model":"m","input":"x","max_tokens":5}"#,
            "max_tokens",
        ),
        (embed, r#"{"model":"m","input":"x","top_k":5}"#, "top_k"),
        // nested
        (
            chat,
            r#"{"model":"m","stream_options":{"chunk_size":1}}"#,
            "stream_options.chunk_size",
        ),
    ] {
        assert_eq!(refused(kind, body), Some(param.to_owned()), "{body}");
    }
    // documented by OpenAI, not served: refused unless null
    for (kind, body, field) in [
        (chat, r#"{"model":"m","audio":{"voice":"x"}}"#, "audio"),
        (chat, r#"{"model":"m","functions":[]}"#, "functions"),
        (
            chat,
            r#"{"model":"m","prediction":{"type":"content","content":"x"}}"#,
            "prediction",
        ),
        (
            text,
            r#"{"model":"m","prompt":"x","suffix":"end"}"#,
            "suffix",
        ),
        (text, r#"{"model":"m","prompt":"x","best_of":3}"#, "best_of"),
    ] {
        assert_eq!(
            RequestPeek::for_endpoint(kind, body.as_bytes()),
            Err(PeekError::UnsupportedParameter { field }),
            "{body}"
        );
    }
    // every member OpenAI documents and this gateway serves, plus the shared sampling extras
    let chat_body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,
        "stream_options":{"include_usage":true,"include_obfuscation":false,
        "continuous_usage_stats":false},"n":1,"max_tokens":5,
        "max_completion_tokens":5,"stop":["x"],"seed":1,"temperature":0.5,"top_p":0.9,
        "frequency_penalty":0,"presence_penalty":0,"logit_bias":{},"logprobs":true,
        "top_logprobs":2,"response_format":{"type":"text"},"tools":[],"tool_choice":"auto",
        "parallel_tool_calls":true,"reasoning_effort":"low","verbosity":"low","user":"u",
        "metadata":{},"store":false,"service_tier":"auto","safety_identifier":"s",
        "prompt_cache_key":"k","prompt_cache_retention":"in_memory","top_k":40,"min_p":0.05,
        "repetition_penalty":1.1,"audio":null,"modalities":null}"#;
    assert!(RequestPeek::for_endpoint(chat, chat_body.as_bytes()).is_ok());
    let text_body = r#"{"model":"m","prompt":"x","stream":false,"n":1,"max_tokens":5,"stop":null,
        "seed":1,"temperature":1,"top_p":1,"frequency_penalty":0,"presence_penalty":0,
        "logit_bias":null,"logprobs":2,"echo":false,"user":"u","suffix":null,"best_of":null,
        "top_k":1,"min_p":0,"repetition_penalty":1,"max_completion_tokens":5,
        "top_logprobs":1}"#;
    assert!(RequestPeek::for_endpoint(text, text_body.as_bytes()).is_ok());
    let embed_body =
        r#"{"model":"m","input":["a"],"dimensions":8,"encoding_format":"float","user":"u"}"#;
    assert!(RequestPeek::for_endpoint(embed, embed_body.as_bytes()).is_ok());
    // the message is OpenAI's own
    assert_eq!(
        PeekError::UnrecognizedArgument {
            param: "n_predict".into()
        }
        .to_string(),
        "Unrecognized request argument supplied: n_predict"
    );
    // reasoning_effort: OpenAI's values only
    assert!(matches!(
        RequestPeek::for_endpoint(chat, br#"{"model":"m","reasoning_effort":"max"}"#),
        Err(PeekError::InvalidField {
            field: "reasoning_effort",
            ..
        })
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
            {"role":"assistant","tool_calls":[{"id":"c2","type":"function","function":{"name":"g","arguments":"not json"}}]},
            {"role":"tool","tool_call_id":"c1","content":"42"}
        ]})),
        Ok(())
    );
}

#[test]
fn members_inside_messages_and_tools_are_allowlisted_with_their_path() {
    use serde_json::json;
    let unrecognized = |param: &str| {
        Err(PeekError::UnrecognizedArgument {
            param: param.to_owned(),
        })
    };
    let user = json!({"role":"user","content":"hi"});
    for (body, param) in [
        (
            json!({"messages":[{"role":"user","content":"hi","cache_control":null}]}),
            "messages[0].cache_control",
        ),
        (
            json!({"messages":[{"role":"user","content":"hi","tool_calls":[]}]}),
            "messages[0].tool_calls",
        ),
        (
            json!({"messages":[{"role":"system","content":"x","prefix":true}, user]}),
            "messages[0].prefix",
        ),
        (
            json!({"messages":[{"role":"user","content":[{"type":"text","text":"a","cache_control":{}}]}]}),
            "messages[0].content[0].cache_control",
        ),
        (
            json!({"messages":[user, {"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","index":0,"function":{"name":"f","arguments":"{}"}}]}, {"role":"tool","tool_call_id":"c","content":"1"}]}),
            "messages[1].tool_calls[0].index",
        ),
        (
            json!({"messages":[user, {"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}","parsed":{}}}]}, {"role":"tool","tool_call_id":"c","content":"1"}]}),
            "messages[1].tool_calls[0].function.parsed",
        ),
        (
            json!({"messages":[{"role":"tool","tool_call_id":"c","content":"1","name":"f"}]}),
            "messages[0].name",
        ),
        (
            json!({"messages":[user],"tools":[{"type":"function","function":{"name":"f","examples":[]}}]}),
            "tools[0].function.examples",
        ),
        (
            json!({"messages":[user],"tools":[{"type":"function","function":{"name":"f"},"cache_control":{}}]}),
            "tools[0].cache_control",
        ),
    ] {
        assert_eq!(msg_err(body), unrecognized(param), "{param}");
    }
    for (body, path) in [
        (
            json!({"messages":[{"role":"function","name":"f","content":"1"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages":[{"role":"ipython","content":"1"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages":[user],"tools":[{"type":"custom","custom":{"name":"f"}}]}),
            "tools[0].type",
        ),
        (
            json!({"messages":[user],"tools":[{"type":"function"}]}),
            "tools[0].function",
        ),
        (json!({"messages":[user],"tools":{}}), "tools"),
        (
            json!({"messages":[user, {"role":"assistant","content":"x","audio":{"id":"a"}}, user]}),
            "messages[1].audio",
        ),
        (
            json!({"messages":[user, {"role":"assistant","content":null,"function_call":{"name":"f","arguments":"{}"}}, user]}),
            "messages[1].function_call",
        ),
        (
            json!({"messages":[user, {"role":"assistant","tool_calls":[{"id":"c","type":"custom"}]}, user]}),
            "messages[1].tool_calls[0].type",
        ),
        // member types, as OpenAI types them (llama.cpp answers 500 to a numeric description)
        (
            json!({"messages":[user],"tools":[{"type":"function","function":{"name":"f","description":5}}]}),
            "tools[0].function.description",
        ),
        (
            json!({"messages":[user],"tools":[{"type":"function","function":{"name":"f","description":null}}]}),
            "tools[0].function.description",
        ),
        (
            json!({"messages":[user],"tools":[{"type":"function","function":{"name":"f","parameters":"{}"}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"messages":[user],"tools":[{"type":"function","function":{"name":"f","strict":"yes"}}]}),
            "tools[0].function.strict",
        ),
        (
            json!({"messages":[user, {"role":"assistant","tool_calls":[{"id":7,"type":"function","function":{"name":"f","arguments":"{}"}}]}, user]}),
            "messages[1].tool_calls[0].id",
        ),
        (
            json!({"messages":[user, {"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":["f"],"arguments":"{}"}}]}, user]}),
            "messages[1].tool_calls[0].function.name",
        ),
        (
            json!({"messages":[user, {"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":{}}}]}, user]}),
            "messages[1].tool_calls[0].function.arguments",
        ),
        // each of these is a 500 from llama.cpp ("Failed to parse messages")
        (
            json!({"messages":[user, {"role":"assistant","tool_calls":[{"id":null,"type":"function","function":{"name":"f","arguments":"{}"}}]}, user]}),
            "messages[1].tool_calls[0].id",
        ),
        (
            json!({"messages":[user, {"role":"assistant","tool_calls":[{"id":"c","function":{"name":"f","arguments":"{}"}}]}, user]}),
            "messages[1].tool_calls[0].type",
        ),
        (
            json!({"messages":[user, {"role":"assistant","tool_calls":[{"id":"c","type":"function"}]}, user]}),
            "messages[1].tool_calls[0].function",
        ),
        (
            json!({"messages":[user, {"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f"}}]}, user]}),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            json!({"messages":[{"role":"user","content":"hi","name":5}]}),
            "messages[0].name",
        ),
        (
            json!({"messages":[user, {"role":"assistant","content":"x","name":null}, user]}),
            "messages[1].name",
        ),
        (
            json!({"messages":[user, {"role":"assistant","content":"x","reasoning_content":null}, user]}),
            "messages[1].reasoning_content",
        ),
        (
            json!({"messages":[user, {"role":"tool","content":"1","tool_call_id":null}]}),
            "messages[1].tool_call_id",
        ),
    ] {
        assert!(
            matches!(msg_err(body), Err(PeekError::InvalidMessage { path: p, .. }) if p == path),
            "{path}"
        );
    }
    // what an SDK sends back of an answer, and the developer role
    assert_eq!(
        msg_err(json!({"messages":[
            {"role":"developer","content":"be brief","name":"ops"},
            user,
            {"role":"assistant","content":"x","refusal":null,"audio":null,"function_call":null,
             "annotations":[],"reasoning_content":"hm","tool_calls":null},
            user
        ],"tools":[{"type":"function","function":{"name":"f","description":"d","parameters":{},"strict":true}}]})),
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
    // a user message has no tool_calls member at all
    assert_eq!(
        msg_err(json!({"messages":[{"role":"user","content":null,"tool_calls":[{"id":"c"}]}]})),
        Err(PeekError::UnrecognizedArgument {
            param: "messages[0].tool_calls".into()
        })
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
        r#"{"model":"m","top_logprobs":0}"#,
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
        r#"{"model":"m","allowed_token_ids":[1,2]}"#,
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

#[test]
fn a_chat_ending_with_the_assistant_is_a_refused_prefill() {
    use serde_json::json;
    let user = json!({"role":"user","content":"Name three colors."});
    for last in [
        json!({"role":"assistant","content":"Red, "}),
        json!({"role":"assistant","content":[{"type":"text","text":"Red"}]}),
        json!({"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]}),
    ] {
        assert!(
            matches!(
                msg_err(json!({"messages":[user.clone(), last.clone()]})),
                Err(PeekError::InvalidMessage { path, .. }) if path == "messages[1].role"
            ),
            "{last}"
        );
    }
    assert_eq!(
        msg_err(json!({"messages":[{"role":"assistant","content":"x"}]})),
        at(
            "messages[0].role",
            "the last message must not be an assistant message: continuing an assistant turn (prefill) is not supported"
        )
    );
    assert_eq!(
        msg_err(json!({"messages":[user.clone(), {"role":"assistant","content":"Red"}, user]})),
        Ok(())
    );
}

#[test]
fn n_is_refused_outside_openais_range() {
    for n in ["129", "2147483648", "4294967297", "-1"] {
        let body = format!(r#"{{"model":"m","n":{n}}}"#);
        let err = RequestPeek::from_json(body.as_bytes()).unwrap_err();
        assert!(
            matches!(err, PeekError::InvalidField { field: "n", .. }),
            "n {n}: {err:?}"
        );
    }
    assert_eq!(
        RequestPeek::from_json(br#"{"model":"m","n":129}"#),
        Err(PeekError::InvalidField {
            field: "n",
            expected: "an integer between 1 and 128"
        })
    );
    for n in [1, 2, MAX_N] {
        let body = format!(r#"{{"model":"m","n":{n}}}"#);
        assert_eq!(RequestPeek::from_json(body.as_bytes()).unwrap().n, n);
    }
}

/// `metadata` and `user` are forwarded and never counted: bounded on every endpoint that takes
/// them (OpenAI's metadata limits; 256 characters of `user`).
#[test]
fn metadata_and_user_are_bounded_where_accepted() {
    let big_meta = format!(r#"{{"k":"{}"}}"#, "v".repeat(513));
    let many = (0..17)
        .map(|i| format!(r#""k{i}":"v""#))
        .collect::<Vec<_>>()
        .join(",");
    let long_user = format!(r#""{}""#, "u".repeat(257));
    let cases = [
        (
            RequestKind::ChatCompletions,
            r#""messages":[{"role":"user","content":"hi"}]"#,
        ),
        (RequestKind::Completions, r#""prompt":"hi""#),
        (RequestKind::Embeddings, r#""input":"hi""#),
    ];
    for (kind, prompt) in cases {
        let body = |extra: &str| format!(r#"{{"model":"m",{prompt},{extra}}}"#);
        let field = |extra: &str| match RequestPeek::for_endpoint(kind, body(extra).as_bytes()) {
            Err(PeekError::InvalidField { field, .. }) => Some(field),
            _ => None,
        };
        assert_eq!(
            field(&format!(r#""user":{long_user}"#)),
            Some("user"),
            "{kind:?}"
        );
        let ok = format!(r#""user":"{}""#, "u".repeat(256));
        assert!(RequestPeek::for_endpoint(kind, body(&ok).as_bytes()).is_ok());
        if kind == RequestKind::ChatCompletions {
            for meta in [
                big_meta.clone(),
                format!("{{{many}}}"),
                r#"{"k":1}"#.to_owned(),
            ] {
                assert_eq!(
                    field(&format!(r#""metadata":{meta}"#)),
                    Some("metadata"),
                    "{meta}"
                );
            }
            let ok = r#""metadata":{"k":"v"}"#;
            assert!(RequestPeek::for_endpoint(kind, body(ok).as_bytes()).is_ok());
        }
    }
}

/// Output constraints (`response_format`, an engine's `grammar`, …) are compiled by the node
/// and never counted: each at most 128 KiB of JSON; `tools` at most OpenAI's 128. Both on chat,
/// the constraints on text completions too (where they are accepted).
#[test]
fn tools_and_output_constraints_are_bounded_where_accepted() {
    let schema = |bytes: usize| {
        let wrap =
            r#"{"type":"json_schema","json_schema":{"name":"n","schema":{"description":""}}}"#;
        let pad = "d".repeat(bytes - wrap.len());
        wrap.replace(r#""description":"""#, &format!(r#""description":"{pad}""#))
    };
    let tools = |n: usize| {
        let one = r#"{"type":"function","function":{"name":"f"}}"#;
        format!("[{}]", vec![one; n].join(","))
    };
    let max = crate::MAX_OUTPUT_CONSTRAINT_BYTES;
    for (kind, prompt) in [
        (
            RequestKind::ChatCompletions,
            r#""messages":[{"role":"user","content":"hi"}]"#,
        ),
        (RequestKind::Completions, r#""prompt":"hi""#),
    ] {
        let body = |extra: &str| format!(r#"{{"model":"m",{prompt},{extra}}}"#);
        let peek = |extra: &str| RequestPeek::for_endpoint(kind, body(extra).as_bytes());
        for member in ["grammar", "json_schema", "guided_json"] {
            let at = format!(r#""{member}":"{}""#, "g".repeat(max - 2));
            assert!(peek(&at).is_ok(), "{kind:?} {member}");
            let over = format!(r#""{member}":"{}""#, "g".repeat(max - 1));
            assert!(
                matches!(peek(&over), Err(PeekError::InvalidField { field, .. }) if field == member),
                "{kind:?} {member}"
            );
        }
        if kind == RequestKind::ChatCompletions {
            assert!(peek(&format!(r#""response_format":{}"#, schema(max))).is_ok());
            assert!(matches!(
                peek(&format!(r#""response_format":{}"#, schema(max + 1))),
                Err(PeekError::InvalidField {
                    field: "response_format",
                    ..
                })
            ));
            assert!(peek(&format!(r#""tools":{}"#, tools(128))).is_ok());
            assert!(matches!(
                peek(&format!(r#""tools":{}"#, tools(129))),
                Err(PeekError::InvalidField { field: "tools", .. })
            ));
            // each tool's schema, and `tool_choice`, as an output constraint
            let tool = |bytes: usize| {
                let wrap = r#"{"type":"function","function":{"name":"f","parameters":{"description":""}}}"#;
                let pad = "d".repeat(bytes - wrap.len());
                wrap.replace(r#""description":"""#, &format!(r#""description":"{pad}""#))
            };
            assert!(peek(&format!(r#""tools":[{},{}]"#, tool(max), tool(max))).is_ok());
            assert!(matches!(
                peek(&format!(r#""tools":[{},{}]"#, tool(100), tool(max + 1))),
                Err(PeekError::InvalidField { field: "tools", .. })
            ));
            let choice = |bytes: usize| {
                let wrap = r#"{"type":"function","function":{"name":""}}"#;
                wrap.replace(
                    r#""name":"""#,
                    &format!(r#""name":"{}""#, "n".repeat(bytes - wrap.len())),
                )
            };
            assert!(peek(&format!(r#""tool_choice":{}"#, choice(max))).is_ok());
            assert!(matches!(
                peek(&format!(r#""tool_choice":{}"#, choice(max + 1))),
                Err(PeekError::InvalidField {
                    field: "tool_choice",
                    ..
                })
            ));
        }
    }
}

/// `stop` is at most 16 sequences of at most 128 bytes each (an engine holds back text that may
/// start a stop sequence, so its length bounds a stream's pause), on chat and completions.
#[test]
fn stop_sequences_are_bounded() {
    for (kind, prompt) in [
        (
            RequestKind::ChatCompletions,
            r#""messages":[{"role":"user","content":"hi"}]"#,
        ),
        (RequestKind::Completions, r#""prompt":"hi""#),
    ] {
        let peek = |stop: &Value| {
            let body = format!(r#"{{"model":"m",{prompt},"stop":{stop}}}"#);
            RequestPeek::for_endpoint(kind, body.as_bytes())
        };
        let max = crate::MAX_STOP_BYTES;
        for ok in [
            Value::Null,
            serde_json::json!("\n\n"),
            serde_json::json!("s".repeat(max)),
            serde_json::json!(vec!["é".repeat(max / 2); crate::MAX_STOP_SEQUENCES]),
        ] {
            assert!(peek(&ok).is_ok(), "{kind:?} {ok}");
        }
        for bad in [
            serde_json::json!("s".repeat(max + 1)),
            serde_json::json!(["ok", "s".repeat(max + 1)]),
            serde_json::json!(vec!["x"; crate::MAX_STOP_SEQUENCES + 1]),
            serde_json::json!([1]),
            serde_json::json!(7),
        ] {
            assert!(
                matches!(
                    peek(&bad),
                    Err(PeekError::InvalidField { field: "stop", .. })
                ),
                "{kind:?} {bad}"
            );
        }
    }
}
