//! The PostgreSQL ledger store (several gateway instances, one database): its connections, its
//! locks, how it places a hold and how it writes a settlement ([`settle`]); the
//! other statements are the shared ones ([`super::sql`]).

mod instances;
pub(in crate::ledger) mod migrations;
mod settle;

use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Transaction};

use super::convert::{db, now_ms, to_i64};
use super::sql::{self, money, unique_as, Access, Arg, Backend, HoldRequest, SqlConn as _};
use super::{LedgerError, LedgerFuture};
#[cfg(doc)]
use crate::ledger::Store;

/// PostgreSQL's own clock in Unix milliseconds: instance heartbeats are written and compared with
/// it, so clock skew between gateway machines cannot make a live instance look dead.
const DB_NOW_MS: &str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT";

/// The advisory lock key migrations run under (`pg_advisory_xact_lock`): "spine" + schema.
const MIGRATION_LOCK: i64 = 0x7370_696e_6500_0001;

/// The two-key advisory lock a settlement takes on its request id (`$1`): the first key
/// `0x7370_6e01` ("spn" + 1, settlements), the second the request id's hash.
const SETTLE_LOCK: &str = "SELECT pg_advisory_xact_lock(1936748033, hashtext($1))";

/// The ledger and gateway store on PostgreSQL, for several gateway instances sharing one database
/// (design brief §8).
///
/// The same tables, semantics and errors as [`super::SqliteLedger`] (see the module docs for how
/// concurrency is handled). Transactions run at PostgreSQL's default `READ COMMITTED`; one that
/// fails on a deadlock (`40P01`) or a serialization failure (`40001`) is run again, up to 5 times.
///
/// Waiting for a connection (see [`PgPoolConfig`]): while PostgreSQL answers and every
/// connection of a full pool is busy, a call queues for one (up to `acquire_timeout`, 30 s by
/// default: a burst on one account serializes on its row lock, and that is not an outage).
/// Otherwise the wait is bounded by `unavailable_timeout` (2 s by default) and then fails with a
/// [`LedgerError::is_unavailable`] error: when the pool is not full the wait can only be for a
/// new connection, which a reachable database makes in milliseconds, and while PostgreSQL is
/// known unreachable (an acquire failed or timed out; shared by clones, cleared by the next
/// successful acquire) every wait is short. A full pool with an idle connection while a call
/// still waits is not a queue either (that call is reconnecting).
#[derive(Clone, Debug)]
pub struct PgLedger {
    pool: PgPool,
    /// Set when an acquire failed because PostgreSQL was unreachable, cleared when a connection
    /// is acquired again; shared by clones.
    unreachable: Arc<AtomicBool>,
    /// The bound on a wait for a connection that is not queueing behind busy connections of a
    /// healthy, full pool ([`PgPoolConfig::unavailable_timeout`]).
    unavailable_timeout: Duration,
    /// The gateway instance this ledger places holds for ([`PgLedger::with_instance_id`]).
    instance_id: Option<Arc<str>>,
    /// This process's claim on `instance_id`, written with every heartbeat (random per
    /// [`PgLedger::with_instance_id`] call).
    nonce: Arc<str>,
}

/// A value no other process (here or on another machine) will pick: process id, time and the
/// standard library's randomly seeded hasher.
fn new_nonce() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    let random = h.finish();
    let mut h2 = std::collections::hash_map::RandomState::new().build_hasher();
    h2.write_u64(random);
    format!("{:x}-{random:016x}{:016x}", std::process::id(), h2.finish())
}

/// How [`PgLedger::connect_with_config`] sizes its pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PgPoolConfig {
    /// Most connections open at once. Default 10.
    pub max_connections: u32,
    /// Longest wait for a connection of a full pool whose connections are all busy while
    /// PostgreSQL answers (a burst queueing, e.g. on one account's row lock); past it the call
    /// fails with a [`LedgerError::is_unavailable`] error. Default 30 s.
    pub acquire_timeout: Duration,
    /// Longest wait for a connection otherwise: for a new connection (the pool is not full), or
    /// for any connection while PostgreSQL is known unreachable (a call failed on a
    /// connection-level error or an acquire timeout since the last successful acquire). Past it
    /// the call fails with a [`LedgerError::is_unavailable`] error, so with PostgreSQL down a
    /// request is refused (503) within this bound instead of hanging. Default 2 s; at most
    /// `acquire_timeout` takes effect.
    pub unavailable_timeout: Duration,
}

impl Default for PgPoolConfig {
    fn default() -> Self {
        Self {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(30),
            unavailable_timeout: Duration::from_secs(2),
        }
    }
}

/// How often [`PgLedger::spawn_instance_upkeep`] heartbeats and sweeps, and when an instance
/// counts as gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct InstanceUpkeep {
    /// Between heartbeats. Default 2 s.
    pub heartbeat_interval: Duration,
    /// Between sweeps of orphaned holds. Default 10 s.
    pub sweep_interval: Duration,
    /// An instance whose last heartbeat is older than this is gone and its holds are settled
    /// `upstream_failed`. Default 60 s; keep it far above `heartbeat_interval` and above the
    /// longest PostgreSQL outage an instance should survive with its holds intact.
    pub stale_after: Duration,
    /// An `instances` row heartbeat more recently than this by another process means that
    /// process is alive under the same id: [`PgLedger::claim_instance`] and
    /// [`PgLedger::heartbeat_within`] refuse to take the id over. Default 6 s (3 heartbeat
    /// intervals); a restart under the same id waits up to this long at start.
    pub live_within: Duration,
}

impl Default for InstanceUpkeep {
    fn default() -> Self {
        Self {
            heartbeat_interval: Duration::from_secs(2),
            sweep_interval: Duration::from_secs(10),
            stale_after: Duration::from_secs(60),
            live_within: Duration::from_secs(6),
        }
    }
}

impl PgPoolConfig {
    /// Sets [`PgPoolConfig::acquire_timeout`].
    #[must_use]
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Sets [`PgPoolConfig::unavailable_timeout`].
    #[must_use]
    pub fn unavailable_timeout(mut self, timeout: Duration) -> Self {
        self.unavailable_timeout = timeout;
        self
    }

    /// Sets [`PgPoolConfig::max_connections`].
    #[must_use]
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }
}

/// A deadlock or a serialization failure: the transaction was rolled back and may be run again.
fn is_retryable(e: &LedgerError) -> bool {
    match e {
        LedgerError::Database(sqlx::Error::Database(d)) => {
            matches!(d.code().as_deref(), Some("40P01" | "40001"))
        }
        _ => false,
    }
}

impl PgLedger {
    /// Connects to the database at `url` (`postgres://user:password@host:port/database`; a pool
    /// of up to 10 connections: [`PgPoolConfig::default`]) and applies migrations.
    ///
    /// Any number of processes may connect to the same (even empty) database at once: migrations
    /// run under a PostgreSQL advisory lock, the first applies them, the others wait and find
    /// them applied.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`] when the URL does not parse, the database cannot be reached or
    /// the migrations fail.
    pub async fn connect(url: &str) -> Result<Self, LedgerError> {
        let options = PgConnectOptions::from_str(url).map_err(db)?;
        Self::connect_with(options).await
    }

    /// [`PgLedger::connect`] with parsed options.
    ///
    /// # Errors
    ///
    /// As [`PgLedger::connect`].
    pub async fn connect_with(options: PgConnectOptions) -> Result<Self, LedgerError> {
        Self::connect_with_config(options, PgPoolConfig::default()).await
    }

    /// [`PgLedger::connect`] with parsed options and a pool configuration (e.g. a shorter or
    /// longer acquire timeout).
    ///
    /// The first connection is made by the migrations, so an unreachable database fails the
    /// call within `config.unavailable_timeout`.
    ///
    /// # Errors
    ///
    /// As [`PgLedger::connect`].
    pub async fn connect_with_config(
        options: PgConnectOptions,
        config: PgPoolConfig,
    ) -> Result<Self, LedgerError> {
        let pool = PgPoolOptions::new()
            .max_connections(config.max_connections)
            .acquire_timeout(config.acquire_timeout)
            .connect_lazy_with(options);
        Self::with_pool_and_timeout(pool, config.unavailable_timeout).await
    }

    /// Wraps an existing pool and applies migrations (idempotent; safe for any number of
    /// processes at once). Waits for a connection as described on [`PgLedger`], with the
    /// default [`PgPoolConfig::unavailable_timeout`] (2 s) and the pool's own acquire timeout.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`].
    pub async fn with_pool(pool: PgPool) -> Result<Self, LedgerError> {
        Self::with_pool_and_timeout(pool, PgPoolConfig::default().unavailable_timeout).await
    }

    async fn with_pool_and_timeout(
        pool: PgPool,
        unavailable_timeout: Duration,
    ) -> Result<Self, LedgerError> {
        let this = Self {
            pool,
            unreachable: Arc::new(AtomicBool::new(false)),
            unavailable_timeout,
            instance_id: None,
            nonce: Arc::from(new_nonce()),
        };
        this.migrate().await?;
        Ok(this)
    }

    /// This ledger as gateway instance `instance_id` (several instances, one database): every
    /// hold it places records the id; [`Store::settle_stale_holds`] then settles only this
    /// instance's holds (its leftovers from a previous run under the same id), and
    /// [`PgLedger::settle_orphaned_holds`] those of instances that stopped heartbeating.
    ///
    /// Ids must be unique among live processes. Call [`PgLedger::claim_instance`] once before
    /// serving (it refuses an id another live process heartbeats) and then heartbeat
    /// periodically ([`PgLedger::spawn_instance_upkeep`]): a hold whose instance has no recent
    /// heartbeat is fair game for another instance's sweep.
    #[must_use]
    pub fn with_instance_id(mut self, instance_id: impl Into<String>) -> Self {
        self.instance_id = Some(Arc::from(instance_id.into()));
        self.nonce = Arc::from(new_nonce());
        self
    }

    /// The instance id holds are recorded under, if one was set.
    pub fn instance_id(&self) -> Option<&str> {
        self.instance_id.as_deref()
    }

    /// The underlying pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Boxed so that `open`/`connect` futures are `Send` for any caller (spawnable): sqlx's
    /// executor impls otherwise trip rustc's higher-ranked `Send` inference.
    fn migrate(&self) -> LedgerFuture<'_, ()> {
        Box::pin(self.migrate_impl())
    }

    async fn migrate_impl(&self) -> Result<(), LedgerError> {
        let lock = format!("SELECT pg_advisory_xact_lock({MIGRATION_LOCK})");
        sql::migrate(
            self,
            Some(&lock),
            "CREATE TABLE IF NOT EXISTS spine_schema_migrations (version BIGINT PRIMARY KEY, applied_at_ms BIGINT NOT NULL)",
            &migrations::migrations(),
        )
        .await
    }

    /// Waits for `connecting` (a pool acquire, with or without `BEGIN`): past
    /// `unavailable_timeout`, and again every `unavailable_timeout`, it goes on waiting only
    /// while PostgreSQL is not known unreachable and the pool is full (every connection is
    /// busy: the wait is a queue, bounded by the pool's acquire timeout); otherwise it fails
    /// with [`sqlx::Error::PoolTimedOut`] ([`LedgerError::is_unavailable`]). Records the outcome
    /// in the health latch: an unavailable error sets it, success clears it.
    async fn connection<T>(
        &self,
        connecting: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, LedgerError> {
        let mut connecting = std::pin::pin!(connecting);
        let slice = self.unavailable_timeout.max(Duration::from_millis(10));
        let result = loop {
            match tokio::time::timeout(slice, &mut connecting).await {
                Ok(r) => break r.map_err(db),
                Err(_) => {
                    // queueing behind busy connections: PostgreSQL healthy, the pool full and
                    // none of it idle (an idle connection while we still wait means our acquire
                    // is reconnecting: a full pool of dead connections after an outage began)
                    let queueing = !self.unreachable.load(Ordering::Relaxed)
                        && self.pool.size() >= self.pool.options().get_max_connections()
                        && self.pool.num_idle() == 0;
                    if !queueing {
                        break Err(db(sqlx::Error::PoolTimedOut));
                    }
                }
            }
        };
        self.watch(result)
    }

    /// Updates the health latch from a call's outcome: set on an unavailable error, cleared on
    /// success.
    fn watch<T>(&self, result: Result<T, LedgerError>) -> Result<T, LedgerError> {
        match &result {
            Ok(_) => self.unreachable.store(false, Ordering::Relaxed),
            Err(e) if e.is_unavailable() => {
                if !self.unreachable.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "PostgreSQL unreachable: waits for a connection are now short");
                }
            }
            Err(_) => {}
        }
        result
    }

    /// A pooled connection, waited for as [`PgLedger::connection`] says. Every statement of
    /// this store runs on one of these or in [`PgLedger::begin_tx`]'s transaction.
    async fn acquire(&self) -> Result<PoolConnection<Postgres>, LedgerError> {
        self.connection(self.pool.acquire()).await
    }

    /// A transaction on a pooled connection, waited for as [`PgLedger::connection`] says.
    async fn begin_tx(&self) -> Result<Transaction<'static, Postgres>, LedgerError> {
        self.connection(self.pool.begin()).await
    }
}

sql::sql_conn!(Postgres, sqlx::PgConnection, sqlx::postgres::PgRow);
sql::sql_store!(PgLedger);
sql::console::sql_console!(PgLedger);

impl Backend for PgLedger {
    type Conn = PoolConnection<Postgres>;
    type Tx = Transaction<'static, Postgres>;

    const ATTEMPTS: u32 = 5;
    const FOR_UPDATE: &'static str = " FOR UPDATE";
    const SETTLE_LOCK: Option<&'static str> = Some(SETTLE_LOCK);
    const NODES_LOCK: Option<&'static str> = Some("LOCK TABLE nodes IN SHARE ROW EXCLUSIVE MODE");
    const SHARED: bool = true;

    fn is_retryable(e: &LedgerError) -> bool {
        is_retryable(e)
    }

    fn instance_id(&self) -> Option<&str> {
        self.instance_id.as_deref()
    }

    /// One pool for reads and writes alike.
    fn conn(
        &self,
        _: Access,
    ) -> impl Future<Output = Result<PoolConnection<Postgres>, LedgerError>> + Send {
        self.acquire()
    }

    fn begin(
        &self,
    ) -> impl Future<Output = Result<Transaction<'static, Postgres>, LedgerError>> + Send {
        self.begin_tx()
    }

    fn hold_once<'a>(
        &'a self,
        hold: HoldRequest<'a>,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send + 'a {
        self.hold_fast(hold)
    }

    fn settle_writes<'a>(
        tx: &'a mut Self::Tx,
        writes: money::SettlementWrites<'a>,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send + 'a {
        settle::settle_writes(tx, writes)
    }
}

impl PgLedger {
    /// Places a hold with one statement when the account can cover it: the conditional `UPDATE`
    /// locks the account row and re-checks `balance − held` on its latest version, and the hold
    /// row is inserted in the same statement, so the row lock is held from that statement to the
    /// commit (two round trips) instead of across a five-round-trip transaction (holds of one
    /// account serialize across instances). It runs in a transaction all the same, so a caller
    /// that goes away while it waits on the lock leaves nothing behind (rolled back). When
    /// nothing was placed (unknown account, or not enough credit) the decision is made again by
    /// [`PgLedger::hold_locked`], so a refusal still reports the exact numbers it was refused on.
    async fn hold_fast(&self, hold: HoldRequest<'_>) -> Result<(), LedgerError> {
        let amount = to_i64(hold.amount_micros)?;
        // in a transaction, not as a self-committing statement: a caller that goes away (or a
        // connection lost) while the statement waits on the row lock must leave nothing held;
        // a dropped transaction is rolled back, a lone statement would commit a hold nobody owns
        let mut tx = self.begin_tx().await?;
        let placed = tx
            .exec(
                "WITH held AS (
                     UPDATE accounts SET held_micros = held_micros + $1
                     WHERE id = $2 AND balance_micros - held_micros >= $1
                     RETURNING id)
                 INSERT INTO holds (request_id, account_id, model, amount_micros, state, created_at_ms, instance_id)
                 SELECT $3, id, $4, $1, 'held', $5, $6 FROM held",
                &[
                    Arg::I64(amount),
                    Arg::Text(hold.account.as_str()),
                    Arg::Text(hold.request_id),
                    Arg::Text(hold.model),
                    Arg::I64(now_ms()),
                    Arg::OptText(self.instance_id.as_deref()),
                ],
            )
            .await
            .map_err(|e| unique_as(e, "hold"))?;
        if placed == 1 {
            return tx.commit().await.map_err(db);
        }
        tx.rollback().await.map_err(db)?;
        self.hold_locked(hold).await
    }

    /// Places a hold in a transaction that locks the account row before it decides: the
    /// decision and the numbers a refusal reports are those of one moment.
    async fn hold_locked(&self, hold: HoldRequest<'_>) -> Result<(), LedgerError> {
        let amount = to_i64(hold.amount_micros)?;
        let mut tx = self.begin_tx().await?;
        // the account row stays locked until commit: the decision and the numbers a refusal
        // reports are those of one moment, and no concurrent hold can take the same credit
        let row = tx
            .optional(
                &format!("{} FOR NO KEY UPDATE", sql::accounts::ACCOUNT_BALANCE),
                &[Arg::Text(hold.account.as_str())],
            )
            .await?;
        let covered = match &row {
            Some(row) => {
                sql::accounts::balance_from_row(row)?.available_micros >= hold.amount_micros
            }
            None => false,
        };
        if !covered {
            tx.rollback().await.map_err(db)?;
            return Err(money::hold_refusal(row, hold));
        }
        tx.exec(
            "UPDATE accounts SET held_micros = held_micros + $1 WHERE id = $2",
            &[Arg::I64(amount), Arg::Text(hold.account.as_str())],
        )
        .await?;
        let inserted = money::insert_hold(&mut tx, hold, self.instance_id.as_deref()).await;
        sql::finish::<Self>(tx, inserted.is_ok()).await?;
        inserted
    }
}
