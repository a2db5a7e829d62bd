use serde::Deserialize;
use serde_json::value::RawValue;

use crate::ModelId;

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
}

/// Why a request body could not be peeked. Every variant is a 400 for the caller.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
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
}

#[derive(Deserialize)]
struct Fields<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream_options: Option<&'a RawValue>,
    #[serde(borrow, default)]
    n: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_completion_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct StreamOptions<'a> {
    #[serde(borrow, default)]
    include_usage: Option<&'a RawValue>,
}

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

impl RequestPeek {
    /// Reads the peek fields from a JSON request body.
    ///
    /// # Errors
    ///
    /// [`PeekError`] when the body is not a JSON object, `model` is missing or not a non-empty
    /// string, or `stream`, `stream_options.include_usage`, `n`, `max_tokens`,
    /// `max_completion_tokens` or `prompt_cache_key` has the wrong type (`n` must be ≥ 1).
    pub fn from_json(body: &[u8]) -> Result<Self, PeekError> {
        let value: &RawValue =
            serde_json::from_slice(body).map_err(|e| PeekError::NotJson(e.to_string()))?;
        if !value.get().trim_start().starts_with('{') {
            return Err(PeekError::NotObject);
        }
        let fields: Fields<'_> =
            serde_json::from_str(value.get()).map_err(|e| PeekError::NotJson(e.to_string()))?;

        let model: String = parse_opt(fields.model, "model", "a non-empty string")?
            .ok_or(PeekError::MissingModel)?;
        if model.is_empty() {
            return Err(PeekError::InvalidField {
                field: "model",
                expected: "a non-empty string",
            });
        }
        let stream: bool = parse_opt(fields.stream, "stream", "a boolean")?.unwrap_or(false);
        let include_usage = match fields.stream_options {
            Some(r) if !is_null(r) => {
                let opts: StreamOptions<'_> =
                    serde_json::from_str(r.get()).map_err(|_| PeekError::InvalidField {
                        field: "stream_options",
                        expected: "an object",
                    })?;
                parse_opt(
                    opts.include_usage,
                    "stream_options.include_usage",
                    "a boolean",
                )?
                .unwrap_or(false)
            }
            _ => false,
        };
        let n: u32 = parse_opt(fields.n, "n", "an integer >= 1")?.unwrap_or(1);
        if n == 0 {
            return Err(PeekError::InvalidField {
                field: "n",
                expected: "an integer >= 1",
            });
        }
        let max_completion_tokens: Option<u64> = parse_opt(
            fields.max_completion_tokens,
            "max_completion_tokens",
            "a non-negative integer",
        )?;
        let max_tokens: Option<u64> =
            parse_opt(fields.max_tokens, "max_tokens", "a non-negative integer")?;
        let prompt_cache_key: Option<String> =
            parse_opt(fields.prompt_cache_key, "prompt_cache_key", "a string")?;
        Ok(Self {
            model: ModelId::new(model),
            stream,
            include_usage,
            n,
            max_tokens: max_completion_tokens.or(max_tokens),
            prompt_cache_key,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_fields_and_defaults() {
        let p = RequestPeek::from_json(br#"{"model":"smollm2","messages":[]}"#);
        assert_eq!(
            p,
            Ok(RequestPeek {
                model: ModelId::new("smollm2"),
                stream: false,
                include_usage: false,
                n: 1,
                max_tokens: None,
                prompt_cache_key: None,
            })
        );
        let p = RequestPeek::from_json(
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"n":2,
                "max_tokens":10,"max_completion_tokens":7,"prompt_cache_key":"k"}"#,
        );
        assert_eq!(
            p,
            Ok(RequestPeek {
                model: ModelId::new("m"),
                stream: true,
                include_usage: true,
                n: 2,
                max_tokens: Some(7),
                prompt_cache_key: Some("k".into()),
            })
        );
    }

    #[test]
    fn nulls_mean_defaults() {
        let p = RequestPeek::from_json(
            br#"{"model":"m","stream":null,"stream_options":null,"n":null,"max_tokens":null}"#,
        );
        assert_eq!(
            p.map(|p| (p.stream, p.include_usage, p.n, p.max_tokens)),
            Ok((false, false, 1, None))
        );
    }

    #[test]
    fn rejects_bad_bodies_with_exact_errors() {
        assert!(matches!(
            RequestPeek::from_json(b"{"),
            Err(PeekError::NotJson(_))
        ));
        assert_eq!(RequestPeek::from_json(b"[1]"), Err(PeekError::NotObject));
        assert_eq!(RequestPeek::from_json(b"{}"), Err(PeekError::MissingModel));
        assert_eq!(
            RequestPeek::from_json(br#"{"model":5}"#),
            Err(PeekError::InvalidField {
                field: "model",
                expected: "a non-empty string"
            })
        );
        assert_eq!(
            RequestPeek::from_json(br#"{"model":"m","stream":"yes"}"#),
            Err(PeekError::InvalidField {
                field: "stream",
                expected: "a boolean"
            })
        );
        assert_eq!(
            RequestPeek::from_json(br#"{"model":"m","n":0}"#),
            Err(PeekError::InvalidField {
                field: "n",
                expected: "an integer >= 1"
            })
        );
        assert_eq!(
            RequestPeek::from_json(br#"{"model":"m","max_tokens":-1}"#),
            Err(PeekError::InvalidField {
                field: "max_tokens",
                expected: "a non-negative integer"
            })
        );
    }

    proptest::proptest! {
        #[test]
        fn never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = RequestPeek::from_json(&bytes);
        }
    }
}
