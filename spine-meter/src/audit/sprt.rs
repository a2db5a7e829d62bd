//! The sequential test over audit observations, kept running (design brief §10): a test
//! martingale (an *e-process*) per (node, model), with Ville's inequality as its error bound.
//!
//! Each scored position of an audited completion ([`super::observations`]) multiplies the
//! node's *wealth* `M` (start `M = 1`) by a factor whose expectation is at most 1 when the node
//! serves the reference's model (H0):
//!
//! - **greedy** positions: Wald's likelihood ratio of a Bernoulli event, `p1/p0` for an event
//!   and `(1−p1)/(1−p0)` otherwise (A. Wald, *Sequential Tests of Statistical Hypotheses*,
//!   Ann. Math. Statist. 16, 1945). Its expectation is `≤ 1` whenever the event rate is
//!   `≤ p0`: that rate is an *assumption* about honest nondeterminism (near-ties flipped by
//!   threads, slots, batching), set above the rates measured in `docs/trust.md`;
//! - **sampled** positions: a bet `1 + λ·(s − h)/c` on the excess surprisal (surprisal `s` of
//!   the delivered text, its bound `h`, both clipped at the position's cap `c`, see
//!   [`super::score`]). `E[s] ≤ h` for an honest node is a *theorem* for any temperature up to
//!   the request's and any truncation (top-k, top-p, min-p), so the factor's expectation is
//!   `≤ 1`; it is positive since `s − h ≥ −c` and `λ < 1`. The bet size is not known in
//!   advance: `M` is the average of [`BETS`] wealths, one per `λ` in
//!   [`SprtConfig::sampled_bets`] (an average of e-processes is one; it costs `ln BETS` nats
//!   against the best of them).
//!
//! `Λ = ln M` is compared with `a = ln(1/α)` (`failed`) and `b = ln β` (`passing`). Under H0,
//! `M` is a non-negative supermartingale, so by Ville's inequality (J. Ville, *Étude critique de
//! la notion de collectif*, 1939) `P(Λ ever ≥ a) ≤ α`, at any stopping time, however many
//! audits. Audits go on after a node passes: `M` is not let below `e^b = β` (at the floor every
//! wealth restarts at `β`), so a node that turns dishonest later climbs from `b`, not from far
//! below it. A restart at position `j` is a fresh e-process started at `β`, which reaches `1/α`
//! with probability `≤ αβ` (Ville again); a union over the start and the `n` positions where
//! restarts can happen bounds **the probability that an honest node is ever failed within `n`
//! observed positions by `α·(1 + n·β)`** (defaults: `2.1·10⁻⁴` for `n = 2,000`).
//!
//! `β` is not a miss rate here (the test has no fixed alternative): it sets the floor, and with
//! it the `passing` verdict and the bound above.

use serde::Serialize;

/// Bet sizes averaged on sampled positions.
pub const BETS: usize = 4;

/// Which statistic produced an observation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ObservationKind {
    /// A greedy request's position (see [`Observation::Greedy`]).
    Greedy,
    /// A sampled request's position (see [`Observation::Sampled`]).
    Sampled,
    /// A position scored on the node's own logprob (see [`Observation::Logprob`]).
    Logprob,
}

/// One scored position.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Observation {
    /// A greedy request's position whose reference top-1 is clear.
    Greedy {
        /// The delivered text does not continue with the reference's top-1 token.
        event: bool,
    },
    /// A sampled request's position. All three in nats, `0 ≤ surprisal, bound ≤ cap`.
    Sampled {
        /// The delivered text's surprisal under the reference, clipped at `cap` (a lower bound
        /// of the node's token's `−ln p`).
        surprisal: f64,
        /// An upper bound of the clipped surprisal's expectation for an honest node.
        bound: f64,
        /// The position's clipping cap.
        cap: f64,
    },
    /// A position of a node that reports its logprobs ([`super::node_logprobs`]): the node's
    /// claimed logprob of its own token against the reference's, greedy or sampled alike.
    Logprob {
        /// `|claimed − reference|`, nats.
        delta: f64,
        /// `delta` exceeded [`ScoreConfig::logprob_event_nats`](super::ScoreConfig::logprob_event_nats)
        /// (or the node sent no usable list).
        event: bool,
    },
}

impl Observation {
    /// The statistic.
    pub fn kind(&self) -> ObservationKind {
        match self {
            Self::Greedy { .. } => ObservationKind::Greedy,
            Self::Sampled { .. } => ObservationKind::Sampled,
            Self::Logprob { .. } => ObservationKind::Logprob,
        }
    }

    /// Whether the position counts as a disagreement in the evidence shown to operators:
    /// greedy, the top-1 did not continue the text; sampled, the surprisal exceeded its bound.
    pub fn is_event(&self) -> bool {
        match *self {
            Self::Greedy { event } | Self::Logprob { event, .. } => event,
            Self::Sampled {
                surprisal, bound, ..
            } => surprisal > bound,
        }
    }
}

/// Error rates and design rates of the test. [`Default`] gives the documented values.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct SprtConfig {
    /// Bound of the probability that the test ever fails an honest node without a restart
    /// (see the module docs for the bound with restarts). Default 1e-5: on the replies of
    /// `docs/trust.md`, 1e-4 failed 2 of 10 sampled Q2_K runs within 300 tokens, 1e-5 one,
    /// 1e-6 none; the greedy substitutes' detections within 300 were the same for all three.
    pub alpha: f64,
    /// The floor of the wealth, `e^b`: reaching it is `passing`. Default 1e-2.
    pub beta: f64,
    /// Highest event rate of an honest node at a clear greedy position (an assumption the
    /// honest matrix of `docs/trust.md` measured far below). Default 0.002.
    pub greedy_p0: f64,
    /// The event rate of a substitute the greedy likelihood ratio is designed for. Default 0.08.
    pub greedy_p1: f64,
    /// The bet sizes `λ ∈ (0, 1)` averaged on sampled positions. Default 0.3, 0.5, 0.7, 0.9
    /// (the substitutes' sampled replies in `docs/trust.md` grow the wealth fastest at the
    /// large ones; the small ones lose less on honest nodes).
    pub sampled_bets: [f64; BETS],
    /// Highest event rate of an honest node at a node-logprob position (|Δ| above
    /// [`ScoreConfig::logprob_event_nats`](super::ScoreConfig::logprob_event_nats); an
    /// assumption). Default 0.001: the honest runs of `docs/trust.md` had 3 events in
    /// 230,089 positions (one-sided 95 % bound 3.4·10⁻⁵, 29× under it); 0.005 before, which
    /// let a substitute whose first reply agreed with the model climb back from the floor
    /// too slowly (greedy Q2_K: 34 of 35 runs failed within 300 audited tokens).
    pub logprob_p0: f64,
    /// The event rate of a substitute the node-logprob likelihood ratio is designed for.
    /// Default 0.10.
    pub logprob_p1: f64,
}

impl Default for SprtConfig {
    fn default() -> Self {
        Self {
            alpha: 1e-5,
            beta: 1e-2,
            greedy_p0: 0.002,
            greedy_p1: 0.08,
            sampled_bets: [0.3, 0.5, 0.7, 0.9],
            logprob_p0: 0.001,
            logprob_p1: 0.10,
        }
    }
}

impl SprtConfig {
    /// Sets α and β.
    pub fn with_error_rates(mut self, alpha: f64, beta: f64) -> Self {
        self.alpha = alpha;
        self.beta = beta;
        self
    }

    /// The rejection boundary `a = ln(1/α)` (Ville's inequality).
    pub fn fail_threshold(&self) -> f64 {
        (1.0 / self.alpha).ln()
    }

    /// The floor and acceptance boundary `b = ln β` (negative).
    pub fn pass_threshold(&self) -> f64 {
        self.beta.ln()
    }

    /// The bound of the probability that an honest node is ever failed within `n` observed
    /// positions: `α·(1 + n·β)` (module docs).
    pub fn false_fail_bound(&self, n: u64) -> f64 {
        self.alpha * (1.0 + n as f64 * self.beta)
    }

    /// The log-wealth step of a greedy observation (Wald's log-likelihood ratio).
    pub fn greedy_step(&self, event: bool) -> f64 {
        if event {
            (self.greedy_p1 / self.greedy_p0).ln()
        } else {
            ((1.0 - self.greedy_p1) / (1.0 - self.greedy_p0)).ln()
        }
    }

    /// The log-wealth step of a node-logprob observation (Wald's log-likelihood ratio of a
    /// Bernoulli event, `logprob_p1` against `logprob_p0`).
    pub fn logprob_step(&self, event: bool) -> f64 {
        if event {
            (self.logprob_p1 / self.logprob_p0).ln()
        } else {
            ((1.0 - self.logprob_p1) / (1.0 - self.logprob_p0)).ln()
        }
    }

    /// Whether the rates make a test: `0 < α, β < 1/2`, `0 < p0 < p1 < 1`, every bet in
    /// `(0, 1)`.
    pub fn is_valid(&self) -> bool {
        let rate = |x: f64| x > 0.0 && x < 0.5;
        rate(self.alpha)
            && rate(self.beta)
            && self.greedy_p0 > 0.0
            && self.greedy_p0 < self.greedy_p1
            && self.greedy_p1 < 1.0
            && self.logprob_p0 > 0.0
            && self.logprob_p0 < self.logprob_p1
            && self.logprob_p1 < 1.0
            && self.sampled_bets.iter().all(|&l| l > 0.0 && l < 1.0)
    }
}

/// The running test of one (node, model).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Sprt {
    /// The statistic Λ now: the log of the average wealth.
    pub llr: f64,
    /// The log of each bet size's wealth ([`SprtConfig::sampled_bets`], same order).
    pub log_wealth: [f64; BETS],
    /// Positions observed.
    pub observations: u64,
    /// Of which events ([`Observation::is_event`]).
    pub events: u64,
    /// Whether Λ has reached the acceptance boundary at least once.
    pub passed_once: bool,
    /// Whether Λ reached the rejection boundary (absorbing until [`Sprt::default`] again).
    pub rejected: bool,
}

impl Sprt {
    /// Adds one observation. A rejected test stays rejected; a sampled observation whose
    /// numbers are not finite or whose cap is not positive is ignored.
    pub fn observe(&mut self, config: &SprtConfig, obs: Observation) {
        if self.rejected {
            return;
        }
        match obs {
            Observation::Greedy { event } => {
                let step = config.greedy_step(event);
                self.log_wealth.iter_mut().for_each(|w| *w += step);
            }
            Observation::Logprob { event, .. } => {
                let step = config.logprob_step(event);
                self.log_wealth.iter_mut().for_each(|w| *w += step);
            }
            Observation::Sampled {
                surprisal,
                bound,
                cap,
            } => {
                let finite = surprisal.is_finite() && bound.is_finite() && cap.is_finite();
                if !finite || cap <= 0.0 {
                    return;
                }
                let x = ((surprisal - bound) / cap).clamp(-1.0, 1.0);
                for (w, l) in self.log_wealth.iter_mut().zip(config.sampled_bets) {
                    *w += (l * x).ln_1p();
                }
            }
        }
        self.observations += 1;
        self.events += u64::from(obs.is_event());
        self.llr = log_mean_exp(&self.log_wealth);
        let floor = config.pass_threshold();
        if self.llr <= floor {
            self.llr = floor;
            self.log_wealth = [floor; BETS];
            self.passed_once = true;
        }
        if self.llr >= config.fail_threshold() {
            self.rejected = true;
        }
    }

    /// The verdict the test gives now: `failed` once rejected; `suspect` past half the
    /// rejection boundary; `passing` once the acceptance boundary was reached; else
    /// `unverified`.
    pub fn verdict(&self, config: &SprtConfig) -> spine_core::AuditVerdict {
        use spine_core::AuditVerdict as V;
        if self.rejected {
            V::Failed
        } else if self.llr >= config.fail_threshold() / 2.0 {
            V::Suspect
        } else if self.passed_once {
            V::Passing
        } else {
            V::Unverified
        }
    }
}

fn log_mean_exp(xs: &[f64; BETS]) -> f64 {
    let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    max + (xs.iter().map(|x| (x - max).exp()).sum::<f64>() / BETS as f64).ln()
}
