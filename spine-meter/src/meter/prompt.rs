//! The prompt side of a request: what the node reads (`developer` sent as `system`) and the
//! independent count of each prompt (design brief §6).

use spine_core::{
    prompt_inputs, validate_chat_messages, PeekError, PromptSegment, RequestKind, RequestPeek,
};

use super::MeterError;
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
pub(super) fn count_prompts(
    tokenizer: &dyn TokenCounter,
    kind: RequestKind,
    json: &serde_json::Value,
) -> Result<Vec<u64>, MeterError> {
    let field = match kind {
        RequestKind::Embeddings => "input",
        RequestKind::Completions => "prompt",
        _ => {
            validate_chat_messages(json).map_err(MeterError::BadRequest)?;
            let n = tokenizer.count_prompt(json).map_err(MeterError::Prompt)?;
            return Ok(vec![n]);
        }
    };
    let prompts = prompt_inputs(json, field).map_err(MeterError::BadRequest)?;
    let counts: Vec<u64> = prompts
        .iter()
        .map(|segments| {
            segments
                .iter()
                .map(|s| match s {
                    PromptSegment::Text(t) => tokenizer.count_text(t),
                    PromptSegment::TokenIds(n) => *n,
                })
                .fold(0u64, u64::saturating_add)
        })
        .collect();
    if counts.contains(&0) {
        return Err(MeterError::BadRequest(PeekError::InvalidField {
            field,
            expected: "non-empty prompts (each at least one token)",
        }));
    }
    Ok(counts)
}

/// Whether the request constrains tokenization ([`RequestPeek::tokenization_constrained`]),
/// with one refinement the peek cannot make without the vocabulary: a `logit_bias` that only
/// biases special tokens (EOS banned to make an answer run to its limit, the usual use) cannot
/// make the engine spell a text in other tokens, so it does not count.
pub(super) fn constrains_tokenization(
    peek: &RequestPeek,
    json: &serde_json::Value,
    counter: &dyn TokenCounter,
) -> bool {
    use serde_json::Value;
    if !peek.tokenization_constrained {
        return false;
    }
    let other_constraint = spine_core::TOKENIZATION_CONSTRAINT_FIELDS
        .iter()
        .filter(|field| **field != "logit_bias")
        .any(|field| match (json.get(*field), *field) {
            (None | Some(Value::Null), _) => false,
            (Some(v), "response_format") => v.get("type").and_then(Value::as_str) != Some("text"),
            _ => true,
        });
    if other_constraint {
        return true;
    }
    match json.get("logit_bias") {
        Some(Value::Object(biases)) => !biases.keys().all(|id| {
            id.parse::<u32>()
                .is_ok_and(|id| counter.is_special_token(id))
        }),
        _ => true,
    }
}
