//! What a [`MeterLayer`](super::MeterLayer) is configured with: the catalog of models and
//! prices, the ledger and counter, and every bound the metering service enforces.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use spine_core::ModelId;

use super::{Admission, MeterEvents, Settlements};
use crate::{Ledger, Price, TokenCounter};

/// One model the gateway meters.
#[derive(Clone, Debug)]
pub struct CatalogEntry {
    /// The model's token counter: its tokenizer and chat template
    /// ([`ModelTokenizer`](crate::ModelTokenizer), feature `tokenizer`), or any
    /// [`TokenCounter`] of the application's. An `Arc<ModelTokenizer>` coerces:
    /// `tokenizer: Arc::new(ModelTokenizer::from_gguf(path)?)`.
    pub tokenizer: Arc<dyn TokenCounter>,
    /// Its price.
    pub price: Price,
    /// The model's context window, tokens: a prompt of this many tokens or more is refused
    /// ([`MeterError::ContextLengthExceeded`](super::MeterError::ContextLengthExceeded)), and
    /// `context − prompt` bounds the hold and the completion tokens billed per choice.
    pub max_context_tokens: u64,
}

/// Models by the id callers use.
pub type Catalog = HashMap<ModelId, CatalogEntry>;

/// Everything the metering layer needs. Built by [`MeterLayer`](super::MeterLayer)'s setters.
#[derive(Clone)]
pub struct MeterConfig {
    pub(crate) ledger: Arc<dyn Ledger>,
    pub(crate) catalog: Arc<Catalog>,
    pub(crate) events: Arc<dyn MeterEvents>,
    pub(crate) admission: Option<Arc<dyn Admission>>,
    pub(crate) audit: Option<Arc<dyn crate::audit::AuditTap>>,
    pub(crate) settlements: Settlements,
    pub(crate) refused_credit: super::credit::RefusedCredit,
    /// The cheapest request any catalog model could be (1 prompt + 1 completion token), micros:
    /// an account remembered with less than this is refused before any counting.
    pub(crate) min_request_cost_micros: u64,
    /// The operator's share of each debit, basis points. Default 7 000 (70 %).
    pub operator_share_bps: u16,
    /// Largest request body buffered, bytes. Default 4 MiB.
    pub max_request_body_bytes: usize,
    /// Largest non-streamed response body buffered, bytes. Default 16 MiB. An answer larger than
    /// the request could honestly make (the stream byte bound of its cap: 1 MiB + 8 KiB a token
    /// of `n` × cap; embeddings from the model's vector length, else 1 MiB + 256 KiB a vector)
    /// is the node's fault, [`MeterError::UpstreamInvalid`](super::MeterError::UpstreamInvalid);
    /// one within that bound but over this limit is the gateway's,
    /// [`MeterError::AnswerTooLarge`](super::MeterError::AnswerTooLarge) (embeddings:
    /// [`MeterError::EmbeddingsTooLarge`](super::MeterError::EmbeddingsTooLarge), free). An
    /// embeddings request whose honest answer cannot fit it is refused before the node
    /// ([`MeterError::EmbeddingsRefused`](super::MeterError::EmbeddingsRefused)).
    pub max_response_body_bytes: usize,
    /// Absolute discrepancy tolerance, tokens. Default 2.
    pub discrepancy_tolerance_tokens: u64,
    /// Relative discrepancy tolerance, basis points of the billed count. Default 200 (2 %).
    pub discrepancy_tolerance_bps: u16,
    /// Longest line of a node's SSE stream, bytes (default 16 MiB,
    /// [`DEFAULT_MAX_LINE_BYTES`](crate::sse::DEFAULT_MAX_LINE_BYTES)); a node that sends a
    /// longer one fails the request (`upstream_failed`, scored as its fault).
    pub max_sse_line_bytes: usize,
    /// Largest SSE event of a node's stream, bytes (default 16 MiB,
    /// [`DEFAULT_MAX_EVENT_BYTES`](crate::sse::DEFAULT_MAX_EVENT_BYTES)); as above.
    pub max_sse_event_bytes: usize,
    /// Longest a streamed response may last from its head to its end (default 1 h; zero: no
    /// bound). Past it the caller's stream ends with an error event (code
    /// `stream_bound_reached`) and settles `cut_at_bound`.
    pub max_stream_duration: std::time::Duration,
    /// Longest a streamed response may go without PROGRESS (default 120 s,
    /// [`DEFAULT_STREAM_STALL_TIMEOUT`]; zero: no bound): new delivered text (content,
    /// reasoning, tool calls) or a `finish_reason` of a requested choice. Comments, empty deltas,
    /// role-only and usage chunks keep a connection alive but are not progress. Past it the
    /// node is stalled: the caller's stream ends with the `upstream_failed` error event (no
    /// `[DONE]`), the request settles `upstream_failed` with the delivered tokens recorded,
    /// and the fault is reported on the [`NodeSlot`](spine_core::NodeSlot) as
    /// [`NodeFault::Stalled`](spine_core::NodeFault::Stalled) (the router scores it as a
    /// mid-request disconnect). Only time spent waiting for or reading the node counts: while
    /// the caller has not asked for the next frame (a slow reader) the clock stops.
    pub stream_stall_timeout: std::time::Duration,
    /// Longest the body of a non-streamed answer may take to arrive, from its head to its end
    /// (default 120 s, [`DEFAULT_RESPONSE_BODY_TIMEOUT`]; zero: no bound). A node whose body
    /// trickles (bytes keep coming, slowly, forever) is cut when it passes: the caller gets a
    /// 502 ([`MeterError::UpstreamInvalid`](super::MeterError::UpstreamInvalid)), the request
    /// settles `upstream_failed` (the caller pays nothing) and the node is scored.
    pub response_body_timeout: std::time::Duration,
    /// Cancelled when a draining process stops waiting for streams in flight (default: none):
    /// each open stream then ends as at [`max_stream_duration`](Self::max_stream_duration),
    /// with the `stream_bound_reached` error event and a `cut_at_bound` settlement, instead of
    /// being cut mid-chunk when the process exits.
    pub drain_deadline: Option<tokio_util::sync::CancellationToken>,
    /// Whether members outside OpenAI's response shape (llama.cpp's `timings`, cache and slot
    /// counters, `__verbose`, …) are removed from what the caller gets (default `true`): they
    /// tell one caller about other callers' requests on the same node (a cached-prefix length
    /// is an oracle for another account's prompt). This switch governs the response's top
    /// level; inside each choice only OpenAI's members are ever passed on, whatever it says
    /// (`stop_reason`, `token_ids`, a legacy `function_call`, … are always dropped: the
    /// caller's SDK reads the choice, and text there that the meter does not count is free).
    pub strip_engine_fields: bool,
    /// How long the answer to a remembered refusal for lack of credit is held back (default
    /// 250 ms, [`DEFAULT_REFUSED_CREDIT_DELAY`](super::DEFAULT_REFUSED_CREDIT_DELAY);
    /// zero: answered at once). An account refused within
    /// [`REFUSED_CREDIT_TTL`](super::REFUSED_CREDIT_TTL) is refused before its body is
    /// parsed; holding the 402 back as well limits a closed-loop flood from a key that cannot
    /// pay to one refusal per connection per delay, a body larger than
    /// [`REFUSED_BODY_BYTES_PER_DELAY`](super::REFUSED_BODY_BYTES_PER_DELAY) one delay per
    /// started share of it, up to [`MAX_REFUSED_DELAYS`](super::MAX_REFUSED_DELAYS) (at most
    /// [`MAX_DELAYED_REFUSALS`](super::MAX_DELAYED_REFUSALS) wait at once).
    pub refused_credit_delay: std::time::Duration,
    /// Refuse for lack of credit without reading the request body (default `false`: the body
    /// is read and dropped first). A body that declares 64 KiB or more (`Content-Length`) then
    /// has the balance read before it is read, and a remembered refusal of one costs no copy
    /// of it (smaller bodies are still read, so that their connection stays open). Set it only
    /// when the server lingers on close, as [`spine_transport::LimitedServer`] does: a server
    /// that closes a connection with the body unread resets it, and a caller still writing a
    /// large body sees a broken pipe instead of the 402.
    pub refuse_unread_bodies: bool,
    /// Most bytes of request bodies being read at once, across every request (default 256 MiB;
    /// set with [`MeterLayer`](super::MeterLayer)'s setter of the same name). A request whose
    /// body would go over
    /// it is refused ([`MeterError::BodiesOverBudget`](super::MeterError::BodiesOverBudget),
    /// 503): bodies that are sent slowly or never finished hold at most this much memory, not
    /// [`max_request_body_bytes`](Self::max_request_body_bytes) per connection.
    pub max_buffered_request_bytes: usize,
    pub(crate) request_body_budget: Arc<tokio::sync::Semaphore>,
    /// Most bytes of request bodies being read at once for ONE account (default 32 MiB,
    /// [`DEFAULT_MAX_BUFFERED_REQUEST_BYTES_PER_ACCOUNT`]; set with
    /// [`MeterLayer`](super::MeterLayer)'s setter of the same name), within
    /// [`max_buffered_request_bytes`](Self::max_buffered_request_bytes). A request whose body
    /// would take its account over it is refused
    /// ([`MeterError::AccountBodiesOverBudget`](super::MeterError::AccountBodiesOverBudget),
    /// 429): one account that opens many connections and sends slowly holds at most this much,
    /// and the other accounts keep the rest of the shared budget.
    pub max_buffered_request_bytes_per_account: usize,
    pub(crate) account_body_bytes: Arc<AccountBodyBytes>,
    /// Most requests whose ledger write is not committed yet: answered requests whose
    /// settlement is not, and holds being placed (default 1,024,
    /// [`DEFAULT_MAX_UNSETTLED_REQUESTS`]; `usize::MAX`: no bound). One account may have a
    /// quarter of them; past that its request is refused at once
    /// ([`MeterError::AccountSettlementsBehind`](super::MeterError::AccountSettlementsBehind),
    /// 429). At the limit a new request waits before its hold
    /// until a settlement commits, at most [`unsettled_wait`](Self::unsettled_wait), then is
    /// refused ([`MeterError::SettlementsBehind`](super::MeterError::SettlementsBehind), 503).
    /// Why: the caller is answered before the settlement commits (the ledger's latency is not
    /// the caller's), so a crash loses the pending settlements (their holds are swept unpaid
    /// at the restart); a ledger slower than the traffic (measured: PostgreSQL at 2,000 req/s,
    /// `docs/benchmarks.md`) would otherwise let that backlog, and the memory it holds, grow
    /// without bound.
    pub max_unsettled_requests: usize,
    /// How long a request waits for room among the unsettled requests (default
    /// [`UNSETTLED_WAIT`](super::UNSETTLED_WAIT), 10 s).
    pub unsettled_wait: std::time::Duration,
}

/// Default of [`MeterConfig::max_unsettled_requests`]: 1,024.
pub const DEFAULT_MAX_UNSETTLED_REQUESTS: usize = 1_024;

/// Default of [`MeterConfig::max_buffered_request_bytes_per_account`]: 32 MiB.
pub const DEFAULT_MAX_BUFFERED_REQUEST_BYTES_PER_ACCOUNT: usize = 32 * 1024 * 1024;

/// Bytes of request bodies being read at once, per account
/// ([`MeterConfig::max_buffered_request_bytes_per_account`]). An account's entry lives while
/// one of its bodies is being read.
#[derive(Debug, Default)]
pub(crate) struct AccountBodyBytes {
    used: std::sync::Mutex<HashMap<spine_core::AccountId, usize>>,
}

impl AccountBodyBytes {
    /// Grows what one body of `account` holds from `*held` to `want` bytes, when the account's
    /// bodies stay within `limit`; false (nothing taken) otherwise.
    pub(crate) fn grow(
        &self,
        account: &spine_core::AccountId,
        held: &mut usize,
        want: usize,
        limit: usize,
    ) -> bool {
        if want <= *held {
            return true;
        }
        let mut map = self.used.lock().unwrap_or_else(|e| e.into_inner());
        let used = match map.get_mut(account) {
            Some(used) => used,
            None => map.entry(account.clone()).or_insert(0),
        };
        let others = used.saturating_sub(*held);
        if others.saturating_add(want) > limit {
            return false;
        }
        *used = others.saturating_add(want);
        *held = want;
        true
    }

    /// Gives back the `held` bytes of one body of `account`.
    pub(crate) fn release(&self, account: &spine_core::AccountId, held: usize) {
        if held == 0 {
            return;
        }
        let mut map = self.used.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(used) = map.get_mut(account) {
            *used = used.saturating_sub(held);
            if *used == 0 {
                map.remove(account);
            }
        }
    }

    /// Bytes `account`'s bodies hold now.
    #[cfg(test)]
    pub(crate) fn used(&self, account: &spine_core::AccountId) -> usize {
        self.used
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(account)
            .copied()
            .unwrap_or(0)
    }
}

/// Default of [`MeterConfig::stream_stall_timeout`]: 120 s.
pub const DEFAULT_STREAM_STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Default of [`MeterConfig::response_body_timeout`]: 120 s (an honest node sends a finished
/// answer's body at once: 16 MiB at 1 Mbit/s is ~130 s, the largest buffered body on the
/// slowest uplink worth serving).
pub const DEFAULT_RESPONSE_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Default of [`MeterConfig::max_buffered_request_bytes`]: 256 MiB.
pub const DEFAULT_MAX_BUFFERED_REQUEST_BYTES: usize = 256 * 1024 * 1024;

pub(super) fn body_budget(bytes: usize) -> Arc<tokio::sync::Semaphore> {
    Arc::new(tokio::sync::Semaphore::new(
        bytes
            .div_ceil(1024)
            .min(tokio::sync::Semaphore::MAX_PERMITS),
    ))
}

impl fmt::Debug for MeterConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MeterConfig")
            .field("ledger", &self.ledger)
            .field("models", &self.catalog.keys().collect::<Vec<_>>())
            .field("operator_share_bps", &self.operator_share_bps)
            .field("max_request_body_bytes", &self.max_request_body_bytes)
            .field("max_response_body_bytes", &self.max_response_body_bytes)
            .field(
                "discrepancy_tolerance_tokens",
                &self.discrepancy_tolerance_tokens,
            )
            .field("discrepancy_tolerance_bps", &self.discrepancy_tolerance_bps)
            .field("max_sse_line_bytes", &self.max_sse_line_bytes)
            .field("max_sse_event_bytes", &self.max_sse_event_bytes)
            .field("max_stream_duration", &self.max_stream_duration)
            .field("stream_stall_timeout", &self.stream_stall_timeout)
            .field("response_body_timeout", &self.response_body_timeout)
            .field("drain_deadline", &self.drain_deadline)
            .field("strip_engine_fields", &self.strip_engine_fields)
            .field("refused_credit_delay", &self.refused_credit_delay)
            .field("refuse_unread_bodies", &self.refuse_unread_bodies)
            .field(
                "max_buffered_request_bytes",
                &self.max_buffered_request_bytes,
            )
            .field(
                "max_buffered_request_bytes_per_account",
                &self.max_buffered_request_bytes_per_account,
            )
            .finish_non_exhaustive()
    }
}
