//! The PostgreSQL ledger store (several gateway instances, one database).

use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{Postgres, Row, Transaction};

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

/// Schema migrations, applied in order, each once (recorded in `spine_schema_migrations`), all in
/// one transaction under [`MIGRATION_LOCK`].
///
/// Version 1 is SQLite's versions 1 and 2 together (PostgreSQL support started there).
const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        r#"
CREATE TABLE accounts (
    id TEXT PRIMARY KEY,
    balance_micros BIGINT NOT NULL DEFAULT 0 CHECK (balance_micros >= 0),
    held_micros BIGINT NOT NULL DEFAULT 0 CHECK (held_micros >= 0),
    created_at_ms BIGINT NOT NULL,
    CHECK (held_micros <= balance_micros)
);
CREATE TABLE api_keys (
    key_hash TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts(id),
    created_at_ms BIGINT NOT NULL
);
CREATE TABLE credits (
    idempotency_key TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts(id),
    amount_micros BIGINT NOT NULL CHECK (amount_micros >= 0),
    created_at_ms BIGINT NOT NULL
);
CREATE TABLE operators (
    id TEXT PRIMARY KEY,
    earned_micros BIGINT NOT NULL DEFAULT 0 CHECK (earned_micros >= 0),
    created_at_ms BIGINT NOT NULL
);
CREATE TABLE nodes (
    node_id TEXT PRIMARY KEY,
    operator_id TEXT NOT NULL REFERENCES operators(id),
    public_key_text TEXT NOT NULL UNIQUE,
    created_at_ms BIGINT NOT NULL
);
CREATE TABLE holds (
    request_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts(id),
    model TEXT,
    amount_micros BIGINT NOT NULL CHECK (amount_micros >= 0),
    state TEXT NOT NULL CHECK (state IN ('held', 'released', 'settled')),
    created_at_ms BIGINT NOT NULL
);
CREATE INDEX holds_held ON holds(created_at_ms, request_id) WHERE state = 'held';
CREATE TABLE requests (
    request_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    model TEXT NOT NULL,
    outcome TEXT NOT NULL,
    node_id TEXT,
    operator_id TEXT,
    billed_prompt_tokens BIGINT NOT NULL,
    billed_completion_tokens BIGINT NOT NULL,
    claimed_prompt_tokens BIGINT,
    claimed_completion_tokens BIGINT,
    usage_source TEXT NOT NULL,
    discrepancy BOOLEAN NOT NULL,
    input_micros_per_mtok BIGINT NOT NULL,
    output_micros_per_mtok BIGINT NOT NULL,
    share_bps BIGINT NOT NULL,
    cost_micros BIGINT NOT NULL,
    debit_micros BIGINT NOT NULL,
    operator_credit_micros BIGINT NOT NULL,
    fee_micros BIGINT NOT NULL,
    hold_micros BIGINT NOT NULL,
    created_at_ms BIGINT NOT NULL
);
CREATE TABLE ledger_entries (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    ref TEXT NOT NULL,
    party_kind TEXT NOT NULL CHECK (party_kind IN ('account', 'operator', 'platform', 'external')),
    party_id TEXT NOT NULL,
    amount_micros BIGINT NOT NULL,
    created_at_ms BIGINT NOT NULL
);
CREATE INDEX ledger_entries_ref ON ledger_entries(ref);
"#,
    ),
    (
        2,
        // SQLite's version 3: one-time enrollment tokens (hash only), node names, and the
        // per-node request counts the operator view reads
        r#"
ALTER TABLE nodes ADD COLUMN name TEXT;
CREATE TABLE enrollments (
    token_hash TEXT PRIMARY KEY,
    operator_id TEXT NOT NULL REFERENCES operators(id),
    expires_at_ms BIGINT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    node_id TEXT REFERENCES nodes(node_id),
    redeemed_at_ms BIGINT
);
CREATE INDEX requests_node ON requests(node_id);
"#,
    ),
    (
        3,
        // several instances (design brief §8): the instance that placed each hold and the
        // instances' heartbeats, so a stale-hold sweep never touches a live instance's request;
        // per-key rate limits shared by every instance (SQLite's version 4)
        r#"
ALTER TABLE holds ADD COLUMN instance_id TEXT;
CREATE INDEX holds_instance ON holds(instance_id) WHERE state = 'held';
CREATE TABLE instances (
    instance_id TEXT PRIMARY KEY,
    started_at_ms BIGINT NOT NULL,
    heartbeat_at_ms BIGINT NOT NULL
);
CREATE TABLE key_limits (
    key_hash TEXT PRIMARY KEY,
    rpm_limit BIGINT CHECK (rpm_limit >= 0),
    tpm_limit BIGINT CHECK (tpm_limit >= 0),
    updated_at_ms BIGINT NOT NULL
);
"#,
    ),
    (
        4,
        // which process holds an instance id: two live processes under one id are refused
        r#"
ALTER TABLE instances ADD COLUMN nonce TEXT;
"#,
    ),
    (
        5,
        // what is known of a request in flight, on its hold (`Ledger::note_hold`), so a sweep's
        // record keeps the node and the usage; which sweep settled a request (SQLite's 5)
        r#"
ALTER TABLE holds ADD COLUMN node_id TEXT;
ALTER TABLE holds ADD COLUMN prompt_tokens BIGINT;
ALTER TABLE holds ADD COLUMN completion_tokens BIGINT;
ALTER TABLE requests ADD COLUMN swept TEXT;
"#,
    ),
    (
        6,
        // operator credits held in escrow while a node's model audit is suspect (design brief
        // §10): NULL = paid, 'held', 'forfeited' (SQLite's 6)
        r#"
ALTER TABLE requests ADD COLUMN earnings TEXT;
CREATE INDEX requests_held_earnings ON requests(node_id, model) WHERE earnings = 'held';
"#,
    ),
];

/// PostgreSQL's own clock in Unix milliseconds: instance heartbeats are written and compared with
/// it, so clock skew between gateway machines cannot make a live instance look dead.
const DB_NOW_MS: &str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT";

/// The advisory lock key migrations run under (`pg_advisory_xact_lock`): "spine" + schema.
const MIGRATION_LOCK: i64 = 0x7370_696e_6500_0001;

/// The first key of the two-key advisory lock a settlement takes on its request id
/// (`pg_advisory_xact_lock(SETTLE_LOCK_CLASS, hashtext(request_id))`).
const SETTLE_LOCK_CLASS: i32 = 0x7370_6e01;

/// How many times a transaction that failed on a deadlock or a serialization failure is run.
const ATTEMPTS: u32 = 5;

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

fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.is_unique_violation())
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

fn get_u64(row: &PgRow, col: &'static str) -> Result<u64, LedgerError> {
    to_u64(row.try_get::<i64, _>(col).map_err(db)?, col)
}

fn balance_from_row(row: &PgRow) -> Result<AccountBalance, LedgerError> {
    let balance_micros = get_u64(row, "balance_micros")?;
    let held_micros = get_u64(row, "held_micros")?;
    Ok(AccountBalance {
        balance_micros,
        held_micros,
        available_micros: balance_micros.saturating_sub(held_micros),
    })
}

async fn insert_entry(
    tx: &mut Transaction<'static, Postgres>,
    reference: &str,
    party_kind: &str,
    party_id: &str,
    amount_micros: i64,
) -> Result<(), LedgerError> {
    sqlx::query(
        "INSERT INTO ledger_entries (ref, party_kind, party_id, amount_micros, created_at_ms) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(reference)
    .bind(party_kind)
    .bind(party_id)
    .bind(amount_micros)
    .bind(now_ms())
    .execute(&mut **tx)
    .await
    .map_err(db)?;
    Ok(())
}

/// Inserts a node of `operator` inside `tx`, under the node table lock (node ids count
/// registrations: one registration at a time; reads are not blocked).
async fn insert_node(
    tx: &mut Transaction<'static, Postgres>,
    operator: &OperatorId,
    public_key_text: &str,
    name: Option<&str>,
) -> Result<NodeId, LedgerError> {
    sqlx::query("LOCK TABLE nodes IN SHARE ROW EXCLUSIVE MODE")
        .execute(&mut **tx)
        .await
        .map_err(db)?;
    let exists: Option<i64> = sqlx::query_scalar("SELECT 1::BIGINT FROM operators WHERE id = $1")
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
        "INSERT INTO nodes (node_id, operator_id, public_key_text, name, created_at_ms) VALUES ($1, $2, $3, $4, $5)",
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

/// The body of [`PgLedger::redeem_enrollment_once`]: the enrollment row is locked
/// (`FOR UPDATE`), so two redemptions of one token queue and the second sees the first. Returns
/// the enrollment and whether anything was written (to commit).
async fn redeem_in(
    tx: &mut Transaction<'static, Postgres>,
    token_hash: &str,
    public_key_text: &str,
    name: Option<&str>,
) -> Result<(Enrollment, bool), LedgerError> {
    let row = sqlx::query(
        "SELECT operator_id, expires_at_ms, node_id FROM enrollments WHERE token_hash = $1 FOR UPDATE",
    )
    .bind(token_hash)
    .fetch_optional(&mut **tx)
    .await
    .map_err(db)?
    .ok_or(LedgerError::UnknownEnrollment)?;
    let operator = OperatorId::from(row.try_get::<String, _>("operator_id").map_err(db)?);
    if let Some(node) = row.try_get::<Option<String>, _>("node_id").map_err(db)? {
        let key: Option<String> =
            sqlx::query_scalar("SELECT public_key_text FROM nodes WHERE node_id = $1")
                .bind(node.as_str())
                .fetch_optional(&mut **tx)
                .await
                .map_err(db)?;
        return if key.as_deref() == Some(public_key_text) {
            Ok((
                Enrollment {
                    node: NodeId::from(node),
                    operator,
                },
                false,
            ))
        } else {
            Err(LedgerError::EnrollmentUsed)
        };
    }
    let expires_at_ms: i64 = row.try_get("expires_at_ms").map_err(db)?;
    let now = now_ms();
    if now >= expires_at_ms {
        return Err(LedgerError::EnrollmentExpired);
    }
    let node = insert_node(tx, &operator, public_key_text, name).await?;
    sqlx::query("UPDATE enrollments SET node_id = $1, redeemed_at_ms = $2 WHERE token_hash = $3")
        .bind(node.as_str())
        .bind(now)
        .bind(token_hash)
        .execute(&mut **tx)
        .await
        .map_err(db)?;
    Ok((Enrollment { node, operator }, true))
}

/// Runs `$body` (an expression evaluating to a `Result`) again while it fails on a deadlock or a
/// serialization failure, up to [`ATTEMPTS`] times.
macro_rules! retrying {
    ($body:expr) => {{
        let mut attempt = 1;
        loop {
            match $body {
                Err(e) if attempt < ATTEMPTS && is_retryable(&e) => {
                    tracing::debug!(attempt, error = %e, "ledger transaction retried");
                    attempt += 1;
                }
                r => break r,
            }
        }
    }};
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

    /// Records that this instance is alive now (PostgreSQL's clock) in the `instances` table,
    /// under this process's nonce; [`PgLedger::heartbeat_within`] with the default 6 s bound.
    /// Does nothing without an instance id.
    ///
    /// # Errors
    ///
    /// [`LedgerError::InstanceIdLive`] when another process heartbeat the same id within 6 s;
    /// [`LedgerError::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe (one statement, then a read).
    pub async fn heartbeat(&self) -> Result<(), LedgerError> {
        self.heartbeat_within(InstanceUpkeep::default().live_within)
            .await
    }

    /// Records that this instance is alive now, unless another process (another nonce) holds
    /// the id: its heartbeat is less than `live_within` old. Then nothing is written and
    /// [`LedgerError::InstanceIdLive`] is returned. A row with an older heartbeat (a crashed or
    /// stopped process) is taken over. Does nothing without an instance id.
    ///
    /// # Errors
    ///
    /// [`LedgerError::InstanceIdLive`], [`LedgerError::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe (one statement, then a read).
    pub async fn heartbeat_within(&self, live_within: Duration) -> Result<(), LedgerError> {
        let Some(id) = &self.instance_id else {
            return Ok(());
        };
        let live_ms = i64::try_from(live_within.as_millis()).unwrap_or(i64::MAX);
        let sql = format!(
            "INSERT INTO instances (instance_id, started_at_ms, heartbeat_at_ms, nonce) VALUES ($1, {DB_NOW_MS}, {DB_NOW_MS}, $2)
             ON CONFLICT (instance_id) DO UPDATE SET
                 heartbeat_at_ms = EXCLUDED.heartbeat_at_ms,
                 nonce = EXCLUDED.nonce,
                 started_at_ms = CASE WHEN instances.nonce IS NOT DISTINCT FROM EXCLUDED.nonce
                                      THEN instances.started_at_ms ELSE EXCLUDED.started_at_ms END
             WHERE instances.nonce IS NOT DISTINCT FROM EXCLUDED.nonce
                OR instances.heartbeat_at_ms < EXCLUDED.heartbeat_at_ms - $3
             RETURNING 1"
        );
        let written: Option<i32> = sqlx::query_scalar(&sql)
            .bind(id.as_ref())
            .bind(self.nonce.as_ref())
            .bind(live_ms)
            .fetch_optional(&mut *self.acquire().await?)
            .await
            .map_err(db)?;
        if written.is_some() {
            return Ok(());
        }
        let age: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT {DB_NOW_MS} - heartbeat_at_ms FROM instances WHERE instance_id = $1"
        ))
        .bind(id.as_ref())
        .fetch_optional(&mut *self.acquire().await?)
        .await
        .map_err(db)?;
        Err(LedgerError::InstanceIdLive {
            instance_id: id.to_string(),
            heartbeat_age_ms: age.unwrap_or(0),
        })
    }

    /// Takes this instance's id at start: [`PgLedger::heartbeat_within`]`(live_within)`, tried
    /// again every 500 ms while another process holds the id, for up to `live_within` + 1 s (so
    /// a restart under the same id waits for the previous process's last heartbeat to age past
    /// the bound). Call it before [`Store::settle_stale_holds`]: that settles every hold under
    /// this id, which is only right once no other live process uses it.
    ///
    /// # Errors
    ///
    /// [`LedgerError::InstanceIdLive`] when the id is still live after the wait (two
    /// processes configured with one `instance_id`), [`LedgerError::Database`].
    pub async fn claim_instance(&self, live_within: Duration) -> Result<(), LedgerError> {
        let deadline = tokio::time::Instant::now() + live_within + Duration::from_secs(1);
        loop {
            match self.heartbeat_within(live_within).await {
                Err(LedgerError::InstanceIdLive { .. })
                    if tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                other => return other,
            }
        }
    }

    /// Settles, as `upstream_failed`, every active hold placed by another instance whose last
    /// heartbeat is older than `stale_after` (or that never heartbeat), or placed by no recorded
    /// instance at all (a gateway of a release before instance ids) more than `stale_after` ago,
    /// and returns how many it settled. A live
    /// instance's holds (heartbeat within `stale_after`, PostgreSQL's clock) and this
    /// instance's own are never touched. Each hold is settled exactly once however many
    /// instances sweep at the same time (settlement is idempotent by request id), and a late
    /// settlement by the hold's own instance then finds it settled and changes nothing.
    ///
    /// `stale_after` must be well above the heartbeat interval (e.g. 60 s against 2 s).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`], [`LedgerError::Corrupt`]; holds settled before the error stay
    /// settled.
    pub async fn settle_orphaned_holds(&self, stale_after: Duration) -> Result<u64, LedgerError> {
        let stale_ms = i64::try_from(stale_after.as_millis()).unwrap_or(i64::MAX);
        // a hold without an instance id was placed by a gateway of a release before instance
        // ids, which may still be serving it (rolling upgrade): swept only once it is older
        // than `stale_after` (its creation time, the placing gateway's clock)
        let sql = format!(
            "SELECT request_id, account_id, model, node_id, prompt_tokens, completion_tokens FROM holds h
             WHERE state = 'held'
               AND h.instance_id IS DISTINCT FROM $1
               AND CASE WHEN h.instance_id IS NULL
                        THEN h.created_at_ms < {DB_NOW_MS} - $2
                        ELSE NOT EXISTS (
                            SELECT 1 FROM instances i
                            WHERE i.instance_id = h.instance_id
                              AND i.heartbeat_at_ms >= {DB_NOW_MS} - $2)
                   END
             ORDER BY created_at_ms, request_id"
        );
        let rows = sqlx::query(&sql)
            .bind(self.instance_id.as_deref())
            .bind(stale_ms)
            .fetch_all(&mut *self.acquire().await?)
            .await
            .map_err(db)?;
        self.settle_hold_rows(rows, SweepKind::Orphan).await
    }

    /// Keeps this instance's heartbeat and sweeps orphaned holds until `shutdown` is cancelled:
    /// a heartbeat now and every `config.heartbeat_interval`, and
    /// [`PgLedger::settle_orphaned_holds`]`(config.stale_after)` every `config.sweep_interval`.
    /// Failures are logged and retried at the next tick (PostgreSQL may be down for a while).
    pub fn spawn_instance_upkeep(
        self: Arc<Self>,
        config: InstanceUpkeep,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut heartbeat = tokio::time::interval(config.heartbeat_interval);
            heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut sweep = tokio::time::interval(config.sweep_interval);
            sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = heartbeat.tick() => {
                        if let Err(e) = self.heartbeat_within(config.live_within).await {
                            tracing::warn!(error = %e, "instance heartbeat to PostgreSQL failed");
                        }
                    }
                    _ = sweep.tick() => {
                        match self.settle_orphaned_holds(config.stale_after).await {
                            Ok(0) => {}
                            Ok(n) => tracing::warn!(
                                settled = n,
                                "settled holds of instances that stopped heartbeating as upstream_failed"
                            ),
                            Err(e) => tracing::warn!(error = %e, "orphaned hold sweep failed"),
                        }
                    }
                }
            }
        })
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
        let mut tx = self.begin().await?;
        // held until commit or rollback, also when this future is dropped (the connection's
        // transaction is rolled back before it is reused)
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATION_LOCK)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS spine_schema_migrations (version BIGINT PRIMARY KEY, applied_at_ms BIGINT NOT NULL)",
        )
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        for &(version, sql) in MIGRATIONS {
            let applied: Option<i64> = sqlx::query_scalar(
                "SELECT version FROM spine_schema_migrations WHERE version = $1",
            )
            .bind(version)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db)?;
            if applied.is_none() {
                sqlx::Executor::execute(&mut *tx, sql).await.map_err(db)?;
                sqlx::query(
                    "INSERT INTO spine_schema_migrations (version, applied_at_ms) VALUES ($1, $2)",
                )
                .bind(version)
                .bind(now_ms())
                .execute(&mut *tx)
                .await
                .map_err(db)?;
                tracing::info!(version, "applied ledger schema migration");
            }
        }
        tx.commit().await.map_err(db)
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
    /// this store runs on one of these or in [`PgLedger::begin`]'s transaction.
    async fn acquire(&self) -> Result<PoolConnection<Postgres>, LedgerError> {
        self.connection(self.pool.acquire()).await
    }

    /// A transaction on a pooled connection, waited for as [`PgLedger::connection`] says.
    async fn begin(&self) -> Result<Transaction<'static, Postgres>, LedgerError> {
        self.connection(self.pool.begin()).await
    }

    async fn create_account_impl(&self, account: &AccountId) -> Result<(), LedgerError> {
        sqlx::query("INSERT INTO accounts (id, created_at_ms) VALUES ($1, $2)")
            .bind(account.as_str())
            .bind(now_ms())
            .execute(&mut *self.acquire().await?)
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

    async fn add_credits_once(
        &self,
        account: &AccountId,
        amount_micros: u64,
        idempotency_key: &str,
    ) -> Result<bool, LedgerError> {
        let amount = to_i64(amount_micros)?;
        let mut tx = self.begin().await?;
        // a concurrent credit with the same key makes this wait for it, then do nothing
        let inserted = sqlx::query(
            "INSERT INTO credits (idempotency_key, account_id, amount_micros, created_at_ms)
             SELECT $1, id, $2, $3 FROM accounts WHERE id = $4
             ON CONFLICT (idempotency_key) DO NOTHING",
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
                "SELECT account_id, amount_micros FROM credits WHERE idempotency_key = $1",
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
            "UPDATE accounts SET balance_micros = balance_micros + $1 WHERE id = $2 AND balance_micros <= 9223372036854775807 - $1",
        )
        .bind(amount)
        .bind(account.as_str())
        .execute(&mut *tx)
        .await
        .map_err(db)?
        .rows_affected();
        if updated == 0 {
            tx.rollback().await.map_err(db)?;
            return Err(LedgerError::OutOfRange);
        }
        let reference = format!("credit:{idempotency_key}");
        insert_entry(&mut tx, &reference, "account", account.as_str(), amount).await?;
        insert_entry(&mut tx, &reference, "external", "deposits", -amount).await?;
        tx.commit().await.map_err(db)?;
        Ok(true)
    }

    async fn create_api_key_impl(
        &self,
        account: &AccountId,
        key_hash: &str,
    ) -> Result<(), LedgerError> {
        let r = sqlx::query(
            "INSERT INTO api_keys (key_hash, account_id, created_at_ms) SELECT $1, id, $2 FROM accounts WHERE id = $3",
        )
        .bind(key_hash)
        .bind(now_ms())
        .bind(account.as_str())
        .execute(&mut *self.acquire().await?)
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

    async fn account_for_key_hash_impl(
        &self,
        key_hash: &str,
    ) -> Result<Option<AccountId>, LedgerError> {
        let id: Option<String> =
            sqlx::query_scalar("SELECT account_id FROM api_keys WHERE key_hash = $1")
                .bind(key_hash)
                .fetch_optional(&mut *self.acquire().await?)
                .await
                .map_err(db)?;
        Ok(id.map(AccountId::from))
    }

    async fn account_impl(&self, account: &AccountId) -> Result<AccountBalance, LedgerError> {
        let row = sqlx::query("SELECT balance_micros, held_micros FROM accounts WHERE id = $1")
            .bind(account.as_str())
            .fetch_optional(&mut *self.acquire().await?)
            .await
            .map_err(db)?
            .ok_or_else(|| LedgerError::UnknownAccount(account.clone()))?;
        balance_from_row(&row)
    }

    async fn create_operator_impl(&self, operator: &OperatorId) -> Result<(), LedgerError> {
        sqlx::query("INSERT INTO operators (id, created_at_ms) VALUES ($1, $2)")
            .bind(operator.as_str())
            .bind(now_ms())
            .execute(&mut *self.acquire().await?)
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

    async fn operator_earned_micros_impl(&self, operator: &OperatorId) -> Result<u64, LedgerError> {
        let v: i64 = sqlx::query_scalar("SELECT earned_micros FROM operators WHERE id = $1")
            .bind(operator.as_str())
            .fetch_optional(&mut *self.acquire().await?)
            .await
            .map_err(db)?
            .ok_or_else(|| LedgerError::UnknownOperator(operator.clone()))?;
        to_u64(v, "earned_micros")
    }

    async fn register_node_once(
        &self,
        operator: &OperatorId,
        public_key_text: &str,
    ) -> Result<NodeId, LedgerError> {
        let mut tx = self.begin().await?;
        match insert_node(&mut tx, operator, public_key_text, None).await {
            Ok(node) => {
                tx.commit().await.map_err(db)?;
                Ok(node)
            }
            Err(e) => {
                tx.rollback().await.map_err(db)?;
                Err(e)
            }
        }
    }

    async fn create_enrollment_impl(
        &self,
        operator: &OperatorId,
        token_hash: &str,
        expires_at_ms: i64,
    ) -> Result<(), LedgerError> {
        let r = sqlx::query(
            "INSERT INTO enrollments (token_hash, operator_id, expires_at_ms, created_at_ms)
             SELECT $1, id, $3, $4 FROM operators WHERE id = $2",
        )
        .bind(token_hash)
        .bind(operator.as_str())
        .bind(expires_at_ms)
        .bind(now_ms())
        .execute(&mut *self.acquire().await?)
        .await
        .map_err(|e| {
            if is_unique_violation(&e) {
                LedgerError::Duplicate {
                    what: "enrollment token",
                }
            } else {
                db(e)
            }
        })?;
        if r.rows_affected() == 0 {
            return Err(LedgerError::UnknownOperator(operator.clone()));
        }
        Ok(())
    }

    async fn redeem_enrollment_once(
        &self,
        token_hash: &str,
        public_key_text: &str,
        name: Option<&str>,
    ) -> Result<Enrollment, LedgerError> {
        let mut tx = self.begin().await?;
        let result = redeem_in(&mut tx, token_hash, public_key_text, name).await;
        match result {
            Ok((enrollment, true)) => {
                tx.commit().await.map_err(db)?;
                Ok(enrollment)
            }
            Ok((enrollment, false)) => {
                tx.rollback().await.map_err(db)?;
                Ok(enrollment)
            }
            Err(e) => {
                tx.rollback().await.map_err(db)?;
                Err(e)
            }
        }
    }

    async fn operator_nodes_impl(
        &self,
        operator: &OperatorId,
    ) -> Result<Vec<NodeRecord>, LedgerError> {
        // one statement, one snapshot: the operator row and its nodes
        let rows = sqlx::query(
            "SELECT o.id AS operator_id, n.node_id, n.public_key_text, n.name, n.created_at_ms,
                    (SELECT COUNT(*) FROM requests r
                      WHERE r.node_id = n.node_id AND r.outcome = 'completed') AS served,
                    (SELECT COALESCE(SUM(r.operator_credit_micros), 0)::BIGINT FROM requests r
                      WHERE r.node_id = n.node_id
                        AND (r.earnings IS NULL OR r.earnings = 'paid')) AS earned
             FROM operators o LEFT JOIN nodes n ON n.operator_id = o.id
             WHERE o.id = $1
             ORDER BY n.created_at_ms, n.node_id",
        )
        .bind(operator.as_str())
        .fetch_all(&mut *self.acquire().await?)
        .await
        .map_err(db)?;
        if rows.is_empty() {
            return Err(LedgerError::UnknownOperator(operator.clone()));
        }
        let mut nodes = Vec::with_capacity(rows.len());
        for row in &rows {
            let Some(node_id) = row.try_get::<Option<String>, _>("node_id").map_err(db)? else {
                continue; // the operator has no node: one row of NULLs
            };
            nodes.push(NodeRecord {
                node_id: NodeId::from(node_id),
                operator: operator.clone(),
                public_key_text: row.try_get("public_key_text").map_err(db)?,
                name: row.try_get("name").map_err(db)?,
                created_at_ms: row.try_get("created_at_ms").map_err(db)?,
                requests_served: get_u64(row, "served")?,
                earned_micros: get_u64(row, "earned")?,
            });
        }
        Ok(nodes)
    }

    async fn node_for_public_key_impl(
        &self,
        public_key_text: &str,
    ) -> Result<Option<NodeId>, LedgerError> {
        let id: Option<String> =
            sqlx::query_scalar("SELECT node_id FROM nodes WHERE public_key_text = $1")
                .bind(public_key_text)
                .fetch_optional(&mut *self.acquire().await?)
                .await
                .map_err(db)?;
        Ok(id.map(NodeId::from))
    }

    async fn node_operator_impl(&self, node: &NodeId) -> Result<OperatorId, LedgerError> {
        let id: String = sqlx::query_scalar("SELECT operator_id FROM nodes WHERE node_id = $1")
            .bind(node.as_str())
            .fetch_optional(&mut *self.acquire().await?)
            .await
            .map_err(db)?
            .ok_or_else(|| LedgerError::UnknownNode(node.clone()))?;
        Ok(OperatorId::from(id))
    }

    async fn settle_stale_holds_impl(&self, kind: SweepKind) -> Result<u64, LedgerError> {
        const COLUMNS: &str =
            "request_id, account_id, model, node_id, prompt_tokens, completion_tokens";
        let rows = match &self.instance_id {
            Some(id) => sqlx::query(&format!(
                "SELECT {COLUMNS} FROM holds WHERE state = 'held' AND instance_id = $1 ORDER BY created_at_ms, request_id"
            ))
            .bind(id.as_ref())
            .fetch_all(&mut *self.acquire().await?)
            .await
            .map_err(db)?,
            // without an instance id this process cannot tell its holds from other instances':
            // at shutdown it settles nothing
            None if kind == SweepKind::Shutdown => return Ok(0),
            None => sqlx::query(&format!(
                "SELECT {COLUMNS} FROM holds WHERE state = 'held' ORDER BY created_at_ms, request_id"
            ))
            .fetch_all(&mut *self.acquire().await?)
            .await
            .map_err(db)?,
        };
        self.settle_hold_rows(rows, kind).await
    }

    /// Settles each hold row (`request_id, account_id, model, node_id, prompt_tokens,
    /// completion_tokens`) as `upstream_failed`, recorded as swept by `kind` with the node and
    /// usage the hold noted; returns how many this call settled (not those settled meanwhile by
    /// someone else).
    async fn settle_hold_rows(
        &self,
        rows: Vec<PgRow>,
        kind: SweepKind,
    ) -> Result<u64, LedgerError> {
        let mut settled = 0;
        for row in rows {
            let request_id: String = row.try_get("request_id").map_err(db)?;
            let account: String = row.try_get("account_id").map_err(db)?;
            let model: Option<String> = row.try_get("model").map_err(db)?;
            let node: Option<String> = row.try_get("node_id").map_err(db)?;
            let prompt: Option<i64> = row.try_get("prompt_tokens").map_err(db)?;
            let completion: Option<i64> = row.try_get("completion_tokens").map_err(db)?;
            let settlement = Settlement {
                request_id: RequestId::from(request_id),
                account: AccountId::from(account),
                node: node.map(NodeId::from),
                model: ModelId::from(model.unwrap_or_else(|| "unknown".to_owned())),
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
            };
            let result = retrying!(self.settle_once(&settlement, Some(kind)).await)?;
            if !result.already_settled {
                settled += 1;
            }
        }
        Ok(settled)
    }

    async fn note_hold_once(
        &self,
        request_id: &RequestId,
        note: &HoldNote,
    ) -> Result<(), LedgerError> {
        let prompt = note.known.map(|u| to_i64(u.prompt_tokens)).transpose()?;
        let completion = note
            .known
            .map(|u| to_i64(u.completion_tokens))
            .transpose()?;
        sqlx::query(
            "UPDATE holds SET node_id = COALESCE($1, node_id), prompt_tokens = COALESCE($2, prompt_tokens),
                completion_tokens = COALESCE($3, completion_tokens)
             WHERE request_id = $4 AND state = 'held'",
        )
        .bind(note.node.as_ref().map(NodeId::as_str))
        .bind(prompt)
        .bind(completion)
        .bind(request_id.as_str())
        .execute(&mut *self.acquire().await?)
        .await
        .map_err(db)?;
        Ok(())
    }

    async fn set_key_limits_impl(
        &self,
        key_hash: &str,
        limits: KeyLimits,
    ) -> Result<(), LedgerError> {
        sqlx::query(
            "INSERT INTO key_limits (key_hash, rpm_limit, tpm_limit, updated_at_ms) VALUES ($1, $2, $3, $4)
             ON CONFLICT (key_hash) DO UPDATE SET rpm_limit = EXCLUDED.rpm_limit, tpm_limit = EXCLUDED.tpm_limit, updated_at_ms = EXCLUDED.updated_at_ms",
        )
        .bind(key_hash)
        .bind(limits.rpm_limit.map(i64::from))
        .bind(limits.tpm_limit.map(to_i64).transpose()?)
        .bind(now_ms())
        .execute(&mut *self.acquire().await?)
        .await
        .map_err(db)?;
        Ok(())
    }

    async fn key_limits_impl(&self, key_hash: &str) -> Result<Option<KeyLimits>, LedgerError> {
        let Some(row) =
            sqlx::query("SELECT rpm_limit, tpm_limit FROM key_limits WHERE key_hash = $1")
                .bind(key_hash)
                .fetch_optional(&mut *self.acquire().await?)
                .await
                .map_err(db)?
        else {
            return Ok(None);
        };
        let rpm: Option<i64> = row.try_get("rpm_limit").map_err(db)?;
        let tpm: Option<i64> = row.try_get("tpm_limit").map_err(db)?;
        super::convert::key_limits(rpm, tpm).map(Some)
    }

    async fn entries_sum_micros_impl(&self) -> Result<i64, LedgerError> {
        sqlx::query_scalar("SELECT COALESCE(SUM(amount_micros), 0)::BIGINT FROM ledger_entries")
            .fetch_one(&mut *self.acquire().await?)
            .await
            .map_err(db)
    }

    async fn entry_totals_impl(&self) -> Result<EntryTotals, LedgerError> {
        let rows = sqlx::query(
            "SELECT party_kind, COALESCE(SUM(amount_micros), 0)::BIGINT AS total FROM ledger_entries GROUP BY party_kind",
        )
        .fetch_all(&mut *self.acquire().await?)
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

    /// Places a hold with one statement when the account can cover it: the conditional `UPDATE`
    /// locks the account row and re-checks `balance − held` on its latest version, and the hold
    /// row is inserted in the same statement, so the row lock is held from that statement to the
    /// commit (two round trips) instead of across a five-round-trip transaction (holds of one
    /// account serialize across instances). It runs in a transaction all the same, so a caller
    /// that goes away while it waits on the lock leaves nothing behind (rolled back). When
    /// nothing was placed (unknown account, or not enough credit) the decision is made again by
    /// [`PgLedger::hold_locked`], so a refusal still reports the exact numbers it was refused on.
    async fn hold_once(
        &self,
        request_id: &RequestId,
        account: &AccountId,
        model: &ModelId,
        amount_micros: u64,
    ) -> Result<(), LedgerError> {
        let amount = to_i64(amount_micros)?;
        // in a transaction, not as a self-committing statement: a caller that goes away (or a
        // connection lost) while the statement waits on the row lock must leave nothing held;
        // a dropped transaction is rolled back, a lone statement would commit a hold nobody owns
        let mut tx = self.begin().await?;
        let placed = sqlx::query(
            "WITH held AS (
                 UPDATE accounts SET held_micros = held_micros + $1
                 WHERE id = $2 AND balance_micros - held_micros >= $1
                 RETURNING id)
             INSERT INTO holds (request_id, account_id, model, amount_micros, state, created_at_ms, instance_id)
             SELECT $3, id, $4, $1, 'held', $5, $6 FROM held",
        )
        .bind(amount)
        .bind(account.as_str())
        .bind(request_id.as_str())
        .bind(model.as_str())
        .bind(now_ms())
        .bind(self.instance_id.as_deref())
        .execute(&mut *tx)
        .await
        .map_err(|e| {
            if is_unique_violation(&e) {
                LedgerError::Duplicate { what: "hold" }
            } else {
                db(e)
            }
        })?
        .rows_affected();
        if placed == 1 {
            return tx.commit().await.map_err(db);
        }
        tx.rollback().await.map_err(db)?;
        self.hold_locked(request_id, account, model, amount_micros)
            .await
    }

    /// Places a hold in a transaction that locks the account row before it decides: the
    /// decision and the numbers a refusal reports are those of one moment.
    async fn hold_locked(
        &self,
        request_id: &RequestId,
        account: &AccountId,
        model: &ModelId,
        amount_micros: u64,
    ) -> Result<(), LedgerError> {
        let amount = to_i64(amount_micros)?;
        let mut tx = self.begin().await?;
        // the account row stays locked until commit: the decision and the numbers a refusal
        // reports are those of one moment, and no concurrent hold can take the same credit
        let row = sqlx::query(
            "SELECT balance_micros, held_micros FROM accounts WHERE id = $1 FOR NO KEY UPDATE",
        )
        .bind(account.as_str())
        .fetch_optional(&mut *tx)
        .await
        .map_err(db)?;
        let Some(row) = row else {
            tx.rollback().await.map_err(db)?;
            return Err(LedgerError::UnknownAccount(account.clone()));
        };
        let available_micros = balance_from_row(&row)?.available_micros;
        if available_micros < amount_micros {
            tx.rollback().await.map_err(db)?;
            return Err(LedgerError::InsufficientCredit {
                available_micros,
                needed_micros: amount_micros,
            });
        }
        sqlx::query("UPDATE accounts SET held_micros = held_micros + $1 WHERE id = $2")
            .bind(amount)
            .bind(account.as_str())
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        let r = sqlx::query(
            "INSERT INTO holds (request_id, account_id, model, amount_micros, state, created_at_ms, instance_id) VALUES ($1, $2, $3, $4, 'held', $5, $6)",
        )
        .bind(request_id.as_str())
        .bind(account.as_str())
        .bind(model.as_str())
        .bind(amount)
        .bind(now_ms())
        .bind(self.instance_id.as_deref())
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

    async fn release_once(&self, request_id: &RequestId) -> Result<(), LedgerError> {
        let mut tx = self.begin().await?;
        let row = sqlx::query(
            "UPDATE holds SET state = 'released' WHERE request_id = $1 AND state = 'held' RETURNING account_id, amount_micros",
        )
        .bind(request_id.as_str())
        .fetch_optional(&mut *tx)
        .await
        .map_err(db)?;
        if let Some(row) = row {
            let account: String = row.try_get("account_id").map_err(db)?;
            let amount: i64 = row.try_get("amount_micros").map_err(db)?;
            sqlx::query("UPDATE accounts SET held_micros = held_micros - $1 WHERE id = $2")
                .bind(amount)
                .bind(account)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
        }
        tx.commit().await.map_err(db)
    }

    async fn settle_impl(&self, s: Settlement) -> Result<SettleResult, LedgerError> {
        retrying!(self.settle_once(&s, None).await)
    }

    async fn settle_once(
        &self,
        s: &Settlement,
        swept: Option<SweepKind>,
    ) -> Result<SettleResult, LedgerError> {
        let mut tx = self.begin().await?;
        // one settlement of a request at a time; the next one waits here, then its reads see the
        // first one's record (READ COMMITTED takes a new snapshot per statement)
        sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
            .bind(SETTLE_LOCK_CLASS)
            .bind(s.request_id.as_str())
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        if let Some(row) = sqlx::query(
            "SELECT cost_micros, debit_micros, operator_credit_micros, fee_micros, hold_micros FROM requests WHERE request_id = $1",
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
            "UPDATE holds SET state = 'settled' WHERE request_id = $1 AND state = 'held' RETURNING account_id, amount_micros",
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
            Some(node) => sqlx::query_scalar("SELECT operator_id FROM nodes WHERE node_id = $1")
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
            "UPDATE accounts SET balance_micros = balance_micros - $1, held_micros = held_micros - $2 WHERE id = $3",
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
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23)",
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
            insert_entry(
                &mut tx,
                &reference,
                "account",
                hold_account.as_str(),
                -debit,
            )
            .await?;
            match (&operator, &s.node) {
                (Some(_), Some(node)) if held => {
                    let escrow = super::escrow_party(node);
                    insert_entry(&mut tx, &reference, "platform", &escrow, credit).await?;
                }
                (Some(op), _) => {
                    insert_entry(&mut tx, &reference, "operator", op, credit).await?;
                }
                (None, _) => {}
            }
            insert_entry(&mut tx, &reference, "platform", "platform", fee).await?;
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
        let Some(row) = sqlx::query("SELECT * FROM requests WHERE request_id = $1")
            .bind(request_id.as_str())
            .fetch_optional(&mut *self.acquire().await?)
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

    async fn resolve_held_earnings_once(
        &self,
        node: &NodeId,
        model: &ModelId,
        pay: bool,
    ) -> Result<super::HeldEarnings, LedgerError> {
        let mut tx = self.begin().await?;
        let rows = sqlx::query(
            "UPDATE requests SET earnings = $1 WHERE node_id = $2 AND model = $3 AND earnings = 'held'
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
        for (kind, id, amount) in &release.entries {
            insert_entry(&mut tx, &release.reference, kind, id, *amount).await?;
        }
        tx.commit().await.map_err(db)?;
        Ok(super::HeldEarnings {
            requests: rows.len() as u64,
            micros: to_u64(release.total, "operator_credit_micros")?,
        })
    }
}

impl Ledger for PgLedger {
    fn hold(
        &self,
        request_id: RequestId,
        account: AccountId,
        model: ModelId,
        amount_micros: u64,
    ) -> LedgerFuture<'_, ()> {
        Box::pin(async move {
            retrying!(
                self.hold_once(&request_id, &account, &model, amount_micros)
                    .await
            )
        })
    }

    fn available_micros<'a>(&'a self, account: &'a AccountId) -> LedgerFuture<'a, Option<u64>> {
        Box::pin(async move {
            match Store::account(self, account).await {
                Ok(b) => Ok(Some(b.available_micros)),
                Err(LedgerError::UnknownAccount(_)) => Ok(None),
                Err(e) => Err(e),
            }
        })
    }

    fn release(&self, request_id: RequestId) -> LedgerFuture<'_, ()> {
        Box::pin(async move { retrying!(self.release_once(&request_id).await) })
    }

    fn note_hold(&self, request_id: RequestId, note: HoldNote) -> LedgerFuture<'_, ()> {
        Box::pin(async move { retrying!(self.note_hold_once(&request_id, &note).await) })
    }

    fn settle(&self, settlement: Settlement) -> LedgerFuture<'_, SettleResult> {
        Box::pin(self.settle_impl(settlement))
    }

    fn request_record(&self, request_id: RequestId) -> LedgerFuture<'_, Option<RequestRecord>> {
        Box::pin(self.request_record_impl(request_id))
    }
}

impl Store for PgLedger {
    fn into_ledger(self: Arc<Self>) -> Arc<dyn Ledger> {
        self
    }

    fn create_account<'a>(&'a self, account: &'a AccountId) -> LedgerFuture<'a, ()> {
        Box::pin(self.create_account_impl(account))
    }

    fn add_credits<'a>(
        &'a self,
        account: &'a AccountId,
        amount_micros: u64,
        idempotency_key: &'a str,
    ) -> LedgerFuture<'a, bool> {
        Box::pin(async move {
            retrying!(
                self.add_credits_once(account, amount_micros, idempotency_key)
                    .await
            )
        })
    }

    fn create_api_key<'a>(
        &'a self,
        account: &'a AccountId,
        key_hash: &'a str,
    ) -> LedgerFuture<'a, ()> {
        Box::pin(self.create_api_key_impl(account, key_hash))
    }

    fn account_for_key_hash<'a>(
        &'a self,
        key_hash: &'a str,
    ) -> LedgerFuture<'a, Option<AccountId>> {
        Box::pin(self.account_for_key_hash_impl(key_hash))
    }

    fn account<'a>(&'a self, account: &'a AccountId) -> LedgerFuture<'a, AccountBalance> {
        Box::pin(self.account_impl(account))
    }

    fn create_operator<'a>(&'a self, operator: &'a OperatorId) -> LedgerFuture<'a, ()> {
        Box::pin(self.create_operator_impl(operator))
    }

    fn operator_earned_micros<'a>(&'a self, operator: &'a OperatorId) -> LedgerFuture<'a, u64> {
        Box::pin(self.operator_earned_micros_impl(operator))
    }

    fn resolve_held_earnings<'a>(
        &'a self,
        node: &'a NodeId,
        model: &'a ModelId,
        pay: bool,
    ) -> LedgerFuture<'a, super::HeldEarnings> {
        Box::pin(async move { retrying!(self.resolve_held_earnings_once(node, model, pay).await) })
    }

    fn register_node<'a>(
        &'a self,
        operator: &'a OperatorId,
        public_key_text: &'a str,
    ) -> LedgerFuture<'a, NodeId> {
        Box::pin(async move { retrying!(self.register_node_once(operator, public_key_text).await) })
    }

    fn node_for_public_key<'a>(
        &'a self,
        public_key_text: &'a str,
    ) -> LedgerFuture<'a, Option<NodeId>> {
        Box::pin(self.node_for_public_key_impl(public_key_text))
    }

    fn node_operator<'a>(&'a self, node: &'a NodeId) -> LedgerFuture<'a, OperatorId> {
        Box::pin(self.node_operator_impl(node))
    }

    fn create_enrollment<'a>(
        &'a self,
        operator: &'a OperatorId,
        token_hash: &'a str,
        expires_at_ms: i64,
    ) -> LedgerFuture<'a, ()> {
        Box::pin(self.create_enrollment_impl(operator, token_hash, expires_at_ms))
    }

    fn redeem_enrollment<'a>(
        &'a self,
        token_hash: &'a str,
        public_key_text: &'a str,
        name: Option<&'a str>,
    ) -> LedgerFuture<'a, Enrollment> {
        Box::pin(async move {
            retrying!(
                self.redeem_enrollment_once(token_hash, public_key_text, name)
                    .await
            )
        })
    }

    fn operator_nodes<'a>(&'a self, operator: &'a OperatorId) -> LedgerFuture<'a, Vec<NodeRecord>> {
        Box::pin(self.operator_nodes_impl(operator))
    }

    fn set_key_limits<'a>(&'a self, key_hash: &'a str, limits: KeyLimits) -> LedgerFuture<'a, ()> {
        Box::pin(self.set_key_limits_impl(key_hash, limits))
    }

    fn key_limits<'a>(&'a self, key_hash: &'a str) -> LedgerFuture<'a, Option<KeyLimits>> {
        Box::pin(self.key_limits_impl(key_hash))
    }

    fn settle_stale_holds(&self) -> LedgerFuture<'_, u64> {
        Box::pin(self.settle_stale_holds_impl(SweepKind::Restart))
    }

    fn settle_holds_at_shutdown(&self) -> LedgerFuture<'_, u64> {
        Box::pin(self.settle_stale_holds_impl(SweepKind::Shutdown))
    }

    fn entries_sum_micros(&self) -> LedgerFuture<'_, i64> {
        Box::pin(self.entries_sum_micros_impl())
    }

    fn entry_totals(&self) -> LedgerFuture<'_, EntryTotals> {
        Box::pin(self.entry_totals_impl())
    }
}

/// Adds `micros` to `operator`'s earnings inside `tx`.
async fn credit_operator(
    tx: &mut Transaction<'static, Postgres>,
    operator: &str,
    micros: i64,
) -> Result<(), LedgerError> {
    sqlx::query("UPDATE operators SET earned_micros = earned_micros + $1 WHERE id = $2")
        .bind(micros)
        .bind(operator)
        .execute(&mut **tx)
        .await
        .map_err(db)?;
    Ok(())
}
