//! The metered answer as the caller gets it.

use http::header::{self, HeaderName, HeaderValue};

/// The node's (metered) successful response as the caller gets it: its status, its
/// `content-type` and its body; the node's other headers (server, keep-alive, the length of a
/// body the meter may rewrite) stay behind. An SSE stream also gets `cache-control: no-cache`
/// and `x-accel-buffering: no`, so no proxy in front holds its events back.
///
/// A non-2xx answer is the application's to shape (e.g.
/// `openai_error::ApiError::from_node_response`, feature `axum`).
pub fn caller_response<B>(resp: http::Response<B>) -> http::Response<B> {
    let (parts, body) = resp.into_parts();
    let mut out = http::Response::new(body);
    *out.status_mut() = parts.status;
    let content_type = parts.headers.get(header::CONTENT_TYPE).cloned();
    let is_sse = spine_core::is_event_stream_response(&parts.headers);
    if let Some(ct) = content_type {
        out.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    if is_sse {
        out.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        out.headers_mut().insert(
            HeaderName::from_static("x-accel-buffering"),
            HeaderValue::from_static("no"),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_status_and_content_type_travel_and_sse_is_not_buffered() {
        let resp = http::Response::builder()
            .status(http::StatusCode::OK)
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::SERVER, "llama.cpp")
            .header(header::CONTENT_LENGTH, "12")
            .body(())
            .unwrap_or_default();
        let out = caller_response(resp);
        assert_eq!(out.status(), http::StatusCode::OK);
        let names: Vec<&str> = out.headers().keys().map(HeaderName::as_str).collect();
        assert_eq!(
            names,
            ["content-type", "cache-control", "x-accel-buffering"],
            "{names:?}"
        );
        let json = http::Response::builder()
            .header(header::CONTENT_TYPE, "application/json")
            .body(())
            .unwrap_or_default();
        assert_eq!(caller_response(json).headers().len(), 1);
    }
}
