//! What a response is billed and when a choice must be cut, shared by the streamed body
//! ([`super::body`]) and the non-streamed path ([`meter_json`]); the gateway's own error events.

use std::borrow::Cow;
use std::collections::BTreeMap;

use bytes::Bytes;
use spine_core::{NodeSlot, RequestKind, StreamOutcome, Usage};

use super::constraint::{natural_most, PinnedCount, SamplingConstraint, GRAMMAR_HIDDEN_TOKENS};
use super::node_json::{
    engine_error_message, is_engine_error, read_choices, usage_claim, ChoicesRead, Members,
    TextMember, ToolCallEdit, ToolCallEdits, ToolCallHead,
};
use super::settle::{BillNotes, SettleCtx};
use super::MeterError;
use crate::tokenizer::GeneratedCount;
use crate::TokenCounter;

/// Most tool calls one streamed choice may carry. An honest engine can be asked for more, so
/// the cut is the gateway's bound, not the node's fault: the stream ends `cut_at_bound`, the
/// caller pays what was delivered and the node is not penalised. A non-streamed body is
/// already whole when it is metered and is delivered whatever its number of tool calls.
pub const MAX_TOOL_CALLS_PER_CHOICE: usize = 128;

#[derive(Debug, Default)]
pub(super) struct Choice {
    pub(super) delivered: GeneratedCount,
    pub(super) finish_reason: Option<String>,
    /// The pinned texts' occurrences in `delivered` ([`SamplingConstraint::Pinned`]).
    pub(super) pinned: PinnedCount,
    /// Each tool call begun in the stream so far (read, delivered or not): the next new call
    /// must have index `tool_calls.len()`, and every call a name by the end.
    pub(super) tool_calls: Vec<CallHead>,
}

/// A streamed tool call's name as the node gave it so far, and whether the caller has it
/// ([`tool_call_heads`]).
#[derive(Debug, Default)]
pub(super) struct CallHead {
    /// The node's latest non-empty name for the call.
    name: String,
    /// Whether `name` went to the caller (once; never again).
    given: bool,
    /// Whether the call's arguments have begun.
    arguments: bool,
    /// Whether they began before any name (a name read after them may still grow: it waits
    /// for the call's end).
    arguments_first: bool,
}

pub(super) fn usage_json(u: &Usage) -> String {
    format!(
        "{{\"prompt_tokens\":{},\"completion_tokens\":{},\"total_tokens\":{}}}",
        u.prompt_tokens,
        u.completion_tokens,
        u.total_tokens()
    )
}

pub(super) fn encode_event(data: &str) -> Bytes {
    let mut out = Vec::with_capacity(data.len() + 8);
    for line in data.split('\n') {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line.as_bytes());
        out.push(b'\n');
    }
    out.push(b'\n');
    Bytes::from(out)
}

/// The gateway's error event in OpenAI's shape: a node's failure (`upstream_error`,
/// `upstream_failed`).
pub(super) fn error_event(message: &str) -> Bytes {
    openai_error_event(message, "upstream_error", "upstream_failed")
}

/// The error event of a stream cut at its byte bound or its SSE line / event cap (the node's
/// fault): OpenAI's `server_error` type, code `upstream_failed`.
pub(super) fn bytes_bound_event(message: &str) -> Bytes {
    openai_error_event(message, "server_error", "upstream_failed")
}

/// The error event that ends a stream cut at one of the gateway's own bounds.
pub(super) fn bound_event(message: &str) -> Bytes {
    openai_error_event(message, "invalid_request_error", "stream_bound_reached")
}

pub(super) fn openai_error_event(message: &str, kind: &str, code: &str) -> Bytes {
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": code}
    });
    encode_event(&body.to_string())
}

/// Why a choice must be cut: the node broke the rules, or the stream reached one of the
/// gateway's bounds that an honest node can reach too.
pub(super) enum Cut {
    NodeFault(String),
    Bound(String),
}

/// The usage billed for `choices` (requested choices only): the prompt plus each choice's
/// capped completion tokens, with the EOS and `length` rules only when `completed`.
///
/// **Constrained sampling** ([`SettleCtx::sampling_constraint`]): the engine may have
/// generated the text as more tokens than its canonical tokenization, so the count above is
/// only a lower bound. The most tokens a choice's text can have been:
///
/// - a `logit_bias` on normal tokens whose texts are known, no grammar
///   ([`SamplingConstraint::Pinned`]): [`natural_most`]`(count)` plus, for each occurrence of a
///   biased token's text the choice delivered, its bytes + 3 ([`PinnedCount::allowance`]), at
///   most the byte bound below;
/// - a grammar on the text ([`SamplingConstraint::Text`]: a text the grammar pins is spelled
///   in pieces the model would never choose, and JSON's structure is spelled in more tokens
///   than its canonical count even when nothing is pinned) and token-level constraints the meter
///   cannot read ([`SamplingConstraint::Tokens`]: a caller that bans every multi-character
///   token gets a text spelled one character per token): one per byte, plus the EOS and a
///   held-back UTF-8 tail; a completed answer under a grammar also [`GRAMMAR_HIDDEN_TOKENS`]
///   (what llama.cpp's response-format parser takes out around the JSON);
///
/// **Stop strings** ([`SettleCtx::stop_hidden_bytes`], `S` bytes for the longest): a choice
/// that completed with `stop` or `length` may also have generated a matched (or held-back
/// partial) stop string the caller never gets: `most` gains `S + 1`.
///
/// each within the cap: `U = min(cap, max(count, most))`. A completed answer then bills the
/// node's claim (`claimed`, the engine's own usage) clamped to `[Σ count, Σ U]`. An answer that
/// ended early (the caller left; no claim ever comes) bills `Σ U` under either constraint (the
/// most the delivered text can be).
///
pub(super) fn billed_usage(
    ctx: &SettleCtx,
    choices: &BTreeMap<u64, Choice>,
    completed: bool,
    claimed: Option<&Usage>,
) -> (Usage, BillNotes) {
    let mut notes = BillNotes::default();
    let mut completion_tokens = 0u64;
    let mut most_tokens = 0u64;
    for (i, (&index, c)) in choices.iter().enumerate() {
        let count =
            ctx.choice_completion_counted(&c.delivered, c.finish_reason.as_deref(), completed);
        completion_tokens = completion_tokens.saturating_add(count.tokens);
        let by_bytes = c
            .delivered
            .len_bytes()
            .saturating_add(crate::tokenizer::MAX_HELD_BACK_BYTES + 1);
        let most = match &ctx.sampling_constraint {
            SamplingConstraint::None => count.tokens,
            SamplingConstraint::Pinned(_) => natural_most(count.tokens)
                .saturating_add(c.pinned.allowance(&ctx.sampling_constraint))
                .min(by_bytes),
            SamplingConstraint::Text if completed => by_bytes.saturating_add(GRAMMAR_HIDDEN_TOKENS),
            SamplingConstraint::Text => by_bytes,
            SamplingConstraint::Tokens => by_bytes,
        }
        // a matched stop string (or a partial match held back at `length`): generated, counted
        // by the engine, never delivered; one more for a token across its start
        .saturating_add(match c.finish_reason.as_deref() {
            Some("stop" | "length") if completed && ctx.stop_hidden_bytes > 0 => {
                ctx.stop_hidden_bytes.saturating_add(1)
            }
            _ => 0,
        })
        .min(ctx.max_completion_tokens_per_choice);
        most_tokens = most_tokens.saturating_add(count.tokens.max(most));
        if i == 0 && choices.len() > 1 {
            notes.first_choice_completion_tokens = Some(count.tokens);
        }
        if let (Some(each), Some(claim)) = (&ctx.prompt_tokens_each, claimed) {
            let prompt = usize::try_from(index / u64::from(ctx.n_per_prompt.max(1)))
                .ok()
                .and_then(|p| each.get(p).copied());
            if let Some(prompt) = prompt {
                let off = |(p, c): (u64, u64)| {
                    p.abs_diff(claim.prompt_tokens)
                        .saturating_add(c.abs_diff(claim.completion_tokens))
                };
                let task = (prompt, count.tokens);
                if notes.nearest_task.is_none_or(|t| off(task) < off(t)) {
                    notes.nearest_task = Some(task);
                }
            }
        }
        notes.length_unsupported |= count.length_unsupported;
        if completed && c.finish_reason.as_deref() == Some("length") && !count.length_unsupported {
            notes.length_claim_allowance_tokens =
                notes.length_claim_allowance_tokens.saturating_add(
                    ctx.max_completion_tokens_per_choice
                        .saturating_sub(count.tokens),
                );
        }
        notes.wrapper_allowance_tokens = notes
            .wrapper_allowance_tokens
            .saturating_add(c.delivered.wrapper_allowance_tokens());
    }
    if ctx.sampling_constraint.is_constrained() || ctx.stop_hidden_bytes > 0 {
        completion_tokens = match (completed, claimed) {
            (true, Some(claim)) => claim
                .completion_tokens
                .clamp(completion_tokens, most_tokens.max(completion_tokens)),
            (true, None) => completion_tokens,
            (false, _) if ctx.sampling_constraint.is_constrained() => most_tokens,
            (false, _) => completion_tokens,
        };
    }
    let usage = Usage {
        prompt_tokens: ctx.prompt_tokens,
        completion_tokens,
    };
    (usage, notes)
}

/// Why an answer whose requested choices are `choices` lacks one the caller asked for, if it
/// does: `completed` needs every requested choice (`index < n`) to finish, and a node that
/// answers fewer than `n` is at fault.
pub(super) fn missing_choice(ctx: &SettleCtx, choices: &BTreeMap<u64, Choice>) -> Option<String> {
    let asked = u64::from(ctx.n);
    let missing = (0..asked).find(|i| !choices.contains_key(i))?;
    Some(format!(
        "the node answered {} of the {asked} choices asked for (choice {missing} is missing)",
        choices.len()
    ))
}

/// Why a streamed choice that delivered `delivered` is past what it may deliver, if it is.
pub(super) fn over_limit_streamed(
    ctx: &SettleCtx,
    tokenizer: &dyn TokenCounter,
    delivered: &mut GeneratedCount,
    exact: bool,
) -> Option<Cut> {
    // the node's own fault first: a choice past its token cap is cut as such even when it also
    // carries too many tool calls
    if let Some(why) = over_limit(ctx, tokenizer, delivered, exact) {
        return Some(Cut::NodeFault(why));
    }
    (delivered.tool_call_count() > MAX_TOOL_CALLS_PER_CHOICE).then(|| {
        Cut::Bound(format!(
            "the response reached the gateway's bound of {MAX_TOOL_CALLS_PER_CHOICE} tool calls \
             in one streamed choice; what was delivered is billed"
        ))
    })
}

/// Why a choice that delivered `delivered` is past the tokens it may deliver, if it is: the
/// node's fault (the engine was told the cap). Judged on the FEWEST tokens that spell what was
/// delivered ([`TokenCounter::count_generated_text_and_fewest`]), not on its count: an engine
/// samples tokens, and an honest one can write text that counts more tokens than it generated
/// (a caller's `logit_bias` can ask for such text: it must not make an honest node look at
/// fault, nor make the answer free). The bill still follows the count, within the cap.
pub(super) fn over_limit(
    ctx: &SettleCtx,
    tokenizer: &dyn TokenCounter,
    delivered: &mut GeneratedCount,
    exact: bool,
) -> Option<String> {
    let limit = ctx.delivery_limit_tokens();
    let over = |fewest: Option<u64>, delivered: &GeneratedCount| {
        let spelled = fewest.map_or_else(String::new, |f| format!(" at least {f} tokens in"));
        format!(
            "the node sent more than the {} completion tokens a choice may have (it delivered{spelled} \
             {} bytes of text; the limit is {limit} tokens)",
            ctx.max_completion_tokens_per_choice,
            delivered.len_bytes()
        )
    };
    if delivered.len_bytes() > ctx.delivery_limit_bytes() {
        return Some(over(None, delivered));
    }
    if exact {
        let fewest = delivered.fewest(tokenizer);
        return (fewest > limit).then(|| over(Some(fewest), delivered));
    }
    if delivered.fewest_upper_bound() <= limit {
        return None;
    }
    delivered.refresh(tokenizer);
    let bound = delivered.fewest_upper_bound();
    if bound <= limit {
        return None;
    }
    // the bound may be loose (a tail not counted since it last grew): decide only when it is
    // the exact count; otherwise a later event (or the end, on the exact count) decides
    delivered
        .bound_is_exact()
        .then(|| over(Some(bound), delivered))
}

/// Meters a complete non-streamed 2xx response body and settles.
///
/// A usable completion — one JSON object without duplicate members, not an engine error, whose
/// `choices` is an array of objects with every requested choice (`index < n`), each with a
/// `finish_reason` and within its token cap — settles `completed` and comes back with
/// `usage` rewritten to the billed counts, choices past `n` removed and (when `strip`) members
/// outside OpenAI's shape removed. Anything else settles `upstream_failed` (the caller pays
/// nothing), is reported on `slot` as the node's fault, and is a
/// [`MeterError::UpstreamInvalid`].
pub(crate) fn meter_json(
    mut ctx: SettleCtx,
    body: &[u8],
    kind: RequestKind,
    strip: bool,
    slot: Option<&NodeSlot>,
) -> Result<Bytes, MeterError> {
    let fail = |ctx: SettleCtx, billed: Usage, claimed: Option<Usage>, why: String| {
        tracing::warn!(request_id = %ctx.request_id, reason = %why, "invalid node response");
        if let Some(slot) = slot {
            slot.report_node_fault();
        }
        ctx.settle(StreamOutcome::UpstreamFailed, billed, claimed);
        Err(MeterError::UpstreamInvalid(why))
    };
    let nothing = Usage {
        prompt_tokens: ctx.prompt_tokens,
        completion_tokens: 0,
    };
    let Some(members) = std::str::from_utf8(body).ok().and_then(Members::parse) else {
        return fail(
            ctx,
            nothing,
            None,
            "the body is not one JSON object".to_owned(),
        );
    };
    let claimed = members.get("usage").and_then(usage_claim);
    if is_engine_error(&members) {
        let why = engine_error_message(&members);
        return fail(ctx, nothing, claimed, why);
    }
    let read = match members
        .get("choices")
        .map(|raw| read_choices(raw, TextMember::of(kind, false)))
    {
        Some(Ok(read)) => read,
        Some(Err(why)) => {
            return fail(ctx, nothing, claimed, format!("the body is invalid: {why}"))
        }
        None => ChoicesRead::new(),
    };
    let tokenizer = ctx.tokenizer.clone();
    let mut choices: BTreeMap<u64, Choice> = BTreeMap::new();
    let mut kept: Vec<Cow<'_, str>> = Vec::with_capacity(read.len());
    let dropped = read
        .iter()
        .any(|c| c.rebuilt || !ctx.is_requested_choice(c.index));
    let mut stripped = false;
    for mut c in read {
        if !ctx.is_requested_choice(c.index) {
            continue;
        }
        let choice = choices.entry(c.index).or_default();
        choice.finish_reason = c.finish_reason.take();
        choice.delivered.push(&*tokenizer, &c.generated);
        choice.pinned.push(&ctx.sampling_constraint, &c.generated);
        if let Some(capture) = ctx.audit.as_mut() {
            capture.push(c.index, &c.generated);
            capture.push_logprobs(c.index, c.logprobs.as_ref());
        }
        // the caller's answer has the log-probabilities it asked for, no others (a node's
        // unasked ones, or those asked for an audit, are text outside the bill)
        if !ctx.caller_logprobs {
            stripped |= c.strip_logprobs(kind);
        }
        kept.push(c.raw);
    }
    if choices.is_empty() {
        return fail(ctx, nothing, claimed, "the body has no choices".to_owned());
    }
    for choice in choices.values_mut() {
        if let Some(why) = over_limit(&ctx, &*tokenizer, &mut choice.delivered, true) {
            return fail(ctx, nothing, claimed, why);
        }
    }
    if let Some((index, _)) = choices.iter().find(|(_, c)| c.finish_reason.is_none()) {
        let why = format!("choice {index} has no finish_reason");
        let (billed, _) = billed_usage(&ctx, &choices, false, claimed.as_ref());
        return fail(ctx, billed, claimed, why);
    }
    if let Some(why) = missing_choice(&ctx, &choices) {
        let (billed, _) = billed_usage(&ctx, &choices, false, claimed.as_ref());
        return fail(ctx, billed, claimed, why);
    }
    let (billed, notes) = billed_usage(&ctx, &choices, true, claimed.as_ref());
    let usage = usage_json(&billed);
    // the caller's catalog model, not the node's own name for what it serves (its word, and
    // llama.cpp's may be a file path)
    let model = serde_json::to_string(ctx.model.as_str()).unwrap_or_default();
    let mut has_usage = false;
    let mut out = members.encode(strip, |name| match name {
        "usage" => {
            has_usage = true;
            Some(Some(usage.clone()))
        }
        "model" => Some(Some(model.clone())),
        "choices" if dropped || stripped => Some(Some(format!("[{}]", kept.join(",")))),
        _ => None,
    });
    if !has_usage {
        out.pop();
        if out.len() > 1 {
            out.push(',');
        }
        out.push_str("\"usage\":");
        out.push_str(&usage);
        out.push('}');
    }
    ctx.settle_checked(StreamOutcome::Completed, billed, claimed, notes);
    Ok(Bytes::from(out))
}

/// A metered whole answer ([`meter_json`]'s) as the stream a caller asked for, for a node that
/// answered a streamed request with one JSON body (the SDKs read no SSE event from it: the
/// caller would pay for an answer it never gets): one chunk per choice (a chat choice's
/// `message` as its `delta`, each tool call given its `index`; a completion's choice as is),
/// each with the answer's `id`, `created`, `model` (and `system_fingerprint`), then the billed
/// usage chunk when the caller asked for usage, then `[DONE]`.
pub(crate) fn json_as_stream(body: &[u8], kind: RequestKind, include_usage: bool) -> Bytes {
    use serde_json::{Map, Value};
    let answer: Map<String, Value> = serde_json::from_slice(body).unwrap_or_default();
    let mut head = Map::new();
    for key in ["id", "created", "model", "system_fingerprint"] {
        if let Some(v) = answer.get(key) {
            head.insert(key.to_owned(), v.clone());
        }
    }
    let object = match kind {
        RequestKind::Completions => "text_completion",
        _ => "chat.completion.chunk",
    };
    head.insert("object".to_owned(), Value::from(object));
    let chunk = |member: &str, value: Value| {
        let mut c = head.clone();
        c.insert(member.to_owned(), value);
        encode_event(&Value::Object(c).to_string())
    };
    let mut out = Vec::new();
    let choices = answer.get("choices").and_then(Value::as_array);
    for choice in choices.into_iter().flatten() {
        let mut choice = choice.clone();
        if let Some(c) = choice.as_object_mut() {
            if let Some(mut message) = c.remove("message") {
                let calls = message.get_mut("tool_calls").and_then(Value::as_array_mut);
                for (i, call) in calls.into_iter().flatten().enumerate() {
                    if let Some(call) = call.as_object_mut() {
                        call.entry("index").or_insert(Value::from(i));
                    }
                }
                c.insert("delta".to_owned(), message);
            }
        }
        out.extend_from_slice(&chunk("choices", Value::Array(vec![choice])));
    }
    if include_usage {
        if let Some(usage) = answer.get("usage") {
            let mut c = head.clone();
            c.insert("choices".to_owned(), Value::Array(Vec::new()));
            c.insert("usage".to_owned(), usage.clone());
            out.extend_from_slice(&encode_event(&Value::Object(c).to_string()));
        }
    }
    out.extend_from_slice(b"data: [DONE]\n\n");
    Bytes::from(out)
}

/// Bytes a whole stream's events may take before the node is cut as at fault:
/// [`STREAM_BYTES_FLOOR`] plus [`STREAM_BYTES_PER_TOKEN`] for each completion token the
/// request may bill (`n` × the per-choice cap, with the cap's delivery slack). Text is bounded
/// per choice already; this bounds what is not text — log-probabilities, ids, tool-call
/// wrappers, members the SDK ignores (`delta.audio` of megabytes) — relative to the cap, so a
/// node cannot send the caller gigabytes for a few billed tokens. An honest llama.cpp chunk
/// with 20 top log-probabilities is ≈ 1.5 KB a token.
pub(crate) fn stream_bytes_bound(ctx: &SettleCtx) -> u64 {
    let cap = ctx.max_completion_tokens_per_choice;
    let per_choice = cap.saturating_add(16.max(cap / 10));
    STREAM_BYTES_FLOOR.saturating_add(
        per_choice
            .saturating_mul(u64::from(ctx.n.max(1)))
            .saturating_mul(STREAM_BYTES_PER_TOKEN),
    )
}

/// See [`stream_bytes_bound`]: 1 MiB.
pub(crate) const STREAM_BYTES_FLOOR: u64 = 1 << 20;
/// See [`stream_bytes_bound`]: 8 KiB a token.
pub(crate) const STREAM_BYTES_PER_TOKEN: u64 = 8 * 1024;

/// Checks tool-call deltas `heads` of choice `index` against what `choice` has begun, and
/// says how to rewrite them so that both official SDKs read each call alike: the Python SDK
/// appends every `id` and `name` string of a call's deltas, the Node SDK keeps the last one.
///
/// - A new call must come next in order (0, 1, 2, …: an SDK indexes a list by it, and a gap
///   crashed the Python SDK's stream helper) and carry its `id` and `type` (an SDK reads them
///   from a call's first delta); a call gets no delta once the next one began (the Python
///   helper had already announced its arguments done).
/// - A later delta loses any `id` and `type` (the first gave them; a `type` null made the
///   Python helper fail), and gets a `function` object if it had none (the helper asserts one).
/// - The name reaches the caller **once, whole**. A node's later name replaces its earlier
///   one (llama.cpp's `common_chat_msg_diff::compute_diffs` re-sends the grown name whole
///   while its parser reads it). So the gateway holds a call's name until it is whole: until
///   the call's arguments begin (a JSON name is read before them), or, when they began first,
///   until the call ends (the next call begins, or `finish`); it is then given in that delta
///   (or in a delta of its own). Any name after that is removed. A name removed is neither
///   delivered nor billed; the one given is both.
///
/// `finish`: whether the choice finishes in this chunk.
///
/// # Errors
///
/// Why the deltas break the stream's order: the node's fault.
pub(super) fn tool_call_heads(
    index: u64,
    heads: &[ToolCallHead],
    finish: bool,
    choice: &mut Choice,
) -> Result<ToolCallEdits, String> {
    let mut edits = ToolCallEdits::default();
    for head in heads {
        let next = choice.tool_calls.len() as u64;
        let call = head.index;
        let mut edit = ToolCallEdit {
            position: head.position,
            add_function: !head.has_function,
            ..ToolCallEdit::default()
        };
        match call.cmp(&next) {
            std::cmp::Ordering::Less if call + 1 < next => {
                return Err(format!(
                    "the node sent tool call {call} of choice {index} after tool call {} began",
                    next - 1
                ))
            }
            std::cmp::Ordering::Less => edit.drop_head = head.has_id || head.has_type,
            std::cmp::Ordering::Equal if head.begins => {
                // the call before it ended: its name, if still held, goes first
                if let Some(last) = choice.tool_calls.last_mut() {
                    if let Some(name) = last.release() {
                        edits.inserts.push((head.position, call - 1, name));
                    }
                }
                choice.tool_calls.push(CallHead::default());
                edit.add_arguments = !head.arguments_member;
            }
            std::cmp::Ordering::Equal => {
                return Err(format!(
                    "the node began tool call {call} of choice {index} without its id and type \
                     function"
                ))
            }
            std::cmp::Ordering::Greater => {
                return Err(format!(
                    "the node sent tool call {call} of choice {index} before tool call {next}"
                ))
            }
        }
        let Some(state) = choice.tool_calls.last_mut() else {
            continue;
        };
        edit.name = state.read(head);
        if edit.drop_head || edit.add_function || edit.add_arguments || edit.name.is_some() {
            edits.entries.push(edit);
        }
    }
    if finish {
        if let Some(last) = choice.tool_calls.last_mut() {
            if let Some(name) = last.release() {
                edits.append = Some((choice.tool_calls.len() as u64 - 1, name));
            }
        }
    }
    Ok(edits)
}

impl CallHead {
    /// Reads one delta of the call: what its `name` member must become (`Some("")`: removed),
    /// `None` to leave it as it is.
    fn read(&mut self, head: &ToolCallHead) -> Option<String> {
        if head.has_arguments && !self.arguments {
            self.arguments = true;
            self.arguments_first = self.name.is_empty() && head.name.is_none();
        }
        if self.given {
            return head.name.as_ref().map(|_| String::new());
        }
        if let Some(name) = &head.name {
            self.name.clone_from(name);
        }
        if self.arguments && !self.arguments_first && !self.name.is_empty() {
            self.given = true;
            return (head.name.as_deref() != Some(self.name.as_str())).then(|| self.name.clone());
        }
        head.name.as_ref().map(|_| String::new())
    }

    /// The call ended: its name, if held, to give now.
    fn release(&mut self) -> Option<String> {
        if self.given || self.name.is_empty() {
            return None;
        }
        self.given = true;
        Some(self.name.clone())
    }
}

/// Why a stream whose `choices` ended is not a usable answer for its tool calls: a call that
/// never got a function name (an SDK shows `None`, the Responses API a nameless call).
pub(super) fn unnamed_tool_call(choices: &BTreeMap<u64, Choice>) -> Option<String> {
    choices.iter().find_map(|(index, c)| {
        let call = c.tool_calls.iter().position(|call| call.name.is_empty())?;
        Some(format!(
            "the node never named tool call {call} of choice {index}"
        ))
    })
}
