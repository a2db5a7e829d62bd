//! Conversions shared by the SQL stores: database errors, integer columns, timestamps.

use super::LedgerError;

pub(super) fn db(e: sqlx::Error) -> LedgerError {
    LedgerError::Database(e)
}

/// Wall-clock time in Unix milliseconds, as stored in the ledger's `*_at_ms` columns.
pub(super) use spine_core::unix_time_ms as now_ms;

/// A `u64` amount or count as the `BIGINT` both stores keep; above `i64::MAX` is out of range.
pub(super) fn to_i64(v: u64) -> Result<i64, LedgerError> {
    i64::try_from(v).map_err(|_| LedgerError::OutOfRange)
}

/// A stored `BIGINT` back to `u64`; a negative value means the row is corrupt (`what` names it).
pub(super) fn to_u64(v: i64, what: &'static str) -> Result<u64, LedgerError> {
    u64::try_from(v).map_err(|_| LedgerError::Corrupt(what))
}

/// A `key_limits` row's `rpm_limit` / `tpm_limit` columns (`NULL` = the gateway default).
pub(super) fn key_limits(
    rpm: Option<i64>,
    tpm: Option<i64>,
) -> Result<super::KeyLimits, LedgerError> {
    Ok(super::KeyLimits {
        rpm_limit: rpm
            .map(|v| u32::try_from(v).map_err(|_| LedgerError::Corrupt("rpm_limit")))
            .transpose()?,
        tpm_limit: tpm.map(|v| to_u64(v, "tpm_limit")).transpose()?,
    })
}
