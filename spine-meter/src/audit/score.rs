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
//! - **Sampled** requests (temperature `T` in (0, 1]; 1 when the request names none): the
//!   *surprisal* `s = −ln p` of the delivered text under the reference, compared with a bound
//!   `h` of its expectation for an honest node ([`Observation::Sampled`]).
//!
//! ## The sampled bound
//!
//! Let `p` be the reference's raw distribution at a position and `g = min(−ln p, c)` the
//! surprisal clipped at a cap `c`. An honest node samples from `q ∝ p^(1/T')` restricted to an
//! *upper set* `S` of `p` (the most probable tokens: top-k, top-p and min-p all keep such a set,
//! before or after the temperature) with `T' ≤ T ≤ 1`. Then `E_q[g] ≤ E_{p_T}[g]` where
//! `p_T ∝ p^(1/T)`, because `g` is a non-increasing function of `p`:
//!
//! 1. *cooling*: for `q_b ∝ p^b`, `d/db E_{q_b}[g] = Cov_{q_b}(g, ln p) ≤ 0` (two oppositely
//!    monotone functions of the same variable are negatively correlated, Chebyshev's sum
//!    inequality), so `E[g]` only falls as `b = 1/T'` grows past `1/T`;
//! 2. *truncation*: on `S` every token's `g` is at most `g` off `S`, so `g`'s mean over `S`
//!    (under any distribution proportional to `p_T` on `S`) is at most its mean over all tokens.
//!
//! (At `T = 1`, `E_p[−ln p]` is the entropy: an honest node's expected surprisal is at most the
//! reference's entropy.) The reference lists only its most probable tokens `L` (40); every
//! unlisted token has `p ≤ p_min`, the least listed one. With `c ≤ −ln p_min` every unlisted
//! token has `g = c`, so
//!
//! `h = (Σ_{i∈L} p_i^(1/T) g_i + U·c) / (Σ_{i∈L} p_i^(1/T) + U)`, `U = (1 − Σ_L p_i)·p_min^(1/T − 1)`
//!
//! bounds `E_{p_T}[g]` from above (`U` is the most the unlisted tokens can weigh under `p_T`, and
//! more weight on `c`, the largest `g`, only raises the mean). The cap is
//! `c = min(`[`ScoreConfig::surprisal_cap`]`, −ln p_min)`.
//!
//! The delivered token is not known, only the text: its surprisal is taken as that of the most
//! probable listed token that agrees, `min(−ln max p_agreeing, c)`, or `c` when none agrees. The
//! node's own token is among the agreeing ones or unlisted (then `p ≤ p_min ≤` any agreeing
//! one's), so this is at most its `g`: the bound holds for it too. It assumes the node's token
//! boundaries are the reference's at the positions scored; a node whose tokenization differed
//! is scored at positions it never sampled (measured in `docs/trust.md`).
//!
//! The last position is never scored: a stop sequence or the capture cap may cut its token.

use super::sprt::Observation;

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
    /// Sampled at a temperature in (0, 1] (with any truncation).
    Sampled {
        /// The request's temperature, or 1 when it named none (the highest an audited request
        /// may use; a node's lower default only lowers the expected surprisal).
        temperature: f64,
    },
}

/// Constants of the statistics. [`Default`] gives the documented values.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct ScoreConfig {
    /// Least top-1 − top-2 probability at which a greedy position counts. Default 0.1.
    pub greedy_margin: f64,
    /// Most a sampled position's surprisal counts, in nats (the cap `c` of the module docs,
    /// lowered at a position to `−ln` of its least listed probability). Default 3: of 2, 3, 4
    /// and 8 on the sampled substitutes' replies of `docs/trust.md`, 2 and 3 detect the Q2_K
    /// substitute soonest, 3 the canned text sooner than 2; any cap keeps the bound.
    pub surprisal_cap: f64,
    /// Least `|claimed − reference|` logprob difference at which a node-logprob position is an
    /// event, nats ([`super::node_logprobs`]). Default 1.0 (honest configurations of
    /// `docs/trust.md` differ by far less).
    pub logprob_event_nats: f64,
}

impl Default for ScoreConfig {
    fn default() -> Self {
        Self {
            greedy_margin: 0.1,
            surprisal_cap: 3.0,
            logprob_event_nats: 1.0,
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
            (p1 - p2 > config.greedy_margin).then(|| Observation::Greedy {
                event: !agrees(&top[0].bytes, rest),
            })
        }
        SamplingMode::Sampled { temperature } => sampled(&top, rest, temperature, config),
    }
}

/// The sampled observation of one position (module docs); `top` sorted by falling logprob.
fn sampled(
    top: &[&TopToken],
    rest: &[u8],
    temperature: f64,
    config: &ScoreConfig,
) -> Option<Observation> {
    if temperature.is_nan() || temperature <= 0.0 || temperature > 1.0 {
        return None;
    }
    // log-probabilities, at most 0 (a reference's rounding may list a little above)
    let lp: Vec<f64> = top.iter().map(|t| t.logprob.min(0.0)).collect();
    let (lp_max, lp_min) = (*lp.first()?, *lp.last()?);
    let cap = config.surprisal_cap.min(-lp_min);
    if cap.is_nan() || cap <= 0.0 {
        return None;
    }
    let best_agreeing = top
        .iter()
        .zip(&lp)
        .filter(|(t, _)| agrees(&t.bytes, rest))
        .map(|(_, lp)| *lp)
        .fold(f64::NEG_INFINITY, f64::max);
    let surprisal = (-best_agreeing).min(cap);
    // weights p_i^(1/T) relative to the top-1's (no underflow at low temperatures)
    let inv_t = 1.0 / temperature;
    let listed_mass: f64 = lp.iter().map(|l| l.exp()).sum();
    let unlisted = (1.0 - listed_mass).max(0.0) * ((inv_t - 1.0) * lp_min - inv_t * lp_max).exp();
    let (mut num, mut den) = (unlisted * cap, unlisted);
    for l in &lp {
        let w = (inv_t * (l - lp_max)).exp();
        num += w * (-l).min(cap);
        den += w;
    }
    let bound = (num / den).clamp(0.0, cap);
    Some(Observation::Sampled {
        surprisal,
        bound,
        cap,
    })
}
