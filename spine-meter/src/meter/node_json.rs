//! Reading a node's JSON: its objects member by member (duplicates refused), its choices in the
//! endpoint's shape, its usage claim and its error objects.

use std::borrow::Cow;
use std::fmt;

use serde_json::value::RawValue;
use serde_json::Value;
use smallvec::SmallVec;
use spine_core::{JsonKey as Key, RequestKind, Usage};

use crate::tokenizer::GeneratedText;

mod plain;
mod unique;
use unique::unique_value;

/// Longest engine error message passed on to the caller, characters.
const MAX_ENGINE_MESSAGE_CHARS: usize = 512;

/// Top-level members of OpenAI's chat and text completion objects and chunks (the OpenAI API
/// reference): everything else is engine-internal and removed when
/// [`MeterConfig::strip_engine_fields`](super::MeterConfig::strip_engine_fields) is on.
const RESPONSE_MEMBERS: [&str; 10] = [
    "id",
    "object",
    "created",
    "model",
    "system_fingerprint",
    "choices",
    "usage",
    "service_tier",
    "obfuscation",
    "error",
];

pub(crate) fn usage_claim(raw: &RawValue) -> Option<Usage> {
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

pub(crate) fn is_null(raw: Option<&RawValue>) -> bool {
    raw.is_none_or(|r| r.get().trim() == "null")
}

/// A JSON object's members in order, values raw, refusing duplicate names (engines and SDKs
/// disagree on which duplicate wins, so an object with one is ambiguous).
///
/// Held inline up to [`INLINE_MEMBERS`] members (a chunk has 5–7): a stream reads one per event.
pub(crate) struct Members<'a>(SmallVec<[(Key<'a>, &'a RawValue); INLINE_MEMBERS]>);

/// Members of an object held without an allocation ([`Members`]).
const INLINE_MEMBERS: usize = 8;

impl<'de> serde::Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Members<'de>, A::Error> {
                let mut members: SmallVec<[(Key<'de>, &'de RawValue); INLINE_MEMBERS]> =
                    SmallVec::new();
                while let Some(key) = map.next_key::<Key<'de>>()? {
                    if members.iter().any(|(k, _)| k.0 == key.0) {
                        return Err(serde::de::Error::custom("duplicate member"));
                    }
                    let value: &'de RawValue = map.next_value()?;
                    members.push((key, value));
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(V)
    }
}

impl<'a> Members<'a> {
    /// The members of `data` when it is exactly one JSON object without duplicate names.
    pub(crate) fn parse(data: &'a str) -> Option<Self> {
        if !data.trim_start().starts_with('{') {
            return None;
        }
        serde_json::from_str(data).ok()
    }

    pub(crate) fn get(&self, name: &str) -> Option<&'a RawValue> {
        self.0.iter().find(|(k, _)| k.0 == name).map(|(_, v)| *v)
    }

    pub(crate) fn has_engine_fields(&self) -> bool {
        self.0
            .iter()
            .any(|(k, _)| !RESPONSE_MEMBERS.contains(&k.0.as_ref()))
    }

    /// The object re-encoded with `replace` applied: each member is kept as is, replaced
    /// (`Some(raw)`) or dropped (`None`) by name, and members outside OpenAI's shape dropped when
    /// `strip`.
    pub(crate) fn encode(
        &self,
        strip: bool,
        mut replace: impl FnMut(&str) -> Option<Option<String>>,
    ) -> String {
        let mut out = String::with_capacity(256);
        out.push('{');
        let mut first = true;
        for (k, v) in &self.0 {
            let name = k.0.as_ref();
            if strip && !RESPONSE_MEMBERS.contains(&name) {
                continue;
            }
            let value: Cow<'_, str> = match replace(name) {
                Some(None) => continue,
                Some(Some(new)) => Cow::Owned(new),
                None => Cow::Borrowed(v.get()),
            };
            if !first {
                out.push(',');
            }
            first = false;
            out.push_str(&serde_json::to_string(name).unwrap_or_else(|_| "\"\"".to_owned()));
            out.push(':');
            out.push_str(&value);
        }
        out.push('}');
        out
    }
}

/// One choice of a chunk or completion: where it goes and what it carries.
pub(crate) struct ChoiceRead<'a> {
    /// The choice's `index`; without one, its position in the array.
    pub(crate) index: u64,
    /// Whether the node gave the choice an `index` (a stream's choices must carry one: the
    /// position in a chunk says nothing about which choice it continues).
    pub(crate) indexed: bool,
    pub(crate) generated: GeneratedText,
    pub(crate) finish_reason: Option<String>,
    /// The choice as the caller gets it: rebuilt from OpenAI's members ([`openai_choice`]),
    /// or the node's bytes when nothing was dropped (borrowed: most chunks are forwarded as
    /// they came, and this is never read).
    pub(crate) raw: Cow<'a, str>,
    /// Whether `raw` differs from the node's choice (a member was dropped).
    pub(crate) rebuilt: bool,
    /// The choice's `logprobs` member, when not null.
    pub(crate) logprobs: Option<Value>,
    /// What each tool-call delta of a stream chunk's `delta` carries of its call's head, in
    /// order ([`ToolCallHead`]); the stream's state decides which is a call's first delta and
    /// how the deltas are rewritten (`bill::tool_call_heads`).
    pub(crate) tool_call_heads: Vec<ToolCallHead>,
}

impl ChoiceRead<'_> {
    /// Applies `edits` to the choice's `delta.tool_calls` and reads its generated text again
    /// from what is left (a name removed is neither delivered nor billed, one given is both).
    /// Only tool-call chunks get here (about two per call: the delta whose name is held, the
    /// one it is given in), so the choice is parsed again rather than edited in place.
    pub(crate) fn edit_tool_calls(&mut self, edits: &ToolCallEdits) {
        let Ok(mut c) = serde_json::from_str::<Value>(&self.raw) else {
            return;
        };
        let Some(choice) = c.as_object_mut() else {
            return;
        };
        let delta = choice
            .entry("delta")
            .or_insert_with(|| Value::Object(serde_json::Map::new()));
        if !delta.is_object() {
            *delta = Value::Object(serde_json::Map::new());
        }
        let held = |index: u64, name: &str| serde_json::json!({"index": index, "function": {"name": name}});
        let old = match delta.get_mut("tool_calls").map(Value::take) {
            Some(Value::Array(calls)) => calls,
            _ => Vec::new(),
        };
        let mut calls = Vec::with_capacity(old.len() + edits.inserts.len() + 1);
        for (position, mut call) in old.into_iter().enumerate() {
            for (_, index, name) in edits.inserts.iter().filter(|(p, ..)| *p == position) {
                calls.push(held(*index, name));
            }
            if let (Some(edit), Some(call)) = (
                edits.entries.iter().find(|e| e.position == position),
                call.as_object_mut(),
            ) {
                if edit.drop_head {
                    call.remove("id");
                    call.remove("type");
                }
                if edit.add_function {
                    call.insert("function".to_owned(), Value::Object(serde_json::Map::new()));
                }
                if let (true, Some(f)) = (
                    edit.add_arguments,
                    call.get_mut("function").and_then(Value::as_object_mut),
                ) {
                    f.insert("arguments".to_owned(), Value::from(""));
                }
                if let (Some(name), Some(f)) = (
                    &edit.name,
                    call.get_mut("function").and_then(Value::as_object_mut),
                ) {
                    if name.is_empty() {
                        f.remove("name");
                    } else {
                        f.insert("name".to_owned(), Value::from(name.as_str()));
                    }
                }
            }
            calls.push(call);
        }
        if let Some((index, name)) = &edits.append {
            calls.push(held(*index, name));
        }
        if !calls.is_empty() {
            delta["tool_calls"] = Value::Array(calls);
        }
        let mut generated = GeneratedText::new();
        generated.push_message_json(delta);
        self.generated = generated;
        self.raw = Cow::Owned(c.to_string());
        self.rebuilt = true;
    }

    /// Removes the choice's logprobs from what the caller receives (they were added for an
    /// audit): a chat choice loses its `logprobs` member, a completion's becomes `null`, as
    /// llama.cpp answers without them. Whether the raw choice changed.
    pub(crate) fn strip_logprobs(&mut self, kind: RequestKind) -> bool {
        if self.logprobs.is_none() {
            return false;
        }
        let Some(members) = Members::parse(&self.raw) else {
            return false;
        };
        let chat = kind != RequestKind::Completions;
        let stripped = members.encode(false, |name| match name {
            "logprobs" if chat => Some(None),
            "logprobs" => Some(Some("null".to_owned())),
            _ => None,
        });
        drop(members);
        self.raw = Cow::Owned(stripped);
        true
    }
}

/// A choice's members the caller gets (OpenAI API reference: chat completion, chat completion
/// chunk, completion), besides its text member (`text`, `delta` or `message`).
const CHOICE_MEMBERS: [&str; 3] = ["index", "finish_reason", "logprobs"];

/// A `delta` / `message` object's members the caller gets: OpenAI's, plus the reasoning text
/// engines send beside the content (counted and billed, see [`GeneratedText`]).
/// The legacy `function_call` and `audio` are dropped: text the meter does not count.
const MESSAGE_MEMBERS: [&str; 7] = [
    "role",
    "content",
    "refusal",
    "tool_calls",
    "annotations",
    "reasoning_content",
    "reasoning",
];

/// A tool call's members (`index` in a stream chunk).
const TOOL_CALL_MEMBERS: [&str; 4] = ["index", "id", "type", "function"];

/// A tool call's `function` members.
const TOOL_CALL_FUNCTION_MEMBERS: [&str; 2] = ["name", "arguments"];

/// OpenAI's `finish_reason` values (`null` mid-stream).
pub(crate) const FINISH_REASONS: [&str; 5] = [
    "stop",
    "length",
    "tool_calls",
    "content_filter",
    "function_call",
];

/// The longest tool call `id` a node may send, bytes (OpenAI's ids are about 30): an id is
/// text the caller receives and the meter does not count.
pub(crate) const MAX_TOOL_CALL_ID_BYTES: usize = 128;

/// Keeps only `allowed` members of `object`; whether one was dropped.
fn retain(object: &mut serde_json::Map<String, Value>, allowed: &[&str]) -> bool {
    let before = object.len();
    object.retain(|k, _| allowed.contains(&k.as_str()));
    object.len() != before
}

/// The choice `c` rebuilt from OpenAI's members only (engine members such as `stop_reason`,
/// `token_ids`, `prompt_logprobs`, `matched_stop`, a message's `function_call` or `audio` are
/// dropped), after checking the values the caller's SDK reads as enumerations: `finish_reason`
/// one of [`FINISH_REASONS`] or null, `role` `assistant`, a tool call's `type` `function` and
/// its `id` at most [`MAX_TOOL_CALL_ID_BYTES`]. Every tool call of a complete `message` has
/// what an SDK reads of it (an `id`, `type` `function`, a function `name`; an `index`, if any,
/// its position); a `delta`'s each have an `index`, and whether each carries a call's head is
/// pushed to `heads`. Whether a member was dropped.
///
/// # Errors
///
/// Why the choice is not OpenAI's: the node's fault.
fn openai_choice(
    c: &mut Value,
    member: TextMember,
    heads: &mut Vec<ToolCallHead>,
) -> Result<bool, &'static str> {
    let Some(choice) = c.as_object_mut() else {
        return Err("a choice is not an object");
    };
    match choice.get("finish_reason") {
        None | Some(Value::Null) => {}
        Some(Value::String(f)) if FINISH_REASONS.contains(&f.as_str()) => {}
        Some(_) => return Err("a choice's finish_reason is not one of OpenAI's"),
    }
    let mut dropped = choice
        .keys()
        .any(|k| k != member.name() && !CHOICE_MEMBERS.contains(&k.as_str()));
    if dropped {
        choice.retain(|k, _| k == member.name() || CHOICE_MEMBERS.contains(&k.as_str()));
    }
    let Some(part) = choice.get_mut(member.name()).and_then(Value::as_object_mut) else {
        return Ok(dropped);
    };
    match part.get("role") {
        None | Some(Value::Null) => {}
        Some(r) if r == "assistant" => {}
        Some(_) => return Err("a choice's role is not assistant"),
    }
    dropped |= retain(part, &MESSAGE_MEMBERS);
    // OpenAI's annotations are its web search's citations, which no engine here serves: text
    // in them would reach the caller uncounted, so only an empty list passes
    if part
        .get("annotations")
        .is_some_and(|a| !a.is_null() && a.as_array().is_none_or(|a| !a.is_empty()))
    {
        part.remove("annotations");
        dropped = true;
    }
    let Some(calls) = part.get_mut("tool_calls").and_then(Value::as_array_mut) else {
        return Ok(dropped);
    };
    for (position, call) in calls.iter_mut().enumerate() {
        let Some(call) = call.as_object_mut() else {
            return Err("a tool call is not an object");
        };
        let begins = call.get("type").is_some_and(|t| t == "function")
            && call
                .get("id")
                .and_then(Value::as_str)
                .is_some_and(|id| !id.is_empty());
        let named = call
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .is_some_and(|name| !name.is_empty());
        let index = call.get("index").and_then(Value::as_u64);
        match member {
            TextMember::Message if !(begins && named) => {
                return Err("a tool call lacks its id, type function or function name")
            }
            TextMember::Message if index.is_some_and(|i| i != position as u64) => {
                return Err("a message's tool call indexes are not 0, 1, 2, …")
            }
            TextMember::Delta => match index {
                Some(index) => {
                    let function = call.get("function").filter(|f| f.is_object());
                    heads.push(ToolCallHead {
                        index,
                        position,
                        begins,
                        has_id: call.contains_key("id"),
                        has_type: call.contains_key("type"),
                        has_function: function.is_some(),
                        name: named.then(|| {
                            function
                                .and_then(|f| f.get("name"))
                                .and_then(Value::as_str)
                                .unwrap_or_default()
                                .to_owned()
                        }),
                        has_arguments: function
                            .and_then(|f| f.get("arguments"))
                            .and_then(Value::as_str)
                            .is_some_and(|a| !a.is_empty()),
                        arguments_member: function
                            .and_then(|f| f.get("arguments"))
                            .is_some_and(Value::is_string),
                    });
                }
                None => return Err("a streamed tool call has no index"),
            },
            _ => {}
        }
        match call.get("type") {
            None | Some(Value::Null) => {}
            Some(t) if t == "function" => {}
            Some(_) => return Err("a tool call's type is not function"),
        }
        match call.get("id") {
            None | Some(Value::Null) => {}
            Some(Value::String(id)) if id.len() <= MAX_TOOL_CALL_ID_BYTES => {}
            Some(Value::String(_)) => return Err("a tool call's id is over 128 bytes"),
            Some(_) => return Err("a tool call's id is not a string"),
        }
        dropped |= retain(call, &TOOL_CALL_MEMBERS);
        match call.get_mut("function") {
            None | Some(Value::Null) => {}
            Some(Value::Object(function)) => {
                // text the SDK reads as a string: another type is text it cannot read, and
                // is not counted either (an object `arguments` was delivered unbilled)
                if ["name", "arguments"].iter().any(|k| {
                    function
                        .get(*k)
                        .is_some_and(|v| !v.is_null() && !v.is_string())
                }) {
                    return Err("a tool call's function name or arguments is not a string");
                }
                dropped |= retain(function, &TOOL_CALL_FUNCTION_MEMBERS);
            }
            Some(_) => return Err("a tool call's function is not an object"),
        }
        if call
            .get("index")
            .is_some_and(|i| !i.is_null() && !i.is_u64())
        {
            return Err("a tool call's index is not an integer");
        }
    }
    Ok(dropped)
}

/// What a streamed tool-call delta carries of its call's head ([`ChoiceRead::tool_call_heads`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ToolCallHead {
    /// The call's `index`.
    pub(crate) index: u64,
    /// The delta's position in the chunk's `tool_calls` array.
    pub(crate) position: usize,
    /// An `id` and `type` `function`.
    pub(crate) begins: bool,
    /// An `id` member (any value).
    pub(crate) has_id: bool,
    /// A `type` member (any value).
    pub(crate) has_type: bool,
    /// A `function` object.
    pub(crate) has_function: bool,
    /// The function `name`, when a non-empty one.
    pub(crate) name: Option<String>,
    /// Non-empty function `arguments` text.
    pub(crate) has_arguments: bool,
    /// A function `arguments` string (empty or not).
    pub(crate) arguments_member: bool,
}

/// How the gateway rewrites one chunk's streamed tool-call deltas of a choice before the caller
/// gets them ([`ChoiceRead::edit_tool_calls`]), so that the official SDKs read each call the
/// same way (see `bill::tool_call_heads`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ToolCallEdits {
    /// Changes to the deltas in the chunk.
    pub(crate) entries: Vec<ToolCallEdit>,
    /// `(position, index, name)`: a delta `{"index": index, "function": {"name": name}}` to
    /// insert before the delta at `position` (a call's held name, given before the next call).
    pub(crate) inserts: Vec<(usize, u64, String)>,
    /// `(index, name)`: the same, after the chunk's deltas (the choice finishes).
    pub(crate) append: Option<(u64, String)>,
}

impl ToolCallEdits {
    /// Whether nothing is to change.
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.inserts.is_empty() && self.append.is_none()
    }
}

/// The changes to one delta ([`ToolCallEdits`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ToolCallEdit {
    /// The delta's position in the chunk's `tool_calls` array.
    pub(crate) position: usize,
    /// Remove the delta's `id` and `type` (the call's first delta gave them).
    pub(crate) drop_head: bool,
    /// Replace the delta's function `name` with this text (empty: remove it).
    pub(crate) name: Option<String>,
    /// Give the delta a `function` object (the Python SDK asserts one in every delta).
    pub(crate) add_function: bool,
    /// Give the delta's function an empty `arguments` (a call's first delta: the Python SDK
    /// keeps `None` for a call whose deltas never carry one, the Node SDK `""`).
    pub(crate) add_arguments: bool,
}

/// The member of a choice that carries its text, as the caller's SDK reads it: a completion's
/// `text`; a chat stream chunk's `delta`; a complete chat answer's `message`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TextMember {
    Text,
    Delta,
    Message,
}

impl TextMember {
    /// The member for `kind`, in a stream chunk (`chunk`) or a complete answer.
    pub(crate) fn of(kind: RequestKind, chunk: bool) -> Self {
        match (kind, chunk) {
            (RequestKind::Completions, _) => Self::Text,
            (_, true) => Self::Delta,
            (_, false) => Self::Message,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Text => "text",
            Self::Delta => "delta",
            Self::Message => "message",
        }
    }

    /// Why a choice that carries `other` (set, not null) is refused.
    fn misplaced(self, other: Self) -> &'static str {
        match (self, other) {
            (Self::Text, _) => "a completion's choice carries a chat delta or message",
            (_, Self::Text) => "a chat choice carries a completion's text",
            (Self::Delta, _) => "a stream chunk's choice carries a complete message",
            (Self::Message, _) => "a complete answer's choice carries a stream delta",
        }
    }
}

/// A chunk's or completion's choices ([`read_choices`]): a stream's chunk carries one, held
/// without an allocation.
pub(crate) type ChoicesRead<'a> = SmallVec<[ChoiceRead<'a>; 1]>;

/// The choices of a chunk or completion, each rebuilt from OpenAI's members
/// ([`openai_choice`]); `Err` when `choices` is not an array of objects, an `index` is not a
/// non-negative integer, a choice is not OpenAI's (`finish_reason`, `role`, a tool call's
/// `type` or `id`), or a choice carries text in a member other than
/// `member` ([`TextMember::of`]: a completion's `text`, a chat chunk's `delta`, a complete chat
/// answer's `message`). Only `member` is read: text in a member the caller's SDK does not read
/// is text the caller never sees, so a choice with it is the node's fault, never billed.
pub(crate) fn read_choices<'a>(
    raw: &'a RawValue,
    member: TextMember,
) -> Result<ChoicesRead<'a>, &'static str> {
    // a stream's chunk: one plain choice, read in one pass
    if let Some(one) = plain::read_one_plain(raw.get(), member) {
        return Ok(smallvec::smallvec![one]);
    }
    let items: Vec<&'a RawValue> =
        serde_json::from_str(raw.get()).map_err(|_| "its choices are not an array")?;
    // one choice that is not plain (the one-pass reading above said so: a reasoning or tool
    // call delta) is read the general way at once
    let alone = items.len() == 1;
    let read: ChoicesRead<'a> = items
        .into_iter()
        .enumerate()
        .map(|(pos, item)| match alone {
            true => read_choice(pos, item, member),
            false => plain::read_plain(item.get(), member)
                .map_or_else(|| read_choice(pos, item, member), Ok),
        })
        .collect::<Result<_, _>>()?;
    // one index twice in one array: an SDK reads `choices[i]` for choice `i` (or the first
    // choice of a chunk), so the other one's text is text the caller never sees
    // (a chunk carries one choice: nothing to compare, nothing allocated on the hot path)
    if read.len() > 1 {
        let mut indexes: Vec<u64> = read.iter().map(|c| c.index).collect();
        indexes.sort_unstable();
        if indexes.windows(2).any(|w| w[0] == w[1]) {
            return Err("two choices carry the same index");
        }
    }
    Ok(read)
}

/// One choice of `choices` at position `pos`, read the general way (every form and every
/// error; [`read_choices`] tries the plain streamed form first, `plain::read_plain`).
fn read_choice<'a>(
    pos: usize,
    item: &'a RawValue,
    member: TextMember,
) -> Result<ChoiceRead<'a>, &'static str> {
    let mut c = unique_value(item.get())?;
    if !c.is_object() {
        return Err("a choice is not an object");
    }
    let present = |k: &str| c.get(k).is_some_and(|v| !v.is_null());
    for other in [TextMember::Text, TextMember::Delta, TextMember::Message] {
        if other != member && present(other.name()) {
            return Err(member.misplaced(other));
        }
    }
    check_text_types(&c)?;
    let indexed = c.get("index").is_some_and(|v| !v.is_null());
    let index = match c.get("index") {
        None | Some(Value::Null) => pos as u64,
        Some(v) => v.as_u64().ok_or_else(|| index_error(v))?,
    };
    // reasoning in both members must be the same text (vLLM sent both while it moved
    // from one to the other): otherwise one of them is text the caller's client does
    // not show, counted or not
    for part in ["delta", "message"] {
        let reasoning = |k: &str| c.get(part).and_then(|p| p.get(k)).and_then(Value::as_str);
        if let (Some(a), Some(b)) = (reasoning("reasoning_content"), reasoning("reasoning")) {
            if a != b {
                return Err("a choice carries two different reasoning texts");
            }
        }
    }
    let mut generated = GeneratedText::new();
    match (member, c.get(member.name())) {
        (TextMember::Text, Some(Value::String(t))) => generated.push_content(t),
        (TextMember::Delta | TextMember::Message, Some(part)) if part.is_object() => {
            generated.push_message_json(part);
        }
        _ => {}
    }
    let finish_reason = c
        .get("finish_reason")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let logprobs = c.get("logprobs").filter(|l| !l.is_null()).cloned();
    if let Some(l) = &logprobs {
        check_logprobs_nesting(l)?;
    }
    if !indexed {
        // forwarded (a complete answer): the caller's SDK reads `index`
        c["index"] = Value::from(index);
    }
    let mut tool_call_heads = Vec::new();
    let rebuilt = openai_choice(&mut c, member, &mut tool_call_heads)? || !indexed;
    let raw = if rebuilt {
        Cow::Owned(c.to_string())
    } else {
        Cow::Borrowed(item.get())
    };
    Ok(ChoiceRead {
        index,
        indexed,
        generated,
        finish_reason,
        raw,
        rebuilt,
        logprobs,
        tool_call_heads,
    })
}

/// The deepest `logprobs` a choice may carry, in nested arrays and objects, the `logprobs`
/// value itself counted: OpenAI's chat form is 6 deep (`logprobs.content[].top_logprobs[]
/// .bytes[]`), the completions form 3. Deeper would be relayed to a caller who asked for
/// logprobs as a chunk that a JSON reader with a nesting limit refuses (serde_json's is 128,
/// so async-openai's: the chunk, `choices` and the choice leave 125), after it was billed.
const MAX_LOGPROBS_NESTING: usize = 8;

/// [`MAX_LOGPROBS_NESTING`] checked.
fn check_logprobs_nesting(logprobs: &Value) -> Result<(), &'static str> {
    /// Arrays and objects nested in `v`, `v` included (a scalar is 0).
    fn nesting(v: &Value) -> usize {
        match v {
            Value::Array(a) => 1 + a.iter().map(nesting).max().unwrap_or(0),
            Value::Object(o) => 1 + o.values().map(nesting).max().unwrap_or(0),
            _ => 0,
        }
    }
    if nesting(logprobs) > MAX_LOGPROBS_NESTING {
        return Err("a choice's logprobs nest deeper than OpenAI's");
    }
    Ok(())
}

/// Why `v`, a choice's `index` that is not a `u64`, is refused: an integer out of range
/// (negative, or past `u64`, or written as `1099511627776.0`), or not an integer at all.
fn index_error(v: &Value) -> &'static str {
    let integral = v.is_i64() || v.as_f64().is_some_and(|f| f.fract() == 0.0);
    if integral {
        "a choice's index is out of range"
    } else {
        "a choice's index is not an integer"
    }
}

/// Whether every member that carries generated text has its type in OpenAI's shape: `text`,
/// and a `delta` / `message` object's `content`, `refusal`, `reasoning_content`, `reasoning`,
/// strings (or null); `tool_calls` an array (or null). Anything else (content as an array of
/// parts, a number) would reach the caller as text that is never counted.
fn check_text_types(choice: &Value) -> Result<(), &'static str> {
    let string_or_null = |v: Option<&Value>| v.is_none_or(|v| v.is_null() || v.is_string());
    if !string_or_null(choice.get("text")) {
        return Err("a choice's text is not a string");
    }
    for part in ["delta", "message"] {
        let Some(p) = choice.get(part).filter(|p| !p.is_null()) else {
            continue;
        };
        if !p.is_object() {
            return Err("a choice's delta or message is not an object");
        }
        for field in ["content", "refusal", "reasoning_content", "reasoning"] {
            if !string_or_null(p.get(field)) {
                return Err("a choice's content is not a string");
            }
        }
        if !p
            .get("tool_calls")
            .is_none_or(|t| t.is_null() || t.is_array())
        {
            return Err("a choice's tool_calls is not an array");
        }
    }
    Ok(())
}

/// The message of an engine's error object: `error.message`, a string `error`, or a top-level
/// `message` (vLLM, SGLang: `{"object":"error","message":…}`), shortened.
pub(crate) fn engine_error_message(members: &Members<'_>) -> String {
    let text = |raw: Option<&RawValue>| -> Option<String> {
        serde_json::from_str::<Value>(raw?.get())
            .ok()
            .and_then(|v| match v {
                Value::String(s) => Some(s),
                Value::Object(o) => o.get("message").and_then(Value::as_str).map(str::to_owned),
                _ => None,
            })
    };
    let message = text(members.get("error"))
        .or_else(|| text(members.get("message")))
        .unwrap_or_else(|| "no message".to_owned());
    let short: String = message.chars().take(MAX_ENGINE_MESSAGE_CHARS).collect();
    format!("the node's engine reported an error: {short}")
}

/// Whether a parsed object is an engine's error rather than a completion or chunk.
pub(crate) fn is_engine_error(members: &Members<'_>) -> bool {
    !is_null(members.get("error"))
        || members
            .get("object")
            .is_some_and(|o| o.get() == "\"error\"")
}

#[cfg(test)]
mod tests;
