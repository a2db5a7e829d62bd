//! Metering for spine (design brief §6): SSE parsing, usage capture, `include_usage` injection,
//! independent token counts, prices, the ledger and the metering tower layer.
//!
//! # Features
//!
//! On by default: `tokenizer`: [`ModelTokenizer`] and the [`gguf`] reader, the model's own
//! tokenizer and chat template (the tokenizers crate with onig, minijinja); without it the
//! metering layer counts with any [`TokenCounter`] the application brings. `sqlite`:
//! [`SqliteLedger`], the ledger store on one SQLite file; `postgres`: [`PgLedger`], the store for several gateway instances on PostgreSQL (both pull in
//! sqlx; without either, the [`Ledger`] and [`Store`] traits stay for a store of your own);
//! `llama-reference`: `audit::LlamaCppReference` (a hyper client to a llama-server). Off by
//! default: `axum` (`openai_error`: OpenAI's error shape as an axum response), `enroll`
//! (node enrollment's axum handlers) and `console`: the web console (`console`), server-rendered
//! pages for builders, GPU operators and the platform's staff as an axum `Router` (turns on
//! `axum`, `tunnel` and `limits`, and pulls in minijinja, argon2 and spine-router), besides
//! `limits`, `redis`, `metrics` and `tunnel`.

pub mod audit;
#[cfg(feature = "tokenizer")]
pub mod catalog;
pub mod classify;
#[cfg(feature = "console")]
pub mod console;
#[cfg(feature = "enroll")]
pub mod enroll;
#[cfg(feature = "tokenizer")]
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
#[cfg(feature = "axum")]
pub mod openai_error;
pub mod price;
pub mod request_id;
pub mod responses;
pub mod sse;
pub mod tokenizer;

#[cfg(test)]
// the helpers for the real model tokenizer and the captured fixtures serve the suites that need
// the default features
#[cfg_attr(
    not(all(feature = "tokenizer", feature = "sqlite")),
    allow(dead_code, unused_imports)
)]
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
#[cfg(feature = "tokenizer")]
pub use tokenizer::ModelTokenizer;
pub use tokenizer::{TokenCounter, TokenizerError};
