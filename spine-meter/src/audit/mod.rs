//! Trust rung 1 (design brief §10): catching a node that serves another model.
//!
//! What is promised is *statistical* detection, not proof: a node that serves other weights
//! under a model's name is caught with stated error rates after a number of audited tokens; no
//! single request is verified.
//!
//! - The metering layer offers each completed request's choice-0 text to an [`AuditTap`]
//!   ([`MeterLayer::audit`](crate::meter::MeterLayer::audit)) after the caller was answered.
//! - The [`Auditor`] flips a coin per request (a higher rate for new and suspect nodes),
//!   queues the chosen ones and scores them on a trusted [`Reference`] — an engine the gateway's
//!   operator runs with the model's exact weights ([`LlamaCppReference`]) — off the request
//!   path: the reference is teacher-forced through the delivered text and reports its
//!   probabilities at each position.
//! - Each position becomes one observation ([`observations`]: top-1 agreement at clear greedy
//!   positions; the surprisal of the text against a proven bound of an honest node's expected
//!   surprisal at sampled ones, both judged on the delivered text), fed to a per-(node, model)
//!   sequential test ([`Sprt`]: an e-process, Wald's likelihood ratio on greedy positions and a
//!   bounded bet on sampled ones) that fails an honest node with probability at most α.
//! - The verdict ([`spine_core::AuditVerdict`]) reaches the router through
//!   [`spine_core::ModelTrust`]: a `failed` node is not routed that model until
//!   [`Auditor::reverify`].
//! - Models configured with node logprobs ([`node_logprobs`]) are scored on the node's own
//!   token choices instead: the metering layer asks the node for its logprobs (the caller
//!   never sees them unless it asked), and each position compares the node's claimed logprob
//!   of its token with the reference's, teacher-forced through the same tokens
//!   ([`Reference::force`]).
//! - [`EscrowOnVerdict`] (an [`AuditEvents`]) pays a node's escrowed earnings to its operator
//!   when it reaches `passing` and keeps them when it reaches `failed`.
//! - [`Challenges`] sends nodes with little traffic plausible chats ([`challenge_body`]) on the
//!   normal path, so that their models are audited too.
//!
//! Measurements (honest configurations, substitutes, costs) are in `docs/trust.md`.

mod auditor;
mod challenge;
mod challenges;
mod escrow;
pub mod node_logprobs;
mod reference;
mod request;
mod score;
mod settings;
mod sprt;

pub use auditor::{
    AuditAlways, AuditConfig, AuditCounters, AuditEvents, AuditSample, AuditStatus, AuditTap,
    Auditor,
};
pub use challenge::challenge_body;
pub use challenges::{ChallengeFuture, Challenges, CHALLENGE_TIMEOUT};
pub use escrow::EscrowOnVerdict;
pub use node_logprobs::{
    align, judge_node_list, parse_node_logprobs, NodeList, NodeLogprobs, NodeLogprobsError,
    NodeToken, TokenVocabulary, VocabularyError,
};
#[cfg(feature = "llama-reference")]
pub use reference::LlamaCppReference;
pub use reference::{
    ForceFuture, ForceQuery, ForcedToken, Reference, ReferenceError, ReferenceQuery, ReferenceSet,
    ScoreFuture,
};
pub use request::{auditable, AuditPrompt, AuditableRequest, NotAuditable};
pub use score::{observations, SamplingMode, ScoreConfig, ScoreError, ScoredToken, TopToken};
pub use settings::{AuditSettings, AuditSettingsError, AuditedModel};
pub use sprt::{Observation, ObservationKind, Sprt, SprtConfig, BETS};

#[cfg(test)]
mod tests;
