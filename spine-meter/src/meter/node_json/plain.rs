//! The common streamed choice read without a JSON tree: `{"index": N, "delta": {"content":
//! "…"}, "finish_reason": null, "logprobs": …}` and the forms llama.cpp, vLLM and SGLang send
//! of it.
//!
//! Why: a stream's chunk is read once per token; reading its choice as a [`Value`](serde_json::Value)
//! (an ordered map per object, every key and string copied) was the meter's largest cost per
//! event (issue 17, `docs/benchmarks.md`). This reads the same choice into a struct of borrowed
//! strings, and gives up (`None`) on anything else: the caller then reads it the general way,
//! which decides every other case and every error. So this path only ever answers what the
//! general path would answer for the same bytes (tested: `plain_reads_as_the_general_path`).

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::{check_logprobs_nesting, unique_value, ChoiceRead, TextMember, FINISH_REASONS};
use crate::tokenizer::GeneratedText;

/// A streamed chat choice with OpenAI's members only; any other member, a member named twice
/// or a value of another type fails to deserialize (serde's derived structs refuse both).
///
/// A derived struct also reads a JSON **array**, field by field (`[0, {"content": "hi"}]`),
/// which the general path refuses and a caller's SDK cannot read: so the choice and its `delta`
/// are taken only when they are objects ([`is_object`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlainChoice<'a> {
    index: u64,
    /// A [`PlainDelta`] once checked to be an object.
    #[serde(borrow)]
    delta: &'a RawValue,
    #[serde(borrow, default)]
    finish_reason: Option<Cow<'a, str>>,
    /// Read as the general path reads the whole choice ([`unique_value`]) when not null: the
    /// audit asks nodes for them, so an audited model's every chunk carries them.
    #[serde(borrow, default)]
    logprobs: Option<&'a RawValue>,
}

/// A `delta` with a role and content only.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlainDelta<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
}

/// `choice` (one element of a chunk's `choices`, valid JSON) read as the general path would,
/// when it has the plain streamed form; `None` for any other choice or member.
pub(super) fn read_plain(choice: &str, member: TextMember) -> Option<ChoiceRead<'_>> {
    if member != TextMember::Delta || !is_object(choice) {
        return None;
    }
    plain_choice(serde_json::from_str(choice).ok()?, choice)
}

/// `choices` (a member's value, valid JSON) read as the general path would, when it is an
/// array of exactly one choice in the plain streamed form (a stream's every chunk): the array
/// and its choice are read in one pass, where [`read_plain`] after the general path's split of
/// the array reads the choice's bytes twice more. `None` for anything else.
pub(super) fn read_one_plain(choices: &str, member: TextMember) -> Option<ChoiceRead<'_>> {
    // the one choice's own bytes: the array's, less its brackets and JSON's whitespace (what
    // the general path's split of the array gives), once the array is known to hold one value
    let choice = choices
        .trim_matches(JSON_WHITESPACE)
        .strip_prefix('[')?
        .strip_suffix(']')?
        .trim_matches(JSON_WHITESPACE);
    if member != TextMember::Delta || !is_object(choice) {
        return None;
    }
    let OneChoice(parsed) = serde_json::from_str(choices).ok()?;
    plain_choice(parsed, choice)
}

/// JSON's insignificant whitespace (RFC 8259 §2).
const JSON_WHITESPACE: [char; 4] = [' ', '\t', '\n', '\r'];

/// A JSON array of exactly one [`PlainChoice`] (an array of any other length fails).
struct OneChoice<'a>(PlainChoice<'a>);

impl<'de: 'a, 'a> Deserialize<'de> for OneChoice<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = OneChoice<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array of one choice")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<OneChoice<'de>, A::Error> {
                let Some(choice) = seq.next_element()? else {
                    return Err(serde::de::Error::invalid_length(0, &self));
                };
                if seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    return Err(serde::de::Error::invalid_length(2, &self));
                }
                Ok(OneChoice(choice))
            }
        }
        d.deserialize_seq(V)
    }
}

/// The plain choice `parsed` from the bytes `choice` (an object), checked as the general path
/// checks it; `None` when it is not plain after all.
fn plain_choice<'a>(parsed: PlainChoice<'a>, choice: &'a str) -> Option<ChoiceRead<'a>> {
    let PlainChoice {
        index,
        delta,
        finish_reason,
        logprobs,
    } = parsed;
    if !is_object(delta.get()) {
        return None;
    }
    let delta: PlainDelta<'_> = serde_json::from_str(delta.get()).ok()?;
    if delta.role.as_deref().is_some_and(|r| r != "assistant") {
        return None;
    }
    if finish_reason
        .as_deref()
        .is_some_and(|f| !FINISH_REASONS.contains(&f))
    {
        return None;
    }
    // a member named twice inside is the general path's error to give; read one level down,
    // as the general path reads it inside the choice, so that the same nesting is too deep
    // (serde_json allows 127 levels in one read)
    let logprobs = match logprobs {
        Some(raw) => match unique_value(&format!("[{}]", raw.get())).ok()? {
            Value::Array(mut one) => Some(one.pop()?),
            _ => return None,
        },
        None => None,
    };
    if logprobs
        .as_ref()
        .is_some_and(|l| check_logprobs_nesting(l).is_err())
    {
        return None;
    }
    let mut generated = GeneratedText::new();
    if let Some(text) = &delta.content {
        generated.push_content(text);
    }
    Some(ChoiceRead {
        index,
        indexed: true,
        generated,
        finish_reason: finish_reason.map(Cow::into_owned),
        raw: Cow::Borrowed(choice),
        rebuilt: false,
        logprobs,
        tool_call_heads: Vec::new(),
    })
}

/// Whether `json` (one valid JSON value) is an object.
fn is_object(json: &str) -> bool {
    json.trim_start().starts_with('{')
}
