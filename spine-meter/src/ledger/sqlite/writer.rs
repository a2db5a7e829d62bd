//! The file store's writer connection: every write runs its statements on it **in the calling
//! task**, with `rusqlite` on the same SQLite library as sqlx's driver, instead of one hand-off
//! per statement to sqlx's connection thread.
//!
//! Why: a hold is five statements (`BEGIN IMMEDIATE` twice counted by sqlx, the conditional
//! `UPDATE`, the `INSERT`, `COMMIT`) and a settlement ten or more; on sqlx's driver each is a
//! message to the connection's worker thread and a wake-up back (two thread switches), which
//! was the largest item in the gateway's profile (`docs/benchmarks.md`, issue 17). Here a write
//! waits once, asynchronously, for the connection ([`tokio::sync::Mutex`], a FIFO queue like
//! the one-connection pool it replaces), then runs each statement directly: microseconds each,
//! prepared once per connection (statement cache).
//!
//! What stays the same: the statements (the shared SQL of [`super::super::sql`]),
//! `BEGIN IMMEDIATE` transactions, `journal_mode = WAL`, `synchronous = NORMAL`, foreign keys,
//! the 5 s busy timeout for another process on the same file, and the errors callers see
//! (a SQLite failure is a [`sqlx::Error::Database`] with SQLite's extended result code, so a
//! unique violation is still [`LedgerError::Duplicate`](crate::ledger::LedgerError::Duplicate)
//! and a busy file still code 5).
//!
//! The one cost: a statement that waits in SQLite's busy handler (only when *another process*
//! writes the same file) waits on the runtime thread that runs the write, for at most the busy
//! timeout. Writers in this process never wait there: they queue for the connection first.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rusqlite::types::Value;
use rusqlite::{Connection, OpenFlags};
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::ledger::sql::{Arg, SqlConn, SqlRow, TxEnd};
use crate::ledger::{LedgerError, LedgerFuture};

/// Prepared statements kept per writer connection (the request path uses about twenty).
const STATEMENT_CACHE: usize = 128;

/// The writer connection; `None` once the store is closed.
#[derive(Clone, Debug)]
pub(super) struct Writer(Arc<Mutex<Option<Connection>>>);

impl Writer {
    /// Opens the writer connection on the (existing, migrated, WAL) database file at `path`.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`] when SQLite cannot open or configure it.
    pub(super) fn open(
        path: &Path,
        busy_timeout: Duration,
        autocheckpoint_pages: u32,
    ) -> Result<Self, LedgerError> {
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(to_ledger)?;
        conn.busy_timeout(busy_timeout).map_err(to_ledger)?;
        conn.execute_batch(&format!(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON;
             PRAGMA wal_autocheckpoint = {autocheckpoint_pages};"
        ))
        .map_err(to_ledger)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        Ok(Self(Arc::new(Mutex::new(Some(conn)))))
    }

    /// Waits for the connection (first come, first served).
    ///
    /// # Errors
    ///
    /// [`sqlx::Error::PoolClosed`] (as [`LedgerError::Database`]) once the store is closed.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped wait leaves the queue.
    pub(super) async fn acquire(&self) -> Result<WriterConn, LedgerError> {
        let guard = Arc::clone(&self.0).lock_owned().await;
        if guard.is_none() {
            return Err(LedgerError::Database(sqlx::Error::PoolClosed));
        }
        Ok(WriterConn(guard))
    }

    /// A write transaction: `BEGIN IMMEDIATE` on the connection.
    ///
    /// # Errors
    ///
    /// As [`Writer::acquire`]; [`LedgerError::Database`] when `BEGIN` fails.
    pub(super) async fn begin(&self) -> Result<WriterTx, LedgerError> {
        let mut conn = self.acquire().await?;
        conn.run(&mut |c| c.prepare_cached("BEGIN IMMEDIATE")?.raw_execute().map(drop))
            .map_err(to_ledger)?;
        Ok(WriterTx { conn: Some(conn) })
    }

    /// Closes the connection once the writes in flight are done; later writes fail
    /// [`sqlx::Error::PoolClosed`].
    pub(super) async fn close(&self) {
        let conn = self.0.lock().await.take();
        if let Some(conn) = conn {
            if let Err((_, e)) = conn.close() {
                tracing::warn!(error = %e, "closing the ledger's writer connection failed");
            }
        }
    }
}

/// The writer connection, held: statements run on it synchronously.
#[derive(Debug)]
pub(in crate::ledger) struct WriterConn(OwnedMutexGuard<Option<Connection>>);

impl WriterConn {
    /// Runs `f` on the connection (present: [`Writer::acquire`] checked it).
    fn run<T>(
        &mut self,
        f: &mut dyn FnMut(&Connection) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<T> {
        match self.0.as_ref() {
            Some(conn) => f(conn),
            None => Err(rusqlite::Error::InvalidQuery),
        }
    }

    /// Runs `sql` with `args`: its rows (up to `limit`) and how many rows it changed.
    fn query(
        &mut self,
        sql: &str,
        args: &[Arg<'_>],
        limit: usize,
    ) -> Result<(Vec<WriterRow>, u64), LedgerError> {
        self.run(&mut |c| {
            let mut stmt = c.prepare_cached(sql)?;
            bind(&mut stmt, args)?;
            // the names only for a statement whose rows are kept (not for `exec`, the hot path)
            let names: Option<Arc<[String]>> =
                (limit > 0).then(|| stmt.column_names().into_iter().map(String::from).collect());
            let readonly = stmt.readonly();
            let mut out = Vec::new();
            let mut rows = stmt.raw_query();
            // every row is stepped, also past `limit`: a statement runs to its end
            while let Some(row) = rows.next()? {
                let Some(names) = names.as_ref().filter(|_| out.len() < limit) else {
                    continue;
                };
                let values = (0..names.len())
                    .map(|i| row.get_ref(i).map(Value::from))
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                out.push(WriterRow {
                    names: Arc::clone(names),
                    values,
                });
            }
            drop(rows);
            let changed = if readonly { 0 } else { c.changes() };
            Ok((out, changed))
        })
        .map_err(to_ledger)
    }
}

/// Binds `args` to `stmt`'s `$n` placeholders (`$1` is `args[0]`); every placeholder must be
/// one of them.
fn bind(stmt: &mut rusqlite::Statement<'_>, args: &[Arg<'_>]) -> rusqlite::Result<()> {
    for index in 1..=stmt.parameter_count() {
        let n = stmt
            .parameter_name(index)
            .and_then(|name| name.strip_prefix('$'))
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|n| (1..=args.len()).contains(n))
            .ok_or(rusqlite::Error::InvalidParameterCount(
                stmt.parameter_count(),
                args.len(),
            ))?;
        match args[n - 1] {
            Arg::I64(v) => stmt.raw_bind_parameter(index, v)?,
            Arg::OptI64(v) => stmt.raw_bind_parameter(index, v)?,
            Arg::Text(v) => stmt.raw_bind_parameter(index, v)?,
            Arg::OptText(v) => stmt.raw_bind_parameter(index, v)?,
            Arg::Bool(v) => stmt.raw_bind_parameter(index, i64::from(v))?,
        }
    }
    Ok(())
}

impl SqlConn for WriterConn {
    type Row = WriterRow;

    fn exec<'a>(&'a mut self, sql: &'a str, args: &'a [Arg<'a>]) -> LedgerFuture<'a, u64> {
        let r = self.query(sql, args, 0).map(|(_, changed)| changed);
        Box::pin(std::future::ready(r))
    }

    fn optional<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> LedgerFuture<'a, Option<WriterRow>> {
        let r = self
            .query(sql, args, 1)
            .map(|(rows, _)| rows.into_iter().next());
        Box::pin(std::future::ready(r))
    }

    fn all<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> LedgerFuture<'a, Vec<WriterRow>> {
        let r = self.query(sql, args, usize::MAX).map(|(rows, _)| rows);
        Box::pin(std::future::ready(r))
    }

    fn batch<'a>(&'a mut self, sql: &'a str) -> LedgerFuture<'a, ()> {
        let r = self.run(&mut |c| c.execute_batch(sql)).map_err(to_ledger);
        Box::pin(std::future::ready(r))
    }
}

/// A write transaction on the writer connection; rolled back when dropped unfinished.
#[derive(Debug)]
pub(in crate::ledger) struct WriterTx {
    /// `None` once committed or rolled back.
    conn: Option<WriterConn>,
}

impl WriterTx {
    /// The connection, while the transaction is open.
    fn conn(&mut self) -> Result<&mut WriterConn, LedgerError> {
        self.conn
            .as_mut()
            .ok_or(LedgerError::Database(sqlx::Error::PoolClosed))
    }

    /// Ends the transaction with `sql` (`COMMIT` or `ROLLBACK`). If it fails and SQLite left
    /// the transaction open, it is rolled back (on drop).
    fn end(mut self, sql: &str) -> Result<(), sqlx::Error> {
        let Some(mut conn) = self.conn.take() else {
            return Ok(());
        };
        let r = conn.run(&mut |c| c.prepare_cached(sql)?.raw_execute().map(drop));
        if r.is_err() {
            self.conn = Some(conn);
        }
        r.map_err(to_sqlx)
    }
}

impl Drop for WriterTx {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.conn {
            let r = conn.run(&mut |c| {
                if c.is_autocommit() {
                    Ok(())
                } else {
                    c.execute_batch("ROLLBACK")
                }
            });
            if let Err(e) = r {
                tracing::warn!(error = %e, "rolling back a ledger write failed");
            }
        }
    }
}

impl TxEnd for WriterTx {
    fn commit(self) -> impl std::future::Future<Output = Result<(), sqlx::Error>> + Send {
        std::future::ready(self.end("COMMIT"))
    }

    fn rollback(self) -> impl std::future::Future<Output = Result<(), sqlx::Error>> + Send {
        std::future::ready(self.end("ROLLBACK"))
    }
}

impl SqlConn for WriterTx {
    type Row = WriterRow;

    fn exec<'a>(&'a mut self, sql: &'a str, args: &'a [Arg<'a>]) -> LedgerFuture<'a, u64> {
        match self.conn() {
            Ok(c) => c.exec(sql, args),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }

    fn optional<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> LedgerFuture<'a, Option<WriterRow>> {
        match self.conn() {
            Ok(c) => c.optional(sql, args),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }

    fn all<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> LedgerFuture<'a, Vec<WriterRow>> {
        match self.conn() {
            Ok(c) => c.all(sql, args),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }

    fn batch<'a>(&'a mut self, sql: &'a str) -> LedgerFuture<'a, ()> {
        match self.conn() {
            Ok(c) => c.batch(sql),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }
}

/// A row read on the writer connection: its columns by name.
#[derive(Debug)]
pub(in crate::ledger) struct WriterRow {
    /// The statement's column names (shared by its rows).
    names: Arc<[String]>,
    /// The values, in column order.
    values: Vec<Value>,
}

impl WriterRow {
    /// The value of column `col`.
    fn get(&self, col: &str) -> Result<&Value, LedgerError> {
        self.names
            .iter()
            .position(|n| n == col)
            .and_then(|i| self.values.get(i))
            .ok_or_else(|| LedgerError::Database(sqlx::Error::ColumnNotFound(col.to_owned())))
    }
}

/// A column that does not decode as asked (as sqlx's `ColumnDecode`).
fn decode_error(col: &str, want: &str, got: &Value) -> LedgerError {
    LedgerError::Database(sqlx::Error::ColumnDecode {
        index: col.to_owned(),
        source: format!("expected {want}, found {}", got.data_type()).into(),
    })
}

impl SqlRow for WriterRow {
    fn i64(&self, col: &str) -> Result<i64, LedgerError> {
        match self.get(col)? {
            Value::Integer(v) => Ok(*v),
            other => Err(decode_error(col, "INTEGER", other)),
        }
    }

    fn opt_i64(&self, col: &str) -> Result<Option<i64>, LedgerError> {
        match self.get(col)? {
            Value::Null => Ok(None),
            Value::Integer(v) => Ok(Some(*v)),
            other => Err(decode_error(col, "INTEGER or NULL", other)),
        }
    }

    fn text(&self, col: &str) -> Result<String, LedgerError> {
        match self.get(col)? {
            Value::Text(v) => Ok(v.clone()),
            other => Err(decode_error(col, "TEXT", other)),
        }
    }

    fn opt_text(&self, col: &str) -> Result<Option<String>, LedgerError> {
        match self.get(col)? {
            Value::Null => Ok(None),
            Value::Text(v) => Ok(Some(v.clone())),
            other => Err(decode_error(col, "TEXT or NULL", other)),
        }
    }

    fn bool(&self, col: &str) -> Result<bool, LedgerError> {
        match self.get(col)? {
            Value::Integer(v) => Ok(*v != 0),
            other => Err(decode_error(col, "INTEGER (boolean)", other)),
        }
    }
}

/// A SQLite failure, as sqlx's driver reports one: the message and SQLite's extended result
/// code (as text, e.g. `"2067"` for a unique violation).
#[derive(Debug)]
struct WriterDbError {
    /// SQLite's extended result code.
    extended_code: i32,
    /// SQLite's message.
    message: String,
}

impl std::fmt::Display for WriterDbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "(code: {}) {}", self.extended_code, self.message)
    }
}

impl std::error::Error for WriterDbError {}

impl sqlx::error::DatabaseError for WriterDbError {
    fn message(&self) -> &str {
        &self.message
    }

    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        Some(self.extended_code.to_string().into())
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        use rusqlite::ffi;
        match self.extended_code {
            ffi::SQLITE_CONSTRAINT_UNIQUE | ffi::SQLITE_CONSTRAINT_PRIMARYKEY => {
                sqlx::error::ErrorKind::UniqueViolation
            }
            ffi::SQLITE_CONSTRAINT_FOREIGNKEY => sqlx::error::ErrorKind::ForeignKeyViolation,
            ffi::SQLITE_CONSTRAINT_NOTNULL => sqlx::error::ErrorKind::NotNullViolation,
            ffi::SQLITE_CONSTRAINT_CHECK => sqlx::error::ErrorKind::CheckViolation,
            _ => sqlx::error::ErrorKind::Other,
        }
    }
}

/// `e` as sqlx's driver would report it.
fn to_sqlx(e: rusqlite::Error) -> sqlx::Error {
    match e {
        rusqlite::Error::SqliteFailure(code, message) => {
            sqlx::Error::Database(Box::new(WriterDbError {
                extended_code: code.extended_code,
                message: message.unwrap_or_else(|| code.to_string()),
            }))
        }
        other => sqlx::Error::Protocol(format!("SQLite writer connection: {other}")),
    }
}

/// `e` as a [`LedgerError::Database`].
fn to_ledger(e: rusqlite::Error) -> LedgerError {
    LedgerError::Database(to_sqlx(e))
}
