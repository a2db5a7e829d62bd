//! The file store's writer connection: every write runs its statements on it **in the calling
//! task**, with `rusqlite` on the same SQLite library as sqlx's driver, instead of one hand-off
//! per statement to sqlx's connection thread; and the writes of one scheduler tick are
//! **committed together** (group commit).
//!
//! Why: a hold is five statements (`BEGIN IMMEDIATE` twice counted by sqlx, the conditional
//! `UPDATE`, the `INSERT`, `COMMIT`) and a settlement ten or more; on sqlx's driver each is a
//! message to the connection's worker thread and a wake-up back (two thread switches), which
//! was the largest item in the gateway's profile (`docs/benchmarks.md`, issue 17). Here a write
//! waits once, asynchronously, for the connection ([`tokio::sync::Mutex`], a FIFO queue like
//! the one-connection pool it replaces), then runs each statement directly: microseconds each,
//! prepared once per connection (statement cache).
//!
//! # Group commit
//!
//! After that, the largest ledger item was the commit itself: each commit appends every page
//! it changed to the WAL (the account's page, the hot index pages, the roll-ups), so two
//! commits per request wrote the same hot pages twice per request. Now:
//!
//! - a write transaction ([`Writer::begin`]) is a `SAVEPOINT` inside the **batch**: one
//!   `BEGIN IMMEDIATE` transaction that stays open while writes join it;
//! - its commit (`RELEASE`) hands the connection back and yields to the scheduler once
//!   ([`tokio::task::yield_now`]), so the other writes that are ready in the same tick run and
//!   join the batch; then the first of the batch's writes to get the connection back commits
//!   the batch (`COMMIT`) for all of them, and each of them returns the batch's outcome;
//! - a write returns `Ok` only once the `COMMIT` that holds it has succeeded, so what a caller
//!   was told is committed is on disk as before (WAL, `synchronous = NORMAL`); if that
//!   `COMMIT` fails, every write of the batch returns its error;
//! - a write that fails or is dropped unfinished is rolled back to its savepoint and leaves the
//!   batch's other writes as they were (each write sees the writes before it, as one after
//!   another on one connection did); if SQLite itself rolled the whole transaction back (an
//!   I/O error, a full disk), every write of the batch fails and none is reported committed.
//!
//! A lone write pays one extra yield and one extra wait for the connection (free at once); a
//! loaded writer commits once per tick instead of once per write. The savepoints' statement
//! journal is kept in memory (`temp_store = MEMORY`), truncated at each `RELEASE`: as a file it
//! cost about 29 `pwrite` calls per request (`docs/benchmarks.md`).
//!
//! What stays the same: the statements (the shared SQL of [`super::super::sql`]),
//! `BEGIN IMMEDIATE` transactions, `journal_mode = WAL`, `synchronous = NORMAL`, foreign keys,
//! the 5 s busy timeout for another process on the same file, and the errors callers see
//! (a SQLite failure is a [`sqlx::Error::Database`] with SQLite's extended result code, so a
//! unique violation is still [`LedgerError::Duplicate`](crate::ledger::LedgerError::Duplicate)
//! and a busy file still code 5).
//!
//! Another process writing the same file: `BEGIN IMMEDIATE` waits for its lock asynchronously
//! (polling, up to the busy timeout), never in SQLite's busy handler on the runtime thread; the
//! batch holds the write lock across one tick, so under load that process gets it less often.
//! Writers in this process queue for the connection instead.

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rusqlite::types::Value;
use rusqlite::{Connection, OpenFlags};
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::checkpoint::{checkpoint_to_restart, WalSize};
use crate::ledger::sql::{Arg, SqlConn, TxEnd};

mod row;
use crate::ledger::{LedgerError, LedgerFuture};
pub(in crate::ledger) use row::WriterRow;

/// Prepared statements kept per writer connection (the request path uses about twenty).
const STATEMENT_CACHE: usize = 128;

/// The longest pause between two tries of `BEGIN IMMEDIATE` while another connection writes
/// (SQLite's own busy handler pauses at most 100 ms; shorter here, so a batch reopened at once
/// by a busy writer leaves the other connection more chances).
const MAX_BUSY_PAUSE: Duration = Duration::from_millis(25);

/// The writer connection and its open batch, behind the FIFO mutex.
#[derive(Clone, Debug)]
pub(super) struct Writer(Arc<Mutex<Inner>>);

/// What the mutex guards.
#[derive(Debug)]
pub(in crate::ledger) struct Inner {
    /// The connection; `None` once the store is closed.
    conn: Option<Connection>,
    /// The batch whose `BEGIN IMMEDIATE` transaction is open on `conn`, if one is.
    open: Option<OpenBatch>,
    /// Batches committed so far.
    commits: u64,
    /// How long `BEGIN IMMEDIATE` waits for another connection's write lock (asynchronously).
    busy_timeout: Duration,
    /// When to checkpoint after a commit so that the WAL starts over (`checkpoint.rs`).
    wal: WalSize,
}

/// The open batch: its outcome, to come, and how many writes it holds.
#[derive(Debug)]
struct OpenBatch {
    /// Set once, when the batch commits or fails.
    batch: Arc<Batch>,
    /// Writes released into the batch (committed with it).
    released: usize,
}

/// One group commit's outcome, shared by its writes.
#[derive(Debug, Default)]
struct Batch(OnceLock<Result<(), CommitFailure>>);

/// Why a batch did not commit, kept so that each of its writes can report it.
#[derive(Clone, Debug)]
enum CommitFailure {
    /// SQLite refused (`COMMIT` failed, or SQLite rolled the transaction back itself).
    Database(WriterDbError),
    /// The store was closed, or a failure outside SQLite's codes.
    Other(String),
}

impl CommitFailure {
    /// As sqlx's driver would report it.
    fn to_sqlx(&self) -> sqlx::Error {
        match self {
            Self::Database(e) => sqlx::Error::Database(Box::new(e.clone())),
            Self::Other(m) => sqlx::Error::Protocol(m.clone()),
        }
    }
}

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
        wal: WalSize,
    ) -> Result<Self, LedgerError> {
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(to_ledger)?;
        conn.busy_timeout(busy_timeout).map_err(to_ledger)?;
        conn.execute_batch(&format!(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON;
             PRAGMA wal_autocheckpoint = {autocheckpoint_pages}; PRAGMA temp_store = MEMORY;"
        ))
        .map_err(to_ledger)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        Ok(Self(Arc::new(Mutex::new(Inner {
            conn: Some(conn),
            open: None,
            commits: 0,
            busy_timeout,
            wal,
        }))))
    }

    /// A connection for writes of one statement each: each statement is a write transaction
    /// of its own ([`Writer::begin`], committed with its batch before it returns).
    pub(super) fn auto(&self) -> WriterAuto {
        WriterAuto(self.clone())
    }

    /// The connection, held, or `PoolClosed` once the store is closed.
    async fn lock(&self) -> Result<WriterConn, LedgerError> {
        let guard = Arc::clone(&self.0).lock_owned().await;
        if guard.conn.is_none() {
            return Err(LedgerError::Database(sqlx::Error::PoolClosed));
        }
        Ok(WriterConn(guard))
    }

    /// A write transaction: a `SAVEPOINT` in the open batch (opened with `BEGIN IMMEDIATE`
    /// when none is).
    ///
    /// # Errors
    ///
    /// As [`Writer::acquire`]; [`LedgerError::Database`] when `BEGIN` or `SAVEPOINT` fails.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped wait leaves the queue.
    pub(super) async fn begin(&self) -> Result<WriterTx, LedgerError> {
        let mut conn = self.lock().await?;
        conn.fail_batch_rolled_back_by_sqlite();
        if conn.0.open.is_none() {
            conn.begin_immediate().await?;
            conn.0.open = Some(OpenBatch {
                batch: Arc::default(),
                released: 0,
            });
        }
        if let Err(e) = conn.execute("SAVEPOINT w") {
            conn.end_batch_if_empty();
            return Err(to_ledger(e));
        }
        Ok(WriterTx {
            conn: Some(conn),
            writer: self.clone(),
        })
    }

    /// Waits until `batch` has committed or failed, committing it if it is still the open one.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe by itself: [`PendingCommit`]'s drop finishes the wait on a task.
    async fn outcome_of(&self, batch: &Arc<Batch>) -> Result<(), sqlx::Error> {
        if let Some(done) = batch.0.get() {
            return done.as_ref().map_err(CommitFailure::to_sqlx).copied();
        }
        let mut guard = Arc::clone(&self.0).lock_owned().await;
        let is_open = guard
            .open
            .as_ref()
            .is_some_and(|o| Arc::ptr_eq(&o.batch, batch));
        if is_open {
            WriterConn::finish_batch_of(&mut guard);
        }
        if is_open && guard.wal.take_restart() {
            // the batch's writes have their outcome; later writes wait for the connection
            tokio::task::spawn_blocking(move || guard.conn.as_ref().map(checkpoint_to_restart));
        } else {
            drop(guard);
        }
        match batch.0.get() {
            Some(done) => done.as_ref().map_err(CommitFailure::to_sqlx).copied(),
            None => Err(sqlx::Error::Protocol(
                "SQLite writer connection: a batch ended without an outcome".to_owned(),
            )),
        }
    }

    /// Batches committed so far (each `COMMIT` of the writer's transactions).
    #[cfg(test)]
    pub(super) async fn commits(&self) -> u64 {
        self.0.lock().await.commits
    }

    /// Closes the connection once the writes in flight are done (an open batch is committed
    /// first); later writes fail [`sqlx::Error::PoolClosed`].
    pub(super) async fn close(&self) {
        let mut guard = self.0.lock().await;
        WriterConn::finish_batch_of(&mut guard);
        if let Some(conn) = guard.conn.take() {
            if let Err((_, e)) = conn.close() {
                tracing::warn!(error = %e, "closing the ledger's writer connection failed");
            }
        }
    }
}

/// The writer connection, held: statements run on it synchronously.
#[derive(Debug)]
pub(in crate::ledger) struct WriterConn(OwnedMutexGuard<Inner>);

impl WriterConn {
    /// Runs `f` on the connection (present: [`Writer::lock`] checked it).
    fn run<T>(
        &mut self,
        f: &mut dyn FnMut(&Connection) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<T> {
        match self.0.conn.as_ref() {
            Some(conn) => f(conn),
            None => Err(rusqlite::Error::InvalidQuery),
        }
    }

    /// Runs one statement without arguments or rows (`BEGIN`, `SAVEPOINT`, …), prepared once.
    fn execute(&mut self, sql: &str) -> rusqlite::Result<()> {
        self.run(&mut |c| c.prepare_cached(sql)?.raw_execute().map(drop))
    }

    /// `BEGIN IMMEDIATE`, waiting for another connection's write lock (another process on
    /// the same file) **asynchronously**, up to the busy timeout: SQLite's own busy handler
    /// would sleep on the runtime thread, and in one process could wait for a batch that needs
    /// that very thread to commit. Polls after 1, 2, 4 … ms, at most [`MAX_BUSY_PAUSE`] apart,
    /// as SQLite's busy handler does.
    ///
    /// # Errors
    ///
    /// SQLite's error; `SQLITE_BUSY` (code 5) once the busy timeout has passed.
    async fn begin_immediate(&mut self) -> Result<(), LedgerError> {
        let busy_timeout = self.0.busy_timeout;
        let deadline = tokio::time::Instant::now() + busy_timeout;
        let mut pause = Duration::from_millis(1);
        loop {
            let r = self.run(&mut |c| {
                c.busy_timeout(Duration::ZERO)?;
                let r = c
                    .prepare_cached("BEGIN IMMEDIATE")
                    .and_then(|mut s| s.raw_execute());
                c.busy_timeout(busy_timeout)?;
                r
            });
            match r {
                Ok(_) => return Ok(()),
                Err(e) if is_busy(&e) && tokio::time::Instant::now() + pause < deadline => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_BUSY_PAUSE);
                }
                Err(e) => return Err(to_ledger(e)),
            }
        }
    }

    /// Ends the open batch, if any, with `COMMIT` and records the outcome for its writes; if
    /// SQLite already rolled the transaction back, or `COMMIT` fails, the outcome is that
    /// failure (and what is left open is rolled back).
    fn finish_batch_of(inner: &mut Inner) {
        let Some(open) = inner.open.take() else {
            return;
        };
        let outcome = match inner.conn.as_ref() {
            None => Err(CommitFailure::Other(
                "the ledger store is closed".to_owned(),
            )),
            Some(c) if c.is_autocommit() => Err(rolled_back_by_sqlite()),
            Some(c) => match c.prepare_cached("COMMIT").and_then(|mut s| s.raw_execute()) {
                Ok(_) => {
                    inner.commits += 1;
                    #[cfg(feature = "metrics")]
                    {
                        metrics::counter!(crate::metrics::LEDGER_COMMITS).increment(1);
                        metrics::counter!(crate::metrics::LEDGER_COMMITTED_WRITES)
                            .increment(open.released as u64);
                    }
                    Ok(())
                }
                Err(e) => {
                    if !c.is_autocommit() {
                        if let Err(e) = c.execute_batch("ROLLBACK") {
                            tracing::warn!(error = %e, "rolling back a failed ledger batch failed");
                        }
                    }
                    Err(failure_of(&e))
                }
            },
        };
        // set once: a batch is finished only here, and taken out of `open` before it
        let _ = open.batch.0.set(outcome);
    }

    /// If SQLite rolled the open batch's transaction back by itself (it does on some I/O,
    /// full-disk and out-of-memory errors), the batch fails: none of its writes is reported
    /// committed, and the next write opens a new batch.
    fn fail_batch_rolled_back_by_sqlite(&mut self) {
        let rolled_back = self.0.conn.as_ref().is_some_and(Connection::is_autocommit);
        if rolled_back {
            if let Some(open) = self.0.open.take() {
                let _ = open.batch.0.set(Err(rolled_back_by_sqlite()));
            }
        }
    }

    /// Rolls back the open batch if no write was released into it (nothing to commit), so that
    /// SQLite's write lock is not kept for nothing.
    fn end_batch_if_empty(&mut self) {
        self.fail_batch_rolled_back_by_sqlite();
        if self.0.open.as_ref().is_some_and(|o| o.released == 0) {
            if let Some(open) = self.0.open.take() {
                let r = self.run(&mut |c| c.execute_batch("ROLLBACK"));
                if let Err(e) = r {
                    tracing::warn!(error = %e, "rolling back an empty ledger batch failed");
                }
                let _ = open
                    .batch
                    .0
                    .set(Err(CommitFailure::Other("an empty batch".to_owned())));
            }
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

/// The writer for writes of one statement each ([`Writer::auto`]): each statement runs as a
/// write transaction of its own in the current batch and returns once that batch committed,
/// as an autocommit statement returns once committed.
#[derive(Debug)]
pub(in crate::ledger) struct WriterAuto(Writer);

/// Runs `$call` on a write transaction of its own (`$tx`), committed before it returns.
macro_rules! one_statement {
    ($writer:expr, |$tx:ident| $call:expr) => {
        Box::pin(async move {
            let mut $tx = $writer.begin().await?;
            let value = $call.await?;
            TxEnd::commit($tx).await.map_err(LedgerError::Database)?;
            Ok(value)
        })
    };
}

impl SqlConn for WriterAuto {
    type Row = WriterRow;

    fn exec<'a>(&'a mut self, sql: &'a str, args: &'a [Arg<'a>]) -> LedgerFuture<'a, u64> {
        one_statement!(self.0, |tx| tx.exec(sql, args))
    }

    fn optional<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> LedgerFuture<'a, Option<WriterRow>> {
        one_statement!(self.0, |tx| tx.optional(sql, args))
    }

    fn all<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> LedgerFuture<'a, Vec<WriterRow>> {
        one_statement!(self.0, |tx| tx.all(sql, args))
    }

    fn batch<'a>(&'a mut self, sql: &'a str) -> LedgerFuture<'a, ()> {
        one_statement!(self.0, |tx| tx.batch(sql))
    }
}

/// A write transaction: a savepoint in the writer's open batch; rolled back to it when dropped
/// unfinished (the batch's other writes stay).
#[derive(Debug)]
pub(in crate::ledger) struct WriterTx {
    /// `None` once released or rolled back.
    conn: Option<WriterConn>,
    /// To wait for the batch's commit.
    writer: Writer,
}

impl WriterTx {
    /// The connection, while the transaction is open.
    fn conn(&mut self) -> Result<&mut WriterConn, LedgerError> {
        self.conn
            .as_mut()
            .ok_or(LedgerError::Database(sqlx::Error::PoolClosed))
    }

    /// Releases the savepoint into the batch and hands the connection back: the batch to wait
    /// for. On failure the savepoint is rolled back (on drop).
    fn release(&mut self) -> Result<Arc<Batch>, sqlx::Error> {
        let Some(mut conn) = self.conn.take() else {
            return Err(sqlx::Error::PoolClosed);
        };
        if let Err(e) = conn.execute("RELEASE w") {
            self.conn = Some(conn);
            return Err(to_sqlx(e));
        }
        match conn.0.open.as_mut() {
            Some(open) => {
                open.released += 1;
                Ok(Arc::clone(&open.batch))
            }
            None => Err(sqlx::Error::Protocol(
                "SQLite writer connection: a write released outside a batch".to_owned(),
            )),
        }
    }
}

/// Rolls `conn` back to the write's savepoint. If that fails, the whole batch is rolled back
/// and fails (so no part of this write can be committed with it).
fn roll_back_savepoint(conn: &mut WriterConn) -> Result<(), sqlx::Error> {
    let r = conn.run(&mut |c| {
        if c.is_autocommit() {
            Ok(())
        } else {
            c.execute_batch("ROLLBACK TO w; RELEASE w")
        }
    });
    if let Err(e) = &r {
        let rolled = conn.run(&mut |c| {
            if c.is_autocommit() {
                Ok(())
            } else {
                c.execute_batch("ROLLBACK")
            }
        });
        if let Err(e) = rolled {
            tracing::warn!(error = %e, "rolling back a ledger batch failed");
        }
        if let Some(open) = conn.0.open.take() {
            let _ = open.batch.0.set(Err(failure_of(e)));
        }
    }
    conn.end_batch_if_empty();
    r.map_err(to_sqlx)
}

impl Drop for WriterTx {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.conn {
            if let Err(e) = roll_back_savepoint(conn) {
                tracing::warn!(error = %e, "rolling back a ledger write failed");
            }
        }
    }
}

impl TxEnd for WriterTx {
    /// Releases the write into the batch, yields once so that the writes ready in the same
    /// tick join it, then waits for the batch's `COMMIT` (committing it if no other write of
    /// the batch has yet). `Ok` only once that `COMMIT` succeeded.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future once the write is released does not lose it: a task finishes the
    /// batch (the caller just does not learn the outcome, as with a lost acknowledgement).
    fn commit(mut self) -> impl std::future::Future<Output = Result<(), sqlx::Error>> + Send {
        let released = self.release();
        let writer = self.writer.clone();
        drop(self);
        async move {
            let pending = PendingCommit {
                writer,
                batch: Some(released?),
            };
            tokio::task::yield_now().await;
            pending.wait().await
        }
    }

    fn rollback(mut self) -> impl std::future::Future<Output = Result<(), sqlx::Error>> + Send {
        let r = match self.conn.take() {
            Some(mut conn) => roll_back_savepoint(&mut conn),
            None => Ok(()),
        };
        std::future::ready(r)
    }
}

/// A write released into a batch, waiting for the batch's outcome; dropped while waiting, it
/// leaves a task to finish the batch, so a cancelled caller never leaves a batch open.
struct PendingCommit {
    /// The writer whose batch it is.
    writer: Writer,
    /// `None` once the outcome is known.
    batch: Option<Arc<Batch>>,
}

impl PendingCommit {
    /// The batch's outcome (see [`Writer::outcome_of`]).
    async fn wait(mut self) -> Result<(), sqlx::Error> {
        let Some(batch) = self.batch.clone() else {
            return Ok(());
        };
        let r = self.writer.outcome_of(&batch).await;
        self.batch = None;
        r
    }
}

impl Drop for PendingCommit {
    fn drop(&mut self) {
        let Some(batch) = self.batch.take() else {
            return;
        };
        if batch.0.get().is_some() {
            return;
        }
        // without a runtime (shutting down), the next write or `close` commits the batch
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let writer = self.writer.clone();
            runtime.spawn(async move {
                if let Err(e) = writer.outcome_of(&batch).await {
                    tracing::warn!(error = %e, "a ledger batch whose waiter was cancelled failed");
                }
            });
        }
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

/// A SQLite failure, as sqlx's driver reports one: the message and SQLite's extended result
/// code (as text, e.g. `"2067"` for a unique violation).
#[derive(Clone, Debug)]
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

/// Whether `e` is `SQLITE_BUSY` (another connection holds the lock).
fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DatabaseBusy)
}

/// `e` as a [`LedgerError::Database`].
fn to_ledger(e: rusqlite::Error) -> LedgerError {
    LedgerError::Database(to_sqlx(e))
}

/// `e` as a batch's failure.
fn failure_of(e: &rusqlite::Error) -> CommitFailure {
    match e {
        rusqlite::Error::SqliteFailure(code, message) => CommitFailure::Database(WriterDbError {
            extended_code: code.extended_code,
            message: message.clone().unwrap_or_else(|| code.to_string()),
        }),
        other => CommitFailure::Other(format!("SQLite writer connection: {other}")),
    }
}

/// The failure of a batch whose transaction SQLite rolled back by itself.
fn rolled_back_by_sqlite() -> CommitFailure {
    CommitFailure::Other(
        "SQLite writer connection: the batch's transaction was rolled back by SQLite".to_owned(),
    )
}
