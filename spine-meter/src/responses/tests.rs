#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use http_body_util::BodyExt;
use serde_json::{json, Value};
use spine_test_support::ScriptedBody;

use super::*;

fn chat_of(req: Value) -> Value {
    let t = chat_request(req.to_string().as_bytes()).unwrap();
    serde_json::from_slice(&t.chat_body).unwrap()
}

fn refused(req: Value) -> ResponsesError {
    chat_request(req.to_string().as_bytes()).unwrap_err()
}

#[test]
fn a_string_input_with_instructions_is_a_system_and_a_user_message() {
    let chat = chat_of(json!({
        "model": "smollm2", "instructions": "Be brief.", "input": "Hi",
        "max_output_tokens": 16, "temperature": 0, "stream": true, "store": false,
        "metadata": {"k": "v"},
    }));
    assert_eq!(
        chat,
        json!({
            "model": "smollm2",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 16, "temperature": 0, "stream": true,
            "stream_options": {"include_usage": true},
        })
    );
}

#[test]
fn input_items_become_chat_turns() {
    let chat = chat_of(json!({
        "model": "m",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": true}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
    }));
    assert_eq!(
        chat["messages"],
        json!([
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": [{"type": "text", "text": "It is sunny."}]},
            {"role": "user", "content": "And tomorrow?"},
        ])
    );
    assert_eq!(
        chat["tools"],
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}, "strict": true}}])
    );
    assert_eq!(
        chat["tool_choice"],
        json!({"type": "function", "function": {"name": "get_weather"}})
    );
    assert_eq!(
        chat["response_format"],
        json!({"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}})
    );
    assert!(chat.get("stream").is_none());
}

#[test]
fn an_input_ending_with_the_assistant_is_a_refused_prefill() {
    let user = json!({"role": "user", "content": "Hi"});
    for last in [
        json!({"role": "assistant", "content": "Hello, "}),
        json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]}),
        json!({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}),
    ] {
        let e = refused(json!({"model": "m", "input": [user.clone(), last.clone()]}));
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some("input"), "invalid_request"),
            "{last}"
        );
    }
    // a dropped reasoning item after the assistant's turn does not hide it
    let e = refused(json!({"model": "m", "input": [user.clone(),
        {"role": "assistant", "content": "x"}, {"type": "reasoning", "id": "rs", "summary": []}]}));
    assert_eq!(e.param.as_deref(), Some("input"));
    chat_of(json!({"model": "m", "input": [user]}));
}

#[test]
fn what_is_not_served_is_refused_naming_the_member() {
    let base = || json!({"model": "m", "input": "hi"});
    let with = |k: &str, v: Value| {
        let mut r = base();
        r[k] = v;
        r
    };
    let cases = [
        (
            with("previous_response_id", json!("resp_1")),
            "previous_response_id",
            "unsupported_parameter",
        ),
        (
            with("conversation", json!("c")),
            "conversation",
            "unsupported_parameter",
        ),
        (
            with("n_predict", json!(300)),
            "n_predict",
            "unsupported_parameter",
        ),
        (
            with("max_output_tokens", json!(0)),
            "max_output_tokens",
            "invalid_request",
        ),
        (
            with("max_output_tokens", json!("9")),
            "max_output_tokens",
            "invalid_request",
        ),
        (
            with("background", json!(true)),
            "background",
            "unsupported_parameter",
        ),
        (
            with("include", json!(["reasoning.encrypted_content"])),
            "include",
            "unsupported_parameter",
        ),
        (
            with("reasoning", json!({"effort": "high"})),
            "reasoning",
            "unsupported_parameter",
        ),
        (
            with("tools", json!([{"type": "web_search"}])),
            "tools[0].type",
            "unsupported_parameter",
        ),
        (
            with("tools", json!([{"type": "function"}])),
            "tools[0].name",
            "invalid_request",
        ),
        (
            with(
                "input",
                json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
            ),
            "input[0].content[0].type",
            "unsupported_parameter",
        ),
        (
            with("input", json!([{"type": "web_search_call", "id": "x"}])),
            "input[0].type",
            "unsupported_parameter",
        ),
        (
            with("input", json!([{"role": "tool", "content": "x"}])),
            "input[0].role",
            "invalid_request",
        ),
        (with("input", json!([])), "input", "invalid_request"),
        (with("input", json!(7)), "input", "invalid_request"),
        (with("model", json!(null)), "model", "invalid_request"),
        (
            with("text", json!({"format": {"type": "json_schema"}})),
            "text.format.schema",
            "invalid_request",
        ),
    ];
    for (req, param, code) in cases {
        let e = refused(req.clone());
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some(param), code),
            "{req}: {e}"
        );
    }
    assert!(chat_request(b"[1]").is_err());
    assert!(chat_request(b"{").is_err());
    // defaults that ask for nothing are accepted
    let mut ok = base();
    ok["background"] = json!(false);
    ok["truncation"] = json!("disabled");
    ok["include"] = json!([]);
    ok["reasoning"] = json!({"summary": null});
    chat_request(ok.to_string().as_bytes()).unwrap();
}

fn meta() -> ResponseMeta {
    let mut echo = serde_json::Map::new();
    echo.insert("model".into(), json!("smollm2"));
    ResponseMeta {
        id: "resp_r1".into(),
        created_at: 1,
        echo,
    }
}

#[test]
fn a_chat_completion_becomes_a_response_object() {
    let chat = json!({
        "id": "x", "object": "chat.completion", "model": "alias",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!", "reasoning_content": "think"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
    });
    let r = response_from_chat(chat.to_string().as_bytes(), &meta()).unwrap();
    assert_eq!(r["object"], "response");
    assert_eq!(r["model"], "smollm2");
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(r["output"][0]["type"], "reasoning");
    assert_eq!(r["output"][1]["content"][0]["text"], "Hello!");
    assert_eq!(
        (
            r["usage"]["input_tokens"].as_u64(),
            r["usage"]["output_tokens"].as_u64(),
            r["usage"]["total_tokens"].as_u64()
        ),
        (Some(10), Some(3), Some(13))
    );
    let calls = json!({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2},
    });
    let r = response_from_chat(calls.to_string().as_bytes(), &meta()).unwrap();
    assert_eq!(r["status"], "completed");
    assert_eq!(r["output"].as_array().unwrap().len(), 1);
    assert_eq!(r["output"][0]["type"], "function_call");
    // the gateway's own call id, unique whatever the node sent
    assert_eq!(r["output"][0]["call_id"], "call_r1_0");
    assert!(response_from_chat(b"{}", &meta()).is_err());
}

/// Runs `chat` (the metered chat stream's frames) through [`ResponsesSse`]; the events' data.
async fn convert(frames: &[&str]) -> (Vec<Value>, String) {
    let body = ScriptedBody::data(frames.iter().map(|f| f.to_string()));
    let out = ResponsesSse::new(body, meta())
        .collect()
        .await
        .unwrap()
        .to_bytes();
    let text = String::from_utf8(out.to_vec()).unwrap();
    let mut events = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.is_empty()) {
        if block.starts_with(':') {
            continue;
        }
        let mut lines = block.lines();
        let kind = lines.next().unwrap().strip_prefix("event: ").unwrap();
        let data: Value =
            serde_json::from_str(lines.next().unwrap().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(data["type"], kind);
        assert_eq!(data["sequence_number"].as_u64(), Some(events.len() as u64));
        events.push(data);
    }
    (events, text)
}

fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

#[tokio::test]
async fn a_chat_stream_becomes_responses_events_with_the_billed_usage() {
    let (events, text) = convert(&[
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
        ": keepalive\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"},\"finish_reason\":null}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":null}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3,\"total_tokens\":10}}\n\n",
        "data: [DONE]\n\n",
    ])
    .await;
    assert!(text.contains("\n\n: keepalive\n\n"), "{text}");
    assert_eq!(
        types(&events),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, "Hello");
    let done = events.last().unwrap();
    assert_eq!(done["response"]["output"][0]["content"][0]["text"], "Hello");
    assert_eq!(done["response"]["usage"]["input_tokens"], 7);
    assert_eq!(done["response"]["usage"]["output_tokens"], 3);
    assert_eq!(done["response"]["id"], events[0]["response"]["id"]);
}

#[tokio::test]
async fn tool_calls_and_reasoning_stream_as_their_own_items() {
    let (events, _) = convert(&[
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"reasoning_content\":\"hmm\"},\"finish_reason\":null}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_9\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\"\"}}]},\"finish_reason\":null}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\":1}\"}}]},\"finish_reason\":null}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
        "data: [DONE]\n\n",
    ])
    .await;
    let done = &events.last().unwrap()["response"];
    assert_eq!(done["status"], "completed");
    assert_eq!(done["output"][0]["type"], "reasoning");
    assert_eq!(done["output"][0]["content"][0]["text"], "hmm");
    assert_eq!(done["output"][1]["type"], "function_call");
    assert_eq!(done["output"][1]["call_id"], "call_r1_1");
    assert_eq!(done["output"][1]["arguments"], "{\"a\":1}");
    assert!(types(&events).contains(&"response.function_call_arguments.done"));
}

#[tokio::test]
async fn a_chat_error_event_or_a_cut_stream_fails_the_response() {
    let (events, _) = convert(&[
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n",
        "data: {\"error\":{\"message\":\"the node failed\",\"type\":\"upstream_error\",\"param\":null,\"code\":\"upstream_failed\"}}\n\n",
    ])
    .await;
    let t = types(&events);
    assert_eq!(&t[t.len() - 2..], ["error", "response.failed"]);
    assert_eq!(events[t.len() - 2]["code"], "upstream_failed");
    assert_eq!(events[t.len() - 2]["message"], "the node failed");
    let failed = &events.last().unwrap()["response"];
    assert_eq!(failed["status"], "failed");
    assert_eq!(failed["error"]["code"], "upstream_failed");
    assert_eq!(failed["output"][0]["content"][0]["text"], "Hi");

    let (events, _) = convert(&["data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n"]).await;
    assert_eq!(events.last().unwrap()["type"], "response.failed");
    let (events, _) = convert(&[]).await;
    assert_eq!(
        types(&events),
        [
            "response.created",
            "response.in_progress",
            "error",
            "response.failed"
        ]
    );
}

#[tokio::test]
async fn the_converter_reads_what_the_meter_reads() {
    // members the meter forwards unread (a number out of f64's range, a lone surrogate) do
    // not stop the text; a padded [DONE] still completes; calls stay apart and get distinct
    // call ids whatever ids the node gave them (a streamed call without `index` is the node's
    // fault: `meter::tests`)
    let (events, _) = convert(&[
        "data: {\"id\":\"\\ud800\",\"created\":1e400,\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"same\",\"type\":\"function\",\"function\":{\"name\":\"a\",\"arguments\":\"{}\"}},{\"index\":1,\"id\":\"same\",\"type\":\"function\",\"function\":{\"name\":\"b\",\"arguments\":\"{}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n",
        "data:  [DONE] \n\n",
    ])
    .await;
    let done = &events.last().unwrap()["response"];
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    assert_eq!(done["output"][0]["content"][0]["text"], "Hi");
    assert_eq!(done["output"][1]["name"], "a");
    assert_eq!(done["output"][2]["name"], "b");
    assert_ne!(done["output"][1]["call_id"], done["output"][2]["call_id"]);
    // a chunk whose text is in `message` is a node fault the meter never lets through (the
    // streaming SDK reads `delta`); read as the meter reads a chunk, it shows no text
    let (events, _) = convert(&[
        "data: {\"choices\":[{\"index\":0,\"message\":{\"content\":\"From message\"},\"finish_reason\":\"stop\"}]}\n\n",
        "data: [DONE]\n\n",
    ])
    .await;
    assert!(!events.is_empty());
    assert!(
        events
            .iter()
            .all(|e| !e.to_string().contains("From message")),
        "{events:?}"
    );
}

#[tokio::test]
async fn a_whole_body_answer_to_a_streamed_request_becomes_the_stream() {
    let chat = json!({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
    });
    let stream = chat_json_as_stream(chat.to_string().as_bytes());
    let text = String::from_utf8(stream.to_vec()).unwrap();
    let frames: Vec<&str> = vec![text.as_str()];
    let (events, _) = convert(&frames).await;
    let done = &events.last().unwrap()["response"];
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    assert_eq!(done["output"][0]["content"][0]["text"], "Hello!");
    assert_eq!(done["usage"]["output_tokens"], 3);
}

#[test]
fn a_member_given_twice_is_refused_as_on_chat() {
    for body in [
        r#"{"model":"m","input":"hi","max_output_tokens":5,"max_output_tokens":500}"#,
        r#"{"model":"m","input":"hi","max_output_tokens":5,"max_output_token\u0073":500}"#,
    ] {
        let e = chat_request(body.as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_output_tokens"), "{body}");
        assert_eq!(e.code, "invalid_request");
    }
    // nested objects are the translation's own business (rebuilt, never forwarded as sent)
    assert!(chat_request(br#"{"model":"m","input":"hi","metadata":{"a":"1"}}"#).is_ok());
}

/// `text` (its format's schema) is echoed three times in a stream and never counted: at most
/// 128 KiB of JSON, as an output constraint on chat; `tools` at most OpenAI's 128.
#[test]
fn text_format_and_tools_are_bounded() {
    let text = |pad: usize| json!({"format": {"type": "json_schema", "name": "n", "schema": {"description": "d".repeat(pad)}}});
    let fixed = text(0).to_string().len();
    let max = spine_core::MAX_OUTPUT_CONSTRAINT_BYTES;
    let tools = |n: usize| json!(vec![json!({"type": "function", "name": "f"}); n]);
    for (member, value, ok) in [
        ("text", text(max - fixed), true),
        ("text", text(max - fixed + 1), false),
        ("tools", tools(128), true),
        ("tools", tools(129), false),
        (
            "tools",
            json!([{"type": "function", "name": "f", "parameters": {"description": "d".repeat(max)}}]),
            false,
        ),
        (
            "tool_choice",
            json!({"type": "function", "name": "n".repeat(max)}),
            false,
        ),
        ("tool_choice", json!("auto"), true),
    ] {
        let body = json!({"model": "m", "input": "hi", member: value});
        let got = chat_request(body.to_string().as_bytes());
        if ok {
            assert!(got.is_ok(), "{member}");
        } else {
            let e = got.unwrap_err();
            assert_eq!(e.param.as_deref(), Some(member));
            assert_eq!(e.code, "invalid_request");
        }
    }
}

/// `metadata` and `user` are echoed (three times in a stream) and never counted: OpenAI's
/// metadata limits and 256 characters of `user`, as on chat.
#[test]
fn metadata_and_user_are_bounded() {
    let pairs = |n: usize| -> Value {
        Value::Object((0..n).map(|i| (format!("k{i}"), json!("v"))).collect())
    };
    for (member, value) in [
        ("metadata", pairs(17)),
        ("metadata", json!({"k".repeat(65): "v"})),
        ("metadata", json!({"k": "v".repeat(513)})),
        ("metadata", json!({"k": 1})),
        ("metadata", json!("k")),
        ("user", json!("u".repeat(257))),
        ("user", json!(7)),
    ] {
        let body = json!({"model": "m", "input": "hi", member: value});
        let e = chat_request(body.to_string().as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(member), "{body}");
        assert_eq!(e.code, "invalid_request");
    }
    for (member, value) in [
        ("metadata", pairs(16)),
        ("metadata", json!({"k".repeat(64): "v".repeat(512)})),
        ("user", json!("u".repeat(256))),
    ] {
        let body = json!({"model": "m", "input": "hi", member: value});
        assert!(
            chat_request(body.to_string().as_bytes()).is_ok(),
            "{member}"
        );
    }
}
