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
        let c = read_choices(&raw, TextMember::Delta).unwrap().remove(0);
        (c.rebuilt, c.raw.into_owned())
    };
    let c = read(
        r#"{"content":"Hi","annotations":[{"type":"url_citation","url_citation":{"title":"free text"}}]}"#,
    );
    assert!(c.0 && !c.1.contains("free text"), "{}", c.1);
    for kept in [
        r#"{"content":"Hi","annotations":[]}"#,
        r#"{"content":"Hi","annotations":null}"#,
    ] {
        let c = read(kept);
        assert!(!c.0 && c.1.contains("annotations"), "{}", c.1);
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
    let raw_clean = raw(clean);
    let read = read_choices(&raw_clean, TextMember::Delta).unwrap();
    assert!(!read[0].rebuilt);
    assert_eq!(format!("[{}]", read[0].raw), clean);
    // engine members at every level are dropped, the order of the rest kept
    let engine = r#"[{"index":0,"delta":{"role":"assistant","content":"Hi","function_call":{"arguments":"FREE"},"audio":{"data":"FREE"},"token_ids":[1],"tool_calls":[{"index":0,"id":"c","type":"function","function":{"name":"f","arguments":"","parsed":{}},"extra":1}]},"finish_reason":"stop","stop_reason":null,"matched_stop":2,"prompt_logprobs":null,"text":null}]"#;
    let raw_engine = raw(engine);
    let read = read_choices(&raw_engine, TextMember::Delta).unwrap();
    assert!(read[0].rebuilt);
    assert_eq!(
        read[0].raw,
        r#"{"index":0,"delta":{"role":"assistant","content":"Hi","tool_calls":[{"index":0,"id":"c","type":"function","function":{"name":"f","arguments":""}}]},"finish_reason":"stop"}"#
    );
    assert_eq!(read[0].generated.content(), "Hi");
    let raw_text = raw(
        r#"[{"index":0,"text":"Hi","finish_reason":"length","stop_reason":null,"timings":{}}]"#,
    );
    let text = read_choices(&raw_text, TextMember::Text).unwrap();
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
    let raw_ok = raw(ok);
    let read = read_choices(&raw_ok, TextMember::Delta).unwrap();
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

/// Reads `choice` both ways and checks that the plain path, when it answers, answers as the
/// general path does; returns whether it answered.
fn plain_agrees_with_general(choice: &str) -> bool {
    let Some(plain) = plain::read_plain(choice, TextMember::Delta) else {
        return false;
    };
    let raw: Box<RawValue> = serde_json::from_str(choice).unwrap();
    let general = read_choice(0, &raw, TextMember::Delta).unwrap_or_else(|e| {
        panic!("the plain path took {choice} which the general path refuses: {e}")
    });
    assert_eq!(plain.index, general.index, "{choice}");
    assert_eq!(plain.indexed, general.indexed, "{choice}");
    assert_eq!(plain.generated, general.generated, "{choice}");
    assert_eq!(plain.finish_reason, general.finish_reason, "{choice}");
    assert_eq!(plain.raw, general.raw, "{choice}");
    assert_eq!(plain.rebuilt, general.rebuilt, "{choice}");
    assert_eq!(plain.logprobs, general.logprobs, "{choice}");
    assert_eq!(plain.tool_call_heads, general.tool_call_heads, "{choice}");
    // the same choice alone in a chunk's array, read in one pass, whatever the whitespace
    for choices in [format!("[{choice}]"), format!(" [\n {choice}\t\r] ")] {
        let one = plain::read_one_plain(&choices, TextMember::Delta)
            .unwrap_or_else(|| panic!("{choices} was not read in one pass"));
        assert_eq!(one.index, plain.index, "{choices}");
        assert_eq!(one.generated, plain.generated, "{choices}");
        assert_eq!(one.finish_reason, plain.finish_reason, "{choices}");
        assert_eq!(one.raw, plain.raw, "{choices}");
        assert_eq!(one.logprobs, plain.logprobs, "{choices}");
        let raw: Box<RawValue> = serde_json::from_str(&choices).unwrap();
        assert_eq!(
            read_choices(&raw, TextMember::Delta).unwrap()[0].raw,
            general.raw
        );
    }
    true
}

#[test]
fn only_an_array_of_one_plain_choice_is_read_in_one_pass() {
    let plain = r#"{"index":0,"delta":{"content":"a"},"finish_reason":null}"#;
    assert!(plain_agrees_with_general(plain));
    for choices in [
        "[]".to_owned(),
        format!("[{plain},{plain}]"),
        format!("[{plain}, 1]"),
        format!("[[{plain}]]"),
        plain.to_owned(),
        format!("[{}]", r#"[0,{"content":"hi"}]"#),
        format!("[{}]", r#"{"index":0,"delta":{"content":"a"},"extra":1}"#),
    ] {
        assert!(
            plain::read_one_plain(&choices, TextMember::Delta).is_none(),
            "{choices}"
        );
    }
    assert!(plain::read_one_plain(&format!("[{plain}]"), TextMember::Text).is_none());
    // two choices are still read, the general way
    let two: Box<RawValue> = serde_json::from_str(&format!(
        "[{plain},{}]",
        plain.replace("\"index\":0", "\"index\":1")
    ))
    .unwrap();
    assert_eq!(read_choices(&two, TextMember::Delta).unwrap().len(), 2);
}

#[test]
fn every_streamed_choice_of_the_llama_cpp_captures_takes_the_plain_path() {
    let mut choices = 0;
    for entry in std::fs::read_dir(crate::test_support::fixtures_dir().join("llama.cpp")).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
            let Ok(chunk) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if chunk["object"] != "chat.completion.chunk" {
                continue;
            }
            for choice in chunk["choices"].as_array().unwrap() {
                let choice = choice.to_string();
                assert!(plain_agrees_with_general(&choice), "{choice}");
                choices += 1;
            }
        }
    }
    assert!(choices >= 30, "{choices} streamed choices in the captures");
}

#[test]
fn choices_off_the_plain_form_are_left_to_the_general_path() {
    for choice in [
        r#"{"index":0,"delta":{"content":"a"},"extra":1}"#,
        r#"{"index":0,"delta":{"content":"a","content":"b"}}"#,
        r#"{"index":0,"index":1,"delta":{}}"#,
        r#"{"delta":{"content":"a"}}"#,
        r#"{"index":null,"delta":{"content":"a"}}"#,
        r#"{"index":-1,"delta":{}}"#,
        r#"{"index":1.0,"delta":{}}"#,
        r#"{"index":0,"delta":{"role":"user","content":"a"}}"#,
        r#"{"index":0,"delta":{"content":"a"},"finish_reason":"done"}"#,
        r#"{"index":0,"delta":{"content":"a"},"logprobs":{"content":[],"content":[]}}"#,
        r#"{"index":0,"delta":{"reasoning_content":"a"}}"#,
        r#"{"index":0,"delta":{"tool_calls":[]}}"#,
        r#"{"index":0,"delta":null}"#,
        r#"{"index":0,"delta":{"content":1}}"#,
        r#"{"index":0,"text":"a","delta":{}}"#,
        // a derived struct reads arrays field by field: the general path refuses them
        r#"{"index":0,"delta":[null,"hi"]}"#,
        r#"{"index":0,"delta":["assistant","hi"],"finish_reason":null}"#,
        r#"{"index":0,"delta":[]}"#,
        r#"[0,{"content":"hi"}]"#,
        r#"[0,[null,"hi"],"stop",null]"#,
    ] {
        assert!(
            plain::read_plain(choice, TextMember::Delta).is_none(),
            "{choice}"
        );
        assert!(
            plain::read_one_plain(&format!("[{choice}]"), TextMember::Delta).is_none(),
            "{choice}"
        );
    }
    // escaped names and strings are the same members and text
    assert!(plain_agrees_with_general(
        r#"{"\u0069ndex":2,"delta":{"role":"assist\u0061nt","content":"a\nb\u00e9\ud83d\ude00"},"finish_reason":"st\u006fp","logprobs":null}"#
    ));
    assert!(plain::read_plain(
        r#"{"index":0,"delta":{"content":"a"}}"#,
        TextMember::Message
    )
    .is_none());
}

/// A choice's `logprobs` nest at most 8 deep (OpenAI's chat form is 6), so that what is
/// relayed stays readable by a JSON reader with a nesting limit; both paths refuse deeper,
/// up to and past serde_json's own limit (127 levels in one read, the choice's included).
#[test]
fn logprobs_nested_deeper_than_openais_are_refused_on_both_paths() {
    let openai = r#"{"content":[{"token":"a","logprob":-0.5,"bytes":[97],"top_logprobs":[{"token":"a","logprob":-0.5,"bytes":[97]}]}]}"#;
    let choice = format!(r#"{{"index":0,"delta":{{"content":"a"}},"logprobs":{openai}}}"#);
    assert!(plain_agrees_with_general(&choice));
    for depth in [1, 6, 8, 9, 100, 125, 126, 127, 128] {
        let deep = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        let choice = format!(r#"{{"index":0,"delta":{{"content":"x"}},"logprobs":{deep}}}"#);
        let raw: Box<RawValue> = serde_json::from_str(&choice).unwrap();
        let general = read_choice(0, &raw, TextMember::Delta);
        assert_eq!(general.is_ok(), depth <= 8, "depth {depth}");
        assert_eq!(
            plain_agrees_with_general(&choice),
            general.is_ok(),
            "depth {depth}"
        );
    }
}

/// Pieces the differential property builds choices from: every member the general path
/// reads, values of every type, names written with escapes, and members named twice.
fn choice_member() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let name = prop::sample::select(vec![
        "index",
        "delta",
        "finish_reason",
        "logprobs",
        "text",
        "message",
        "extra",
        r"\u0069ndex",
    ]);
    let delta_name = prop::sample::select(vec![
        "role",
        "content",
        "refusal",
        "tool_calls",
        "reasoning_content",
        "reasoning",
        "x",
        r"c\u006fntent",
    ]);
    let scalar = prop::sample::select(vec![
        "0",
        "3",
        "-1",
        "1.0",
        "1e0",
        "null",
        "true",
        r#""0""#,
        "18446744073709551615",
        "18446744073709551616",
        r#""assistant""#,
        r#""user""#,
        r#""stop""#,
        r#""length""#,
        r#""done""#,
        r#""hi""#,
        r#""a\nb\u00e9""#,
        "[]",
        "{}",
        r#"{"content":[]}"#,
    ]);
    let delta = prop::collection::vec((delta_name, scalar.clone()), 0..4).prop_map(|members| {
        let body: Vec<String> = members
            .iter()
            .map(|(k, v)| format!(r#""{k}":{v}"#))
            .collect();
        format!("{{{}}}", body.join(","))
    });
    let value = prop_oneof![scalar.prop_map(str::to_owned), delta];
    (name, value).prop_map(|(k, v)| format!(r#""{k}":{v}"#))
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4096))]
    #[test]
    fn plain_reads_as_the_general_path(
        index in proptest::sample::select(vec!["0", "1", "3", "255", "18446744073709551615"]),
        role in proptest::option::of(proptest::sample::select(vec![r#""assistant""#, "null"])),
        content in proptest::option::of(proptest::sample::select(vec![
            r#""x""#, r#""""#, "null", r#""a\nb\u00e9\ud83d\ude00""#, r#"" the""#,
        ])),
        finish in proptest::option::of(proptest::sample::select(vec![
            "null", r#""stop""#, r#""length""#, r#""tool_calls""#,
        ])),
        logprobs in proptest::option::of(proptest::sample::select(vec![
            "null",
            r#"{"content":[]}"#,
            r#"{"content":[{"token":" a","logprob":-0.5,"bytes":[32,97],"top_logprobs":[{"token":" a","logprob":-0.5}]}]}"#,
            r#"{"content":[{"token":"a","logprob":-1e-3,"logprob":0}]}"#,
            r#"{"content":null,"refusal":null}"#,
            "[]",
            "1.5",
        ])),
        extra in proptest::collection::vec(choice_member(), 0..3),
        extra_count in 0usize..4,
        as_array in proptest::sample::select(vec![None, None, None, None, None, None, Some("delta"), Some("choice")]),
    ) {
        // a plain choice (the path's own form, all of it varied), then up to two members of
        // anything: the plain path must answer as the general path or leave it alone
        let mut delta = Vec::new();
        if let Some(r) = role {
            delta.push(format!(r#""role":{r}"#));
        }
        if let Some(c) = content {
            delta.push(format!(r#""content":{c}"#));
        }
        // or the same values as an array, which serde's derived structs would read in order
        let values = |members: &[String]| {
            members.iter().map(|m| m.split_once(':').unwrap().1.to_owned()).collect::<Vec<_>>()
        };
        let delta = if as_array == Some("delta") {
            format!("[{}]", values(&delta).join(","))
        } else {
            format!("{{{}}}", delta.join(","))
        };
        let mut all = vec![format!(r#""index":{index}"#), format!(r#""delta":{delta}"#)];
        if let Some(f) = finish {
            all.push(format!(r#""finish_reason":{f}"#));
        }
        if let Some(l) = logprobs {
            all.push(format!(r#""logprobs":{l}"#));
        }
        all.extend(extra.into_iter().take(extra_count.saturating_sub(1)));
        let choice = if as_array == Some("choice") {
            format!("[{}]", values(&all).join(","))
        } else {
            format!("{{{}}}", all.join(","))
        };
        let taken = plain_agrees_with_general(&choice);
        // the plain form itself is always taken (logprobs without a member named twice)
        if as_array.is_none()
            && extra_count <= 1
            && !logprobs.is_some_and(|l| l.contains(r#""logprob":0"#))
        {
            proptest::prop_assert!(taken, "{}", choice);
        }
    }
}
