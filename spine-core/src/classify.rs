/// What the bytes of a response body seen so far say about one attempt on a node.
///
/// The router (design brief §5) may retry a request on another node only before the first content
/// byte reaches the caller. It buffers the body's first frames and feeds them to a
/// [`BodyClassifier`] until the classifier answers [`BodySignal::Content`] (commit: forward and
/// never retry) or [`BodySignal::Failed`] (retry elsewhere if allowed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodySignal {
    /// Nothing decisive yet (SSE: only role, usage or keepalive events so far).
    Pending,
    /// The node produced content (a token, a finish, a complete non-streamed body): the attempt
    /// is committed. Returned again for every later chunk while no failure is seen.
    Content,
    /// The node failed: an error event, an empty stream, bytes that cannot be parsed.
    Failed,
}

/// Classifies one response body, chunk by chunk (see [`BodySignal`]).
///
/// Implementations keep their own state; once they return [`BodySignal::Failed`] they keep
/// returning it. The router keeps feeding a committed body so that a failure after the first
/// byte (an error event mid-stream) still counts against the node's score.
pub trait BodyClassifier: Send {
    /// The next chunk of body bytes, exactly as they arrived.
    fn feed(&mut self, chunk: &[u8]) -> BodySignal;

    /// The body ended cleanly; what does the whole body say?
    fn finish(&mut self) -> BodySignal;
}

/// Makes a [`BodyClassifier`] for each 2xx response, from its `Content-Type`.
///
/// The metering crate provides one that parses SSE (`spine_meter::classify::SseClassify`); the
/// router's default is [`FirstBytes`] for every body.
pub trait ClassifyBody: Send + Sync + std::fmt::Debug + 'static {
    /// A classifier for a body with this `Content-Type` header value (`None` when absent).
    fn classifier(&self, content_type: Option<&str>) -> Box<dyn BodyClassifier>;

    /// A classifier for the answer to a request for `choices` choices (its `n`): content of a
    /// choice past them is none of the caller's (the metering layer drops it), so it must not
    /// count as the answer's first content. Default: [`classifier`](Self::classifier).
    fn classifier_for(&self, content_type: Option<&str>, choices: u32) -> Box<dyn BodyClassifier> {
        let _ = choices;
        self.classifier(content_type)
    }
}

/// Classifies without parsing: the first non-empty chunk is content, a body that ends with no
/// byte failed.
#[derive(Clone, Copy, Debug, Default)]
pub struct FirstBytes {
    seen_bytes: bool,
}

impl BodyClassifier for FirstBytes {
    fn feed(&mut self, chunk: &[u8]) -> BodySignal {
        if !chunk.is_empty() {
            self.seen_bytes = true;
        }
        if self.seen_bytes {
            BodySignal::Content
        } else {
            BodySignal::Pending
        }
    }

    fn finish(&mut self) -> BodySignal {
        if self.seen_bytes {
            BodySignal::Content
        } else {
            BodySignal::Failed
        }
    }
}

impl ClassifyBody for FirstBytes {
    fn classifier(&self, _content_type: Option<&str>) -> Box<dyn BodyClassifier> {
        Box::new(FirstBytes::default())
    }
}

/// Whether `headers` say the body is a Server-Sent Events stream: a `Content-Type` of
/// `text/event-stream` ([`is_event_stream`]).
pub fn is_event_stream_response(headers: &http::HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| is_event_stream(v.as_bytes()))
}

/// Whether a `Content-Type` value is `text/event-stream` (WHATWG HTML, "Server-sent events"):
/// the media type in any case (RFC 9110 §8.3.1), after optional whitespace, then the value's
/// end, whitespace or parameters (`; charset=utf-8`). `text/event-streamx` is not. Every part of
/// spine that tells a stream from a complete answer asks this, so the meter, the router's
/// classifier, the ledger's record and the tunnel agree on every node's header.
pub fn is_event_stream(value: &[u8]) -> bool {
    const TYPE: &[u8] = b"text/event-stream";
    let value = value.trim_ascii_start();
    value.len() >= TYPE.len()
        && value[..TYPE.len()].eq_ignore_ascii_case(TYPE)
        && value
            .get(TYPE.len())
            .is_none_or(|b| *b == b';' || b.is_ascii_whitespace())
}

#[cfg(test)]
mod tests;
