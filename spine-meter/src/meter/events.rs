use spine_core::{ModelId, NodeId, RequestId, Usage};

use crate::ledger::{LedgerError, SettleResult, Settlement};

/// A node's usage claim that disagrees with the independent count beyond the tolerance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscrepancyReport {
    /// The request.
    pub request_id: RequestId,
    /// The node that made the claim.
    pub node: Option<NodeId>,
    /// The model.
    pub model: ModelId,
    /// The independent count (what was billed).
    pub billed: Usage,
    /// The node's claim.
    pub claimed: Usage,
}

/// Hooks the metering layer calls; the router implements this to lower a node's score on a
/// discrepancy. Every method has a no-op default, and `()` implements the trait.
pub trait MeterEvents: Send + Sync + 'static {
    /// A node's claim disagreed with the count.
    fn on_discrepancy(&self, report: &DiscrepancyReport) {
        let _ = report;
    }

    /// A settlement was committed (or found already committed).
    fn on_settled(&self, settlement: &Settlement, result: &SettleResult) {
        let _ = (settlement, result);
    }

    /// A settlement attempt failed; it is retried.
    fn on_settle_error(&self, settlement: &Settlement, error: &LedgerError) {
        let _ = (settlement, error);
    }
}

impl MeterEvents for () {}
