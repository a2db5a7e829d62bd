use std::sync::Arc;
use std::time::Duration;

use spine_core::{BoxError, ClassifyBody, FirstBytes};
use tower::Layer;

use super::retry::RouteCtx;
use super::Route;
use crate::affinity::AffinityStore;
use crate::NodeRegistry;

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
    /// [`RouteError::FirstContentTimeout`](crate::RouteError::FirstContentTimeout). Default
    /// 120 s; `Duration::ZERO` disables it.
    pub first_content_timeout: Duration,
    /// Longest gap between two frames of the node's body once the response is committed (and,
    /// for a non-2xx answer that goes to the caller, after its head), counted from the commit
    /// for the first frame. Past it the node is stalled (e.g. its agent answers PINGs but its
    /// engine sends nothing): the body ends with
    /// [`RouteError::StreamIdleTimeout`](crate::RouteError::StreamIdleTimeout), the node is
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
    ctx: RouteCtx,
}

/// How many times one request may find its picked node momentarily full
/// ([`RouteLayer::node_full`]) and pick again, besides [`RouteConfig::max_retries`].
pub const MAX_FULL_REPICKS: u32 = 3;

/// The pause before picking again after a node was found momentarily full: long enough for the
/// stream that just ended to be released on both ends of the tunnel (a few scheduler turns).
pub(super) const FULL_REPICK_PAUSE: Duration = Duration::from_millis(5);

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
            ctx: RouteCtx {
                registry,
                classify: Arc::new(FirstBytes::default()),
                config: RouteConfig::default(),
                not_node_fault: never_not_node_fault,
                node_full: never_not_node_fault,
                affinity: None,
            },
        }
    }

    /// Keeps conversation affinity in `store` (shared by several gateway instances) as well as
    /// in the registry's in-memory table, which is the fallback when the store fails. See
    /// [`AffinityStore`]. Default: the in-memory table only.
    pub fn affinity_store(mut self, store: Arc<dyn AffinityStore>) -> Self {
        self.ctx.affinity = Some(store);
        self
    }

    /// Decides when a 2xx body has started (its first content) or failed before it; the metering
    /// crate provides `spine_meter::classify::SseClassify`.
    pub fn classify(mut self, classify: Arc<dyn ClassifyBody>) -> Self {
        self.ctx.classify = classify;
        self
    }

    /// Sets the retry bound and buffer limit.
    pub fn config(mut self, config: RouteConfig) -> Self {
        self.ctx.config = config;
        self
    }

    /// Recognises inner errors that are the gateway's own refusal, not the node's fault (the
    /// gateway passes `TunnelError::is_node_full`): retried elsewhere, never scored. By default
    /// every inner error counts against the node.
    pub fn not_node_fault(mut self, not_node_fault: NotNodeFault) -> Self {
        self.ctx.not_node_fault = not_node_fault;
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
        self.ctx.node_full = node_full;
        self
    }
}

impl<S> Layer<S> for RouteLayer {
    type Service = Route<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Route {
            inner,
            ctx: self.ctx.clone(),
        }
    }
}
