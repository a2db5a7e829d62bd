//! Metering for spine (design brief §6): SSE parsing, usage capture, `include_usage` injection,
//! independent token counts, prices, the ledger and the metering tower layer.

pub mod audit;
pub mod classify;
pub mod gguf;
pub mod inject;
pub mod ledger;
#[cfg(feature = "limits")]
pub mod limits;
pub mod meter;
pub mod price;
pub mod responses;
pub mod sse;
pub mod tokenizer;

#[cfg(test)]
mod test_support;

pub use inject::{inject_include_usage, InjectError};
pub use ledger::{
    AccountBalance, EarningsState, Enrollment, EntryTotals, HeldEarnings, HoldNote, InstanceUpkeep,
    KeyLimits, Ledger, LedgerError, LedgerFuture, NodeRecord, PgLedger, PgPoolConfig,
    RequestRecord, SettleResult, Settlement, SqliteLedger, Store, SweepKind,
};
pub use price::Price;
pub use tokenizer::{ModelTokenizer, TokenizerError};
