use std::collections::VecDeque;
use std::future::Future;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use spine_core::{BodySignal, BoxBody, BoxError, ClassifyBody, NodeSlot};
use tokio::time::Instant;

use super::body::{RoutedBody, Watch};
use super::{NotNodeFault, RouteConfig};
use crate::idle::IdleTimer;
use crate::{InFlightLease, NodeRegistry, Overload, RouteError};

/// How one attempt ended before commit.
pub(super) enum Attempt {
    Committed(http::Response<BoxBody>),
    /// A failure, with its answer (or error) for the caller if no retry is left. `None`: already
    /// scored (connect failure, timeout, broken body) or never scored (node full); `Some`: an
    /// answer-type failure whose scoring waits for the other attempts (see [`Route`]).
    ///
    /// [`Route`]: super::Route
    Failed(
        Result<http::Response<BoxBody>, BoxError>,
        Option<AnswerFault>,
    ),
    /// The node was momentarily full ([`RouteLayer::node_full`]): not scored, and the node may
    /// be picked again.
    ///
    /// [`RouteLayer::node_full`]: super::RouteLayer::node_full
    Full(BoxError),
}

/// An answer-type failure before the first byte: the node answered, but with a failure that may
/// follow the request rather than the node. Two equal values on two nodes mean the request
/// itself fails (no third node is tried, neither node is scored).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum AnswerFault {
    /// A 5xx head other than 502 / 503 / 504 (e.g. llama-server's 500 "Failed to parse tools").
    Status(u16),
    /// A 2xx stream that failed before its first content: an error event (`empty: false`) or a
    /// stream that ended with nothing at all (`empty: true`).
    Stream {
        /// Whether the node sent no byte at all.
        empty: bool,
    },
    /// No first content within the first-content deadline. Late on every node it tried, the
    /// request itself is slow (a caller's long prompt): no node is scored, and no node's
    /// learned concurrency limit lowered (a caller cannot shrink an honest node for free); once
    /// another node serves it, each late node was queueing or failing: scored, and its limit
    /// lowered (`registry::limit`). The requests the node had in flight then, this one included.
    Late(u32),
    /// The node called the request itself wrong: 400, 413 or 422 (any of the three: one node
    /// may say 400 where another says 422 for the same bad request). A hostile or
    /// misconfigured node can refuse every request to draw none of the work and keep its score,
    /// so the request goes to another node: if that one serves it, the refusal was the node's
    /// fault (scored); if it refuses too, the request was bad (neither scored, the refusal goes
    /// to the caller).
    Refused,
}

/// Awaits `fut` until `deadline` (none: no limit); `None` when the deadline passed first.
pub(super) async fn within<F: Future>(deadline: Option<Instant>, fut: F) -> Option<F::Output> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, fut).await.ok(),
        None => Some(fut.await),
    }
}

pub(super) fn first_content_timeout(config: &RouteConfig) -> BoxError {
    RouteError::FirstContentTimeout(config.first_content_timeout).into()
}

/// Whether `e` is [`first_content_timeout`]'s.
fn is_first_content_timeout(e: &BoxError) -> bool {
    matches!(
        e.downcast_ref::<RouteError>(),
        Some(RouteError::FirstContentTimeout(_))
    )
}

/// Whether a failed non-2xx head is an answer-type failure (scored only once the request's other
/// attempts show that it was the node's): the statuses that say the caller's request itself is
/// wrong — 400, 413 and 422 ([`AnswerFault::Refused`]) — and a 5xx other than 502 / 503 / 504.
/// Those three, like 408 / 429 / 401 / 404…, say that the node (or the proxy in front of its
/// engine) cannot serve at all, whatever the request, and are scored at once. Every non-2xx is
/// retried on another node while retries are left.
fn answer_fault_status(status: http::StatusCode) -> Option<AnswerFault> {
    if matches!(
        status,
        http::StatusCode::BAD_REQUEST
            | http::StatusCode::PAYLOAD_TOO_LARGE
            | http::StatusCode::UNPROCESSABLE_ENTITY
    ) {
        return Some(AnswerFault::Refused);
    }
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
pub(super) struct CommitCtx<'a> {
    /// The metering layer's [`NodeSlot`], when there is one: a node fault it reports is scored
    /// by the hook [`route`] sets, and the body then records nothing more.
    ///
    /// [`route`]: super::retry::route
    pub(super) slot: Option<NodeSlot>,
    pub(super) registry: &'a NodeRegistry,
    pub(super) classify: &'a dyn ClassifyBody,
    pub(super) config: &'a RouteConfig,
    pub(super) not_node_fault: NotNodeFault,
    pub(super) node_full: NotNodeFault,
    pub(super) started: Instant,
    pub(super) deadline: Option<Instant>,
    /// The choices the request asks for (`n`): content of another is not its first content.
    pub(super) choices: u32,
}

/// Reads a 2xx body up to its first content; records a failed attempt, except an answer-type
/// failure, which it hands to [`route`] as an [`AnswerFault`] to score later.
///
/// [`route`]: super::retry::route
pub(super) async fn try_commit(
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
        choices,
    } = ctx;
    let node = lease.node().clone();
    let resp = match result {
        Ok(resp) => resp,
        Err(e) => {
            if node_full(&e) {
                return Attempt::Full(e);
            }
            if is_first_content_timeout(&e) {
                // no response head in time: scored once another node serves the request
                return Attempt::Failed(Err(e), Some(AnswerFault::Late(lease.node_in_flight())));
            }
            if not_node_fault(&e) {
                tracing::debug!(node = %node, error = %e, "refused by the gateway; not scored");
            } else {
                registry.record_failure(&node);
            }
            return Attempt::Failed(Err(e), None);
        }
    };
    if !resp.status().is_success() {
        if matches!(
            resp.status(),
            http::StatusCode::TOO_MANY_REQUESTS | http::StatusCode::SERVICE_UNAVAILABLE
        ) {
            // the node says it is full
            registry.record_overload(&node, Overload::Refused);
        }
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
    let streamed = spine_core::is_event_stream_response(resp.headers());
    let mut classifier = classify.classifier_for(content_type.as_deref(), choices);
    let (mut parts, mut body) = resp.into_parts();
    parts.extensions.insert(node.clone());
    let mut prefix: VecDeque<Frame<Bytes>> = VecDeque::new();
    let mut buffered_bytes = 0usize;
    let mut ended = false;
    let signal = loop {
        let Some(next) = within(deadline, body.frame()).await else {
            // accepted, then silent: retried elsewhere, scored once another node serves it
            return Attempt::Failed(
                Err(first_content_timeout(config)),
                Some(AnswerFault::Late(lease.node_in_flight())),
            );
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
