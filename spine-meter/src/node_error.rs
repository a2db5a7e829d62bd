//! A node's non-2xx answer read as an error the caller can act on: the engine's message kept
//! (at most 1 KiB of it), the failure classified the way OpenAI's clients branch on it.
//!
//! Engines word their errors differently: llama.cpp answers `{"error":{"message","type"}}`
//! (`exceed_context_size_error` for a prompt over its context), vLLM and SGLang a top-level
//! `{"object":"error","message",…}`, Ollama a plain message. Only the application maps a
//! [`NodeError`] to an HTTP status and error code.

use http_body_util::BodyExt as _;
use spine_core::BoxBody;

/// Largest node error body read to extract its message, bytes.
pub const MAX_NODE_ERROR_BYTES: usize = 64 * 1024;
/// Longest node error message passed on to the caller, bytes (the rest is cut, with `…`).
pub const MAX_NODE_MESSAGE_BYTES: usize = 1024;

/// What a node's non-2xx answer means for the caller; `message` is the engine's own.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// The engine said the prompt is over its context (llama.cpp's `exceed_context_size_error`,
    /// or a 4xx message about the context length as vLLM, SGLang and Ollama word it).
    #[error("the prompt is over the node's context window: {message}")]
    ContextLengthExceeded {
        /// The engine's message.
        message: String,
    },
    /// 501: the engine does not support what was asked (e.g. tools without `--jinja`); asking
    /// again changes nothing.
    #[error("the node's engine does not support this request: {message}")]
    Unsupported {
        /// The engine's message.
        message: String,
    },
    /// Any other 4xx: the engine refused the request.
    #[error("the node's engine refused the request: {message}")]
    Rejected {
        /// The engine's status (4xx).
        status: http::StatusCode,
        /// The engine's message.
        message: String,
    },
    /// Anything else: the engine failed.
    #[error("the node's engine failed ({status}): {message}")]
    Failed {
        /// The engine's status.
        status: http::StatusCode,
        /// The engine's message.
        message: String,
    },
}

impl NodeError {
    /// Reads at most [`MAX_NODE_ERROR_BYTES`] of `resp`'s body (a read error ends the read) and
    /// classifies it ([`NodeError::classify`]).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future drops the body.
    pub async fn read(resp: http::Response<BoxBody>) -> Self {
        let status = resp.status();
        let mut body = resp.into_body();
        let mut buf = Vec::new();
        while buf.len() < MAX_NODE_ERROR_BYTES {
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        buf.extend_from_slice(&data);
                    }
                }
                Some(Err(_)) | None => break,
            }
        }
        Self::classify(status, &buf)
    }

    /// The error a node's non-2xx `status` with body `body` means. The message is the engine's
    /// `message` member (OpenAI's `error.message` or the top-level one of `{"object":"error"}`),
    /// else the first 512 bytes of the body, cut at [`MAX_NODE_MESSAGE_BYTES`].
    pub fn classify(status: http::StatusCode, body: &[u8]) -> Self {
        let parsed = serde_json::from_slice::<serde_json::Value>(body).ok();
        // OpenAI's `{"error":{…}}`, or vLLM's / SGLang's top-level `{"object":"error",…}`
        let field = |name: &str| {
            parsed
                .as_ref()
                .and_then(|v| {
                    v.pointer(&format!("/error/{name}"))
                        .or_else(|| (v["object"] == "error").then(|| v.get(name)).flatten())
                })
                .and_then(|m| m.as_str())
                .map(str::to_owned)
        };
        let mut message = field("message")
            .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned());
        if message.len() > MAX_NODE_MESSAGE_BYTES {
            let mut end = MAX_NODE_MESSAGE_BYTES;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
            message.push('…');
        }
        let lower = message.to_ascii_lowercase();
        let over_context = field("type").as_deref() == Some("exceed_context_size_error")
            || (status.is_client_error()
                && (lower.contains("context length")
                    || lower.contains("context size")
                    || lower.contains("context window")
                    || lower.contains("maximum context")));
        if over_context {
            Self::ContextLengthExceeded { message }
        } else if status == http::StatusCode::NOT_IMPLEMENTED {
            Self::Unsupported { message }
        } else if status.is_client_error() {
            Self::Rejected { status, message }
        } else {
            Self::Failed { status, message }
        }
    }
}

#[cfg(test)]
mod tests;
