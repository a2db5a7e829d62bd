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

use super::{unique_value, ChoiceRead, TextMember, FINISH_REASONS};
use crate::tokenizer::GeneratedText;

/// A streamed chat choice with OpenAI's members only; any other member, a member named twice
/// or a value of another type fails to deserialize (serde's derived structs refuse both).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlainChoice<'a> {
    index: u64,
    #[serde(borrow)]
    delta: PlainDelta<'a>,
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
pub(super) fn read_plain(choice: &str, member: TextMember) -> Option<ChoiceRead> {
    if member != TextMember::Delta {
        return None;
    }
    let PlainChoice {
        index,
        delta,
        finish_reason,
        logprobs,
    } = serde_json::from_str(choice).ok()?;
    if delta.role.as_deref().is_some_and(|r| r != "assistant") {
        return None;
    }
    if finish_reason
        .as_deref()
        .is_some_and(|f| !FINISH_REASONS.contains(&f))
    {
        return None;
    }
    // a member named twice inside is the general path's error to give
    let logprobs = match logprobs {
        Some(raw) => Some(unique_value(raw.get()).ok()?),
        None => None,
    };
    let mut generated = GeneratedText::new();
    if let Some(text) = &delta.content {
        generated.push_content(text);
    }
    Some(ChoiceRead {
        index,
        indexed: true,
        generated,
        finish_reason: finish_reason.map(Cow::into_owned),
        raw: choice.to_owned(),
        rebuilt: false,
        logprobs,
        tool_call_heads: Vec::new(),
    })
}
