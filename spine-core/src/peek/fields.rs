//! The request members each endpoint accepts: an ALLOWLIST (issue 13, "the hold binds the
//! engine"). A denylist of engine aliases is never complete — every engine grows new ones —
//! so every member not listed here is refused before anything is counted, held or forwarded.
//!
//! Top level, per endpoint (OpenAI API reference, 2025-12):
//!
//! | member | chat | completions | embeddings | why |
//! |---|---|---|---|---|
//! | `model` | ✓ | ✓ | ✓ | OpenAI |
//! | `messages` | ✓ | | | OpenAI (members allowlisted too, see below) |
//! | `prompt`, `echo` (`false` only), `suffix` refused | | ✓ | | OpenAI |
//! | `input`, `dimensions`, `encoding_format` | | | ✓ | OpenAI |
//! | `stream`, `stream_options` (`include_usage`, `include_obfuscation`; vLLM's `continuous_usage_stats`) | ✓ | ✓ | | OpenAI |
//! | `n`, `max_tokens`, `stop`, `seed`, `temperature`, `top_p`, `frequency_penalty`, `presence_penalty`, `logprobs` | ✓ | ✓ | | OpenAI |
//! | `max_completion_tokens`, `top_logprobs` | ✓ | ✓ | | OpenAI (chat); llama.cpp reads them on completions too, held and checked the same |
//! | `tools`, `tool_choice`, `parallel_tool_calls`, `reasoning_effort`, `verbosity`, `metadata`, `store`, `service_tier`, `safety_identifier`, `prompt_cache_retention` | ✓ | | | OpenAI |
//! | `user` | ✓ | ✓ | ✓ | OpenAI |
//! | `prompt_cache_key` | ✓ | ✓ | | OpenAI (chat); the gateway's affinity key on both |
//! | `top_k`, `min_p`, `repetition_penalty` | ✓ | ✓ | | [`SAMPLING_EXTRAS`]: shared by llama.cpp, vLLM and SGLang; they change which token is drawn, never how many tokens or choices |
//! | [`TOKENIZATION_CONSTRAINT_FIELDS`] | ✓ | ✓ | | accepted, billed as constrained sampling |
//!
//! Documented by OpenAI but not served ([`NOT_SERVED`]; refused unless `null`, code
//! `unsupported_parameter`): `audio`, `modalities`, `prediction`, `web_search_options`, the
//! legacy `functions` / `function_call` (chat), `best_of` and `suffix` (completions). Anything
//! else — engine aliases such as llama.cpp's `n_predict` / `n_cmpl`, vLLM's `min_tokens`,
//! `chat_template_kwargs`, typos — is refused even when its value is `null`, with OpenAI's own
//! message `Unrecognized request argument supplied: <name>`.
//!
//! Inside `messages` (chat), by role (any other role is refused):
//!
//! | role | members |
//! |---|---|
//! | `system`, `developer`, `user` | `role`, `content`, `name` |
//! | `assistant` | `role`, `content`, `name`, `refusal`, `tool_calls`, `annotations`, `reasoning_content`, `reasoning`; `audio` and `function_call` only `null` |
//! | `tool` | `role`, `content`, `tool_call_id` |
//!
//! A content part: `type` (`text`), `text`. A tool: `type` (`function`), `function`
//! (`name`, `description`, `parameters`, `strict`). A tool call: `id`, `type` (`function`),
//! `function` (`name`, `arguments`).
//!
//! [`TOKENIZATION_CONSTRAINT_FIELDS`]: super::TOKENIZATION_CONSTRAINT_FIELDS

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;

use serde::de::{DeserializeSeed, Error as _, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::{RequestKind, TOKENIZATION_CONSTRAINT_FIELDS};

/// OpenAI's chat completion request members served here (the OpenAI API reference).
pub const CHAT_COMPLETIONS_MEMBERS: [&str; 29] = [
    "model",
    "messages",
    "stream",
    "stream_options",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "temperature",
    "top_p",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "verbosity",
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
];

/// OpenAI's (legacy) completion request members served here; `echo` only `false`. Also
/// `max_completion_tokens` and `top_logprobs` (OpenAI's chat members, which llama.cpp reads on
/// this endpoint too): held and range-checked exactly as on chat completions.
pub const COMPLETIONS_MEMBERS: [&str; 19] = [
    "model",
    "prompt",
    "stream",
    "stream_options",
    "n",
    "max_tokens",
    "stop",
    "seed",
    "temperature",
    "top_p",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "echo",
    "user",
    "prompt_cache_key",
    "max_completion_tokens",
    "top_logprobs",
];

/// OpenAI's embeddings request members.
pub const EMBEDDINGS_MEMBERS: [&str; 5] =
    ["model", "input", "dimensions", "encoding_format", "user"];

/// Sampling members outside OpenAI's reference that llama.cpp, vLLM and SGLang all read the
/// same way, accepted on chat and text completions: each changes which token is drawn, never
/// how many tokens or choices are generated.
pub const SAMPLING_EXTRAS: [&str; 3] = ["top_k", "min_p", "repetition_penalty"];

/// Members OpenAI documents that this gateway does not serve: refused with
/// `unsupported_parameter` unless `null`. Output it cannot meter (`audio`, `modalities`), input
/// the meter does not count (`prediction`, `suffix`, the legacy `functions`), or generation past
/// what is returned (`best_of`).
pub const NOT_SERVED: [&str; 8] = [
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "functions",
    "function_call",
    "best_of",
    "suffix",
];

/// `stream_options` members: OpenAI's, and vLLM's `continuous_usage_stats` (usage on every
/// chunk: the meter keeps the latest claim, never a sum, and sends the caller only the billed
/// usage chunk).
pub(super) const STREAM_OPTIONS_MEMBERS: [&str; 3] = [
    "include_usage",
    "include_obfuscation",
    "continuous_usage_stats",
];

/// The members of a chat message of `role` (see the module table); `None` for a role that is
/// not served.
pub(super) fn message_members(role: &str) -> Option<&'static [&'static str]> {
    const PLAIN: &[&str] = &["role", "content", "name"];
    const ASSISTANT: &[&str] = &[
        "role",
        "content",
        "name",
        "refusal",
        "tool_calls",
        "annotations",
        "reasoning_content",
        "reasoning",
        "audio",
        "function_call",
    ];
    const TOOL: &[&str] = &["role", "content", "tool_call_id"];
    match role {
        "system" | "developer" | "user" => Some(PLAIN),
        "assistant" => Some(ASSISTANT),
        "tool" => Some(TOOL),
        _ => None,
    }
}

/// Assistant message members accepted only as `null` (an SDK sends them back that way).
pub(super) const NULL_ONLY_MESSAGE_MEMBERS: [&str; 2] = ["audio", "function_call"];

/// Message members that must be strings when present (not `null`): llama.cpp reads each into
/// a string and answers 500 to anything else, so the caller gets a 400 naming the member
/// instead of a server error.
pub(super) const STRING_MESSAGE_MEMBERS: [&str; 3] = ["name", "tool_call_id", "reasoning_content"];

/// A text content part's members.
pub(super) const CONTENT_PART_MEMBERS: [&str; 2] = ["type", "text"];

/// A tool's members (`type` is `function`).
pub(super) const TOOL_MEMBERS: [&str; 2] = ["type", "function"];

/// A function tool's `function` members.
pub(super) const FUNCTION_MEMBERS: [&str; 4] = ["name", "description", "parameters", "strict"];

/// An assistant message's tool call members (`type` is `function`).
pub(super) const TOOL_CALL_MEMBERS: [&str; 3] = ["id", "type", "function"];

/// A tool call's `function` members.
pub(super) const TOOL_CALL_FUNCTION_MEMBERS: [&str; 2] = ["name", "arguments"];

/// How a top-level member is treated for an endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Member {
    /// Accepted.
    Served,
    /// Documented by OpenAI, refused unless `null`.
    NotServed,
}

/// Every name some endpoint accepts, as a `'static` name: `None` for a name no endpoint knows.
fn known(name: &str) -> Option<&'static str> {
    CHAT_COMPLETIONS_MEMBERS
        .iter()
        .chain(COMPLETIONS_MEMBERS.iter())
        .chain(EMBEDDINGS_MEMBERS.iter())
        .chain(SAMPLING_EXTRAS.iter())
        .chain(TOKENIZATION_CONSTRAINT_FIELDS.iter())
        .chain(NOT_SERVED.iter())
        .find(|n| **n == name)
        .copied()
}

/// How `name` is treated on `kind`; `None`: unrecognized there.
pub(super) fn member(kind: RequestKind, name: &str) -> Option<Member> {
    if NOT_SERVED.contains(&name) && (kind != RequestKind::Embeddings) {
        let chat_only = !matches!(name, "best_of" | "suffix");
        if chat_only == (kind == RequestKind::ChatCompletions) {
            return Some(Member::NotServed);
        }
    }
    let served = match kind {
        RequestKind::ChatCompletions => {
            CHAT_COMPLETIONS_MEMBERS.contains(&name)
                || SAMPLING_EXTRAS.contains(&name)
                || TOKENIZATION_CONSTRAINT_FIELDS.contains(&name)
        }
        RequestKind::Completions => {
            COMPLETIONS_MEMBERS.contains(&name)
                || SAMPLING_EXTRAS.contains(&name)
                || TOKENIZATION_CONSTRAINT_FIELDS.contains(&name)
        }
        RequestKind::Embeddings => EMBEDDINGS_MEMBERS.contains(&name),
    };
    served.then_some(Member::Served)
}

/// Why [`read_members`] failed.
#[derive(Debug)]
pub(super) enum MembersError {
    /// Not a JSON object.
    NotObject,
    /// A member no table knows (its name as sent, unescaped).
    Unknown(String),
    /// Malformed or a duplicate member.
    Json(String),
}

/// The top-level members of a JSON object in order, values raw and borrowed, each name one of
/// the tables' (`'static`). Stops at the first name no endpoint knows; refuses a name given
/// twice (engines and serde disagree on which duplicate wins). Names are at most as many as
/// the tables hold, so the duplicate check is bounded.
pub(super) fn read_members(json: &str) -> Result<Vec<(&'static str, &RawValue)>, MembersError> {
    read_with(json, known)
}

/// The members of a nested object (`stream_options`) against `table`, as [`read_members`].
pub(super) fn read_nested<'a>(
    json: &'a str,
    table: &'static [&'static str],
) -> Result<Vec<(&'static str, &'a RawValue)>, MembersError> {
    read_with(json, |name: &str| {
        table.iter().find(|n| **n == name).copied()
    })
}

fn read_with(
    json: &str,
    lookup: impl Fn(&str) -> Option<&'static str>,
) -> Result<Vec<(&'static str, &RawValue)>, MembersError> {
    if !json.trim_start().starts_with('{') {
        return Err(MembersError::NotObject);
    }
    let mut unknown = None;
    let mut de = serde_json::Deserializer::from_str(json);
    let seed = Seed {
        unknown: &mut unknown,
        lookup,
    };
    match seed.deserialize(&mut de) {
        Ok(members) => Ok(members),
        Err(e) => Err(match unknown {
            Some(name) => MembersError::Unknown(name),
            None => MembersError::Json(e.to_string()),
        }),
    }
}

struct Seed<'s, F> {
    unknown: &'s mut Option<String>,
    lookup: F,
}

impl<'de, F: Fn(&str) -> Option<&'static str>> DeserializeSeed<'de> for Seed<'_, F> {
    type Value = Vec<(&'static str, &'de RawValue)>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, F: Fn(&str) -> Option<&'static str>> Visitor<'de> for Seed<'_, F> {
    type Value = Vec<(&'static str, &'de RawValue)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut members: Vec<(&'static str, &'de RawValue)> = Vec::with_capacity(8);
        while let Some(JsonKey(key)) = map.next_key::<JsonKey<'de>>()? {
            let Some(name) = (self.lookup)(&key) else {
                *self.unknown = Some(key.into_owned());
                return Err(A::Error::custom("unrecognized member"));
            };
            if members.iter().any(|(k, _)| *k == name) {
                return Err(A::Error::custom(format_args!("duplicate member `{name}`")));
            }
            let value: &'de RawValue = map.next_value()?;
            members.push((name, value));
        }
        Ok(members)
    }
}

/// A JSON object's member name as serde reads it: borrowed from the input when it has no
/// escapes, owned (unescaped) otherwise, so that `"a"` and `"\u0061"` compare equal. Used by
/// every reader of untrusted JSON objects that must see each member name (allowlists,
/// duplicate refusal) without building a `serde_json::Value`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JsonKey<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for JsonKey<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = JsonKey<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a member name")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<JsonKey<'de>, E> {
                Ok(JsonKey(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<JsonKey<'de>, E> {
                Ok(JsonKey(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<JsonKey<'de>, E> {
                Ok(JsonKey(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}
