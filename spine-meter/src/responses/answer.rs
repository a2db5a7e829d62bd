//! The request and answer ends of a `/v1/responses` call as an application serves it: the
//! caller's body read and translated into a chat completion body ([`translate_request`]), and
//! the metered chat answer re-shaped as the Responses answer the caller asked for
//! ([`ResponsesAnswer::reshape`]).

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http_body_util::BodyExt as _;
use spine_core::{BoxBody, BoxError};

use super::{
    chat_json_as_stream, chat_request, response_from_chat, ResponseMeta, ResponsesError,
    ResponsesSse,
};

/// Why a `/v1/responses` request could not be translated.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TranslateError {
    /// The body is longer than the limit, bytes.
    #[error("request body larger than {limit} bytes")]
    TooLarge {
        /// The limit, bytes.
        limit: usize,
    },
    /// The body could not be read.
    #[error("cannot read the request body: {0}")]
    Unreadable(#[source] BoxError),
    /// The body is not a Responses request this translation serves.
    #[error("{}", .0.message)]
    Invalid(ResponsesError),
}

/// Why a metered chat answer could not be re-shaped as a Responses answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReshapeError {
    /// A stream converted for a non-streamed request ended before it was complete (and was not
    /// billed): the node's fault.
    #[error("the node's answer ended before it was complete")]
    Incomplete,
    /// A JSON answer could not be converted (the meter already checked it: a bug).
    #[error("cannot build the response object: {0}")]
    Unconvertible(String),
}

/// A translated request's body (a chat completion request, JSON) and what its answer needs.
///
/// Reads at most `limit` bytes of `body`; `request_id` becomes the response id (`resp_…`).
///
/// # Errors
///
/// [`TranslateError`]: too large, unreadable, or not a request this translation serves.
///
/// # Cancel safety
///
/// Cancel safe: dropping the future drops the body.
pub async fn translate_request<B>(
    body: B,
    limit: usize,
    request_id: &str,
) -> Result<(BoxBody, ResponsesAnswer), TranslateError>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    let bytes = match http_body_util::Limited::new(body, limit).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(TranslateError::TooLarge { limit })
        }
        Err(e) => return Err(TranslateError::Unreadable(e)),
    };
    translate_body(&bytes, request_id).map_err(TranslateError::Invalid)
}

/// [`translate_request`] of a body already read whole (within the bounds the application
/// keeps, e.g. [`BodyGate`](crate::meter::BodyGate)).
///
/// # Errors
///
/// A [`ResponsesError`] when `body` is not a Responses request this translation serves.
pub fn translate_body(
    body: &[u8],
    request_id: &str,
) -> Result<(BoxBody, ResponsesAnswer), ResponsesError> {
    let translation = chat_request(body)?;
    let meta = ResponseMeta::new(request_id, translation.echo);
    let body = http_body_util::Full::new(Bytes::from(translation.chat_body))
        .map_err(|never| match never {});
    let answer = ResponsesAnswer {
        meta,
        stream: translation.stream,
    };
    Ok((BoxBody::new(body), answer))
}

/// The name the Responses API gives a chat request member an error names: `messages` is
/// `input`, `max_tokens` and `max_completion_tokens` are `max_output_tokens`; `None` for the
/// others (their names are the same).
pub fn responses_param(chat_param: &str) -> Option<&'static str> {
    match chat_param {
        "messages" => Some("input"),
        "max_tokens" | "max_completion_tokens" => Some("max_output_tokens"),
        _ => None,
    }
}

/// Buffers a whole body (one the meter has already bounded). A plain function returning a
/// boxed future: collecting a `BoxBody` inside an async fn trips rustc's higher-ranked check
/// on its `dyn Error` (as the meter's own body buffering notes).
fn collect_bytes(body: BoxBody) -> Pin<Box<dyn Future<Output = Result<Bytes, String>> + Send>> {
    let mut collect = Box::pin(body.collect());
    Box::pin(std::future::poll_fn(move |cx| {
        collect
            .as_mut()
            .poll(cx)
            .map(|r| r.map(|c| c.to_bytes()).map_err(|e| e.to_string()))
    }))
}

fn with_body(
    mut parts: http::response::Parts,
    content_type: &'static str,
    body: Bytes,
) -> http::Response<BoxBody> {
    parts
        .headers
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    let body = http_body_util::Full::new(body).map_err(|never| match never {});
    http::Response::from_parts(parts, BoxBody::new(body))
}

/// What a `/v1/responses` answer needs: its meta, and whether the caller asked for a stream.
#[derive(Debug)]
pub struct ResponsesAnswer {
    meta: ResponseMeta,
    stream: bool,
}

impl ResponsesAnswer {
    /// Whether the caller asked for a stream.
    pub fn stream(&self) -> bool {
        self.stream
    }

    /// A metered chat answer as the Responses answer the caller asked for: a stream re-shaped
    /// as it flows, a JSON body (already buffered by the meter) converted whole. A node that
    /// answered in the other shape (a whole body to a streamed request, or a stream to one that
    /// was not) is re-shaped too: the request is already metered, so the caller gets what it
    /// paid for in the shape its SDK expects. A non-2xx answer is returned as it is.
    ///
    /// # Errors
    ///
    /// [`ReshapeError`]: a stream that ended incomplete (and unbilled) for a non-streamed
    /// request, or a JSON answer that cannot be converted.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future drops the answer's body.
    pub async fn reshape(
        self,
        resp: http::Response<BoxBody>,
    ) -> Result<http::Response<BoxBody>, ReshapeError> {
        if !resp.status().is_success() {
            return Ok(resp);
        }
        let Self { meta, stream } = self;
        let streamed = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let (mut parts, body) = resp.into_parts();
        parts.headers.remove(header::CONTENT_LENGTH);
        match (stream, streamed) {
            (true, true) => {
                let body = ResponsesSse::new(body, meta);
                Ok(http::Response::from_parts(parts, BoxBody::new(body)))
            }
            (true, false) => {
                let whole = collect_bytes(body).await.unwrap_or_default();
                let chat = http_body_util::Full::new(chat_json_as_stream(&whole))
                    .map_err(|never| match never {});
                let body = ResponsesSse::new(BoxBody::new(chat), meta);
                parts.headers.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/event-stream"),
                );
                Ok(http::Response::from_parts(parts, BoxBody::new(body)))
            }
            (false, true) => {
                // the stream converted, and its final response object is the answer
                let events = collect_bytes(BoxBody::new(ResponsesSse::new(body, meta)))
                    .await
                    .unwrap_or_default();
                let last = String::from_utf8_lossy(&events)
                    .split("\n\n")
                    .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
                    .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
                    .filter(|v| v["type"] != "error")
                    .last();
                // a failed answer that was billed (cut at a gateway bound: its usage is there)
                // is returned as the failed response object, since the caller pays for its output
                match last {
                    Some(v)
                        if v["response"]["status"] != "failed"
                            || v["response"]["usage"].is_object() =>
                    {
                        let bytes = Bytes::from(v["response"].to_string());
                        Ok(with_body(parts, "application/json", bytes))
                    }
                    _ => Err(ReshapeError::Incomplete),
                }
            }
            (false, false) => {
                let converted = match collect_bytes(body).await {
                    Ok(bytes) => response_from_chat(&bytes, &meta),
                    Err(e) => Err(e),
                };
                let v = converted.map_err(ReshapeError::Unconvertible)?;
                Ok(with_body(
                    parts,
                    "application/json",
                    Bytes::from(v.to_string()),
                ))
            }
        }
    }
}
