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
    pub(crate) settlements: super::layer::Settlements,
    pub(crate) request_id: RequestId,
    pub(crate) account: AccountId,
    pub(crate) model: ModelId,
    pub(crate) node: Option<NodeId>,
    pub(crate) tokenizer: Arc<ModelTokenizer>,
    pub(crate) price: Price,
    pub(crate) share_bps: u16,
    pub(crate) prompt_tokens: u64,
    /// Choices the caller asked for (`n`): choice indexes `>= n` are never billed.
    pub(crate) n: u32,
    /// Most completion tokens billed per choice: `max(1, min(max_tokens, context − prompt))`,
    /// the per-choice part of the hold.
    pub(crate) max_completion_tokens_per_choice: u64,
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
    /// Whether choice `index` is one the caller asked for (`index < n`).
    pub(crate) fn is_requested_choice(&self, index: u64) -> bool {
        index < u64::from(self.n)
    }

    /// Completion tokens billed for one choice (module docs, "Billing"): the delivered text's
    /// tokens, plus one EOS when `with_eos`, `finish_reason` is `"stop"` and the text is under
    /// the per-choice cap; never more than the cap.
    pub(crate) fn choice_completion_tokens(
        &self,
        delivered: &str,
        finish_reason: Option<&str>,
        with_eos: bool,
    ) -> u64 {
        let cap = self.max_completion_tokens_per_choice;
        let text = self.tokenizer.count_text(delivered);
        let eos = u64::from(with_eos && finish_reason == Some("stop") && text < cap);
        text.saturating_add(eos).min(cap)
    }

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
        let runtime = self.runtime;
        self.settlements.spawn_on(
            async move {
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
            },
            &runtime,
        );
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
