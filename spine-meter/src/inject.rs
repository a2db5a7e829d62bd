//! Request-side rewriting: `stream_options.include_usage = true` (design brief §6), and the
//! logprobs an audit of the node's own tokens asks for (design brief §10).

use bytes::Bytes;
use indexmap::IndexMap;
use serde_json::value::RawValue;

/// Why a body could not be rewritten.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InjectError {
    /// The body is not a JSON object.
    #[error("request body is not a json object")]
    NotObject(#[source] serde_json::Error),
    /// `stream_options` is present but neither an object nor `null`.
    #[error("stream_options must be an object")]
    StreamOptionsNotObject(#[source] serde_json::Error),
}

/// Sets `stream_options.include_usage = true` in a JSON request body.
///
/// Other `stream_options` keys are kept (in order, byte for byte); every other top-level member
/// is forwarded byte for byte, in its original order. Insignificant whitespace between top-level
/// members is not kept. A `null` `stream_options` becomes `{"include_usage":true}`. Duplicate
/// top-level keys keep the last value (as JSON parsers downstream would).
///
/// # Errors
///
/// [`InjectError`] when the body is not a JSON object or `stream_options` is not an object.
pub fn inject_include_usage(body: &[u8]) -> Result<Bytes, InjectError> {
    let mut top: IndexMap<String, &RawValue> =
        serde_json::from_slice(body).map_err(InjectError::NotObject)?;
    let mut opts: IndexMap<String, &RawValue> = match top.get("stream_options") {
        Some(raw) if raw.get().trim() != "null" => {
            serde_json::from_str(raw.get()).map_err(InjectError::StreamOptionsNotObject)?
        }
        _ => IndexMap::new(),
    };
    let yes: &RawValue = serde_json::from_str("true").map_err(InjectError::NotObject)?;
    opts.insert("include_usage".to_owned(), yes);
    let opts_json = serde_json::to_string(&opts).map_err(InjectError::NotObject)?;
    let opts_raw = RawValue::from_string(opts_json).map_err(InjectError::NotObject)?;
    top.insert("stream_options".to_owned(), &opts_raw);
    serde_json::to_vec(&top)
        .map(Bytes::from)
        .map_err(InjectError::NotObject)
}

/// Whether a request body asks for logprobs itself: a chat request's `logprobs: true` or any
/// `top_logprobs`, a completions request's `logprobs` of at least 1 (`kind` says which shape).
pub fn asks_logprobs(chat: bool, body: &serde_json::Value) -> bool {
    let member = |k: &str| body.get(k).filter(|v| !v.is_null());
    if chat {
        member("logprobs").is_some_and(|v| v.as_bool() != Some(false))
            || member("top_logprobs").is_some()
    } else {
        member("logprobs").is_some_and(|v| v.as_u64() != Some(0))
    }
}

/// Adds the logprobs an audit of the node's own tokens needs to a JSON request body: chat
/// `"logprobs": true, "top_logprobs": 1`, completions `"logprobs": 1`. Every other top-level
/// member is forwarded byte for byte, in order (as [`inject_include_usage`]).
///
/// # Errors
///
/// [`InjectError::NotObject`] when the body is not a JSON object.
pub fn inject_logprobs(body: &[u8], chat: bool) -> Result<Bytes, InjectError> {
    let mut top: IndexMap<String, &RawValue> =
        serde_json::from_slice(body).map_err(InjectError::NotObject)?;
    let yes: &RawValue = serde_json::from_str("true").map_err(InjectError::NotObject)?;
    let one: &RawValue = serde_json::from_str("1").map_err(InjectError::NotObject)?;
    if chat {
        top.insert("logprobs".to_owned(), yes);
        top.insert("top_logprobs".to_owned(), one);
    } else {
        top.insert("logprobs".to_owned(), one);
    }
    serde_json::to_vec(&top)
        .map(Bytes::from)
        .map_err(InjectError::NotObject)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn inj(s: &str) -> String {
        String::from_utf8(inject_include_usage(s.as_bytes()).unwrap().to_vec()).unwrap()
    }

    #[test]
    fn adds_stream_options_and_keeps_everything_else_byte_exact() {
        assert_eq!(
            inj(r#"{"model":"m","temperature":1.50,"x":{"a" : [1, 2]},"stream":true}"#),
            r#"{"model":"m","temperature":1.50,"x":{"a" : [1, 2]},"stream":true,"stream_options":{"include_usage":true}}"#
        );
    }

    #[test]
    fn merges_with_client_stream_options() {
        // hostile-streams.json H11
        assert_eq!(
            inj(
                r#"{"stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":false},"n":1}"#
            ),
            r#"{"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":false},"n":1}"#
        );
        assert_eq!(
            inj(r#"{"stream_options":null}"#),
            r#"{"stream_options":{"include_usage":true}}"#
        );
        assert_eq!(
            inj(r#"{"s":"\u00e9\n","stream_options":{"k":1e3}}"#),
            r#"{"s":"\u00e9\n","stream_options":{"k":1e3,"include_usage":true}}"#
        );
    }

    #[test]
    fn logprobs_are_added_and_asked_ones_recognized() {
        let chat = inject_logprobs(br#"{"model":"m","logprobs":false,"x":1.50}"#, true).unwrap();
        assert_eq!(
            &chat[..],
            br#"{"model":"m","logprobs":true,"x":1.50,"top_logprobs":1}"#
        );
        let cmpl = inject_logprobs(br#"{"prompt":"p"}"#, false).unwrap();
        assert_eq!(&cmpl[..], br#"{"prompt":"p","logprobs":1}"#);
        let v = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
        assert!(asks_logprobs(true, &v(r#"{"logprobs":true}"#)));
        assert!(asks_logprobs(true, &v(r#"{"top_logprobs":2}"#)));
        assert!(!asks_logprobs(true, &v(r#"{"logprobs":false}"#)));
        assert!(!asks_logprobs(true, &v(r#"{"logprobs":null}"#)));
        assert!(asks_logprobs(false, &v(r#"{"logprobs":2}"#)));
        assert!(!asks_logprobs(false, &v(r#"{"logprobs":0}"#)));
        assert!(!asks_logprobs(false, &v(r#"{}"#)));
    }

    #[test]
    fn refuses_non_objects() {
        assert!(matches!(
            inject_include_usage(b"[1]"),
            Err(InjectError::NotObject(_))
        ));
        assert!(matches!(
            inject_include_usage(br#"{"stream_options":5}"#),
            Err(InjectError::StreamOptionsNotObject(_))
        ));
    }
}
