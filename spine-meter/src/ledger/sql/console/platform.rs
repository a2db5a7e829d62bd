//! The platform page's statements (schema version 9): every query reads a bounded range of an
//! index, never all request records: the roll-ups by day (`usage_daily_day`,
//! `earnings_daily_day`), the records with a discrepancy (`requests_discrepancy`, partial),
//! the active holds (`holds_held`, partial) and the escrowed records (`requests_held_earnings`,
//! partial), the nodes by time (`nodes_time`). Sums are cast to `BIGINT` (PostgreSQL's `SUM`
//! of a `BIGINT` is a `NUMERIC`).

use std::collections::BTreeMap;

use spine_core::{AccountId, ModelId, NodeId, OperatorId, Usage};

use super::super::{Arg, Backend, SqlConn, SqlRow};
use super::lists::{bounded, day_rows, first_day, keyset_page};
use crate::ledger::console::{
    DiscrepancyRecord, HeldCredit, NodeInfo, OperatorWindow, Page, PageCursor, PlatformDay,
};
use crate::ledger::LedgerError;

/// [`ConsoleStore::platform_days`](crate::ledger::ConsoleStore::platform_days): two grouped
/// reads of the roll-ups' rows of the window, joined by day here.
pub(in crate::ledger) async fn platform_days<B: Backend>(
    b: &B,
    since_ms: i64,
    until_ms: i64,
    limit: u32,
) -> Result<Vec<PlatformDay>, LedgerError> {
    let (since, until, limit) = (first_day(since_ms), first_day(until_ms), bounded(limit));
    let mut conn = b.read().await?;
    let usage = conn
        .all(
            "SELECT day, CAST(SUM(requests) AS BIGINT) AS requests,
                    CAST(SUM(prompt_tokens) AS BIGINT) AS prompt_tokens,
                    CAST(SUM(completion_tokens) AS BIGINT) AS completion_tokens,
                    CAST(SUM(debit_micros) AS BIGINT) AS debit
             FROM usage_daily WHERE day >= $1 AND day < $2
             GROUP BY day ORDER BY day DESC LIMIT $3",
            &[Arg::I64(since), Arg::I64(until), Arg::I64(limit)],
        )
        .await?;
    let earned = conn
        .all(
            "SELECT day, CAST(SUM(earned_micros) AS BIGINT) AS earned
             FROM earnings_daily WHERE day >= $1 AND day < $2
             GROUP BY day ORDER BY day DESC LIMIT $3",
            &[Arg::I64(since), Arg::I64(until), Arg::I64(limit)],
        )
        .await?;
    let mut days: BTreeMap<i64, PlatformDay> = BTreeMap::new();
    for row in &usage {
        let day = row.i64("day")?;
        days.insert(
            day,
            PlatformDay {
                day,
                requests: row.u64("requests")?,
                prompt_tokens: row.u64("prompt_tokens")?,
                completion_tokens: row.u64("completion_tokens")?,
                debit_micros: row.u64("debit")?,
                operator_credit_micros: 0,
            },
        );
    }
    for row in &earned {
        let day = row.i64("day")?;
        let d = days.entry(day).or_insert_with(|| PlatformDay {
            day,
            ..PlatformDay::default()
        });
        d.operator_credit_micros = row.u64("earned")?;
    }
    let mut out: Vec<PlatformDay> = days.into_values().rev().collect();
    out.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    Ok(out)
}

/// [`ConsoleStore::platform_operators`](crate::ledger::ConsoleStore::platform_operators).
pub(in crate::ledger) async fn platform_operators<B: Backend>(
    b: &B,
    since_ms: i64,
    until_ms: i64,
    limit: u32,
) -> Result<Vec<OperatorWindow>, LedgerError> {
    day_rows(
        b,
        "SELECT operator_id, CAST(SUM(requests_served) AS BIGINT) AS served,
                CAST(SUM(earned_micros) AS BIGINT) AS earned
         FROM earnings_daily WHERE day >= $1 AND day < $2
         GROUP BY operator_id ORDER BY earned DESC, operator_id LIMIT $3",
        &[],
        since_ms,
        until_ms,
        limit,
        |row| {
            Ok(OperatorWindow {
                operator: OperatorId::from(row.text("operator_id")?),
                requests_served: row.u64("served")?,
                earned_micros: row.u64("earned")?,
            })
        },
    )
    .await
}

/// [`ConsoleStore::platform_nodes`](crate::ledger::ConsoleStore::platform_nodes).
pub(in crate::ledger) async fn platform_nodes<B: Backend>(
    b: &B,
    after: Option<&PageCursor>,
    limit: u32,
) -> Result<Page<NodeInfo>, LedgerError> {
    keyset_page(
        b,
        "SELECT node_id, operator_id, name, created_at_ms FROM nodes
         WHERE (created_at_ms, node_id) < ($1, $2)
         ORDER BY created_at_ms DESC, node_id DESC LIMIT $3",
        &[],
        after,
        limit,
        |row| {
            Ok(NodeInfo {
                node_id: NodeId::from(row.text("node_id")?),
                operator: OperatorId::from(row.text("operator_id")?),
                name: row.opt_text("name")?,
                created_at_ms: row.i64("created_at_ms")?,
            })
        },
        |n| PageCursor {
            at_ms: n.created_at_ms,
            id: n.node_id.to_string(),
        },
    )
    .await
}

/// [`ConsoleStore::platform_discrepancies`](crate::ledger::ConsoleStore::platform_discrepancies):
/// `WHERE discrepancy` exactly as the partial index says it, so both stores read that index.
pub(in crate::ledger) async fn platform_discrepancies<B: Backend>(
    b: &B,
    after: Option<&PageCursor>,
    limit: u32,
) -> Result<Page<DiscrepancyRecord>, LedgerError> {
    keyset_page(
        b,
        "SELECT request_id, created_at_ms, account_id, node_id, operator_id, model,
                billed_prompt_tokens, billed_completion_tokens,
                claimed_prompt_tokens, claimed_completion_tokens
         FROM requests
         WHERE discrepancy AND (created_at_ms, request_id) < ($1, $2)
         ORDER BY created_at_ms DESC, request_id DESC LIMIT $3",
        &[],
        after,
        limit,
        |row| {
            Ok(DiscrepancyRecord {
                request_id: row.text("request_id")?,
                created_at_ms: row.i64("created_at_ms")?,
                account: AccountId::from(row.text("account_id")?),
                node: row.opt_text("node_id")?.map(NodeId::from),
                operator: row.opt_text("operator_id")?.map(OperatorId::from),
                model: ModelId::from(row.text("model")?),
                billed: Usage {
                    prompt_tokens: row.u64("billed_prompt_tokens")?,
                    completion_tokens: row.u64("billed_completion_tokens")?,
                },
                claimed: super::super::money::claimed_usage(row)?,
            })
        },
        |r| PageCursor {
            at_ms: r.created_at_ms,
            id: r.request_id.clone(),
        },
    )
    .await
}

/// [`ConsoleStore::platform_held`](crate::ledger::ConsoleStore::platform_held).
pub(in crate::ledger) async fn platform_held<B: Backend>(b: &B) -> Result<HeldCredit, LedgerError> {
    let mut conn = b.read().await?;
    let holds = conn
        .optional(
            "SELECT COUNT(*) AS n, CAST(COALESCE(SUM(amount_micros), 0) AS BIGINT) AS micros,
                    MIN(created_at_ms) AS oldest
             FROM holds WHERE state = 'held'",
            &[],
        )
        .await?;
    let escrow = conn
        .optional(
            "SELECT COUNT(*) AS n, CAST(COALESCE(SUM(operator_credit_micros), 0) AS BIGINT) AS micros
             FROM requests WHERE earnings = 'held'",
            &[],
        )
        .await?;
    let mut held = HeldCredit::default();
    if let Some(row) = holds {
        held.holds = row.u64("n")?;
        held.hold_micros = row.u64("micros")?;
        held.oldest_hold_at_ms = row.opt_i64("oldest")?;
    }
    if let Some(row) = escrow {
        held.escrow_requests = row.u64("n")?;
        held.escrow_micros = row.u64("micros")?;
    }
    Ok(held)
}
