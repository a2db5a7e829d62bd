use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use spine_core::{
    AccountId, BodyClassifier, BodySignal, BoxBody, BoxError, ClassifyBody, FirstBytes, NodeId,
    NodeSlot, PromptTokens, RequestKind, RequestPeek,
};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

use crate::affinity::{AffinityKey, AffinityStore, SessionId};
use crate::idle::IdleTimer;
use crate::{Ask, InFlightLease, Needs, NodeRegistry, QueueTicket, QueueWeight, RouteError};

/// Settings of [`Route`]. [`Default`] gives the documented values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteConfig {
    /// Further attempts after the first, each on a node not tried yet for this request. Default 2.
    pub max_retries: u32,
    /// Bytes of a 2xx body buffered while waiting for its first content event. Past this the
    /// attempt is committed as is (forwarded, no longer retried). Default 1 MiB.
    pub max_buffered_bytes: usize,
    /// How long an attempt may take, from the moment it is sent, to reach its commit (a non-2xx
    /// head, or a 2xx head and its first content). Past it the attempt is a failure of the node
    /// and is retried on another node while retries are left; otherwise the request fails with
    /// [`RouteError::FirstContentTimeout`]. Default 120 s; `Duration::ZERO` disables it.
    pub first_content_timeout: Duration,
    /// Longest gap between two frames of the node's body once the response is committed (and,
    /// for a non-2xx answer that goes to the caller, after its head), counted from the commit
    /// for the first frame. Past it the node is stalled (e.g. its agent answers PINGs but its
    /// engine sends nothing): the body ends with [`RouteError::StreamIdleTimeout`], the node is
    /// scored as for a mid-request disconnect, its in-flight slot is freed and its body is
    /// dropped (the tunnel stream is reset, so the agent cancels the engine request). Never
    /// retried: bytes already reached the caller. Default 120 s; `Duration::ZERO` disables it.
    pub stream_idle_timeout: Duration,
}

impl Default for RouteConfig {
    fn default() -> Self {
        Self {
            max_retries: 2,
            max_buffered_bytes: 1024 * 1024,
            first_content_timeout: Duration::from_secs(120),
            stream_idle_timeout: Duration::from_secs(120),
        }
    }
}

/// Applies [`Route`] to a service: picks the node for each request, retries before the first
/// byte.
#[derive(Debug, Clone)]
pub struct RouteLayer {
    registry: NodeRegistry,
    classify: Arc<dyn ClassifyBody>,
    config: RouteConfig,
    not_node_fault: NotNodeFault,
    node_full: NotNodeFault,
    affinity: Option<Arc<dyn AffinityStore>>,
}

/// How many times one request may find its picked node momentarily full
/// ([`RouteLayer::node_full`]) and pick again, besides [`RouteConfig::max_retries`].
pub const MAX_FULL_REPICKS: u32 = 3;

/// The pause before picking again after a node was found momentarily full: long enough for the
/// stream that just ended to be released on both ends of the tunnel (a few scheduler turns).
const FULL_REPICK_PAUSE: Duration = Duration::from_millis(5);

/// Tells whether an inner service error is the gateway's own refusal (e.g. the tunnel's per-node
/// stream limit) rather than a fault of the node: such an attempt is retried on another node but
/// not scored against the node.
pub type NotNodeFault = fn(&BoxError) -> bool;

fn never_not_node_fault(_: &BoxError) -> bool {
    false
}

impl RouteLayer {
    /// A layer that picks nodes from `registry`, with [`RouteConfig::default`] and the
    /// [`FirstBytes`] classifier (any first byte commits; use [`RouteLayer::classify`] to give it
    /// an SSE-aware one).
    pub fn new(registry: NodeRegistry) -> Self {
        Self {
            registry,
            classify: Arc::new(FirstBytes::default()),
            config: RouteConfig::default(),
            not_node_fault: never_not_node_fault,
            node_full: never_not_node_fault,
            affinity: None,
        }
    }

    /// Keeps conversation affinity in `store` (shared by several gateway instances) as well as
    /// in the registry's in-memory table, which is the fallback when the store fails. See
    /// [`AffinityStore`]. Default: the in-memory table only.
    pub fn affinity_store(mut self, store: Arc<dyn AffinityStore>) -> Self {
        self.affinity = Some(store);
        self
    }

    /// Decides when a 2xx body has started (its first content) or failed before it; the metering
    /// crate provides `spine_meter::classify::SseClassify`.
    pub fn classify(mut self, classify: Arc<dyn ClassifyBody>) -> Self {
        self.classify = classify;
        self
    }

    /// Sets the retry bound and buffer limit.
    pub fn config(mut self, config: RouteConfig) -> Self {
        self.config = config;
        self
    }

    /// Recognises inner errors that are the gateway's own refusal, not the node's fault (the
    /// gateway passes `TunnelError::is_node_full`): retried elsewhere, never scored. By default
    /// every inner error counts against the node.
    pub fn not_node_fault(mut self, not_node_fault: NotNodeFault) -> Self {
        self.not_node_fault = not_node_fault;
        self
    }

    /// Recognises inner errors that say the picked node was *momentarily* full (the gateway
    /// passes `TunnelError::is_node_full`: the tunnel's stream slot of a request that just ended
    /// is not released yet, or the node refused an HTTP/2 stream with `REFUSED_STREAM`, which
    /// RFC 9113 §8.7 says was not processed). Such an attempt is not scored and the node stays a
    /// candidate: after a pause of a few milliseconds the request picks again — waiting in the
    /// admission queue if every node is full — at most [`MAX_FULL_REPICKS`] times, besides
    /// [`RouteConfig::max_retries`]. An error recognised here is treated as
    /// [`not_node_fault`](Self::not_node_fault) too. By default no error is.
    pub fn node_full(mut self, node_full: NotNodeFault) -> Self {
        self.node_full = node_full;
        self
    }
}

impl<S> Layer<S> for RouteLayer {
    type Service = Route<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Route {
            inner,
            registry: self.registry.clone(),
            classify: self.classify.clone(),
            config: self.config,
            not_node_fault: self.not_node_fault,
            node_full: self.node_full,
            affinity: self.affinity.clone(),
        }
    }
}

/// Picks a node for each request (conversation affinity, then a weighted pick by reliability
/// score; design brief §5) and hands the request to the inner (transport) service, retrying on
/// another node while nothing has reached the caller.
///
/// Per request:
/// 1. Reads the model from the [`RequestPeek`] request extension and the affinity key
///    ([`AffinityKey::for_request`]: `prompt_cache_key`, else [`SessionId`] extension or
///    `x-session-id` header, else the automatic conversation key).
/// 2. Collects the request body to `Bytes` once (the metering layer above has it buffered), so
///    that every attempt sends the same bytes.
/// 3. Each attempt: picks a node not tried yet among those that fit the request's endpoint and
///    [`PromptTokens`] ([`NodeRegistry::acquire`]; every attempt waits in the model's
///    admission [`queue`](crate::queue) when they are all full, with the [`AccountId`] extension
///    as its fairness class and the [`QueueWeight`] extension as its weight), inserts its [`NodeId`] into the request
///    extensions (the transport reads it) and records it in the [`NodeSlot`] extension, calls the
///    inner service, then
///    - inner error (connect failure, tunnel gone) or a 502 / 503 / 504, 408 or 429 head (and
///      401 / 403 / 404 / 405…): failure of the node, scored at once, retry;
///    - any other 5xx head: an *answer-type* failure, retry; scored only as described below;
///    - an inner error recognised by [`RouteLayer::not_node_fault`] (the tunnel's per-node stream
///      limit): retry, not scored against the node;
///    - any other 4xx head (the caller's fault): returned to the caller as is, no retry, not
///      scored;
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
/// - a later node answers with the caller's 4xx → likewise not scored (`request_fault`);
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
#[derive(Debug, Clone)]
pub struct Route<S> {
    inner: S,
    registry: NodeRegistry,
    classify: Arc<dyn ClassifyBody>,
    config: RouteConfig,
    not_node_fault: NotNodeFault,
    node_full: NotNodeFault,
    affinity: Option<Arc<dyn AffinityStore>>,
}

impl<S> Route<S> {
    /// Wraps `inner` with the defaults of [`RouteLayer::new`].
    pub fn new(inner: S, registry: NodeRegistry) -> Self {
        RouteLayer::new(registry).layer(inner)
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// Response future of [`Route`].
pub struct ResponseFuture {
    inner: Pin<Box<dyn Future<Output = Result<http::Response<BoxBody>, BoxError>> + Send>>,
}

impl std::fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl Future for ResponseFuture {
    type Output = Result<http::Response<BoxBody>, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
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
            inner: Box::pin(route(
                inner,
                RouteCtx {
                    registry: self.registry.clone(),
                    classify: self.classify.clone(),
                    config: self.config,
                    not_node_fault: self.not_node_fault,
                    node_full: self.node_full,
                    affinity: self.affinity.clone(),
                },
                req,
            )),
        }
    }
}

/// How one attempt ended before commit.
enum Attempt {
    Committed(http::Response<BoxBody>),
    /// The caller's own fault (a 4xx other than 408/429): returned as is, not retried.
    Final(http::Response<BoxBody>),
    /// A failure, with its answer (or error) for the caller if no retry is left. `None`: already
    /// scored (connect failure, timeout, broken body) or never scored (node full); `Some`: an
    /// answer-type failure whose scoring waits for the other attempts (see [`Route`]).
    Failed(
        Result<http::Response<BoxBody>, BoxError>,
        Option<AnswerFault>,
    ),
    /// The node was momentarily full ([`RouteLayer::node_full`]): not scored, and the node may
    /// be picked again.
    Full(BoxError),
}

/// An answer-type failure before the first byte: the node answered, but with a failure that may
/// follow the request rather than the node. Two equal values on two nodes mean the request
/// itself fails (no third node is tried, neither node is scored).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AnswerFault {
    /// A 5xx head other than 502 / 503 / 504 (e.g. llama-server's 500 "Failed to parse tools").
    Status(u16),
    /// A 2xx stream that failed before its first content: an error event (`empty: false`) or a
    /// stream that ended with nothing at all (`empty: true`).
    Stream {
        /// Whether the node sent no byte at all.
        empty: bool,
    },
}

/// Answer-type failures of one request whose scoring waits until its attempts are over.
#[derive(Default)]
struct Deferred(Vec<(NodeId, AnswerFault)>);

impl Deferred {
    /// A later attempt on another node committed: the request was servable, so every earlier
    /// answer-type failure was the node's fault.
    fn node_faults(self, registry: &NodeRegistry) {
        for (node, _) in self.0 {
            registry.record_failure(&node);
        }
    }

    /// The attempts are over without a commit: nothing proves the nodes wrong. `result` is the
    /// [`ATTEMPTS_METRIC`](crate::ATTEMPTS_METRIC) label: `request_fault` (the same failure on
    /// two nodes, or a caller's 4xx from another node) or `unresolved` (no other node answered
    /// to compare with).
    fn unscored(self, result: &'static str) {
        if !self.0.is_empty() {
            tracing::info!(
                nodes = ?self.0.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
                result,
                "answer-type failures not scored"
            );
            metrics::counter!(crate::ATTEMPTS_METRIC, "result" => result)
                .increment(self.0.len() as u64);
        }
    }
}

/// A request extension: nodes the request must not be routed to, as if each had already been
/// tried (it is still queued for the others). The reference gateway's audit challenges use it
/// to reach one node (design brief §10); only code that builds the request can set it, never a
/// caller.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AvoidNodes(pub Vec<NodeId>);

/// What [`route`] needs besides the inner service and the request.
struct RouteCtx {
    registry: NodeRegistry,
    classify: Arc<dyn ClassifyBody>,
    config: RouteConfig,
    not_node_fault: NotNodeFault,
    node_full: NotNodeFault,
    affinity: Option<Arc<dyn AffinityStore>>,
}

async fn route<S>(
    mut inner: S,
    ctx: RouteCtx,
    req: http::Request<BoxBody>,
) -> Result<http::Response<BoxBody>, BoxError>
where
    S: Service<http::Request<BoxBody>, Response = http::Response<BoxBody>, Error = BoxError>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let peek = req
        .extensions()
        .get::<RequestPeek>()
        .cloned()
        .ok_or(RouteError::MissingPeek)?;
    let session = req
        .extensions()
        .get::<SessionId>()
        .map(|s| s.0.clone())
        .or_else(|| {
            req.headers()
                .get("x-session-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
    let RouteCtx {
        registry,
        classify,
        config,
        not_node_fault,
        node_full,
        affinity,
    } = ctx;
    // scoped by account when the caller's account is known (design brief §5; no cross-tenant
    // affinity: a shared cached prefix would tell one account about another's prompt)
    let account = req.extensions().get::<AccountId>().cloned();
    let key = AffinityKey::for_request(&peek, session.as_deref()).map(|k| match &account {
        Some(account) => k.scoped_to(account),
        None => k,
    });
    let needs = Needs {
        kind: RequestKind::from_path(req.uri().path()),
        prompt_tokens: req.extensions().get::<PromptTokens>().map(|p| p.0),
    };
    // fairness class of the admission queue: the account (all unauthenticated callers share one)
    let ticket = QueueTicket {
        class: req
            .extensions()
            .get::<AccountId>()
            .map(|a| a.as_str().to_owned())
            .unwrap_or_default(),
        weight: req.extensions().get::<QueueWeight>().map_or(1, |w| w.0),
    };
    // nodes this request must not reach (a challenge aimed at one node avoids the others)
    let mut tried: Vec<NodeId> = req
        .extensions()
        .get::<AvoidNodes>()
        .map(|a| a.0.clone())
        .unwrap_or_default();
    let (parts, body) = req.into_parts();
    let body_bytes = body.collect().await?.to_bytes();
    // The shared store's answer, asked once; `None` = use the in-memory table (no store, no key,
    // affinity disabled, or the store failed).
    let shared: Option<Option<NodeId>> = match (&affinity, &key) {
        (Some(store), Some(key)) if !registry.config().affinity_ttl.is_zero() => {
            match store.get(&peek.model, key).await {
                Ok(node) => Some(node),
                Err(e) => {
                    tracing::debug!(error = %e, "affinity store failed; using the local table");
                    None
                }
            }
        }
        _ => None,
    };

    let mut last: Option<Result<http::Response<BoxBody>, BoxError>> = None;
    let mut deferred = Deferred::default();
    let mut full_repicks = 0u32;
    let mut attempt = 0u32;
    let queue_deadline = Instant::now() + registry.config().queue.max_wait;
    while attempt <= config.max_retries {
        let local = match (&shared, &key) {
            (None, Some(key)) => registry.local_preference(&peek.model, key),
            _ => None,
        };
        let preferred = match &shared {
            Some(preferred) => Some(preferred.as_ref()),
            None => local.as_ref().map(Option::as_ref),
        };
        let ask = Ask {
            model: &peek.model,
            preferred,
            exclude: &tried,
            needs,
        };
        // every attempt may wait in the queue for a node not tried yet: a retry after a node
        // failed waits for a healthy one to have room rather than failing a request that never
        // started (when no untried node is left, it answers with the last failure at once); all
        // the waits of one request end at one deadline
        let picked = registry
            .acquire_until(ask, Some(&ticket), queue_deadline)
            .await;
        let pick = match picked {
            Ok(pick) => pick,
            Err(e) => {
                deferred.unscored("unresolved");
                match last {
                    Some(last) => return last,
                    None => return Err(e.into()),
                }
            }
        };
        let node = pick.lease.node().clone();
        tracing::debug!(node = %node, attempt, sticky = pick.sticky.as_str(), "routed");
        if let Some(slot) = parts.extensions.get::<NodeSlot>() {
            slot.set(node.clone());
        }
        let mut req = http::Request::new(BoxBody::new(
            Full::new(body_bytes.clone()).map_err(|never| match never {}),
        ));
        *req.method_mut() = parts.method.clone();
        *req.uri_mut() = parts.uri.clone();
        *req.version_mut() = parts.version;
        *req.headers_mut() = parts.headers.clone();
        *req.extensions_mut() = parts.extensions.clone();
        req.extensions_mut().insert(node.clone());

        if attempt > 0 {
            inner = inner.clone();
        }
        let started = Instant::now();
        // Streamed answers only: a non-streamed answer's head and body come when generation is
        // done, which for a long completion may rightly take longer than any first-token bound.
        // (a bound too large for the clock, meant as "never", is no bound)
        let deadline = (peek.stream && !config.first_content_timeout.is_zero())
            .then(|| started.checked_add(config.first_content_timeout))
            .flatten();
        let result = match within(deadline, call_once(&mut inner, req)).await {
            Some(result) => result,
            None => Err(first_content_timeout(&config)),
        };
        let ctx = CommitCtx {
            slot: parts.extensions.get::<NodeSlot>().cloned(),
            registry: &registry,
            classify: &*classify,
            config: &config,
            not_node_fault,
            node_full,
            started,
            deadline,
        };
        match try_commit(result, pick.lease, ctx).await {
            Attempt::Final(resp) => {
                // another node calls the request itself wrong: earlier 5xx were likely its too
                deferred.unscored("request_fault");
                return Ok(resp);
            }
            Attempt::Committed(resp) => {
                deferred.node_faults(&registry);
                if let Some(slot) = parts.extensions.get::<NodeSlot>() {
                    // the metering layer found the committed answer broke the rules
                    let (registry, node) = (registry.clone(), node.clone());
                    slot.on_node_fault(move || registry.record_failure(&node));
                }
                if let Some(key) = &key {
                    registry.remember(&peek.model, key, &node);
                    if let Some(store) = &affinity {
                        // off the response path; a lost write is a later sticky miss
                        let (store, model, key) = (store.clone(), peek.model.clone(), key.clone());
                        tokio::spawn(async move {
                            if let Err(e) = store.set(&model, &key, &node).await {
                                tracing::debug!(error = %e, "affinity store write failed");
                            }
                        });
                    }
                }
                return Ok(resp);
            }
            Attempt::Failed(answer, fault) => {
                tracing::info!(node = %node, attempt, ?fault, "attempt failed before the first byte");
                if let Some(fault) = fault {
                    let seen = deferred.0.iter().any(|(_, f)| *f == fault);
                    deferred.0.push((node.clone(), fault));
                    if seen {
                        // the same answer from two nodes follows the request: no third node
                        deferred.unscored("request_fault");
                        return answer;
                    }
                }
                tried.push(node);
                // the next attempt may wait in the queue: the failed answer must not keep its
                // node's slot (lease and tunnel stream) meanwhile (the last one goes to the
                // caller as it comes)
                last = Some(if attempt < config.max_retries {
                    release_failed(answer).await
                } else {
                    answer
                });
            }
            Attempt::Full(e) => {
                if full_repicks < MAX_FULL_REPICKS {
                    full_repicks += 1;
                    tracing::debug!(node = %node, full_repicks, error = %e, "node momentarily full; picking again");
                    tokio::time::sleep(FULL_REPICK_PAUSE * full_repicks).await;
                    continue;
                }
                // still full after the re-picks: the gateway's own count is never the node's
                // fault, but a node that keeps refusing streams (REFUSED_STREAM) while it has
                // room is, or it would draw traffic it never serves
                if !not_node_fault(&e) {
                    registry.record_failure(&node);
                }
                tried.push(node);
                last = Some(Err(e));
            }
        }
        attempt += 1;
    }
    deferred.unscored("unresolved");
    match last {
        Some(last) => last,
        None => Err(RouteError::NoNodeForModel(peek.model).into()),
    }
}

/// Most bytes of a failed answer's body kept for the caller while the request tries another node.
const MAX_FAILED_BODY_BYTES: usize = 64 * 1024;
/// Longest wait for a failed answer's body (a short error) before it is given up.
const FAILED_BODY_TIMEOUT: Duration = Duration::from_secs(5);

/// A failed answer, its body read now (at most [`MAX_FAILED_BODY_BYTES`], within
/// [`FAILED_BODY_TIMEOUT`]; otherwise empty) so that its node's lease and tunnel stream are
/// released before the request waits for another node.
fn release_failed(answer: Result<http::Response<BoxBody>, BoxError>) -> AttemptFuture {
    // boxed, as `call_once`: rustc's higher-ranked check on `dyn Error` inside async fns
    Box::pin(async move {
        let resp = match answer {
            Ok(resp) => resp,
            Err(e) => return Err(e),
        };
        let (parts, mut body) = resp.into_parts();
        let mut kept = BytesMut::new();
        let read = async {
            while let Some(Ok(frame)) = body.frame().await {
                if let Some(data) = frame.data_ref() {
                    if kept.len() + data.len() > MAX_FAILED_BODY_BYTES {
                        break;
                    }
                    kept.extend_from_slice(data);
                }
            }
        };
        let _ = tokio::time::timeout(FAILED_BODY_TIMEOUT, read).await;
        drop(body);
        Ok(http::Response::from_parts(
            parts,
            BoxBody::new(Full::new(kept.freeze()).map_err(|never| match never {})),
        ))
    })
}

type AttemptFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<BoxBody>, BoxError>> + Send>>;

/// Waits for `inner` to be ready, then calls it. Boxed where `S::Future: Send` is known (works
/// around rustc's higher-ranked check on `dyn Error` inside async fns).
async fn call_once<S>(
    inner: &mut S,
    req: http::Request<BoxBody>,
) -> Result<http::Response<BoxBody>, BoxError>
where
    S: Service<http::Request<BoxBody>, Response = http::Response<BoxBody>, Error = BoxError>,
    S::Future: Send + 'static,
{
    std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
    let fut: AttemptFuture = Box::pin(inner.call(req));
    fut.await
}

/// Awaits `fut` until `deadline` (none: no limit); `None` when the deadline passed first.
async fn within<F: Future>(deadline: Option<Instant>, fut: F) -> Option<F::Output> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, fut).await.ok(),
        None => Some(fut.await),
    }
}

fn first_content_timeout(config: &RouteConfig) -> BoxError {
    RouteError::FirstContentTimeout(config.first_content_timeout).into()
}

/// Whether a non-2xx status is the node's (or a transient) failure worth another node. Only the
/// statuses that say the caller's request itself is wrong — 400, 413 and 422 — are the caller's
/// fault and go back as they are; anything else (5xx, 408, 429, and 401/403/404/405…, which from
/// a node mean it is misconfigured or does not serve what it advertised) counts against the node
/// and is retried elsewhere.
fn retryable_status(status: http::StatusCode) -> bool {
    !matches!(
        status,
        http::StatusCode::BAD_REQUEST
            | http::StatusCode::PAYLOAD_TOO_LARGE
            | http::StatusCode::UNPROCESSABLE_ENTITY
    )
}

/// Whether a failed non-2xx head is an answer-type failure (scored only once the request's other
/// attempts show that it was the node's): a 5xx other than 502 / 503 / 504. Those three, like
/// 408 / 429 / 401 / 404…, say that the node (or the proxy in front of its engine) cannot serve
/// at all, whatever the request, and are scored at once.
fn answer_fault_status(status: http::StatusCode) -> Option<AnswerFault> {
    let deferred = status.is_server_error()
        && !matches!(
            status,
            http::StatusCode::BAD_GATEWAY
                | http::StatusCode::SERVICE_UNAVAILABLE
                | http::StatusCode::GATEWAY_TIMEOUT
        );
    deferred.then_some(AnswerFault::Status(status.as_u16()))
}

/// What [`try_commit`] needs besides the attempt itself.
struct CommitCtx<'a> {
    /// The metering layer's [`NodeSlot`], when there is one: a node fault it reports is scored
    /// by the hook [`route`] sets, and the body then records nothing more.
    slot: Option<NodeSlot>,
    registry: &'a NodeRegistry,
    classify: &'a dyn ClassifyBody,
    config: &'a RouteConfig,
    not_node_fault: NotNodeFault,
    node_full: NotNodeFault,
    started: Instant,
    deadline: Option<Instant>,
}

/// Reads a 2xx body up to its first content; records a failed attempt, except an answer-type
/// failure, which it hands to [`route`] as an [`AnswerFault`] to score later.
async fn try_commit(
    result: Result<http::Response<BoxBody>, BoxError>,
    lease: InFlightLease,
    ctx: CommitCtx<'_>,
) -> Attempt {
    let CommitCtx {
        slot,
        registry,
        classify,
        config,
        not_node_fault,
        node_full,
        started,
        deadline,
    } = ctx;
    let node = lease.node().clone();
    let resp = match result {
        Ok(resp) => resp,
        Err(e) => {
            if node_full(&e) {
                return Attempt::Full(e);
            }
            if not_node_fault(&e) {
                tracing::debug!(node = %node, error = %e, "refused by the gateway; not scored");
            } else {
                registry.record_failure(&node);
            }
            return Attempt::Failed(Err(e), None);
        }
    };
    if !resp.status().is_success() && !retryable_status(resp.status()) {
        // the caller's own fault: the node did its job; the lease rides with the body
        let (mut parts, body) = resp.into_parts();
        parts.extensions.insert(node.clone());
        return Attempt::Final(http::Response::from_parts(
            parts,
            BoxBody::new(RoutedBody::passthrough(body, lease, config)),
        ));
    }
    if !resp.status().is_success() {
        let fault = answer_fault_status(resp.status());
        if fault.is_none() {
            registry.record_failure(&node);
        }
        // the body (usually a short error) goes to the caller if this was the last attempt; the
        // lease rides with it
        return Attempt::Failed(
            Ok(resp.map(|inner| BoxBody::new(RoutedBody::passthrough(inner, lease, config)))),
            fault,
        );
    }
    let content_type = resp
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let streamed = content_type
        .as_deref()
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
    let mut classifier = classify.classifier(content_type.as_deref());
    let (mut parts, mut body) = resp.into_parts();
    parts.extensions.insert(node.clone());
    let mut prefix: VecDeque<Frame<Bytes>> = VecDeque::new();
    let mut buffered_bytes = 0usize;
    let mut ended = false;
    let signal = loop {
        let Some(next) = within(deadline, body.frame()).await else {
            // accepted, then silent: the node's fault, retried elsewhere
            registry.record_failure(&node);
            return Attempt::Failed(Err(first_content_timeout(config)), None);
        };
        match next {
            Some(Ok(frame)) => {
                let signal = match frame.data_ref() {
                    Some(data) => {
                        buffered_bytes = buffered_bytes.saturating_add(data.len());
                        classifier.feed(data)
                    }
                    None => {
                        // trailers end the body
                        ended = true;
                        classifier.finish()
                    }
                };
                prefix.push_back(frame);
                if signal != BodySignal::Pending {
                    break signal;
                }
                if body.is_end_stream() {
                    ended = true;
                    break classifier.finish();
                }
                if buffered_bytes > config.max_buffered_bytes {
                    break BodySignal::Content;
                }
            }
            None => {
                ended = true;
                break classifier.finish();
            }
            Some(Err(e)) => {
                // broken before anything reached the caller: still retryable
                registry.record_disconnect(&node);
                return Attempt::Failed(Err(e), None);
            }
        }
    };
    match signal {
        BodySignal::Failed => {
            // scored (or not) by `route` once the other attempts are known
            // what the node sent (its error event) is the answer if no retry is left
            let mut bytes = BytesMut::new();
            for frame in prefix {
                if let Ok(data) = frame.into_data() {
                    bytes.extend_from_slice(&data);
                }
            }
            drop(lease);
            let fault = AnswerFault::Stream {
                empty: bytes.is_empty(),
            };
            Attempt::Failed(
                Ok(http::Response::from_parts(
                    parts,
                    BoxBody::new(Full::new(bytes.freeze()).map_err(|never| match never {})),
                )),
                Some(fault),
            )
        }
        _ => {
            let ttft = streamed.then(|| started.elapsed());
            let mut body = RoutedBody {
                prefix,
                inner: body,
                inner_ended: ended,
                lease: Some(lease),
                watch: Some(Watch {
                    slot,
                    classifier,
                    registry: registry.clone(),
                    ttft,
                    failed: false,
                }),
                idle: IdleTimer::new(config.stream_idle_timeout),
            };
            if ended {
                // the whole body is already here: the attempt's outcome is known now
                body.finish();
            }
            Attempt::Committed(http::Response::from_parts(parts, BoxBody::new(body)))
        }
    }
}

/// What a committed body reports at its end.
struct Watch {
    /// Set when a [`NodeSlot`] came with the request: a fault reported on it was scored already.
    slot: Option<NodeSlot>,
    classifier: Box<dyn BodyClassifier>,
    registry: NodeRegistry,
    ttft: Option<Duration>,
    failed: bool,
}

impl Watch {
    fn fault_reported(&self) -> bool {
        self.slot
            .as_ref()
            .is_some_and(NodeSlot::node_fault_reported)
    }
}

/// A response body that replays the buffered prefix, then the node's body; holds the node's
/// in-flight lease until it ends or is dropped, and records a committed attempt's outcome once.
///
/// # End of stream
///
/// The outcome is recorded exactly once, at the first of: `None`, a trailers frame, a data frame
/// after which the inner body reports `is_end_stream()`, an error (a disconnect), a stall of
/// [`RouteConfig::stream_idle_timeout`] (a disconnect too), or a drop (a success unless a failure
/// was seen: see `Drop`). The lease is released at the same moment.
struct RoutedBody {
    prefix: VecDeque<Frame<Bytes>>,
    inner: BoxBody,
    inner_ended: bool,
    lease: Option<InFlightLease>,
    /// `None` for a non-2xx answer (its failure is recorded already or left to [`route`], or a
    /// caller's 4xx that is not scored) and after the end.
    watch: Option<Watch>,
    /// `None` when [`RouteConfig::stream_idle_timeout`] is zero (disabled).
    idle: Option<IdleTimer>,
}

impl RoutedBody {
    /// A body that only holds the lease (a non-2xx answer), bounded by
    /// [`RouteConfig::stream_idle_timeout`] as well.
    fn passthrough(inner: BoxBody, lease: InFlightLease, config: &RouteConfig) -> Self {
        Self {
            prefix: VecDeque::new(),
            inner,
            inner_ended: false,
            lease: Some(lease),
            watch: None,
            idle: IdleTimer::new(config.stream_idle_timeout),
        }
    }

    /// The body ended cleanly: success, unless the classifier saw a failure.
    fn finish(&mut self) {
        self.inner_ended = true;
        // the transport's own stream slot goes first: a request queued for the node, woken by
        // the lease below, must find the tunnel's stream free too
        drop(std::mem::take(&mut self.inner));
        let lease = self.lease.take();
        if let (Some(mut watch), Some(lease)) = (self.watch.take(), lease) {
            if watch.fault_reported() {
                return;
            }
            // with a metering layer above, it is the judge of a committed stream (see poll_frame)
            let failed = watch.failed
                || (watch.slot.is_none() && watch.classifier.finish() == BodySignal::Failed);
            if failed {
                watch.registry.record_failure(lease.node());
            } else {
                watch.registry.record_success(lease.node(), watch.ttft);
            }
        }
    }

    /// The node's body broke after commit: a mid-request disconnect.
    fn broke(&mut self) {
        self.inner_ended = true;
        drop(std::mem::take(&mut self.inner));
        let lease = self.lease.take();
        if let (Some(watch), Some(lease)) = (self.watch.take(), lease) {
            if !watch.fault_reported() {
                watch.registry.record_disconnect(lease.node());
            }
        }
    }
}

impl Drop for RoutedBody {
    /// Dropped before its end: the caller went away, or the layer above stopped reading after
    /// the answer's last event. The node did nothing wrong by that, so a committed attempt
    /// counts as a success unless the classifier saw a failure.
    fn drop(&mut self) {
        // the node's body (and the transport's stream slot) before the lease, as in `finish`
        drop(std::mem::take(&mut self.inner));
        let lease = self.lease.take();
        if let (Some(watch), Some(lease)) = (self.watch.take(), lease) {
            if watch.fault_reported() {
                return;
            }
            if watch.failed {
                watch.registry.record_failure(lease.node());
            } else {
                watch.registry.record_success(lease.node(), watch.ttft);
            }
        }
    }
}

impl Body for RoutedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(frame) = this.prefix.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        if this.inner_ended {
            this.finish();
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        let Poll::Ready(polled) = polled else {
            if let Some(idle) = this.idle.as_mut() {
                if idle.poll_expired(cx) {
                    let timeout = idle.timeout();
                    tracing::info!(
                        node = ?this.lease.as_ref().map(|l| l.node().as_str()),
                        timeout_secs = timeout.as_secs(),
                        "node stream stalled; ending it"
                    );
                    this.broke();
                    // reset the node's stream: the agent cancels the engine request
                    this.inner = BoxBody::default();
                    this.idle = None;
                    return Poll::Ready(Some(Err(RouteError::StreamIdleTimeout(timeout).into())));
                }
            }
            return Poll::Pending;
        };
        if let Some(idle) = this.idle.as_mut() {
            idle.frame();
        }
        match polled {
            Some(Ok(frame)) => {
                match frame.data_ref() {
                    Some(data) => {
                        if let Some(watch) = this.watch.as_mut() {
                            // with a metering layer above (a NodeSlot came with the request), it
                            // judges the committed stream and reports a fault on the slot; the
                            // classifier would only parse every event a second time
                            if watch.slot.is_none()
                                && watch.classifier.feed(data) == BodySignal::Failed
                            {
                                watch.failed = true;
                            }
                        }
                        if this.inner.is_end_stream() {
                            this.finish();
                        }
                    }
                    None => this.finish(),
                }
                Poll::Ready(Some(Ok(frame)))
            }
            None => {
                this.finish();
                Poll::Ready(None)
            }
            Some(Err(e)) => {
                this.broke();
                Poll::Ready(Some(Err(e)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_empty() && (self.inner_ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let buffered: u64 = self
            .prefix
            .iter()
            .filter_map(|f| f.data_ref())
            .map(|d| d.len() as u64)
            .sum();
        if self.inner_ended {
            return SizeHint::with_exact(buffered);
        }
        let inner = self.inner.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower().saturating_add(buffered));
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(buffered));
        }
        hint
    }
}

#[cfg(test)]
mod affinity_store_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use std::collections::HashMap;
    use std::sync::Mutex;

    use http_body_util::{BodyExt, Full};
    use spine_core::{EngineKind, ModelDescriptor, ModelId, NodeDescriptor};
    use tower::{Layer, ServiceExt};

    use super::*;
    use crate::{AffinityFuture, StickyOutcome};

    /// A shared store: a map, or a store that always fails.
    #[derive(Debug, Default)]
    struct MapStore {
        failing: bool,
        map: Mutex<HashMap<u64, NodeId>>,
        gets: Mutex<u32>,
    }

    impl AffinityStore for MapStore {
        fn get<'a>(
            &'a self,
            model: &'a ModelId,
            key: &'a AffinityKey,
        ) -> AffinityFuture<'a, Option<NodeId>> {
            Box::pin(async move {
                *self.gets.lock().unwrap() += 1;
                if self.failing {
                    return Err("store down".into());
                }
                Ok(self.map.lock().unwrap().get(&key.digest(model)).cloned())
            })
        }
        fn set<'a>(
            &'a self,
            model: &'a ModelId,
            key: &'a AffinityKey,
            node: &'a NodeId,
        ) -> AffinityFuture<'a, ()> {
            Box::pin(async move {
                if self.failing {
                    return Err("store down".into());
                }
                self.map
                    .lock()
                    .unwrap()
                    .insert(key.digest(model), node.clone());
                Ok(())
            })
        }
    }

    fn registry() -> NodeRegistry {
        let r = NodeRegistry::new();
        for n in ["a", "b", "c", "d"] {
            r.node_ready(
                &NodeId::new(n),
                &NodeDescriptor {
                    engine: EngineKind::LlamaCpp,
                    models: vec![ModelDescriptor {
                        id: ModelId::new("m"),
                        max_context_tokens: None,
                        endpoints: None,
                    }],
                    vram_mib: 1,
                    max_concurrency: 64,
                    agent_version: "t".into(),
                },
            );
        }
        r
    }

    fn request() -> http::Request<BoxBody> {
        let mut req = http::Request::post("/v1/completions")
            .body(BoxBody::new(
                Full::new(Bytes::from_static(b"{}")).map_err(|n| match n {}),
            ))
            .unwrap();
        req.extensions_mut().insert(RequestPeek {
            model: ModelId::new("m"),
            stream: false,
            include_usage: false,
            n: 1,
            max_tokens: None,
            prompt_cache_key: Some("chat-1".into()),
            conversation_key: None,
        });
        req
    }

    /// Answers 200 and says which node it was.
    fn upstream() -> impl tower::Service<
        http::Request<BoxBody>,
        Response = http::Response<BoxBody>,
        Error = BoxError,
        Future = impl Send,
    > + Clone
           + Send
           + 'static {
        tower::service_fn(|req: http::Request<BoxBody>| async move {
            let node = req.extensions().get::<NodeId>().cloned().unwrap();
            Ok::<_, BoxError>(http::Response::new(BoxBody::new(
                Full::new(Bytes::from(node.as_str().to_owned())).map_err(|n| match n {}),
            )))
        })
    }

    async fn served(
        svc: &Route<
            impl tower::Service<
                    http::Request<BoxBody>,
                    Response = http::Response<BoxBody>,
                    Error = BoxError,
                    Future = impl Send + 'static,
                > + Clone
                + Send
                + 'static,
        >,
    ) -> String {
        let resp = svc.clone().oneshot(request()).await.unwrap();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn the_shared_store_names_the_sticky_node() {
        let r = registry();
        let store = Arc::new(MapStore::default());
        let key = AffinityKey::PromptCacheKey("chat-1".into());
        // another instance served the conversation on "c"
        store
            .map
            .lock()
            .unwrap()
            .insert(key.digest(&ModelId::new("m")), NodeId::new("c"));
        let svc = RouteLayer::new(r.clone())
            .affinity_store(store.clone())
            .layer(upstream());
        for _ in 0..10 {
            assert_eq!(served(&svc).await, "c");
        }
        assert_eq!(*store.gets.lock().unwrap(), 10);
        let hits: u64 = r.snapshot().iter().map(|s| s.sticky_hits).sum();
        assert_eq!(hits, 10);
        // the store's answer wins over the local table
        assert_eq!(
            r.pick_preferring(&ModelId::new("m"), Some(Some(&NodeId::new("b"))), &[])
                .map(|p| (p.lease.node().clone(), p.sticky))
                .unwrap(),
            (NodeId::new("b"), StickyOutcome::Hit)
        );
    }

    #[tokio::test]
    async fn a_failing_store_falls_back_to_the_local_table() {
        let r = registry();
        let store = Arc::new(MapStore {
            failing: true,
            ..MapStore::default()
        });
        let svc = RouteLayer::new(r.clone())
            .affinity_store(store.clone())
            .layer(upstream());
        let first = served(&svc).await;
        for _ in 0..10 {
            assert_eq!(served(&svc).await, first);
        }
        assert_eq!(*store.gets.lock().unwrap(), 11);
    }

    #[tokio::test]
    async fn a_served_conversation_is_written_to_the_store() {
        let r = registry();
        let store = Arc::new(MapStore::default());
        let svc = RouteLayer::new(r)
            .affinity_store(store.clone())
            .layer(upstream());
        let node = served(&svc).await;
        let key = AffinityKey::PromptCacheKey("chat-1".into()).digest(&ModelId::new("m"));
        // written off the response path
        for _ in 0..100 {
            if store.map.lock().unwrap().contains_key(&key) {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(
            store.map.lock().unwrap().get(&key),
            Some(&NodeId::new(node.as_str()))
        );
    }
}
