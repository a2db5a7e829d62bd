use std::borrow::Cow;
use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use serde_json::value::RawValue;
use smallvec::SmallVec;
use spine_core::{BoxError, NodeFault, NodeSlot, RequestKind, StreamOutcome, Usage};

use super::bill::{
    billed_usage, bound_event, bytes_bound_event, encode_event, error_event, over_limit_streamed,
    stream_bytes_bound, tool_call_heads, unnamed_tool_call, Choice, Cut,
};
use super::node_json::{
    engine_error_message, is_engine_error, is_null, read_choices, usage_claim, Members, TextMember,
};
use super::settle::SettleCtx;
use stall::StallClock;

mod meta;
mod stall;
mod timers;
use crate::sse::{SseEvent, SseParser};
use crate::tokenizer::GeneratedText;
use crate::TokenCounter;

/// The error event sent when the node's stream ends before every choice finished.
const TRUNCATED_EVENT: &[u8] = b"data: {\"error\":{\"message\":\"the node's stream ended before the response was complete\",\"type\":\"upstream_error\",\"param\":null,\"code\":\"upstream_failed\"}}\n\n";
const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";
/// The SSE comment the gateway writes while the node is silent.
const KEEPALIVE_EVENT: &[u8] = b": keepalive\n\n";
/// Longest the client waits without a byte while the node is silent (long prefill, slow
/// node): [`MeterBody`] writes an SSE comment keepalive after this much quiet.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(15);
/// What a streamed response's metering needs besides the settlement context.
#[derive(Clone, Debug)]
pub(crate) struct StreamSettings {
    /// Send the billed usage chunk: the caller asked for usage (`stream_options.include_usage`).
    pub(crate) include_usage: bool,
    /// The endpoint: names the usage chunk's `object`.
    pub(crate) kind: RequestKind,
    pub(crate) strip_engine_fields: bool,
    pub(crate) max_sse_line_bytes: usize,
    pub(crate) max_sse_event_bytes: usize,
    /// Zero: no bound.
    pub(crate) max_stream_duration: Duration,
    /// Longest without progress ([`MeterConfig::stream_stall_timeout`]); zero: no bound.
    ///
    /// [`MeterConfig::stream_stall_timeout`]: super::MeterConfig::stream_stall_timeout
    pub(crate) stream_stall_timeout: Duration,
    /// Cancelled when the process's drain ends ([`MeterLayer::drain_deadline`]): the stream is
    /// ended at its bound.
    ///
    /// [`MeterLayer::drain_deadline`]: super::MeterLayer::drain_deadline
    pub(crate) drain_deadline: Option<tokio_util::sync::CancellationToken>,
    /// Where a node fault is reported, for the router to score.
    pub(crate) slot: Option<NodeSlot>,
}

impl StreamSettings {
    fn chunk_object(&self) -> &'static str {
        match self.kind {
            RequestKind::Completions => "text_completion",
            _ => "chat.completion.chunk",
        }
    }
}

pin_project_lite::pin_project! {
    /// A response body that meters what it forwards.
    ///
    /// **Streamed** (`text/event-stream`): parses SSE incrementally and forwards each complete
    /// event as its own frame as soon as it is complete. **Every event the caller gets is one
    /// complete JSON object of the endpoint's chunk shape, OpenAI's error shape, or `[DONE]`**:
    ///
    /// - an event that is not one JSON object (two values, a half-written object, invalid
    ///   UTF-8, duplicate members), a chunk whose `choices` is not an array of objects, an
    ///   event or line over the caps, a choice past its token cap: the node broke the
    ///   rules — the caller's stream ends with the gateway's error event, the request settles
    ///   `upstream_failed` (the caller pays nothing) and the fault is reported on the
    ///   [`NodeSlot`] for the router to score;
    /// - a bound an honest node can reach too (`max_stream_duration`,
    ///   [`MAX_TOOL_CALLS_PER_CHOICE`]): the stream ends with an error event of code
    ///   `stream_bound_reached`, the request settles `cut_at_bound` (the caller pays the prompt
    ///   plus the completion tokens delivered, like a cancel; the operator earns nothing) and
    ///   the node is not scored;
    /// - an engine's error (a non-null `error` member, or vLLM's / SGLang's top-level
    ///   `{"object":"error","message":…}`) becomes the gateway's error event in OpenAI's shape
    ///   (`type` `upstream_error`, `code` `upstream_failed`, the engine's message), settled and
    ///   scored the same way;
    /// - choices with an index `>= n` are removed (never delivered, never billed), members
    ///   outside OpenAI's chunk shape (`timings`, …) are removed when configured, a `usage`
    ///   member on a content chunk is removed, a usage-only chunk is withheld; events with
    ///   fields other than `data` are re-encoded as plain `data:` lines, comments are dropped.
    ///
    /// The node's latest non-null `usage` is kept as its claim (never summed). When the client
    /// asked for usage (`stream_options.include_usage`), exactly one usage chunk carrying the
    /// BILLED counts is sent just before `[DONE]`, with the stream's `id`, `object`, `created`,
    /// `model` and `choices: []`. A stream whose choices all finished gets a `[DONE]` even when
    /// the node did not send one; a stream that ends early gets an OpenAI-shaped error event
    /// instead. The gateway never writes `id:`, `event:` or `retry:` lines.
    ///
    /// **Bounded cost.** Each choice's delivered text is counted as it flows
    /// ([`GeneratedCount`]: no whole-text buffer); a choice may deliver at most its cap plus
    /// `max(16, cap / 10)` tokens, and at most that × the longest token in bytes. The whole
    /// stream lasts at most `max_stream_duration`.
    ///
    /// **Keepalive.** While the node is silent the client gets an SSE comment,
    /// `: keepalive\n\n`, after every [`KEEPALIVE_INTERVAL`] without a frame (the node's own
    /// comment pings are dropped; these are the gateway's). Needs a tokio runtime with time
    /// enabled; without one no keepalive is sent and no total bound is kept.
    ///
    /// Non-streamed responses are not wrapped: [`Meter`](super::Meter) buffers and meters them
    /// before it returns the response head.
    ///
    /// # End of stream
    ///
    /// The settlement hook fires exactly once for every ending: the node's end of stream
    /// (`[DONE]`, end of body, or `is_end_stream()` after a data frame), a body error, a rule
    /// broken, the total bound, or drop before the end (the client went away:
    /// `client_cancelled`, the caller pays the prompt plus the completion tokens DELIVERED to it,
    /// without EOS). A stream with an error event, or whose requested choices did not all get a
    /// `finish_reason`, settles `upstream_failed`. A completed stream bills the independent
    /// prompt count plus, per requested choice, the delivered text's tokens (content,
    /// reasoning, tool calls) with the EOS and `length` rules of
    /// [`bill_counted`](crate::tokenizer::bill_counted), capped as the
    /// [module docs](super) state.
    pub struct MeterBody<B> {
        #[pin]
        inner: B,
        state: State,
    }
}

struct Out {
    bytes: Bytes,
    /// Each choice's text in the event (a stream's event carries one).
    text: SmallVec<[(u64, GeneratedText); 1]>,
}

struct State {
    parser: Box<SseParser>,
    settings: StreamSettings,
    tokenizer: Arc<dyn TokenCounter>,
    /// The latest `id`, `object`, `created`, `system_fingerprint` the node sent (raw JSON), for
    /// the usage chunk.
    meta: Vec<(&'static str, Box<RawValue>)>,
    /// The catalog model the caller asked for, as a JSON string: every chunk's `model` (the
    /// node's own name for what it serves is its word, and may be a file path).
    model_json: String,
    done_raw: Option<Bytes>,
    ctx: Option<SettleCtx>,
    choices: BTreeMap<u64, Choice>,
    claimed: Option<Usage>,
    error_seen: bool,
    upstream_done: bool,
    /// Bytes of the node's SSE events so far (bounded by [`stream_bytes_bound`]).
    node_bytes: u64,
    /// Choices 0, 1, … that have begun in what the caller received: a chat choice that begins
    /// before a lower one is preceded by an empty delta of each lower one (the Python SDK's
    /// stream helper files choices by arrival, and failed with `IndexError`).
    choices_begun: u64,
    queue: VecDeque<Out>,
    scratch: Vec<SseEvent>,
    keepalive: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The total bound, started on the first poll.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    deadline_started: bool,
    /// The drain deadline's wait (registered on the first poll).
    drain_wait: Option<Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>>,
    /// The bound on a stream without progress; `None` when disabled.
    stall: Option<StallClock>,
    /// The clock read at the start of the current poll ([`MeterBody::poll_frame`]).
    now: tokio::time::Instant,
}

impl fmt::Debug for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MeterBodyState")
            .field("ctx", &self.ctx)
            .field("choices", &self.choices)
            .field("claimed", &self.claimed)
            .field("error_seen", &self.error_seen)
            .field("upstream_done", &self.upstream_done)
            .field("node_bytes", &self.node_bytes)
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
    pub(crate) fn streaming(inner: B, ctx: SettleCtx, settings: StreamSettings) -> Self {
        let settings_stall = settings.stream_stall_timeout;
        Self {
            inner,
            state: State {
                parser: Box::new(SseParser::with_limits(
                    settings.max_sse_line_bytes,
                    settings.max_sse_event_bytes,
                )),
                tokenizer: ctx.tokenizer.clone(),
                settings,
                meta: Vec::new(),
                model_json: serde_json::to_string(ctx.model.as_str()).unwrap_or_default(),
                done_raw: None,
                ctx: Some(ctx),
                choices: BTreeMap::new(),
                claimed: None,
                error_seen: false,
                upstream_done: false,
                node_bytes: 0,
                choices_begun: 0,
                queue: VecDeque::new(),
                scratch: Vec::new(),
                keepalive: None,
                deadline: None,
                deadline_started: false,
                drain_wait: None,
                stall: StallClock::new(settings_stall),
                now: tokio::time::Instant::now(),
            },
        }
    }
}

impl State {
    /// One event from the node.
    fn on_event(&mut self, ev: &SseEvent) {
        if self.upstream_done {
            return;
        }
        let raw_len = u64::try_from(ev.raw().len()).unwrap_or(u64::MAX);
        self.node_bytes = self.node_bytes.saturating_add(raw_len);
        if let Some(bound) = self.ctx.as_ref().map(stream_bytes_bound) {
            if self.node_bytes > bound {
                return self.bytes_fault(&format!(
                    "the node sent more than {bound} bytes of events for this request's cap \
                     of completion tokens"
                ));
            }
        }
        let data = ev.data();
        // llama.cpp's stream of several prompts sends `data: null` between them: its bytes are
        // counted against the bound above, and it is neither forwarded nor an error
        if data.trim() == "null" {
            return;
        }
        if data.trim() == "[DONE]" {
            // the gateway's own spelling, never the node's: an SDK ends the stream on data that
            // starts with `[DONE]` and parses any other as JSON (` [DONE]`, `\n[DONE]`: raised)
            self.done_raw = Some(Bytes::from_static(DONE_EVENT));
            self.upstream_done = true;
            return;
        }
        let members = if ev.is_utf8() {
            Members::parse(data)
        } else {
            None
        };
        let Some(members) = members else {
            return self.node_fault("the node sent an SSE event that is not one JSON object");
        };
        if is_engine_error(&members) {
            let message = engine_error_message(&members);
            return self.node_fault(&message);
        }
        let usage = members.get("usage");
        let has_usage = !is_null(usage);
        if has_usage {
            if let Some(claim) = usage.and_then(usage_claim) {
                self.claimed = Some(claim);
            }
        }
        let read = match members.get("choices") {
            Some(raw) if raw.get().trim() != "null" => {
                match read_choices(raw, TextMember::of(self.settings.kind, true)) {
                    Ok(read) if read.iter().any(|c| !c.indexed) => {
                        return self
                            .node_fault("the node sent an invalid chunk: a choice has no index")
                    }
                    Ok(read) => read,
                    Err(why) => {
                        return self.node_fault(&format!("the node sent an invalid chunk: {why}"))
                    }
                }
            }
            _ if has_usage => SmallVec::new(),
            _ => return self.node_fault("the node sent a chunk without choices"),
        };
        if read.is_empty() && has_usage {
            // usage-only chunk: withheld; the billed one goes out at the end if asked (with the
            // stream's own id, not this chunk's)
            return;
        }
        self.remember_meta(&members);
        let n_read = read.len();
        let mut progressed = false;
        let mut rebuilt = read.iter().any(|c| c.rebuilt);
        let mut kept: SmallVec<[Cow<'_, str>; 1]> = SmallVec::new();
        let mut text = SmallVec::new();
        let mut stripped = false;
        for mut c in read {
            let Some(ctx) = self.ctx.as_mut() else {
                return;
            };
            // a choice the caller did not ask for is neither delivered nor billed
            if !ctx.is_requested_choice(c.index) {
                continue;
            }
            if let Some(capture) = ctx.audit.as_mut() {
                capture.push_logprobs(c.index, c.logprobs.as_ref());
            }
            if !ctx.caller_logprobs {
                stripped |= c.strip_logprobs(self.settings.kind);
            }
            if c.index >= self.choices_begun {
                if self.settings.kind != RequestKind::Completions {
                    for lower in self.choices_begun..c.index {
                        kept.push(Cow::Owned(format!(
                            "{{\"index\":{lower},\"delta\":{{}},\"finish_reason\":null}}"
                        )));
                    }
                }
                self.choices_begun = c.index + 1;
            }
            let choice = self.choices.entry(c.index).or_default();
            // tool calls begin in order, each with its id and type, and the caller reads each
            // call's head once (`bill::tool_call_heads`)
            match tool_call_heads(
                c.index,
                &c.tool_call_heads,
                c.finish_reason.is_some() && choice.finish_reason.is_none(),
                choice,
            ) {
                Ok(edits) if edits.is_empty() => {}
                Ok(edits) => {
                    c.edit_tool_calls(&edits);
                    rebuilt = true;
                }
                Err(why) => return self.node_fault(&why),
            }
            if choice.finish_reason.is_some() && !c.generated.is_empty() {
                // generated after the choice ended: never forwarded nor billed
                return self.node_fault(&format!(
                    "the node sent content for choice {} after its finish_reason",
                    c.index
                ));
            }
            // a finish is progress once per choice: a node repeating one it already sent (or
            // sending another) makes none, and is cut at the stall bound like any keep-alive
            if (c.finish_reason.is_some() && choice.finish_reason.is_none())
                || !c.generated.is_empty()
            {
                progressed = true;
            }
            if let Some(f) = c.finish_reason {
                choice.finish_reason = Some(f);
            }
            if !c.generated.is_empty() {
                text.push((c.index, c.generated));
            }
            kept.push(c.raw);
        }
        if progressed {
            if let Some(stall) = self.stall.as_mut() {
                stall.progress(self.now);
            }
        }
        if n_read > 0 && kept.is_empty() {
            return;
        }
        if !text.is_empty() {
            if let Some(ctx) = self.ctx.as_mut() {
                ctx.note_first_content();
            }
        }
        let strip = self.settings.strip_engine_fields && members.has_engine_fields();
        let dropped = rebuilt || stripped || kept.len() != n_read;
        let renamed = members
            .get("model")
            .is_some_and(|m| m.get() != self.model_json);
        let rewrite = strip || has_usage || dropped || renamed || !ev.is_data_only();
        let bytes = if !rewrite {
            ev.raw().clone()
        } else if !strip && !has_usage && !dropped && !renamed {
            encode_event(data)
        } else {
            let json = members.encode(self.settings.strip_engine_fields, |name| match name {
                "usage" if has_usage => Some(None),
                "choices" if dropped => Some(Some(format!("[{}]", kept.join(",")))),
                "model" if renamed => Some(Some(self.model_json.clone())),
                _ => None,
            });
            encode_event(&json)
        };
        self.queue.push_back(Out { bytes, text });
    }

    fn billed(&self, ctx: &SettleCtx, completed: bool) -> Usage {
        billed_usage(ctx, &self.choices, completed, self.claimed.as_ref()).0
    }

    /// The node's stream ended (every queued event already delivered): decide, queue the tail,
    /// settle.
    fn finish_stream(&mut self) {
        let Some(ctx) = self.ctx.as_ref() else {
            return;
        };
        // the last check of each choice's cap, on its exact count
        let tokenizer = self.tokenizer.clone();
        let mut over = None;
        for choice in self.choices.values_mut() {
            if let Some(cut) = over_limit_streamed(ctx, &*tokenizer, &mut choice.delivered, true) {
                over = Some(cut);
                break;
            }
        }
        if let Some(cut) = over {
            return self.cut(cut);
        }
        if let Some(why) = unnamed_tool_call(&self.choices) {
            return self.node_fault(&why);
        }
        // every requested choice must have come and finished (`index < n`: no other is kept)
        let completed = !self.error_seen
            && !self.choices.is_empty()
            && super::bill::missing_choice(ctx, &self.choices).is_none()
            && self.choices.values().all(|c| c.finish_reason.is_some());
        let (billed, notes) = billed_usage(ctx, &self.choices, completed, self.claimed.as_ref());
        if completed {
            if self.settings.include_usage {
                let bytes = self.usage_chunk(&billed);
                self.queue.push_back(Out {
                    bytes,
                    text: SmallVec::new(),
                });
            }
            let done = self
                .done_raw
                .take()
                .unwrap_or_else(|| Bytes::from_static(DONE_EVENT));
            self.queue.push_back(Out {
                bytes: done,
                text: SmallVec::new(),
            });
            if let Some(ctx) = self.ctx.take() {
                ctx.settle_checked(StreamOutcome::Completed, billed, self.claimed, notes);
            }
            // a long pause after the first token: the request waited in the node's queue
            if let (Some(slot), Some(stall)) = (&self.settings.slot, &self.stall) {
                slot.report_pause(stall.longest_pause());
            }
        } else {
            if !self.error_seen {
                // ended early: the node's fault
                if let Some(slot) = &self.settings.slot {
                    slot.report_node_fault();
                }
                self.queue.push_back(Out {
                    bytes: Bytes::from_static(TRUNCATED_EVENT),
                    text: SmallVec::new(),
                });
            }
            if let Some(ctx) = self.ctx.take() {
                ctx.settle(StreamOutcome::UpstreamFailed, billed, self.claimed);
            }
        }
    }

    fn on_data(&mut self, data: &[u8]) {
        let mut events = std::mem::take(&mut self.scratch);
        let res = self.parser.feed(data, &mut events);
        for ev in &events {
            self.on_event(ev);
        }
        events.clear();
        self.scratch = events;
        if let Err(e) = res {
            if !self.upstream_done {
                self.bytes_fault(&format!("the node's stream broke the limits: {e}"));
            }
        }
    }

    /// The node broke the rules (or its engine reported an error): report it for the router
    /// to score, end the caller's stream with an error event, settle `upstream_failed`. Events
    /// already queued are still delivered before the error event.
    fn node_fault(&mut self, message: &str) {
        self.fault(message, error_event(message));
    }

    /// A node fault that is a size: the stream's byte bound, an SSE line or event cap. As
    /// [`State::node_fault`], with the `server_error` event ([`bytes_bound_event`]).
    fn bytes_fault(&mut self, message: &str) {
        self.fault(message, bytes_bound_event(message));
    }

    fn fault(&mut self, message: &str, event: Bytes) {
        tracing::warn!(
            request_id = ?self.ctx.as_ref().map(|c| c.request_id.as_str()),
            reason = %message,
            "node stream failed"
        );
        if let Some(slot) = &self.settings.slot {
            slot.report_node_fault();
        }
        self.fail(event, StreamOutcome::UpstreamFailed);
    }

    /// The stream reached one of the gateway's bounds that an honest node can reach too (the
    /// total duration, the tool calls per choice): end the caller's stream with an error event
    /// (`stream_bound_reached`) and settle `cut_at_bound` — the caller pays what was delivered,
    /// the node is not penalised.
    fn bound_reached(&mut self, message: &str) {
        tracing::info!(
            request_id = ?self.ctx.as_ref().map(|c| c.request_id.as_str()),
            reason = %message,
            "stream cut at the gateway's bound"
        );
        self.fail(bound_event(message), StreamOutcome::CutAtBound);
    }

    /// The node kept its stream alive without progress for the stall bound: reported as
    /// [`NodeFault::Stalled`] (the router scores a mid-request disconnect), the caller's stream
    /// ends with the `upstream_failed` error event, settled `upstream_failed` (the delivered
    /// tokens recorded, nothing paid).
    fn stalled(&mut self) {
        let secs = self.settings.stream_stall_timeout.as_secs_f64();
        tracing::warn!(
            request_id = ?self.ctx.as_ref().map(|c| c.request_id.as_str()),
            stall_timeout_secs = secs,
            "node stream made no progress; cutting it"
        );
        if let Some(slot) = &self.settings.slot {
            slot.report(NodeFault::Stalled);
        }
        self.fail(
            error_event(&format!(
                "the node's stream made no progress (no new text) for {secs} s"
            )),
            StreamOutcome::UpstreamFailed,
        );
    }

    fn cut(&mut self, cut: Cut) {
        match cut {
            Cut::NodeFault(why) => self.node_fault(&why),
            Cut::Bound(why) => self.bound_reached(&why),
        }
    }

    /// Ends the stream with `event` and settles with `outcome` (`upstream_failed`, or
    /// `cut_at_bound`), billing the prompt plus the text delivered (paid only when `outcome`
    /// is billed).
    fn fail(&mut self, event: Bytes, outcome: StreamOutcome) {
        self.upstream_done = true;
        self.error_seen = true;
        // events queued before the failure still reach the caller first: their text counts
        // in the record (and in the bill, for a billed outcome)
        for out in self.queue.iter_mut() {
            for (index, text) in out.text.drain(..) {
                self.choices
                    .entry(index)
                    .or_default()
                    .delivered
                    .push(&*self.tokenizer, &text);
            }
        }
        if let Some(billed) = self.ctx.as_ref().map(|ctx| self.billed(ctx, false)) {
            // a caller who asked for usage and pays for this ending reads its bill in the
            // usage chunk, just before the error event
            if outcome.is_billed() && self.settings.include_usage {
                let bytes = self.usage_chunk(&billed);
                self.queue.push_back(Out {
                    bytes,
                    text: SmallVec::new(),
                });
            }
            if let Some(ctx) = self.ctx.take() {
                ctx.settle(outcome, billed, self.claimed);
            }
        }
        self.queue.push_back(Out {
            bytes: event,
            text: SmallVec::new(),
        });
    }

    /// The node's body failed (a transport error, scored by the router as a disconnect).
    fn on_upstream_error(&mut self) {
        if !self.upstream_done {
            self.fail(
                Bytes::from_static(TRUNCATED_EVENT),
                StreamOutcome::UpstreamFailed,
            );
        }
    }

    fn on_eof(&mut self) {
        let mut events = Vec::new();
        let res = self.parser.finish(&mut events);
        for ev in &events {
            self.on_event(ev);
        }
        if let Err(e) = res {
            if !self.upstream_done {
                self.bytes_fault(&format!("the node's stream broke the limits: {e}"));
            }
            return;
        }
        self.upstream_done = true;
    }

    /// The next frame for the caller: the bytes of `out`, after counting its text into its
    /// choices; a choice pushed past its cap is not delivered (the node's fault instead).
    fn deliver(&mut self, out: Out) -> Bytes {
        self.reset_keepalive(self.now);
        if out.text.is_empty() {
            return out.bytes;
        }
        let mut over = None;
        if let Some(ctx) = self.ctx.as_mut() {
            for (index, text) in &out.text {
                let choice = self.choices.entry(*index).or_default();
                choice.delivered.push(&*self.tokenizer, text);
                choice.pinned.push(&ctx.sampling_constraint, text);
                if let Some(capture) = ctx.audit.as_mut() {
                    capture.push(*index, text);
                }
                if over.is_none() {
                    over = over_limit_streamed(ctx, &*self.tokenizer, &mut choice.delivered, false);
                }
            }
        }
        match over {
            None => out.bytes,
            // an honest node's text up to the bound: `out` is delivered (and billed), then
            // the error event ends the stream
            Some(Cut::Bound(why)) => {
                self.queue.clear();
                self.bound_reached(&why);
                out.bytes
            }
            Some(Cut::NodeFault(why)) => {
                self.queue.clear();
                self.node_fault(&why);
                self.queue
                    .pop_front()
                    .map_or_else(|| Bytes::from_static(TRUNCATED_EVENT), |o| o.bytes)
            }
        }
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
        // one reading of the clock per poll serves the keepalive's restart and the stall
        // clock's resume and progress (an earlier reading only makes the stall bound stricter)
        state.now = tokio::time::Instant::now();
        if let Some(stall) = state.stall.as_mut() {
            stall.resumed(state.now);
        }
        loop {
            if let Some(out) = state.queue.pop_front() {
                let bytes = state.deliver(out);
                if let Some(stall) = state.stall.as_mut() {
                    // a fresh reading: this poll's work on the node's bytes is the node's time,
                    // not the caller's (with the poll's start, a node that keeps the gateway
                    // busy had its time credited as the caller's and was never cut)
                    stall.handed_out(tokio::time::Instant::now());
                }
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            if state.ctx.is_none() {
                return Poll::Ready(None);
            }
            if state.upstream_done {
                state.finish_stream();
                continue;
            }
            if state.deadline_passed(cx) {
                let secs = state.settings.max_stream_duration.as_secs();
                state.bound_reached(&format!(
                    "the stream reached the gateway's total bound of {secs} s; what was \
                     delivered is billed"
                ));
                continue;
            }
            if state.drain_deadline_passed(cx) {
                state.bound_reached(
                    "the gateway is shutting down and its grace period for streams in flight \
                     ended; what was delivered is billed",
                );
                continue;
            }
            if state.stall.as_mut().is_some_and(|s| s.passed(cx)) {
                state.stalled();
                continue;
            }
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Pending => {
                    if state.keepalive_due(cx) {
                        if let Some(stall) = state.stall.as_mut() {
                            stall.handed_out(tokio::time::Instant::now());
                        }
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
