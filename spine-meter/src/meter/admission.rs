//! Admission before the hold: a hook that may refuse a request for its worst-case token count
//! (e.g. a tokens-per-minute limit), told later how many tokens the request really used.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use spine_core::{AccountId, ModelId, RequestId, RequestKind};

use super::{DiscrepancyReport, MeterEvents};
use crate::ledger::{LedgerError, SettleResult, Settlement};

/// What [`Admission::admit`] sees of a request: counted, not yet held or forwarded.
#[derive(Debug)]
#[non_exhaustive]
pub struct AdmissionRequest<'a> {
    /// The request.
    pub request_id: &'a RequestId,
    /// The caller's account.
    pub account: &'a AccountId,
    /// The model asked for.
    pub model: &'a ModelId,
    /// The endpoint.
    pub kind: RequestKind,
    /// The worst case the hold covers, tokens: prompt + choices × per-choice cap (embeddings:
    /// the input tokens).
    pub reserved_tokens: u64,
    /// The request's extensions, where the application put what identifies the caller (e.g. its
    /// API key).
    pub extensions: &'a http::Extensions,
}

/// Why a request was not admitted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
#[non_exhaustive]
pub struct AdmissionRefusal {
    /// When a retry may succeed; `None` when it never will as sent (the request alone is over
    /// the limit).
    pub retry_after: Option<Duration>,
    /// Why, for the caller.
    pub reason: String,
}

impl AdmissionRefusal {
    /// A refusal.
    pub fn new(retry_after: Option<Duration>, reason: impl Into<String>) -> Self {
        Self {
            retry_after,
            reason: reason.into(),
        }
    }
}

/// The future [`Admission::admit_async`] returns.
pub type AdmitFuture<'a> = Pin<Box<dyn Future<Output = Result<(), AdmissionRefusal>> + Send + 'a>>;

/// Admission control the metering layer consults after counting a request and before placing
/// its hold. Set with [`MeterLayer::admission`](super::MeterLayer::admission); `()` admits
/// everything.
///
/// For every request `admit` accepted, [`Admission::release`] is called exactly once or more
/// (it must be idempotent per request id): with 0 tokens when the request was not forwarded
/// (its hold refused, the caller gone before the hold), else when its settlement is committed,
/// with the tokens the caller paid for (`completed` and `client_cancelled`: billed prompt +
/// completion; `upstream_failed` and `rejected`: 0).
pub trait Admission: Send + Sync + 'static {
    /// Admits the request or refuses it (the request is then never held nor forwarded).
    ///
    /// # Errors
    ///
    /// [`AdmissionRefusal`]: surfaced as [`MeterError::AdmissionRefused`](super::MeterError).
    fn admit(&self, request: &AdmissionRequest<'_>) -> Result<(), AdmissionRefusal>;

    /// [`Admission::admit`] for a hook that must ask something across the network (e.g. a
    /// rate-limit bucket shared in Redis by several gateway instances). The metering layer calls
    /// this one; the default answers with [`Admission::admit`].
    ///
    /// # Errors
    ///
    /// As [`Admission::admit`].
    ///
    /// # Cancel safety
    ///
    /// Dropped before it answers, the request is not admitted and [`Admission::release`] is
    /// not called for it (a bucket it already took tokens from gets them back by refill).
    fn admit_async<'a>(&'a self, request: &'a AdmissionRequest<'a>) -> AdmitFuture<'a> {
        Box::pin(std::future::ready(self.admit(request)))
    }

    /// The admitted request is over; `used_tokens` of its reservation were used.
    fn release(&self, request_id: &RequestId, used_tokens: u64);
}

impl Admission for () {
    fn admit(&self, _request: &AdmissionRequest<'_>) -> Result<(), AdmissionRefusal> {
        Ok(())
    }
    fn release(&self, _request_id: &RequestId, _used_tokens: u64) {}
}

/// The tokens a settlement counts against admission: what the caller paid for.
pub(crate) fn used_tokens(settlement: &Settlement) -> u64 {
    if settlement.outcome.is_billed() {
        settlement.billed.total_tokens()
    } else {
        0
    }
}

/// The layer's events plus the admission's release on settlement.
pub(crate) struct AdmissionEvents {
    pub(crate) inner: Arc<dyn MeterEvents>,
    pub(crate) admission: Arc<dyn Admission>,
}

impl MeterEvents for AdmissionEvents {
    fn on_discrepancy(&self, report: &DiscrepancyReport) {
        self.inner.on_discrepancy(report);
    }

    fn on_settled(&self, settlement: &Settlement, result: &SettleResult) {
        self.inner.on_settled(settlement, result);
        self.admission
            .release(&settlement.request_id, used_tokens(settlement));
    }

    fn on_settle_error(&self, settlement: &Settlement, error: &LedgerError) {
        self.inner.on_settle_error(settlement, error);
    }
}

/// Releases an admitted request with 0 tokens if dropped armed (not forwarded).
pub(crate) struct AdmitGuard {
    pub(crate) armed: Option<(Arc<dyn Admission>, RequestId)>,
}

impl AdmitGuard {
    /// The settlement takes over the release.
    pub(crate) fn disarm(&mut self) {
        self.armed = None;
    }
}

impl Drop for AdmitGuard {
    fn drop(&mut self) {
        if let Some((admission, id)) = self.armed.take() {
            admission.release(&id, 0);
        }
    }
}
