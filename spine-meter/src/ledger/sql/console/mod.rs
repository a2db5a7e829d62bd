//! The console's statements ([`ConsoleStore`](crate::ledger::ConsoleStore)), once for both
//! stores. Lists are keyset-paged, newest first: `(created_at_ms, id) < cursor`, ordered by
//! `created_at_ms DESC, id DESC`, `limit + 1` rows read to know whether a next page exists;
//! the indexes of schema version 7 ([`super::schema::CONSOLE`]) serve them. Usage and
//! earnings read the daily roll-ups ([`rollup`]), whole UTC days.

mod lists;
mod platform;
pub(in crate::ledger) mod rollup;
mod store;

pub(in crate::ledger) use platform::{
    platform_days, platform_discrepancies, platform_held, platform_nodes, platform_operators,
};
pub(in crate::ledger) use store::sql_console;

use spine_core::{AccountId, ModelId, NodeId, OperatorId, StreamOutcome, Usage};

use super::{bind, insert, insert_owned, Arg, Backend, SqlConn, SqlRow, TxEnd as _};
use crate::ledger::console::{
    ApiKeyInfo, ConsoleRole, ConsoleUser, CreditEntry, EarningsDay, EnrollmentInfo, Page,
    PageCursor, RequestFilter, RequestSummary, UsageDay, MAX_SCANNED_PER_PAGE,
};
use crate::ledger::convert::{db, key_limits, now_ms};
use crate::ledger::LedgerError;
use lists::{bounded, day_rows, keyset_page, page};

const USER_COLUMNS: &str =
    "user_id, email, password_hash, account_id, operator_id, platform, created_at_ms";

fn user_from_row<R: SqlRow>(row: &R) -> Result<ConsoleUser, LedgerError> {
    let role = match (
        row.opt_text("account_id")?,
        row.opt_text("operator_id")?,
        row.bool("platform")?,
    ) {
        (Some(a), None, false) => ConsoleRole::Builder(AccountId::from(a)),
        (None, Some(o), false) => ConsoleRole::Operator(OperatorId::from(o)),
        (None, None, true) => ConsoleRole::Platform,
        _ => return Err(LedgerError::Corrupt("console user role")),
    };
    Ok(ConsoleUser {
        user_id: row.text("user_id")?,
        email: row.text("email")?,
        role,
        password_hash: row.opt_text("password_hash")?,
        created_at_ms: row.i64("created_at_ms")?,
    })
}

/// [`ConsoleStore::create_console_user`](crate::ledger::ConsoleStore::create_console_user).
pub(in crate::ledger) async fn create_console_user<B: Backend>(
    b: &B,
    user: &ConsoleUser,
) -> Result<(), LedgerError> {
    let (account, operator) = match &user.role {
        ConsoleRole::Builder(a) => (Some(a.as_str()), None),
        ConsoleRole::Operator(o) => (None, Some(o.as_str())),
        ConsoleRole::Platform => (None, None),
    };
    // the owner must exist: one statement, inserted only when it does
    let owner = match &user.role {
        ConsoleRole::Builder(_) => "SELECT 1 FROM accounts WHERE id = $4",
        ConsoleRole::Operator(_) => "SELECT 1 FROM operators WHERE id = $5",
        ConsoleRole::Platform => "SELECT 1",
    };
    let inserted = insert(
        b,
        &format!(
            "INSERT INTO console_users (user_id, email, password_hash, account_id, operator_id, created_at_ms, platform)
             SELECT $1, $2, $3, $4, $5, $6, $7 WHERE EXISTS ({owner})"
        ),
        &[
            Arg::Text(&user.user_id),
            Arg::Text(&user.email),
            Arg::OptText(user.password_hash.as_deref()),
            Arg::OptText(account),
            Arg::OptText(operator),
            Arg::I64(now_ms()),
            Arg::Bool(user.role == ConsoleRole::Platform),
        ],
        "console user",
    )
    .await?;
    match (&user.role, inserted) {
        (ConsoleRole::Builder(a), 0) => return Err(LedgerError::UnknownAccount(a.clone())),
        (ConsoleRole::Operator(o), 0) => return Err(LedgerError::UnknownOperator(o.clone())),
        _ => {}
    }
    Ok(())
}

/// [`ConsoleStore::console_user_by_email`](crate::ledger::ConsoleStore::console_user_by_email).
pub(in crate::ledger) async fn console_user_by_email<B: Backend>(
    b: &B,
    email: &str,
) -> Result<Option<ConsoleUser>, LedgerError> {
    b.read()
        .await?
        .optional(
            &format!("SELECT {USER_COLUMNS} FROM console_users WHERE email = $1"),
            &[Arg::Text(email)],
        )
        .await?
        .map(|row| user_from_row(&row))
        .transpose()
}

/// Inserts a console token row (`console_sessions` or `console_links`): its hash, its user and
/// when it expires; [`LedgerError::Duplicate`] `what` when the hash exists.
async fn insert_console_token<B: Backend>(
    b: &B,
    table: &str,
    what: &'static str,
    token_hash: &str,
    user_id: &str,
    expires_at_ms: i64,
) -> Result<(), LedgerError> {
    insert(
        b,
        &format!(
            "INSERT INTO {table} (token_hash, user_id, created_at_ms, expires_at_ms) VALUES ($1, $2, $3, $4)"
        ),
        &[
            Arg::Text(token_hash),
            Arg::Text(user_id),
            Arg::I64(now_ms()),
            Arg::I64(expires_at_ms),
        ],
        what,
    )
    .await?;
    Ok(())
}

/// [`ConsoleStore::create_console_session`](crate::ledger::ConsoleStore::create_console_session).
pub(in crate::ledger) async fn create_console_session<B: Backend>(
    b: &B,
    token_hash: &str,
    user_id: &str,
    expires_at_ms: i64,
) -> Result<(), LedgerError> {
    insert_console_token(
        b,
        "console_sessions",
        "console session",
        token_hash,
        user_id,
        expires_at_ms,
    )
    .await
}

/// [`ConsoleStore::console_session`](crate::ledger::ConsoleStore::console_session).
pub(in crate::ledger) async fn console_session<B: Backend>(
    b: &B,
    token_hash: &str,
    now: i64,
) -> Result<Option<ConsoleUser>, LedgerError> {
    b.read()
        .await?
        .optional(
            "SELECT u.user_id, u.email, u.password_hash, u.account_id, u.operator_id, u.platform, u.created_at_ms
             FROM console_sessions s JOIN console_users u ON u.user_id = s.user_id
             WHERE s.token_hash = $1 AND s.revoked_at_ms IS NULL AND s.expires_at_ms > $2",
            &[Arg::Text(token_hash), Arg::I64(now)],
        )
        .await?
        .map(|row| user_from_row(&row))
        .transpose()
}

/// [`ConsoleStore::revoke_console_session`](crate::ledger::ConsoleStore::revoke_console_session).
pub(in crate::ledger) async fn revoke_console_session<B: Backend>(
    b: &B,
    token_hash: &str,
) -> Result<(), LedgerError> {
    b.write()
        .await?
        .exec(
            "UPDATE console_sessions SET revoked_at_ms = $1 WHERE token_hash = $2 AND revoked_at_ms IS NULL",
            &[Arg::I64(now_ms()), Arg::Text(token_hash)],
        )
        .await?;
    Ok(())
}

/// [`ConsoleStore::revoke_console_sessions`](crate::ledger::ConsoleStore::revoke_console_sessions).
pub(in crate::ledger) async fn revoke_console_sessions<B: Backend>(
    b: &B,
    user_id: &str,
) -> Result<u64, LedgerError> {
    let now = now_ms();
    b.write()
        .await?
        .exec(
            "UPDATE console_sessions SET revoked_at_ms = $1
             WHERE user_id = $2 AND revoked_at_ms IS NULL AND expires_at_ms > $1",
            &[Arg::I64(now), Arg::Text(user_id)],
        )
        .await
}

/// [`ConsoleStore::create_console_link`](crate::ledger::ConsoleStore::create_console_link).
pub(in crate::ledger) async fn create_console_link<B: Backend>(
    b: &B,
    token_hash: &str,
    user_id: &str,
    expires_at_ms: i64,
) -> Result<(), LedgerError> {
    insert_console_token(
        b,
        "console_links",
        "console link",
        token_hash,
        user_id,
        expires_at_ms,
    )
    .await
}

/// [`ConsoleStore::redeem_console_link`](crate::ledger::ConsoleStore::redeem_console_link):
/// one conditional `UPDATE … RETURNING`, so two uses at once cannot both succeed.
pub(in crate::ledger) async fn redeem_console_link<B: Backend>(
    b: &B,
    token_hash: &str,
    now: i64,
) -> Result<Option<ConsoleUser>, LedgerError> {
    let mut tx = b.begin().await?;
    let used = tx
        .optional(
            "UPDATE console_links SET used_at_ms = $1
             WHERE token_hash = $2 AND used_at_ms IS NULL AND expires_at_ms > $1 RETURNING user_id",
            &[Arg::I64(now), Arg::Text(token_hash)],
        )
        .await?;
    let user = match used {
        Some(row) => {
            let user_id = row.text("user_id")?;
            tx.optional(
                &format!("SELECT {USER_COLUMNS} FROM console_users WHERE user_id = $1"),
                &[Arg::Text(&user_id)],
            )
            .await?
            .map(|row| user_from_row(&row))
            .transpose()?
        }
        None => None,
    };
    tx.commit().await.map_err(db)?;
    Ok(user)
}

/// [`ConsoleStore::create_named_api_key`](crate::ledger::ConsoleStore::create_named_api_key).
pub(in crate::ledger) async fn create_named_api_key<B: Backend>(
    b: &B,
    account: &AccountId,
    key_hash: &str,
    name: &str,
    key_hint: &str,
) -> Result<(), LedgerError> {
    insert_owned(
        b,
        "INSERT INTO api_keys (key_hash, account_id, created_at_ms, name, key_hint)
         SELECT $1, id, $2, $3, $4 FROM accounts WHERE id = $5",
        &[
            Arg::Text(key_hash),
            Arg::I64(now_ms()),
            Arg::Text(name),
            Arg::Text(key_hint),
            Arg::Text(account.as_str()),
        ],
        "api key",
        || LedgerError::UnknownAccount(account.clone()),
    )
    .await
}

/// [`ConsoleStore::account_keys`](crate::ledger::ConsoleStore::account_keys).
pub(in crate::ledger) async fn account_keys<B: Backend>(
    b: &B,
    account: &AccountId,
    after: Option<&PageCursor>,
    limit: u32,
) -> Result<Page<ApiKeyInfo>, LedgerError> {
    keyset_page(
        b,
        "SELECT k.key_hash, k.name, k.key_hint, k.created_at_ms, k.revoked_at_ms, l.rpm_limit, l.tpm_limit
         FROM api_keys k LEFT JOIN key_limits l ON l.key_hash = k.key_hash
         WHERE k.account_id = $1
           AND (k.created_at_ms, k.key_hash) < ($2, $3)
         ORDER BY k.created_at_ms DESC, k.key_hash DESC LIMIT $4",
        &[Arg::Text(account.as_str())],
        after,
        limit,
        |row| {
            Ok(ApiKeyInfo {
                key_hash: row.text("key_hash")?,
                name: row.opt_text("name")?,
                key_hint: row.opt_text("key_hint")?,
                created_at_ms: row.i64("created_at_ms")?,
                revoked_at_ms: row.opt_i64("revoked_at_ms")?,
                limits: key_limits(row.opt_i64("rpm_limit")?, row.opt_i64("tpm_limit")?)?,
            })
        },
        |k| PageCursor {
            at_ms: k.created_at_ms,
            id: k.key_hash.clone(),
        },
    )
    .await
}

/// [`ConsoleStore::revoke_api_key`](crate::ledger::ConsoleStore::revoke_api_key).
pub(in crate::ledger) async fn revoke_api_key<B: Backend>(
    b: &B,
    account: &AccountId,
    key_hash: &str,
) -> Result<bool, LedgerError> {
    let changed = b
        .write()
        .await?
        .exec(
            "UPDATE api_keys SET revoked_at_ms = $1
             WHERE key_hash = $2 AND account_id = $3 AND revoked_at_ms IS NULL",
            &[
                Arg::I64(now_ms()),
                Arg::Text(key_hash),
                Arg::Text(account.as_str()),
            ],
        )
        .await?;
    Ok(changed == 1)
}

/// The request log's range for `filter` below `after`: the upper bound, the lower of the
/// window's end and the cursor (`created_at_ms < until` is `(created_at_ms, request_id) <
/// (until, '')`: no id is below ''), and the window's start as a lower bound `(since, '')`.
/// SQLite's planner, without statistics, ranges an index on a row value or on a column's
/// bounds, not both, and would rather take `requests_account_time` for both: so both bounds
/// are row values.
fn request_range<'a>(
    filter: &RequestFilter,
    after: Option<&'a PageCursor>,
) -> ((i64, &'a str), (i64, &'a str)) {
    let until = filter.until_ms.unwrap_or(i64::MAX);
    let upper = match after {
        Some(c) if c.at_ms < until => (c.at_ms, c.id.as_str()),
        _ => (until, ""),
    };
    (upper, (filter.since_ms.unwrap_or(i64::MIN), ""))
}

/// `WHERE account_id = $1 [AND model = $2]`, the index's equality prefix, and its arguments.
fn request_prefix<'a>(account: &'a AccountId, filter: &'a RequestFilter) -> (String, Vec<Arg<'a>>) {
    let mut sql = String::from(" WHERE account_id = $1");
    let mut args = vec![Arg::Text(account.as_str())];
    if let Some(model) = &filter.model {
        args.push(Arg::Text(model));
        sql.push_str(" AND model = $2");
    }
    (sql, args)
}

/// The statement that finds where a filtered request-log page stops searching: the
/// `max_scanned`-th record below `after` in the window (of the model's, with a model filter),
/// newest first, read from the index alone (`requests_account_time` or
/// `requests_account_model_time` holds both columns); no row when fewer are left.
pub(in crate::ledger) fn request_scan_end_statement<'a>(
    account: &'a AccountId,
    filter: &'a RequestFilter,
    after: Option<&'a PageCursor>,
    max_scanned: i64,
) -> (String, Vec<Arg<'a>>) {
    let (mut sql, mut args) = request_prefix(account, filter);
    sql.insert_str(0, "SELECT created_at_ms, request_id FROM requests");
    let ((at, id), (since, _)) = request_range(filter, after);
    let [since, at, id, offset] = bind(
        &mut args,
        [
            Arg::I64(since),
            Arg::I64(at),
            Arg::Text(id),
            Arg::I64(max_scanned.max(1) - 1),
        ],
    );
    sql.push_str(&format!(
        " AND (created_at_ms, request_id) >= ({since}, '') AND (created_at_ms, request_id) < ({at}, {id})
         ORDER BY created_at_ms DESC, request_id DESC LIMIT 1 OFFSET {offset}"
    ));
    (sql, args)
}

/// The request log's statement and its arguments for `filter`, the page after `after`, down
/// to and including `scan_end` (the last record a filtered page searches, from
/// [`request_scan_end_statement`]; `None`: the window's start), and `limit + 1` rows. Only the
/// filters given are in the text, each an equality (never `$n IS NULL OR …`, which neither
/// SQLite's planner nor a PostgreSQL generic plan can turn into an index range): with a model,
/// a range of `requests_account_model_time` `(account_id, model, created_at_ms, request_id)`
/// (schema version 8), otherwise of `requests_account_time` `(account_id, created_at_ms,
/// request_id)`, in index order either way (no sort; SQLite picks the model index without
/// `ANALYZE` statistics too). A key or outcome filter is checked on the rows that range reads,
/// at most the records down to `scan_end`.
pub(in crate::ledger) fn account_requests_statement<'a>(
    account: &'a AccountId,
    filter: &'a RequestFilter,
    after: Option<&'a PageCursor>,
    scan_end: Option<&'a PageCursor>,
    limit: i64,
) -> (String, Vec<Arg<'a>>) {
    let (prefix, mut args) = request_prefix(account, filter);
    let mut sql = format!(
        "SELECT request_id, created_at_ms, key_hash, model, outcome, node_id,
                billed_prompt_tokens, billed_completion_tokens,
                claimed_prompt_tokens, claimed_completion_tokens,
                discrepancy, duration_ms, ttft_ms, debit_micros
         FROM requests{prefix}"
    );
    for (column, value) in [("key_hash", &filter.key_hash), ("outcome", &filter.outcome)] {
        if let Some(value) = value {
            let [value] = bind(&mut args, [Arg::Text(value)]);
            sql.push_str(&format!(" AND {column} = {value}"));
        }
    }
    let ((at, id), since) = request_range(filter, after);
    // the scan's end is at or above the window's start: it was found inside the window
    let (low_at, low_id) = scan_end.map_or(since, |c| (c.at_ms, c.id.as_str()));
    let [low_at, low_id, at, id, rows] = bind(
        &mut args,
        [
            Arg::I64(low_at),
            Arg::Text(low_id),
            Arg::I64(at),
            Arg::Text(id),
            Arg::I64(limit + 1),
        ],
    );
    sql.push_str(&format!(
        " AND (created_at_ms, request_id) >= ({low_at}, {low_id}) AND (created_at_ms, request_id) < ({at}, {id})
         ORDER BY created_at_ms DESC, request_id DESC LIMIT {rows}"
    ));
    (sql, args)
}

/// [`ConsoleStore::account_requests`](crate::ledger::ConsoleStore::account_requests), searching
/// at most [`MAX_SCANNED_PER_PAGE`] records a page.
pub(in crate::ledger) async fn account_requests<B: Backend>(
    b: &B,
    account: &AccountId,
    filter: &RequestFilter,
    after: Option<&PageCursor>,
    limit: u32,
) -> Result<Page<RequestSummary>, LedgerError> {
    account_requests_scanning(
        b,
        account,
        filter,
        after,
        limit,
        i64::from(MAX_SCANNED_PER_PAGE),
    )
    .await
}

/// A request-log page that searches at most `max_scanned` records when it filters by key or
/// outcome: first the last record it may search ([`request_scan_end_statement`], from the
/// index alone), then the page's rows down to it ([`account_requests_statement`]). Both are
/// bounded by keys, not counts, so a record settled between the two statements is either in
/// the searched range or not, and the next page (below the last record searched, when the
/// page is not full) neither skips nor repeats one. Without a key or outcome filter every
/// record read is a row: one statement, `limit + 1` rows.
pub(in crate::ledger) async fn account_requests_scanning<B: Backend>(
    b: &B,
    account: &AccountId,
    filter: &RequestFilter,
    after: Option<&PageCursor>,
    limit: u32,
    max_scanned: i64,
) -> Result<Page<RequestSummary>, LedgerError> {
    let limit = bounded(limit);
    let sparse = filter.key_hash.is_some() || filter.outcome.is_some();
    let mut conn = b.read().await?;
    let scan_end = if sparse {
        let (sql, args) = request_scan_end_statement(account, filter, after, max_scanned);
        match conn.optional(&sql, &args).await? {
            Some(row) => Some(PageCursor {
                at_ms: row.i64("created_at_ms")?,
                id: row.text("request_id")?,
            }),
            None => None,
        }
    } else {
        None
    };
    let (sql, args) = account_requests_statement(account, filter, after, scan_end.as_ref(), limit);
    let rows = conn.all(&sql, &args).await?;
    let mut page = page(
        &rows,
        limit,
        |row| {
            let claimed = super::money::claimed_usage(row)?;
            Ok(RequestSummary {
                request_id: row.text("request_id")?,
                created_at_ms: row.i64("created_at_ms")?,
                key_hash: row.opt_text("key_hash")?,
                model: ModelId::from(row.text("model")?),
                outcome: StreamOutcome::parse(&row.text("outcome")?)
                    .ok_or(LedgerError::Corrupt("outcome"))?,
                billed: Usage {
                    prompt_tokens: row.u64("billed_prompt_tokens")?,
                    completion_tokens: row.u64("billed_completion_tokens")?,
                },
                claimed,
                discrepancy: row.bool("discrepancy")?,
                duration_ms: row.opt_i64("duration_ms")?,
                ttft_ms: row.opt_i64("ttft_ms")?,
                debit_micros: row.u64("debit_micros")?,
                node: row.opt_text("node_id")?.map(NodeId::from),
            })
        },
        |r| PageCursor {
            at_ms: r.created_at_ms,
            id: r.request_id.clone(),
        },
    )?;
    if page.next.is_none() {
        // fewer matches than a page down to the scan's end: search on below it
        page.next = scan_end;
    }
    Ok(page)
}

/// [`ConsoleStore::account_usage`](crate::ledger::ConsoleStore::account_usage).
pub(in crate::ledger) async fn account_usage<B: Backend>(
    b: &B,
    account: &AccountId,
    since_ms: i64,
    until_ms: i64,
    limit: u32,
) -> Result<Vec<UsageDay>, LedgerError> {
    day_rows(
        b,
        "SELECT day, model, key_hash, requests, prompt_tokens, completion_tokens, debit_micros AS debit
         FROM usage_daily
         WHERE account_id = $1 AND day >= $2 AND day < $3
         ORDER BY day DESC, model, key_hash LIMIT $4",
        &[Arg::Text(account.as_str())],
        since_ms,
        until_ms,
        limit,
        |row| {
            Ok(UsageDay {
                day: row.i64("day")?,
                model: ModelId::from(row.text("model")?),
                key_hash: Some(row.text("key_hash")?).filter(|k| !k.is_empty()),
                requests: row.u64("requests")?,
                prompt_tokens: row.u64("prompt_tokens")?,
                completion_tokens: row.u64("completion_tokens")?,
                debit_micros: row.u64("debit")?,
            })
        },
    )
    .await
}

/// [`ConsoleStore::account_credits`](crate::ledger::ConsoleStore::account_credits).
pub(in crate::ledger) async fn account_credits<B: Backend>(
    b: &B,
    account: &AccountId,
    after: Option<&PageCursor>,
    limit: u32,
) -> Result<Page<CreditEntry>, LedgerError> {
    keyset_page(
        b,
        "SELECT idempotency_key, amount_micros, created_at_ms FROM credits
         WHERE account_id = $1
           AND (created_at_ms, idempotency_key) < ($2, $3)
         ORDER BY created_at_ms DESC, idempotency_key DESC LIMIT $4",
        &[Arg::Text(account.as_str())],
        after,
        limit,
        |row| {
            Ok(CreditEntry {
                idempotency_key: row.text("idempotency_key")?,
                amount_micros: row.u64("amount_micros")?,
                created_at_ms: row.i64("created_at_ms")?,
            })
        },
        |c| PageCursor {
            at_ms: c.created_at_ms,
            id: c.idempotency_key.clone(),
        },
    )
    .await
}

/// [`ConsoleStore::operator_earnings`](crate::ledger::ConsoleStore::operator_earnings): the
/// credits paid (as [`Store::operator_nodes`](crate::ledger::Store::operator_nodes) counts them),
/// the roll-up's rows summed over the operator's nodes.
pub(in crate::ledger) async fn operator_earnings<B: Backend>(
    b: &B,
    operator: &OperatorId,
    since_ms: i64,
    until_ms: i64,
    limit: u32,
) -> Result<Vec<EarningsDay>, LedgerError> {
    day_rows(
        b,
        "SELECT day, model, CAST(SUM(requests_served) AS BIGINT) AS served,
                CAST(SUM(completion_tokens) AS BIGINT) AS completion_tokens,
                CAST(SUM(earned_micros) AS BIGINT) AS earned
         FROM earnings_daily
         WHERE operator_id = $1 AND day >= $2 AND day < $3
         GROUP BY day, model
         ORDER BY day DESC, model LIMIT $4",
        &[Arg::Text(operator.as_str())],
        since_ms,
        until_ms,
        limit,
        |row| {
            Ok(EarningsDay {
                day: row.i64("day")?,
                model: ModelId::from(row.text("model")?),
                requests_served: row.u64("served")?,
                completion_tokens: row.u64("completion_tokens")?,
                earned_micros: row.u64("earned")?,
            })
        },
    )
    .await
}

/// [`ConsoleStore::operator_enrollments`](crate::ledger::ConsoleStore::operator_enrollments).
pub(in crate::ledger) async fn operator_enrollments<B: Backend>(
    b: &B,
    operator: &OperatorId,
    after: Option<&PageCursor>,
    limit: u32,
) -> Result<Page<EnrollmentInfo>, LedgerError> {
    keyset_page(
        b,
        "SELECT token_hash, created_at_ms, expires_at_ms, node_id, revoked_at_ms FROM enrollments
         WHERE operator_id = $1
           AND (created_at_ms, token_hash) < ($2, $3)
         ORDER BY created_at_ms DESC, token_hash DESC LIMIT $4",
        &[Arg::Text(operator.as_str())],
        after,
        limit,
        |row| {
            Ok(EnrollmentInfo {
                token_hash: row.text("token_hash")?,
                created_at_ms: row.i64("created_at_ms")?,
                expires_at_ms: row.i64("expires_at_ms")?,
                node: row.opt_text("node_id")?.map(NodeId::from),
                revoked_at_ms: row.opt_i64("revoked_at_ms")?,
            })
        },
        |e| PageCursor {
            at_ms: e.created_at_ms,
            id: e.token_hash.clone(),
        },
    )
    .await
}

/// [`ConsoleStore::revoke_enrollment`](crate::ledger::ConsoleStore::revoke_enrollment): the
/// token expires now, so redeeming it fails as an expired one.
pub(in crate::ledger) async fn revoke_enrollment<B: Backend>(
    b: &B,
    operator: &OperatorId,
    token_hash: &str,
) -> Result<bool, LedgerError> {
    let changed = b
        .write()
        .await?
        .exec(
            "UPDATE enrollments SET revoked_at_ms = $1, expires_at_ms = $1
             WHERE token_hash = $2 AND operator_id = $3 AND node_id IS NULL AND revoked_at_ms IS NULL",
            &[
                Arg::I64(now_ms()),
                Arg::Text(token_hash),
                Arg::Text(operator.as_str()),
            ],
        )
        .await?;
    Ok(changed == 1)
}
