use std::sync::Arc;

use spine_core::{BoxError, ClassifyBody, FirstBytes};
use tower::Layer;

use super::config::{NotNodeFault, RouteConfig, RouteCtx};
use super::Route;
use crate::affinity::AffinityStore;
use crate::NodeRegistry;

/// Applies [`Route`] to a service: picks the node for each request, retries before the first
/// byte.
#[derive(Debug, Clone)]
pub struct RouteLayer {
    ctx: RouteCtx,
}

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
    /// admission queue if every node is full — at most [`MAX_FULL_REPICKS`](super::MAX_FULL_REPICKS) times, besides
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
