//! The end hook's work: build the settlement and commit it on a spawned task, retrying.

use std::sync::Arc;
use std::time::Duration;

use spine_core::{AccountId, ModelId, NodeId, RequestId, StreamOutcome, Usage, UsageSource};

use super::{DiscrepancyReport, MeterEvents};
use crate::{Ledger, ModelTokenizer, Price, Settlement};

/// What the end hook needs to settle one request.
#[derive(Clone)]
pub(crate) struct SettleCtx {
    pub(crate) ledger: Arc<dyn Ledger>,
    pub(crate) events: Arc<dyn MeterEvents>,
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) request_id: RequestId,
    pub(crate) account: AccountId,
    pub(crate) model: ModelId,
    pub(crate) node: Option<NodeId>,
    pub(crate) tokenizer: Arc<ModelTokenizer>,
    pub(crate) price: Price,
    pub(crate) share_bps: u16,
    pub(crate) prompt_tokens: u64,
    pub(crate) tolerance_tokens: u64,
    pub(crate) tolerance_bps: u16,
}

impl std::fmt::Debug for SettleCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SettleCtx")
            .field("request_id", &self.request_id)
            .field("account", &self.account)
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

fn beyond(claimed: u64, billed: u64, tokens: u64, bps: u16) -> bool {
    let rel = u64::try_from(u128::from(billed) * u128::from(bps) / 10_000).unwrap_or(u64::MAX);
    claimed.abs_diff(billed) > tokens.max(rel)
}

impl SettleCtx {
    /// Settles on a spawned task. Retries with backoff (capped at 30 s) until the ledger accepts:
    /// settlement is idempotent by request id, so a retry never double-charges.
    pub(crate) fn settle(self, outcome: StreamOutcome, billed: Usage, claimed: Option<Usage>) {
        let discrepancy = outcome == StreamOutcome::Completed
            && claimed.is_some_and(|c| {
                beyond(
                    c.prompt_tokens,
                    billed.prompt_tokens,
                    self.tolerance_tokens,
                    self.tolerance_bps,
                ) || beyond(
                    c.completion_tokens,
                    billed.completion_tokens,
                    self.tolerance_tokens,
                    self.tolerance_bps,
                )
            });
        if discrepancy {
            if let Some(claimed) = claimed {
                self.events.on_discrepancy(&DiscrepancyReport {
                    request_id: self.request_id.clone(),
                    node: self.node.clone(),
                    model: self.model.clone(),
                    billed,
                    claimed,
                });
            }
        }
        let settlement = Settlement {
            request_id: self.request_id,
            account: self.account,
            node: self.node,
            model: self.model,
            outcome,
            billed,
            claimed,
            usage_source: UsageSource::Independent,
            discrepancy,
            price: self.price,
            share_bps: self.share_bps,
        };
        let ledger = self.ledger;
        let events = self.events;
        self.runtime.spawn(async move {
            let mut backoff = Duration::from_millis(50);
            loop {
                match ledger.settle(settlement.clone()).await {
                    Ok(result) => {
                        events.on_settled(&settlement, &result);
                        return;
                    }
                    Err(e) => {
                        tracing::error!(
                            request_id = %settlement.request_id,
                            error = %e,
                            ?settlement,
                            "settlement failed; retrying"
                        );
                        events.on_settle_error(&settlement, &e);
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(30));
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::beyond;

    #[test]
    fn tolerance_is_the_larger_of_absolute_and_relative() {
        assert!(!beyond(36, 34, 2, 200));
        assert!(beyond(37, 34, 2, 200));
        assert!(!beyond(1020, 1000, 2, 200));
        assert!(beyond(1021, 1000, 2, 200));
        assert!(beyond(0, 34, 2, 200));
    }
}
