use std::task::{Context, Poll};

use spine_core::{BoxBody, BoxError};
use tower::{Layer, Service, ServiceExt};

use super::config::RouteCtx;
use super::retry::route;
use super::{ResponseFuture, RouteLayer};
use crate::NodeRegistry;

/// Picks a node for each request (conversation affinity, then a weighted pick by reliability
/// score; design brief §5) and hands the request to the inner (transport) service, retrying on
/// another node while nothing has reached the caller.
///
/// Per request:
/// 1. Reads the model from the metering layer's [`BufferedRequest`] (else the [`RequestPeek`]
///    request extension), the kind, account and session from the edge's [`RequestContext`]
///    (else the URI path and the [`AccountId`] / [`SessionId`] extensions) and the affinity key
///    ([`AffinityKey::for_request`]: `prompt_cache_key`, else the session or the
///    `x-session-id` header, else the automatic conversation key).
/// 2. Takes the body bytes from the [`BufferedRequest`], leaving the request body unpolled (the
///    body is collected and parsed once, by the metering layer); without one it collects the
///    request body to `Bytes` once. Every attempt sends the same bytes.
/// 3. Each attempt: picks a node not tried yet among those that fit the request's endpoint and
///    [`PromptTokens`] (the [`BufferedRequest`]'s when there is one; [`NodeRegistry::acquire`];
///    every attempt waits in the model's admission [`queue`] when they are all full, with the
///    account as its fairness class and the [`QueueWeight`] extension as its weight), inserts its [`NodeId`] into the request
///    extensions (the transport reads it) and records it in the [`NodeSlot`] extension, calls the
///    inner service, then
///    - inner error (connect failure, tunnel gone) or a 502 / 503 / 504, 408 or 429 head (and
///      401 / 403 / 404 / 405…): failure of the node, scored at once, retry;
///    - any other 5xx head: an *answer-type* failure, retry; scored only as described below;
///    - an inner error recognised by [`RouteLayer::not_node_fault`] (the tunnel's per-node stream
///      limit): retry, not scored against the node;
///    - a 400, 413 or 422 head (the request called wrong): an *answer-type* failure of its own
///      kind (any two of the three are alike), retry; scored only as described below — a node
///      that refuses every request would otherwise draw no work and keep its score;
///    - 2xx: buffers body frames and feeds them to the classifier until it says
///      [`BodySignal::Content`] (commit) or [`BodySignal::Failed`] (error event or empty stream:
///      an answer-type failure, retry; a body broken before content: a disconnect, scored at
///      once, retry).
///    - nothing committed within [`RouteConfig::first_content_timeout`] of sending: failure,
///      retry ([`RouteError::FirstContentTimeout`] when no retry is left);
/// 4. At most [`RouteConfig::max_retries`] retries, and none after the second identical
///    answer-type failure; when none is left (or no untried node has a slot) the last failed
///    answer is returned as it came (a non-2xx response, the buffered error stream) or its error.
///
/// # Failures that follow the request
///
/// An answer-type failure may be the request's doing rather than the node's: a body that every
/// llama-server rejects with 500 ("Failed to parse tools") would otherwise cost each node it
/// reaches a ×0.8 penalty while the caller pays nothing, and `prompt_cache_key` lets a caller aim
/// it at one node. So these failures are not scored when they happen; when the request's
/// attempts are over:
/// - a later attempt on another node committed → the request was servable: every earlier
///   answer-type failure is recorded as the node's failure;
/// - the same answer-type failure (same 5xx status, or both an error event / both an empty
///   stream) on a second node → the request itself fails: no further node is tried, the second
///   answer goes back to the caller, and neither node is scored
///   (`spine_router_attempts_total{result="request_fault"}`);
/// - a refusal (400 / 413 / 422) on a second node → the request was bad: likewise, the second
///   refusal goes to the caller and neither node is scored (`request_fault`); a lone node's
///   refusal is `unresolved` (below) and goes to the caller unscored;
/// - otherwise (a single candidate, `max_retries` 0, different failures on different nodes with
///   no node left, the other attempts all connect failures or timeouts) → not scored either
///   (`result="unresolved"`). With one answer there is nothing to compare it with, and scoring it
///   would reopen the attack on any node that happens to be the only one left. The price: a lone
///   node that fails every request this way is not penalised while it is alone; as soon as
///   another node serves a request it failed, it is. Two *different* failures alone do not
///   implicate either node (nodes run different engines and versions, which reject a bad request
///   differently); they only keep the retries going, and a later success scores them all.
///
/// Connect failures, timeouts to first content, bodies broken before content (disconnects) and
/// the other statuses above are scored at once, as before; node full is never scored.
///
/// A committed response carries the [`NodeId`] in its extensions and the node's in-flight lease in
/// its body until the body ends or is dropped. The body keeps feeding the classifier: at its end
/// the attempt is recorded as a success (with its TTFT if streamed) or, after an error event, a
/// failure; a body that breaks is a mid-request disconnect (score halved), and so is one that
/// sends nothing for [`RouteConfig::stream_idle_timeout`] (it then ends with
/// [`RouteError::StreamIdleTimeout`] and the node's body is dropped). It is never retried
/// after commit: the caller's stream ends with the error (the metering layer turns it into an
/// OpenAI-shaped error event). A body dropped early (the caller left, or the layer above
/// stopped after the last event) counts as a success unless a failure was seen.
///
/// # Errors
///
/// A [`RouteError`] (boxed) when no node can be picked for the first attempt; otherwise the last
/// attempt's inner error or body error.
///
/// [`RequestPeek`]: spine_core::RequestPeek
/// [`BufferedRequest`]: spine_core::BufferedRequest
/// [`RequestContext`]: spine_core::RequestContext
/// [`AffinityKey::for_request`]: crate::AffinityKey::for_request
/// [`SessionId`]: crate::SessionId
/// [`PromptTokens`]: spine_core::PromptTokens
/// [`queue`]: crate::queue
/// [`AccountId`]: spine_core::AccountId
/// [`QueueWeight`]: crate::QueueWeight
/// [`NodeId`]: spine_core::NodeId
/// [`NodeSlot`]: spine_core::NodeSlot
/// [`BodySignal::Content`]: spine_core::BodySignal::Content
/// [`BodySignal::Failed`]: spine_core::BodySignal::Failed
/// [`RouteError::FirstContentTimeout`]: crate::RouteError::FirstContentTimeout
/// [`RouteError::StreamIdleTimeout`]: crate::RouteError::StreamIdleTimeout
/// [`RouteError`]: crate::RouteError
/// [`RouteConfig::first_content_timeout`]: crate::RouteConfig::first_content_timeout
/// [`RouteConfig::max_retries`]: crate::RouteConfig::max_retries
/// [`RouteConfig::stream_idle_timeout`]: crate::RouteConfig::stream_idle_timeout
#[derive(Debug, Clone)]
pub struct Route<S> {
    pub(super) inner: S,
    pub(super) ctx: RouteCtx,
}

impl<S> Route<S> {
    /// Wraps `inner` with the defaults of [`RouteLayer::new`].
    pub fn new(inner: S, registry: NodeRegistry) -> Self {
        RouteLayer::new(registry).layer(inner)
    }

    spine_core::inner_service_accessors!(inner: S);
}

impl<S, E> Service<http::Request<BoxBody>> for Route<S>
where
    S: Service<http::Request<BoxBody>, Response = http::Response<BoxBody>, Error = E>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    E: Into<BoxError> + 'static,
{
    type Response = http::Response<BoxBody>;
    type Error = BoxError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<BoxBody>) -> Self::Future {
        // the ready service goes into the future; a fresh clone stays behind (tower's pattern)
        let clone = self.inner.clone();
        let inner =
            std::mem::replace(&mut self.inner, clone).map_err(Into::into as fn(E) -> BoxError);
        ResponseFuture {
            inner: Box::pin(route(inner, self.ctx.clone(), req)),
        }
    }
}
