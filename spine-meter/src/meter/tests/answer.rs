//! The answer surface (issue 13): choices rebuilt from OpenAI's members, the node's faults in
//! them, `data: null`, the byte bound's `server_error` event.

use super::*;

/// Asserts that the metered answer `res` was refused as the node's fault
/// ([`MeterError::UpstreamInvalid`]) and settled `upstream_failed` with nothing debited.
pub(super) async fn assert_free_node_fault(
    h: &mut Harness,
    res: Result<http::Response<BoxBody>, BoxError>,
    what: &str,
) {
    let err = match res {
        Err(err) => err,
        Ok(resp) => panic!("{what}: answered {}", resp.status()),
    };
    assert!(
        matches!(
            err.downcast_ref::<MeterError>(),
            Some(MeterError::UpstreamInvalid(_))
        ),
        "{what}: {err}"
    );
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, r.debit_micros),
        (StreamOutcome::UpstreamFailed, 0),
        "{what}"
    );
}

#[tokio::test]
async fn a_non_streamed_answer_reaches_the_caller_with_openais_members_only() {
    let mut h = harness().await;
    let answer = json!({"id":"c1","object":"chat.completion","created":1,"model":"smollm2",
        "choices":[{"index":0,"finish_reason":"stop","stop_reason":null,"token_ids":[1,2],
            "prompt_logprobs":null,"logprobs":null,
            "message":{"role":"assistant","content":"Red","function_call":{"name":"FREE","arguments":"FREE"},
                "audio":null,"reasoning_content":null,"tool_calls":[]}}],
        "usage":{"prompt_tokens":34,"completion_tokens":2,"total_tokens":36}});
    let body = serde_json::to_vec(&answer).unwrap();
    let svc = h.service(200, "application/json", reads_of(&body, 64), End::Eof);
    let resp = svc
        .oneshot(request("clean", &chat(false, None)))
        .await
        .unwrap();
    let got: Value = serde_json::from_slice(&frames(resp.into_body()).await.concat()).unwrap();
    assert_eq!(
        got["choices"],
        json!([{"index":0,"finish_reason":"stop","logprobs":null,
            "message":{"role":"assistant","content":"Red","reasoning_content":null,"tool_calls":[]}}]),
        "{got}"
    );
    let (s, _) = h.settled().await;
    assert_eq!(s.outcome, StreamOutcome::Completed);
}

#[tokio::test]
async fn a_choice_that_is_not_openais_is_the_nodes_fault() {
    for (i, choice) in [
        json!({"index":0,"finish_reason":"abort","message":{"role":"assistant","content":"Red"}}),
        json!({"index":0,"finish_reason":"eos_token","message":{"role":"assistant","content":"Red"}}),
        json!({"index":0,"finish_reason":7,"message":{"role":"assistant","content":"Red"}}),
        json!({"index":0,"finish_reason":"stop","message":{"role":"user","content":"Red"}}),
        json!({"index":0,"finish_reason":"tool_calls","message":{"role":"assistant","content":null,
            "tool_calls":[{"id":"c","type":"custom","function":{"name":"f","arguments":"{}"}}]}}),
        json!({"index":0,"finish_reason":"tool_calls","message":{"role":"assistant","content":null,
            "tool_calls":[{"id":"x".repeat(129),"type":"function","function":{"name":"f","arguments":"{}"}}]}}),
    ]
    .into_iter()
    .enumerate()
    {
        let mut h = harness().await;
        let answer = json!({"id":"c1","object":"chat.completion","choices":[choice]});
        let body = serde_json::to_vec(&answer).unwrap();
        let svc = h.service(200, "application/json", reads_of(&body, 64), End::Eof);
        let res = svc
            .oneshot(request(&format!("bad{i}"), &chat(false, None)))
            .await;
        assert_free_node_fault(&mut h, res, &answer.to_string()).await;
    }
    // 128 bytes is still an id
    let mut h = harness().await;
    let answer = json!({"id":"c1","object":"chat.completion","choices":[{"index":0,
        "finish_reason":"tool_calls","message":{"role":"assistant","content":null,
        "tool_calls":[{"id":"x".repeat(128),"type":"function","function":{"name":"f","arguments":"{}"}}]}}]});
    let body = serde_json::to_vec(&answer).unwrap();
    let svc = h.service(200, "application/json", reads_of(&body, 64), End::Eof);
    let resp = svc
        .oneshot(request("ok", &chat(false, None)))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    drop(resp);
    assert_eq!(h.settled().await.0.outcome, StreamOutcome::Completed);
}

fn chunk(choice: Value) -> String {
    let c = json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"smollm2",
        "choices":[choice]});
    format!("data: {c}\n\n")
}

#[tokio::test]
async fn streamed_choices_are_rebuilt_and_data_null_is_skipped() {
    let mut h = harness().await;
    let stream = [
        chunk(
            json!({"index":0,"delta":{"role":"assistant","content":"Red","function_call":
            {"arguments":"FREE"},"token_ids":[5]},"finish_reason":null,"stop_reason":null}),
        ),
        "data: null\n\n".to_owned(),
        chunk(json!({"index":0,"delta":{},"finish_reason":"stop","matched_stop":2})),
        "data: [DONE]\n\n".to_owned(),
    ]
    .concat();
    let svc = h.service(
        200,
        "text/event-stream",
        reads_of(stream.as_bytes(), 7),
        End::Eof,
    );
    let resp = svc.oneshot(request("s", &chat(true, None))).await.unwrap();
    let got = String::from_utf8(frames(resp.into_body()).await.concat()).unwrap();
    for never in [
        "FREE",
        "token_ids",
        "stop_reason",
        "matched_stop",
        "function_call",
        "data: null",
    ] {
        assert!(!got.contains(never), "{never}: {got}");
    }
    let events = crate::sse::parse_all(got.as_bytes()).unwrap();
    let data: Vec<&str> = events.iter().map(|e| e.data()).collect();
    assert_eq!(data.len(), 3, "{got}");
    let first: Value = serde_json::from_str(data[0]).unwrap();
    assert_eq!(
        first["choices"],
        json!([{"index":0,"delta":{"role":"assistant","content":"Red"},"finish_reason":null}])
    );
    assert_eq!(data[2], "[DONE]");
    let (s, _) = h.settled().await;
    assert_eq!(s.outcome, StreamOutcome::Completed);
}

#[tokio::test]
async fn a_stream_past_its_byte_bound_ends_with_a_server_error_event() {
    let mut h = harness().await;
    // `data: null` is skipped but its bytes count: 2 MiB of them pass the bound of a 1-token
    // request (1 MiB + 17 × 8 KiB)
    let nulls = "data: null\n\n".repeat(2 * 1024 * 1024 / 12);
    let mut body = chunk(json!({"index":0,"delta":{"content":"Red"},"finish_reason":null}));
    body.push_str(&nulls);
    let svc = h.service(
        200,
        "text/event-stream",
        reads_of(body.as_bytes(), 64 * 1024),
        End::Eof,
    );
    let mut req = chat(true, None);
    req["max_tokens"] = json!(1);
    let resp = svc.oneshot(request("big", &req)).await.unwrap();
    let got = String::from_utf8(frames(resp.into_body()).await.concat()).unwrap();
    let events = crate::sse::parse_all(got.as_bytes()).unwrap();
    let last: Value = serde_json::from_str(events.last().unwrap().data()).unwrap();
    assert_eq!(last["error"]["type"], "server_error", "{last}");
    assert_eq!(last["error"]["code"], "upstream_failed", "{last}");
    assert!(!got.contains("[DONE]"));
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, r.debit_micros),
        (StreamOutcome::UpstreamFailed, 0)
    );
}

/// A caller asked for a stream and the node answered with one complete JSON body: the caller's
/// SDK reads the body as SSE events and finds none (the Python and Node SDKs yield nothing), so
/// the caller paid for an answer it never got. The metered answer goes out as the stream the
/// caller asked for: its text in `delta`s, the billed usage when asked, `[DONE]`.
#[tokio::test]
async fn one_json_body_answering_a_stream_request_reaches_the_caller_as_a_stream() {
    let mut h = harness().await;
    let body = capture_body("a_chat_nonstream.txt");
    let answer: Value = serde_json::from_slice(&body).unwrap();
    let content = answer["choices"][0]["message"]["content"].as_str().unwrap();
    for (i, usage) in [None, Some(true)].into_iter().enumerate() {
        let svc = h.service(200, "application/json", reads_of(&body, 100), End::Eof);
        let resp = svc
            .oneshot(request(&format!("json{i}"), &chat(true, usage)))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.headers()[http::header::CONTENT_TYPE],
            "text/event-stream"
        );
        let got = frames(resp.into_body()).await.concat();
        let events = crate::sse::parse_all(&got).unwrap();
        let data: Vec<&str> = events.iter().map(|e| e.data()).collect();
        assert_eq!(data.last(), Some(&"[DONE]"), "{data:?}");
        let chunks: Vec<Value> = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let text: String = chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().unwrap().clone())
            .filter_map(|c| c["delta"]["content"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(text, content);
        assert!(chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk" && c["choices"].is_array()));
        let (s, _) = h.settled().await;
        assert_eq!(s.outcome, StreamOutcome::Completed);
        let usage_chunks: Vec<&Value> = chunks.iter().filter(|c| c["usage"].is_object()).collect();
        if usage.is_some() {
            assert_eq!(usage_chunks.len(), 1);
            assert_eq!(
                usage_chunks[0]["usage"]["completion_tokens"],
                s.billed.completion_tokens
            );
        } else {
            assert!(usage_chunks.is_empty());
        }
    }
}

/// The node's `[DONE]` in another spelling (after two spaces, on a second data line): the
/// gateway read it as the end, but forwarded as it came an SDK that ends on data starting with
/// `[DONE]` parses ` [DONE]` or `\n[DONE]` as JSON and raises after the caller paid. The caller
/// gets the gateway's own `data: [DONE]`.
#[tokio::test]
async fn the_nodes_done_reaches_the_caller_in_the_gateways_spelling() {
    let mut h = harness().await;
    for (i, done) in [
        "data:  [DONE]\n\n",
        "data:\ndata: [DONE]\n\n",
        "data: [DONE] \r\n\r\n",
    ]
    .into_iter()
    .enumerate()
    {
        let stream = [
            chunk(json!({"index":0,"delta":{"content":"Red"},"finish_reason":null})),
            chunk(json!({"index":0,"delta":{},"finish_reason":"stop"})),
            done.to_owned(),
        ]
        .concat();
        let svc = h.service(
            200,
            "text/event-stream",
            reads_of(stream.as_bytes(), 64),
            End::Eof,
        );
        let resp = svc
            .oneshot(request(&format!("done{i}"), &chat(true, None)))
            .await
            .unwrap();
        let frames = frames(resp.into_body()).await;
        assert_eq!(
            frames.last().map(|f| f.as_ref()),
            Some(&b"data: [DONE]\n\n"[..]),
            "{done:?}"
        );
        assert_eq!(h.settled().await.0.outcome, StreamOutcome::Completed);
    }
}

/// A choice that names a member twice (`message.content` twice): the meter counted the last one,
/// the choice went to the caller as it came, and SDKs disagree on which duplicate wins (serde's
/// derived structs refuse the answer). The node's fault, as a duplicate at the top level is.
#[tokio::test]
async fn a_choice_naming_a_member_twice_is_the_nodes_fault() {
    let mut h = harness().await;
    let body = r#"{"id":"c1","object":"chat.completion","choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"Red","content":"Red, green and blue, and a long padding text"}}]}"#;
    let svc = h.service(
        200,
        "application/json",
        reads_of(body.as_bytes(), 64),
        End::Eof,
    );
    let res = svc.oneshot(request("dup", &chat(false, None))).await;
    assert_free_node_fault(&mut h, res, body).await;
}
