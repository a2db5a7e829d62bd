//! Routing for spine (design brief §5): which node serves a request.
//!
//! - [`NodeRegistry`]: the nodes this gateway can route to, their models, capacity, in-flight
//!   count and reliability score ([`score`]), and the conversation affinity table. The tunnel
//!   tells it when a node becomes routable (after its first health probe), when its keepalive is
//!   answered ([`NodeRegistry::heartbeat`]) and when it is gone.
//! - [`RouteLayer`] / [`Route`]: a tower middleware that reads the requested model from the
//!   [`RequestPeek`](spine_core::RequestPeek) in the request's extensions, picks a node among
//!   those whose advertised capabilities fit the request (endpoint, context window for the
//!   [`PromptTokens`](spine_core::PromptTokens) extension): the sticky node of the conversation
//!   if it can take the request and is not overloaded, else a load-aware weighted pick (power
//!   of two choices by `max(min(vram_mib, max_vram_mib), 1)·(0.2 + 0.8·score)`, the less loaded
//!   of two draws); when every such node is full the request waits in the model's fair
//!   admission [`queue`]. It puts the node's [`NodeId`](spine_core::NodeId) into the
//!   request's extensions for the transport below, retries on another node while nothing has
//!   reached the caller, and counts the request in flight until its response body ends.
//! - [`AffinityStore`]: conversation affinity kept outside the process (several gateway
//!   instances share it, e.g. in Redis); [`RouteLayer::affinity_store`] adds one, the in-memory
//!   table stays the default and the fallback.
//! - [`ReadAheadLayer`] / [`ReadAhead`]: reads each node's answer at the node's pace into a
//!   bounded per-stream buffer, so a slow caller holds gateway memory, not the node's slot.
//! - [`NodeDirectory`] / [`DirectoryDispatch`]: with several gateway instances, where a node's
//!   tunnel is (here, on instance Y, unknown) and a service that sends each request to a local
//!   or a remote service accordingly.
//! - `cluster` (feature `redis`): that directory kept in Redis, shared affinity, instance
//!   liveness, the signed HTTP/2 forwarder and the internal relay listener (design brief §8).
//!
//! `Route` works over any tower service that takes an `http::Request<BoxBody>` carrying a
//! `NodeId` extension; see `examples/route_alone.rs` for two plain HTTP upstreams.
//!
//! Metrics (the `metrics` facade): `spine_router_sticky_total{result="hit|miss|new"}` for picks
//! with an affinity key, `spine_router_attempts_total{result="success|failure|disconnect|request_fault|unresolved"}`
//! (the last two: answer-type failures left unscored; see `Route`).
//!
//! ```
//! use spine_core::{EngineKind, ModelDescriptor, ModelId, NodeDescriptor, NodeId};
//! use spine_router::NodeRegistry;
//!
//! let registry = NodeRegistry::new();
//! registry.node_ready(
//!     &NodeId::new("n1"),
//!     &NodeDescriptor {
//!         engine: EngineKind::LlamaCpp,
//!         models: vec![ModelDescriptor { id: ModelId::new("smollm2"), max_context_tokens: Some(2048), endpoints: None }],
//!         vram_mib: 0,
//!         max_concurrency: 4,
//!         agent_version: "0.1.0".into(),
//!     },
//! );
//! let picked = registry.pick(&ModelId::new("smollm2")).map(|lease| lease.node().clone());
//! assert_eq!(picked.ok(), Some(NodeId::new("n1")));
//! ```

mod affinity;
#[cfg(feature = "redis")]
pub mod cluster;
mod directory;
mod idle;
pub mod queue;
mod readahead;
mod registry;
mod route;
pub mod score;

pub use affinity::{AffinityFuture, AffinityKey, AffinityStore, SessionId, StickyOutcome};
pub use directory::{
    DirectoryDispatch, DirectoryError, DirectoryFuture, DispatchFuture, NodeDirectory,
    NodeLocation, RemoteOwner,
};
pub use idle::IdleTimer;
pub use queue::{QueueConfig, QueueSnapshot, QueueTicket, QueueWeight};
pub use readahead::{
    read_ahead, ReadAhead, ReadAheadFuture, ReadAheadLayer, DEFAULT_READ_AHEAD_BYTES,
};
pub use registry::{
    Ask, InFlightLease, Needs, NodeRegistry, NodeSnapshot, NodeView, Overload, Pick,
    RegistryConfig, RouteError, StickyView, ATTEMPTS_METRIC, STICKY_METRIC,
};
pub use route::{
    AvoidNodes, NotNodeFault, ResponseFuture, Route, RouteConfig, RouteLayer, MAX_FULL_REPICKS,
};
pub use score::{ScoreConfig, ScoreParts};
