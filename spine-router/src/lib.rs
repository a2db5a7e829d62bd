//! Routing for spine: which node serves a request.
//!
//! - [`NodeRegistry`]: the nodes this gateway can route to, their models, capacity and in-flight
//!   count. The tunnel tells it when a node becomes routable (after its first health probe) and
//!   when it is gone.
//! - [`RouteLayer`] / [`Route`]: a tower middleware that reads the requested model from the
//!   [`RequestPeek`](spine_core::RequestPeek) in the request's extensions, picks a node, puts its
//!   [`NodeId`](spine_core::NodeId) into the request's extensions for the transport below, and
//!   counts the request in flight until its response body ends.
//!
//! This is the minimal router of design brief §5: a uniform random pick among routable nodes that
//! serve the model and have free capacity. Scores, affinity and retries build on these types.
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
//!         models: vec![ModelDescriptor { id: ModelId::new("smollm2"), max_context_tokens: Some(2048) }],
//!         vram_mib: 0,
//!         max_concurrency: 4,
//!         agent_version: "0.1.0".into(),
//!     },
//! );
//! let picked = registry.pick(&ModelId::new("smollm2")).map(|lease| lease.node().clone());
//! assert_eq!(picked.ok(), Some(NodeId::new("n1")));
//! ```

mod registry;
mod route;

pub use registry::{InFlightLease, NodeRegistry, NodeSnapshot, RouteError};
pub use route::{ResponseFuture, Route, RouteLayer};
