//! The SQLite ledger store (one file, WAL).

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use sqlx::{Connection as _, Row, Sqlite, Transaction};

use spine_core::{
    AccountId, ModelId, NodeId, OperatorId, RequestId, StreamOutcome, Usage, UsageSource,
};

use super::convert::{db, now_ms, to_i64, to_u64};
use super::{
    AccountBalance, Enrollment, EntryTotals, HoldNote, KeyLimits, Ledger, LedgerError,
    LedgerFuture, NodeRecord, RequestRecord, SettleAmounts, SettleResult, Settlement, Store,
    SweepKind,
};
use crate::price::Price;

/// Schema migrations, applied in order, each once (recorded in `spine_schema_migrations`).
const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        r#"
CREATE TABLE accounts (
    id TEXT PRIMARY KEY,
    balance_micros INTEGER NOT NULL DEFAULT 0 CHECK (balance_micros >= 0),
    held_micros INTEGER NOT NULL DEFAULT 0 CHECK (held_micros >= 0),
    created_at_ms INTEGER NOT NULL,
    CHECK (held_micros <= balance_micros)
);
CREATE TABLE api_keys (
    key_hash TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts(id),
    created_at_ms INTEGER NOT NULL
);
CREATE TABLE credits (
    idempotency_key TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts(id),
    amount_micros INTEGER NOT NULL CHECK (amount_micros >= 0),
    created_at_ms INTEGER NOT NULL
);
CREATE TABLE operators (
    id TEXT PRIMARY KEY,
    earned_micros INTEGER NOT NULL DEFAULT 0 CHECK (earned_micros >= 0),
    created_at_ms INTEGER NOT NULL
);
CREATE TABLE nodes (
    node_id TEXT PRIMARY KEY,
    operator_id TEXT NOT NULL REFERENCES operators(id),
    public_key_text TEXT NOT NULL UNIQUE,
    created_at_ms INTEGER NOT NULL
);
CREATE TABLE holds (
    request_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts(id),
    amount_micros INTEGER NOT NULL CHECK (amount_micros >= 0),
    state TEXT NOT NULL CHECK (state IN ('held', 'released', 'settled')),
    created_at_ms INTEGER NOT NULL
);
CREATE TABLE requests (
    request_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    model TEXT NOT NULL,
    outcome TEXT NOT NULL,
    node_id TEXT,
    operator_id TEXT,
    billed_prompt_tokens INTEGER NOT NULL,
    billed_completion_tokens INTEGER NOT NULL,
    claimed_prompt_tokens INTEGER,
    claimed_completion_tokens INTEGER,
    usage_source TEXT NOT NULL,
    discrepancy INTEGER NOT NULL,
    input_micros_per_mtok INTEGER NOT NULL,
    output_micros_per_mtok INTEGER NOT NULL,
    share_bps INTEGER NOT NULL,
    cost_micros INTEGER NOT NULL,
    debit_micros INTEGER NOT NULL,
    operator_credit_micros INTEGER NOT NULL,
    fee_micros INTEGER NOT NULL,
    hold_micros INTEGER NOT NULL,
    created_at_ms INTEGER NOT NULL
);
CREATE TABLE ledger_entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ref TEXT NOT NULL,
    party_kind TEXT NOT NULL CHECK (party_kind IN ('account', 'operator', 'platform', 'external')),
    party_id TEXT NOT NULL,
    amount_micros INTEGER NOT NULL,
    created_at_ms INTEGER NOT NULL
);
CREATE INDEX ledger_entries_ref ON ledger_entries(ref);
"#,
    ),
    (
        2,
        // the model of a hold, so a hold left active by a crash can be settled with a full
        // request record (`SqliteLedger::settle_stale_holds`); NULL for holds placed before
        r#"
ALTER TABLE holds ADD COLUMN model TEXT;
"#,
    ),
    (
        3,
        // one-time enrollment tokens (hash only), node names, and the per-node request counts
        // the operator view reads
        r#"
ALTER TABLE nodes ADD COLUMN name TEXT;
CREATE TABLE enrollments (
    token_hash TEXT PRIMARY KEY,
    operator_id TEXT NOT NULL REFERENCES operators(id),
    expires_at_ms INTEGER NOT NULL,
    created_at_ms INTEGER NOT NULL,
    node_id TEXT REFERENCES nodes(node_id),
    redeemed_at_ms INTEGER
);
CREATE INDEX requests_node ON requests(node_id);
"#,
    ),
    (
        4,
        // per-key rate limits, kept beside the keys (PostgreSQL's version 3 has the same table)
        r#"
CREATE TABLE key_limits (
    key_hash TEXT PRIMARY KEY,
    rpm_limit INTEGER CHECK (rpm_limit >= 0),
    tpm_limit INTEGER CHECK (tpm_limit >= 0),
    updated_at_ms INTEGER NOT NULL
);
"#,
    ),
    (
        5,
        // what is known of a request in flight, on its hold (`Ledger::note_hold`), so a sweep's
        // record keeps the node and the usage; which sweep settled a request (PostgreSQL's 5)
        r#"
ALTER TABLE holds ADD COLUMN node_id TEXT;
ALTER TABLE holds ADD COLUMN prompt_tokens INTEGER;
ALTER TABLE holds ADD COLUMN completion_tokens INTEGER;
ALTER TABLE requests ADD COLUMN swept TEXT;
"#,
    ),
    (
        6,
        // operator credits held in escrow while a node's model audit is suspect (design brief
        // §10): NULL = paid, 'held', 'forfeited' (PostgreSQL's 6)
        r#"
ALTER TABLE requests ADD COLUMN earnings TEXT;
CREATE INDEX requests_held_earnings ON requests(node_id, model) WHERE earnings = 'held';
"#,
    ),
];

/// The ledger and gateway store on SQLite.
///
/// Holds accounts, API key hashes (never plaintext keys), idempotent credits, operators, nodes,
/// holds, request records and double-entry ledger entries.
///
/// # Writers and readers
///
/// SQLite lets one connection write at a time. A file store ([`SqliteLedger::open`]) therefore
/// sends every write through **one writer connection** (a pool of exactly one): concurrent holds,
/// settlements and credits wait for it in the pool's asynchronous FIFO queue, in process, instead
/// of each taking its own connection, hitting `SQLITE_BUSY` on `BEGIN IMMEDIATE` and sleeping in
/// SQLite's busy handler (1, 2, 5, 10 … ms per retry, measured as the gateway's bottleneck in
/// `docs/benchmarks.md`). Write transactions still start with `BEGIN IMMEDIATE` and the 5 s busy
/// timeout stays, for another process opening the same file (a second gateway on the same
/// file, a migration). Reads (balances, key lookups, request records, entry sums) run on a
/// separate pool of four `query_only` connections: in WAL mode readers run beside the
/// writer and see every transaction committed before their statement began.
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
/// with its own connection every 250 ms (`PRAGMA wal_checkpoint(PASSIVE)`,
/// which never blocks the writer), so the writer does not stall for them after a commit; the
/// writer's own automatic checkpoint stays as a safety net at 16,384 WAL pages.
#[derive(Clone, Debug)]
pub struct SqliteLedger {
    /// Every write: one connection (or the one shared pool of [`SqliteLedger::with_pool`]).
    writer: SqlitePool,
    /// Reads; the same pool as `writer` for [`SqliteLedger::in_memory`] and
    /// [`SqliteLedger::with_pool`].
    reader: SqlitePool,
    /// The background checkpointer of a file store; aborted when the last clone is dropped.
    checkpointer: Option<Arc<AbortOnDrop>>,
}

/// Reader connections of a file store.
const READERS: u32 = 4;

/// How often a file store's background task checkpoints the WAL.
const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(250);

/// The writer connection's `wal_autocheckpoint` (pages): a safety net, reached only when the
/// background checkpoints fall behind (SQLite's default is 1,000).
const WRITER_AUTOCHECKPOINT_PAGES: u32 = 16_384;

/// Aborts a task when dropped.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Checkpoints the WAL every [`CHECKPOINT_INTERVAL`] on its own connection until aborted.
fn spawn_checkpointer(mut conn: SqliteConnection) -> AbortOnDrop {
    let task = async move {
        let mut tick = tokio::time::interval(CHECKPOINT_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(e) = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
                .execute(&mut conn)
                .await
            {
                tracing::debug!(error = %e, "ledger WAL checkpoint failed; retried next tick");
            }
        }
    };
    AbortOnDrop(tokio::spawn(task))
}

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

fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.is_unique_violation())
}

fn get_u64(row: &SqliteRow, col: &'static str) -> Result<u64, LedgerError> {
    to_u64(row.try_get::<i64, _>(col).map_err(db)?, col)
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
            .busy_timeout(Duration::from_secs(5))
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
        Ok(Self {
            writer,
            reader,
            checkpointer: Some(Arc::new(spawn_checkpointer(checkpointer))),
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
        let mut tx = self.begin().await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS spine_schema_migrations (version INTEGER PRIMARY KEY, applied_at_ms INTEGER NOT NULL)",
        )
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        for &(version, sql) in MIGRATIONS {
            let applied: Option<i64> =
                sqlx::query_scalar("SELECT version FROM spine_schema_migrations WHERE version = ?")
                    .bind(version)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(db)?;
            if applied.is_none() {
                sqlx::Executor::execute(&mut *tx, sql).await.map_err(db)?;
                sqlx::query(
                    "INSERT INTO spine_schema_migrations (version, applied_at_ms) VALUES (?, ?)",
                )
                .bind(version)
                .bind(now_ms())
                .execute(&mut *tx)
                .await
                .map_err(db)?;
            }
        }
        tx.commit().await.map_err(db)
    }

    async fn begin(&self) -> Result<Transaction<'static, Sqlite>, LedgerError> {
        self.writer.begin_with("BEGIN IMMEDIATE").await.map_err(db)
    }

    /// The pool every write goes through (one connection for a file store).
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
        self.writer.close().await;
        self.reader.close().await;
    }

    /// Creates an account with a zero balance.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Duplicate`] when it exists.
    pub async fn create_account(&self, account: &AccountId) -> Result<(), LedgerError> {
        sqlx::query("INSERT INTO accounts (id, created_at_ms) VALUES (?, ?)")
            .bind(account.as_str())
            .bind(now_ms())
            .execute(&self.writer)
            .await
            .map_err(|e| {
                if is_unique_violation(&e) {
                    LedgerError::Duplicate { what: "account" }
                } else {
                    db(e)
                }
            })?;
        Ok(())
    }

    /// Adds credits to an account, once per `idempotency_key`. Returns `true` when applied,
    /// `false` when the key was already used for the same account and amount (a retry: nothing
    /// changes).
    ///
    /// # Errors
    ///
    /// [`LedgerError::IdempotencyConflict`] when the key was already used for a different
    /// account or amount (nothing changes); [`LedgerError::UnknownAccount`],
    /// [`LedgerError::OutOfRange`].
    pub async fn add_credits(
        &self,
        account: &AccountId,
        amount_micros: u64,
        idempotency_key: &str,
    ) -> Result<bool, LedgerError> {
        let amount = to_i64(amount_micros)?;
        let mut tx = self.begin().await?;
        let inserted = sqlx::query(
            "INSERT INTO credits (idempotency_key, account_id, amount_micros, created_at_ms)
             SELECT ?, id, ?, ? FROM accounts WHERE id = ?
             ON CONFLICT(idempotency_key) DO NOTHING",
        )
        .bind(idempotency_key)
        .bind(amount)
        .bind(now_ms())
        .bind(account.as_str())
        .execute(&mut *tx)
        .await
        .map_err(db)?
        .rows_affected();
        if inserted == 0 {
            let used = sqlx::query(
                "SELECT account_id, amount_micros FROM credits WHERE idempotency_key = ?",
            )
            .bind(idempotency_key)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db)?;
            tx.rollback().await.map_err(db)?;
            let Some(row) = used else {
                return Err(LedgerError::UnknownAccount(account.clone()));
            };
            let used_account: String = row.try_get("account_id").map_err(db)?;
            let used_amount: i64 = row.try_get("amount_micros").map_err(db)?;
            return if used_account == account.as_str() && used_amount == amount {
                Ok(false)
            } else {
                Err(LedgerError::IdempotencyConflict {
                    idempotency_key: idempotency_key.to_owned(),
                })
            };
        }
        let updated = sqlx::query(
            "UPDATE accounts SET balance_micros = balance_micros + ? WHERE id = ? AND balance_micros <= 9223372036854775807 - ?",
        )
        .bind(amount)
        .bind(account.as_str())
        .bind(amount)
        .execute(&mut *tx)
        .await
        .map_err(db)?
        .rows_affected();
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

    /// Maps an API key's hash (e.g. hex SHA-256 of the key) to an account. The plaintext key is
    /// never stored.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Duplicate`], [`LedgerError::UnknownAccount`].
    pub async fn create_api_key(
        &self,
        account: &AccountId,
        key_hash: &str,
    ) -> Result<(), LedgerError> {
        let r = sqlx::query(
            "INSERT INTO api_keys (key_hash, account_id, created_at_ms) SELECT ?, id, ? FROM accounts WHERE id = ?",
        )
        .bind(key_hash)
        .bind(now_ms())
        .bind(account.as_str())
        .execute(&self.writer)
        .await
        .map_err(|e| {
            if is_unique_violation(&e) {
                LedgerError::Duplicate { what: "api key" }
            } else {
                db(e)
            }
        })?;
        if r.rows_affected() == 0 {
            return Err(LedgerError::UnknownAccount(account.clone()));
        }
        Ok(())
    }

    /// Records an API key's own rate limits ([`Store::set_key_limits`]).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`], [`LedgerError::OutOfRange`].
    pub async fn set_key_limits(
        &self,
        key_hash: &str,
        limits: KeyLimits,
    ) -> Result<(), LedgerError> {
        sqlx::query(
            "INSERT INTO key_limits (key_hash, rpm_limit, tpm_limit, updated_at_ms) VALUES (?, ?, ?, ?)
             ON CONFLICT (key_hash) DO UPDATE SET rpm_limit = excluded.rpm_limit, tpm_limit = excluded.tpm_limit, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(key_hash)
        .bind(limits.rpm_limit.map(i64::from))
        .bind(limits.tpm_limit.map(to_i64).transpose()?)
        .bind(now_ms())
        .execute(&self.writer)
        .await
        .map_err(db)?;
        Ok(())
    }

    /// An API key's own rate limits ([`Store::key_limits`]).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`], [`LedgerError::Corrupt`].
    pub async fn key_limits(&self, key_hash: &str) -> Result<Option<KeyLimits>, LedgerError> {
        let Some(row) =
            sqlx::query("SELECT rpm_limit, tpm_limit FROM key_limits WHERE key_hash = ?")
                .bind(key_hash)
                .fetch_optional(&self.reader)
                .await
                .map_err(db)?
        else {
            return Ok(None);
        };
        let rpm: Option<i64> = row.try_get("rpm_limit").map_err(db)?;
        let tpm: Option<i64> = row.try_get("tpm_limit").map_err(db)?;
        super::convert::key_limits(rpm, tpm).map(Some)
    }

    /// The account an API key hash belongs to.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`].
    pub async fn account_for_key_hash(
        &self,
        key_hash: &str,
    ) -> Result<Option<AccountId>, LedgerError> {
        let id: Option<String> =
            sqlx::query_scalar("SELECT account_id FROM api_keys WHERE key_hash = ?")
                .bind(key_hash)
                .fetch_optional(&self.reader)
                .await
                .map_err(db)?;
        Ok(id.map(AccountId::from))
    }

    /// An account's balance, held and available amounts.
    ///
    /// # Errors
    ///
    /// [`LedgerError::UnknownAccount`].
    pub async fn account(&self, account: &AccountId) -> Result<AccountBalance, LedgerError> {
        let row = sqlx::query("SELECT balance_micros, held_micros FROM accounts WHERE id = ?")
            .bind(account.as_str())
            .fetch_optional(&self.reader)
            .await
            .map_err(db)?
            .ok_or_else(|| LedgerError::UnknownAccount(account.clone()))?;
        balance_from_row(&row)
    }

    /// Creates an operator with nothing earned.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Duplicate`].
    pub async fn create_operator(&self, operator: &OperatorId) -> Result<(), LedgerError> {
        sqlx::query("INSERT INTO operators (id, created_at_ms) VALUES (?, ?)")
            .bind(operator.as_str())
            .bind(now_ms())
            .execute(&self.writer)
            .await
            .map_err(|e| {
                if is_unique_violation(&e) {
                    LedgerError::Duplicate { what: "operator" }
                } else {
                    db(e)
                }
            })?;
        Ok(())
    }

    /// What an operator has earned, micros.
    ///
    /// # Errors
    ///
    /// [`LedgerError::UnknownOperator`].
    pub async fn operator_earned_micros(&self, operator: &OperatorId) -> Result<u64, LedgerError> {
        let v: i64 = sqlx::query_scalar("SELECT earned_micros FROM operators WHERE id = ?")
            .bind(operator.as_str())
            .fetch_optional(&self.reader)
            .await
            .map_err(db)?
            .ok_or_else(|| LedgerError::UnknownOperator(operator.clone()))?;
        to_u64(v, "earned_micros")
    }

    /// Registers a node by its public key (text form) under an operator; the node id is
    /// `node_<n>`.
    ///
    /// # Errors
    ///
    /// [`LedgerError::UnknownOperator`]; [`LedgerError::Duplicate`] when the key is registered.
    pub async fn register_node(
        &self,
        operator: &OperatorId,
        public_key_text: &str,
    ) -> Result<NodeId, LedgerError> {
        let mut tx = self.begin().await?;
        let node = insert_node(&mut tx, operator, public_key_text, None).await?;
        tx.commit().await.map_err(db)?;
        Ok(node)
    }

    /// Stores a one-time enrollment token's hash for an operator, valid until `expires_at_ms`.
    ///
    /// # Errors
    ///
    /// [`LedgerError::UnknownOperator`]; [`LedgerError::Duplicate`] when the hash exists.
    pub async fn create_enrollment(
        &self,
        operator: &OperatorId,
        token_hash: &str,
        expires_at_ms: i64,
    ) -> Result<(), LedgerError> {
        let mut tx = self.begin().await?;
        let exists: Option<i64> = sqlx::query_scalar("SELECT 1 FROM operators WHERE id = ?")
            .bind(operator.as_str())
            .fetch_optional(&mut *tx)
            .await
            .map_err(db)?;
        if exists.is_none() {
            tx.rollback().await.map_err(db)?;
            return Err(LedgerError::UnknownOperator(operator.clone()));
        }
        sqlx::query(
            "INSERT INTO enrollments (token_hash, operator_id, expires_at_ms, created_at_ms) VALUES (?, ?, ?, ?)",
        )
        .bind(token_hash)
        .bind(operator.as_str())
        .bind(expires_at_ms)
        .bind(now_ms())
        .execute(&mut *tx)
        .await
        .map_err(|e| {
            if is_unique_violation(&e) {
                LedgerError::Duplicate { what: "enrollment token" }
            } else {
                db(e)
            }
        })?;
        tx.commit().await.map_err(db)
    }

    /// Redeems an enrollment token: registers the node and marks the token used, atomically
    /// (see [`Store::redeem_enrollment`]).
    ///
    /// # Errors
    ///
    /// As [`Store::redeem_enrollment`].
    pub async fn redeem_enrollment(
        &self,
        token_hash: &str,
        public_key_text: &str,
        name: Option<&str>,
    ) -> Result<Enrollment, LedgerError> {
        let mut tx = self.begin().await?;
        let row = sqlx::query(
            "SELECT e.operator_id, e.expires_at_ms, e.node_id, n.public_key_text
             FROM enrollments e LEFT JOIN nodes n ON n.node_id = e.node_id
             WHERE e.token_hash = ?",
        )
        .bind(token_hash)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db)?;
        let Some(row) = row else {
            tx.rollback().await.map_err(db)?;
            return Err(LedgerError::UnknownEnrollment);
        };
        let operator = OperatorId::from(row.try_get::<String, _>("operator_id").map_err(db)?);
        let used_by: Option<String> = row.try_get("node_id").map_err(db)?;
        let used_key: Option<String> = row.try_get("public_key_text").map_err(db)?;
        if let Some(node) = used_by {
            tx.rollback().await.map_err(db)?;
            return if used_key.as_deref() == Some(public_key_text) {
                Ok(Enrollment {
                    node: NodeId::from(node),
                    operator,
                })
            } else {
                Err(LedgerError::EnrollmentUsed)
            };
        }
        let expires_at_ms: i64 = row.try_get("expires_at_ms").map_err(db)?;
        let now = now_ms();
        if now >= expires_at_ms {
            tx.rollback().await.map_err(db)?;
            return Err(LedgerError::EnrollmentExpired);
        }
        let node = insert_node(&mut tx, &operator, public_key_text, name).await?;
        sqlx::query("UPDATE enrollments SET node_id = ?, redeemed_at_ms = ? WHERE token_hash = ?")
            .bind(node.as_str())
            .bind(now)
            .bind(token_hash)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(Enrollment { node, operator })
    }

    /// An operator's nodes with what each served and earned (see [`Store::operator_nodes`]).
    ///
    /// # Errors
    ///
    /// [`LedgerError::UnknownOperator`].
    pub async fn operator_nodes(
        &self,
        operator: &OperatorId,
    ) -> Result<Vec<NodeRecord>, LedgerError> {
        // one read transaction: the operator check and the node rows see the same snapshot
        let mut tx = self.reader.begin().await.map_err(db)?;
        let exists: Option<i64> = sqlx::query_scalar("SELECT 1 FROM operators WHERE id = ?")
            .bind(operator.as_str())
            .fetch_optional(&mut *tx)
            .await
            .map_err(db)?;
        if exists.is_none() {
            return Err(LedgerError::UnknownOperator(operator.clone()));
        }
        let rows = sqlx::query(
            "SELECT n.node_id, n.public_key_text, n.name, n.created_at_ms,
                    COALESCE(SUM(CASE WHEN r.outcome = 'completed' THEN 1 ELSE 0 END), 0) AS served,
                    COALESCE(SUM(CASE WHEN r.earnings IS NULL OR r.earnings = 'paid' THEN r.operator_credit_micros ELSE 0 END), 0) AS earned
             FROM nodes n LEFT JOIN requests r ON r.node_id = n.node_id
             WHERE n.operator_id = ?
             GROUP BY n.node_id, n.public_key_text, n.name, n.created_at_ms
             ORDER BY n.created_at_ms, n.node_id",
        )
        .bind(operator.as_str())
        .fetch_all(&mut *tx)
        .await
        .map_err(db)?;
        tx.commit().await.map_err(db)?;
        rows.iter()
            .map(|row| {
                Ok(NodeRecord {
                    node_id: NodeId::from(row.try_get::<String, _>("node_id").map_err(db)?),
                    operator: operator.clone(),
                    public_key_text: row.try_get("public_key_text").map_err(db)?,
                    name: row.try_get("name").map_err(db)?,
                    created_at_ms: row.try_get("created_at_ms").map_err(db)?,
                    requests_served: get_u64(row, "served")?,
                    earned_micros: get_u64(row, "earned")?,
                })
            })
            .collect()
    }

    /// The node registered with this public key.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`].
    pub async fn node_for_public_key(
        &self,
        public_key_text: &str,
    ) -> Result<Option<NodeId>, LedgerError> {
        let id: Option<String> =
            sqlx::query_scalar("SELECT node_id FROM nodes WHERE public_key_text = ?")
                .bind(public_key_text)
                .fetch_optional(&self.reader)
                .await
                .map_err(db)?;
        Ok(id.map(NodeId::from))
    }

    /// The operator a node belongs to.
    ///
    /// # Errors
    ///
    /// [`LedgerError::UnknownNode`].
    pub async fn node_operator(&self, node: &NodeId) -> Result<OperatorId, LedgerError> {
        let id: String = sqlx::query_scalar("SELECT operator_id FROM nodes WHERE node_id = ?")
            .bind(node.as_str())
            .fetch_optional(&self.reader)
            .await
            .map_err(db)?
            .ok_or_else(|| LedgerError::UnknownNode(node.clone()))?;
        Ok(OperatorId::from(id))
    }

    /// Settles every hold still active as `upstream_failed` and returns how many it settled.
    ///
    /// For a gateway starting after a crash or an unclean shutdown: no request of a previous run
    /// can still be in flight, so each active hold belongs to a request whose ending was never
    /// recorded. Each is settled through [`Ledger::settle`]'s rules with outcome
    /// `upstream_failed`: the caller pays nothing, the hold is released, nobody is credited, and
    /// a request record is written with [`SweepKind::Restart`], the node and the usage the hold
    /// recorded ([`Ledger::note_hold`]; none and 0 when nothing was noted) and the hold's model
    /// (`unknown` for holds placed before schema migration 2).
    ///
    /// Call it only when no request is in flight on this store: at start-up, before serving, and
    /// only in single-instance mode (another instance's holds would be settled too).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`], [`LedgerError::Corrupt`]. Holds settled before the error stay
    /// settled; calling again settles the rest.
    pub async fn settle_stale_holds(&self) -> Result<u64, LedgerError> {
        self.sweep_holds(SweepKind::Restart).await
    }

    /// As [`SqliteLedger::settle_stale_holds`], at a clean shutdown once every request in flight
    /// has ended: the records say [`SweepKind::Shutdown`].
    ///
    /// # Errors
    ///
    /// As [`SqliteLedger::settle_stale_holds`].
    pub async fn settle_holds_at_shutdown(&self) -> Result<u64, LedgerError> {
        self.sweep_holds(SweepKind::Shutdown).await
    }

    async fn sweep_holds(&self, kind: SweepKind) -> Result<u64, LedgerError> {
        let rows = sqlx::query(
            "SELECT request_id, account_id, model, node_id, prompt_tokens, completion_tokens FROM holds WHERE state = 'held' ORDER BY created_at_ms, request_id",
        )
        .fetch_all(&self.reader)
        .await
        .map_err(db)?;
        let mut settled = 0;
        for row in rows {
            let request_id: String = row.try_get("request_id").map_err(db)?;
            let account: String = row.try_get("account_id").map_err(db)?;
            let model: Option<String> = row.try_get("model").map_err(db)?;
            let node: Option<String> = row.try_get("node_id").map_err(db)?;
            let prompt: Option<i64> = row.try_get("prompt_tokens").map_err(db)?;
            let completion: Option<i64> = row.try_get("completion_tokens").map_err(db)?;
            let result = self
                .settle_with(
                    Settlement {
                        request_id: RequestId::from(request_id),
                        account: AccountId::from(account),
                        node: node.map(NodeId::from),
                        model: ModelId::from(model.unwrap_or_else(|| "unknown".to_owned())),
                        outcome: StreamOutcome::UpstreamFailed,
                        billed: Usage {
                            prompt_tokens: to_u64(prompt.unwrap_or(0), "prompt_tokens")?,
                            completion_tokens: to_u64(
                                completion.unwrap_or(0),
                                "completion_tokens",
                            )?,
                        },
                        claimed: None,
                        usage_source: UsageSource::Independent,
                        discrepancy: false,
                        price: Price::default(),
                        share_bps: 0,
                        earnings_held: false,
                    },
                    Some(kind),
                )
                .await?;
            if !result.already_settled {
                settled += 1;
            }
        }
        Ok(settled)
    }

    async fn note_hold_impl(
        &self,
        request_id: RequestId,
        note: HoldNote,
    ) -> Result<(), LedgerError> {
        let prompt = note.known.map(|u| to_i64(u.prompt_tokens)).transpose()?;
        let completion = note
            .known
            .map(|u| to_i64(u.completion_tokens))
            .transpose()?;
        sqlx::query(
            "UPDATE holds SET node_id = COALESCE(?, node_id), prompt_tokens = COALESCE(?, prompt_tokens),
                completion_tokens = COALESCE(?, completion_tokens)
             WHERE request_id = ? AND state = 'held'",
        )
        .bind(note.node.as_ref().map(NodeId::as_str))
        .bind(prompt)
        .bind(completion)
        .bind(request_id.as_str())
        .execute(&self.writer)
        .await
        .map_err(db)?;
        Ok(())
    }

    /// Sum of all ledger entries, micros; zero unless the books are broken.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`].
    pub async fn entries_sum_micros(&self) -> Result<i64, LedgerError> {
        sqlx::query_scalar("SELECT COALESCE(SUM(amount_micros), 0) FROM ledger_entries")
            .fetch_one(&self.reader)
            .await
            .map_err(db)
    }

    /// Sums of all ledger entries by party kind.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`], [`LedgerError::Corrupt`] (an unknown party kind).
    pub async fn entry_totals(&self) -> Result<EntryTotals, LedgerError> {
        let rows = sqlx::query(
            "SELECT party_kind, COALESCE(SUM(amount_micros), 0) AS total FROM ledger_entries GROUP BY party_kind",
        )
        .fetch_all(&self.reader)
        .await
        .map_err(db)?;
        let mut totals = EntryTotals::default();
        for row in rows {
            let kind: String = row.try_get("party_kind").map_err(db)?;
            let total: i64 = row.try_get("total").map_err(db)?;
            match kind.as_str() {
                "account" => totals.accounts_micros = total,
                "operator" => totals.operators_micros = total,
                "platform" => totals.platform_micros = total,
                "external" => totals.external_micros = total,
                _ => return Err(LedgerError::Corrupt("party_kind")),
            }
        }
        Ok(totals)
    }

    async fn hold_impl(
        &self,
        request_id: RequestId,
        account: AccountId,
        model: ModelId,
        amount_micros: u64,
    ) -> Result<(), LedgerError> {
        let amount = to_i64(amount_micros)?;
        let mut tx = self.begin().await?;
        let updated = sqlx::query(
            "UPDATE accounts SET held_micros = held_micros + ?1 WHERE id = ?2 AND balance_micros - held_micros >= ?1",
        )
        .bind(amount)
        .bind(account.as_str())
        .execute(&mut *tx)
        .await
        .map_err(db)?
        .rows_affected();
        if updated == 0 {
            let row = sqlx::query("SELECT balance_micros, held_micros FROM accounts WHERE id = ?")
                .bind(account.as_str())
                .fetch_optional(&mut *tx)
                .await
                .map_err(db)?;
            tx.rollback().await.map_err(db)?;
            return match row {
                None => Err(LedgerError::UnknownAccount(account)),
                Some(row) => Err(LedgerError::InsufficientCredit {
                    available_micros: balance_from_row(&row)?.available_micros,
                    needed_micros: amount_micros,
                }),
            };
        }
        let r = sqlx::query(
            "INSERT INTO holds (request_id, account_id, model, amount_micros, state, created_at_ms) VALUES (?, ?, ?, ?, 'held', ?)",
        )
        .bind(request_id.as_str())
        .bind(account.as_str())
        .bind(model.as_str())
        .bind(amount)
        .bind(now_ms())
        .execute(&mut *tx)
        .await;
        if let Err(e) = r {
            tx.rollback().await.map_err(db)?;
            return Err(if is_unique_violation(&e) {
                LedgerError::Duplicate { what: "hold" }
            } else {
                db(e)
            });
        }
        tx.commit().await.map_err(db)
    }

    async fn release_impl(&self, request_id: RequestId) -> Result<(), LedgerError> {
        let mut tx = self.begin().await?;
        let row = sqlx::query(
            "UPDATE holds SET state = 'released' WHERE request_id = ? AND state = 'held' RETURNING account_id, amount_micros",
        )
        .bind(request_id.as_str())
        .fetch_optional(&mut *tx)
        .await
        .map_err(db)?;
        if let Some(row) = row {
            let account: String = row.try_get("account_id").map_err(db)?;
            let amount: i64 = row.try_get("amount_micros").map_err(db)?;
            sqlx::query("UPDATE accounts SET held_micros = held_micros - ? WHERE id = ?")
                .bind(amount)
                .bind(account)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
        }
        tx.commit().await.map_err(db)
    }

    async fn settle_impl(&self, s: Settlement) -> Result<SettleResult, LedgerError> {
        self.settle_with(s, None).await
    }

    async fn settle_with(
        &self,
        s: Settlement,
        swept: Option<SweepKind>,
    ) -> Result<SettleResult, LedgerError> {
        let mut tx = self.begin().await?;
        if let Some(row) = sqlx::query(
            "SELECT cost_micros, debit_micros, operator_credit_micros, fee_micros, hold_micros FROM requests WHERE request_id = ?",
        )
        .bind(s.request_id.as_str())
        .fetch_optional(&mut *tx)
        .await
        .map_err(db)?
        {
            tx.rollback().await.map_err(db)?;
            return Ok(SettleResult {
                cost_micros: get_u64(&row, "cost_micros")?,
                debit_micros: get_u64(&row, "debit_micros")?,
                operator_credit_micros: get_u64(&row, "operator_credit_micros")?,
                fee_micros: get_u64(&row, "fee_micros")?,
                hold_micros: get_u64(&row, "hold_micros")?,
                already_settled: true,
            });
        }
        let hold_row = sqlx::query(
            "UPDATE holds SET state = 'settled' WHERE request_id = ? AND state = 'held' RETURNING account_id, amount_micros",
        )
        .bind(s.request_id.as_str())
        .fetch_optional(&mut *tx)
        .await
        .map_err(db)?;
        let (hold_account, hold_micros) = match hold_row {
            Some(row) => (
                AccountId::from(row.try_get::<String, _>("account_id").map_err(db)?),
                get_u64(&row, "amount_micros")?,
            ),
            None => (s.account.clone(), 0),
        };
        let operator: Option<String> = match &s.node {
            Some(node) => sqlx::query_scalar("SELECT operator_id FROM nodes WHERE node_id = ?")
                .bind(node.as_str())
                .fetch_optional(&mut *tx)
                .await
                .map_err(db)?,
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
        sqlx::query(
            "UPDATE accounts SET balance_micros = balance_micros - ?, held_micros = held_micros - ? WHERE id = ?",
        )
        .bind(debit)
        .bind(to_i64(hold_micros)?)
        .bind(hold_account.as_str())
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        if let (Some(op), false) = (&operator, held) {
            credit_operator(&mut tx, op, credit).await?;
        }
        let opt_i64 = |v: Option<u64>| v.map(to_i64).transpose();
        sqlx::query(
            "INSERT INTO requests (request_id, account_id, model, outcome, node_id, operator_id,
                billed_prompt_tokens, billed_completion_tokens, claimed_prompt_tokens, claimed_completion_tokens,
                usage_source, discrepancy, input_micros_per_mtok, output_micros_per_mtok, share_bps,
                cost_micros, debit_micros, operator_credit_micros, fee_micros, hold_micros, created_at_ms, swept,
                earnings)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(s.request_id.as_str())
        .bind(hold_account.as_str())
        .bind(s.model.as_str())
        .bind(s.outcome.as_str())
        .bind(s.node.as_ref().map(NodeId::as_str))
        .bind(operator.as_deref())
        .bind(to_i64(s.billed.prompt_tokens)?)
        .bind(to_i64(s.billed.completion_tokens)?)
        .bind(opt_i64(s.claimed.map(|u| u.prompt_tokens))?)
        .bind(opt_i64(s.claimed.map(|u| u.completion_tokens))?)
        .bind(s.usage_source.as_str())
        .bind(s.discrepancy)
        .bind(to_i64(s.price.input_micros_per_mtok)?)
        .bind(to_i64(s.price.output_micros_per_mtok)?)
        .bind(i64::from(s.share_bps))
        .bind(to_i64(cost_micros)?)
        .bind(debit)
        .bind(credit)
        .bind(fee)
        .bind(to_i64(hold_micros)?)
        .bind(now_ms())
        .bind(swept.map(SweepKind::as_str))
        .bind(held.then_some("held"))
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        if debit > 0 {
            let reference = format!("request:{}", s.request_id);
            let mut entries = vec![("account", hold_account.as_str(), -debit)];
            let escrow = s.node.as_ref().map(super::escrow_party).unwrap_or_default();
            match &operator {
                Some(_) if held => entries.push(("platform", escrow.as_str(), credit)),
                Some(op) => entries.push(("operator", op, credit)),
                None => {}
            }
            entries.push(("platform", "platform", fee));
            insert_entries(&mut tx, &reference, &entries).await?;
        }
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

    async fn request_record_impl(
        &self,
        request_id: RequestId,
    ) -> Result<Option<RequestRecord>, LedgerError> {
        let Some(row) = sqlx::query("SELECT * FROM requests WHERE request_id = ?")
            .bind(request_id.as_str())
            .fetch_optional(&self.reader)
            .await
            .map_err(db)?
        else {
            return Ok(None);
        };
        let outcome: String = row.try_get("outcome").map_err(db)?;
        let source: String = row.try_get("usage_source").map_err(db)?;
        let claimed_p: Option<i64> = row.try_get("claimed_prompt_tokens").map_err(db)?;
        let claimed_c: Option<i64> = row.try_get("claimed_completion_tokens").map_err(db)?;
        let claimed = match (claimed_p, claimed_c) {
            (Some(p), Some(c)) => Some(Usage {
                prompt_tokens: to_u64(p, "claimed_prompt_tokens")?,
                completion_tokens: to_u64(c, "claimed_completion_tokens")?,
            }),
            _ => None,
        };
        Ok(Some(RequestRecord {
            request_id,
            account: AccountId::from(row.try_get::<String, _>("account_id").map_err(db)?),
            model: ModelId::from(row.try_get::<String, _>("model").map_err(db)?),
            outcome: StreamOutcome::parse(&outcome).ok_or(LedgerError::Corrupt("outcome"))?,
            node: row
                .try_get::<Option<String>, _>("node_id")
                .map_err(db)?
                .map(NodeId::from),
            operator: row
                .try_get::<Option<String>, _>("operator_id")
                .map_err(db)?
                .map(OperatorId::from),
            billed: Usage {
                prompt_tokens: get_u64(&row, "billed_prompt_tokens")?,
                completion_tokens: get_u64(&row, "billed_completion_tokens")?,
            },
            claimed,
            usage_source: match source.as_str() {
                "independent" => UsageSource::Independent,
                "node_claim" => UsageSource::NodeClaim,
                _ => return Err(LedgerError::Corrupt("usage_source")),
            },
            discrepancy: row.try_get::<bool, _>("discrepancy").map_err(db)?,
            cost_micros: get_u64(&row, "cost_micros")?,
            debit_micros: get_u64(&row, "debit_micros")?,
            operator_credit_micros: get_u64(&row, "operator_credit_micros")?,
            fee_micros: get_u64(&row, "fee_micros")?,
            hold_micros: get_u64(&row, "hold_micros")?,
            created_at_ms: row.try_get("created_at_ms").map_err(db)?,
            swept: match row.try_get::<Option<String>, _>("swept").map_err(db)? {
                None => None,
                Some(kind) => Some(SweepKind::parse(&kind).ok_or(LedgerError::Corrupt("swept"))?),
            },
            earnings: super::EarningsState::parse(
                row.try_get::<Option<String>, _>("earnings")
                    .map_err(db)?
                    .as_deref(),
            ),
        }))
    }

    /// See [`Store::resolve_held_earnings`].
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`], [`LedgerError::OutOfRange`].
    pub async fn resolve_held_earnings(
        &self,
        node: &NodeId,
        model: &ModelId,
        pay: bool,
    ) -> Result<super::HeldEarnings, LedgerError> {
        let mut tx = self.begin().await?;
        let rows = sqlx::query(
            "UPDATE requests SET earnings = ? WHERE node_id = ? AND model = ? AND earnings = 'held'
             RETURNING operator_id, operator_credit_micros",
        )
        .bind(if pay { "paid" } else { "forfeited" })
        .bind(node.as_str())
        .bind(model.as_str())
        .fetch_all(&mut *tx)
        .await
        .map_err(db)?;
        let mut credits = Vec::with_capacity(rows.len());
        for row in &rows {
            credits.push((
                row.try_get::<Option<String>, _>("operator_id")
                    .map_err(db)?,
                row.try_get::<i64, _>("operator_credit_micros")
                    .map_err(db)?,
            ));
        }
        let release = super::escrow_release(node, model, pay, credits);
        for (op, credit) in &release.operator_credits {
            credit_operator(&mut tx, op, *credit).await?;
        }
        if !release.entries.is_empty() {
            let entries: Vec<(&str, &str, i64)> = release
                .entries
                .iter()
                .map(|(k, id, amount)| (*k, id.as_str(), *amount))
                .collect();
            insert_entries(&mut tx, &release.reference, &entries).await?;
        }
        tx.commit().await.map_err(db)?;
        Ok(super::HeldEarnings {
            requests: rows.len() as u64,
            micros: to_u64(release.total, "operator_credit_micros")?,
        })
    }
}

/// Inserts a node of `operator` inside `tx`; the id is `node_<n>`, `n` counting registrations.
async fn insert_node(
    tx: &mut Transaction<'static, Sqlite>,
    operator: &OperatorId,
    public_key_text: &str,
    name: Option<&str>,
) -> Result<NodeId, LedgerError> {
    let exists: Option<i64> = sqlx::query_scalar("SELECT 1 FROM operators WHERE id = ?")
        .bind(operator.as_str())
        .fetch_optional(&mut **tx)
        .await
        .map_err(db)?;
    if exists.is_none() {
        return Err(LedgerError::UnknownOperator(operator.clone()));
    }
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) + 1 FROM nodes")
        .fetch_one(&mut **tx)
        .await
        .map_err(db)?;
    let node = NodeId::new(format!("node_{n}"));
    sqlx::query(
        "INSERT INTO nodes (node_id, operator_id, public_key_text, name, created_at_ms) VALUES (?, ?, ?, ?, ?)",
    )
    .bind(node.as_str())
    .bind(operator.as_str())
    .bind(public_key_text)
    .bind(name)
    .bind(now_ms())
    .execute(&mut **tx)
    .await
    .map_err(|e| {
        if is_unique_violation(&e) {
            LedgerError::Duplicate {
                what: "node public key",
            }
        } else {
            db(e)
        }
    })?;
    Ok(node)
}

fn balance_from_row(row: &SqliteRow) -> Result<AccountBalance, LedgerError> {
    let balance_micros = get_u64(row, "balance_micros")?;
    let held_micros = get_u64(row, "held_micros")?;
    Ok(AccountBalance {
        balance_micros,
        held_micros,
        available_micros: balance_micros.saturating_sub(held_micros),
    })
}

/// Inserts ledger entries `(party kind, party id, amount)` under one reference, in order, with
/// one statement (one round trip to the connection's worker thread).
async fn insert_entries(
    tx: &mut Transaction<'static, Sqlite>,
    reference: &str,
    entries: &[(&str, &str, i64)],
) -> Result<(), LedgerError> {
    let mut sql = String::from(
        "INSERT INTO ledger_entries (ref, party_kind, party_id, amount_micros, created_at_ms) VALUES ",
    );
    for i in 0..entries.len() {
        sql.push_str(if i == 0 {
            "(?, ?, ?, ?, ?)"
        } else {
            ", (?, ?, ?, ?, ?)"
        });
    }
    let now = now_ms();
    let mut q = sqlx::query(&sql);
    for &(party_kind, party_id, amount_micros) in entries {
        q = q
            .bind(reference)
            .bind(party_kind)
            .bind(party_id)
            .bind(amount_micros)
            .bind(now);
    }
    q.execute(&mut **tx).await.map_err(db)?;
    Ok(())
}

impl Ledger for SqliteLedger {
    fn hold(
        &self,
        request_id: RequestId,
        account: AccountId,
        model: ModelId,
        amount_micros: u64,
    ) -> LedgerFuture<'_, ()> {
        Box::pin(self.hold_impl(request_id, account, model, amount_micros))
    }

    fn available_micros<'a>(&'a self, account: &'a AccountId) -> LedgerFuture<'a, Option<u64>> {
        Box::pin(async move {
            match SqliteLedger::account(self, account).await {
                Ok(b) => Ok(Some(b.available_micros)),
                Err(LedgerError::UnknownAccount(_)) => Ok(None),
                Err(e) => Err(e),
            }
        })
    }

    fn release(&self, request_id: RequestId) -> LedgerFuture<'_, ()> {
        Box::pin(self.release_impl(request_id))
    }

    fn note_hold(&self, request_id: RequestId, note: HoldNote) -> LedgerFuture<'_, ()> {
        Box::pin(self.note_hold_impl(request_id, note))
    }

    fn settle(&self, settlement: Settlement) -> LedgerFuture<'_, SettleResult> {
        Box::pin(self.settle_impl(settlement))
    }

    fn request_record(&self, request_id: RequestId) -> LedgerFuture<'_, Option<RequestRecord>> {
        Box::pin(self.request_record_impl(request_id))
    }
}

impl Store for SqliteLedger {
    fn into_ledger(self: Arc<Self>) -> Arc<dyn Ledger> {
        self
    }

    fn create_account<'a>(&'a self, account: &'a AccountId) -> LedgerFuture<'a, ()> {
        Box::pin(SqliteLedger::create_account(self, account))
    }

    fn add_credits<'a>(
        &'a self,
        account: &'a AccountId,
        amount_micros: u64,
        idempotency_key: &'a str,
    ) -> LedgerFuture<'a, bool> {
        Box::pin(SqliteLedger::add_credits(
            self,
            account,
            amount_micros,
            idempotency_key,
        ))
    }

    fn create_api_key<'a>(
        &'a self,
        account: &'a AccountId,
        key_hash: &'a str,
    ) -> LedgerFuture<'a, ()> {
        Box::pin(SqliteLedger::create_api_key(self, account, key_hash))
    }

    fn account_for_key_hash<'a>(
        &'a self,
        key_hash: &'a str,
    ) -> LedgerFuture<'a, Option<AccountId>> {
        Box::pin(SqliteLedger::account_for_key_hash(self, key_hash))
    }

    fn account<'a>(&'a self, account: &'a AccountId) -> LedgerFuture<'a, AccountBalance> {
        Box::pin(SqliteLedger::account(self, account))
    }

    fn create_operator<'a>(&'a self, operator: &'a OperatorId) -> LedgerFuture<'a, ()> {
        Box::pin(SqliteLedger::create_operator(self, operator))
    }

    fn operator_earned_micros<'a>(&'a self, operator: &'a OperatorId) -> LedgerFuture<'a, u64> {
        Box::pin(SqliteLedger::operator_earned_micros(self, operator))
    }

    fn resolve_held_earnings<'a>(
        &'a self,
        node: &'a NodeId,
        model: &'a ModelId,
        pay: bool,
    ) -> LedgerFuture<'a, super::HeldEarnings> {
        Box::pin(SqliteLedger::resolve_held_earnings(self, node, model, pay))
    }

    fn register_node<'a>(
        &'a self,
        operator: &'a OperatorId,
        public_key_text: &'a str,
    ) -> LedgerFuture<'a, NodeId> {
        Box::pin(SqliteLedger::register_node(self, operator, public_key_text))
    }

    fn node_for_public_key<'a>(
        &'a self,
        public_key_text: &'a str,
    ) -> LedgerFuture<'a, Option<NodeId>> {
        Box::pin(SqliteLedger::node_for_public_key(self, public_key_text))
    }

    fn node_operator<'a>(&'a self, node: &'a NodeId) -> LedgerFuture<'a, OperatorId> {
        Box::pin(SqliteLedger::node_operator(self, node))
    }

    fn create_enrollment<'a>(
        &'a self,
        operator: &'a OperatorId,
        token_hash: &'a str,
        expires_at_ms: i64,
    ) -> LedgerFuture<'a, ()> {
        Box::pin(SqliteLedger::create_enrollment(
            self,
            operator,
            token_hash,
            expires_at_ms,
        ))
    }

    fn redeem_enrollment<'a>(
        &'a self,
        token_hash: &'a str,
        public_key_text: &'a str,
        name: Option<&'a str>,
    ) -> LedgerFuture<'a, Enrollment> {
        Box::pin(SqliteLedger::redeem_enrollment(
            self,
            token_hash,
            public_key_text,
            name,
        ))
    }

    fn operator_nodes<'a>(&'a self, operator: &'a OperatorId) -> LedgerFuture<'a, Vec<NodeRecord>> {
        Box::pin(SqliteLedger::operator_nodes(self, operator))
    }

    fn set_key_limits<'a>(&'a self, key_hash: &'a str, limits: KeyLimits) -> LedgerFuture<'a, ()> {
        Box::pin(SqliteLedger::set_key_limits(self, key_hash, limits))
    }

    fn key_limits<'a>(&'a self, key_hash: &'a str) -> LedgerFuture<'a, Option<KeyLimits>> {
        Box::pin(SqliteLedger::key_limits(self, key_hash))
    }

    fn settle_stale_holds(&self) -> LedgerFuture<'_, u64> {
        Box::pin(SqliteLedger::settle_stale_holds(self))
    }

    fn settle_holds_at_shutdown(&self) -> LedgerFuture<'_, u64> {
        Box::pin(SqliteLedger::settle_holds_at_shutdown(self))
    }

    fn entries_sum_micros(&self) -> LedgerFuture<'_, i64> {
        Box::pin(SqliteLedger::entries_sum_micros(self))
    }

    fn entry_totals(&self) -> LedgerFuture<'_, EntryTotals> {
        Box::pin(SqliteLedger::entry_totals(self))
    }
}

#[cfg(test)]
mod tests;

/// Adds `micros` to `operator`'s earnings inside `tx`.
async fn credit_operator(
    tx: &mut Transaction<'static, Sqlite>,
    operator: &str,
    micros: i64,
) -> Result<(), LedgerError> {
    sqlx::query("UPDATE operators SET earned_micros = earned_micros + ? WHERE id = ?")
        .bind(micros)
        .bind(operator)
        .execute(&mut **tx)
        .await
        .map_err(db)?;
    Ok(())
}
