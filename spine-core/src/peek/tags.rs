//! Bounds on what the caller sends that is forwarded or echoed but never counted: `metadata`
//! (OpenAI's documented limits), `user` (this gateway's) and the output constraints (a
//! `response_format`, an engine's `grammar` …: this gateway's). Unbounded, they would only make a
//! node read (and compile into a grammar), and a `/v1/responses` answer echo (three times when
//! streamed), megabytes nobody pays for. Also the number of `tools` (OpenAI's limit; their text
//! is counted in the prompt).

use serde_json::Value;

use super::PeekError;

/// OpenAI's limit on `metadata` pairs.
pub const MAX_METADATA_PAIRS: usize = 16;
/// OpenAI's limit on a `metadata` key, characters.
pub const MAX_METADATA_KEY_CHARS: usize = 64;
/// OpenAI's limit on a `metadata` value (a string), characters.
pub const MAX_METADATA_VALUE_CHARS: usize = 512;
/// This gateway's limit on `user`, characters (OpenAI documents none; it is an end-user id).
pub const MAX_USER_CHARS: usize = 256;

/// OpenAI's limit on `tools` ("a max of 128 functions are supported"), on chat and on
/// `/v1/responses`.
pub const MAX_TOOLS: usize = 128;
/// This gateway's limit on the JSON text of one output constraint member (`response_format`,
/// llama.cpp's `grammar` / `json_schema`, vLLM's `guided_*`, Ollama's `format`, the Responses
/// API's `text`; the members of [`TOKENIZATION_CONSTRAINT_FIELDS`](super::TOKENIZATION_CONSTRAINT_FIELDS)
/// but `logit_bias`), bytes: 128 KiB. A node turns it into a grammar and no one pays for its
/// size. OpenAI bounds a structured-output schema at 120,000 characters of property names,
/// definition names and enum values; this leaves room for the structure around them.
pub const MAX_OUTPUT_CONSTRAINT_BYTES: usize = 128 * 1024;

/// Most `stop` sequences (OpenAI allows 4; engines take more).
pub const MAX_STOP_SEQUENCES: usize = 16;

/// Longest `stop` sequence, bytes. An engine holds back generated text that could be the start
/// of a stop sequence until it knows (llama.cpp's `find_partial_stop_string`), so a stop
/// sequence bounds how long a stream may go without visible progress: a caller with a
/// 3,205-character stop and a grammar that generated its prefix made an honest node's stream
/// look stalled for 20 s (cut as the node's fault, the caller paying nothing).
pub const MAX_STOP_BYTES: usize = 128;

/// A request's `stop` whose JSON text is `json`: null, a string, or an array of at most
/// [`MAX_STOP_SEQUENCES`] strings, each at most [`MAX_STOP_BYTES`].
///
/// # Errors
///
/// [`PeekError::InvalidField`] for `stop`.
pub fn check_stop(json: &str) -> Result<(), PeekError> {
    let short = |s: &str| s.len() <= MAX_STOP_BYTES;
    let ok = match serde_json::from_str::<Value>(json) {
        Ok(Value::Null) => true,
        Ok(Value::String(s)) => short(&s),
        Ok(Value::Array(stops)) => {
            stops.len() <= MAX_STOP_SEQUENCES && stops.iter().all(|s| s.as_str().is_some_and(short))
        }
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(PeekError::InvalidField {
            field: "stop",
            expected: "a string or an array of at most 16 strings, each at most 128 bytes",
        })
    }
}

const METADATA_EXPECTED: &str = "an object of at most 16 pairs, each key at most 64 characters \
                                 and each value a string of at most 512 characters";
const USER_EXPECTED: &str = "a string of at most 256 characters";

/// `metadata` as OpenAI bounds it (`null` passes): at most [`MAX_METADATA_PAIRS`] pairs, keys
/// of at most [`MAX_METADATA_KEY_CHARS`] characters, values strings of at most
/// [`MAX_METADATA_VALUE_CHARS`].
///
/// # Errors
///
/// [`PeekError::InvalidField`] for `metadata`.
pub fn check_metadata(metadata: &Value) -> Result<(), PeekError> {
    let bad = PeekError::InvalidField {
        field: "metadata",
        expected: METADATA_EXPECTED,
    };
    match metadata {
        Value::Null => Ok(()),
        Value::Object(pairs) if pairs.len() <= MAX_METADATA_PAIRS => {
            let fits = pairs.iter().all(|(k, v)| {
                k.chars().count() <= MAX_METADATA_KEY_CHARS
                    && v.as_str()
                        .is_some_and(|v| v.chars().count() <= MAX_METADATA_VALUE_CHARS)
            });
            if fits {
                Ok(())
            } else {
                Err(bad)
            }
        }
        _ => Err(bad),
    }
}

/// `user` (`null` passes): a string of at most [`MAX_USER_CHARS`] characters.
///
/// # Errors
///
/// [`PeekError::InvalidField`] for `user`.
pub fn check_user(user: &Value) -> Result<(), PeekError> {
    match user {
        Value::Null => Ok(()),
        Value::String(s) if s.chars().count() <= MAX_USER_CHARS => Ok(()),
        _ => Err(PeekError::InvalidField {
            field: "user",
            expected: USER_EXPECTED,
        }),
    }
}

/// `count` entries of `tools`: at most [`MAX_TOOLS`].
///
/// # Errors
///
/// [`PeekError::InvalidField`] for `tools`.
pub fn check_tool_count(count: usize) -> Result<(), PeekError> {
    if count <= MAX_TOOLS {
        Ok(())
    } else {
        Err(PeekError::InvalidField {
            field: "tools",
            expected: "an array of at most 128 tools",
        })
    }
}

/// A request's `tools` whose JSON text is `json`: at most [`MAX_TOOLS`] tools (see
/// [`check_tool_count`]), each at most [`MAX_OUTPUT_CONSTRAINT_BYTES`] of JSON (an engine
/// compiles a tool's `parameters` schema into a grammar, as it does an output constraint, and
/// a template that ignores tools counts none of it). Not an array: passes (the endpoint's
/// error).
///
/// # Errors
///
/// [`PeekError::InvalidField`] for `tools`.
pub fn check_tools(json: &str) -> Result<(), PeekError> {
    let Ok(tools) = serde_json::from_str::<Vec<&serde_json::value::RawValue>>(json) else {
        return Ok(());
    };
    check_tool_count(tools.len())?;
    tools
        .iter()
        .try_for_each(|tool| check_output_constraint("tools", tool.get()))
}

/// An output constraint member `field` whose JSON text is `json`: at most
/// [`MAX_OUTPUT_CONSTRAINT_BYTES`] bytes.
///
/// # Errors
///
/// [`PeekError::InvalidField`] for `field`.
pub fn check_output_constraint(field: &'static str, json: &str) -> Result<(), PeekError> {
    if json.len() <= MAX_OUTPUT_CONSTRAINT_BYTES {
        Ok(())
    } else {
        Err(PeekError::InvalidField {
            field,
            expected: "at most 131072 bytes of JSON (this gateway's limit on an output \
                       constraint: a schema or grammar)",
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn metadata_and_user_are_bounded() {
        let pairs = |n: usize| Value::Object((0..n).map(|i| (i.to_string(), json!("v"))).collect());
        for ok in [
            Value::Null,
            json!({}),
            pairs(16),
            json!({"k".repeat(64): "v".repeat(512)}),
            json!({"é".repeat(64): "日".repeat(512)}),
        ] {
            assert_eq!(check_metadata(&ok), Ok(()), "{ok}");
        }
        for bad in [
            pairs(17),
            json!({"k".repeat(65): "v"}),
            json!({"k": "v".repeat(513)}),
            json!({"k": 1}),
            json!({"k": {"nested": "v"}}),
            json!(["k"]),
            json!("k"),
        ] {
            assert!(check_metadata(&bad).is_err(), "{bad}");
        }
        assert_eq!(check_user(&json!("u".repeat(256))), Ok(()));
        assert_eq!(check_user(&Value::Null), Ok(()));
        assert!(check_user(&json!("u".repeat(257))).is_err());
        assert!(check_user(&json!(1)).is_err());
    }

    #[test]
    fn tools_and_output_constraints_are_bounded() {
        assert_eq!(check_tool_count(128), Ok(()));
        assert!(check_tool_count(129).is_err());
        let schema = |bytes: usize| format!("\"{}\"", "x".repeat(bytes - 2));
        assert_eq!(
            check_output_constraint("grammar", &schema(MAX_OUTPUT_CONSTRAINT_BYTES)),
            Ok(())
        );
        assert_eq!(
            check_output_constraint("grammar", &schema(MAX_OUTPUT_CONSTRAINT_BYTES + 1)),
            Err(PeekError::InvalidField {
                field: "grammar",
                expected: "at most 131072 bytes of JSON (this gateway's limit on an output \
                           constraint: a schema or grammar)",
            })
        );
    }
}
