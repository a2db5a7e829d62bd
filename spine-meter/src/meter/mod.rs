//! The metering tower middleware (design brief §2, §6).
//!
//! [`MeterLayer`] wraps the routing service. For each request it:
//! 1. reads the caller's [`RequestId`](spine_core::RequestId) and
//!    [`AccountId`](spine_core::AccountId) from the request extensions (put there by auth);
//! 2. buffers the body (up to `max_request_body_bytes`), peeks it ([`RequestPeek`]), refuses an
//!    unknown model, counts the prompt with the model's [`ModelTokenizer`];
//! 3. places a hold for the worst case: `cost(prompt + n × min(max_tokens, context − prompt))`
//!    (no `max_tokens`: `context − prompt`), refusing with
//!    [`MeterError::InsufficientCredit`] when the available balance cannot cover it;
//! 4. for `stream: true` sets `stream_options.include_usage = true` upstream, inserts the
//!    [`RequestPeek`] into the request extensions and calls the inner service;
//! 5. wraps a 2xx response body in [`MeterBody`], which forwards each SSE event as soon as it is
//!    complete, captures the node's usage claim, shapes the egress (see [`MeterBody`]) and settles
//!    the ledger once, on a spawned task, at whatever ending the body has.
//!
//! The serving node is read from the RESPONSE extensions ([`NodeId`](spine_core::NodeId)).
//! Non-2xx responses pass through untouched and settle `upstream_failed`; an inner error settles
//! `rejected` (the hold is released) and is returned unchanged.
//!
//! **Discrepancy.** When a completed request's node claim differs from the billed count by more
//! than `max(discrepancy_tolerance_tokens, billed × discrepancy_tolerance_bps / 10 000)` for the
//! prompt or the completion (defaults: 2 tokens, 200 bps = 2 %), the request record is flagged
//! and [`MeterEvents::on_discrepancy`] is called.
//!
//! ```
//! # use std::sync::Arc;
//! # use spine_meter::meter::{MeterLayer, Catalog};
//! # use spine_meter::SqliteLedger;
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let ledger = Arc::new(SqliteLedger::in_memory().await?);
//! let layer = MeterLayer::new(ledger, Catalog::new())
//!     .operator_share_bps(7_000)
//!     .max_request_body_bytes(1 << 20);
//! let svc = tower::ServiceBuilder::new().layer(layer).service(tower::service_fn(
//!     |_req: http::Request<spine_core::BoxBody>| async {
//!         Ok::<_, spine_core::BoxError>(http::Response::new(spine_core::BoxBody::default()))
//!     },
//! ));
//! # let _ = svc; Ok(()) }
//! ```
//!
//! [`RequestPeek`]: spine_core::RequestPeek
//! [`ModelTokenizer`]: crate::ModelTokenizer

mod body;
mod error;
mod events;
mod future;
mod layer;
mod service;
mod settle;

pub use body::MeterBody;
pub use error::MeterError;
pub use events::{DiscrepancyReport, MeterEvents};
pub use future::ResponseFuture;
pub use layer::{Catalog, CatalogEntry, MeterConfig, MeterLayer};
pub use service::Meter;

#[cfg(test)]
mod tests;
