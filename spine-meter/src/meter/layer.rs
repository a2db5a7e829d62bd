use std::sync::Arc;

use tower::Layer;

use super::config::{
    body_budget, Catalog, MeterConfig, DEFAULT_MAX_BUFFERED_REQUEST_BYTES,
    DEFAULT_MAX_BUFFERED_REQUEST_BYTES_PER_ACCOUNT, DEFAULT_MAX_UNSETTLED_REQUESTS,
    DEFAULT_RESPONSE_BODY_TIMEOUT, DEFAULT_STREAM_STALL_TIMEOUT,
};
use super::{Admission, Meter, MeterError, MeterEvents, Settlements};
use crate::Ledger;

/// Applies [`Meter`] to a service. See the [module docs](super).
#[derive(Clone, Debug)]
pub struct MeterLayer {
    config: MeterConfig,
}

impl MeterLayer {
    /// A layer over `ledger` and `catalog` with the documented defaults.
    pub fn new(ledger: Arc<dyn Ledger>, catalog: Catalog) -> Self {
        let one_and_one = spine_core::Usage {
            prompt_tokens: 1,
            completion_tokens: 1,
        };
        let min_request_cost_micros = catalog
            .values()
            .map(|e| e.price.cost_micros(&one_and_one))
            .min()
            .unwrap_or(0);
        Self {
            config: MeterConfig {
                ledger,
                catalog: Arc::new(catalog),
                events: Arc::new(()),
                admission: None,
                audit: None,
                settlements: Settlements::default(),
                refused_credit: super::credit::RefusedCredit::default(),
                min_request_cost_micros,
                operator_share_bps: 7_000,
                max_request_body_bytes: 4 * 1024 * 1024,
                max_response_body_bytes: 16 * 1024 * 1024,
                discrepancy_tolerance_tokens: 2,
                discrepancy_tolerance_bps: 200,
                max_sse_line_bytes: crate::sse::DEFAULT_MAX_LINE_BYTES,
                max_sse_event_bytes: crate::sse::DEFAULT_MAX_EVENT_BYTES,
                max_stream_duration: std::time::Duration::from_secs(3600),
                stream_stall_timeout: DEFAULT_STREAM_STALL_TIMEOUT,
                response_body_timeout: DEFAULT_RESPONSE_BODY_TIMEOUT,
                drain_deadline: None,
                strip_engine_fields: true,
                refused_credit_delay: super::credit::DEFAULT_REFUSED_CREDIT_DELAY,
                refuse_unread_bodies: false,
                max_buffered_request_bytes: DEFAULT_MAX_BUFFERED_REQUEST_BYTES,
                request_body_budget: body_budget(DEFAULT_MAX_BUFFERED_REQUEST_BYTES),
                max_buffered_request_bytes_per_account:
                    DEFAULT_MAX_BUFFERED_REQUEST_BYTES_PER_ACCOUNT,
                account_body_bytes: Arc::default(),
                max_unsettled_requests: DEFAULT_MAX_UNSETTLED_REQUESTS,
                unsettled_wait: super::UNSETTLED_WAIT,
            },
        }
    }

    /// Sets the operator's share, basis points (clamped to 10 000).
    pub fn operator_share_bps(mut self, bps: u16) -> Self {
        self.config.operator_share_bps = bps.min(10_000);
        self
    }

    /// Sets the request body limit, bytes.
    pub fn max_request_body_bytes(mut self, limit: usize) -> Self {
        self.config.max_request_body_bytes = limit;
        self
    }

    /// Sets the budget of request-body bytes being read at once
    /// ([`MeterConfig::max_buffered_request_bytes`]).
    pub fn max_buffered_request_bytes(mut self, bytes: usize) -> Self {
        self.config.max_buffered_request_bytes = bytes;
        self.config.request_body_budget = body_budget(bytes);
        self
    }

    /// Sets the most requests whose hold or settlement is not committed
    /// ([`MeterConfig::max_unsettled_requests`]; 0: no bound) and how long a request waits for
    /// room among them ([`MeterConfig::unsettled_wait`]).
    pub fn max_unsettled_requests(mut self, requests: usize, wait: std::time::Duration) -> Self {
        self.config.max_unsettled_requests = if requests == 0 { usize::MAX } else { requests };
        self.config.unsettled_wait = wait;
        self
    }

    /// Sets one account's share of request-body bytes being read at once
    /// ([`MeterConfig::max_buffered_request_bytes_per_account`]).
    pub fn max_buffered_request_bytes_per_account(mut self, bytes: usize) -> Self {
        self.config.max_buffered_request_bytes_per_account = bytes;
        self
    }

    /// Sets the non-streamed response body limit, bytes.
    pub fn max_response_body_bytes(mut self, limit: usize) -> Self {
        self.config.max_response_body_bytes = limit;
        self
    }

    /// Sets the discrepancy tolerance: absolute tokens and basis points of the billed count.
    pub fn discrepancy_tolerance(mut self, tokens: u64, bps: u16) -> Self {
        self.config.discrepancy_tolerance_tokens = tokens;
        self.config.discrepancy_tolerance_bps = bps;
        self
    }

    /// Caps on a node's SSE lines and events, bytes ([`MeterConfig::max_sse_line_bytes`],
    /// [`MeterConfig::max_sse_event_bytes`]).
    pub fn max_sse_bytes(mut self, line_bytes: usize, event_bytes: usize) -> Self {
        self.config.max_sse_line_bytes = line_bytes;
        self.config.max_sse_event_bytes = event_bytes;
        self
    }

    /// The total bound on a streamed response ([`MeterConfig::max_stream_duration`]).
    pub fn max_stream_duration(mut self, duration: std::time::Duration) -> Self {
        self.config.max_stream_duration = duration;
        self
    }

    /// The bound on a stream without progress ([`MeterConfig::stream_stall_timeout`]).
    pub fn stream_stall_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.config.stream_stall_timeout = timeout;
        self
    }

    /// The total bound on reading a non-streamed answer's body
    /// ([`MeterConfig::response_body_timeout`]).
    pub fn response_body_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.config.response_body_timeout = timeout;
        self
    }

    /// The drain deadline ([`MeterConfig::drain_deadline`]): cancel `token` when a shutdown's
    /// grace period ends, then give open streams a moment to write their error event.
    pub fn drain_deadline(mut self, token: tokio_util::sync::CancellationToken) -> Self {
        self.config.drain_deadline = Some(token);
        self
    }

    /// Whether engine-internal members are removed from responses
    /// ([`MeterConfig::strip_engine_fields`]).
    pub fn strip_engine_fields(mut self, strip: bool) -> Self {
        self.config.strip_engine_fields = strip;
        self
    }

    /// How long a remembered refusal for lack of credit is held back
    /// ([`MeterConfig::refused_credit_delay`]).
    pub fn refused_credit_delay(mut self, delay: std::time::Duration) -> Self {
        self.config.refused_credit_delay = delay;
        self
    }

    /// Refuses for lack of credit without reading the request body
    /// ([`MeterConfig::refuse_unread_bodies`]): only behind a server that lingers on close.
    pub fn refuse_unread_bodies(mut self, refuse: bool) -> Self {
        self.config.refuse_unread_bodies = refuse;
        self
    }

    /// Sets the event hooks.
    pub fn events(mut self, events: Arc<dyn MeterEvents>) -> Self {
        self.config.events = events;
        self
    }

    /// Sets the admission hook, consulted after a request is counted and before its hold
    /// (see [`Admission`]). Default: none, everything is admitted.
    pub fn admission(mut self, admission: Arc<dyn Admission>) -> Self {
        self.config.admission = Some(admission);
        self
    }

    /// Offers each completed request's choice-0 text to `tap` once the caller has been answered
    /// (design brief §10: an [`Auditor`](crate::audit::Auditor) samples and scores them off the
    /// request path). Costs one copy of at most
    /// [`AuditTap::max_completion_bytes`](crate::audit::AuditTap::max_completion_bytes) of text
    /// per request. Default: none.
    pub fn audit(mut self, tap: Arc<dyn crate::audit::AuditTap>) -> Self {
        self.config.audit = Some(tap);
        self
    }

    /// The settlements this layer (and every service it made) has in flight: wait for them
    /// before a process exits so no request is left to the next start's stale-hold sweep.
    pub fn settlements(&self) -> Settlements {
        self.config.settlements.clone()
    }

    /// The handle a process that adds credit uses to drop this layer's remembered refusals of
    /// the account ([`CreditRefusals`](super::CreditRefusals)).
    pub fn credit_refusals(&self) -> super::CreditRefusals {
        super::CreditRefusals(self.config.refused_credit.clone())
    }

    /// The handle a handler uses to read a request body itself, before this layer, within the
    /// same bounds ([`BodyGate`]).
    pub fn body_gate(&self) -> BodyGate {
        BodyGate(self.config.clone())
    }

    /// The configuration.
    pub fn config(&self) -> &MeterConfig {
        &self.config
    }
}

impl<S> Layer<S> for MeterLayer {
    type Service = Meter<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Meter::new(inner, self.config.clone())
    }
}

/// Reads a request body as a [`MeterLayer`] does before it parses anything: an account refused
/// for lack of credit a moment ago gets its 402 (after the layer's delay) without its body being
/// kept, the body is buffered within `max_request_body_bytes` and the shared
/// `max_buffered_request_bytes` budget, and a large body's account must be able to pay for the
/// cheapest request. For a handler that must read (and, say, translate) a body before handing it
/// to the layer — the reference gateway's `/v1/responses` — so that a caller who cannot pay
/// makes it do no more work there than on the layer's own endpoints. Cheap to clone.
#[derive(Clone, Debug)]
pub struct BodyGate(MeterConfig);

impl BodyGate {
    /// The body of `account`'s request, whole.
    ///
    /// # Errors
    ///
    /// [`MeterError::InsufficientCredit`] (402), [`MeterError::BodyTooLarge`] (413),
    /// [`MeterError::BodiesOverBudget`] (503), [`MeterError::Body`] when reading fails.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the body and the budget it held; nothing is recorded.
    pub async fn read(
        &self,
        account: &spine_core::AccountId,
        body: spine_core::BoxBody,
    ) -> Result<bytes::Bytes, MeterError> {
        super::request_body::read_request_body(&self.0, account, body).await
    }
}

/// How long streams ended by the drain deadline get to write their error event to callers
/// before [`drain_streams`] gives up on them (a caller that reads nothing is cut).
pub const DRAIN_CUT_WRITE_BOUND: std::time::Duration = std::time::Duration::from_secs(5);

/// A shutdown's drain of the metered streams, once the listener serving them stopped accepting:
/// waits up to `grace` for `served` (the listener's task, done when its connections closed);
/// past it cancels `drain_deadline` (the layer's [`MeterLayer::drain_deadline`]), so each open
/// stream ends with its error event and settles `cut_at_bound`, and waits up to
/// [`DRAIN_CUT_WRITE_BOUND`] more. Whether `served` finished: when not, the caller closes the
/// connections still open (e.g. aborts the task).
///
/// # Cancel safety
///
/// Cancel safe: `served` is only polled.
pub async fn drain_streams<F: std::future::Future + Unpin>(
    served: &mut F,
    grace: std::time::Duration,
    drain_deadline: &tokio_util::sync::CancellationToken,
) -> bool {
    if tokio::time::timeout(grace, &mut *served).await.is_ok() {
        return true;
    }
    // each open stream ends with its error event and settles; the connections then close
    tracing::warn!("streams still open after the grace period; ending them");
    drain_deadline.cancel();
    tokio::time::timeout(DRAIN_CUT_WRITE_BOUND, served)
        .await
        .is_ok()
}
