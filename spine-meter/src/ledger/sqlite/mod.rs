//! The SQLite ledger store (one file, WAL): its connections (one writer, a reader pool, a
//! background checkpointer) and how it places a hold; the statements are the shared ones
//! ([`super::sql`]).

mod api;
mod checkpoint;
mod conn;
pub(in crate::ledger) mod migrations;
mod writer;

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{Connection as _, Sqlite};

use super::convert::{db, to_i64};
use super::sql::{self, money, Access, Arg, Backend, HoldRequest, SqlConn as _, TxEnd as _};
use super::{LedgerError, LedgerFuture};
#[cfg(doc)]
use crate::ledger::Store;
use checkpoint::{spawn_checkpointer, AbortOnDrop, WalSize, WRITER_AUTOCHECKPOINT_PAGES};
use conn::{StoreConn, StoreTx};
use writer::Writer;

/// The ledger and gateway store on SQLite.
///
/// Holds accounts, API key hashes (never plaintext keys), idempotent credits, operators, nodes,
/// holds, request records and double-entry ledger entries.
///
/// # Writers and readers
///
/// SQLite lets one connection write at a time. A file store ([`SqliteLedger::open`]) therefore
/// sends every write through **one writer connection**: concurrent holds, settlements and
/// credits wait for it in an asynchronous FIFO queue, in process, instead of each taking its
/// own connection, hitting `SQLITE_BUSY` on `BEGIN IMMEDIATE` and sleeping in SQLite's busy
/// handler (1, 2, 5, 10 … ms per retry, measured as the gateway's bottleneck in
/// `docs/benchmarks.md`). Once it has the connection, a write runs its statements directly in
/// the calling task (`rusqlite`, on the same SQLite library as sqlx's driver, statements
/// prepared once): one wait per transaction, where sqlx's driver hands every statement to its
/// connection thread and back. The writes ready in one scheduler tick are **committed
/// together** (group commit: each write is a savepoint in one `BEGIN IMMEDIATE` transaction,
/// and a write returns `Ok` only once that transaction's `COMMIT` succeeded; a failed write is
/// rolled back to its savepoint alone), so a loaded writer appends its hot pages to the WAL
/// once per tick instead of once per write. Write transactions still start with
/// `BEGIN IMMEDIATE` and the 5 s busy timeout stays, for another process writing the same
/// file (a second gateway on the same file, a migration); only then does a write wait, and it
/// waits asynchronously (polling `BEGIN IMMEDIATE`), never on the runtime thread; under load
/// the writer holds the lock across a tick, so such a second writer gets it less often. Reads (balances, key lookups, request records, entry sums) run
/// on a separate sqlx pool of four `query_only` connections: in WAL mode readers run beside the
/// writer and see every transaction committed before their statement began. An in-memory
/// store and a store on a caller's pool write through sqlx.
///
/// # Durability
///
/// `journal_mode = WAL`, `synchronous = NORMAL`. A commit returns once its WAL frames are written
/// to the file (in the OS page cache), so **an application crash (panic, `kill -9`, OOM) never
/// loses a committed hold or settlement**: the next open replays the WAL. The WAL is fsynced
/// before each checkpoint and the database after it, not at every commit; so on **power loss or
/// an OS crash** the transactions committed since the last checkpoint's fsync (about the last
/// quarter second's worth) can be rolled back. The file stays consistent either way:
/// each transaction is whole or absent, so double entry, `held ≤ balance` and idempotency hold
/// after recovery; a settlement lost this way leaves its hold active, and
/// [`Store::settle_stale_holds`] at start-up settles it as `upstream_failed` (the caller is not
/// charged for that request). `synchronous = FULL` would fsync every commit (≈ 10 ms on the
/// benchmark machine's disk, one writer: ≈ 100 writes/s); deployments that need power-loss
/// durability of every single settlement should use the PostgreSQL store with its default
/// `synchronous_commit = on`.
///
/// Checkpoints (copying the WAL into the database file, two fsyncs) run on a background task
/// with its own connection every 250 ms (`PRAGMA wal_checkpoint(PASSIVE)`, which never blocks
/// the writer), so the writer does not stall for them after a commit. Once the WAL holds
/// 16,384 pages, the writer checkpoints the rest itself after a commit, on a blocking thread,
/// so that its next transaction starts the WAL over; SQLite's automatic checkpoint, which
/// would run on the runtime thread inside a `COMMIT`, is only a safety net at 65,536 pages
/// (`checkpoint.rs` has the details).
#[derive(Clone, Debug)]
pub struct SqliteLedger {
    /// A file store's writer connection: every write of [`SqliteLedger::open`]'s store.
    direct: Option<Writer>,
    /// Every write of an in-memory or caller's-pool store (one connection, or the shared
    /// pool of [`SqliteLedger::with_pool`]); a file store's migrations.
    writer: SqlitePool,
    /// Reads; the same pool as `writer` for [`SqliteLedger::in_memory`] and
    /// [`SqliteLedger::with_pool`].
    reader: SqlitePool,
    /// The background checkpointer of a file store; aborted when the last clone is dropped.
    checkpointer: Option<Arc<AbortOnDrop>>,
}

/// How long a connection waits in SQLite's busy handler for another process's write lock.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Reader connections of a file store.
const READERS: u32 = 4;

/// How long [`SqliteLedger::open`] keeps retrying a connection SQLite refuses as busy.
const OPEN_BUSY_DEADLINE: Duration = Duration::from_secs(10);

/// Whether `e` is `SQLITE_BUSY` or `SQLITE_LOCKED` (any extended code of either).
fn is_busy(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d)
        if d.code().and_then(|c| c.parse::<i32>().ok()).is_some_and(|c| matches!(c & 0xff, 5 | 6)))
}

/// Runs `connect` until it does not fail busy, for at most [`OPEN_BUSY_DEADLINE`] (backoff
/// 10 ms doubling to 200 ms).
///
/// Every new connection runs `PRAGMA journal_mode = WAL`; switching a new file to WAL takes
/// an exclusive lock that SQLite's busy handler does not wait for, so processes opening one
/// new file at the same instant can be refused with "database is locked" (code 5) at connect
/// despite `busy_timeout` (seen in CI on this crate's concurrent-open test; the same race from
/// the `sqlite3` shell: elixir-sqlite/exqlite#138). The switch happens once per file, so a
/// retry finds it done.
async fn connect_retrying_busy<T, F, Fut>(mut connect: F) -> Result<T, LedgerError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let deadline = tokio::time::Instant::now() + OPEN_BUSY_DEADLINE;
    let mut backoff = Duration::from_millis(10);
    loop {
        match connect().await {
            Err(e) if is_busy(&e) && tokio::time::Instant::now() + backoff < deadline => {
                tracing::debug!(error = %e, "ledger file busy at connect; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
            r => return r.map_err(db),
        }
    }
}

/// Creates the database file at `path` owner-only (`0600`) if it is missing, and takes group
/// and other permissions off an existing one and its `-wal` / `-shm` files (Unix; elsewhere
/// nothing).
fn restrict_file_modes(path: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
        {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let mut names = vec![path.as_os_str().to_owned()];
        for suffix in ["-wal", "-shm"] {
            let mut name = path.as_os_str().to_owned();
            name.push(suffix);
            names.push(name);
        }
        for name in names {
            let meta = match std::fs::metadata(&name) {
                Ok(meta) => meta,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            if meta.is_file() && meta.permissions().mode() & 0o077 != 0 {
                let mode = meta.permissions().mode() & 0o700;
                std::fs::set_permissions(&name, std::fs::Permissions::from_mode(mode))?;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

impl SqliteLedger {
    /// Opens (creating if needed) the database file at `path` and applies migrations: one
    /// writer connection, four reader connections and a background checkpointer (see
    /// the type's docs). Call it inside a Tokio runtime.
    ///
    /// On Unix the file is created `0600` (owner only: the ledger holds API key hashes and
    /// balances), and SQLite creates its `-wal` and `-shm` files with the database file's mode;
    /// an existing database, `-wal` or `-shm` file readable by others is set to `0600`.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`] when the file cannot be opened or migrated (a connection that
    /// SQLite refuses as busy, as when several processes open one new file at once, is retried
    /// for up to 10 s first).
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, LedgerError> {
        let path = path.as_ref();
        restrict_file_modes(path).map_err(|e| db(sqlx::Error::Io(e)))?;
        let base = SqliteConnectOptions::new()
            .filename(path)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true);
        // the writer first: it creates the file, switches it to WAL and migrates it
        let writer_opts = base.clone().create_if_missing(true).pragma(
            "wal_autocheckpoint",
            WRITER_AUTOCHECKPOINT_PAGES.to_string(),
        );
        let writer = connect_retrying_busy(|| {
            SqlitePoolOptions::new()
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
                // one connection: a liveness ping per acquire would be one more hand-off to
                // its worker thread per transaction, for nothing
                .test_before_acquire(false)
                .acquire_timeout(Duration::from_secs(30))
                .connect_with(writer_opts.clone())
        })
        .await?;
        let migrated = Self {
            direct: None,
            writer: writer.clone(),
            reader: writer.clone(),
            checkpointer: None,
        };
        migrated.migrate().await?;
        let reader_opts = base.clone().pragma("query_only", "ON");
        let reader = connect_retrying_busy(|| {
            SqlitePoolOptions::new()
                .max_connections(READERS)
                .test_before_acquire(false)
                .connect_with(reader_opts.clone())
        })
        .await?;
        let checkpointer = connect_retrying_busy(|| SqliteConnection::connect_with(&base)).await?;
        let wal = WalSize::new(checkpoint::RESTART_AFTER_FRAMES);
        let direct = Writer::open(path, BUSY_TIMEOUT, WRITER_AUTOCHECKPOINT_PAGES, wal.clone())?;
        Ok(Self {
            direct: Some(direct),
            writer,
            reader,
            checkpointer: Some(Arc::new(spawn_checkpointer(checkpointer, wal))),
        })
    }

    /// An in-memory database (one connection for reads and writes), for tests and ephemeral use.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`].
    pub async fn in_memory() -> Result<Self, LedgerError> {
        let opts = SqliteConnectOptions::from_str("sqlite::memory:")
            .map_err(db)?
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .test_before_acquire(false)
            .connect_with(opts)
            .await
            .map_err(db)?;
        Self::with_pool(pool).await
    }

    /// Wraps an existing pool, used for reads and writes alike, and applies migrations
    /// (idempotent; safe for several processes opening the same file at once). Writers queue
    /// in process only if the pool has one connection; with more, concurrent writes wait in
    /// SQLite's busy handler (see the type's docs). No background checkpointer: SQLite's
    /// automatic checkpoints apply.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`].
    pub async fn with_pool(pool: SqlitePool) -> Result<Self, LedgerError> {
        let this = Self {
            direct: None,
            writer: pool.clone(),
            reader: pool,
            checkpointer: None,
        };
        this.migrate().await?;
        Ok(this)
    }

    /// Boxed so that `open`/`connect` futures are `Send` for any caller (spawnable): sqlx's
    /// executor impls otherwise trip rustc's higher-ranked `Send` inference.
    fn migrate(&self) -> LedgerFuture<'_, ()> {
        Box::pin(self.migrate_impl())
    }

    async fn migrate_impl(&self) -> Result<(), LedgerError> {
        sql::migrate(
            self,
            None,
            "CREATE TABLE IF NOT EXISTS spine_schema_migrations (version INTEGER PRIMARY KEY, applied_at_ms INTEGER NOT NULL)",
            &migrations::migrations(),
        )
        .await
    }

    /// sqlx's writer pool: every write of an in-memory or caller's-pool store; for a file
    /// store (whose own writes go through its writer connection) one connection that ran the
    /// migrations, for the caller's own statements.
    pub fn pool(&self) -> &SqlitePool {
        &self.writer
    }

    /// The pool reads go through (`query_only` connections for a file store).
    pub fn reader_pool(&self) -> &SqlitePool {
        &self.reader
    }

    /// Closes the writer and reader pools and stops the background checkpointer; waits for
    /// checked-out connections to be returned. Clones of this store see closed pools.
    pub async fn close(&self) {
        if let Some(c) = &self.checkpointer {
            c.0.abort();
        }
        if let Some(direct) = &self.direct {
            direct.close().await;
        }
        self.writer.close().await;
        self.reader.close().await;
    }
}

sql::sql_conn!(Sqlite, SqliteConnection, sqlx::sqlite::SqliteRow);
sql::sql_store!(SqliteLedger);
sql::console::sql_console!(SqliteLedger);

impl Backend for SqliteLedger {
    type Conn = StoreConn;
    type Tx = StoreTx;

    // one writer at a time (`BEGIN IMMEDIATE` on one connection): no deadlock to retry, no
    // lock to take
    const ATTEMPTS: u32 = 1;
    const FOR_UPDATE: &'static str = "";
    const SETTLE_LOCK: Option<&'static str> = None;
    const NODES_LOCK: Option<&'static str> = None;
    const SHARED: bool = false;

    fn is_retryable(_: &LedgerError) -> bool {
        false
    }

    fn instance_id(&self) -> Option<&str> {
        None
    }

    /// Reads on the reader pool; writes on the file store's writer, else on the writer pool.
    async fn conn(&self, access: Access) -> Result<StoreConn, LedgerError> {
        match (access, &self.direct) {
            (Access::Read, _) => self.reader.acquire().await.map(StoreConn::Pool).map_err(db),
            (Access::Write, Some(direct)) => Ok(StoreConn::Writer(direct.auto())),
            (Access::Write, None) => self.writer.acquire().await.map(StoreConn::Pool).map_err(db),
        }
    }

    /// `BEGIN IMMEDIATE` on the writer: the write lock is taken at the start, so writers take
    /// turns.
    async fn begin(&self) -> Result<StoreTx, LedgerError> {
        match &self.direct {
            Some(direct) => direct.begin().await.map(StoreTx::Writer),
            None => self
                .writer
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map(StoreTx::Pool)
                .map_err(db),
        }
    }

    /// Places a hold: the conditional `UPDATE` adds the amount to `held_micros` only when
    /// `balance − held` covers it (writers take turns on the one writer connection, in a
    /// `BEGIN IMMEDIATE` transaction, so the decision and the numbers a refusal reports are
    /// those of one moment).
    async fn hold_once<'a>(&'a self, hold: HoldRequest<'a>) -> Result<(), LedgerError> {
        let amount = to_i64(hold.amount_micros)?;
        let mut tx = self.begin().await?;
        let updated = tx
            .exec(
                "UPDATE accounts SET held_micros = held_micros + $1 WHERE id = $2 AND balance_micros - held_micros >= $1",
                &[Arg::I64(amount), Arg::Text(hold.account.as_str())],
            )
            .await?;
        if updated == 0 {
            let row = tx
                .optional(
                    sql::accounts::ACCOUNT_BALANCE,
                    &[Arg::Text(hold.account.as_str())],
                )
                .await?;
            tx.rollback().await.map_err(db)?;
            return Err(money::hold_refusal(row, hold));
        }
        let inserted = money::insert_hold(&mut tx, hold, None).await;
        sql::finish::<Self>(tx, inserted.is_ok()).await?;
        inserted
    }
}

#[cfg(test)]
mod tests;
