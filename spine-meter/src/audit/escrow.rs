//! [`EscrowOnVerdict`]: an audit's verdict settles the node's escrowed earnings.

use std::sync::Arc;
use std::time::Duration;

use spine_core::{AuditVerdict, ModelId, NodeId};

use super::AuditEvents;
use crate::Store;

/// Resolves a node's escrowed earnings at its audit's verdict (design brief §10): paid to its
/// operator when the (node, model) reaches `passing`, kept by the platform when it reaches
/// `failed` ([`Store::resolve_held_earnings`]); other verdicts leave them held.
///
/// Each resolution runs on a spawned tokio task (`on_verdict` must be called within a runtime)
/// and is retried with a backoff from 100 ms doubling to 30 s until it commits: the escrow
/// stays held, and shown, until then.
#[derive(Clone)]
pub struct EscrowOnVerdict(Arc<dyn Store>);

impl EscrowOnVerdict {
    /// Resolves escrowed earnings in `store`.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self(store)
    }
}

impl std::fmt::Debug for EscrowOnVerdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EscrowOnVerdict").finish_non_exhaustive()
    }
}

impl AuditEvents for EscrowOnVerdict {
    fn on_verdict(&self, node: &NodeId, model: &ModelId, _from: AuditVerdict, to: AuditVerdict) {
        use AuditVerdict as V;
        // any way into `passing` pays what is held (a suspect node may pass through
        // `unverified` on its way back); any way into `failed` forfeits it
        let pay = match to {
            V::Passing => true,
            V::Failed => false,
            _ => return,
        };
        let (store, node, model) = (self.0.clone(), node.clone(), model.clone());
        tokio::spawn(async move {
            // retried: the escrow stays held (and shown) until this commits
            let mut backoff = Duration::from_millis(100);
            loop {
                match store.resolve_held_earnings(&node, &model, pay).await {
                    Ok(moved) => {
                        tracing::info!(node = %node, model = %model, pay, requests = moved.requests, micros = moved.micros, "held earnings resolved");
                        return;
                    }
                    Err(e) => {
                        tracing::error!(node = %node, model = %model, error = %e, "resolving held earnings failed; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(30));
                    }
                }
            }
        });
    }
}
