//! Per-position statistics of an audited completion against the reference's probabilities.
//!
//! The reference is teacher-forced through the delivered text tokenized by the reference itself
//! ([`ScoredToken`]s in order). The node's own token ids are not known (the engine's text is all
//! that is delivered, and a node could lie about ids), and re-tokenizing the text does not always
//! give the node's tokens (a Spanish reply generated as `[90, 17476]` re-tokenizes as
//! `[16864, 315]`). So each statistic asks about the **text**, not the token id: at a position
//! whose remaining delivered text is `rest`, a reference token *agrees* when its bytes are a
//! prefix of `rest` (or `rest` a prefix of them at the end of the captured text). An honest node
//! whose tokenization differed still agrees: its token is a prefix of `rest` too.
//!
//! - **Greedy** requests: a position counts only where the reference's top-1 probability exceeds
//!   its top-2 by more than [`ScoreConfig::greedy_margin`] (honest configurations — threads,
//!   slots, flash attention, batch — flip near-ties; `docs/trust.md`); event = the top-1 token
//!   does not agree.
//! - **Sampled** requests (temperature in (0, 1]): the reference's *head* is its most probable
//!   tokens holding `1 − tail_mass` of the probability; event = no head token agrees. An honest
//!   node samples outside the head with probability at most `tail_mass` whatever its temperature
//!   (≤ 1: cooling moves mass from the tail to the head) and truncation (top-k, top-p, min-p
//!   only cut the tail). A position whose listed top tokens hold less than `1 − tail_mass` does
//!   not count (its head is not known).
//!
//! The last position is never scored: a stop sequence or the capture cap may cut its token.

use super::sprt::{Observation, ObservationKind};

/// One teacher-forced position from the reference.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScoredToken {
    /// The forced token's bytes.
    pub bytes: Vec<u8>,
    /// The reference's most probable tokens at this position, any order (at least two for a
    /// greedy position to count).
    pub top: Vec<TopToken>,
}

/// One of the reference's most probable tokens at a position.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TopToken {
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// Natural log of its probability under the reference's raw distribution (temperature 1,
    /// before any sampler).
    pub logprob: f64,
}

/// How the audited request sampled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SamplingMode {
    /// Temperature 0 (or `top_k: 1`).
    Greedy,
    /// Temperature in (0, 1].
    Sampled,
}

/// Constants of the statistics. [`Default`] gives the documented values.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct ScoreConfig {
    /// Least top-1 − top-2 probability at which a greedy position counts. Default 0.1.
    pub greedy_margin: f64,
    /// Probability mass left outside a sampled position's head. Default 0.01.
    pub tail_mass: f64,
}

impl Default for ScoreConfig {
    fn default() -> Self {
        Self {
            greedy_margin: 0.1,
            tail_mass: 0.01,
        }
    }
}

/// Why a reference's scoring could not be used (the audit is inconclusive, never the node's
/// fault).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScoreError {
    /// The forced tokens do not spell the delivered text.
    #[error("the reference's forced tokens do not spell the delivered text (at byte {0})")]
    TextMismatch(usize),
}

fn agrees(piece: &[u8], rest: &[u8]) -> bool {
    !piece.is_empty() && (rest.starts_with(piece) || piece.starts_with(rest))
}

/// The observations of one audited completion: `tokens` are the reference's forced positions
/// over `text` (the delivered text of choice 0, possibly cut at the capture cap), in order.
///
/// # Errors
///
/// [`ScoreError::TextMismatch`] when the forced tokens' bytes are not `text` (a prefix of it is
/// allowed: the reference may have scored fewer tokens).
pub fn observations(
    tokens: &[ScoredToken],
    text: &[u8],
    mode: SamplingMode,
    config: &ScoreConfig,
) -> Result<Vec<Observation>, ScoreError> {
    let mut out = Vec::with_capacity(tokens.len());
    let mut offset = 0usize;
    let scored = tokens.len().saturating_sub(1);
    for (i, t) in tokens.iter().enumerate() {
        let rest = &text[offset.min(text.len())..];
        if !rest.starts_with(&t.bytes) {
            return Err(ScoreError::TextMismatch(offset));
        }
        if i < scored {
            if let Some(obs) = position(t, rest, mode, config) {
                out.push(obs);
            }
        }
        offset += t.bytes.len();
    }
    Ok(out)
}

fn position(
    t: &ScoredToken,
    rest: &[u8],
    mode: SamplingMode,
    config: &ScoreConfig,
) -> Option<Observation> {
    let mut top: Vec<&TopToken> = t.top.iter().filter(|p| p.logprob.is_finite()).collect();
    top.sort_by(|a, b| b.logprob.total_cmp(&a.logprob));
    match mode {
        SamplingMode::Greedy => {
            let p1 = top.first()?.logprob.exp();
            let p2 = top.get(1)?.logprob.exp();
            (p1 - p2 > config.greedy_margin).then(|| Observation {
                kind: ObservationKind::Greedy,
                event: !agrees(&top[0].bytes, rest),
            })
        }
        SamplingMode::Sampled => {
            let mut mass = 0.0;
            let mut head = 0;
            for p in &top {
                mass += p.logprob.exp();
                head += 1;
                if mass >= 1.0 - config.tail_mass {
                    break;
                }
            }
            (mass >= 1.0 - config.tail_mass).then(|| Observation {
                kind: ObservationKind::Sampled,
                event: !top[..head].iter().any(|p| agrees(&p.bytes, rest)),
            })
        }
    }
}
