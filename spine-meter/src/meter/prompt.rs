//! The prompt side of a request: what the node reads (`developer` sent as `system`) and the
//! independent count of each prompt (design brief §6).

use spine_core::{prompt_inputs, validate_chat_messages, PeekError, PromptSegment, RequestKind};

use spine_core::Usage;

use super::MeterError;
use crate::tokenizer::{count_text_within, Counted};
use crate::TokenCounter;

/// Sends `developer` messages as `system` ones: OpenAI's newer name for the same role, which
/// chat templates do not know (llama.cpp's renders some of them without it, others refuse it),
/// so the node and the meter both read `system`. Whether a message changed.
pub(super) fn developer_to_system(json: &mut serde_json::Value) -> bool {
    let Some(messages) = json.get_mut("messages").and_then(|m| m.as_array_mut()) else {
        return false;
    };
    let mut changed = false;
    for message in messages {
        if let Some(role) = message.get_mut("role") {
            if role == "developer" {
                *role = serde_json::Value::from("system");
                changed = true;
            }
        }
    }
    changed
}

/// The independent prompt count of each prompt of a request (design brief §6):
///
/// - chat completions: `messages` checked ([`validate_chat_messages`]), rendered with the model's
///   chat template and counted ([`TokenCounter::count_prompt`]); one prompt;
/// - completions (`prompt`) and embeddings (`input`): each prompt of [`prompt_inputs`] counted
///   WITHOUT a chat template, as llama.cpp counts it: each text segment tokenized on its own
///   (special tokens parsed, no BOS: measured against `llama-server`, which adds none for this
///   kind of model), each token id one token. A prompt of 0 tokens is refused (llama.cpp refuses
///   empty embedding inputs, and an empty completion prompt has nothing to condition on).
///
/// Counting stops early ([`TokenCounter::count_prompt_within`], [`count_text_within`]: in
/// pieces of 64 KiB) once a prompt cannot fit the context (`>= max_context_tokens`:
/// [`MeterError::PromptOverContext`], 400) or the prompts together cost more than the account's
/// available balance when it is known ([`MeterError::InsufficientCredit`], 402: the hold could
/// not cover the prompt alone).
pub(super) fn count_prompts(
    tokenizer: &dyn TokenCounter,
    kind: RequestKind,
    json: &serde_json::Value,
    limits: &PromptLimits,
) -> Result<Vec<u64>, MeterError> {
    // a prompt of max_context_tokens or more leaves no room for a completion token
    let per_prompt = limits.max_context_tokens.saturating_sub(1);
    let affordable = limits.affordable.map_or(u64::MAX, |(tokens, _)| tokens);
    let field = match kind {
        RequestKind::Embeddings => "input",
        RequestKind::Completions => "prompt",
        _ => {
            validate_chat_messages(json).map_err(MeterError::BadRequest)?;
            let n = tokenizer
                .count_prompt_within(json, per_prompt.min(affordable))
                .map_err(MeterError::Prompt)?;
            limits.check(n, n.tokens())?;
            return Ok(vec![n.tokens()]);
        }
    };
    let prompts = prompt_inputs(json, field).map_err(MeterError::BadRequest)?;
    if kind == RequestKind::Embeddings && prompts.len() > super::embeddings::MAX_INPUTS {
        return Err(MeterError::EmbeddingsRefused {
            param: "input",
            message: format!(
                "'input' has {} items: at most {} inputs per request",
                prompts.len(),
                super::embeddings::MAX_INPUTS
            ),
        });
    }
    let mut counts = Vec::with_capacity(prompts.len());
    let mut total = 0u64;
    for segments in &prompts {
        let mut prompt = Counted::Exact(0);
        for segment in segments {
            let room = per_prompt
                .saturating_sub(prompt.tokens())
                .min(affordable.saturating_sub(total.saturating_add(prompt.tokens())));
            let n = match segment {
                PromptSegment::Text(t) => count_text_within(tokenizer, t, room),
                PromptSegment::TokenIds(n) => Counted::Exact(*n),
            };
            prompt = prompt.plus(n);
            limits.check(prompt, total.saturating_add(prompt.tokens()))?;
        }
        total = total.saturating_add(prompt.tokens());
        counts.push(prompt.tokens());
    }
    if counts.contains(&0) {
        return Err(MeterError::BadRequest(PeekError::InvalidField {
            field,
            expected: "non-empty prompts (each at least one token)",
        }));
    }
    Ok(counts)
}

/// What a request's prompts may count before counting stops ([`count_prompts`]).
pub(super) struct PromptLimits {
    pub(super) max_context_tokens: u64,
    /// `(prompt tokens the account can pay for, its available balance in micros)`, when the
    /// balance was read.
    pub(super) affordable: Option<(u64, u64)>,
    pub(super) price: crate::Price,
}

impl PromptLimits {
    /// Refuses one prompt counted as `prompt` (with `total` tokens for every prompt so far)
    /// when it cannot fit the context or be paid for.
    fn check(&self, prompt: Counted, total: u64) -> Result<(), MeterError> {
        match prompt {
            Counted::AtLeast(n) if n >= self.max_context_tokens => {
                return Err(MeterError::PromptOverContext {
                    at_least_tokens: n,
                    max_context_tokens: self.max_context_tokens,
                })
            }
            // an exact count over the context: refused with the exact count by the caller
            Counted::Exact(n) if n >= self.max_context_tokens => return Ok(()),
            _ => {}
        }
        if let Some((tokens, available_micros)) = self.affordable {
            if total > tokens {
                return Err(MeterError::InsufficientCredit {
                    available_micros,
                    needed_micros: self.price.cost_micros(&Usage {
                        prompt_tokens: total,
                        completion_tokens: 0,
                    }),
                });
            }
        }
        Ok(())
    }
}

/// The most prompt tokens `available_micros` pays for at `price` (no completion token):
/// the largest `t` with `ceil(t × input / 10⁶) <= available`; `u64::MAX` when prompts are free.
pub(super) fn affordable_prompt_tokens(price: &crate::Price, available_micros: u64) -> u64 {
    if price.input_micros_per_mtok == 0 {
        return u64::MAX;
    }
    let t = u128::from(available_micros) * 1_000_000 / u128::from(price.input_micros_per_mtok);
    u64::try_from(t).unwrap_or(u64::MAX)
}

/// The longest of the request's `stop` strings, UTF-8 bytes (0 without): what an engine may
/// generate for a choice and never send. OpenAI's semantics, which llama.cpp, vLLM and SGLang
/// follow: a matched stop string ends the choice and is not returned, though its tokens were
/// generated and are counted in `usage`; llama.cpp holds back a partial match while it may
/// still complete and never sends it when generation ends on `length` (measured on llama.cpp:
/// a 120-token stop string matched whole gave `""`, `stop`, usage 120).
pub(super) fn stop_hidden_bytes(json: &serde_json::Value) -> u64 {
    use serde_json::Value;
    let len = |v: &Value| v.as_str().map_or(0, |s| s.len() as u64);
    match json.get("stop") {
        Some(Value::Array(stops)) => stops.iter().map(len).max().unwrap_or(0),
        Some(stop) => len(stop),
        None => 0,
    }
}

/// Why a `logit_bias` that raises a control token is refused (`docs/metering.md`,
/// "Constrained sampling").
pub(super) const RAISED_CONTROL_TOKEN: &str =
    "no positive bias on a control token (it is generated as no text, so it cannot be metered)";

/// Why a `logit_bias` the engines could read as other tokens than the gateway is refused.
pub(super) const UNREADABLE_LOGIT_BIAS: &str =
    "an object mapping token ids (decimal digits, at most 2147483647) to numbers";

/// Whether the request's `logit_bias` raises a control token (a special token of the
/// vocabulary, [`TokenCounter::is_special_token`]) by a positive bias. The engine then spends
/// tokens that render as no text: its `length` finish looks unsupported by its text (an honest
/// node flagged) and the caller pays nothing for the work. Only for a `logit_bias` that
/// [`logit_bias_unreadable`] accepts.
pub(super) fn raises_control_token(json: &serde_json::Value, counter: &dyn TokenCounter) -> bool {
    logit_biases(json).is_some_and(|biases| {
        biases.is_ok_and(|biases| {
            biases
                .iter()
                .any(|(id, bias)| counter.is_special_token(*id) && *bias > 0.0)
        })
    })
}

/// Why a `logit_bias` on an id past the vocabulary is refused.
pub(super) const UNKNOWN_TOKEN_BIAS: &str = "token ids of the model's vocabulary";

/// Whether the request's `logit_bias` names a token id at or past the counter's
/// [`TokenCounter::vocab_size`] (when it knows one). Only for a `logit_bias` that
/// [`logit_bias_unreadable`] accepts.
pub(super) fn biases_unknown_token(json: &serde_json::Value, counter: &dyn TokenCounter) -> bool {
    logit_biases(json).is_some_and(|biases| {
        biases.is_ok_and(|biases| {
            counter
                .vocab_size()
                .is_some_and(|size| biases.iter().any(|(id, _)| u64::from(*id) >= size))
        })
    })
}

/// Whether the request's `logit_bias` (not `null`) has an entry the engines may read as
/// another token than the gateway does, so that [`raises_control_token`] cannot vouch for
/// it: every entry must be a token id of ASCII decimal digits at most `i32::MAX` (OpenAI's
/// form) mapped to a number (or llama.cpp's `false`, a ban), in an object or in llama.cpp's
/// array of `[id, bias]` pairs (the id a JSON integer). Each engine reads the rest its own
/// way: llama.cpp takes an object key with `strtol` into a 32-bit token (`"4294967299"`
/// and `"-4294967293"` are token 3, `""` is token 0, a key is cut at its first NUL:
/// `"3\u0000"` is token 3) and an array id as a 32-bit integer (`4294967299` is 3), and
/// tokenizes any other key as text; vLLM and SGLang read a key with Python's `int` (`"٣"`
/// and `"3_0"` are ids) and coerce a string bias (`"100"`) to a number.
pub(super) fn logit_bias_unreadable(json: &serde_json::Value) -> bool {
    matches!(logit_biases(json), Some(Err(())))
}

/// The request's `logit_bias` as `(token id, bias)` per entry, `false` (a ban) read as −∞;
/// `Err` when an entry is not in the form every engine reads alike ([`logit_bias_unreadable`]).
/// `None` for a `logit_bias` absent or `null`.
pub(super) fn logit_biases(json: &serde_json::Value) -> Option<Result<Vec<(u32, f64)>, ()>> {
    use serde_json::Value;
    let id = |id: &str| {
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        id.parse::<u32>()
            .ok()
            .filter(|id| i32::try_from(*id).is_ok())
    };
    let bias = |bias: &Value| match bias {
        Value::Number(n) => n.as_f64(),
        Value::Bool(false) => Some(f64::NEG_INFINITY),
        _ => None,
    };
    let entry = |id: Option<u32>, b: Option<&Value>| Some((id?, bias(b?)?));
    let entries: Option<Vec<(u32, f64)>> = match json.get("logit_bias")? {
        Value::Null => return None,
        Value::Object(biases) => biases.iter().map(|(k, b)| entry(id(k), Some(b))).collect(),
        Value::Array(pairs) => pairs
            .iter()
            .map(|pair| match pair.as_array().map(Vec::as_slice) {
                Some([Value::Number(n), b]) => {
                    entry(n.as_u64().and_then(|n| id(&n.to_string())), Some(b))
                }
                _ => None,
            })
            .collect(),
        _ => None,
    };
    Some(entries.ok_or(()))
}

/// Why a grammar naming tokens is refused.
pub(super) const GRAMMAR_NAMES_TOKENS: &str =
    "a grammar on characters (token references such as <[id]> or <|token|> cannot be metered)";

/// Whether llama.cpp's `grammar` (GBNF) names tokens: a `<` outside a string literal, a
/// character class and a comment starts a token reference (`<[3]>`, `<|im_end|>`, negated
/// `!<[3]>`). A token-level grammar can make the engine generate tokens the delivered text
/// does not show (a control token renders as no text), which no count of the text can bill.
pub(super) fn grammar_names_tokens(json: &serde_json::Value) -> bool {
    let Some(grammar) = json.get("grammar").and_then(serde_json::Value::as_str) else {
        return false;
    };
    let mut chars = grammar.chars();
    while let Some(c) = chars.next() {
        match c {
            '<' => return true,
            '#' => {
                for c in chars.by_ref() {
                    if c == '\n' || c == '\r' {
                        break;
                    }
                }
            }
            '"' | '[' => {
                let close = if c == '"' { '"' } else { ']' };
                while let Some(c) = chars.next() {
                    if c == '\\' {
                        chars.next();
                    } else if c == close {
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    false
}
