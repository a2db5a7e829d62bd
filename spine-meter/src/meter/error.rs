use spine_core::{BoxError, ModelId, PeekError};

use crate::{InjectError, LedgerError, TokenizerError};

/// Why the metering layer refused or failed a request. Returned boxed in a
/// [`BoxError`]; downcast to map it to an HTTP status (400, 413, 404, 402, 500, 502). Every
/// refusal before the node (400, 413, 404, 402) means the request was never forwarded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MeterError {
    /// The body could not be peeked, or its chat `messages` are malformed or unsupported (400;
    /// [`PeekError::InvalidMessage`] names the offending path).
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
    /// Request bodies being read hold the whole budget for them
    /// ([`MeterConfig::max_buffered_request_bytes`](super::MeterConfig::max_buffered_request_bytes);
    /// 503): the request is refused, nothing held or forwarded.
    #[error(
        "too many request bodies being read at once ({limit_bytes} bytes buffered); retry shortly"
    )]
    BodiesOverBudget {
        /// The budget, bytes.
        limit_bytes: usize,
    },
    /// The account's request bodies being read hold its whole share of the budget for them
    /// ([`MeterConfig::max_buffered_request_bytes_per_account`](super::MeterConfig::max_buffered_request_bytes_per_account);
    /// 429): the request is refused, nothing held or forwarded; other accounts are served.
    #[error(
        "this account has too many request bodies being read at once ({limit_bytes} bytes \
         buffered); retry once they are sent"
    )]
    AccountBodiesOverBudget {
        /// The account's share, bytes.
        limit_bytes: usize,
    },
    /// Requests whose hold or settlement is not committed yet are at the limit
    /// ([`MeterConfig::max_unsettled_requests`](super::MeterConfig::max_unsettled_requests))
    /// and stayed there for [`MeterConfig::unsettled_wait`](super::MeterConfig::unsettled_wait) (503 `server_busy`): the
    /// ledger is behind, and the request is refused before anything is held or forwarded.
    #[error(
        "the ledger is behind: {limit} requests wait for their hold or settlement; retry shortly"
    )]
    SettlementsBehind {
        /// The limit, requests.
        limit: usize,
    },
    /// The caller's account has its share of that limit (a quarter) waiting for the ledger
    /// (429 `rate_limit_exceeded`, `Retry-After: 1`): refused at once, before anything is
    /// held or forwarded, so that one account cannot fill the limit for every other.
    #[error(
        "this account has {limit} requests waiting for their hold or settlement; retry shortly"
    )]
    AccountSettlementsBehind {
        /// The account's share, requests.
        limit: usize,
    },
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
    /// The prompt leaves no room for a completion token in the model's context window:
    /// `prompt_tokens >= max_context_tokens` (400 `context_length_exceeded`).
    #[error(
        "the prompt is {prompt_tokens} tokens and the model's context window is {max_context_tokens} tokens"
    )]
    ContextLengthExceeded {
        /// The prompt, counted independently, tokens.
        prompt_tokens: u64,
        /// The catalog's context window for the model, tokens.
        max_context_tokens: u64,
    },
    /// The prompt is past the model's context window, found before all of it was counted: the
    /// count stopped at `at_least_tokens` (400 `context_length_exceeded`). Counting stops as
    /// soon as the prompt cannot fit, so a huge prompt costs no more than what fits.
    #[error(
        "the prompt is over {max_context_tokens} tokens (counting stopped at {at_least_tokens}) \
         and the model's context window is {max_context_tokens} tokens"
    )]
    PromptOverContext {
        /// Tokens counted before counting stopped (the prompt has at least this many).
        at_least_tokens: u64,
        /// The catalog's context window for the model, tokens.
        max_context_tokens: u64,
    },
    /// The node answered a non-streamed request with a 2xx body that is not a usable
    /// completion: not JSON, over the request's byte bound, an `error` member, no (requested)
    /// choices, or a choice without `finish_reason` (502). Settled `upstream_failed`.
    #[error("invalid response from the node: {0}")]
    UpstreamInvalid(String),
    /// A non-streamed answer the request could honestly make (within its byte bound, relative
    /// to its cap of completion tokens) is larger than the gateway buffers
    /// (`max_response_body_bytes`; 502 `response_too_large`, the caller told to stream it).
    /// The gateway's limit, not the node's fault: settled `cut_at_bound` (the caller pays the
    /// prompt, nothing was delivered; the operator earns nothing; the node is not scored).
    #[error(
        "the answer is larger than the {limit_bytes} bytes this gateway buffers for a non-streamed \
         response; ask for it with \"stream\": true (or lower max_tokens, n or top_logprobs)"
    )]
    AnswerTooLarge {
        /// `max_response_body_bytes`, bytes.
        limit_bytes: usize,
    },
    /// An embeddings request the gateway cannot honestly answer, refused before anything is
    /// held or forwarded (400 with `param`): more than 2,048 inputs (OpenAI's limit; `input`),
    /// `dimensions` other than the model's own vector length (`dimensions`), or more inputs
    /// than an honest answer of the model's vectors can fit the gateway's buffer (`input`).
    #[error("{message}")]
    EmbeddingsRefused {
        /// The member at fault.
        param: &'static str,
        /// What the caller is told.
        message: String,
    },
    /// An embeddings answer larger than the gateway buffers, from a request whose honest
    /// answer could be that large (the model's vector length unknown): the gateway's limit,
    /// 502 `response_too_large`. Embeddings cannot be streamed, so the caller is told to send
    /// fewer inputs; it received nothing and pays nothing (settled `cut_at_bound` at 0 tokens,
    /// the operator earns nothing, the node is not scored).
    #[error(
        "the embeddings answer is larger than the {limit_bytes} bytes this gateway buffers \
         (embeddings cannot be streamed): send fewer inputs per request; nothing was charged"
    )]
    EmbeddingsTooLarge {
        /// `max_response_body_bytes`, bytes.
        limit_bytes: usize,
    },
    /// Reading the node's non-streamed response body failed (502). Settled `upstream_failed`.
    #[error("cannot read the node's response body")]
    UpstreamBody(#[source] BoxError),
    /// `RequestId` or `AccountId` is missing from the request extensions (a wiring bug, 500).
    #[error("request extensions lack {0}")]
    MissingExtension(&'static str),
    /// The ledger failed (500).
    #[error("ledger error")]
    Ledger(#[source] LedgerError),
    /// The [`Admission`](super::Admission) hook refused the request (e.g. a tokens-per-minute
    /// limit; 429). Nothing was held or forwarded.
    #[error("request not admitted: {0}")]
    AdmissionRefused(#[source] super::AdmissionRefusal),
}
