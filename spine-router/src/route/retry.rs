use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::BytesMut;
use http_body_util::{BodyExt, Full};
use spine_core::{
    AccountId, BoxBody, BoxError, BufferedRequest, NodeFault, NodeId, NodeSlot, PromptTokens,
    RequestContext, RequestKind, RequestPeek,
};
use tokio::time::Instant;
use tower::Service;

use super::commit::{first_content_timeout, try_commit, within, AnswerFault, Attempt, CommitCtx};
use super::config::{RouteCtx, FULL_REPICK_PAUSE};
use super::{AvoidNodes, MAX_FULL_REPICKS};
use crate::affinity::{AffinityKey, SessionId};
use crate::{Ask, Needs, NodeRegistry, Overload, QueueTicket, QueueWeight, RouteError};

/// Answer-type failures of one request whose scoring waits until its attempts are over.
#[derive(Default)]
struct Deferred(Vec<(NodeId, AnswerFault)>);

impl Deferred {
    /// A later attempt on another node committed: the request was servable, so every earlier
    /// answer-type failure was the node's fault.
    fn node_faults(self, registry: &NodeRegistry) {
        for (node, fault) in self.0 {
            if let AnswerFault::Late(in_flight) = fault {
                registry.record_overload(&node, Overload::Late { in_flight });
            }
            registry.record_failure(&node);
        }
    }

    /// The attempts are over without a commit: nothing proves the nodes wrong. `result` is the
    /// [`ATTEMPTS_METRIC`](crate::ATTEMPTS_METRIC) label: `request_fault` (the same failure on
    /// two nodes: two 5xx of one status, two failed streams alike, two refusals, or a refusal
    /// beside another answer-type failure) or `unresolved` (no other node answered to compare
    /// with).
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

pub(super) async fn route<S>(
    mut inner: S,
    ctx: RouteCtx,
    req: http::Request<BoxBody>,
) -> Result<http::Response<BoxBody>, BoxError>
where
    S: spine_core::UpstreamService,
{
    // the edge's typed context and the metering layer's buffered body, when the stack has them
    // (issue 20): then nothing here is re-derived from the URI, re-collected or re-parsed
    let context = req.extensions().get::<RequestContext>().cloned();
    let buffered = req.extensions().get::<BufferedRequest>().cloned();
    let peek = match &buffered {
        Some(b) => b.peek.clone(),
        None => req
            .extensions()
            .get::<RequestPeek>()
            .cloned()
            .ok_or(RouteError::MissingPeek)?,
    };
    let session = context
        .as_ref()
        .and_then(|c| c.session.clone())
        .or_else(|| req.extensions().get::<SessionId>().map(|s| s.0.clone()))
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
    let account = match &context {
        Some(c) => Some(c.account.clone()),
        None => req.extensions().get::<AccountId>().cloned(),
    };
    let key = AffinityKey::for_request(&peek, session.as_deref()).map(|k| match &account {
        Some(account) => k.scoped_to(account),
        None => k,
    });
    let needs = Needs {
        kind: match &context {
            Some(c) => Some(c.kind),
            None => RequestKind::from_path(req.uri().path()),
        },
        prompt_tokens: match &buffered {
            Some(b) => Some(b.prompt_tokens),
            None => req.extensions().get::<PromptTokens>().map(|p| p.0),
        },
        choices: peek.n,
    };
    // fairness class of the admission queue: the account (all unauthenticated callers share one)
    let ticket = QueueTicket {
        class: account
            .as_ref()
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
    // the metering layer's bytes when it buffered them (the request body is then left unpolled)
    let body_bytes = match buffered {
        Some(b) => b.body,
        None => body.collect().await?.to_bytes(),
    };
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
    // a node's refusal (400 / 413 / 422), kept apart: when no node serves the request, the
    // caller gets it rather than another node's failure
    let mut refusal: Option<Result<http::Response<BoxBody>, BoxError>> = None;
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
                match refusal.or(last) {
                    Some(last) => return last,
                    None => return Err(e.into()),
                }
            }
        };
        let node = pick.lease.node().clone();
        tracing::debug!(node = %node, attempt, sticky = pick.sticky.as_str(), "routed");
        if let Some(slot) = parts.extensions.get::<NodeSlot>() {
            slot.set(node.clone());
            // the node's own context for the model: the metering layer caps completions by it
            slot.set_context_tokens(
                registry
                    .descriptor(&node)
                    .and_then(|d| d.model(&peek.model).and_then(|m| m.max_context_tokens)),
            );
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
            choices: peek.n,
        };
        match try_commit(result, pick.lease, ctx).await {
            Attempt::Committed(resp) => {
                deferred.node_faults(&registry);
                if let Some(slot) = parts.extensions.get::<NodeSlot>() {
                    // the metering layer found the committed answer broke the rules (a failure)
                    // or made no progress for its stall bound (a mid-request disconnect)
                    let (registry_f, node_f) = (registry.clone(), node.clone());
                    slot.on_node_fault(move |fault| match fault {
                        NodeFault::Stalled => registry_f.record_disconnect(&node_f),
                        _ => registry_f.record_failure(&node_f),
                    });
                    // a stream that paused long after its first token waited in the node's
                    // queue (a first token sent at once dodges the first-content deadline)
                    let (registry, node) = (registry.clone(), node.clone());
                    slot.on_pause(move |longest| registry.record_pause(&node, longest));
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
                    // the same answer from two nodes, or a refusal beside another answer-type
                    // failure (llama.cpp's 500 "Failed to parse tools" where another engine
                    // says 400), follows the request: no third node, no one scored (a late
                    // node is no answer: the next node is still tried)
                    let answer_type = |f: AnswerFault| !matches!(f, AnswerFault::Late(_));
                    let seen = answer_type(fault)
                        && deferred.0.iter().any(|(_, f)| {
                            answer_type(*f)
                                && (*f == fault
                                    || *f == AnswerFault::Refused
                                    || fault == AnswerFault::Refused)
                        });
                    deferred.0.push((node.clone(), fault));
                    if seen {
                        deferred.unscored("request_fault");
                        // a refusal says what is wrong with the request: it is what the caller
                        // gets, whichever node answered first
                        return match refusal {
                            Some(refused) if fault != AnswerFault::Refused => refused,
                            _ => with_node(answer, &node),
                        };
                    }
                }
                // the next attempt may wait in the queue: the failed answer must not keep its
                // node's slot (lease and tunnel stream) meanwhile (the last one goes to the
                // caller as it comes)
                let answer = if attempt < config.max_retries {
                    release_failed(answer).await
                } else {
                    answer
                };
                if fault == Some(AnswerFault::Refused) {
                    refusal = Some(with_node(answer, &node));
                } else {
                    last = Some(answer);
                }
                tried.push(node);
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
    match refusal.or(last) {
        Some(last) => last,
        None => Err(RouteError::NoNodeForModel(peek.model).into()),
    }
}

/// The answer that goes to the caller, with the node that gave it in its extensions (the
/// metering layer records it).
fn with_node(
    answer: Result<http::Response<BoxBody>, BoxError>,
    node: &NodeId,
) -> Result<http::Response<BoxBody>, BoxError> {
    answer.map(|mut resp| {
        resp.extensions_mut().insert(node.clone());
        resp
    })
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
