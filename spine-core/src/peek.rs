use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::ModelId;

mod fields;
mod messages;
mod tags;

pub use fields::{
    JsonKey, CHAT_COMPLETIONS_MEMBERS, COMPLETIONS_MEMBERS, EMBEDDINGS_MEMBERS, NOT_SERVED,
    SAMPLING_EXTRAS,
};
use fields::{Member, MembersError};
pub use messages::validate_chat_messages;
#[cfg(test)]
use messages::CONTENT_EXPECTED;
pub use tags::{
    check_metadata, check_output_constraint, check_stop, check_tool_count, check_tools, check_user,
    MAX_METADATA_KEY_CHARS, MAX_METADATA_PAIRS, MAX_METADATA_VALUE_CHARS,
    MAX_OUTPUT_CONSTRAINT_BYTES, MAX_STOP_BYTES, MAX_STOP_SEQUENCES, MAX_TOOLS, MAX_USER_CHARS,
};

/// The fields of an OpenAI request body the gateway needs, read without touching the rest.
///
/// Covers `/v1/chat/completions` and `/v1/completions` bodies (OpenAI API reference). Fields the
/// peek does not know are ignored here and forwarded unchanged by the caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestPeek {
    /// `model`.
    pub model: ModelId,
    /// `stream`; absent or `null` means `false`.
    pub stream: bool,
    /// `stream_options.include_usage` as the client sent it; absent means `false`.
    pub include_usage: bool,
    /// `n`, choices to generate; absent or `null` means 1.
    pub n: u32,
    /// `max_completion_tokens`, else `max_tokens`, in tokens; `None` when neither is set.
    pub max_tokens: Option<u64>,
    /// `prompt_cache_key`, the caller's conversation key for affinity.
    pub prompt_cache_key: Option<String>,
    /// The automatic conversation key for affinity (design brief §5), `None` when the body has no
    /// well-formed `messages` array. See [`conversation_key`].
    pub conversation_key: Option<u64>,
    /// Whether the request constrains sampling in a way that can make the engine generate
    /// its text as more tokens than the text's canonical tokenization: one of
    /// [`TOKENIZATION_CONSTRAINT_FIELDS`] is set (`logit_bias` non-empty, `response_format` of
    /// a type other than `text`). The independent count of the delivered text is then only a
    /// lower bound on what was generated (a caller can ban every multi-character token and
    /// make the engine spell the text one character per token).
    pub tokenization_constrained: bool,
}

/// Why a request body could not be peeked. Every variant is a 400 for the caller.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeekError {
    /// The body is not valid JSON.
    #[error("request body is not valid JSON: {0}")]
    NotJson(String),
    /// The body is JSON but not an object.
    #[error("request body must be a JSON object")]
    NotObject,
    /// `model` is missing.
    #[error("you must provide a model parameter")]
    MissingModel,
    /// A known field has the wrong type or range.
    #[error("invalid value for '{field}': {expected}")]
    InvalidField {
        /// The field's name.
        field: &'static str,
        /// What was expected.
        expected: &'static str,
    },
    /// A member OpenAI documents that this gateway does not serve ([`NOT_SERVED`]; `echo`
    /// `true`): the meter could not count what it would make the engine read or generate.
    #[error("Unsupported parameter: '{field}' is not supported with this gateway.")]
    UnsupportedParameter {
        /// The field's name.
        field: &'static str,
    },
    /// A member the endpoint's allowlist does not hold (`peek/fields.rs`), whatever its value,
    /// `null` included: engine aliases that change how many tokens or choices are generated
    /// ([`ENGINE_GENERATION_FIELDS`]), template switches, typos. OpenAI's own wording.
    #[error("Unrecognized request argument supplied: {param}")]
    UnrecognizedArgument {
        /// The member, as a path for a nested one: `n_predict`, `messages[0].cache_control`,
        /// `tools[1].function.examples`.
        param: String,
    },
    /// A chat `messages` entry is malformed or not supported (see [`validate_chat_messages`]).
    #[error("invalid value for '{path}': {reason}")]
    InvalidMessage {
        /// Where, as OpenAI names it: `messages`, `messages[0].content`,
        /// `messages[1].content[2].type`, ...
        path: String,
        /// What is wrong.
        reason: &'static str,
    },
}

/// Which OpenAI endpoint a request is for: it decides how the prompt is counted and how the
/// response is metered (design brief §6, §7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RequestKind {
    /// `POST /v1/chat/completions`: `messages` rendered with the model's chat template.
    ChatCompletions,
    /// `POST /v1/completions`: `prompt` counted as is, without a chat template.
    Completions,
    /// `POST /v1/embeddings`: `input` counted as is; no completion tokens.
    Embeddings,
}

impl RequestKind {
    /// The kind served at `path` (`/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`).
    pub fn from_path(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Self::ChatCompletions),
            "/v1/completions" => Some(Self::Completions),
            "/v1/embeddings" => Some(Self::Embeddings),
            _ => None,
        }
    }

    /// The endpoint's path.
    pub fn path(self) -> &'static str {
        match self {
            Self::ChatCompletions => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
            Self::Embeddings => "/v1/embeddings",
        }
    }
}

/// One piece of a `/v1/completions` `prompt` or `/v1/embeddings` `input`, as llama.cpp reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptSegment<'a> {
    /// Text the engine tokenizes (special tokens parsed).
    Text(&'a str),
    /// This many token ids, passed through untokenized: each counts as one token.
    TokenIds(u64),
}

const PROMPT_EXPECTED: &str =
    "a string, an array of strings, an array of token ids, or an array of token-id arrays";

fn token_id(v: &Value) -> bool {
    v.as_u64().is_some_and(|id| id <= u64::from(u32::MAX))
}

fn one_prompt<'a>(
    items: &'a [Value],
    field: &'static str,
) -> Result<Vec<PromptSegment<'a>>, PeekError> {
    let bad = PeekError::InvalidField {
        field,
        expected: PROMPT_EXPECTED,
    };
    if items.is_empty() {
        return Err(bad);
    }
    let mut out: Vec<PromptSegment<'a>> = Vec::new();
    for item in items {
        match item {
            Value::String(s) => out.push(PromptSegment::Text(s)),
            v if token_id(v) => match out.last_mut() {
                Some(PromptSegment::TokenIds(n)) => *n += 1,
                _ => out.push(PromptSegment::TokenIds(1)),
            },
            _ => return Err(bad),
        }
    }
    Ok(out)
}

/// The prompts of a `/v1/completions` body (`field = "prompt"`) or the inputs of a
/// `/v1/embeddings` body (`field = "input"`), split the way llama.cpp splits them
/// (`tokenize_input_prompts`; OpenAI API reference):
///
/// - a string is one prompt;
/// - an array that holds any number is ONE prompt of token ids (llama.cpp also accepts strings
///   mixed in, each tokenized on its own);
/// - any other array is one prompt per element: a string, or a non-empty array of token ids
///   (optionally mixed with strings).
///
/// Each returned prompt is its segments in order. Token ids must be integers in `0..=u32::MAX`.
///
/// # Errors
///
/// [`PeekError::InvalidField`] naming `field` when it is missing, empty or of another shape;
/// [`PeekError::NotObject`] when `body` is not an object.
pub fn prompt_inputs<'a>(
    body: &'a Value,
    field: &'static str,
) -> Result<Vec<Vec<PromptSegment<'a>>>, PeekError> {
    let body = body.as_object().ok_or(PeekError::NotObject)?;
    let bad = PeekError::InvalidField {
        field,
        expected: PROMPT_EXPECTED,
    };
    match body.get(field) {
        Some(Value::String(s)) => Ok(vec![vec![PromptSegment::Text(s)]]),
        Some(Value::Array(items)) if items.is_empty() => Err(bad),
        Some(Value::Array(items)) if items.iter().any(Value::is_number) => {
            Ok(vec![one_prompt(items, field)?])
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => Ok(vec![PromptSegment::Text(s)]),
                Value::Array(inner) => one_prompt(inner, field),
                _ => Err(bad.clone()),
            })
            .collect(),
        _ => Err(bad),
    }
}

/// The top-level members of a request body, values raw and borrowed (see [`fields`]).
struct Fields<'a> {
    members: Vec<(&'static str, &'a RawValue)>,
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a RawValue> {
        self.members
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| *v)
    }

    /// The endpoint of a body whose path is not known: `messages` → chat, `prompt` →
    /// completions, `input` → embeddings, else chat.
    fn infer_kind(&self) -> RequestKind {
        if self.get("messages").is_some() {
            RequestKind::ChatCompletions
        } else if self.get("prompt").is_some() {
            RequestKind::Completions
        } else if self.get("input").is_some() {
            RequestKind::Embeddings
        } else {
            RequestKind::ChatCompletions
        }
    }

    /// Every member is one `kind` accepts ([`fields::member`]); a not-served OpenAI member
    /// only as `null`.
    fn check_allowed(&self, kind: RequestKind) -> Result<(), PeekError> {
        for (name, raw) in &self.members {
            match fields::member(kind, name) {
                Some(Member::Served) => {}
                Some(Member::NotServed) if is_null(raw) => {}
                Some(Member::NotServed) => {
                    return Err(PeekError::UnsupportedParameter { field: name })
                }
                None => {
                    return Err(PeekError::UnrecognizedArgument {
                        param: (*name).to_owned(),
                    })
                }
            }
        }
        Ok(())
    }
}

/// Request fields that constrain sampling so that an engine may generate a text as MORE tokens
/// than its canonical tokenization (the independent count is then a lower bound only): a
/// request that sets one (to anything but `null`; `logit_bias` to a non-empty object;
/// `response_format` to a type other than `text`) is [`RequestPeek::tokenization_constrained`],
/// and its bill follows the node's claim within what the delivered text can be
/// (`docs/metering.md`, "Constrained sampling").
///
/// | field | engine | effect |
/// |---|---|---|
/// | `logit_bias` | OpenAI, all | bans or forces tokens: e.g. every multi-character token banned |
/// | `response_format` (`json_object`, `json_schema`) | OpenAI, all | a grammar on the output |
/// | `grammar`, `json_schema` | llama.cpp | a grammar on the output |
/// | `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `structured_outputs` | vLLM | a grammar on the output |
/// | `regex`, `ebnf` | SGLang | a grammar on the output |
/// | `format` | Ollama | a JSON schema on the output |
/// | `allowed_token_ids` | vLLM | only these tokens may be drawn |
pub const TOKENIZATION_CONSTRAINT_FIELDS: [&str; 13] = [
    "logit_bias",
    "response_format",
    "grammar",
    "json_schema",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "regex",
    "ebnf",
    "format",
    "allowed_token_ids",
];

/// OpenAI's bound on `top_logprobs` (chat): an answer's size grows
/// with it, and an answer larger than the gateway's buffer would be work the caller never pays
/// for.
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// OpenAI's bound on `logprobs` as a number (`/v1/completions`).
pub const MAX_COMPLETION_LOGPROBS: u64 = 5;

/// OpenAI's bound on `n` (it answers a larger one with 400): the hold grows with it, and an
/// `n` of 2^31 placed a hold of 10,512,791,450,425 µ.
pub const MAX_N: u32 = 128;

/// The largest `max_tokens` / `max_completion_tokens` accepted: engines read it as a 32-bit
/// signed integer (llama.cpp's `n_predict`), and a larger one wraps.
pub const MAX_MAX_TOKENS: u64 = i32::MAX as u64;

/// Request fields that some engine obeys to decide how many tokens or choices it generates,
/// besides OpenAI's `max_tokens`, `max_completion_tokens` and `n`: the aliases found in the
/// engines' docs and code, kept as a tested list. They are refused by the allowlist
/// ([`fields`]: every member an endpoint does not list is refused, even `null`), never by
/// this list — a denylist is never complete. The hold and the bill follow the OpenAI fields,
/// and a node would otherwise deliver more than the caller is held and billed for.
///
/// | field | engine | effect |
/// |---|---|---|
/// | `n_predict` | llama.cpp | max tokens; wins over `max_tokens` (`server-schema.cpp`) |
/// | `n_cmpl` | llama.cpp | choices; wins over `n` |
/// | `max_new_tokens` | SGLang, TGI | max tokens |
/// | `min_tokens`, `min_new_tokens` | vLLM, SGLang | forces generation past EOS |
/// | `ignore_eos` | llama.cpp, vLLM, SGLang | generation runs to the limit |
/// | `best_of`, `use_beam_search` | vLLM | generates more sequences than it returns |
/// | `num_predict`, `options` | Ollama | max tokens (`options.num_predict`), context and more |
/// | `t_max_predict_ms` | llama.cpp | a time limit that ends generation with `length` before `max_tokens` (an honest node would be flagged for a `length` its text does not support) |
pub const ENGINE_GENERATION_FIELDS: [&str; 11] = [
    "n_predict",
    "n_cmpl",
    "max_new_tokens",
    "min_tokens",
    "min_new_tokens",
    "ignore_eos",
    "best_of",
    "use_beam_search",
    "num_predict",
    "options",
    "t_max_predict_ms",
];

/// One chat message, as far as the conversation key reads it.
#[derive(Deserialize)]
struct OpeningMessage {
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Value>,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a, 64 bits: stable across processes, builds and instances (unlike std's `RandomState`).
fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// Hashes one field with its length first, so that field boundaries are unambiguous.
fn hash_field(hash: u64, bytes: &[u8]) -> u64 {
    let len = u64::try_from(bytes.len()).unwrap_or(u64::MAX);
    fnv1a(fnv1a(hash, &len.to_le_bytes()), bytes)
}

/// The automatic affinity key of a chat request: a 64-bit FNV-1a hash of the model id and the
/// conversation's opening — its messages up to and including the first `user` message (all of
/// them when there is none), each as its role and its text (a string content as is, each text
/// part's text in order — one text part hashes like the same string —, any other content as its
/// JSON).
///
/// Every turn of one chat resends the same opening, so the key is the same on every turn with no
/// client change (design brief §5). Two chats that share an opening (same system prompt, same
/// first question) get the same key, and also share the engine's cached KV prefix, so sending
/// them to the same node is right anyway. The key is only a routing preference: a collision costs
/// a cache miss, never a wrong answer.
///
/// `messages` is the raw JSON of the body's `messages` field. Returns `None` when it is not an
/// array of objects (the metering layer refuses such a body with a 400 before routing).
pub fn conversation_key(model: &str, messages: &RawValue) -> Option<u64> {
    let messages: Vec<&RawValue> = serde_json::from_str(messages.get()).ok()?;
    let mut hash = hash_field(FNV_OFFSET, model.as_bytes());
    for raw in messages {
        let message: OpeningMessage = serde_json::from_str(raw.get()).ok()?;
        let role = message.role.unwrap_or_default();
        hash = hash_field(hash, role.as_bytes());
        hash = match &message.content {
            None | Some(Value::Null) => hash_field(hash, b""),
            Some(Value::String(text)) => hash_field(hash, text.as_bytes()),
            Some(Value::Array(parts)) => {
                let mut h = hash;
                for part in parts {
                    h = match part.get("text").and_then(Value::as_str) {
                        Some(text) => hash_field(h, text.as_bytes()),
                        None => hash_field(h, part.to_string().as_bytes()),
                    };
                }
                h
            }
            Some(other) => hash_field(hash, other.to_string().as_bytes()),
        };
        if role == "user" {
            break;
        }
    }
    Some(hash)
}

/// OpenAI's `reasoning_effort` values.
const REASONING_EFFORTS: [&str; 6] = ["none", "minimal", "low", "medium", "high", "xhigh"];
const REASONING_EFFORT_EXPECTED: &str = "one of none, minimal, low, medium, high, xhigh";

fn is_null(raw: &RawValue) -> bool {
    raw.get() == "null"
}

fn parse_opt<'a, T: Deserialize<'a>>(
    raw: Option<&'a RawValue>,
    field: &'static str,
    expected: &'static str,
) -> Result<Option<T>, PeekError> {
    match raw {
        None => Ok(None),
        Some(r) if is_null(r) => Ok(None),
        Some(r) => serde_json::from_str::<T>(r.get())
            .map(Some)
            .map_err(|_| PeekError::InvalidField { field, expected }),
    }
}

/// What a count that must be at least 1 (`n`, `max_tokens`, `max_completion_tokens`) is
/// refused with.
const AT_LEAST_ONE: &str = "an integer >= 1";

/// `value` as given, or [`PeekError::InvalidField`] for `field` ([`AT_LEAST_ONE`]) when it is 0.
fn at_least_one<T: PartialEq + From<u8>>(
    value: Option<T>,
    field: &'static str,
) -> Result<Option<T>, PeekError> {
    if value == Some(T::from(0)) {
        return Err(PeekError::InvalidField {
            field,
            expected: AT_LEAST_ONE,
        });
    }
    Ok(value)
}

impl Fields<'_> {
    /// Whether a [`TOKENIZATION_CONSTRAINT_FIELDS`] field is set.
    fn tokenization_constrained(&self) -> bool {
        let set = |r: Option<&RawValue>| r.is_some_and(|r| !is_null(r));
        // an empty object biases nothing; anything else that is not an object is the engine's
        // to refuse, and counts as set
        let logit_bias = self.get("logit_bias").is_some_and(|r| {
            !is_null(r)
                && serde_json::from_str::<serde_json::Map<String, Value>>(r.get())
                    .map_or(true, |m| !m.is_empty())
        });
        let response_format = self.get("response_format").is_some_and(|r| {
            !is_null(r)
                && serde_json::from_str::<Value>(r.get()).map_or(true, |v| {
                    v.get("type").and_then(Value::as_str) != Some("text")
                })
        });
        logit_bias
            || response_format
            || TOKENIZATION_CONSTRAINT_FIELDS
                .iter()
                .filter(|f| !matches!(**f, "logit_bias" | "response_format"))
                .any(|f| set(self.get(f)))
    }

    /// Refuses answer sizes past OpenAI's bounds: `top_logprobs` at most
    /// [`MAX_TOP_LOGPROBS`], a numeric `logprobs` at most [`MAX_COMPLETION_LOGPROBS`].
    fn check_logprobs(&self) -> Result<(), PeekError> {
        const TOP: &str = "an integer between 0 and 20";
        let field = "top_logprobs";
        if parse_opt::<u64>(self.get(field), field, TOP)?.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return Err(PeekError::InvalidField {
                field,
                expected: TOP,
            });
        }
        let bad = PeekError::InvalidField {
            field: "logprobs",
            expected: "a boolean, or an integer between 0 and 5",
        };
        match self
            .get("logprobs")
            .map(|r| serde_json::from_str::<Value>(r.get()))
        {
            None | Some(Ok(Value::Null | Value::Bool(_))) => Ok(()),
            Some(Ok(Value::Number(n)))
                if n.as_u64().is_some_and(|n| n <= MAX_COMPLETION_LOGPROBS) =>
            {
                Ok(())
            }
            Some(_) => Err(bad),
        }
    }
}

impl RequestPeek {
    /// Reads the peek fields from a JSON request body whose endpoint is not known: it is
    /// inferred from the body (`messages` → chat completions, `prompt` → completions, `input`
    /// → embeddings, else chat completions). See [`RequestPeek::for_endpoint`].
    ///
    /// # Errors
    ///
    /// As [`RequestPeek::for_endpoint`].
    pub fn from_json(body: &[u8]) -> Result<Self, PeekError> {
        Self::parse(body, None)
    }

    /// Reads the peek fields from a JSON request body for the endpoint `kind`, refusing every
    /// member that endpoint does not accept (the allowlist of `peek/fields.rs`, tabled in
    /// `docs/metering.md`). One pass over the body's top level; values are borrowed.
    ///
    /// # Errors
    ///
    /// [`PeekError`] when the body is not a JSON object, a top-level member is given twice, a
    /// member is not in the endpoint's allowlist ([`PeekError::UnrecognizedArgument`], even
    /// with value `null`; among them every [`ENGINE_GENERATION_FIELDS`] alias) or is an OpenAI
    /// member this gateway does not serve ([`PeekError::UnsupportedParameter`]), `model` is
    /// missing or not a non-empty string, or `stream`, `stream_options` (whose members are
    /// allowlisted too), `n`, `max_tokens`, `max_completion_tokens`, `reasoning_effort` or
    /// `prompt_cache_key` has the wrong type (`n`, `max_tokens` and `max_completion_tokens`
    /// must be ≥ 1, and the last two equal when both are set), `echo` is `true`,
    /// `max_tokens` / `max_completion_tokens` exceed [`MAX_MAX_TOKENS`], or `top_logprobs` or
    /// `logprobs` exceed OpenAI's bounds ([`MAX_TOP_LOGPROBS`], [`MAX_COMPLETION_LOGPROBS`]).
    /// A malformed `messages` is not an error here (it only leaves
    /// [`RequestPeek::conversation_key`] empty); [`validate_chat_messages`] refuses it.
    pub fn for_endpoint(kind: RequestKind, body: &[u8]) -> Result<Self, PeekError> {
        Self::parse(body, Some(kind))
    }

    fn parse(body: &[u8], kind: Option<RequestKind>) -> Result<Self, PeekError> {
        let value: &RawValue =
            serde_json::from_slice(body).map_err(|e| PeekError::NotJson(e.to_string()))?;
        let fields = match fields::read_members(value.get()) {
            Ok(members) => Fields { members },
            Err(MembersError::NotObject) => return Err(PeekError::NotObject),
            Err(MembersError::Unknown(param)) => {
                return Err(PeekError::UnrecognizedArgument { param })
            }
            Err(MembersError::Json(e)) => return Err(PeekError::NotJson(e)),
        };
        fields.check_allowed(kind.unwrap_or_else(|| fields.infer_kind()))?;
        fields.check_logprobs()?;
        // forwarded to the node and never counted: bounded (`peek/tags.rs`)
        for (name, check) in [
            (
                "metadata",
                check_metadata as fn(&Value) -> Result<(), PeekError>,
            ),
            ("user", check_user),
        ] {
            if let Some(raw) = fields.get(name) {
                let value: Value = serde_json::from_str(raw.get())
                    .map_err(|e| PeekError::NotJson(e.to_string()))?;
                check(&value)?;
            }
        }
        // compiled by the node, counted only by a template that renders them: bounded
        if let Some(raw) = fields.get("tools") {
            check_tools(raw.get())?;
        }
        if let Some(raw) = fields.get("tool_choice") {
            check_output_constraint("tool_choice", raw.get())?;
        }
        if let Some(raw) = fields.get("stop") {
            check_stop(raw.get())?;
        }
        for name in TOKENIZATION_CONSTRAINT_FIELDS {
            if name == "logit_bias" {
                continue;
            }
            if let Some(raw) = fields.get(name) {
                check_output_constraint(name, raw.get())?;
            }
        }
        // the prompt echoed back arrives as completion text the caller did not ask to generate
        // (vLLM sends it as the first chunk): neither a fair bill nor within the hold's cap
        if parse_opt::<bool>(fields.get("echo"), "echo", "a boolean")?.unwrap_or(false) {
            return Err(PeekError::UnsupportedParameter { field: "echo" });
        }
        let model: String = parse_opt(fields.get("model"), "model", "a non-empty string")?
            .ok_or(PeekError::MissingModel)?;
        if model.is_empty() {
            return Err(PeekError::InvalidField {
                field: "model",
                expected: "a non-empty string",
            });
        }
        let stream: bool = parse_opt(fields.get("stream"), "stream", "a boolean")?.unwrap_or(false);
        let include_usage = match fields.get("stream_options") {
            Some(r) if !is_null(r) => {
                let opts = match fields::read_nested(r.get(), &fields::STREAM_OPTIONS_MEMBERS) {
                    Ok(opts) => opts,
                    Err(MembersError::Unknown(name)) => {
                        return Err(PeekError::UnrecognizedArgument {
                            param: format!("stream_options.{name}"),
                        })
                    }
                    Err(_) => {
                        return Err(PeekError::InvalidField {
                            field: "stream_options",
                            expected: "an object",
                        })
                    }
                };
                let raw = opts
                    .iter()
                    .find(|(k, _)| *k == "include_usage")
                    .map(|(_, v)| *v);
                parse_opt(raw, "stream_options.include_usage", "a boolean")?.unwrap_or(false)
            }
            _ => false,
        };
        let reasoning_effort: Option<String> = parse_opt(
            fields.get("reasoning_effort"),
            "reasoning_effort",
            REASONING_EFFORT_EXPECTED,
        )?;
        if reasoning_effort.is_some_and(|e| !REASONING_EFFORTS.contains(&e.as_str())) {
            return Err(PeekError::InvalidField {
                field: "reasoning_effort",
                expected: REASONING_EFFORT_EXPECTED,
            });
        }
        let n: u64 =
            at_least_one(parse_opt(fields.get("n"), "n", AT_LEAST_ONE)?, "n")?.unwrap_or(1);
        // OpenAI's bound, before any node and any hold
        let n = u32::try_from(n)
            .ok()
            .filter(|n| *n <= MAX_N)
            .ok_or(PeekError::InvalidField {
                field: "n",
                expected: "an integer between 1 and 128",
            })?;
        // ≥ 1, as OpenAI requires; and when both are set they must agree, because engines
        // disagree on which one wins (llama.cpp and vLLM: max_completion_tokens; SGLang:
        // `max_completion_tokens or max_tokens`, so a 0 there falls through to the other)
        let max_completion_tokens: Option<u64> = parse_opt(
            fields.get("max_completion_tokens"),
            "max_completion_tokens",
            AT_LEAST_ONE,
        )?;
        let max_tokens: Option<u64> =
            parse_opt(fields.get("max_tokens"), "max_tokens", AT_LEAST_ONE)?;
        at_least_one(max_completion_tokens, "max_completion_tokens")?;
        at_least_one(max_tokens, "max_tokens")?;
        for (value, field) in [
            (max_completion_tokens, "max_completion_tokens"),
            (max_tokens, "max_tokens"),
        ] {
            if value.is_some_and(|v| v > MAX_MAX_TOKENS) {
                return Err(PeekError::InvalidField {
                    field,
                    expected: "an integer between 1 and 2147483647",
                });
            }
        }
        if let (Some(a), Some(b)) = (max_completion_tokens, max_tokens) {
            if a != b {
                return Err(PeekError::InvalidField {
                    field: "max_tokens",
                    expected: "the value of max_completion_tokens when both are set",
                });
            }
        }
        let prompt_cache_key: Option<String> = parse_opt(
            fields.get("prompt_cache_key"),
            "prompt_cache_key",
            "a string",
        )?;
        let conversation_key = fields
            .get("messages")
            .and_then(|messages| conversation_key(&model, messages));
        Ok(Self {
            model: ModelId::new(model),
            stream,
            include_usage,
            n,
            max_tokens: max_completion_tokens.or(max_tokens),
            prompt_cache_key,
            conversation_key,
            tokenization_constrained: fields.tokenization_constrained(),
        })
    }
}

#[cfg(test)]
mod tests;
