//! The SQL both stores run, written once (design brief §6): every statement uses `$n`
//! placeholders, which PostgreSQL and SQLite both accept (sqlx's SQLite driver binds `$NNN` by
//! its number, as `?NNN`), and every value is one of a few column types ([`Arg`], [`SqlRow`]).
//!
//! What truly differs between the stores is a [`Backend`]: where a connection or a transaction
//! comes from (SQLite: one writer and a reader pool; PostgreSQL: a pool watched for outages),
//! whether a transaction that failed on a deadlock is run again, the locks PostgreSQL needs
//! because several instances write at once (`FOR UPDATE`, advisory and table locks; SQLite's
//! `BEGIN IMMEDIATE` already makes writers take turns), how a hold is placed, and the schema's
//! integer types (each store keeps its own migrations).
//!
//! The protocol itself is in three rooms: [`money`] (holds, settlement, sweeps, credits, ledger
//! entries), [`accounts`] (accounts, API keys, key limits) and [`nodes`] (operators, nodes,
//! enrollment tokens). [`sql_store!`] implements [`Ledger`](super::Ledger) and
//! [`Store`](super::Store) for a backend from them.

pub(super) mod accounts;
pub(super) mod console;
pub(super) mod money;
pub(super) mod nodes;
pub(super) mod schema;

use std::future::Future;

use super::convert::{db, now_ms, to_u64};
use super::{LedgerError, LedgerFuture};

/// A value bound to a statement's `$n` placeholder (`$1` is the first).
#[derive(Clone, Copy, Debug)]
pub(super) enum Arg<'a> {
    /// `BIGINT` / `INTEGER`.
    I64(i64),
    /// `BIGINT` / `INTEGER` or `NULL`.
    OptI64(Option<i64>),
    /// `TEXT`.
    Text(&'a str),
    /// `TEXT` or `NULL`.
    OptText(Option<&'a str>),
    /// `BOOLEAN` (SQLite: `INTEGER` 0 or 1).
    Bool(bool),
}

/// Refuses a statement whose text arguments hold a NUL character
/// ([`LedgerError::InvalidText`]): PostgreSQL refuses them with an error that would otherwise
/// read as the database failing (a 503 the caller is told to retry), and SQLite would keep what
/// PostgreSQL cannot; a caller's text (an e-mail address, a URL's id, a filter) may hold one.
pub(super) fn storable(args: &[Arg<'_>]) -> Result<(), LedgerError> {
    let nul = args.iter().any(|a| match a {
        Arg::Text(t) | Arg::OptText(Some(t)) => t.contains('\0'),
        _ => false,
    });
    if nul {
        return Err(LedgerError::InvalidText);
    }
    Ok(())
}

/// Appends `new` to a statement's `args` and returns their placeholders (`"$n"`, numbered on
/// from the arguments already there), for a statement whose text is built as it goes.
pub(super) fn bind<'a, const N: usize>(args: &mut Vec<Arg<'a>>, new: [Arg<'a>; N]) -> [String; N] {
    let first = args.len() + 1;
    args.extend(new);
    std::array::from_fn(|i| format!("${}", first + i))
}

/// A row read back: its columns by name.
pub(super) trait SqlRow: Send + Sync + 'static {
    /// An integer column.
    fn i64(&self, col: &str) -> Result<i64, LedgerError>;
    /// An integer column that may be `NULL`.
    fn opt_i64(&self, col: &str) -> Result<Option<i64>, LedgerError>;
    /// A text column.
    fn text(&self, col: &str) -> Result<String, LedgerError>;
    /// A text column that may be `NULL`.
    fn opt_text(&self, col: &str) -> Result<Option<String>, LedgerError>;
    /// A boolean column.
    fn bool(&self, col: &str) -> Result<bool, LedgerError>;

    /// An amount or count column: a negative value is a corrupt row.
    fn u64(&self, col: &'static str) -> Result<u64, LedgerError> {
        to_u64(self.i64(col)?, col)
    }
}

/// One connection of a store (also inside a transaction): runs a statement with its arguments.
pub(super) trait SqlConn: Send {
    /// The rows it returns.
    type Row: SqlRow;

    /// Runs `sql`; returns how many rows it changed.
    fn exec<'a>(&'a mut self, sql: &'a str, args: &'a [Arg<'a>]) -> LedgerFuture<'a, u64>;

    /// Runs `sql`; returns its first row, if any.
    fn optional<'a>(
        &'a mut self,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> LedgerFuture<'a, Option<Self::Row>>;

    /// Runs `sql`; returns all its rows.
    fn all<'a>(&'a mut self, sql: &'a str, args: &'a [Arg<'a>])
        -> LedgerFuture<'a, Vec<Self::Row>>;

    /// Runs `sql`, any number of statements without arguments (a schema migration).
    fn batch<'a>(&'a mut self, sql: &'a str) -> LedgerFuture<'a, ()>;
}

/// Implements [`SqlConn`] for a sqlx connection type and [`SqlRow`] for its row type, and
/// [`SqlConn`] (by delegation) and [`TxEnd`] for its pooled connection and its transaction.
macro_rules! sql_conn {
    ($db:ty, $conn:ty, $row:ty) => {
        fn bind_args<'q>(
            mut q: sqlx::query::Query<'q, $db, <$db as sqlx::Database>::Arguments<'q>>,
            args: &'q [$crate::ledger::sql::Arg<'q>],
        ) -> sqlx::query::Query<'q, $db, <$db as sqlx::Database>::Arguments<'q>> {
            use $crate::ledger::sql::Arg;
            for arg in args {
                q = match *arg {
                    Arg::I64(v) => q.bind(v),
                    Arg::OptI64(v) => q.bind(v),
                    Arg::Text(v) => q.bind(v),
                    Arg::OptText(v) => q.bind(v),
                    Arg::Bool(v) => q.bind(v),
                };
            }
            q
        }

        impl $crate::ledger::sql::SqlConn for $conn {
            type Row = $row;

            fn exec<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::ledger::sql::Arg<'a>],
            ) -> $crate::ledger::LedgerFuture<'a, u64> {
                Box::pin(async move {
                    $crate::ledger::sql::storable(args)?;
                    let done = bind_args(sqlx::query(sql), args)
                        .execute(self)
                        .await
                        .map_err($crate::ledger::LedgerError::Database)?;
                    Ok(done.rows_affected())
                })
            }

            fn optional<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::ledger::sql::Arg<'a>],
            ) -> $crate::ledger::LedgerFuture<'a, Option<$row>> {
                Box::pin(async move {
                    $crate::ledger::sql::storable(args)?;
                    bind_args(sqlx::query(sql), args)
                        .fetch_optional(self)
                        .await
                        .map_err($crate::ledger::LedgerError::Database)
                })
            }

            fn all<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::ledger::sql::Arg<'a>],
            ) -> $crate::ledger::LedgerFuture<'a, Vec<$row>> {
                Box::pin(async move {
                    $crate::ledger::sql::storable(args)?;
                    bind_args(sqlx::query(sql), args)
                        .fetch_all(self)
                        .await
                        .map_err($crate::ledger::LedgerError::Database)
                })
            }

            fn batch<'a>(&'a mut self, sql: &'a str) -> $crate::ledger::LedgerFuture<'a, ()> {
                Box::pin(async move {
                    sqlx::Executor::execute(self, sql)
                        .await
                        .map_err($crate::ledger::LedgerError::Database)?;
                    Ok(())
                })
            }
        }

        $crate::ledger::sql::sql_conn_deref!(sqlx::pool::PoolConnection<$db>, $row);
        $crate::ledger::sql::sql_conn_deref!(sqlx::Transaction<'static, $db>, $row);

        impl $crate::ledger::sql::TxEnd for sqlx::Transaction<'static, $db> {
            async fn commit(self) -> Result<(), sqlx::Error> {
                sqlx::Transaction::commit(self).await
            }

            async fn rollback(self) -> Result<(), sqlx::Error> {
                sqlx::Transaction::rollback(self).await
            }
        }

        impl $crate::ledger::sql::SqlRow for $row {
            fn i64(&self, col: &str) -> Result<i64, $crate::ledger::LedgerError> {
                sqlx::Row::try_get(self, col).map_err($crate::ledger::LedgerError::Database)
            }
            fn opt_i64(&self, col: &str) -> Result<Option<i64>, $crate::ledger::LedgerError> {
                sqlx::Row::try_get(self, col).map_err($crate::ledger::LedgerError::Database)
            }
            fn text(&self, col: &str) -> Result<String, $crate::ledger::LedgerError> {
                sqlx::Row::try_get(self, col).map_err($crate::ledger::LedgerError::Database)
            }
            fn opt_text(&self, col: &str) -> Result<Option<String>, $crate::ledger::LedgerError> {
                sqlx::Row::try_get(self, col).map_err($crate::ledger::LedgerError::Database)
            }
            fn bool(&self, col: &str) -> Result<bool, $crate::ledger::LedgerError> {
                sqlx::Row::try_get(self, col).map_err($crate::ledger::LedgerError::Database)
            }
        }
    };
}
pub(super) use sql_conn;

/// Implements [`SqlConn`] for `$outer`, which dereferences to a connection that implements it
/// with rows `$row` (a pooled connection, a transaction).
macro_rules! sql_conn_deref {
    ($outer:ty, $row:ty) => {
        impl $crate::ledger::sql::SqlConn for $outer {
            type Row = $row;

            fn exec<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::ledger::sql::Arg<'a>],
            ) -> $crate::ledger::LedgerFuture<'a, u64> {
                (**self).exec(sql, args)
            }

            fn optional<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::ledger::sql::Arg<'a>],
            ) -> $crate::ledger::LedgerFuture<'a, Option<$row>> {
                (**self).optional(sql, args)
            }

            fn all<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [$crate::ledger::sql::Arg<'a>],
            ) -> $crate::ledger::LedgerFuture<'a, Vec<$row>> {
                (**self).all(sql, args)
            }

            fn batch<'a>(&'a mut self, sql: &'a str) -> $crate::ledger::LedgerFuture<'a, ()> {
                (**self).batch(sql)
            }
        }
    };
}
pub(super) use sql_conn_deref;

/// The end of a write transaction ([`Backend::Tx`]): dropped without either, it is rolled back.
pub(super) trait TxEnd: Send {
    /// Commits the transaction.
    fn commit(self) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Rolls the transaction back.
    fn rollback(self) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

/// A hold to place ([`Ledger::hold`](super::Ledger::hold)): `amount_micros` on `account` for
/// `request_id`, a request for `model`.
#[derive(Clone, Copy, Debug)]
pub(super) struct HoldRequest<'a> {
    /// The request.
    pub(super) request_id: &'a str,
    /// The caller's account.
    pub(super) account: &'a spine_core::AccountId,
    /// The model requested.
    pub(super) model: &'a str,
    /// The worst-case cost held, micros.
    pub(super) amount_micros: u64,
}

/// What a connection is for ([`Backend::conn`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Access {
    /// Reads only.
    Read,
    /// A write of one statement.
    Write,
}

/// A connection of backend `B`.
pub(super) type Conn<B> = <B as Backend>::Conn;
/// A write transaction of backend `B`.
pub(super) type Tx<B> = <B as Backend>::Tx;
/// A row of backend `B`.
pub(super) type Row<B> = <<B as Backend>::Conn as SqlConn>::Row;

/// What differs between the SQL stores; everything else is written once in this module.
pub(super) trait Backend: Send + Sync + 'static {
    /// A connection checked out for reads or for a write of one statement.
    type Conn: SqlConn;
    /// A write transaction: statements, then [`TxEnd::commit`] or [`TxEnd::rollback`]; its rows
    /// are a connection's.
    type Tx: SqlConn<Row = <Self::Conn as SqlConn>::Row> + TxEnd;

    /// How many times a transaction is run while it fails on [`Backend::is_retryable`] errors
    /// (1: never run again).
    const ATTEMPTS: u32;

    /// Appended to a `SELECT` that reads a row the transaction then changes, so that a
    /// concurrent writer waits (`" FOR UPDATE"`); empty where writers already take turns.
    const FOR_UPDATE: &'static str;

    /// Run first in a settlement's transaction with the request id as `$1`, so that one
    /// settlement of a request runs at a time; `None` where writers already take turns.
    const SETTLE_LOCK: Option<&'static str>;

    /// Run first in a node registration's transaction, so that registrations (which count
    /// nodes for the id) run one at a time; `None` where writers already take turns.
    const NODES_LOCK: Option<&'static str>;

    /// Whether other gateway instances may hold holds in the same database: then, without an
    /// instance id, a shutdown sweep cannot tell this process's holds and settles none.
    const SHARED: bool;

    /// Whether a failed transaction was rolled back by a deadlock or a serialization failure
    /// and may be run again.
    fn is_retryable(e: &LedgerError) -> bool;

    /// The instance id recorded on the holds this store places, if any.
    fn instance_id(&self) -> Option<&str>;

    /// A connection for reads or for a write of one statement.
    fn conn(&self, access: Access) -> impl Future<Output = Result<Conn<Self>, LedgerError>> + Send;

    /// A connection for reads ([`Backend::conn`]).
    fn read(&self) -> impl Future<Output = Result<Conn<Self>, LedgerError>> + Send {
        self.conn(Access::Read)
    }

    /// A connection for a write of one statement ([`Backend::conn`]).
    fn write(&self) -> impl Future<Output = Result<Conn<Self>, LedgerError>> + Send {
        self.conn(Access::Write)
    }

    /// A write transaction.
    fn begin(&self) -> impl Future<Output = Result<Tx<Self>, LedgerError>> + Send;

    /// Places a hold once (see [`Ledger::hold`](super::Ledger::hold)); run again by
    /// [`retrying`] on a retryable failure.
    fn hold_once<'a>(
        &'a self,
        hold: HoldRequest<'a>,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send + 'a;

    /// Writes what a settlement decided ([`money::SettlementWrites`]: the request's record, its
    /// ledger entries, then the account's, the roll-ups' and the operator's rows, in that order)
    /// in its transaction `tx`; by default one statement each
    /// ([`money::settle_writes_in_turn`]).
    fn settle_writes<'a>(
        tx: &'a mut Self::Tx,
        writes: money::SettlementWrites<'a>,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send + 'a {
        money::settle_writes_in_turn(tx, writes)
    }
}

/// Runs `once` again while it fails on a deadlock or a serialization failure
/// ([`Backend::is_retryable`]), up to [`Backend::ATTEMPTS`] times in all.
pub(super) async fn retrying<B, T, F, Fut>(mut once: F) -> Result<T, LedgerError>
where
    B: Backend,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, LedgerError>>,
{
    let mut attempt = 1;
    loop {
        match once().await {
            Err(e) if attempt < B::ATTEMPTS && B::is_retryable(&e) => {
                tracing::debug!(attempt, error = %e, "ledger transaction retried");
                attempt += 1;
            }
            r => return r,
        }
    }
}

/// `e` as [`LedgerError::Duplicate`] (`what`) when it is a unique-constraint violation.
pub(super) fn unique_as(e: LedgerError, what: &'static str) -> LedgerError {
    match e {
        LedgerError::Database(sqlx::Error::Database(d)) if d.is_unique_violation() => {
            LedgerError::Duplicate { what }
        }
        e => e,
    }
}

/// The text column `col` of the first row `sql` returns (with `args`, on a read connection);
/// `None` when it returns none.
///
/// # Errors
///
/// [`LedgerError::Database`]; [`LedgerError::Corrupt`] when the column is not text.
pub(super) async fn read_text<B: Backend>(
    b: &B,
    sql: &str,
    args: &[Arg<'_>],
    col: &str,
) -> Result<Option<String>, LedgerError> {
    b.read()
        .await?
        .optional(sql, args)
        .await?
        .map(|row| row.text(col))
        .transpose()
}

/// Runs `sql`, an `INSERT` (with `args`, on a write connection); how many rows it inserted.
///
/// # Errors
///
/// [`LedgerError::Duplicate`] `what` on a unique violation ([`unique_as`]),
/// [`LedgerError::Database`].
pub(super) async fn insert<B: Backend>(
    b: &B,
    sql: &str,
    args: &[Arg<'_>],
    what: &'static str,
) -> Result<u64, LedgerError> {
    b.write()
        .await?
        .exec(sql, args)
        .await
        .map_err(|e| unique_as(e, what))
}

/// [`insert`]s with `sql`, an `INSERT … SELECT … FROM <owner> WHERE id = …` that inserts a row
/// only when its owner exists.
///
/// # Errors
///
/// As [`insert`]; `unknown()` when nothing was inserted (no such owner).
pub(super) async fn insert_owned<B: Backend>(
    b: &B,
    sql: &str,
    args: &[Arg<'_>],
    what: &'static str,
    unknown: impl FnOnce() -> LedgerError,
) -> Result<(), LedgerError> {
    if insert(b, sql, args, what).await? == 0 {
        return Err(unknown());
    }
    Ok(())
}

/// Commits `tx` when `write`, else rolls it back.
pub(super) async fn finish<B: Backend>(tx: Tx<B>, write: bool) -> Result<(), LedgerError> {
    if write {
        tx.commit().await.map_err(db)
    } else {
        tx.rollback().await.map_err(db)
    }
}

/// Applies `migrations` (`(version, sql)`, in order, each once, recorded in
/// `spine_schema_migrations`, created by `create_table`) in one transaction, after `lock`
/// (a statement that makes concurrent migrations wait; `None` where writers already take turns).
pub(super) async fn migrate<B: Backend>(
    b: &B,
    lock: Option<&str>,
    create_table: &str,
    migrations: &[(i64, String)],
) -> Result<(), LedgerError> {
    let mut tx = b.begin().await?;
    // a lock is held until commit or rollback, also when this future is dropped (the
    // connection's transaction is rolled back before it is reused)
    if let Some(lock) = lock {
        tx.exec(lock, &[]).await?;
    }
    tx.exec(create_table, &[]).await?;
    for (version, sql) in migrations {
        let version = *version;
        let applied = tx
            .optional(
                "SELECT version FROM spine_schema_migrations WHERE version = $1",
                &[Arg::I64(version)],
            )
            .await?;
        if applied.is_none() {
            tx.batch(sql).await?;
            tx.exec(
                "INSERT INTO spine_schema_migrations (version, applied_at_ms) VALUES ($1, $2)",
                &[Arg::I64(version), Arg::I64(now_ms())],
            )
            .await?;
            tracing::info!(version, "applied ledger schema migration");
        }
    }
    tx.commit().await.map_err(db)
}

/// Implements [`Ledger`](crate::ledger::Ledger) and [`Store`](crate::ledger::Store) for a
/// [`Backend`] with this module's protocol.
macro_rules! sql_store {
    ($store:ty) => {
        impl $crate::ledger::Ledger for $store {
            fn hold(
                &self,
                request_id: spine_core::RequestId,
                account: spine_core::AccountId,
                model: spine_core::ModelId,
                amount_micros: u64,
            ) -> $crate::ledger::LedgerFuture<'_, ()> {
                Box::pin($crate::ledger::sql::money::hold(
                    self,
                    request_id,
                    account,
                    model,
                    amount_micros,
                ))
            }

            fn note_hold(
                &self,
                request_id: spine_core::RequestId,
                note: $crate::ledger::HoldNote,
            ) -> $crate::ledger::LedgerFuture<'_, ()> {
                Box::pin($crate::ledger::sql::money::note_hold(
                    self, request_id, note,
                ))
            }

            fn available_micros<'a>(
                &'a self,
                account: &'a spine_core::AccountId,
            ) -> $crate::ledger::LedgerFuture<'a, Option<u64>> {
                Box::pin($crate::ledger::sql::accounts::available_micros(
                    self, account,
                ))
            }

            fn release(
                &self,
                request_id: spine_core::RequestId,
            ) -> $crate::ledger::LedgerFuture<'_, ()> {
                Box::pin($crate::ledger::sql::money::release(self, request_id))
            }

            fn settle(
                &self,
                settlement: $crate::ledger::Settlement,
            ) -> $crate::ledger::LedgerFuture<'_, $crate::ledger::SettleResult> {
                Box::pin($crate::ledger::sql::money::settle(self, settlement))
            }

            fn request_record(
                &self,
                request_id: spine_core::RequestId,
            ) -> $crate::ledger::LedgerFuture<'_, Option<$crate::ledger::RequestRecord>> {
                Box::pin($crate::ledger::sql::money::request_record(self, request_id))
            }
        }

        impl $crate::ledger::Store for $store {
            fn into_ledger(
                self: std::sync::Arc<Self>,
            ) -> std::sync::Arc<dyn $crate::ledger::Ledger> {
                self
            }

            fn console(
                self: std::sync::Arc<Self>,
            ) -> std::sync::Arc<dyn $crate::ledger::ConsoleStore> {
                self
            }

            fn create_account<'a>(
                &'a self,
                account: &'a spine_core::AccountId,
            ) -> $crate::ledger::LedgerFuture<'a, ()> {
                Box::pin($crate::ledger::sql::accounts::create_account(self, account))
            }

            fn add_credits<'a>(
                &'a self,
                account: &'a spine_core::AccountId,
                amount_micros: u64,
                idempotency_key: &'a str,
            ) -> $crate::ledger::LedgerFuture<'a, bool> {
                Box::pin($crate::ledger::sql::money::add_credits(
                    self,
                    account,
                    amount_micros,
                    idempotency_key,
                ))
            }

            fn create_api_key<'a>(
                &'a self,
                account: &'a spine_core::AccountId,
                key_hash: &'a str,
            ) -> $crate::ledger::LedgerFuture<'a, ()> {
                Box::pin($crate::ledger::sql::accounts::create_api_key(
                    self, account, key_hash,
                ))
            }

            fn account_for_key_hash<'a>(
                &'a self,
                key_hash: &'a str,
            ) -> $crate::ledger::LedgerFuture<'a, Option<spine_core::AccountId>> {
                Box::pin($crate::ledger::sql::accounts::account_for_key_hash(
                    self, key_hash,
                ))
            }

            fn account<'a>(
                &'a self,
                account: &'a spine_core::AccountId,
            ) -> $crate::ledger::LedgerFuture<'a, $crate::ledger::AccountBalance> {
                Box::pin($crate::ledger::sql::accounts::account(self, account))
            }

            fn create_operator<'a>(
                &'a self,
                operator: &'a spine_core::OperatorId,
            ) -> $crate::ledger::LedgerFuture<'a, ()> {
                Box::pin($crate::ledger::sql::nodes::create_operator(self, operator))
            }

            fn operator_earned_micros<'a>(
                &'a self,
                operator: &'a spine_core::OperatorId,
            ) -> $crate::ledger::LedgerFuture<'a, u64> {
                Box::pin($crate::ledger::sql::nodes::operator_earned_micros(
                    self, operator,
                ))
            }

            fn resolve_held_earnings<'a>(
                &'a self,
                node: &'a spine_core::NodeId,
                model: &'a spine_core::ModelId,
                pay: bool,
            ) -> $crate::ledger::LedgerFuture<'a, $crate::ledger::HeldEarnings> {
                Box::pin($crate::ledger::sql::money::resolve_held_earnings(
                    self, node, model, pay,
                ))
            }

            fn register_node<'a>(
                &'a self,
                operator: &'a spine_core::OperatorId,
                public_key_text: &'a str,
            ) -> $crate::ledger::LedgerFuture<'a, spine_core::NodeId> {
                Box::pin($crate::ledger::sql::nodes::register_node(
                    self,
                    operator,
                    public_key_text,
                ))
            }

            fn node_for_public_key<'a>(
                &'a self,
                public_key_text: &'a str,
            ) -> $crate::ledger::LedgerFuture<'a, Option<spine_core::NodeId>> {
                Box::pin($crate::ledger::sql::nodes::node_for_public_key(
                    self,
                    public_key_text,
                ))
            }

            fn node_operator<'a>(
                &'a self,
                node: &'a spine_core::NodeId,
            ) -> $crate::ledger::LedgerFuture<'a, spine_core::OperatorId> {
                Box::pin($crate::ledger::sql::nodes::node_operator(self, node))
            }

            fn create_enrollment<'a>(
                &'a self,
                operator: &'a spine_core::OperatorId,
                token_hash: &'a str,
                expires_at_ms: i64,
            ) -> $crate::ledger::LedgerFuture<'a, ()> {
                Box::pin($crate::ledger::sql::nodes::create_enrollment(
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
            ) -> $crate::ledger::LedgerFuture<'a, $crate::ledger::Enrollment> {
                Box::pin($crate::ledger::sql::nodes::redeem_enrollment(
                    self,
                    token_hash,
                    public_key_text,
                    name,
                ))
            }

            fn operator_nodes<'a>(
                &'a self,
                operator: &'a spine_core::OperatorId,
            ) -> $crate::ledger::LedgerFuture<'a, Vec<$crate::ledger::NodeRecord>> {
                Box::pin($crate::ledger::sql::nodes::operator_nodes(self, operator))
            }

            fn set_key_limits<'a>(
                &'a self,
                key_hash: &'a str,
                limits: $crate::ledger::KeyLimits,
            ) -> $crate::ledger::LedgerFuture<'a, ()> {
                Box::pin($crate::ledger::sql::accounts::set_key_limits(
                    self, key_hash, limits,
                ))
            }

            fn key_limits<'a>(
                &'a self,
                key_hash: &'a str,
            ) -> $crate::ledger::LedgerFuture<'a, Option<$crate::ledger::KeyLimits>> {
                Box::pin($crate::ledger::sql::accounts::key_limits(self, key_hash))
            }

            fn settle_stale_holds(&self) -> $crate::ledger::LedgerFuture<'_, u64> {
                Box::pin($crate::ledger::sql::money::sweep(
                    self,
                    $crate::ledger::SweepKind::Restart,
                ))
            }

            fn settle_holds_at_shutdown(&self) -> $crate::ledger::LedgerFuture<'_, u64> {
                Box::pin($crate::ledger::sql::money::sweep(
                    self,
                    $crate::ledger::SweepKind::Shutdown,
                ))
            }

            fn entries_sum_micros(&self) -> $crate::ledger::LedgerFuture<'_, i64> {
                Box::pin($crate::ledger::sql::money::entries_sum_micros(self))
            }

            fn entry_totals(
                &self,
            ) -> $crate::ledger::LedgerFuture<'_, $crate::ledger::EntryTotals> {
                Box::pin($crate::ledger::sql::money::entry_totals(self))
            }
        }
    };
}
pub(super) use sql_store;
