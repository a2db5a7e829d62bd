//! What a settlement writes, in one statement on PostgreSQL.
//!
//! Once a settlement has decided, it writes the request's record, its ledger entries, and then
//! the rows every settlement of that account (or operator) updates: the account's, its
//! roll-ups' and the operator's ([`SettlementWrites`]). Each of the last stays locked from its
//! update to the commit, so under one account's concurrent traffic the time from the first of
//! those updates to the commit bounds the settlements per second, across every instance. Written
//! one statement each, that is six round trips and the commit's; here it is one data-modifying
//! `WITH` statement and the commit's.
//!
//! PostgreSQL runs the sub-statements of a `WITH` in an order of its choosing (its manual, "Data-
//! Modifying Statements in WITH"), so each update of a shared row reads the one before it —
//! `FROM (SELECT count(*) FROM <previous>)` — which makes the previous one run to completion
//! first: those rows are locked in the tail's order (accounts, `usage_daily`,
//! `earnings_daily`, operators), the order paying escrow takes too. The record and the entries
//! are new rows no other transaction waits on: they are written first (the account's update
//! reads them too), so no shared row is locked while they are.

use sqlx::{Postgres, Transaction};

use crate::ledger::sql::console::rollup::{
    EARNINGS_CONFLICT, EARNINGS_INSERT, MS_PER_DAY, USAGE_CONFLICT, USAGE_INSERT,
};
use crate::ledger::sql::money::{entries_insert, SettlementWrites, REQUEST_COLUMNS};
use crate::ledger::sql::{bind, Arg, SqlConn as _};
use crate::ledger::LedgerError;

/// Writes `w` in `tx` with one statement ([module docs](self)).
///
/// # Errors
///
/// [`LedgerError::Database`].
pub(super) async fn settle_writes(
    tx: &mut Transaction<'static, Postgres>,
    w: SettlementWrites<'_>,
) -> Result<(), LedgerError> {
    let mut args = Vec::with_capacity(26 + 5 * w.entries.len() + 13);
    let sql = statement(&mut args, w);
    tx.exec(&sql, &args).await?;
    Ok(())
}

/// The statement, its values appended to `args`.
fn statement<'a>(args: &mut Vec<Arg<'a>>, w: SettlementWrites<'a>) -> String {
    let record = bind(args, w.record);
    let mut sql = format!(
        "WITH request AS (INSERT INTO requests ({REQUEST_COLUMNS}) VALUES ({}) RETURNING 1)",
        record.join(", ")
    );
    // the new rows first: the shared rows' locks are taken after them (a sub-statement nobody
    // reads runs at the end of the statement, inside those locks)
    // (each read is an aggregate: PostgreSQL folds a plain subquery whose column nobody uses
    // away, and the sub-statement with it)
    let mut written = "(SELECT count(*) FROM request) AS after_request".to_owned();
    if !w.entries.is_empty() {
        let entries = entries_insert(args, w.reference, &w.entries);
        sql.push_str(&format!(", entries AS ({entries} RETURNING 1)"));
        written.push_str(", (SELECT count(*) FROM entries) AS after_entries");
    }
    let t = w.tail;
    let r = t.rollup;
    let [debit, hold, account, day, model, key, prompt, completion] = bind(
        args,
        [
            Arg::I64(r.debit_micros),
            Arg::I64(t.hold_micros),
            Arg::Text(r.account),
            Arg::I64(r.created_at_ms.div_euclid(MS_PER_DAY)),
            Arg::Text(r.model),
            Arg::Text(r.key.unwrap_or("")),
            Arg::I64(r.prompt_tokens),
            Arg::I64(r.completion_tokens),
        ],
    );
    sql.push_str(&format!(
        ",
         account AS (
            UPDATE accounts SET balance_micros = balance_micros - {debit}, held_micros = held_micros - {hold}
            FROM {written}
            WHERE id = {account} RETURNING 1),
         usage AS (
            {USAGE_INSERT}
            SELECT {account}, {day}, {model}, {key}, 1, {prompt}, {completion}, {debit}
            FROM (SELECT count(*) FROM account) AS after_account
            {USAGE_CONFLICT} RETURNING 1)"
    ));
    let mut last = "usage";
    if let Some(op) = r.operator {
        let [op, node, served, paid] = bind(
            args,
            [
                Arg::Text(op),
                Arg::Text(r.node.unwrap_or("")),
                Arg::I64(i64::from(r.completed)),
                Arg::I64(r.paid_micros),
            ],
        );
        sql.push_str(&format!(
            ",
         earnings AS (
            {EARNINGS_INSERT}
            SELECT {op}, {day}, {model}, {node}, {served}, {completion}, {paid}
            FROM (SELECT count(*) FROM usage) AS after_usage
            {EARNINGS_CONFLICT} RETURNING 1)"
        ));
        last = "earnings";
        if t.credit_operator {
            sql.push_str(&format!(
                ",
         operator AS (
            UPDATE operators SET earned_micros = earned_micros + {paid}
            FROM (SELECT count(*) FROM earnings) AS after_earnings
            WHERE id = {op} RETURNING 1)"
            ));
            last = "operator";
        }
    }
    sql.push_str(&format!(" SELECT count(*) FROM {last}"));
    sql
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::ledger::pg::PgLedger;
    use crate::ledger::sql::console::rollup::SettledRow;
    use crate::ledger::sql::money::SettlementTail;
    use crate::ledger::sql::{Backend as _, SqlRow as _};

    /// PostgreSQL's plan of the statement reads each sub-statement from the next one, so none
    /// is left to run at the end of the statement: a plain subquery whose column nobody uses is
    /// folded away with the sub-statement it reads, which then ran last, inside the shared
    /// rows' locks (found in review; this test failed with that form).
    #[tokio::test]
    async fn the_plan_chains_every_write_new_rows_first() {
        let db = spine_test_support::PgDb::create();
        let ledger = PgLedger::connect(&db.url).await.unwrap();
        let text = Arg::Text;
        let int = Arg::I64;
        let writes = SettlementWrites {
            record: [
                text("r1"),
                text("acct"),
                text("m"),
                text("completed"),
                Arg::OptText(Some("node")),
                Arg::OptText(Some("op")),
                int(10),
                int(5),
                Arg::OptI64(None),
                Arg::OptI64(None),
                text("counted"),
                Arg::Bool(false),
                int(1),
                int(2),
                int(8000),
                int(10),
                int(10),
                int(8),
                int(2),
                int(20),
                int(0),
                Arg::OptText(None),
                Arg::OptText(None),
                Arg::OptText(None),
                Arg::OptI64(None),
                Arg::OptI64(None),
            ],
            reference: "request:r1",
            entries: vec![
                ("account", "acct", -10),
                ("operator", "op", 8),
                ("platform", "platform", 2),
            ],
            tail: SettlementTail {
                hold_micros: 20,
                rollup: SettledRow {
                    account: "acct",
                    operator: Some("op"),
                    node: Some("node"),
                    model: "m",
                    key: None,
                    created_at_ms: 0,
                    completed: true,
                    prompt_tokens: 10,
                    completion_tokens: 5,
                    debit_micros: 10,
                    paid_micros: 8,
                },
                credit_operator: true,
            },
        };
        let mut args = Vec::new();
        let sql = statement(&mut args, writes);
        let plan: Vec<String> = ledger
            .write()
            .await
            .unwrap()
            .all(&format!("EXPLAIN (VERBOSE) {sql}"), &args)
            .await
            .unwrap()
            .iter()
            .map(|row| row.text("QUERY PLAN").unwrap())
            .collect();
        let plan = plan.join("\n");
        for cte in [
            "request", "entries", "account", "usage", "earnings", "operator",
        ] {
            assert!(
                plan.contains(&format!("CTE Scan on {cte}")),
                "nothing reads `{cte}`: it would run at the end of the statement\n{plan}"
            );
        }
    }
}
