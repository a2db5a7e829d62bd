//! The routing layer ([`RouteLayer`] / [`Route`], design brief §5): picks the node for each
//! request, retries on another node while nothing has reached the caller, and holds the node's
//! in-flight lease in the response body until it ends.
//!
//! - `config`: [`RouteConfig`], [`NotNodeFault`] and the context each request is routed by;
//! - `layer`: [`RouteLayer`], its builder setters;
//! - `service`: [`Route`], the tower service, and its policy (see its docs);
//! - `retry`: the attempts of one request, the admission queue and the scoring of failures that
//!   may follow the request rather than the node;
//! - `commit`: one attempt, from the node's head to its first content (or its failure);
//! - `future`: [`ResponseFuture`];
//! - `body`: the committed response body, which records the attempt's outcome once.

mod body;
mod commit;
mod config;
mod future;
mod layer;
mod retry;
mod service;
#[cfg(test)]
mod tests;

use spine_core::NodeId;

pub use config::{NotNodeFault, RouteConfig, MAX_FULL_REPICKS};
pub use future::ResponseFuture;
pub use layer::RouteLayer;
pub use service::Route;

/// A request extension: nodes the request must not be routed to, as if each had already been
/// tried (it is still queued for the others). The reference gateway's audit challenges use it
/// to reach one node (design brief §10); only code that builds the request can set it, never a
/// caller.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AvoidNodes(pub Vec<NodeId>);
