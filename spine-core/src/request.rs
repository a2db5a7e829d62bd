//! One request on its way through the stack, typed once (issue 20): the edge's
//! [`RequestContext`] and the metering layer's [`BufferedRequest`], both carried in the request
//! extensions, so that no layer below re-derives what a layer above already knew (the endpoint
//! from the URI path, the body from a second collect, the peek from a second parse).
//!
//! ```text
//! edge (the gateway's handler)  inserts RequestContext   request id, account, key, kind, session
//! metering layer                reads it; collects the body once, parses it, counts it;
//!                               inserts BufferedRequest  body bytes (as sent on), peek, prompt tokens
//! router                        reads both; never collects or parses the body
//! ```

use bytes::Bytes;

use crate::{AccountId, RequestId, RequestKind, RequestPeek};

/// What the edge knows of one request before its body is read, set once in the request
/// extensions (as tower-http's `request_id` sets its id once): who asks, with which key, for
/// which endpoint, in which session.
///
/// The metering layer and the router read it first; without it they fall back to the separate
/// [`RequestId`] and [`AccountId`] extensions and the URI path (a stack built by hand, a test).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestContext {
    /// The request's id (the gateway's `req_<24 hex>`, echoed as `x-request-id`).
    pub request_id: RequestId,
    /// The authenticated caller's account.
    pub account: AccountId,
    /// The API key the caller presented, as the edge names it (the gateway: its SHA-256, hex);
    /// never the key itself. `None` when the edge did not authenticate with a key.
    pub key: Option<String>,
    /// Which endpoint the request is for.
    pub kind: RequestKind,
    /// The caller's own session key for affinity (the gateway: the `x-session-id` header); the
    /// router builds the affinity key from it, the body's `prompt_cache_key` or conversation key
    /// and the account.
    pub session: Option<String>,
}

impl RequestContext {
    /// A context with no key and no session.
    pub fn new(request_id: RequestId, account: AccountId, kind: RequestKind) -> Self {
        Self {
            request_id,
            account,
            key: None,
            kind,
            session: None,
        }
    }

    /// Sets the key's name (a hash of it, never the key).
    #[must_use]
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Sets the caller's session key for affinity.
    #[must_use]
    pub fn with_session(mut self, session: impl Into<String>) -> Self {
        self.session = Some(session.into());
        self
    }
}

/// The request body as the metering layer collected, parsed and counted it, handed to the layers
/// below in the request extensions: they read [`body`](Self::body) instead of collecting the
/// request's body again, and [`peek`](Self::peek) instead of parsing it.
///
/// The request still carries the same bytes as its body, for a layer that does not know this
/// type. A layer that reads this one leaves the request body unpolled.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BufferedRequest {
    /// The body as it goes on to the node: the caller's, with `stream_options.include_usage`
    /// set on a streamed request. Cheap to clone (reference-counted).
    pub body: Bytes,
    /// What the body says, read once by the metering layer.
    pub peek: RequestPeek,
    /// Tokens of the request's longest prompt, as metered (a node's context must hold them).
    pub prompt_tokens: u64,
}

impl BufferedRequest {
    /// The buffered request of `body`, read as `peek`, whose longest prompt is `prompt_tokens`.
    pub fn new(body: Bytes, peek: RequestPeek, prompt_tokens: u64) -> Self {
        Self {
            body,
            peek,
            prompt_tokens,
        }
    }
}
