//! A metered chat completion (JSON or SSE) as a Responses API answer.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use serde_json::{json, Map, Value};
use spine_core::BoxError;

use crate::meter::node_json::{read_choices, ChoiceRead, Members, TextMember};
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

fn message_item(id: &str, status: &str, text: Option<&str>) -> Value {
    let content: Vec<Value> = text.map(output_text).into_iter().collect();
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
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

/// Choice 0 of a chat chunk or completion, read exactly as the meter reads it for the bill
/// ([`read_choices`]: `delta` or `message`, refusal as content, the longer reasoning member,
/// a tool call's place when it has no `index`): what is shown is what is counted. `None` when
/// there is no such choice (the meter lets no other chat object through).
fn choice_zero<'a>(members: &Members<'a>, member: TextMember) -> Option<ChoiceRead<'a>> {
    let raw = members.get("choices")?;
    let choices = read_choices(raw, member).ok()?;
    choices.into_iter().find(|c| c.index == 0)
}

/// A metered, non-streamed chat completion (its `usage` the billed counts) as a Responses
/// object: reasoning, message (`output_text`) and `function_call` items of choice 0, read as
/// the meter read them; `status` `incomplete` with `max_output_tokens` for a `length` finish.
/// A function call's `call_id` is the gateway's own (`call_<response>_<n>`, unique), not the
/// node's.
///
/// # Errors
/// A message when `body` is not a chat completion with a choice 0 (the meter has already
/// checked the node's body, so this is a defect, not a node's fault).
pub fn response_from_chat(body: &[u8], meta: &ResponseMeta) -> Result<Value, String> {
    let text = std::str::from_utf8(body).map_err(|e| e.to_string())?;
    let members = Members::parse(text).ok_or("the chat completion is not one JSON object")?;
    let choice =
        choice_zero(&members, TextMember::Message).ok_or("the chat completion has no choice 0")?;
    let g = &choice.generated;
    let mut output = Vec::new();
    if !g.reasoning().is_empty() {
        output.push(reasoning_item(
            &meta.item_id("rs", output.len()),
            "completed",
            g.reasoning(),
        ));
    }
    if !g.content().is_empty() || g.tool_call_count() == 0 {
        output.push(message_item(
            &meta.item_id("msg", output.len()),
            "completed",
            Some(g.content()),
        ));
    }
    for (_, name, arguments) in g.tool_calls() {
        let n = output.len();
        output.push(function_call_item(
            &meta.item_id("fc", n),
            "completed",
            &meta.item_id("call", n),
            name,
            arguments,
        ));
    }
    let (status, incomplete) = ending(choice.finish_reason.as_deref());
    let usage_raw = members
        .get("usage")
        .and_then(|u| serde_json::from_str::<Value>(u.get()).ok());
    Ok(meta.object(
        status,
        output,
        usage(usage_raw.as_ref()),
        Value::Null,
        incomplete,
    ))
}

/// A chat completion (JSON) as the chat event stream it stands for: one chunk whose `delta` is
/// choice 0's `message` (as the meter read it), the usage chunk, `[DONE]` — for a node that
/// answered a streamed request with a whole body, so that the caller still gets the stream it
/// asked for.
pub fn chat_json_as_stream(body: &[u8]) -> Bytes {
    let mut out = Vec::new();
    let text = std::str::from_utf8(body).unwrap_or_default();
    if let Some(members) = Members::parse(text) {
        if let Some(choice) = choice_zero(&members, TextMember::Message) {
            let g = &choice.generated;
            let calls: Vec<Value> = g
                .tool_calls()
                .map(|(i, name, arguments)| json!({"index": i, "function": {"name": name, "arguments": arguments}}))
                .collect();
            let mut delta = json!({"content": g.content()});
            if !g.reasoning().is_empty() {
                delta["reasoning_content"] = json!(g.reasoning());
            }
            if !calls.is_empty() {
                delta["tool_calls"] = json!(calls);
            }
            let chunk = json!({"choices": [{"index": 0, "delta": delta, "finish_reason": choice.finish_reason}]});
            out.extend_from_slice(format!("data: {chunk}\n\n").as_bytes());
        }
        if let Some(u) = members.get("usage") {
            out.extend_from_slice(
                format!("data: {{\"choices\":[],\"usage\":{}}}\n\n", u.get()).as_bytes(),
            );
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
    }
    Bytes::from(out)
}

/// One output item of a streamed answer, as it grows.
#[derive(Debug)]
enum Item {
    Reasoning {
        text: String,
    },
    Message {
        text: String,
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

/// The meter's keepalive comment, also written after [`crate::meter::KEEPALIVE_INTERVAL`]
/// without an event for the caller (chat chunks that carry nothing it would see).
const KEEPALIVE: &[u8] = b": keepalive\n\n";

/// The end of a stream that did not complete, as the `error` and `response.failed` events.
const TRUNCATED: &str = "the stream ended before the response was complete";

/// A metered chat completion stream as a Responses API event stream.
///
/// Emits `response.created` and `response.in_progress` with the first chat event; then, as
/// the chat deltas come (read as the meter reads them for the bill),
/// `response.output_item.added` (and `response.content_part.added`) for each new item —
/// reasoning, message, function call — `response.reasoning_text.delta`,
/// `response.output_text.delta` and `response.function_call_arguments.delta` carrying every
/// delivered character once; at the chat stream's `[DONE]` the `…done` events of every item
/// and `response.completed` (or `response.incomplete` for a `length` finish) with the whole
/// output and the billed `usage` from the meter's usage chunk. A chat error event (or an end
/// without `[DONE]`) becomes OpenAI's `error` event followed by `response.failed`. Every event
/// is `event: <type>` plus one JSON `data` line with `type` and a `sequence_number` from 0.
/// The meter's keepalive comments pass through, and one is written when chat events arrive
/// for [`crate::meter::KEEPALIVE_INTERVAL`] without producing an event. A function call's
/// `call_id` is the gateway's own (`call_<response>_<n>`).
///
/// Memory: the items' texts (the answer, once), as the final event must carry them.
/// Dropping it drops the metered body (the caller left: `client_cancelled`).
#[derive(Debug)]
pub struct ResponsesSse<B> {
    inner: B,
    meta: ResponseMeta,
    parser: SseParser,
    conv: Converter,
    out: Vec<u8>,
    /// When the caller last got a frame.
    last_sent: std::time::Instant,
}

impl<B> ResponsesSse<B> {
    /// Wraps `inner`, a metered chat completion stream whose request asked for usage.
    pub fn new(inner: B, meta: ResponseMeta) -> Self {
        Self {
            inner,
            meta,
            // the meter bounds every event it forwards; its output needs no second cap
            parser: SseParser::with_limits(usize::MAX, usize::MAX),
            conv: Converter::default(),
            out: Vec::new(),
            last_sent: std::time::Instant::now(),
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
        self.emit(
            out,
            "response.created",
            json!({"response": response.clone()}),
        );
        self.emit(out, "response.in_progress", json!({"response": response}));
    }

    fn item_json(id: &str, item: &Item, status: &str) -> Value {
        match item {
            Item::Reasoning { text } => reasoning_item(id, status, text),
            Item::Message { text } => message_item(id, status, Some(text)),
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
            Item::Message { .. } => message_item(&id, "in_progress", None),
            Item::FunctionCall { call_id, name, .. } => {
                function_call_item(&id, "in_progress", call_id, name, "")
            }
        };
        self.emit(
            out,
            "response.output_item.added",
            json!({"output_index": index, "item": added}),
        );
        let part = match item {
            Item::Reasoning { .. } => Some(json!({"type": "reasoning_text", "text": ""})),
            Item::Message { .. } => Some(output_text("")),
            Item::FunctionCall { .. } => None,
        };
        if let Some(part) = part {
            self.emit(
                out,
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            );
        }
        self.items.push((id, item));
        index
    }

    /// Appends `delta` to the reasoning item (`reasoning`) or the message (`!reasoning`),
    /// opening it first if it is not there yet, and emits its delta event.
    fn text_delta(&mut self, meta: &ResponseMeta, out: &mut Vec<u8>, reasoning: bool, delta: &str) {
        let open = if reasoning {
            self.reasoning
        } else {
            self.message
        };
        let index = match open {
            Some(i) => i,
            None if reasoning => {
                let item = Item::Reasoning {
                    text: String::new(),
                };
                let i = self.open(meta, out, "rs", item);
                self.reasoning = Some(i);
                i
            }
            None => {
                let item = Item::Message {
                    text: String::new(),
                };
                let i = self.open(meta, out, "msg", item);
                self.message = Some(i);
                i
            }
        };
        let (id, item) = &mut self.items[index];
        if let Item::Reasoning { text } | Item::Message { text } = item {
            text.push_str(delta);
        }
        let mut data =
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta});
        let kind = if reasoning {
            "response.reasoning_text.delta"
        } else {
            data["logprobs"] = json!([]);
            "response.output_text.delta"
        };
        self.emit(out, kind, data);
    }

    fn tool_call_delta(
        &mut self,
        meta: &ResponseMeta,
        out: &mut Vec<u8>,
        chat_index: u64,
        name: &str,
        arguments: &str,
    ) {
        let index = match self.calls.get(&chat_index) {
            Some(&i) => {
                if let Item::FunctionCall { name: n, .. } = &mut self.items[i].1 {
                    n.push_str(name);
                }
                i
            }
            // a call's first delta carries no name while the gateway holds it until whole
            // (`meter::bill::tool_call_heads`): the item opens with its name
            None if name.is_empty() && arguments.is_empty() => return,
            None => {
                let call_id = meta.item_id("call", self.items.len());
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
        let (id, item) = &mut self.items[index];
        if let Item::FunctionCall { arguments: a, .. } = item {
            a.push_str(arguments);
        }
        let data = json!({"item_id": id, "output_index": index, "delta": arguments});
        self.emit(out, "response.function_call_arguments.delta", data);
    }

    /// One event of the metered chat stream.
    fn on_chat_event(&mut self, meta: &ResponseMeta, out: &mut Vec<u8>, data: &str) {
        if self.ended {
            return;
        }
        self.start(meta, out);
        if data.trim() == "[DONE]" {
            return self.complete(meta, out);
        }
        let Some(members) = Members::parse(data) else {
            return self.fail(
                meta,
                out,
                "upstream_failed",
                "the stream carried an invalid event",
            );
        };
        if let Some(error) = members.get("error").filter(|e| e.get() != "null") {
            let error: Value = serde_json::from_str(error.get()).unwrap_or(Value::Null);
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
        if let Some(u) = members.get("usage") {
            if let Ok(u @ Value::Object(_)) = serde_json::from_str::<Value>(u.get()) {
                self.usage = Some(u);
            }
        }
        let Some(choice) = choice_zero(&members, TextMember::Delta) else {
            return;
        };
        let g = &choice.generated;
        if !g.reasoning().is_empty() {
            self.text_delta(meta, out, true, g.reasoning());
        }
        if !g.content().is_empty() {
            self.text_delta(meta, out, false, g.content());
        }
        for (index, name, arguments) in g.tool_calls() {
            self.tool_call_delta(meta, out, index, name, arguments);
        }
        if let Some(reason) = choice.finish_reason {
            self.finish_reason = Some(reason);
        }
    }

    /// The `…done` events of every item, in output order; returns the finished items.
    fn close_items(&mut self, out: &mut Vec<u8>) -> Vec<Value> {
        let items = std::mem::take(&mut self.items);
        let mut done = Vec::with_capacity(items.len());
        for (index, (id, item)) in items.iter().enumerate() {
            match item {
                Item::Reasoning { text } => {
                    self.emit(out, "response.reasoning_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}));
                    self.emit(out, "response.content_part.done", json!({"item_id": id, "output_index": index, "content_index": 0, "part": {"type": "reasoning_text", "text": text}}));
                }
                Item::Message { text } => {
                    self.emit(out, "response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}));
                    self.emit(out, "response.content_part.done", json!({"item_id": id, "output_index": index, "content_index": 0, "part": output_text(text)}));
                }
                Item::FunctionCall {
                    name, arguments, ..
                } => {
                    self.emit(out, "response.function_call_arguments.done", json!({"item_id": id, "output_index": index, "name": name, "arguments": arguments}));
                }
            }
            let item = Self::item_json(id, item, "completed");
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
        if self.ended {
            return;
        }
        self.start(meta, out);
        self.ended = true;
        let output = self.close_items(out);
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
        if self.ended {
            return;
        }
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
            .map(|(id, item)| Self::item_json(id, item, "incomplete"))
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
            if !this.out.is_empty() {
                let bytes = Bytes::from(std::mem::take(&mut this.out));
                this.last_sent = std::time::Instant::now();
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
                    if this.out.is_empty()
                        && this.last_sent.elapsed() >= crate::meter::KEEPALIVE_INTERVAL
                    {
                        this.out.extend_from_slice(KEEPALIVE);
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
                    this.conv
                        .fail(&this.meta, &mut this.out, "upstream_failed", TRUNCATED);
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
