//! The metering tower middleware (design brief §2, §6).
//!
//! [`MeterLayer`] wraps the routing service. For each request it:
//! 1. reads the caller's [`RequestId`](spine_core::RequestId),
//!    [`AccountId`](spine_core::AccountId) and [`RequestKind`](spine_core::RequestKind) from the
//!    edge's [`RequestContext`](spine_core::RequestContext) in the request extensions (without
//!    one: the separate `RequestId` and `AccountId` extensions and the URI path);
//! 2. buffers the body (up to `max_request_body_bytes`), peeks it ([`RequestPeek`]), refuses an
//!    unknown model, checks chat `messages` ([`validate_chat_messages`]: a malformed or
//!    unsupported message is [`MeterError::BadRequest`], never forwarded), counts the prompt with
//!    the model's [`TokenCounter`] ([`CatalogEntry::tokenizer`]) and refuses a prompt that leaves no room for a completion
//!    token (`prompt >= max_context_tokens`: [`MeterError::ContextLengthExceeded`]). The count
//!    is made in 64 KiB pieces and stops as soon as a prompt cannot fit the context
//!    ([`MeterError::PromptOverContext`]) or, for a body of 64 KiB or more (whose account's
//!    balance is read first), as soon as the prompt costs more than the balance
//!    ([`MeterError::InsufficientCredit`]): a prompt that cannot be served or paid for costs
//!    the tokenizer no more than what fits;
//! 3. places a hold for the worst case: `cost(prompt + n × per_choice)` where
//!    `per_choice = max(1, min(max_tokens, context − prompt))` (no `max_tokens`:
//!    `context − prompt`; `max_tokens: 0` still holds one token, llama.cpp generates at least
//!    one), refusing with [`MeterError::InsufficientCredit`] when the available balance cannot
//!    cover it;
//! 4. for `stream: true` sets `stream_options.include_usage = true` upstream, inserts a
//!    [`BufferedRequest`](spine_core::BufferedRequest) (the body as it goes on, its peek and the
//!    longest prompt's tokens: the router reads these instead of collecting and parsing the body
//!    again), the [`RequestPeek`] and [`PromptTokens`](spine_core::PromptTokens) on their own
//!    and a [`NodeSlot`] into the request extensions and calls the inner service;
//! 5. wraps a streamed (`text/event-stream`) 2xx response body in [`MeterBody`], which forwards
//!    each SSE event as soon as it is complete, captures the node's usage claim, shapes the
//!    egress (see [`MeterBody`]) and settles the ledger once, on a spawned task, at whatever
//!    ending the body has;
//! 6. reads a non-streamed 2xx response body whole (up to `max_response_body_bytes`) BEFORE
//!    returning the response head: a usable completion comes back with the node's status and
//!    `usage` rewritten to the billed counts; a body that is not a JSON object, is over the
//!    limit, not whole within `response_body_timeout` (a body that trickles), carries an
//!    `error`, has no requested choice or a requested choice without `finish_reason` settles
//!    `upstream_failed` and is returned as [`MeterError::UpstreamInvalid`]
//!    ([`MeterError::UpstreamBody`] when reading it failed); the fault is reported on the
//!    [`NodeSlot`] for the router to score.
//!
//! **Endpoints.** The context's (else the request path's)
//! [`RequestKind`](spine_core::RequestKind) decides: `/v1/completions` and `/v1/embeddings` count their `prompt` / `input`
//! ([`prompt_inputs`](spine_core::prompt_inputs): a string, strings, token ids or token-id
//! arrays) without a chat template, each text segment with
//! [`TokenCounter::count_text`] and each
//! token id as one token; completions hold and bill `n` choices per prompt; embeddings hold and
//! bill the input tokens only and their non-streamed answer must carry one vector per input
//! (its `usage` becomes `{prompt_tokens, total_tokens}` = the billed count).
//!
//! **Counting.** Every count goes through the catalog entry's `Arc<dyn TokenCounter>`: the
//! prompt ([`TokenCounter::count_prompt`], [`TokenCounter::count_text`]) and each streamed
//! choice's delivered text as it passes ([`GeneratedCount`](crate::tokenizer::GeneratedCount)).
//! The gateway's counter is [`ModelTokenizer`] (feature `tokenizer`, on by default: the model's
//! own tokenizer and chat template from its GGUF). Without that feature this layer compiles
//! without the tokenizers crate, minijinja or onig, and meters with whatever counter the
//! application puts in its [`Catalog`]; the bill is as exact as that counter.
//!
//! **Admission.** With [`MeterLayer::admission`], an [`Admission`] hook sees the worst case the
//! hold covers after counting and may refuse ([`MeterError::AdmissionRefused`], nothing held or
//! forwarded); it is released with the tokens paid for when the settlement commits.
//!
//! The serving node is read from the RESPONSE extensions ([`NodeId`](spine_core::NodeId)), or,
//! before there is a response, from the [`NodeSlot`] the router fills when it picks.
//! Non-2xx responses pass through untouched and settle `upstream_failed`. An inner error settles
//! `upstream_failed` with the node when one was picked, else `rejected`; the caller pays nothing,
//! the hold is released, and the error is returned unchanged.
//!
//! **Caller gone before the response head.** The response future dropped after the hold is
//! placed but before the head is returned (the node is still working, or a non-streamed body is
//! still being read) settles `client_cancelled` with the node when one was picked — the caller
//! pays the prompt and 0 completion tokens, the operator is credited its share, because the node
//! already did the prefill — and `rejected` (nothing billed) when none was picked yet.
//!
//! **Billing.** Completion tokens are counted per choice the caller asked for: choices with an
//! index `>= n` are forwarded unchanged but never billed. A choice's completion tokens are the
//! tokens of its delivered text, plus one EOS token when its `finish_reason` is `"stop"` and the
//! text is under the per-choice cap, and never more than the cap `per_choice` of step 3 (the
//! request's `max_tokens`, bounded by the context room, at least 1). So the debit never exceeds
//! the hold. A caller that leaves mid-stream pays the delivered text without EOS, capped the
//! same way.
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
//! [`NodeSlot`]: spine_core::NodeSlot
//! [`validate_chat_messages`]: spine_core::validate_chat_messages
//! [`ModelTokenizer`]: crate::ModelTokenizer
//! [`TokenCounter`]: crate::TokenCounter
//! [`TokenCounter::count_text`]: crate::TokenCounter::count_text
//! [`TokenCounter::count_prompt`]: crate::TokenCounter::count_prompt

mod admission;
mod bill;
mod body;
mod caller;
mod config;
mod constraint;
mod credit;
mod embeddings;
mod error;
mod events;
mod future;
mod layer;
pub(crate) mod node_json;
mod prompt;
mod request_body;
mod service;
mod settle;

pub use admission::{Admission, AdmissionRefusal, AdmissionRequest, AdmitFuture};
pub use bill::MAX_TOOL_CALLS_PER_CHOICE;
pub use body::{MeterBody, KEEPALIVE_INTERVAL};
pub use caller::caller_response;
pub use config::{
    Catalog, CatalogEntry, MeterConfig, DEFAULT_MAX_BUFFERED_REQUEST_BYTES,
    DEFAULT_MAX_BUFFERED_REQUEST_BYTES_PER_ACCOUNT, DEFAULT_MAX_UNSETTLED_REQUESTS,
    DEFAULT_RESPONSE_BODY_TIMEOUT, DEFAULT_STREAM_STALL_TIMEOUT,
};
pub use credit::{
    CreditRefusals, DEFAULT_REFUSED_CREDIT_DELAY, MAX_DELAYED_REFUSALS, MAX_REFUSED_DELAYS,
    REFUSED_BODY_BYTES_PER_DELAY, REFUSED_CREDIT_TTL,
};
pub use error::MeterError;
pub use events::{DiscrepancyReport, MeterEvents};
pub use future::ResponseFuture;
pub use layer::{drain_streams, BodyGate, MeterLayer, DRAIN_CUT_WRITE_BOUND};
pub use service::Meter;
pub use settle::{Settlements, UNSETTLED_WAIT};

/// A response extension on a streamed answer: the usage the metering layer had counted when the
/// answer began (the prompt; 0 completion tokens). A binary may note it on the request's hold
/// (`Ledger::note_hold`), so that a sweep after a crash records what was known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CountedUsage(pub spine_core::Usage);

// the stack's suites meter with the real model tokenizer on a SQLite ledger; `tests_counter`
// runs without any optional feature
#[cfg(all(test, feature = "tokenizer", feature = "sqlite"))]
mod tests;
#[cfg(all(test, feature = "tokenizer", feature = "sqlite"))]
mod tests_billing;
#[cfg(test)]
mod tests_counter;
