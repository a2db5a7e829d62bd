//! Which requests can be audited, and what the reference is asked.

use serde_json::{Map, Value};
use spine_core::RequestKind;

use super::score::SamplingMode;

/// The prompt of an audited request, as the reference renders it.
#[derive(Clone, Debug, PartialEq)]
pub enum AuditPrompt {
    /// A chat request's `messages` (a JSON array, as text): the reference applies the model's
    /// chat template, as the node's engine did.
    Chat(String),
    /// A completions request's `prompt` string, used as is.
    Text(String),
}

/// What an auditable request asks of the model.
#[derive(Clone, Debug, PartialEq)]
pub struct AuditableRequest {
    /// The prompt.
    pub prompt: AuditPrompt,
    /// How the node sampled.
    pub mode: SamplingMode,
}

/// Members whose presence (non-null) leaves the request's distribution the raw model's, sampled
/// at some temperature with truncation. Anything else (tools, response formats, grammars, logit
/// biases, penalties, engine-specific fields) changes the distribution: such requests are not
/// audited, so that an honest node is never scored against the wrong distribution.
const NEUTRAL_MEMBERS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "seed",
    "user",
    "logprobs",
    "top_logprobs",
    "metadata",
    "store",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
];

/// Why a request is not audited (counted, never the node's fault).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotAuditable {
    /// The body is not a JSON object, or its prompt is not a string / its messages not an
    /// array.
    Shape,
    /// A member that changes the distribution (tools, response format, logit bias, a penalty,
    /// an engine field).
    Constrained,
    /// Temperature above 1 (the sampled statistic's bound needs ≤ 1).
    HotSampling,
    /// Embeddings.
    Kind,
}

/// Reads an audited request's body.
///
/// # Errors
///
/// [`NotAuditable`] as its variants say.
pub fn auditable(kind: RequestKind, body: &[u8]) -> Result<AuditableRequest, NotAuditable> {
    let obj: Map<String, Value> = serde_json::from_slice(body).map_err(|_| NotAuditable::Shape)?;
    for (k, v) in &obj {
        if v.is_null() {
            continue;
        }
        if !NEUTRAL_MEMBERS.contains(&k.as_str()) {
            return Err(NotAuditable::Constrained);
        }
        let zero_ok = matches!(k.as_str(), "presence_penalty" | "frequency_penalty");
        if zero_ok && v.as_f64() != Some(0.0) {
            return Err(NotAuditable::Constrained);
        }
    }
    let num = |k: &str| obj.get(k).and_then(Value::as_f64);
    let temperature = num("temperature");
    let greedy = temperature.is_some_and(|t| t <= 1e-6) || num("top_k") == Some(1.0);
    let mode = if greedy {
        SamplingMode::Greedy
    } else if temperature.is_some_and(|t| t > 1.0) {
        return Err(NotAuditable::HotSampling);
    } else {
        // absent: OpenAI's default is 1, llama.cpp's 0.8, vLLM's the model's (≤ 1 for the
        // catalog's models): the bound at 1 holds for all of them
        SamplingMode::Sampled {
            temperature: temperature.unwrap_or(1.0),
        }
    };
    let prompt = match kind {
        RequestKind::ChatCompletions => {
            let messages = obj.get("messages").ok_or(NotAuditable::Shape)?;
            if !messages.is_array() {
                return Err(NotAuditable::Shape);
            }
            AuditPrompt::Chat(messages.to_string())
        }
        RequestKind::Completions => match obj.get("prompt") {
            Some(Value::String(s)) => AuditPrompt::Text(s.clone()),
            _ => return Err(NotAuditable::Shape),
        },
        _ => return Err(NotAuditable::Kind),
    };
    Ok(AuditableRequest { prompt, mode })
}
