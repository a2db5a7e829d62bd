//! Wald's sequential probability ratio test over audit observations, kept running (design brief
//! §10).
//!
//! Each scored position of an audited completion is one Bernoulli observation: an *event*
//! (the node's token disagrees with the reference, see [`super::score`]) or not. H0: the node
//! serves the reference's model, events occur with probability at most `p0`; H1: a substitute,
//! events with probability at least `p1`. The log-likelihood ratio
//! `Λ = Σ ln(p1/p0)` over events `+ Σ ln((1−p1)/(1−p0))` over non-events is compared with Wald's
//! boundaries (A. Wald, *Sequential Tests of Statistical Hypotheses*, Ann. Math. Statist. 16,
//! 1945): `a = ln((1−β)/α)` (reject H0: `failed`) and `b = ln(β/(1−α))` (accept H0: `passing`),
//! so one test falsely fails an honest node with probability ≤ α and passes a substitute with
//! probability ≤ β.
//!
//! Audits go on after a node passes: Λ is not let below `b` (the test restarts from its lower
//! boundary, a CUSUM-like floor), so a node that turns dishonest later climbs from `b`, not from
//! far below it. Each climb from `b` to `a` is one Wald test, so α bounds each such excursion;
//! the false-alarm rate over a run of many tokens is measured in `docs/trust.md`.
//! Each observation kind has its own `(p0, p1)` ([`ObservationKind`]).

use serde::Serialize;

/// Which statistic produced an observation; each has its own design rates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ObservationKind {
    /// A greedy request's position with a clear reference top-1: event = the node's text does
    /// not continue with the reference's top-1 token.
    Greedy,
    /// A sampled request's position: event = the node's text continues with none of the
    /// reference's head tokens (those holding `1 − tail_mass` of the probability).
    Sampled,
}

/// One scored position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Observation {
    /// The statistic.
    pub kind: ObservationKind,
    /// Whether the node's token disagreed with the reference.
    pub event: bool,
}

/// Error rates and design event rates of the test. [`Default`] gives the documented values.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct SprtConfig {
    /// Probability that one test fails an honest node (false accusation). Default 1e-4.
    pub alpha: f64,
    /// Probability that one test passes a substitute (miss). Default 1e-2.
    pub beta: f64,
    /// Highest event rate of an honest node at a clear greedy position. Default 0.01 (measured
    /// in the honest matrix of `docs/trust.md`: 8 in 27,281, 0.029 %).
    pub greedy_p0: f64,
    /// Lowest event rate of a substitute at a clear greedy position. Default 0.08 (a spike
    /// measured 0.17 for the Q2_K requantization and 0.33 for Gemma 3 270M at margin > 0.1).
    pub greedy_p1: f64,
    /// Highest event rate of an honest node at a sampled position: the tail mass
    /// ([`ScoreConfig::tail_mass`](super::ScoreConfig)), a bound that holds for any temperature
    /// ≤ 1 and any truncation (top-k, top-p, min-p). Default 0.01.
    pub sampled_p0: f64,
    /// Lowest event rate of a substitute at a sampled position. Default 0.05 (not met by the
    /// substitutes of `docs/trust.md`, whose sampled event rates were 0–2 %: the sampled
    /// statistic has little power).
    pub sampled_p1: f64,
}

impl Default for SprtConfig {
    fn default() -> Self {
        Self {
            alpha: 1e-4,
            beta: 1e-2,
            greedy_p0: 0.01,
            greedy_p1: 0.08,
            sampled_p0: 0.01,
            sampled_p1: 0.05,
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

    /// The rejection boundary `a = ln((1−β)/α)`.
    pub fn fail_threshold(&self) -> f64 {
        ((1.0 - self.beta) / self.alpha).ln()
    }

    /// The acceptance boundary `b = ln(β/(1−α))` (negative).
    pub fn pass_threshold(&self) -> f64 {
        (self.beta / (1.0 - self.alpha)).ln()
    }

    /// The log-likelihood-ratio step of one observation.
    pub fn step(&self, obs: Observation) -> f64 {
        let (p0, p1) = match obs.kind {
            ObservationKind::Greedy => (self.greedy_p0, self.greedy_p1),
            ObservationKind::Sampled => (self.sampled_p0, self.sampled_p1),
        };
        if obs.event {
            (p1 / p0).ln()
        } else {
            ((1.0 - p1) / (1.0 - p0)).ln()
        }
    }

    /// Whether the rates make a test: `0 < α, β < 1/2`, `0 < p0 < p1 < 1` for both kinds.
    pub fn is_valid(&self) -> bool {
        let rate = |x: f64| x > 0.0 && x < 0.5;
        let pair = |p0: f64, p1: f64| p0 > 0.0 && p0 < p1 && p1 < 1.0;
        rate(self.alpha)
            && rate(self.beta)
            && pair(self.greedy_p0, self.greedy_p1)
            && pair(self.sampled_p0, self.sampled_p1)
    }
}

/// The running test of one (node, model).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Sprt {
    /// The log-likelihood ratio Λ now.
    pub llr: f64,
    /// Positions observed.
    pub observations: u64,
    /// Of which events.
    pub events: u64,
    /// Whether Λ has reached the acceptance boundary at least once.
    pub passed_once: bool,
    /// Whether Λ reached the rejection boundary (absorbing until [`Sprt::default`] again).
    pub rejected: bool,
}

impl Sprt {
    /// Adds one observation. A rejected test stays rejected.
    pub fn observe(&mut self, config: &SprtConfig, obs: Observation) {
        if self.rejected {
            return;
        }
        self.observations += 1;
        self.events += u64::from(obs.event);
        self.llr += config.step(obs);
        let floor = config.pass_threshold();
        if self.llr <= floor {
            self.llr = floor;
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
