//! The ledger: holds, settlement and request records (design brief §6).
//!
//! Money is in integer micro-units. Every settlement is one transaction, idempotent by request id,
//! and writes double-entry ledger entries that sum to zero: the caller's account `−debit`, the
//! node's operator `+operator_credit`, the platform `+fee`. Credits added to an account are booked
//! against the `external` party, so the whole entry table sums to zero.
//!
//! Settlement rules ([`Ledger::settle`]):
//! - `cost_micros` is the price of the billed usage when the outcome is billed (`completed`,
//!   `client_cancelled`, `cut_at_bound`), and 0 for `upstream_failed` and `rejected` (the
//!   caller pays nothing);
//! - `debit_micros = min(cost_micros, hold_micros)` where `hold_micros` is the request's active
//!   hold (0 when there is none); the hold is released in full;
//! - the operator is credited from the debit ([`crate::price::split`]); with no node, a node
//!   without an operator, or a `cut_at_bound` outcome, the platform keeps the whole debit as fee.
//!
//! # Stores
//!
//! [`Store`] is everything the gateway needs from its database: the [`Ledger`] the metering layer
//! uses, plus accounts, API keys, credits, operators, nodes, one-time enrollment tokens (hash,
//! expiry, single use) and stale holds for the admin API and the tunnel. One `Arc<dyn Store>` serves both ([`Store::into_ledger`] hands the meter its
//! `Arc<dyn Ledger>`). Two implementations, with the same semantics and the same errors, proven by
//! one test suite run against both (`ledger/tests.rs`):
//!
//! - [`SqliteLedger`]: one file (WAL), single instance. Every write goes through one writer
//!   connection in a `BEGIN IMMEDIATE` transaction, so writers queue in process (not in SQLite's
//!   busy handler); reads use a separate read-only pool.
//! - [`PgLedger`]: PostgreSQL, for several gateway instances sharing one database (design brief
//!   §8). Transactions run at `READ COMMITTED`; a hold is one statement (a conditional `UPDATE`
//!   of the account row, `balance − held ≥ amount` re-checked on the latest row version after
//!   any concurrent update, plus the hold's `INSERT`), so concurrent holds queue on the row for
//!   one round trip each and never take the same credit; when it places nothing the decision is
//!   made again under `SELECT … FOR NO KEY UPDATE`, so a refusal reports the exact
//!   `balance − held` it was refused on; settlement takes a
//!   transaction-level advisory lock on its request id (so a concurrent second settlement waits,
//!   then sees the first and returns it with `already_settled = true`), and node registration
//!   locks the node table (node ids are `node_<n>`). Deadlocks and serialization failures are
//!   retried. Schema migrations run in one transaction under `pg_advisory_xact_lock`, so any number
//!   of instances starting at once on an empty database all come up.
//!
//!   Several instances: each names itself ([`PgLedger::with_instance_id`]); its holds record the
//!   id and it heartbeats a row of the `instances` table (PostgreSQL's clock, every 2 s with
//!   [`PgLedger::spawn_instance_upkeep`]). At start it settles only its own leftover holds
//!   ([`Store::settle_stale_holds`]); periodically, the holds of instances whose heartbeat is
//!   older than a bound (60 s by default) ([`PgLedger::settle_orphaned_holds`]), never a live
//!   instance's in-flight request. A call queues for a connection of a full, busy pool on a
//!   healthy database (up to 30 s), but waits at most 2 s for a new connection or while
//!   PostgreSQL is known unreachable ([`PgPoolConfig`]), so with PostgreSQL unreachable a hold
//!   fails quickly with an error that [`LedgerError::is_unavailable`] recognises (the gateway answers 503 `ledger_unavailable`),
//!   and the metering layer retries a failed settlement until it commits.
//!
//! Per-key rate limits ([`KeyLimits`]) are kept in both stores (`key_limits` table), so every
//! instance of a multi-instance gateway enforces the same limits.
//!
//! Both keep `held ≤ balance` and `balance ≥ 0` as table constraints as well.

#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod amounts;
mod console;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod convert;
mod lifecycle;
#[cfg(feature = "postgres")]
mod pg;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use spine_core::{
    AccountId, ModelId, NodeId, OperatorId, RequestId, StreamOutcome, Usage, UsageSource,
};

use crate::price::Price;

pub use console::{
    ApiKeyInfo, ConsoleRole, ConsoleStore, ConsoleUser, CreditEntry, DiscrepancyRecord,
    EarningsDay, EnrollmentInfo, HeldCredit, NodeInfo, OperatorWindow, Page, PageCursor,
    PlatformDay, RequestFilter, RequestSummary, UsageDay, MAX_PAGE_ROWS, MAX_SCANNED_PER_PAGE,
};
#[cfg(all(feature = "sqlite", feature = "postgres"))]
pub use lifecycle::open_store;
#[cfg(feature = "tunnel")]
pub use lifecycle::StoreAuthenticator;
pub use lifecycle::{drain_at_shutdown, note_serving_node, Database, DatabaseUrlError};
#[cfg(feature = "postgres")]
pub use pg::{InstanceUpkeep, PgLedger, PgPoolConfig};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteLedger;

/// A boxed future returned by [`Ledger`] methods.
pub type LedgerFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, LedgerError>> + Send + 'a>>;

/// Why a ledger operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    /// The account's available balance (`balance − held`) cannot cover the hold.
    #[error("insufficient credit: {available_micros} available, {needed_micros} needed")]
    InsufficientCredit {
        /// `balance − held`, micros.
        available_micros: u64,
        /// The hold asked for, micros.
        needed_micros: u64,
    },
    /// No such account.
    #[error("unknown account {0}")]
    UnknownAccount(AccountId),
    /// No such operator.
    #[error("unknown operator {0}")]
    UnknownOperator(OperatorId),
    /// No such node.
    #[error("unknown node {0}")]
    UnknownNode(NodeId),
    /// A row with this key already exists (account, operator, API key, node key or hold).
    #[error("{what} already exists")]
    Duplicate {
        /// What was duplicated.
        what: &'static str,
    },
    /// An idempotency key was reused for a different operation (a credit to another account,
    /// or of another amount); nothing was changed.
    #[error("idempotency key {idempotency_key:?} was already used for a different credit")]
    IdempotencyConflict {
        /// The key.
        idempotency_key: String,
    },
    /// No enrollment token with this hash was ever issued.
    #[error("unknown enrollment token")]
    UnknownEnrollment,
    /// The enrollment token's validity ended before it was redeemed.
    #[error("enrollment token expired")]
    EnrollmentExpired,
    /// The enrollment token was already redeemed, by another node key.
    #[error("enrollment token already used")]
    EnrollmentUsed,
    /// An amount does not fit the store's signed 64-bit integers.
    #[error("amount out of range")]
    OutOfRange,
    /// A text (an id, an e-mail address, a filter, an idempotency key) holds a NUL character,
    /// which PostgreSQL cannot store or compare: refused before the database is asked, by both
    /// SQL stores alike. Nothing was read or changed.
    #[error("text holds a NUL character")]
    InvalidText,
    /// Another live process holds this gateway instance id: the `instances` row was
    /// heartbeat `heartbeat_age_ms` ago by a process other than this one. Instance ids must be
    /// unique; a restart under the same id waits until the previous process's heartbeat is older
    /// than the liveness bound.
    #[error("instance_id {instance_id:?} is live (heartbeat {heartbeat_age_ms} ms ago); ids must be unique")]
    InstanceIdLive {
        /// The instance id.
        instance_id: String,
        /// How long ago the other process last heartbeat (PostgreSQL's clock).
        heartbeat_age_ms: i64,
    },
    /// A stored value could not be read back.
    #[error("corrupt ledger row: {0}")]
    Corrupt(&'static str),
    /// The database failed (features `sqlite`, `postgres`: the SQL stores).
    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    #[error("ledger database error")]
    Database(#[source] sqlx::Error),
}

impl LedgerError {
    /// Whether the database could not be reached: never, in a build without the SQL stores
    /// (features `sqlite` and `postgres` off), whose errors are all about the request itself.
    #[must_use]
    #[cfg(not(any(feature = "sqlite", feature = "postgres")))]
    pub fn is_unavailable(&self) -> bool {
        false
    }

    /// Whether the database could not be reached or gave no connection in time (pool acquire
    /// timeout, connection refused or lost, TLS failure, server shutting down or refusing
    /// connections): nothing was done, and the same call may succeed later. The gateway answers
    /// these with 503 `ledger_unavailable`; a settlement that fails so is retried until it
    /// commits.
    #[must_use]
    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    pub fn is_unavailable(&self) -> bool {
        let LedgerError::Database(e) = self else {
            return false;
        };
        match e {
            sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::WorkerCrashed => true,
            // SQLSTATE class 08 (connection exception), 57P01–57P03 (shutdown, cannot connect
            // now), 53300 (too many connections)
            sqlx::Error::Database(d) => d.code().is_some_and(|c| {
                c.starts_with("08") || matches!(c.as_ref(), "57P01" | "57P02" | "57P03" | "53300")
            }),
            _ => false,
        }
    }
}

/// One API key's own rate limits, kept by the store beside the key so that every gateway
/// instance enforces the same limits (design brief §8). `None`: the gateway default; `Some(0)`:
/// unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyLimits {
    /// Requests per minute.
    pub rpm_limit: Option<u32>,
    /// Tokens per minute.
    pub tpm_limit: Option<u64>,
}

/// An account's money, micros.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccountBalance {
    /// Credits minus settled debits.
    pub balance_micros: u64,
    /// Sum of active holds.
    pub held_micros: u64,
    /// `balance − held`.
    pub available_micros: u64,
}

/// Everything needed to settle one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settlement {
    /// The request.
    pub request_id: RequestId,
    /// The caller's account.
    pub account: AccountId,
    /// The node that served it, if it reached one.
    pub node: Option<NodeId>,
    /// The model requested.
    pub model: ModelId,
    /// How it ended.
    pub outcome: StreamOutcome,
    /// The usage billed (the independent count).
    pub billed: Usage,
    /// The node's claim, when it sent one.
    pub claimed: Option<Usage>,
    /// Where `billed` came from.
    pub usage_source: UsageSource,
    /// Whether `claimed` differs from `billed` beyond the tolerance.
    pub discrepancy: bool,
    /// The model's price.
    pub price: Price,
    /// The operator's share, basis points (0–10 000).
    pub share_bps: u16,
    /// The node's model audit is `suspect` (design brief §10): the operator's credit is held in
    /// escrow, not paid, until the verdict ([`Store::resolve_held_earnings`]).
    pub earnings_held: bool,
    /// The API key the caller presented, as the edge names it (the gateway: its SHA-256, hex;
    /// never the key), recorded so the console can show and filter requests by key.
    pub key: Option<String>,
    /// Time to the first generated content of a streamed answer, milliseconds, measured by the
    /// metering layer from the request's admission (after its prompt was counted) to the first
    /// chunk with generated text; `None` for an answer that was not streamed or never had any.
    pub ttft_ms: Option<u64>,
}

/// The money moved by one settlement, micros.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettleResult {
    /// Price of the billed usage (0 for outcomes the caller does not pay).
    pub cost_micros: u64,
    /// Taken from the caller: `min(cost, hold)`.
    pub debit_micros: u64,
    /// Credited to the operator.
    pub operator_credit_micros: u64,
    /// Kept by the platform.
    pub fee_micros: u64,
    /// The hold released.
    pub hold_micros: u64,
    /// True when the request had already been settled: nothing moved this time.
    pub already_settled: bool,
}

/// Which sweep settled a hold its request's own settlement never reached
/// ([`RequestRecord::swept`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum SweepKind {
    /// At start-up, a previous run's leftovers: that run crashed or was killed
    /// ([`Store::settle_stale_holds`]).
    Restart,
    /// By another instance, after the placing instance's heartbeat lapsed
    /// ([`PgLedger::settle_orphaned_holds`]).
    Orphan,
    /// At a clean shutdown, after the requests in flight ended and their settlements were
    /// committed: holds nobody settled ([`Store::settle_holds_at_shutdown`]).
    Shutdown,
}

impl SweepKind {
    /// The stored (and serialised) name: `restart`, `orphan`, `shutdown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Restart => "restart",
            Self::Orphan => "orphan",
            Self::Shutdown => "shutdown",
        }
    }

    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "restart" => Some(Self::Restart),
            "orphan" => Some(Self::Orphan),
            "shutdown" => Some(Self::Shutdown),
            _ => None,
        }
    }
}

/// What is known about a request in flight, recorded on its hold ([`Ledger::note_hold`]) so
/// that a sweep's record keeps it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HoldNote {
    /// The node serving the request (once picked); `None` leaves what was recorded.
    pub node: Option<NodeId>,
    /// The usage counted so far (the independent count); `None` leaves what was recorded.
    pub known: Option<Usage>,
}

/// One request as `GET /admin/v1/requests/{id}` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// The request.
    pub request_id: RequestId,
    /// The caller's account.
    pub account: AccountId,
    /// The model requested.
    pub model: ModelId,
    /// How it ended.
    pub outcome: StreamOutcome,
    /// The node that served it.
    pub node: Option<NodeId>,
    /// That node's operator.
    pub operator: Option<OperatorId>,
    /// The usage billed.
    pub billed: Usage,
    /// The node's claim.
    pub claimed: Option<Usage>,
    /// Where the billed usage came from.
    pub usage_source: UsageSource,
    /// Whether claim and count disagreed beyond the tolerance.
    pub discrepancy: bool,
    /// Price of the billed usage, micros.
    pub cost_micros: u64,
    /// Taken from the caller, micros.
    pub debit_micros: u64,
    /// Credited to the operator, micros.
    pub operator_credit_micros: u64,
    /// Kept by the platform, micros.
    pub fee_micros: u64,
    /// The hold that was placed, micros.
    pub hold_micros: u64,
    /// When it was settled, Unix milliseconds.
    pub created_at_ms: i64,
    /// Set when a sweep settled it (the request's own settlement never came): which one. Such
    /// records are `upstream_failed` (the caller pays nothing) and keep the node and the usage
    /// recorded on the hold ([`Ledger::note_hold`]).
    #[serde(default)]
    pub swept: Option<SweepKind>,
    /// Where the operator's credit is: paid, or held in escrow while the node's model audit was
    /// `suspect`, then paid or forfeited at the verdict.
    #[serde(default)]
    pub earnings: EarningsState,
}

/// Where a request's operator credit is ([`RequestRecord::earnings`]; design brief §10).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum EarningsState {
    /// Credited to the operator (the usual case).
    #[default]
    Paid,
    /// In escrow: served while the node's model audit was `suspect`.
    Held,
    /// Kept by the platform: the audit then `failed` the node's model.
    Forfeited,
}

impl EarningsState {
    /// The stored name (`paid`, `held`, `forfeited`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Paid => "paid",
            Self::Held => "held",
            Self::Forfeited => "forfeited",
        }
    }

    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    pub(crate) fn parse(s: Option<&str>) -> Self {
        match s {
            Some("held") => Self::Held,
            Some("forfeited") => Self::Forfeited,
            _ => Self::Paid,
        }
    }
}

/// What [`Store::resolve_held_earnings`] moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldEarnings {
    /// Requests whose held credit was resolved.
    pub requests: u64,
    /// Their operator credits, micros.
    pub micros: u64,
}

/// What the metering layer needs from a ledger. Object safe: use as `Arc<dyn Ledger>`.
pub trait Ledger: Send + Sync + std::fmt::Debug + 'static {
    /// Places a hold of `amount_micros` on `account` for `request_id`, a request for `model`
    /// (recorded so that a hold left active by a crash can be settled with a full record).
    ///
    /// # Errors
    ///
    /// [`LedgerError::InsufficientCredit`] when `balance − held < amount`;
    /// [`LedgerError::UnknownAccount`]; [`LedgerError::Duplicate`] when the request already has a
    /// hold.
    ///
    /// # Cancel safety
    ///
    /// Atomic: dropped before completion, either the hold exists or it does not.
    fn hold(
        &self,
        request_id: RequestId,
        account: AccountId,
        model: ModelId,
        amount_micros: u64,
    ) -> LedgerFuture<'_, ()>;

    /// Records on the request's active hold what is known so far (the node once picked, the
    /// usage counted so far), so that a sweep that settles the hold — after a crash, an
    /// instance lost, or a shutdown — keeps them in the request record instead of a null node
    /// and zero tokens. No effect when the hold is no longer active. Default: does nothing.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`], [`LedgerError::OutOfRange`].
    ///
    /// # Cancel safety
    ///
    /// One statement: dropped before completion, either it was recorded or not.
    fn note_hold(&self, request_id: RequestId, note: HoldNote) -> LedgerFuture<'_, ()> {
        let _ = (request_id, note);
        Box::pin(std::future::ready(Ok(())))
    }

    /// The account's available balance (`balance − held`), micros, when this ledger can tell
    /// cheaply; `None` when it cannot (the default) or the account is unknown. The metering layer
    /// asks before counting a large prompt, so that an account that cannot pay is refused
    /// before any template or tokenizer work.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`].
    ///
    /// # Cancel safety
    ///
    /// A read: dropped before completion, nothing changed.
    fn available_micros<'a>(&'a self, account: &'a AccountId) -> LedgerFuture<'a, Option<u64>> {
        let _ = account;
        Box::pin(std::future::ready(Ok(None)))
    }

    /// Releases the request's active hold, if any (idempotent).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`].
    fn release(&self, request_id: RequestId) -> LedgerFuture<'_, ()>;

    /// Settles a request in one transaction (see the module docs for the rules). Settling the
    /// same request again changes nothing and returns the first result with
    /// `already_settled = true`.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`], [`LedgerError::OutOfRange`].
    fn settle(&self, settlement: Settlement) -> LedgerFuture<'_, SettleResult>;

    /// The record of a settled request.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`], [`LedgerError::Corrupt`].
    fn request_record(&self, request_id: RequestId) -> LedgerFuture<'_, Option<RequestRecord>>;
}

/// What redeeming an enrollment token registered ([`Store::redeem_enrollment`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Enrollment {
    /// The node now registered with the presented public key.
    pub node: NodeId,
    /// The operator the token was issued for; the node belongs to it.
    pub operator: OperatorId,
}

/// A registered node as its operator sees it ([`Store::operator_nodes`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// The node.
    pub node_id: NodeId,
    /// Its operator.
    pub operator: OperatorId,
    /// Its public key, text form (`ed25519:<base64url>`).
    pub public_key_text: String,
    /// The name given at enrollment, if any.
    pub name: Option<String>,
    /// When it was registered, Unix milliseconds.
    pub created_at_ms: i64,
    /// Settled requests it served to the end (outcome `completed`).
    pub requests_served: u64,
    /// Operator credits paid for the requests it served, micros (every outcome; credit held in
    /// escrow counts once paid, forfeited credit never).
    pub earned_micros: u64,
}

/// Sums of all ledger entries by party kind, micros (design brief §6, double entry).
///
/// Credits added to accounts are booked against `external` (negative), settlements move money
/// from `accounts` (negative) to `operators` and `platform`; the four always sum to zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryTotals {
    /// Accounts: credits added minus debits settled.
    pub accounts_micros: i64,
    /// Operators: their credits.
    pub operators_micros: i64,
    /// The platform: its fees.
    pub platform_micros: i64,
    /// Outside money: minus the credits added.
    pub external_micros: i64,
}

impl EntryTotals {
    /// The sum of all four; zero unless the books are broken.
    #[must_use]
    pub fn sum_micros(&self) -> i128 {
        i128::from(self.accounts_micros)
            + i128::from(self.operators_micros)
            + i128::from(self.platform_micros)
            + i128::from(self.external_micros)
    }
}

/// Everything the gateway needs from its store: the [`Ledger`] plus accounts, API keys, credits,
/// operators, nodes and stale holds. Object safe: use as `Arc<dyn Store>`; implemented by
/// [`SqliteLedger`] and [`PgLedger`] with the same semantics and errors.
///
/// Every method is atomic: a future dropped before completion either did its work or none of it.
pub trait Store: Ledger {
    /// This store as the metering layer's `Arc<dyn Ledger>`.
    fn into_ledger(self: Arc<Self>) -> Arc<dyn Ledger>;

    /// This store as the console's `Arc<dyn ConsoleStore>` (issue 18).
    fn console(self: Arc<Self>) -> Arc<dyn ConsoleStore>;

    /// Creates an account with a zero balance.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Duplicate`] (`what = "account"`) when it exists.
    fn create_account<'a>(&'a self, account: &'a AccountId) -> LedgerFuture<'a, ()>;

    /// Adds credits to an account, once per `idempotency_key`. Returns `true` when applied,
    /// `false` when the key was already used for the same account and amount (a retry: nothing
    /// changes). Books `+amount` to the account and `−amount` to `external`.
    ///
    /// # Errors
    ///
    /// [`LedgerError::IdempotencyConflict`] when the key was already used for a different
    /// account or amount (nothing changes; also for an unknown account);
    /// [`LedgerError::UnknownAccount`], [`LedgerError::OutOfRange`] (amount or resulting balance
    /// above `i64::MAX`).
    fn add_credits<'a>(
        &'a self,
        account: &'a AccountId,
        amount_micros: u64,
        idempotency_key: &'a str,
    ) -> LedgerFuture<'a, bool>;

    /// Maps an API key's hash (e.g. hex SHA-256 of the key) to an account. The plaintext key is
    /// never stored.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Duplicate`] (`what = "api key"`), [`LedgerError::UnknownAccount`].
    fn create_api_key<'a>(
        &'a self,
        account: &'a AccountId,
        key_hash: &'a str,
    ) -> LedgerFuture<'a, ()>;

    /// The account an API key hash belongs to.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`].
    fn account_for_key_hash<'a>(&'a self, key_hash: &'a str)
        -> LedgerFuture<'a, Option<AccountId>>;

    /// An account's balance, held and available amounts.
    ///
    /// # Errors
    ///
    /// [`LedgerError::UnknownAccount`].
    fn account<'a>(&'a self, account: &'a AccountId) -> LedgerFuture<'a, AccountBalance>;

    /// Creates an operator with nothing earned.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Duplicate`] (`what = "operator"`).
    fn create_operator<'a>(&'a self, operator: &'a OperatorId) -> LedgerFuture<'a, ()>;

    /// What an operator has earned, micros.
    ///
    /// # Errors
    ///
    /// [`LedgerError::UnknownOperator`].
    fn operator_earned_micros<'a>(&'a self, operator: &'a OperatorId) -> LedgerFuture<'a, u64>;

    /// Resolves the operator credits held in escrow for requests `node` served for `model`
    /// while its audit was `suspect` ([`Settlement::earnings_held`]): `pay` credits them to the
    /// node's operator (the audit passed), else the platform keeps them (it failed). One
    /// transaction; the ledger entries move the escrow to the operator or the platform and
    /// still sum to zero; resolving again finds nothing held.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`], [`LedgerError::OutOfRange`].
    ///
    /// # Cancel safety
    ///
    /// One transaction: dropped before completion, nothing or everything moved.
    fn resolve_held_earnings<'a>(
        &'a self,
        node: &'a NodeId,
        model: &'a ModelId,
        pay: bool,
    ) -> LedgerFuture<'a, HeldEarnings>;

    /// Registers a node by its public key (text form) under an operator; the node id is
    /// `node_<n>`, `n` counting registrations from 1.
    ///
    /// # Errors
    ///
    /// [`LedgerError::UnknownOperator`]; [`LedgerError::Duplicate`] (`what = "node public key"`)
    /// when the key is registered.
    fn register_node<'a>(
        &'a self,
        operator: &'a OperatorId,
        public_key_text: &'a str,
    ) -> LedgerFuture<'a, NodeId>;

    /// The node registered with this public key.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`].
    fn node_for_public_key<'a>(
        &'a self,
        public_key_text: &'a str,
    ) -> LedgerFuture<'a, Option<NodeId>>;

    /// The operator a node belongs to.
    ///
    /// # Errors
    ///
    /// [`LedgerError::UnknownNode`].
    fn node_operator<'a>(&'a self, node: &'a NodeId) -> LedgerFuture<'a, OperatorId>;

    /// Stores a one-time enrollment token for `operator`: only its hash (e.g. hex SHA-256 of the
    /// token; the plaintext is never stored), valid until `expires_at_ms` (Unix milliseconds).
    ///
    /// # Errors
    ///
    /// [`LedgerError::UnknownOperator`]; [`LedgerError::Duplicate`]
    /// (`what = "enrollment token"`) when the hash exists.
    fn create_enrollment<'a>(
        &'a self,
        operator: &'a OperatorId,
        token_hash: &'a str,
        expires_at_ms: i64,
    ) -> LedgerFuture<'a, ()>;

    /// Redeems an enrollment token in one transaction: registers `public_key_text` as a new node
    /// of the token's operator (as [`Store::register_node`], with an optional `name`) and marks
    /// the token used by that node. Redeeming a used token again with the same public key
    /// returns the same node (a retry after a lost answer); with another key it is refused.
    ///
    /// # Errors
    ///
    /// [`LedgerError::UnknownEnrollment`], [`LedgerError::EnrollmentExpired`] (checked against
    /// the store's clock), [`LedgerError::EnrollmentUsed`]; [`LedgerError::Duplicate`]
    /// (`what = "node public key"`) when the key is already registered (the token stays unused).
    fn redeem_enrollment<'a>(
        &'a self,
        token_hash: &'a str,
        public_key_text: &'a str,
        name: Option<&'a str>,
    ) -> LedgerFuture<'a, Enrollment>;

    /// An operator's nodes, by registration order, each with the requests it served and the
    /// credits they earned, all time (the SQL stores sum the node's rows of the daily earnings
    /// roll-up: days × models rows, not its request records).
    ///
    /// # Errors
    ///
    /// [`LedgerError::UnknownOperator`].
    fn operator_nodes<'a>(&'a self, operator: &'a OperatorId) -> LedgerFuture<'a, Vec<NodeRecord>>;

    /// Records an API key's own rate limits (replacing any it had), by the key's hash.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`].
    fn set_key_limits<'a>(&'a self, key_hash: &'a str, limits: KeyLimits) -> LedgerFuture<'a, ()>;

    /// An API key's own rate limits, if it has any recorded.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`], [`LedgerError::Corrupt`].
    fn key_limits<'a>(&'a self, key_hash: &'a str) -> LedgerFuture<'a, Option<KeyLimits>>;

    /// Settles every hold still active as `upstream_failed` and returns how many it settled: the
    /// caller pays nothing, the hold is released, nobody is credited, a request record is written.
    ///
    /// Call it only when no request is in flight on this store: at start-up of a single instance
    /// (on a store shared by several instances, another instance's holds would be settled too).
    /// A [`PgLedger`] given an instance id ([`PgLedger::with_instance_id`]) settles only the
    /// holds that instance placed: its own leftovers from a previous run under the same id.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`], [`LedgerError::Corrupt`]. Holds settled before the error stay
    /// settled; calling again settles the rest.
    fn settle_stale_holds(&self) -> LedgerFuture<'_, u64>;

    /// At a clean shutdown, once every request in flight has ended and its settlement was
    /// committed: settles the holds still active that this process placed (none, unless a
    /// request lost its owner), as [`Store::settle_stale_holds`] does, but recorded as
    /// [`SweepKind::Shutdown`]; returns how many. A [`PgLedger`] without an instance id settles
    /// nothing (it cannot tell its holds from other instances'). Default: settles nothing.
    ///
    /// # Errors
    ///
    /// As [`Store::settle_stale_holds`].
    fn settle_holds_at_shutdown(&self) -> LedgerFuture<'_, u64> {
        Box::pin(std::future::ready(Ok(0)))
    }

    /// Sum of all ledger entries, micros; zero unless the books are broken.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`].
    fn entries_sum_micros(&self) -> LedgerFuture<'_, i64>;

    /// Sums of all ledger entries by party kind.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`].
    fn entry_totals(&self) -> LedgerFuture<'_, EntryTotals>;
}

#[cfg(all(test, feature = "sqlite", feature = "postgres"))]
mod tests;
