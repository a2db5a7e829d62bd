//! A metered chat completion (JSON or SSE) as a Responses API answer.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use serde_json::{json, Map, Value};
use spine_core::BoxError;

use crate::sse::SseParser;

/// What a Responses answer says about its request: its id, creation time and the request's
/// members it echoes.
#[derive(Clone, Debug)]
pub struct ResponseMeta {
    /// `resp_…`.
    pub id: String,
    /// Unix seconds.
    pub created_at: u64,
    /// The request's members echoed ([`ChatTranslation::echo`](super::ChatTranslation)).
    pub echo: Map<String, Value>,
}

impl ResponseMeta {
    /// The answer to the request `request_id` (the gateway's `x-request-id`), created now.
    pub fn new(request_id: &str, echo: Map<String, Value>) -> Self {
        Self {
            id: format!("resp_{request_id}"),
            created_at: u64::try_from(spine_core::unix_time_ms() / 1000).unwrap_or(0),
            echo,
        }
    }

    /// The id of output item `index` of kind `prefix` (`msg`, `fc`, `rs`).
    fn item_id(&self, prefix: &str, index: usize) -> String {
        let base = self.id.strip_prefix("resp_").unwrap_or(&self.id);
        format!("{prefix}_{base}_{index}")
    }

    /// The response object (`object: "response"`).
    fn object(
        &self,
        status: &str,
        output: Vec<Value>,
        usage: Value,
        error: Value,
        incomplete: Value,
    ) -> Value {
        let echoed = |key: &str, default: Value| self.echo.get(key).cloned().unwrap_or(default);
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": echoed("instructions", Value::Null),
            "max_output_tokens": echoed("max_output_tokens", Value::Null),
            "model": echoed("model", Value::Null),
            "output": output,
            "parallel_tool_calls": echoed("parallel_tool_calls", Value::Bool(true)),
            "previous_response_id": null,
            "reasoning": {"effort": null, "summary": null},
            "store": false,
            "temperature": echoed("temperature", Value::Null),
            "text": echoed("text", json!({"format": {"type": "text"}})),
            "tool_choice": echoed("tool_choice", json!("auto")),
            "tools": echoed("tools", json!([])),
            "top_p": echoed("top_p", Value::Null),
            "truncation": "disabled",
            "usage": usage,
            "user": echoed("user", Value::Null),
            "metadata": echoed("metadata", json!({})),
        })
    }
}

/// A chat `usage` (the billed counts) as a Responses `usage`.
fn usage(chat: Option<&Value>) -> Value {
    let Some(u) = chat.filter(|u| u.is_object()) else {
        return Value::Null;
    };
    let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    let (input, output) = (n("prompt_tokens"), n("completion_tokens"));
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input.saturating_add(output),
    })
}

/// `status` and `incomplete_details` for a chat `finish_reason`.
fn ending(finish_reason: Option<&str>) -> (&'static str, Value) {
    match finish_reason {
        Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some("content_filter") => ("incomplete", json!({"reason": "content_filter"})),
        _ => ("completed", Value::Null),
    }
}

fn message_item(id: &str, status: &str, parts: &[(PartKind, String)]) -> Value {
    let content: Vec<Value> = parts.iter().map(|(kind, text)| kind.part(text)).collect();
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn reasoning_item(id: &str, status: &str, text: &str) -> Value {
    json!({
        "type": "reasoning",
        "id": id,
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    })
}

fn function_call_item(id: &str, status: &str, call_id: &str, name: &str, arguments: &str) -> Value {
    json!({
        "type": "function_call",
        "id": id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PartKind {
    OutputText,
    Refusal,
}

impl PartKind {
    fn part(self, text: &str) -> Value {
        match self {
            Self::OutputText => {
                json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
            }
            Self::Refusal => json!({"type": "refusal", "refusal": text}),
        }
    }
    fn empty(self) -> Value {
        self.part("")
    }
}

/// A chat message's reasoning text (`reasoning_content`, or `reasoning` as vLLM and Ollama send).
fn reasoning_text(message: &Value) -> Option<&str> {
    message
        .get("reasoning_content")
        .and_then(Value::as_str)
        .or_else(|| message.get("reasoning").and_then(Value::as_str))
        .filter(|s| !s.is_empty())
}

/// A metered, non-streamed chat completion (its `usage` the billed counts) as a Responses
/// object: reasoning, message (`output_text`, `refusal`) and `function_call` items of choice 0;
/// `status` `incomplete` with `max_output_tokens` for a `length` finish.
///
/// # Errors
/// A message when `body` is not a chat completion with a choice 0 (the meter has already
/// checked the node's body, so this is a defect, not a node's fault).
pub fn response_from_chat(body: &[u8], meta: &ResponseMeta) -> Result<Value, String> {
    let chat: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let choice = chat
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| {
            c.iter()
                .find(|c| c.get("index").and_then(Value::as_u64).unwrap_or(0) == 0)
        })
        .ok_or("the chat completion has no choice 0")?;
    let message = choice.get("message").cloned().unwrap_or(Value::Null);
    let mut output = Vec::new();
    if let Some(text) = reasoning_text(&message) {
        output.push(reasoning_item(
            &meta.item_id("rs", output.len()),
            "completed",
            text,
        ));
    }
    let mut parts = Vec::new();
    if let Some(text) = message.get("content").and_then(Value::as_str) {
        parts.push((PartKind::OutputText, text.to_owned()));
    }
    if let Some(text) = message.get("refusal").and_then(Value::as_str) {
        parts.push((PartKind::Refusal, text.to_owned()));
    }
    let calls = message.get("tool_calls").and_then(Value::as_array);
    if !parts.is_empty() || calls.is_none_or(Vec::is_empty) {
        output.push(message_item(
            &meta.item_id("msg", output.len()),
            "completed",
            &parts,
        ));
    }
    for call in calls.into_iter().flatten() {
        let f = call.get("function");
        let s = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or_default().to_owned();
        let id = meta.item_id("fc", output.len());
        let call_id = call
            .get("id")
            .and_then(Value::as_str)
            .map_or_else(|| id.clone(), str::to_owned);
        output.push(function_call_item(
            &id,
            "completed",
            &call_id,
            &s(f.and_then(|f| f.get("name"))),
            &s(f.and_then(|f| f.get("arguments"))),
        ));
    }
    let (status, incomplete) = ending(choice.get("finish_reason").and_then(Value::as_str));
    Ok(meta.object(
        status,
        output,
        usage(chat.get("usage")),
        Value::Null,
        incomplete,
    ))
}

/// One output item of a streamed answer, as it grows.
#[derive(Debug)]
enum Item {
    Reasoning {
        text: String,
    },
    Message {
        parts: Vec<(PartKind, String)>,
    },
    FunctionCall {
        call_id: String,
        name: String,
        arguments: String,
    },
}

#[derive(Debug, Default)]
struct Converter {
    seq: u64,
    started: bool,
    items: Vec<(String, Item)>,
    reasoning: Option<usize>,
    message: Option<usize>,
    /// chat tool call index → output index
    calls: BTreeMap<u64, usize>,
    finish_reason: Option<String>,
    usage: Option<Value>,
    ended: bool,
}

/// The meter's keepalive comment ([`crate::meter::KEEPALIVE_INTERVAL`]).
const KEEPALIVE: &[u8] = b": keepalive\n\n";

/// The end of a stream that did not complete, as the `error` and `response.failed` events.
const TRUNCATED: &str = "the stream ended before the response was complete";

/// A metered chat completion stream as a Responses API event stream.
///
/// Emits `response.created` and `response.in_progress` first; then, as the chat deltas come,
/// `response.output_item.added` / `response.content_part.added` for each new item (reasoning,
/// message, function call), `response.reasoning_text.delta`, `response.output_text.delta`,
/// `response.refusal.delta` and `response.function_call_arguments.delta` carrying every
/// delivered character; at the chat stream's `[DONE]` the `…done` events of every item and
/// `response.completed` (or `response.incomplete` for a `length` finish) with the whole
/// output and the billed `usage` from the meter's usage chunk. A chat error event (or an end
/// without `[DONE]`) becomes OpenAI's `error` event followed by `response.failed`. Every event
/// is `event: <type>` plus one JSON `data` line with `type` and a `sequence_number` from 0;
/// the meter's keepalive comments pass through.
///
/// Dropping it drops the metered body (the caller left: `client_cancelled`).
#[derive(Debug)]
pub struct ResponsesSse<B> {
    inner: B,
    meta: ResponseMeta,
    parser: SseParser,
    conv: Converter,
    out: Vec<u8>,
}

impl<B> ResponsesSse<B> {
    /// Wraps `inner`, a metered chat completion stream whose request asked for usage.
    pub fn new(inner: B, meta: ResponseMeta) -> Self {
        Self {
            inner,
            meta,
            parser: SseParser::new(),
            conv: Converter::default(),
            out: Vec::new(),
        }
    }
}

impl Converter {
    fn emit(&mut self, out: &mut Vec<u8>, kind: &str, mut data: Value) {
        if let Value::Object(o) = &mut data {
            o.insert("type".into(), Value::String(kind.to_owned()));
            o.insert("sequence_number".into(), Value::from(self.seq));
        }
        self.seq += 1;
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(b"\ndata: ");
        out.extend_from_slice(data.to_string().as_bytes());
        out.extend_from_slice(b"\n\n");
    }

    fn start(&mut self, meta: &ResponseMeta, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        let response = meta.object(
            "in_progress",
            Vec::new(),
            Value::Null,
            Value::Null,
            Value::Null,
        );
        self.emit(out, "response.created", json!({"response": response}));
        let response = meta.object(
            "in_progress",
            Vec::new(),
            Value::Null,
            Value::Null,
            Value::Null,
        );
        self.emit(out, "response.in_progress", json!({"response": response}));
    }

    fn item_json(meta: &ResponseMeta, id: &str, item: &Item, status: &str) -> Value {
        let _ = meta;
        match item {
            Item::Reasoning { text } => reasoning_item(id, status, text),
            Item::Message { parts } => message_item(id, status, parts),
            Item::FunctionCall {
                call_id,
                name,
                arguments,
            } => function_call_item(id, status, call_id, name, arguments),
        }
    }

    /// Opens a new output item and returns its output index.
    fn open(&mut self, meta: &ResponseMeta, out: &mut Vec<u8>, prefix: &str, item: Item) -> usize {
        let index = self.items.len();
        let id = meta.item_id(prefix, index);
        let added = match &item {
            // added events carry the item as it starts: no text yet
            Item::Reasoning { .. } => reasoning_item(&id, "in_progress", ""),
            Item::Message { .. } => message_item(&id, "in_progress", &[]),
            Item::FunctionCall { call_id, name, .. } => {
                function_call_item(&id, "in_progress", call_id, name, "")
            }
        };
        self.emit(
            out,
            "response.output_item.added",
            json!({"output_index": index, "item": added}),
        );
        if let Item::Reasoning { .. } = item {
            self.emit(
                out,
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}),
            );
        }
        self.items.push((id, item));
        index
    }

    fn reasoning_delta(&mut self, meta: &ResponseMeta, out: &mut Vec<u8>, delta: &str) {
        let index = match self.reasoning {
            Some(i) => i,
            None => {
                let i = self.open(
                    meta,
                    out,
                    "rs",
                    Item::Reasoning {
                        text: String::new(),
                    },
                );
                self.reasoning = Some(i);
                i
            }
        };
        let id = self.items[index].0.clone();
        if let Item::Reasoning { text } = &mut self.items[index].1 {
            text.push_str(delta);
        }
        self.emit(
            out,
            "response.reasoning_text.delta",
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta}),
        );
    }

    fn message_delta(
        &mut self,
        meta: &ResponseMeta,
        out: &mut Vec<u8>,
        kind: PartKind,
        delta: &str,
    ) {
        let index = match self.message {
            Some(i) => i,
            None => {
                let i = self.open(meta, out, "msg", Item::Message { parts: Vec::new() });
                self.message = Some(i);
                i
            }
        };
        let id = self.items[index].0.clone();
        let Item::Message { parts } = &mut self.items[index].1 else {
            return;
        };
        let content_index = match parts.iter().position(|(k, _)| *k == kind) {
            Some(c) => c,
            None => {
                parts.push((kind, String::new()));
                let c = parts.len() - 1;
                self.emit(
                    out,
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index, "content_index": c, "part": kind.empty()}),
                );
                c
            }
        };
        if let Item::Message { parts } = &mut self.items[index].1 {
            parts[content_index].1.push_str(delta);
        }
        let event = match kind {
            PartKind::OutputText => "response.output_text.delta",
            PartKind::Refusal => "response.refusal.delta",
        };
        let mut data = json!({"item_id": id, "output_index": index, "content_index": content_index, "delta": delta});
        if kind == PartKind::OutputText {
            data["logprobs"] = json!([]);
        }
        self.emit(out, event, data);
    }

    fn tool_call_delta(&mut self, meta: &ResponseMeta, out: &mut Vec<u8>, call: &Value) {
        let chat_index = call.get("index").and_then(Value::as_u64).unwrap_or(0);
        let f = call.get("function");
        let name = f
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        let arguments = f
            .and_then(|f| f.get("arguments"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        let index = match self.calls.get(&chat_index) {
            Some(&i) => {
                if let Item::FunctionCall { name: n, .. } = &mut self.items[i].1 {
                    n.push_str(name);
                }
                i
            }
            None => {
                let id = meta.item_id("fc", self.items.len());
                let call_id = call
                    .get("id")
                    .and_then(Value::as_str)
                    .map_or(id, str::to_owned);
                let item = Item::FunctionCall {
                    call_id,
                    name: name.to_owned(),
                    arguments: String::new(),
                };
                let i = self.open(meta, out, "fc", item);
                self.calls.insert(chat_index, i);
                i
            }
        };
        if arguments.is_empty() {
            return;
        }
        let id = self.items[index].0.clone();
        if let Item::FunctionCall { arguments: a, .. } = &mut self.items[index].1 {
            a.push_str(arguments);
        }
        self.emit(
            out,
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": index, "delta": arguments}),
        );
    }

    /// One event of the metered chat stream.
    fn on_chat_event(&mut self, meta: &ResponseMeta, out: &mut Vec<u8>, data: &str) {
        if self.ended {
            return;
        }
        if data == "[DONE]" {
            return self.complete(meta, out);
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            return self.fail(
                meta,
                out,
                "upstream_failed",
                "the stream carried an invalid event",
            );
        };
        if let Some(error) = chunk.get("error").filter(|e| !e.is_null()) {
            let code = error
                .get("code")
                .and_then(Value::as_str)
                .unwrap_or("upstream_failed")
                .to_owned();
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or(TRUNCATED)
                .to_owned();
            return self.fail(meta, out, &code, &message);
        }
        if let Some(u) = chunk.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(u.clone());
        }
        let choices = chunk
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten();
        for choice in choices {
            if choice.get("index").and_then(Value::as_u64).unwrap_or(0) != 0 {
                continue;
            }
            if let Some(delta) = choice.get("delta") {
                if let Some(text) = reasoning_text(delta) {
                    self.reasoning_delta(meta, out, text);
                }
                if let Some(text) = delta
                    .get("content")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                {
                    self.message_delta(meta, out, PartKind::OutputText, text);
                }
                if let Some(text) = delta
                    .get("refusal")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                {
                    self.message_delta(meta, out, PartKind::Refusal, text);
                }
                for call in delta
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    self.tool_call_delta(meta, out, call);
                }
            }
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
                self.finish_reason = Some(reason.to_owned());
            }
        }
    }

    /// The `…done` events of every item, in output order; returns the finished items.
    fn close_items(&mut self, meta: &ResponseMeta, out: &mut Vec<u8>) -> Vec<Value> {
        let items = std::mem::take(&mut self.items);
        let mut done = Vec::with_capacity(items.len());
        for (index, (id, item)) in items.iter().enumerate() {
            match item {
                Item::Reasoning { text } => {
                    self.emit(out, "response.reasoning_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}));
                    self.emit(out, "response.content_part.done", json!({"item_id": id, "output_index": index, "content_index": 0, "part": {"type": "reasoning_text", "text": text}}));
                }
                Item::Message { parts } => {
                    for (c, (kind, text)) in parts.iter().enumerate() {
                        match kind {
                            PartKind::OutputText => self.emit(out, "response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": c, "text": text, "logprobs": []})),
                            PartKind::Refusal => self.emit(out, "response.refusal.done", json!({"item_id": id, "output_index": index, "content_index": c, "refusal": text})),
                        }
                        self.emit(out, "response.content_part.done", json!({"item_id": id, "output_index": index, "content_index": c, "part": kind.part(text)}));
                    }
                }
                Item::FunctionCall {
                    name, arguments, ..
                } => {
                    self.emit(out, "response.function_call_arguments.done", json!({"item_id": id, "output_index": index, "name": name, "arguments": arguments}));
                }
            }
            let item = Self::item_json(meta, id, item, "completed");
            self.emit(
                out,
                "response.output_item.done",
                json!({"output_index": index, "item": item.clone()}),
            );
            done.push(item);
        }
        done
    }

    fn complete(&mut self, meta: &ResponseMeta, out: &mut Vec<u8>) {
        self.start(meta, out);
        self.ended = true;
        let output = self.close_items(meta, out);
        let (status, incomplete) = ending(self.finish_reason.as_deref());
        let response = meta.object(
            status,
            output,
            usage(self.usage.as_ref()),
            Value::Null,
            incomplete,
        );
        let kind = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        self.emit(out, kind, json!({"response": response}));
    }

    fn fail(&mut self, meta: &ResponseMeta, out: &mut Vec<u8>, code: &str, message: &str) {
        self.start(meta, out);
        self.ended = true;
        self.emit(
            out,
            "error",
            json!({"code": code, "message": message, "param": null}),
        );
        let output: Vec<Value> = self
            .items
            .iter()
            .map(|(id, item)| Self::item_json(meta, id, item, "incomplete"))
            .collect();
        let response = meta.object(
            "failed",
            output,
            usage(self.usage.as_ref()),
            json!({"code": code, "message": message}),
            Value::Null,
        );
        self.emit(out, "response.failed", json!({"response": response}));
    }
}

impl<B> Body for ResponsesSse<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if !this.conv.started {
                this.conv.start(&this.meta, &mut this.out);
            }
            if !this.out.is_empty() {
                let bytes = Bytes::from(std::mem::take(&mut this.out));
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            if this.conv.ended {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if data.as_ref() == KEEPALIVE {
                        // the meter writes its keepalive comment as a frame of its own: pass
                        // it on, so that the caller's connection stays warm the same way
                        this.out.extend_from_slice(KEEPALIVE);
                        continue;
                    }
                    let mut events = Vec::new();
                    let res = this.parser.feed(&data, &mut events);
                    for ev in &events {
                        this.conv
                            .on_chat_event(&this.meta, &mut this.out, ev.data());
                    }
                    if res.is_err() {
                        this.conv
                            .fail(&this.meta, &mut this.out, "upstream_failed", TRUNCATED);
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    let e: BoxError = e.into();
                    tracing::debug!(error = %e, "metered stream failed");
                    this.conv
                        .fail(&this.meta, &mut this.out, "upstream_failed", TRUNCATED);
                }
                Poll::Ready(None) => {
                    let mut events = Vec::new();
                    let _ = this.parser.finish(&mut events);
                    for ev in &events {
                        this.conv
                            .on_chat_event(&this.meta, &mut this.out, ev.data());
                    }
                    if !this.conv.ended {
                        this.conv
                            .fail(&this.meta, &mut this.out, "upstream_failed", TRUNCATED);
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.conv.ended && self.out.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
