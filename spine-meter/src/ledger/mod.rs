//! The ledger: holds, settlement and request records (design brief §6).
//!
//! Money is in integer micro-units. Every settlement is one transaction, idempotent by request id,
//! and writes double-entry ledger entries that sum to zero: the caller's account `−debit`, the
//! node's operator `+operator_credit`, the platform `+fee`. Credits added to an account are booked
//! against the `external` party, so the whole entry table sums to zero.
//!
//! Settlement rules ([`Ledger::settle`]):
//! - `cost_micros` is the price of the billed usage when the outcome is `completed` or
//!   `client_cancelled`, and 0 for `upstream_failed` and `rejected` (the caller pays nothing);
//! - `debit_micros = min(cost_micros, hold_micros)` where `hold_micros` is the request's active
//!   hold (0 when there is none); the hold is released in full;
//! - the operator is credited from the debit ([`crate::price::split`]); with no node, or a node
//!   without an operator, the platform keeps the whole debit as fee.

mod sqlite;

use std::future::Future;
use std::pin::Pin;

use serde::{Deserialize, Serialize};
use spine_core::{
    AccountId, ModelId, NodeId, OperatorId, RequestId, StreamOutcome, Usage, UsageSource,
};

use crate::price::Price;

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
    /// An amount does not fit the store's signed 64-bit integers.
    #[error("amount out of range")]
    OutOfRange,
    /// A stored value could not be read back.
    #[error("corrupt ledger row: {0}")]
    Corrupt(&'static str),
    /// The database failed.
    #[error("ledger database error")]
    Database(#[source] sqlx::Error),
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
