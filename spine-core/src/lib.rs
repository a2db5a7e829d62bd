//! Vocabulary of the spine control plane.
//!
//! `spine-core` holds the types every other spine crate speaks: identifiers ([`NodeId`],
//! [`ModelId`], [`RequestId`], [`AccountId`], [`OperatorId`]), token [`Usage`] and where it came
//! from ([`UsageSource`]), how a request ended ([`StreamOutcome`]), what a node says about itself
//! ([`NodeDescriptor`]), the [`RequestPeek`]: the handful of fields the gateway reads from an
//! OpenAI request body without touching the rest, the [`RequestKind`] (which endpoint),
//! [`prompt_inputs`] (the prompts of a completions or embeddings body), [`validate_chat_messages`],
//! and the
//! [`NodeSlot`] through which the router tells the metering layer which node it picked, and the
//! [`ClassifyBody`] hook through which the router asks the metering crate whether a response body
//! has started (retries before the first byte, design brief §5), and the [`ModelTrust`] through
//! which the auditor tells the router which nodes failed their model's audit (§10). One request
//! travels typed once: the edge's [`RequestContext`] and the metering layer's
//! [`BufferedRequest`] (its body collected and parsed once), read by the layers below. The
//! service a layer wraps meets [`UpstreamService`]; [`inner_service_accessors!`] writes a
//! layer's accessors over it.
//!
//! It starts no runtime and does no I/O (design brief §3).

mod classify;
mod ids;
mod node;
mod peek;
mod request;
mod service;
mod slot;
mod time;
mod trust;
mod usage;

pub use classify::{
    is_event_stream, is_event_stream_response, BodyClassifier, BodySignal, ClassifyBody, FirstBytes,
};
pub use ids::{AccountId, ModelId, NodeId, OperatorId, RequestId};
pub use node::{Endpoints, EngineKind, ModelDescriptor, NodeDescriptor};
pub use peek::{
    check_metadata, check_output_constraint, check_stop, check_tool_count, check_tools, check_user,
    conversation_key, prompt_inputs, validate_chat_messages, JsonKey, PeekError, PromptSegment,
    RequestKind, RequestPeek, CHAT_COMPLETIONS_MEMBERS, COMPLETIONS_MEMBERS, EMBEDDINGS_MEMBERS,
    ENGINE_GENERATION_FIELDS, MAX_COMPLETION_LOGPROBS, MAX_MAX_TOKENS, MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS, MAX_METADATA_VALUE_CHARS, MAX_N, MAX_OUTPUT_CONSTRAINT_BYTES,
    MAX_STOP_BYTES, MAX_STOP_SEQUENCES, MAX_TOOLS, MAX_TOP_LOGPROBS, MAX_USER_CHARS, NOT_SERVED,
    SAMPLING_EXTRAS, TOKENIZATION_CONSTRAINT_FIELDS,
};
pub use request::{BufferedRequest, RequestContext};
pub use service::{closed_before_answer, UpstreamService};
pub use slot::{NodeFault, NodeSlot, PromptTokens};
pub use time::unix_time_ms;
pub use trust::{AuditVerdict, ModelTrust};
pub use usage::{StreamOutcome, Usage, UsageSource};

/// `parts` copied, in order, into one allocation of exactly their length: what a joined or kept
/// frame holds is then what it is counted for (a slice of a larger buffer, or a buffer with
/// spare capacity, would hold more memory than its length says).
pub fn concat_exact<'a, I>(parts: I) -> bytes::Bytes
where
    I: IntoIterator<Item = &'a bytes::Bytes>,
    I::IntoIter: Clone,
{
    let parts = parts.into_iter();
    let len = parts.clone().map(bytes::Bytes::len).sum();
    let mut one = Vec::with_capacity(len);
    for part in parts {
        one.extend_from_slice(part);
    }
    bytes::Bytes::from(one)
}

/// A type-erased error, as tower and hyper use it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The body type spine's layers pass between each other: bytes with a boxed error.
pub type BoxBody = http_body_util::combinators::UnsyncBoxBody<bytes::Bytes, BoxError>;
