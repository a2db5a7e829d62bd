//! The money path, once for both stores: holds, settlement, sweeps of stale holds, escrowed
//! earnings, credits and the double-entry ledger entries (module docs of [`super::super`]).

use spine_core::{
    AccountId, ModelId, NodeId, OperatorId, RequestId, StreamOutcome, Usage, UsageSource,
};

use super::accounts::balance_from_row;
use super::{
    bind, retrying, unique_as, Arg, Backend, HoldRequest, Row, SqlConn, SqlRow, TxEnd as _,
};
use crate::ledger::amounts::SettleAmounts;
use crate::ledger::convert::{db, now_ms, to_i64, to_u64};
use crate::ledger::{
    EarningsState, EntryTotals, HeldEarnings, HoldNote, LedgerError, RequestRecord, SettleResult,
    Settlement, SweepKind,
};
use crate::price::Price;

/// The columns of a hold that a sweep settles from, in [`settle_hold_rows`]'s order.
pub(in crate::ledger) const HOLD_COLUMNS: &str =
    "request_id, account_id, model, node_id, prompt_tokens, completion_tokens";

/// The node's claimed usage of a `requests` row (`claimed_prompt_tokens`,
/// `claimed_completion_tokens`), `None` when it made none.
pub(in crate::ledger) fn claimed_usage<R: SqlRow>(row: &R) -> Result<Option<Usage>, LedgerError> {
    Ok(
        match (
            row.opt_i64("claimed_prompt_tokens")?,
            row.opt_i64("claimed_completion_tokens")?,
        ) {
            (Some(p), Some(c)) => Some(Usage {
                prompt_tokens: to_u64(p, "claimed_prompt_tokens")?,
                completion_tokens: to_u64(c, "claimed_completion_tokens")?,
            }),
            _ => None,
        },
    )
}

/// Inserts ledger entries `(party kind, party id, amount)` under one reference, in order, with
/// one statement (one round trip).
pub(super) async fn insert_entries<C: SqlConn + ?Sized>(
    c: &mut C,
    reference: &str,
    entries: &[(&str, &str, i64)],
) -> Result<(), LedgerError> {
    if entries.is_empty() {
        return Ok(());
    }
    let mut args = Vec::with_capacity(entries.len() * 5);
    let sql = entries_insert(&mut args, reference, entries);
    c.exec(&sql, &args).await?;
    Ok(())
}

/// The `INSERT` of ledger entries `(party kind, party id, amount)` under one reference, in
/// order, its values appended to `args` (numbered on from those already there, [`bind`]).
/// `entries` is not empty.
pub(in crate::ledger) fn entries_insert<'a>(
    args: &mut Vec<Arg<'a>>,
    reference: &'a str,
    entries: &[(&'a str, &'a str, i64)],
) -> String {
    let mut sql = String::from(
        "INSERT INTO ledger_entries (ref, party_kind, party_id, amount_micros, created_at_ms) VALUES ",
    );
    let now = now_ms();
    for (i, &(party_kind, party_id, amount_micros)) in entries.iter().enumerate() {
        if i > 0 {
            sql.push_str(", ");
        }
        let row = bind(
            args,
            [
                Arg::Text(reference),
                Arg::Text(party_kind),
                Arg::Text(party_id),
                Arg::I64(amount_micros),
                Arg::I64(now),
            ],
        );
        sql.push_str(&format!("({})", row.join(", ")));
    }
    sql
}

/// The columns of a request's record, in [`SettlementWrites::record`]'s order.
pub(in crate::ledger) const REQUEST_COLUMNS: &str = "request_id, account_id, model, outcome, node_id, operator_id,
    billed_prompt_tokens, billed_completion_tokens, claimed_prompt_tokens, claimed_completion_tokens,
    usage_source, discrepancy, input_micros_per_mtok, output_micros_per_mtok, share_bps,
    cost_micros, debit_micros, operator_credit_micros, fee_micros, hold_micros, created_at_ms, swept,
    earnings, key_hash, duration_ms, ttft_ms";

/// What a settlement writes once it has decided, in this order: the request's record, its
/// ledger entries, then its [`SettlementTail`] ([`Backend::settle_writes`]).
#[derive(Debug)]
pub(in crate::ledger) struct SettlementWrites<'a> {
    /// The request's record, one value per column of [`REQUEST_COLUMNS`].
    pub(in crate::ledger) record: [Arg<'a>; 26],
    /// The ledger entries' reference (`request:<id>`).
    pub(in crate::ledger) reference: &'a str,
    /// The ledger entries `(party kind, party id, amount)`; none when nothing was debited.
    pub(in crate::ledger) entries: Vec<(&'a str, &'a str, i64)>,
    pub(in crate::ledger) tail: SettlementTail<'a>,
}

/// Writes `w` with one statement each for the record and the entries, then
/// [`settle_tail_in_turn`] ([`Backend::settle_writes`]'s default).
///
/// # Errors
///
/// [`LedgerError::Database`].
pub(in crate::ledger) async fn settle_writes_in_turn<C: SqlConn + ?Sized>(
    tx: &mut C,
    w: SettlementWrites<'_>,
) -> Result<(), LedgerError> {
    static RECORD_INSERT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let values: Vec<String> = (1..=26).map(|i| format!("${i}")).collect();
        format!(
            "INSERT INTO requests ({REQUEST_COLUMNS}) VALUES ({})",
            values.join(", ")
        )
    });
    tx.exec(&RECORD_INSERT, &w.record).await?;
    insert_entries(tx, w.reference, &w.entries).await?;
    settle_tail_in_turn(tx, w.tail).await
}

/// The rows a settlement updates that other settlements update too (the account's, its
/// roll-ups', the operator's), written last and in this order: accounts, `usage_daily`,
/// `earnings_daily`, operators (the order paying escrow locks the last two in).
#[derive(Clone, Copy, Debug)]
pub(in crate::ledger) struct SettlementTail<'a> {
    /// Released from the account's holds.
    pub(in crate::ledger) hold_micros: i64,
    /// The request as the roll-ups count it (its account, operator, node, model, key, day, and
    /// the debit, which is also taken from the account's balance).
    pub(in crate::ledger) rollup: super::console::rollup::SettledRow<'a>,
    /// Whether the operator's earnings are credited now (the roll-up's `paid_micros`); false
    /// without an operator or when the credit is held in escrow.
    pub(in crate::ledger) credit_operator: bool,
}

/// Writes `tail` with one statement per row, in its order (part of
/// [`settle_writes_in_turn`]).
///
/// # Errors
///
/// [`LedgerError::Database`].
async fn settle_tail_in_turn<C: SqlConn + ?Sized>(
    tx: &mut C,
    tail: SettlementTail<'_>,
) -> Result<(), LedgerError> {
    tx.exec(
        "UPDATE accounts SET balance_micros = balance_micros - $1, held_micros = held_micros - $2 WHERE id = $3",
        &[
            Arg::I64(tail.rollup.debit_micros),
            Arg::I64(tail.hold_micros),
            Arg::Text(tail.rollup.account),
        ],
    )
    .await?;
    super::console::rollup::record_settlement(tx, tail.rollup).await?;
    // after the roll-ups: `resolve_held_earnings` locks `earnings_daily`, then `operators`
    if let (Some(op), true) = (tail.rollup.operator, tail.credit_operator) {
        credit_operator(tx, op, tail.rollup.paid_micros).await?;
    }
    Ok(())
}

/// Adds `micros` to `operator`'s earnings.
async fn credit_operator<C: SqlConn + ?Sized>(
    c: &mut C,
    operator: &str,
    micros: i64,
) -> Result<(), LedgerError> {
    c.exec(
        "UPDATE operators SET earned_micros = earned_micros + $1 WHERE id = $2",
        &[Arg::I64(micros), Arg::Text(operator)],
    )
    .await?;
    Ok(())
}

/// Why `hold` was not placed, from the account's row (`balance_micros`, `held_micros`) read
/// when it was refused: [`LedgerError::UnknownAccount`] without a row, else
/// [`LedgerError::InsufficientCredit`] with the exact `balance − held`.
pub(in crate::ledger) fn hold_refusal<R: SqlRow>(
    row: Option<R>,
    hold: HoldRequest<'_>,
) -> LedgerError {
    let Some(row) = row else {
        return LedgerError::UnknownAccount(hold.account.clone());
    };
    match balance_from_row(&row) {
        Ok(b) => LedgerError::InsufficientCredit {
            available_micros: b.available_micros,
            needed_micros: hold.amount_micros,
        },
        Err(e) => e,
    }
}

/// Inserts the hold row of a request whose amount was added to its account's `held_micros`
/// ([`LedgerError::Duplicate`] `"hold"` when the request has one), recording `instance_id`
/// when there is one.
pub(in crate::ledger) async fn insert_hold<C: SqlConn + ?Sized>(
    c: &mut C,
    hold: HoldRequest<'_>,
    instance_id: Option<&str>,
) -> Result<(), LedgerError> {
    let (column, value) = match instance_id {
        Some(_) => (", instance_id", ", $6"),
        None => ("", ""),
    };
    let sql = format!(
        "INSERT INTO holds (request_id, account_id, model, amount_micros, state, created_at_ms{column})
         VALUES ($1, $2, $3, $4, 'held', $5{value})"
    );
    let mut args = vec![
        Arg::Text(hold.request_id),
        Arg::Text(hold.account.as_str()),
        Arg::Text(hold.model),
        Arg::I64(to_i64(hold.amount_micros)?),
        Arg::I64(now_ms()),
    ];
    args.extend(instance_id.map(Arg::Text));
    c.exec(&sql, &args)
        .await
        .map_err(|e| unique_as(e, "hold"))?;
    Ok(())
}

/// [`Ledger::hold`](crate::ledger::Ledger::hold).
pub(in crate::ledger) async fn hold<B: Backend>(
    b: &B,
    request_id: RequestId,
    account: AccountId,
    model: ModelId,
    amount_micros: u64,
) -> Result<(), LedgerError> {
    let hold = HoldRequest {
        request_id: request_id.as_str(),
        account: &account,
        model: model.as_str(),
        amount_micros,
    };
    retrying::<B, _, _, _>(|| b.hold_once(hold)).await
}

/// [`Ledger::release`](crate::ledger::Ledger::release).
pub(in crate::ledger) async fn release<B: Backend>(
    b: &B,
    request_id: RequestId,
) -> Result<(), LedgerError> {
    retrying::<B, _, _, _>(|| release_once(b, &request_id)).await
}

async fn release_once<B: Backend>(b: &B, request_id: &RequestId) -> Result<(), LedgerError> {
    let mut tx = b.begin().await?;
    let row = tx
        .optional(
            "UPDATE holds SET state = 'released' WHERE request_id = $1 AND state = 'held' RETURNING account_id, amount_micros",
            &[Arg::Text(request_id.as_str())],
        )
        .await?;
    if let Some(row) = row {
        let account = row.text("account_id")?;
        let amount = row.i64("amount_micros")?;
        tx.exec(
            "UPDATE accounts SET held_micros = held_micros - $1 WHERE id = $2",
            &[Arg::I64(amount), Arg::Text(&account)],
        )
        .await?;
    }
    tx.commit().await.map_err(db)
}

/// [`Ledger::note_hold`](crate::ledger::Ledger::note_hold).
pub(in crate::ledger) async fn note_hold<B: Backend>(
    b: &B,
    request_id: RequestId,
    note: HoldNote,
) -> Result<(), LedgerError> {
    retrying::<B, _, _, _>(|| note_hold_once(b, &request_id, &note)).await
}

async fn note_hold_once<B: Backend>(
    b: &B,
    request_id: &RequestId,
    note: &HoldNote,
) -> Result<(), LedgerError> {
    let prompt = note.known.map(|u| to_i64(u.prompt_tokens)).transpose()?;
    let completion = note
        .known
        .map(|u| to_i64(u.completion_tokens))
        .transpose()?;
    b.write()
        .await?
        .exec(
            "UPDATE holds SET node_id = COALESCE($1, node_id), prompt_tokens = COALESCE($2, prompt_tokens),
                completion_tokens = COALESCE($3, completion_tokens)
             WHERE request_id = $4 AND state = 'held'",
            &[
                Arg::OptText(note.node.as_ref().map(NodeId::as_str)),
                Arg::OptI64(prompt),
                Arg::OptI64(completion),
                Arg::Text(request_id.as_str()),
            ],
        )
        .await?;
    Ok(())
}

/// [`Ledger::settle`](crate::ledger::Ledger::settle).
pub(in crate::ledger) async fn settle<B: Backend>(
    b: &B,
    s: Settlement,
) -> Result<SettleResult, LedgerError> {
    retrying::<B, _, _, _>(|| settle_once(b, &s, None)).await
}

/// Settles `s` in one transaction, recorded as swept by `swept` when a sweep settles it.
async fn settle_once<B: Backend>(
    b: &B,
    s: &Settlement,
    swept: Option<SweepKind>,
) -> Result<SettleResult, LedgerError> {
    let mut tx = b.begin().await?;
    // one settlement of a request at a time; the next one waits here, then its reads see the
    // first one's record (READ COMMITTED takes a new snapshot per statement)
    if let Some(lock) = B::SETTLE_LOCK {
        tx.exec(lock, &[Arg::Text(s.request_id.as_str())]).await?;
    }
    if let Some(row) = tx
        .optional(
            "SELECT cost_micros, debit_micros, operator_credit_micros, fee_micros, hold_micros FROM requests WHERE request_id = $1",
            &[Arg::Text(s.request_id.as_str())],
        )
        .await?
    {
        tx.rollback().await.map_err(db)?;
        return Ok(SettleResult {
            cost_micros: row.u64("cost_micros")?,
            debit_micros: row.u64("debit_micros")?,
            operator_credit_micros: row.u64("operator_credit_micros")?,
            fee_micros: row.u64("fee_micros")?,
            hold_micros: row.u64("hold_micros")?,
            already_settled: true,
        });
    }
    let hold_row = tx
        .optional(
            "UPDATE holds SET state = 'settled' WHERE request_id = $1 AND state = 'held' RETURNING account_id, amount_micros, created_at_ms",
            &[Arg::Text(s.request_id.as_str())],
        )
        .await?;
    let settled_at_ms = now_ms();
    let (hold_account, hold_micros, duration_ms) = match hold_row {
        Some(row) => (
            AccountId::from(row.text("account_id")?),
            row.u64("amount_micros")?,
            // the hold is placed when the request arrives: hold to settlement is its duration
            Some(
                settled_at_ms
                    .saturating_sub(row.i64("created_at_ms")?)
                    .max(0),
            ),
        ),
        None => (s.account.clone(), 0, None),
    };
    let operator: Option<String> = match &s.node {
        Some(node) => tx
            .optional(
                "SELECT operator_id FROM nodes WHERE node_id = $1",
                &[Arg::Text(node.as_str())],
            )
            .await?
            .map(|row| row.text("operator_id"))
            .transpose()?,
        None => None,
    };
    let SettleAmounts {
        cost_micros,
        debit_micros,
        operator_credit_micros,
        fee_micros,
    } = s.amounts(hold_micros, operator.is_some());
    let debit = to_i64(debit_micros)?;
    let credit = to_i64(operator_credit_micros)?;
    let fee = to_i64(fee_micros)?;
    let held = s.earnings_held && operator.is_some() && credit > 0;
    let opt_i64 = |v: Option<u64>| v.map(to_i64).transpose();
    let reference = format!("request:{}", s.request_id);
    let escrow = s
        .node
        .as_ref()
        .map(crate::ledger::amounts::escrow_party)
        .unwrap_or_default();
    let mut entries = Vec::new();
    if debit > 0 {
        entries.push(("account", hold_account.as_str(), -debit));
        match &operator {
            Some(_) if held => entries.push(("platform", escrow.as_str(), credit)),
            Some(op) => entries.push(("operator", op.as_str(), credit)),
            None => {}
        }
        entries.push(("platform", "platform", fee));
    }
    let writes = SettlementWrites {
        record: [
            Arg::Text(s.request_id.as_str()),
            Arg::Text(hold_account.as_str()),
            Arg::Text(s.model.as_str()),
            Arg::Text(s.outcome.as_str()),
            Arg::OptText(s.node.as_ref().map(NodeId::as_str)),
            Arg::OptText(operator.as_deref()),
            Arg::I64(to_i64(s.billed.prompt_tokens)?),
            Arg::I64(to_i64(s.billed.completion_tokens)?),
            Arg::OptI64(opt_i64(s.claimed.map(|u| u.prompt_tokens))?),
            Arg::OptI64(opt_i64(s.claimed.map(|u| u.completion_tokens))?),
            Arg::Text(s.usage_source.as_str()),
            Arg::Bool(s.discrepancy),
            Arg::I64(to_i64(s.price.input_micros_per_mtok)?),
            Arg::I64(to_i64(s.price.output_micros_per_mtok)?),
            Arg::I64(i64::from(s.share_bps)),
            Arg::I64(to_i64(cost_micros)?),
            Arg::I64(debit),
            Arg::I64(credit),
            Arg::I64(fee),
            Arg::I64(to_i64(hold_micros)?),
            Arg::I64(settled_at_ms),
            Arg::OptText(swept.map(SweepKind::as_str)),
            Arg::OptText(held.then_some("held")),
            Arg::OptText(s.key.as_deref()),
            Arg::OptI64(duration_ms),
            Arg::OptI64(opt_i64(s.ttft_ms)?),
        ],
        reference: &reference,
        entries,
        // the rows every settlement of this account (and of this operator) updates come
        // last, so their locks are held from there to the commit only: under one account's
        // concurrent traffic on PostgreSQL, their lock time bounds its settlements per second
        tail: SettlementTail {
            hold_micros: to_i64(hold_micros)?,
            rollup: super::console::rollup::SettledRow {
                account: hold_account.as_str(),
                operator: operator.as_deref(),
                node: s.node.as_ref().map(NodeId::as_str),
                model: s.model.as_str(),
                key: s.key.as_deref(),
                created_at_ms: settled_at_ms,
                completed: s.outcome == StreamOutcome::Completed,
                prompt_tokens: to_i64(s.billed.prompt_tokens)?,
                completion_tokens: to_i64(s.billed.completion_tokens)?,
                debit_micros: debit,
                paid_micros: if held { 0 } else { credit },
            },
            credit_operator: operator.is_some() && !held,
        },
    };
    B::settle_writes(&mut tx, writes).await?;
    tx.commit().await.map_err(db)?;
    Ok(SettleResult {
        cost_micros,
        debit_micros,
        operator_credit_micros,
        fee_micros,
        hold_micros,
        already_settled: false,
    })
}

/// [`Store::settle_stale_holds`](crate::ledger::Store::settle_stale_holds) (`Restart`) and
/// [`Store::settle_holds_at_shutdown`](crate::ledger::Store::settle_holds_at_shutdown)
/// (`Shutdown`): the active holds this store placed (those of its instance id, when it has
/// one), settled as `upstream_failed`.
pub(in crate::ledger) async fn sweep<B: Backend>(
    b: &B,
    kind: SweepKind,
) -> Result<u64, LedgerError> {
    let rows = match b.instance_id() {
        Some(id) => {
            b.read()
                .await?
                .all(
                    &format!("SELECT {HOLD_COLUMNS} FROM holds WHERE state = 'held' AND instance_id = $1 ORDER BY created_at_ms, request_id"),
                    &[Arg::Text(id)],
                )
                .await?
        }
        // without an instance id this process cannot tell its holds from other instances':
        // at shutdown it settles nothing
        None if B::SHARED && kind == SweepKind::Shutdown => return Ok(0),
        None => {
            b.read()
                .await?
                .all(
                    &format!("SELECT {HOLD_COLUMNS} FROM holds WHERE state = 'held' ORDER BY created_at_ms, request_id"),
                    &[],
                )
                .await?
        }
    };
    settle_hold_rows(b, rows, kind).await
}

/// Settles each hold row ([`HOLD_COLUMNS`]) as `upstream_failed`, recorded as swept by `kind`
/// with the node and usage the hold noted (model `unknown` for a hold placed before holds
/// recorded it); returns how many this call settled (not those settled meanwhile by someone
/// else).
pub(in crate::ledger) async fn settle_hold_rows<B: Backend>(
    b: &B,
    rows: Vec<Row<B>>,
    kind: SweepKind,
) -> Result<u64, LedgerError> {
    let mut settled = 0;
    for row in rows {
        let prompt = row.opt_i64("prompt_tokens")?;
        let completion = row.opt_i64("completion_tokens")?;
        let settlement = Settlement {
            request_id: RequestId::from(row.text("request_id")?),
            account: AccountId::from(row.text("account_id")?),
            node: row.opt_text("node_id")?.map(NodeId::from),
            model: ModelId::from(
                row.opt_text("model")?
                    .unwrap_or_else(|| "unknown".to_owned()),
            ),
            outcome: StreamOutcome::UpstreamFailed,
            billed: Usage {
                prompt_tokens: to_u64(prompt.unwrap_or(0), "prompt_tokens")?,
                completion_tokens: to_u64(completion.unwrap_or(0), "completion_tokens")?,
            },
            claimed: None,
            usage_source: UsageSource::Independent,
            discrepancy: false,
            price: Price::default(),
            share_bps: 0,
            earnings_held: false,
            key: None,
            ttft_ms: None,
        };
        let result = retrying::<B, _, _, _>(|| settle_once(b, &settlement, Some(kind))).await?;
        if !result.already_settled {
            settled += 1;
        }
    }
    Ok(settled)
}

/// [`Ledger::request_record`](crate::ledger::Ledger::request_record).
pub(in crate::ledger) async fn request_record<B: Backend>(
    b: &B,
    request_id: RequestId,
) -> Result<Option<RequestRecord>, LedgerError> {
    let Some(row) = b
        .read()
        .await?
        .optional(
            "SELECT * FROM requests WHERE request_id = $1",
            &[Arg::Text(request_id.as_str())],
        )
        .await?
    else {
        return Ok(None);
    };
    let outcome = row.text("outcome")?;
    let source = row.text("usage_source")?;
    let claimed = claimed_usage(&row)?;
    Ok(Some(RequestRecord {
        request_id,
        account: AccountId::from(row.text("account_id")?),
        model: ModelId::from(row.text("model")?),
        outcome: StreamOutcome::parse(&outcome).ok_or(LedgerError::Corrupt("outcome"))?,
        node: row.opt_text("node_id")?.map(NodeId::from),
        operator: row.opt_text("operator_id")?.map(OperatorId::from),
        billed: Usage {
            prompt_tokens: row.u64("billed_prompt_tokens")?,
            completion_tokens: row.u64("billed_completion_tokens")?,
        },
        claimed,
        usage_source: match source.as_str() {
            "independent" => UsageSource::Independent,
            "node_claim" => UsageSource::NodeClaim,
            _ => return Err(LedgerError::Corrupt("usage_source")),
        },
        discrepancy: row.bool("discrepancy")?,
        cost_micros: row.u64("cost_micros")?,
        debit_micros: row.u64("debit_micros")?,
        operator_credit_micros: row.u64("operator_credit_micros")?,
        fee_micros: row.u64("fee_micros")?,
        hold_micros: row.u64("hold_micros")?,
        created_at_ms: row.i64("created_at_ms")?,
        swept: match row.opt_text("swept")? {
            None => None,
            Some(kind) => Some(SweepKind::parse(&kind).ok_or(LedgerError::Corrupt("swept"))?),
        },
        earnings: EarningsState::parse(row.opt_text("earnings")?.as_deref()),
    }))
}

/// [`Store::resolve_held_earnings`](crate::ledger::Store::resolve_held_earnings).
pub(in crate::ledger) async fn resolve_held_earnings<B: Backend>(
    b: &B,
    node: &NodeId,
    model: &ModelId,
    pay: bool,
) -> Result<HeldEarnings, LedgerError> {
    retrying::<B, _, _, _>(|| resolve_held_earnings_once(b, node, model, pay)).await
}

async fn resolve_held_earnings_once<B: Backend>(
    b: &B,
    node: &NodeId,
    model: &ModelId,
    pay: bool,
) -> Result<HeldEarnings, LedgerError> {
    let mut tx = b.begin().await?;
    let rows = tx
        .all(
            "UPDATE requests SET earnings = $1 WHERE node_id = $2 AND model = $3 AND earnings = 'held'
             RETURNING operator_id, operator_credit_micros, created_at_ms",
            &[
                Arg::Text(if pay { "paid" } else { "forfeited" }),
                Arg::Text(node.as_str()),
                Arg::Text(model.as_str()),
            ],
        )
        .await?;
    let mut credits = Vec::with_capacity(rows.len());
    for row in &rows {
        let (op, credit) = (
            row.opt_text("operator_id")?,
            row.i64("operator_credit_micros")?,
        );
        if let (true, Some(op)) = (pay, op.as_deref()) {
            // the console's earnings roll-up counts escrow once it is paid
            super::console::rollup::record_paid_escrow(
                &mut tx,
                op,
                node.as_str(),
                model.as_str(),
                row.i64("created_at_ms")?,
                credit,
            )
            .await?;
        }
        credits.push((op, credit));
    }
    let release = crate::ledger::amounts::escrow_release(node, model, pay, credits);
    for (op, credit) in &release.operator_credits {
        credit_operator(&mut tx, op, *credit).await?;
    }
    let entries: Vec<(&str, &str, i64)> = release
        .entries
        .iter()
        .map(|(k, id, amount)| (*k, id.as_str(), *amount))
        .collect();
    insert_entries(&mut tx, &release.reference, &entries).await?;
    tx.commit().await.map_err(db)?;
    Ok(HeldEarnings {
        requests: rows.len() as u64,
        micros: to_u64(release.total, "operator_credit_micros")?,
    })
}

/// [`Store::add_credits`](crate::ledger::Store::add_credits).
pub(in crate::ledger) async fn add_credits<B: Backend>(
    b: &B,
    account: &AccountId,
    amount_micros: u64,
    idempotency_key: &str,
) -> Result<bool, LedgerError> {
    retrying::<B, _, _, _>(|| add_credits_once(b, account, amount_micros, idempotency_key)).await
}

async fn add_credits_once<B: Backend>(
    b: &B,
    account: &AccountId,
    amount_micros: u64,
    idempotency_key: &str,
) -> Result<bool, LedgerError> {
    let amount = to_i64(amount_micros)?;
    let mut tx = b.begin().await?;
    // a concurrent credit with the same key makes this wait for it, then do nothing
    let inserted = tx
        .exec(
            "INSERT INTO credits (idempotency_key, account_id, amount_micros, created_at_ms)
             SELECT $1, id, $2, $3 FROM accounts WHERE id = $4
             ON CONFLICT (idempotency_key) DO NOTHING",
            &[
                Arg::Text(idempotency_key),
                Arg::I64(amount),
                Arg::I64(now_ms()),
                Arg::Text(account.as_str()),
            ],
        )
        .await?;
    if inserted == 0 {
        let used = tx
            .optional(
                "SELECT account_id, amount_micros FROM credits WHERE idempotency_key = $1",
                &[Arg::Text(idempotency_key)],
            )
            .await?;
        tx.rollback().await.map_err(db)?;
        let Some(row) = used else {
            return Err(LedgerError::UnknownAccount(account.clone()));
        };
        return if row.text("account_id")? == account.as_str() && row.i64("amount_micros")? == amount
        {
            Ok(false)
        } else {
            Err(LedgerError::IdempotencyConflict {
                idempotency_key: idempotency_key.to_owned(),
            })
        };
    }
    let updated = tx
        .exec(
            "UPDATE accounts SET balance_micros = balance_micros + $1 WHERE id = $2 AND balance_micros <= 9223372036854775807 - $1",
            &[Arg::I64(amount), Arg::Text(account.as_str())],
        )
        .await?;
    if updated == 0 {
        tx.rollback().await.map_err(db)?;
        return Err(LedgerError::OutOfRange);
    }
    let reference = format!("credit:{idempotency_key}");
    insert_entries(
        &mut tx,
        &reference,
        &[
            ("account", account.as_str(), amount),
            ("external", "deposits", -amount),
        ],
    )
    .await?;
    tx.commit().await.map_err(db)?;
    Ok(true)
}

/// [`Store::entries_sum_micros`](crate::ledger::Store::entries_sum_micros).
pub(in crate::ledger) async fn entries_sum_micros<B: Backend>(b: &B) -> Result<i64, LedgerError> {
    let row = b
        .read()
        .await?
        .optional(
            "SELECT CAST(COALESCE(SUM(amount_micros), 0) AS BIGINT) AS total FROM ledger_entries",
            &[],
        )
        .await?;
    row.map_or(Ok(0), |row| row.i64("total"))
}

/// [`Store::entry_totals`](crate::ledger::Store::entry_totals).
pub(in crate::ledger) async fn entry_totals<B: Backend>(b: &B) -> Result<EntryTotals, LedgerError> {
    let rows = b
        .read()
        .await?
        .all(
            "SELECT party_kind, CAST(COALESCE(SUM(amount_micros), 0) AS BIGINT) AS total FROM ledger_entries GROUP BY party_kind",
            &[],
        )
        .await?;
    let mut totals = EntryTotals::default();
    for row in rows {
        let total = row.i64("total")?;
        match row.text("party_kind")?.as_str() {
            "account" => totals.accounts_micros = total,
            "operator" => totals.operators_micros = total,
            "platform" => totals.platform_micros = total,
            "external" => totals.external_micros = total,
            _ => return Err(LedgerError::Corrupt("party_kind")),
        }
    }
    Ok(totals)
}
