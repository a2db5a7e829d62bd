//! The node's JSON, read and rebuilt: unit tests.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use super::*;

#[test]
fn members_read_one_object_and_refuse_everything_else() {
    let m = Members::parse(r#"{"id":"c","choices":[],"x\u0041":1}"#).unwrap();
    assert_eq!(m.get("id").unwrap().get(), "\"c\"");
    assert_eq!(m.get("xA").unwrap().get(), "1");
    assert!(m.has_engine_fields());
    for bad in [
        r#"{"a":1}{"b":2}"#,
        r#"{"a":1} {"b":2}"#,
        "{\"a\":1}\n{\"b\":2}",
        r#"{"choices":[1],"choices":[2]}"#,
        r#"{"usage":null,"us\u0061ge":{}}"#,
        r#"[{"choices":[]}]"#,
        r#""a string""#,
        r#"{"choices":[{"delta":{"content":"hal"#,
        "",
    ] {
        assert!(Members::parse(bad).is_none(), "{bad}");
    }
}

#[test]
fn encode_keeps_order_replaces_and_strips() {
    let m = Members::parse(
        r#"{"id":"c","timings":{"cache_n":5},"choices":[1,2],"usage":{"a":1},"model":"m"}"#,
    )
    .unwrap();
    let out = m.encode(true, |name| match name {
        "usage" => Some(None),
        "choices" => Some(Some("[1]".to_owned())),
        _ => None,
    });
    assert_eq!(out, r#"{"id":"c","choices":[1],"model":"m"}"#);
    let kept = m.encode(false, |_| None);
    assert_eq!(
        kept,
        r#"{"id":"c","timings":{"cache_n":5},"choices":[1,2],"usage":{"a":1},"model":"m"}"#
    );
}

/// Annotations are OpenAI's web-search citations: text in them would reach the caller
/// uncounted (an attacker's node put 80 tokens in a title, billed 0), so only an empty
/// list (or null) is kept.
#[test]
fn annotations_with_content_are_dropped() {
    let read = |delta: &str| {
        let raw = format!(r#"[{{"index":0,"delta":{delta}}}]"#);
        let raw: Box<RawValue> = serde_json::from_str(&raw).unwrap();
        read_choices(&raw, TextMember::Delta).unwrap().remove(0)
    };
    let c = read(
        r#"{"content":"Hi","annotations":[{"type":"url_citation","url_citation":{"title":"free text"}}]}"#,
    );
    assert!(c.rebuilt && !c.raw.contains("free text"), "{}", c.raw);
    for kept in [
        r#"{"content":"Hi","annotations":[]}"#,
        r#"{"content":"Hi","annotations":null}"#,
    ] {
        let c = read(kept);
        assert!(!c.rebuilt && c.raw.contains("annotations"), "{}", c.raw);
    }
}

#[test]
fn engine_errors_of_every_engine_are_recognised() {
    for (data, message) in [
        (
            r#"{"error":{"code":500,"message":"boom","type":"server_error"}}"#,
            "boom",
        ),
        (
            r#"{"object":"error","message":"vllm says no","type":"BadRequestError","param":null,"code":400}"#,
            "vllm says no",
        ),
        (r#"{"error":"ollama says no"}"#, "ollama says no"),
        (r#"{"error":{"code":1}}"#, "no message"),
    ] {
        let m = Members::parse(data).unwrap();
        assert!(is_engine_error(&m), "{data}");
        assert!(engine_error_message(&m).ends_with(message), "{data}");
    }
    let ok = Members::parse(r#"{"error":null,"object":"chat.completion.chunk"}"#).unwrap();
    assert!(!is_engine_error(&ok));
}

#[test]
fn choices_are_rebuilt_from_openais_members_and_checked() {
    let raw = |s: &str| serde_json::value::RawValue::from_string(s.to_owned()).unwrap();
    // an OpenAI choice is passed on byte for byte
    let clean = r#"[{"index":0,"delta":{"role":"assistant","content":"Hi","tool_calls":[{"index":0,"id":"c","type":"function","function":{"name":"f","arguments":""}}]},"logprobs":null,"finish_reason":null}]"#;
    let read = read_choices(&raw(clean), TextMember::Delta).unwrap();
    assert!(!read[0].rebuilt);
    assert_eq!(format!("[{}]", read[0].raw), clean);
    // engine members at every level are dropped, the order of the rest kept
    let engine = r#"[{"index":0,"delta":{"role":"assistant","content":"Hi","function_call":{"arguments":"FREE"},"audio":{"data":"FREE"},"token_ids":[1],"tool_calls":[{"index":0,"id":"c","type":"function","function":{"name":"f","arguments":"","parsed":{}},"extra":1}]},"finish_reason":"stop","stop_reason":null,"matched_stop":2,"prompt_logprobs":null,"text":null}]"#;
    let read = read_choices(&raw(engine), TextMember::Delta).unwrap();
    assert!(read[0].rebuilt);
    assert_eq!(
        read[0].raw,
        r#"{"index":0,"delta":{"role":"assistant","content":"Hi","tool_calls":[{"index":0,"id":"c","type":"function","function":{"name":"f","arguments":""}}]},"finish_reason":"stop"}"#
    );
    assert_eq!(read[0].generated.content(), "Hi");
    let text = read_choices(
        &raw(
            r#"[{"index":0,"text":"Hi","finish_reason":"length","stop_reason":null,"timings":{}}]"#,
        ),
        TextMember::Text,
    )
    .unwrap();
    assert_eq!(
        text[0].raw,
        r#"{"index":0,"text":"Hi","finish_reason":"length"}"#
    );
    // what the caller's SDK reads as an enumeration, or an unbounded id: the node's fault
    for bad in [
        r#"[{"index":0,"delta":{},"finish_reason":"abort"}]"#,
        r#"[{"index":0,"delta":{},"finish_reason":"eos"}]"#,
        r#"[{"index":0,"delta":{},"finish_reason":1}]"#,
        r#"[{"index":0,"delta":{"role":"system","content":"x"}}]"#,
        r#"[{"index":0,"delta":{"role":"tool"}}]"#,
        r#"[{"index":0,"delta":{"tool_calls":[{"index":0,"type":"custom"}]}}]"#,
        r#"[{"index":0,"delta":{"tool_calls":[{"index":0,"id":5}]}}]"#,
        r#"[{"index":0,"delta":{"tool_calls":["x"]}}]"#,
        r#"[{"index":0,"delta":{"tool_calls":[{"index":0,"function":"f"}]}}]"#,
    ] {
        assert!(read_choices(&raw(bad), TextMember::Delta).is_err(), "{bad}");
    }
    let long = format!(
        r#"[{{"index":0,"delta":{{"tool_calls":[{{"index":0,"id":"{}"}}]}}}}]"#,
        "x".repeat(MAX_TOOL_CALL_ID_BYTES + 1)
    );
    assert!(read_choices(&raw(&long), TextMember::Delta).is_err());
    for reason in FINISH_REASONS {
        let ok = format!(r#"[{{"index":0,"delta":{{}},"finish_reason":"{reason}"}}]"#);
        assert!(
            read_choices(&raw(&ok), TextMember::Delta).is_ok(),
            "{reason}"
        );
    }
}

#[test]
fn a_member_named_twice_at_any_depth_is_refused() {
    let raw = |s: &str| serde_json::value::RawValue::from_string(s.to_owned()).unwrap();
    for bad in [
        r#"[{"index":0,"delta":{"content":"Hi","content":"pad pad pad"}}]"#,
        r#"[{"index":0,"delta":{"content":"Hi","cont\u0065nt":"pad"}}]"#,
        r#"[{"index":0,"index":1,"delta":{"content":"Hi"}}]"#,
        r#"[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"{}","arguments":"{\"a\":1}"}}]}}]"#,
        r#"[{"index":0,"delta":{"content":"Hi"},"logprobs":{"content":[{"token":"a","token":"b"}]}}]"#,
    ] {
        assert_eq!(
            read_choices(&raw(bad), TextMember::Delta).err(),
            Some("a choice names a member twice"),
            "{bad}"
        );
    }
    // one name in two objects is no duplicate
    let ok = r#"[{"index":0,"delta":{"content":"Hi","tool_calls":[{"index":0,"function":{"name":"f"}},{"index":1,"function":{"name":"g"}}]}}]"#;
    let read = read_choices(&raw(ok), TextMember::Delta).unwrap();
    assert_eq!(read[0].raw, &ok[1..ok.len() - 1]);
    assert!(!read[0].rebuilt);
}

#[test]
fn a_choice_of_the_other_endpoints_shape_is_refused() {
    let raw = |s: &str| serde_json::value::RawValue::from_string(s.to_owned()).unwrap();
    // a completion's visible text is `text`: a message beside it is text the SDK never shows
    let padded = raw(
        r#"[{"index":0,"text":"Paris.","message":{"content":"pad pad pad"},"finish_reason":"stop"}]"#,
    );
    assert!(read_choices(&padded, TextMember::Text).is_err());
    assert!(read_choices(&padded, TextMember::Delta).is_err());
    let message_only = raw(r#"[{"index":0,"message":{"content":"pad"},"finish_reason":"stop"}]"#);
    assert!(read_choices(&message_only, TextMember::Text).is_err());
    let text_only = raw(r#"[{"index":0,"text":"Paris.","finish_reason":"stop"}]"#);
    assert!(read_choices(&text_only, TextMember::Delta).is_err());
    // each endpoint's own shape is read, reasoning in either member counted once
    let text = read_choices(&text_only, TextMember::Text).unwrap();
    assert_eq!(text[0].generated.content(), "Paris.");
    let two = raw(
        r#"[{"index":0,"delta":{"content":"Hi","reasoning":"think","reasoning_content":"other"}}]"#,
    );
    assert!(read_choices(&two, TextMember::Delta).is_err());
    // generated text in a type the SDK shows but the count does not read
    for bad in [
        r#"[{"index":0,"delta":{"content":[{"type":"text","text":"free"}]}}]"#,
        r#"[{"index":0,"delta":{"reasoning":{"text":"free"}}}]"#,
        r#"[{"index":0,"delta":"free"}]"#,
        r#"[{"index":0,"delta":{"tool_calls":{"0":{}}}}]"#,
    ] {
        assert!(read_choices(&raw(bad), TextMember::Delta).is_err(), "{bad}");
    }
    assert!(read_choices(&raw(r#"[{"index":0,"text":["free"]}]"#), TextMember::Text).is_err());
    // a member set to null is absent
    let null_text = raw(r#"[{"index":0,"text":null,"delta":{"content":"Hi"}}]"#);
    assert!(read_choices(&null_text, TextMember::Delta).is_ok());
    let chat = raw(
        r#"[{"index":0,"delta":{"content":"Hi","reasoning":"think","reasoning_content":"think"}}]"#,
    );
    let chat = read_choices(&chat, TextMember::Delta).unwrap();
    assert_eq!(chat[0].generated.content(), "Hi");
    assert_eq!(chat[0].generated.reasoning(), "think");
}

#[test]
fn only_the_member_the_callers_sdk_reads_is_counted() {
    let raw = |s: &str| serde_json::value::RawValue::from_string(s.to_owned()).unwrap();
    // a complete chat answer is read from `message`, a chunk from `delta`; the other one
    // set beside it is text the caller's SDK never shows (a padded bill)
    let both = raw(
        r#"[{"index":0,"delta":{"content":"pad pad pad"},"message":{"content":"Paris."},"finish_reason":"stop"}]"#,
    );
    assert!(read_choices(&both, TextMember::Message).is_err());
    assert!(read_choices(&both, TextMember::Delta).is_err());
    assert!(read_choices(
        &raw(r#"[{"index":0,"delta":{"content":"pad"},"finish_reason":"stop"}]"#),
        TextMember::Message
    )
    .is_err());
    assert!(read_choices(
        &raw(r#"[{"index":0,"message":{"content":"pad"}}]"#),
        TextMember::Delta
    )
    .is_err());
    // `delta: null` beside the message the SDK reads: the message is counted
    let message = raw(
        r#"[{"index":0,"delta":null,"message":{"content":"Paris is the capital."},"finish_reason":"stop"}]"#,
    );
    let read = read_choices(&message, TextMember::Message).unwrap();
    assert_eq!(read[0].generated.content(), "Paris is the capital.");
    // a completion's `text` beside null chat members: the text is counted
    let text = raw(r#"[{"index":0,"text":"Paris.","delta":null,"message":null}]"#);
    let read = read_choices(&text, TextMember::Text).unwrap();
    assert_eq!(read[0].generated.content(), "Paris.");
    assert_eq!(
        TextMember::of(RequestKind::Completions, true),
        TextMember::Text
    );
    assert_eq!(
        TextMember::of(RequestKind::ChatCompletions, true),
        TextMember::Delta
    );
    assert_eq!(
        TextMember::of(RequestKind::ChatCompletions, false),
        TextMember::Message
    );
}
