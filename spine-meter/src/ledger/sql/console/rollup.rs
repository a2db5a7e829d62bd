//! The console's daily roll-ups, written in the settlement's own transaction so the usage and
//! earnings pages read at most a row per day × model (× key) instead of every request record:
//! `usage_daily` (account × UTC day × model × key: requests, prompt and completion tokens
//! billed, debit) and `earnings_daily` (operator × UTC day × model × node, schema version 8:
//! requests served to the end, completion tokens, operator credit paid), which the earnings page
//! sums over nodes and the nodes page ([`Store::operator_nodes`](crate::ledger::Store::operator_nodes))
//! over days and models. Credit held in escrow is added to `earnings_daily` when it is paid
//! ([`record_paid_escrow`]), never when it is forfeited. A settlement writes one row of each
//! (the node is a key column of the earnings row, not a third table). A settlement locks the
//! account's row, then these two, then the operator's row; paying escrow
//! (`resolve_held_earnings`) locks `earnings_daily`, then the operator's row: one order.

use std::sync::LazyLock;

use super::super::{Arg, SqlConn};
use crate::ledger::LedgerError;

/// Milliseconds per UTC day: a record's day is `created_at_ms / MS_PER_DAY`.
pub(in crate::ledger) const MS_PER_DAY: i64 = 86_400_000;

/// The head of the `usage_daily` upsert: its columns are account, day, model, key, requests,
/// prompt tokens, completion tokens, debit (values follow: a `VALUES` list, or a `SELECT` in
/// PostgreSQL's one-statement settlement tail).
pub(in crate::ledger) const USAGE_INSERT: &str = "INSERT INTO usage_daily (account_id, day, model, key_hash, requests, prompt_tokens, completion_tokens, debit_micros)";

/// The tail of the `usage_daily` upsert: a row already there is added to.
pub(in crate::ledger) const USAGE_CONFLICT: &str =
    "ON CONFLICT (account_id, day, model, key_hash) DO UPDATE SET
    requests = usage_daily.requests + excluded.requests,
    prompt_tokens = usage_daily.prompt_tokens + excluded.prompt_tokens,
    completion_tokens = usage_daily.completion_tokens + excluded.completion_tokens,
    debit_micros = usage_daily.debit_micros + excluded.debit_micros";

/// The head of the `earnings_daily` upsert: its columns are operator, day, model, node, requests
/// served, completion tokens, credit paid.
pub(in crate::ledger) const EARNINGS_INSERT: &str = "INSERT INTO earnings_daily (operator_id, day, model, node_id, requests_served, completion_tokens, earned_micros)";

/// The tail of the `earnings_daily` upsert: a row already there is added to.
pub(in crate::ledger) const EARNINGS_CONFLICT: &str =
    "ON CONFLICT (operator_id, day, model, node_id) DO UPDATE SET
    requests_served = earnings_daily.requests_served + excluded.requests_served,
    completion_tokens = earnings_daily.completion_tokens + excluded.completion_tokens,
    earned_micros = earnings_daily.earned_micros + excluded.earned_micros";

/// The `usage_daily` upsert of one settlement, on both stores.
static USAGE_UPSERT: LazyLock<String> = LazyLock::new(|| {
    format!("{USAGE_INSERT} VALUES ($1, $2, $3, $4, 1, $5, $6, $7) {USAGE_CONFLICT}")
});

/// The `earnings_daily` upsert of one settlement or escrow payment, on both stores.
static EARNINGS_UPSERT: LazyLock<String> = LazyLock::new(|| {
    format!("{EARNINGS_INSERT} VALUES ($1, $2, $3, $4, $5, $6, $7) {EARNINGS_CONFLICT}")
});

/// One settled request, as the roll-ups count it.
#[derive(Clone, Copy, Debug)]
pub(in crate::ledger) struct SettledRow<'a> {
    pub(in crate::ledger) account: &'a str,
    pub(in crate::ledger) operator: Option<&'a str>,
    /// The node that served it; always `Some` when `operator` is (the operator is the node's).
    pub(in crate::ledger) node: Option<&'a str>,
    pub(in crate::ledger) model: &'a str,
    /// The key's name, `None` for a request without one (stored as `''`).
    pub(in crate::ledger) key: Option<&'a str>,
    pub(in crate::ledger) created_at_ms: i64,
    pub(in crate::ledger) completed: bool,
    pub(in crate::ledger) prompt_tokens: i64,
    pub(in crate::ledger) completion_tokens: i64,
    pub(in crate::ledger) debit_micros: i64,
    /// Operator credit paid now (0 when held in escrow or when there is no operator).
    pub(in crate::ledger) paid_micros: i64,
}

/// Adds one settled request to the roll-ups (inside the settlement's transaction).
///
/// # Errors
///
/// [`LedgerError::Database`].
pub(in crate::ledger) async fn record_settlement<C: SqlConn + ?Sized>(
    tx: &mut C,
    r: SettledRow<'_>,
) -> Result<(), LedgerError> {
    let day = r.created_at_ms.div_euclid(MS_PER_DAY);
    tx.exec(
        &USAGE_UPSERT,
        &[
            Arg::Text(r.account),
            Arg::I64(day),
            Arg::Text(r.model),
            Arg::Text(r.key.unwrap_or("")),
            Arg::I64(r.prompt_tokens),
            Arg::I64(r.completion_tokens),
            Arg::I64(r.debit_micros),
        ],
    )
    .await?;
    if let Some(op) = r.operator {
        add_earnings(
            tx,
            EarningsKey {
                operator: op,
                day,
                model: r.model,
                node: r.node.unwrap_or(""),
            },
            i64::from(r.completed),
            r.completion_tokens,
            r.paid_micros,
        )
        .await?;
    }
    Ok(())
}

/// Adds escrowed operator credit now paid (`credit_micros` of a request of `model` that `node`
/// served, settled at `created_at_ms`) to `earnings_daily`.
///
/// # Errors
///
/// [`LedgerError::Database`].
pub(in crate::ledger) async fn record_paid_escrow<C: SqlConn + ?Sized>(
    tx: &mut C,
    operator: &str,
    node: &str,
    model: &str,
    created_at_ms: i64,
    credit_micros: i64,
) -> Result<(), LedgerError> {
    let day = created_at_ms.div_euclid(MS_PER_DAY);
    let key = EarningsKey {
        operator,
        day,
        model,
        node,
    };
    add_earnings(tx, key, 0, 0, credit_micros).await
}

/// The key of one `earnings_daily` row.
#[derive(Clone, Copy, Debug)]
struct EarningsKey<'a> {
    operator: &'a str,
    /// UTC day, days since the epoch.
    day: i64,
    model: &'a str,
    node: &'a str,
}

/// Adds to the `earnings_daily` row `key` (inserted when missing): `served` requests served to
/// the end, `completion_tokens`, `earned_micros` paid. One statement for both stores, the
/// settlement's and the escrow payment's.
async fn add_earnings<C: SqlConn + ?Sized>(
    tx: &mut C,
    key: EarningsKey<'_>,
    served: i64,
    completion_tokens: i64,
    earned_micros: i64,
) -> Result<(), LedgerError> {
    tx.exec(
        &EARNINGS_UPSERT,
        &[
            Arg::Text(key.operator),
            Arg::I64(key.day),
            Arg::Text(key.model),
            Arg::Text(key.node),
            Arg::I64(served),
            Arg::I64(completion_tokens),
            Arg::I64(earned_micros),
        ],
    )
    .await?;
    Ok(())
}
