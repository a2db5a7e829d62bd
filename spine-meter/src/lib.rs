//! Metering for spine (design brief §6): SSE parsing, usage capture, `include_usage` injection,
//! independent token counts, prices, the ledger and the metering tower layer.
//!
//! # Features
//!
//! All on by default. `sqlite`: [`SqliteLedger`], the ledger store on one SQLite file;
//! `postgres`: [`PgLedger`], the store for several gateway instances on PostgreSQL (both pull in
//! sqlx; without either, the [`Ledger`] and [`Store`] traits stay for a store of your own);
//! `llama-reference`: `audit::LlamaCppReference` (a hyper client to a llama-server).

pub mod audit;
pub mod catalog;
pub mod classify;
pub mod gguf;
pub mod inject;
pub mod keys;
pub mod ledger;
#[cfg(feature = "limits")]
pub mod limits;
pub mod meter;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod node_error;
pub mod price;
pub mod responses;
pub mod sse;
pub mod tokenizer;

#[cfg(test)]
mod test_support;

pub use inject::{inject_include_usage, InjectError};
#[cfg(feature = "sqlite")]
pub use ledger::SqliteLedger;
pub use ledger::{
    AccountBalance, EarningsState, Enrollment, EntryTotals, HeldEarnings, HoldNote, KeyLimits,
    Ledger, LedgerError, LedgerFuture, NodeRecord, RequestRecord, SettleResult, Settlement, Store,
    SweepKind,
};
#[cfg(feature = "postgres")]
pub use ledger::{InstanceUpkeep, PgLedger, PgPoolConfig};
pub use price::Price;
pub use tokenizer::{ModelTokenizer, TokenizerError};
