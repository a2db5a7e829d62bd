//! What a settlement and an escrow release move, computed once for every store from the
//! module docs' rules ([`super`]): pure arithmetic, no database.

use spine_core::{ModelId, NodeId};

use super::Settlement;
#[cfg(doc)]
use crate::ledger::Store;

/// The amounts one settlement moves, micros: the module docs' rules, computed in one place for
/// every store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::ledger) struct SettleAmounts {
    /// Price of the billed usage; 0 when the outcome is not paid for.
    pub(in crate::ledger) cost_micros: u64,
    /// `min(cost, hold)`: what leaves the caller's balance.
    pub(in crate::ledger) debit_micros: u64,
    /// The operator's share of the debit (0 without an operator).
    pub(in crate::ledger) operator_credit_micros: u64,
    /// The rest of the debit.
    pub(in crate::ledger) fee_micros: u64,
}

impl Settlement {
    /// What this settlement moves given the request's active hold and whether the serving node
    /// has an operator: the caller pays only the billed outcomes ([`StreamOutcome::is_billed`]);
    /// the debit never exceeds the hold; the operator gets `floor(debit · share_bps / 10 000)`
    /// when the outcome pays operators ([`StreamOutcome::pays_operator`]), else nothing.
    pub(in crate::ledger) fn amounts(&self, hold_micros: u64, has_operator: bool) -> SettleAmounts {
        let pays = self.outcome.is_billed();
        let cost_micros = if pays {
            self.price.cost_micros(&self.billed)
        } else {
            0
        };
        let debit_micros = cost_micros.min(hold_micros);
        let share_bps = if has_operator && self.outcome.pays_operator() {
            self.share_bps
        } else {
            0
        };
        let parts = crate::price::split(debit_micros, share_bps);
        SettleAmounts {
            cost_micros,
            debit_micros,
            operator_credit_micros: parts.operator_credit_micros,
            fee_micros: parts.fee_micros,
        }
    }
}

/// The escrow party of a node's held earnings in `ledger_entries` (`platform` kind).
pub(in crate::ledger) fn escrow_party(node: &NodeId) -> String {
    format!("escrow:{node}")
}

/// What resolving a node's held earnings moves ([`Store::resolve_held_earnings`]), computed
/// once for every store from the resolved requests' `(operator, credit)`.
#[derive(Debug, Default, PartialEq, Eq)]
pub(in crate::ledger) struct EscrowRelease {
    /// `ref` of the ledger entries.
    pub(in crate::ledger) reference: String,
    /// `(party_kind, party_id, amount)`: the escrow out, the operators (paid) or the platform
    /// (forfeited) in; they sum to zero. Empty when nothing was held.
    pub(in crate::ledger) entries: Vec<(&'static str, String, i64)>,
    /// `(operator, micros)` to add to `operators.earned_micros` (paid only).
    pub(in crate::ledger) operator_credits: Vec<(String, i64)>,
    /// The credits resolved, micros.
    pub(in crate::ledger) total: i64,
}

pub(in crate::ledger) fn escrow_release(
    node: &NodeId,
    model: &ModelId,
    pay: bool,
    credits: impl IntoIterator<Item = (Option<String>, i64)>,
) -> EscrowRelease {
    let mut by_operator: std::collections::BTreeMap<String, i64> = Default::default();
    for (op, credit) in credits {
        *by_operator.entry(op.unwrap_or_default()).or_default() += credit;
    }
    let total: i64 = by_operator.values().sum();
    let mut out = EscrowRelease {
        reference: format!(
            "earnings:{node}:{model}:{}",
            if pay { "paid" } else { "forfeited" }
        ),
        total,
        ..EscrowRelease::default()
    };
    if total <= 0 {
        return out;
    }
    out.entries.push(("platform", escrow_party(node), -total));
    for (op, credit) in by_operator {
        if pay {
            out.entries.push(("operator", op.clone(), credit));
            out.operator_credits.push((op, credit));
        } else {
            out.entries
                .push(("platform", "platform".to_owned(), credit));
        }
    }
    out
}
