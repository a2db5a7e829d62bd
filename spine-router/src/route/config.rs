//! What a [`RouteLayer`](super::RouteLayer) is built with and each request is routed by:
//! [`RouteConfig`], the fault classifier, and the context every [`Route`](super::Route) hands
//! to its requests.

use std::sync::Arc;
use std::time::Duration;

use spine_core::{BoxError, ClassifyBody};

use crate::affinity::AffinityStore;
use crate::NodeRegistry;

/// Settings of [`Route`](super::Route). [`Default`] gives the documented values.
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

/// How many times one request may find its picked node momentarily full
/// ([`RouteLayer::node_full`](super::RouteLayer::node_full)) and pick again, besides [`RouteConfig::max_retries`].
pub const MAX_FULL_REPICKS: u32 = 3;

/// The pause before picking again after a node was found momentarily full: long enough for the
/// stream that just ended to be released on both ends of the tunnel (a few scheduler turns).
pub(super) const FULL_REPICK_PAUSE: Duration = Duration::from_millis(5);

/// Tells whether an inner service error is the gateway's own refusal (e.g. the tunnel's per-node
/// stream limit) rather than a fault of the node: such an attempt is retried on another node but
/// not scored against the node.
pub type NotNodeFault = fn(&BoxError) -> bool;

/// What [`route`](super::retry::route) needs besides the inner service and the request: the settings a
/// [`RouteLayer`](super::RouteLayer) is built with, which each [`Route`](super::Route) it makes
/// holds and hands (cloned) to every request.
#[derive(Debug, Clone)]
pub(super) struct RouteCtx {
    pub(super) registry: NodeRegistry,
    pub(super) classify: Arc<dyn ClassifyBody>,
    pub(super) config: RouteConfig,
    pub(super) not_node_fault: NotNodeFault,
    pub(super) node_full: NotNodeFault,
    pub(super) affinity: Option<Arc<dyn AffinityStore>>,
}
