use spine_core::{BoxError, ModelId, PeekError};

use crate::{InjectError, LedgerError, TokenizerError};

/// Why the metering layer refused or failed a request. Returned boxed in a
/// [`BoxError`]; downcast to map it to an HTTP status (400, 413, 404, 402, 500).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MeterError {
    /// The body could not be peeked (400).
    #[error("bad request")]
    BadRequest(#[source] PeekError),
    /// The prompt could not be rendered or counted (400).
    #[error("cannot count the prompt")]
    Prompt(#[source] TokenizerError),
    /// The body could not be rewritten (400).
    #[error("cannot rewrite the request body")]
    Inject(#[source] InjectError),
    /// The request body is over the configured limit (413).
    #[error("request body larger than {limit_bytes} bytes")]
    BodyTooLarge {
        /// The limit, bytes.
        limit_bytes: usize,
    },
    /// Reading the request body failed.
    #[error("cannot read the request body")]
    Body(#[source] BoxError),
    /// The model is not in the catalog (404).
    #[error("unknown model {0}")]
    UnknownModel(ModelId),
    /// The account cannot cover the hold (402).
    #[error("insufficient credit: {available_micros} available, {needed_micros} needed")]
    InsufficientCredit {
        /// `balance − held`, micros.
        available_micros: u64,
        /// The hold, micros.
        needed_micros: u64,
    },
    /// `RequestId` or `AccountId` is missing from the request extensions (a wiring bug, 500).
    #[error("request extensions lack {0}")]
    MissingExtension(&'static str),
    /// The ledger failed (500).
    #[error("ledger error")]
    Ledger(#[source] LedgerError),
}
