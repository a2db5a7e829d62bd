use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use indexmap::IndexMap;
use serde_json::value::RawValue;
use serde_json::Value;
use spine_core::{BoxError, StreamOutcome, Usage};

use super::settle::{BillNotes, SettleCtx};
use super::MeterError;
use crate::sse::{SseEvent, SseParser};
use crate::tokenizer::GeneratedText;

type JsonMap = IndexMap<String, Box<RawValue>>;

/// The error event sent when the node's stream ends before every choice finished.
const TRUNCATED_EVENT: &[u8] = b"data: {\"error\":{\"message\":\"the upstream stream ended before the response was complete\",\"type\":\"upstream_error\",\"code\":\"upstream_failed\"}}\n\n";
const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";
/// The SSE comment the gateway writes while the node is silent.
const KEEPALIVE_EVENT: &[u8] = b": keepalive\n\n";
/// Longest the client waits without a byte while the node is silent (long prefill, slow
/// node): [`MeterBody`] writes an SSE comment keepalive after this much quiet.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(15);

pin_project_lite::pin_project! {
    /// A response body that meters what it forwards.
    ///
    /// **Streamed** (`text/event-stream`): parses SSE incrementally and forwards each complete
    /// event as its own frame as soon as it is complete. Events are forwarded byte for byte
    /// unless they must change: a `usage` member on a content chunk is removed, a usage-only
    /// chunk (`choices` empty or absent) is withheld, events with fields other than `data`
    /// (comments, `id:`, `retry:`, `event:`) are re-encoded as plain `data:` lines, comments and
    /// data-less events are dropped. The node's latest non-null `usage` is kept as its claim
    /// (never summed). When the client asked for usage (`stream_options.include_usage`), exactly
    /// one usage chunk carrying the BILLED counts is sent just before `[DONE]`. A stream whose
    /// choices all finished gets a `[DONE]` even when the node did not send one; a stream that
    /// ends early gets an OpenAI-shaped error event instead. The gateway never writes `id:`,
    /// `event:` or `retry:` lines.
    ///
    /// **Keepalive.** While the node is silent the client gets an SSE comment,
    /// `: keepalive\n\n`, after every [`KEEPALIVE_INTERVAL`] without a frame (the node's own
    /// comment pings are dropped; these are the gateway's). Needs a tokio runtime with time
    /// enabled; without one no keepalive is sent.
    ///
    /// Non-streamed responses are not wrapped: [`Meter`](super::Meter) buffers and meters them
    /// before it returns the response head.
    ///
    /// # End of stream
    ///
    /// The settlement hook fires exactly once for every ending: the node's end of stream
    /// (`[DONE]`, end of body, or `is_end_stream()` after a data frame), a body error, or drop
    /// before the end (the client went away: `client_cancelled`, the caller pays the prompt plus
    /// the completion tokens delivered, without EOS). A stream with an error event, or whose
    /// requested choices did not all get a `finish_reason`, settles `upstream_failed`. A
    /// completed stream bills the independent prompt count plus, per requested choice, the
    /// generated text's tokens (content, reasoning, tool calls) with the EOS and `length` rules
    /// of [`ModelTokenizer::bill_completion`](crate::ModelTokenizer::bill_completion), capped
    /// as the [module docs](super) state. Choices with an index `>= n` are forwarded but never
    /// billed.
    pub struct MeterBody<B> {
        #[pin]
        inner: B,
        state: State,
    }
}

#[derive(Debug, Default)]
struct Choice {
    delivered: GeneratedText,
    finish_reason: Option<String>,
}

struct Stream {
    parser: Box<SseParser>,
    include_usage: bool,
    usage_template: Option<JsonMap>,
    meta: JsonMap,
    done_raw: Option<Bytes>,
}

struct Out {
    bytes: Bytes,
    text: Vec<(u64, GeneratedText)>,
}

struct State {
    stream: Stream,
    ctx: Option<SettleCtx>,
    choices: BTreeMap<u64, Choice>,
    claimed: Option<Usage>,
    error_seen: bool,
    upstream_done: bool,
    queue: VecDeque<Out>,
    scratch: Vec<SseEvent>,
    keepalive: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl fmt::Debug for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MeterBodyState")
            .field("ctx", &self.ctx)
            .field("choices", &self.choices)
            .field("claimed", &self.claimed)
            .field("error_seen", &self.error_seen)
            .field("upstream_done", &self.upstream_done)
            .field("queued", &self.queue.len())
            .finish_non_exhaustive()
    }
}

impl<B: fmt::Debug> fmt::Debug for MeterBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MeterBody")
            .field("inner", &self.inner)
            .field("state", &self.state)
            .finish()
    }
}

impl Drop for State {
    fn drop(&mut self) {
        // the body went away before the end: the client left
        if let Some(ctx) = self.ctx.take() {
            let billed = self.billed(&ctx, false);
            let outcome = if self.error_seen {
                StreamOutcome::UpstreamFailed
            } else {
                StreamOutcome::ClientCancelled
            };
            ctx.settle(outcome, billed, self.claimed);
        }
    }
}

impl<B> MeterBody<B> {
    pub(crate) fn streaming(inner: B, ctx: SettleCtx, include_usage: bool) -> Self {
        Self {
            inner,
            state: State {
                stream: Stream {
                    parser: Box::new(SseParser::new()),
                    include_usage,
                    usage_template: None,
                    meta: JsonMap::new(),
                    done_raw: None,
                },
                ctx: Some(ctx),
                choices: BTreeMap::new(),
                claimed: None,
                error_seen: false,
                upstream_done: false,
                queue: VecDeque::new(),
                scratch: Vec::new(),
                keepalive: None,
            },
        }
    }
}

fn usage_claim(raw: &RawValue) -> Option<Usage> {
    let v: Value = serde_json::from_str(raw.get()).ok()?;
    let obj = v.as_object()?;
    Some(Usage {
        prompt_tokens: obj
            .get("prompt_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        completion_tokens: obj
            .get("completion_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0),
    })
}

fn usage_json(u: &Usage) -> Box<RawValue> {
    let s = format!(
        "{{\"prompt_tokens\":{},\"completion_tokens\":{},\"total_tokens\":{}}}",
        u.prompt_tokens,
        u.completion_tokens,
        u.total_tokens()
    );
    RawValue::from_string(s).unwrap_or_else(|_| empty_object())
}

fn empty_object() -> Box<RawValue> {
    serde_json::from_str("{}").unwrap_or_else(|_| Box::<RawValue>::default())
}

fn encode_event(data: &str) -> Bytes {
    let mut out = Vec::with_capacity(data.len() + 8);
    for line in data.split('\n') {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line.as_bytes());
        out.push(b'\n');
    }
    out.push(b'\n');
    Bytes::from(out)
}

/// The chunk members kept to build a usage chunk when the node sent none.
const META_KEYS: [&str; 5] = ["id", "object", "created", "model", "system_fingerprint"];

/// A member's raw JSON when present, `null` included (`Option<&RawValue>` would turn `null`
/// into `None`).
#[derive(Default)]
struct MaybeRaw<'a>(Option<&'a RawValue>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for MaybeRaw<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <&'a RawValue as serde::Deserialize<'de>>::deserialize(d).map(|r| MaybeRaw(Some(r)))
    }
}

/// The members of a chunk the meter reads, borrowed from the event's data: the same values
/// a [`JsonMap`] parse gives for an object without duplicate members (serde refuses
/// duplicates of these fields, and the caller then falls back to the map).
#[derive(serde::Deserialize)]
struct ChunkView<'a> {
    #[serde(default, borrow)]
    error: MaybeRaw<'a>,
    #[serde(default, borrow)]
    usage: MaybeRaw<'a>,
    #[serde(default, borrow)]
    choices: MaybeRaw<'a>,
    #[serde(default, borrow)]
    id: MaybeRaw<'a>,
    #[serde(default, borrow)]
    object: MaybeRaw<'a>,
    #[serde(default, borrow)]
    created: MaybeRaw<'a>,
    #[serde(default, borrow)]
    model: MaybeRaw<'a>,
    #[serde(default, borrow)]
    system_fingerprint: MaybeRaw<'a>,
}

impl<'a> ChunkView<'a> {
    /// The view of a JSON object; `None` for anything else (a derived struct would also
    /// accept an array) or on any parse error.
    fn parse(data: &'a str) -> Option<Self> {
        if !data.trim_start().starts_with('{') {
            return None;
        }
        serde_json::from_str(data).ok()
    }
}

fn encode_map(map: &JsonMap) -> Option<Bytes> {
    serde_json::to_string(map).ok().map(|s| encode_event(&s))
}

/// `(index, generated, finish_reason)` of each choice in a chunk or completion: what its
/// `delta` / `message` / `text` carries ([`GeneratedText::push_choice_json`]).
fn read_choices(raw: &RawValue) -> Vec<(u64, GeneratedText, Option<String>)> {
    let Ok(Value::Array(choices)) = serde_json::from_str::<Value>(raw.get()) else {
        return Vec::new();
    };
    choices
        .iter()
        .map(|c| {
            let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
            let mut generated = GeneratedText::new();
            generated.push_choice_json(c);
            let finish = c
                .get("finish_reason")
                .and_then(Value::as_str)
                .map(str::to_owned);
            (index, generated, finish)
        })
        .collect()
}

/// The usage billed for `choices` (requested choices only): the prompt plus each choice's
/// capped completion tokens, with the EOS and `length` rules only when `completed`.
fn billed_usage(
    ctx: &SettleCtx,
    choices: &BTreeMap<u64, Choice>,
    completed: bool,
) -> (Usage, BillNotes) {
    let mut notes = BillNotes::default();
    let mut completion_tokens = 0u64;
    for (i, c) in choices.values().enumerate() {
        let count = ctx.choice_completion(&c.delivered, c.finish_reason.as_deref(), completed);
        completion_tokens = completion_tokens.saturating_add(count.tokens);
        if i == 0 && choices.len() > 1 {
            notes.first_choice_completion_tokens = Some(count.tokens);
        }
        notes.length_unsupported |= count.length_unsupported;
        notes.wrapper_allowance_tokens = notes
            .wrapper_allowance_tokens
            .saturating_add(c.delivered.wrapper_allowance_tokens());
    }
    let usage = Usage {
        prompt_tokens: ctx.prompt_tokens,
        completion_tokens,
    };
    (usage, notes)
}

/// Meters a complete non-streamed 2xx response body and settles.
///
/// A usable completion (a JSON object without a non-null `error`, with at least one requested
/// choice, every requested choice with a `finish_reason`) settles `completed` and comes back
/// with `usage` rewritten to the billed counts. Anything else settles `upstream_failed` (the
/// caller pays nothing) and is a [`MeterError::UpstreamInvalid`].
pub(crate) fn meter_json(ctx: SettleCtx, body: &[u8]) -> Result<Bytes, MeterError> {
    let fail = |ctx: SettleCtx, billed: Usage, claimed: Option<Usage>, why: String| {
        tracing::warn!(request_id = %ctx.request_id, reason = %why, "invalid node response");
        ctx.settle(StreamOutcome::UpstreamFailed, billed, claimed);
        Err(MeterError::UpstreamInvalid(why))
    };
    let nothing = Usage {
        prompt_tokens: ctx.prompt_tokens,
        completion_tokens: 0,
    };
    let Ok(mut map) = serde_json::from_slice::<JsonMap>(body) else {
        return fail(
            ctx,
            nothing,
            None,
            "the body is not a JSON object".to_owned(),
        );
    };
    let claimed = map.get("usage").and_then(|u| usage_claim(u));
    if !State::is_null(map.get("error").map(|b| &**b)) {
        return fail(
            ctx,
            nothing,
            claimed,
            "the body carries an error".to_owned(),
        );
    }
    let mut choices: BTreeMap<u64, Choice> = BTreeMap::new();
    for (index, content, finish) in map
        .get("choices")
        .map(|c| read_choices(c))
        .unwrap_or_default()
    {
        if !ctx.is_requested_choice(index) {
            continue;
        }
        let choice = choices.entry(index).or_default();
        choice.finish_reason = finish;
        choice.delivered.append(&content);
    }
    if choices.is_empty() {
        return fail(ctx, nothing, claimed, "the body has no choices".to_owned());
    }
    if let Some((index, _)) = choices.iter().find(|(_, c)| c.finish_reason.is_none()) {
        let why = format!("choice {index} has no finish_reason");
        let (billed, _) = billed_usage(&ctx, &choices, false);
        return fail(ctx, billed, claimed, why);
    }
    let (billed, notes) = billed_usage(&ctx, &choices, true);
    map.insert("usage".to_owned(), usage_json(&billed));
    let bytes = match serde_json::to_vec(&map) {
        Ok(v) => Bytes::from(v),
        Err(e) => {
            return fail(
                ctx,
                nothing,
                claimed,
                format!("cannot re-encode the body: {e}"),
            )
        }
    };
    ctx.settle_checked(StreamOutcome::Completed, billed, claimed, notes);
    Ok(bytes)
}

impl State {
    fn is_null(raw: Option<&RawValue>) -> bool {
        raw.is_none_or(|r| r.get().trim() == "null")
    }

    /// One event from the node.
    fn on_event(&mut self, ev: &SseEvent) {
        if self.upstream_done {
            return;
        }
        if ev.data().trim() == "[DONE]" {
            self.stream.done_raw = Some(if ev.is_data_only() {
                ev.raw().clone()
            } else {
                Bytes::from_static(DONE_EVENT)
            });
            self.upstream_done = true;
            return;
        }
        let untouched = || {
            if ev.is_data_only() {
                ev.raw().clone()
            } else {
                encode_event(ev.data())
            }
        };
        // fast path: a chunk without a non-null `usage` (every chunk but the last) is read
        // through a borrowed view, without building a map; anything else (usage, duplicate
        // keys, not an object) takes the general path below, which means the same
        if let Some(view) = ChunkView::parse(ev.data()) {
            if Self::is_null(view.usage.0) {
                self.error_seen |= !Self::is_null(view.error.0);
                self.remember_meta(&view);
                let choices = view.choices.0.map(read_choices).unwrap_or_default();
                let text = self.take_choices(choices);
                self.queue.push_back(Out {
                    bytes: untouched(),
                    text,
                });
                return;
            }
        }
        let Ok(mut map) = serde_json::from_str::<JsonMap>(ev.data()) else {
            // not a JSON object: forwarded, never counted
            self.queue.push_back(Out {
                bytes: untouched(),
                text: Vec::new(),
            });
            return;
        };
        if !Self::is_null(map.get("error").map(|b| &**b)) {
            self.error_seen = true;
        }
        for key in META_KEYS {
            if let Some(v) = map.get(key) {
                self.stream.meta.insert(key.to_owned(), v.clone());
            }
        }
        let choices = map
            .get("choices")
            .map(|c| read_choices(c))
            .unwrap_or_default();
        let choices_empty = choices.is_empty();
        let text = self.take_choices(choices);
        let Stream { usage_template, .. } = &mut self.stream;
        let has_usage = !Self::is_null(map.get("usage").map(|b| &**b));
        if has_usage {
            if let Some(claim) = map.get("usage").and_then(|u| usage_claim(u)) {
                self.claimed = Some(claim);
            }
            if choices_empty && !map.contains_key("error") {
                // usage-only chunk: withheld; the billed one goes out at the end if asked
                *usage_template = Some(map);
                return;
            }
            map.shift_remove("usage");
            let bytes = encode_map(&map).unwrap_or_else(untouched);
            self.queue.push_back(Out { bytes, text });
            return;
        }
        self.queue.push_back(Out {
            bytes: untouched(),
            text,
        });
    }

    /// Records each choice's `finish_reason` (requested choices only) and returns the text of
    /// those that carry some, to be billed once delivered.
    fn take_choices(
        &mut self,
        choices: Vec<(u64, GeneratedText, Option<String>)>,
    ) -> Vec<(u64, GeneratedText)> {
        let mut text = Vec::new();
        for (index, content, finish) in choices {
            // forwarded, but a choice the caller did not ask for is never billed
            if !self
                .ctx
                .as_ref()
                .is_some_and(|c| c.is_requested_choice(index))
            {
                continue;
            }
            let choice = self.choices.entry(index).or_default();
            if let Some(f) = finish {
                choice.finish_reason = Some(f);
            }
            if !content.is_empty() {
                text.push((index, content));
            }
        }
        text
    }

    /// Keeps the latest value of each [`META_KEYS`] member the chunk has (allocating only
    /// when a value changes: they are the same on every chunk of a stream).
    fn remember_meta(&mut self, view: &ChunkView<'_>) {
        let fields = [
            view.id.0,
            view.object.0,
            view.created.0,
            view.model.0,
            view.system_fingerprint.0,
        ];
        for (key, value) in META_KEYS.iter().zip(fields) {
            let Some(value) = value else { continue };
            if self.stream.meta.get(*key).map(|m| m.get()) != Some(value.get()) {
                self.stream.meta.insert((*key).to_owned(), value.to_owned());
            }
        }
    }

    fn billed(&self, ctx: &SettleCtx, completed: bool) -> Usage {
        billed_usage(ctx, &self.choices, completed).0
    }

    /// The node's stream ended (every queued event already delivered): decide, queue the tail,
    /// settle.
    fn finish_stream(&mut self) {
        let Some(ctx) = self.ctx.take() else {
            return;
        };
        let completed = !self.error_seen
            && !self.choices.is_empty()
            && self.choices.values().all(|c| c.finish_reason.is_some());
        let (billed, notes) = billed_usage(&ctx, &self.choices, completed);
        let Stream {
            include_usage,
            usage_template,
            meta,
            done_raw,
            ..
        } = &mut self.stream;
        if completed {
            if *include_usage {
                let mut chunk = usage_template.take().unwrap_or_else(|| {
                    let mut m = meta.clone();
                    if let Ok(empty) = RawValue::from_string("[]".to_owned()) {
                        m.insert("choices".to_owned(), empty);
                    }
                    m
                });
                chunk.insert("usage".to_owned(), usage_json(&billed));
                if let Some(bytes) = encode_map(&chunk) {
                    self.queue.push_back(Out {
                        bytes,
                        text: Vec::new(),
                    });
                }
            }
            self.queue.push_back(Out {
                bytes: done_raw
                    .take()
                    .unwrap_or_else(|| Bytes::from_static(DONE_EVENT)),
                text: Vec::new(),
            });
            ctx.settle_checked(StreamOutcome::Completed, billed, self.claimed, notes);
        } else {
            if !self.error_seen {
                self.queue.push_back(Out {
                    bytes: Bytes::from_static(TRUNCATED_EVENT),
                    text: Vec::new(),
                });
            }
            ctx.settle(StreamOutcome::UpstreamFailed, billed, self.claimed);
        }
    }

    fn on_data(&mut self, data: &[u8]) {
        let mut events = std::mem::take(&mut self.scratch);
        let res = self.stream.parser.feed(data, &mut events);
        for ev in &events {
            self.on_event(ev);
        }
        events.clear();
        self.scratch = events;
        if let Err(e) = res {
            tracing::warn!(error = %e, "node stream is not valid sse");
            self.on_upstream_error();
        }
    }

    /// The node's body failed or broke the rules: upstream_failed, the client gets an error.
    fn on_upstream_error(&mut self) {
        self.upstream_done = true;
        self.error_seen = true;
        if let Some(ctx) = self.ctx.take() {
            let billed = self.billed(&ctx, false);
            let claimed = self.claimed;
            ctx.settle(StreamOutcome::UpstreamFailed, billed, claimed);
        }
        self.queue.push_back(Out {
            bytes: Bytes::from_static(TRUNCATED_EVENT),
            text: Vec::new(),
        });
    }

    fn on_eof(&mut self) {
        let mut events = Vec::new();
        let res = self.stream.parser.finish(&mut events);
        for ev in &events {
            self.on_event(ev);
        }
        if res.is_err() {
            self.on_upstream_error();
            return;
        }
        self.upstream_done = true;
    }

    fn deliver(&mut self, out: Out) -> Bytes {
        for (index, text) in out.text {
            self.choices
                .entry(index)
                .or_default()
                .delivered
                .append(&text);
        }
        self.reset_keepalive();
        out.bytes
    }

    /// The keepalive timer restarts after every frame the client gets.
    fn reset_keepalive(&mut self) {
        if let Some(sleep) = self.keepalive.as_mut() {
            sleep
                .as_mut()
                .reset(tokio::time::Instant::now() + KEEPALIVE_INTERVAL);
        }
    }

    /// Polls the keepalive timer (started on first use, when a tokio runtime is there): true
    /// when the client has had no frame for [`KEEPALIVE_INTERVAL`].
    fn keepalive_due(&mut self, cx: &mut Context<'_>) -> bool {
        if self.keepalive.is_none() {
            if tokio::runtime::Handle::try_current().is_err() {
                return false;
            }
            self.keepalive = Some(Box::pin(tokio::time::sleep(KEEPALIVE_INTERVAL)));
        }
        let Some(sleep) = self.keepalive.as_mut() else {
            return false;
        };
        if sleep.as_mut().poll(cx).is_ready() {
            self.reset_keepalive();
            // register the waker on the restarted timer
            if let Some(sleep) = self.keepalive.as_mut() {
                let _ = sleep.as_mut().poll(cx);
            }
            return true;
        }
        false
    }

    fn ended(&self) -> bool {
        self.ctx.is_none() && self.queue.is_empty()
    }
}

impl<B> Body for MeterBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        let state: &mut State = this.state;
        loop {
            if let Some(out) = state.queue.pop_front() {
                let bytes = state.deliver(out);
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            if state.ctx.is_none() {
                return Poll::Ready(None);
            }
            if state.upstream_done {
                state.finish_stream();
                continue;
            }
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Pending => {
                    if state.keepalive_due(cx) {
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(
                            KEEPALIVE_EVENT,
                        )))));
                    }
                    return Poll::Pending;
                }
                Poll::Ready(None) => state.on_eof(),
                Poll::Ready(Some(Err(e))) => {
                    let e: BoxError = e.into();
                    tracing::warn!(error = %e, "node body failed");
                    state.on_upstream_error();
                }
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        state.on_data(&data);
                    }
                    // hyper may never poll again after an exact Content-Length
                    if !state.upstream_done && this.inner.is_end_stream() {
                        state.on_eof();
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.state.ended()
    }

    fn size_hint(&self) -> SizeHint {
        if self.state.ctx.is_none() {
            let n: usize = self.state.queue.iter().map(|o| o.bytes.len()).sum();
            SizeHint::with_exact(n as u64)
        } else {
            SizeHint::default()
        }
    }
}

#[cfg(test)]
mod view_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    /// What the general path reads from a chunk: the members the meter uses, raw.
    fn via_map(data: &str) -> Option<Vec<Option<String>>> {
        let map = serde_json::from_str::<JsonMap>(data).ok()?;
        let keys = ["error", "usage", "choices"].into_iter().chain(META_KEYS);
        Some(
            keys.map(|k| map.get(k).map(|v| v.get().to_owned()))
                .collect(),
        )
    }

    fn via_view(data: &str) -> Option<Vec<Option<String>>> {
        let v = ChunkView::parse(data)?;
        let fields = [
            v.error.0,
            v.usage.0,
            v.choices.0,
            v.id.0,
            v.object.0,
            v.created.0,
            v.model.0,
            v.system_fingerprint.0,
        ];
        Some(
            fields
                .iter()
                .map(|f| f.map(|r| r.get().to_owned()))
                .collect(),
        )
    }

    #[test]
    fn the_view_reads_what_the_map_reads_or_declines() {
        let cases = [
            r#"{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}],"created":1,"id":"c","model":"m","system_fingerprint":"b0","object":"chat.completion.chunk"}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#,
            r#"{"error":null,"usage":null,"choices":null,"id":null}"#,
            r#" { "us\u0061ge" : { "prompt_tokens" : 1 } , "error" : {"message":"x"} } "#,
            r#"{"choices":[1],"choices":[2]}"#,
            r#"{"usage":null,"usage":{"prompt_tokens":9}}"#,
            r#"[{"choices":[]}]"#,
            r#""a string""#,
            r#"{"choices":[{"text":"é\n"}],"extra":{"nested":[1,2,{"a":null}]}}"#,
            r#"{"choices":[]} trailing"#,
            "{}",
        ];
        for data in cases {
            match via_view(data) {
                // when the view reads a chunk, it reads exactly what the map reads
                Some(view) => assert_eq!(Some(view), via_map(data), "{data}"),
                // it declines only what the general path must decide (duplicates, non-objects,
                // invalid json)
                None => assert!(
                    via_map(data).is_none()
                        || data.matches("\"choices\"").count() > 1
                        || data.matches("\"usage\"").count() > 1,
                    "{data}"
                ),
            }
        }
        assert!(via_view(r#"{"choices":[1],"choices":[2]}"#).is_none());
        assert!(via_view(r#"[{"choices":[]}]"#).is_none());
    }
}
