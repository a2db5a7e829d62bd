//! Accounts, API keys and per-key limits, once for both stores.

use spine_core::AccountId;

use super::{insert, insert_owned, read_text, Arg, Backend, SqlConn, SqlRow};
use crate::ledger::convert::{now_ms, to_i64};
use crate::ledger::{AccountBalance, KeyLimits, LedgerError};

/// The account row a hold decides on: `SELECT balance_micros, held_micros` by id (`$1`).
pub(in crate::ledger) const ACCOUNT_BALANCE: &str =
    "SELECT balance_micros, held_micros FROM accounts WHERE id = $1";

/// An account row's money (`balance_micros`, `held_micros`).
pub(in crate::ledger) fn balance_from_row<R: SqlRow>(
    row: &R,
) -> Result<AccountBalance, LedgerError> {
    let balance_micros = row.u64("balance_micros")?;
    let held_micros = row.u64("held_micros")?;
    Ok(AccountBalance {
        balance_micros,
        held_micros,
        available_micros: balance_micros.saturating_sub(held_micros),
    })
}

/// [`Store::create_account`](crate::ledger::Store::create_account).
pub(in crate::ledger) async fn create_account<B: Backend>(
    b: &B,
    account: &AccountId,
) -> Result<(), LedgerError> {
    insert(
        b,
        "INSERT INTO accounts (id, created_at_ms) VALUES ($1, $2)",
        &[Arg::Text(account.as_str()), Arg::I64(now_ms())],
        "account",
    )
    .await?;
    Ok(())
}

/// [`Store::create_api_key`](crate::ledger::Store::create_api_key).
pub(in crate::ledger) async fn create_api_key<B: Backend>(
    b: &B,
    account: &AccountId,
    key_hash: &str,
) -> Result<(), LedgerError> {
    insert_owned(
        b,
        "INSERT INTO api_keys (key_hash, account_id, created_at_ms) SELECT $1, id, $2 FROM accounts WHERE id = $3",
        &[Arg::Text(key_hash), Arg::I64(now_ms()), Arg::Text(account.as_str())],
        "api key",
        || LedgerError::UnknownAccount(account.clone()),
    )
    .await
}

/// [`Store::account_for_key_hash`](crate::ledger::Store::account_for_key_hash).
pub(in crate::ledger) async fn account_for_key_hash<B: Backend>(
    b: &B,
    key_hash: &str,
) -> Result<Option<AccountId>, LedgerError> {
    let account = read_text(
        b,
        "SELECT account_id FROM api_keys WHERE key_hash = $1 AND revoked_at_ms IS NULL",
        &[Arg::Text(key_hash)],
        "account_id",
    )
    .await?;
    Ok(account.map(AccountId::from))
}

/// [`Store::account`](crate::ledger::Store::account).
pub(in crate::ledger) async fn account<B: Backend>(
    b: &B,
    account: &AccountId,
) -> Result<AccountBalance, LedgerError> {
    let row = b
        .read()
        .await?
        .optional(ACCOUNT_BALANCE, &[Arg::Text(account.as_str())])
        .await?
        .ok_or_else(|| LedgerError::UnknownAccount(account.clone()))?;
    balance_from_row(&row)
}

/// [`Ledger::available_micros`](crate::ledger::Ledger::available_micros): `None` for an
/// unknown account.
pub(in crate::ledger) async fn available_micros<B: Backend>(
    b: &B,
    id: &AccountId,
) -> Result<Option<u64>, LedgerError> {
    match account(b, id).await {
        Ok(balance) => Ok(Some(balance.available_micros)),
        Err(LedgerError::UnknownAccount(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// [`Store::set_key_limits`](crate::ledger::Store::set_key_limits).
pub(in crate::ledger) async fn set_key_limits<B: Backend>(
    b: &B,
    key_hash: &str,
    limits: KeyLimits,
) -> Result<(), LedgerError> {
    let tpm_limit = limits.tpm_limit.map(to_i64).transpose()?;
    b.write()
        .await?
        .exec(
            "INSERT INTO key_limits (key_hash, rpm_limit, tpm_limit, updated_at_ms) VALUES ($1, $2, $3, $4)
             ON CONFLICT (key_hash) DO UPDATE SET rpm_limit = excluded.rpm_limit, tpm_limit = excluded.tpm_limit, updated_at_ms = excluded.updated_at_ms",
            &[
                Arg::Text(key_hash),
                Arg::OptI64(limits.rpm_limit.map(i64::from)),
                Arg::OptI64(tpm_limit),
                Arg::I64(now_ms()),
            ],
        )
        .await?;
    Ok(())
}

/// [`Store::key_limits`](crate::ledger::Store::key_limits).
pub(in crate::ledger) async fn key_limits<B: Backend>(
    b: &B,
    key_hash: &str,
) -> Result<Option<KeyLimits>, LedgerError> {
    let Some(row) = b
        .read()
        .await?
        .optional(
            "SELECT rpm_limit, tpm_limit FROM key_limits WHERE key_hash = $1",
            &[Arg::Text(key_hash)],
        )
        .await?
    else {
        return Ok(None);
    };
    crate::ledger::convert::key_limits(row.opt_i64("rpm_limit")?, row.opt_i64("tpm_limit")?)
        .map(Some)
}
