//! The console's two kinds of list, each read with one statement: a keyset page of records,
//! newest first ([`keyset_page`], the module docs of [`super`]), and the rows of a daily
//! roll-up for a window of whole UTC days ([`day_rows`]).

use super::super::{Arg, Backend, Row, SqlConn};
use super::rollup;
use crate::ledger::console::{Page, PageCursor, MAX_PAGE_ROWS};
use crate::ledger::LedgerError;

/// The first UTC day that starts at or after `ms` (days since the epoch): the roll-ups count
/// whole days, so a window `[since_ms, until_ms)` covers the days that start inside it.
pub(super) fn first_day(ms: i64) -> i64 {
    let day = ms.div_euclid(rollup::MS_PER_DAY);
    if ms.rem_euclid(rollup::MS_PER_DAY) == 0 {
        day
    } else {
        day.saturating_add(1)
    }
}

/// `limit` within `1..=MAX_PAGE_ROWS`, as the `i64` a `LIMIT` binds (one more row is read).
pub(super) fn bounded(limit: u32) -> i64 {
    i64::from(limit.clamp(1, MAX_PAGE_ROWS))
}

/// `rows` mapped by `from_row`, the first `limit` of them as a page; the next page's cursor
/// (`cursor` of the last row kept) when there were more.
///
/// # Errors
///
/// `from_row`'s error for the first row it refuses ([`LedgerError::Corrupt`], …).
pub(super) fn page<R, T>(
    rows: &[R],
    limit: i64,
    from_row: impl Fn(&R) -> Result<T, LedgerError>,
    cursor: impl Fn(&T) -> PageCursor,
) -> Result<Page<T>, LedgerError> {
    let mut rows = rows.iter().map(from_row).collect::<Result<Vec<T>, _>>()?;
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    let next = if rows.len() > limit {
        rows.truncate(limit);
        rows.last().map(cursor)
    } else {
        None
    };
    Ok(Page { rows, next })
}

/// The cursor's `(at_ms, id)` as arguments; the first page's is `(i64::MAX, "")`, above every
/// row. Always bound, so the statements compare `(created_at_ms, id) < (…)` with no `OR`: a
/// range of the `(owner, created_at_ms, id)` index, whatever page is asked for.
fn cursor_args(after: Option<&PageCursor>) -> (Arg<'_>, Arg<'_>) {
    match after {
        Some(c) => (Arg::I64(c.at_ms), Arg::Text(c.id.as_str())),
        None => (Arg::I64(i64::MAX), Arg::Text("")),
    }
}

/// One keyset-paged list, newest first (the module docs): runs `sql` on a read connection with
/// `prefix`'s arguments as `$1`…`$n` (the owner's id, where the list has an owner), then the
/// cursor's `(at_ms, id)` as `$n+1`, `$n+2` ([`cursor_args`]) and `limit + 1` as `$n+3`
/// (`limit` within `1..=MAX_PAGE_ROWS`, [`bounded`]); the rows mapped by `from_row` as a
/// [`page`] whose next cursor is `cursor` of its last row.
///
/// # Errors
///
/// [`LedgerError::Database`]; `from_row`'s error for the first row it refuses.
pub(super) async fn keyset_page<B: Backend, T>(
    b: &B,
    sql: &str,
    prefix: &[Arg<'_>],
    after: Option<&PageCursor>,
    limit: u32,
    from_row: impl Fn(&Row<B>) -> Result<T, LedgerError>,
    cursor: impl Fn(&T) -> PageCursor,
) -> Result<Page<T>, LedgerError> {
    let limit = bounded(limit);
    let (at, id) = cursor_args(after);
    let mut args = prefix.to_vec();
    args.extend([at, id, Arg::I64(limit + 1)]);
    let rows = b.read().await?.all(sql, &args).await?;
    page(&rows, limit, from_row, cursor)
}

/// The roll-up rows of the UTC days that start in `[since_ms, until_ms)`: runs `sql` on a read
/// connection with `prefix`'s arguments as `$1`…`$n` (the owner's id, where it has one), then
/// the window's first day as `$n+1`, the first day after it as `$n+2` (days since the epoch,
/// [`first_day`]) and `limit` within `1..=MAX_PAGE_ROWS` ([`bounded`]) as `$n+3`; each row
/// mapped by `from_row`.
///
/// # Errors
///
/// [`LedgerError::Database`]; `from_row`'s error for the first row it refuses.
pub(super) async fn day_rows<B: Backend, T>(
    b: &B,
    sql: &str,
    prefix: &[Arg<'_>],
    since_ms: i64,
    until_ms: i64,
    limit: u32,
    from_row: impl Fn(&Row<B>) -> Result<T, LedgerError>,
) -> Result<Vec<T>, LedgerError> {
    let mut args = prefix.to_vec();
    args.extend([
        Arg::I64(first_day(since_ms)),
        Arg::I64(first_day(until_ms)),
        Arg::I64(bounded(limit)),
    ]);
    let rows = b.read().await?.all(sql, &args).await?;
    rows.iter().map(from_row).collect()
}
