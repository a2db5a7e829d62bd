//! The reliability score of one node (design brief §5).
//!
//! ```text
//! score  = 0.5·success_rate_ema + 0.3·latency_score(ttft_ema_ms) + 0.2·uptime_score(last_seen)
//!          then, while a failure penalty p < 1 is in force: min(score, max(0.05, score·p))
//! weight = max(min(vram_mib, max_vram_mib), 1) · (0.2 + 0.8·score)
//! ```
//!
//! - **EMAs** use the factor [`ScoreConfig::ema_alpha`] (default 0.2): `ema ← ema + α·(x − ema)`,
//!   so the last sample weighs 20 % and a sample's weight halves after about 3 samples.
//!   `success_rate_ema` takes `x = 1` for a successful attempt and `x = 0` for a failed one (and
//!   for each usage discrepancy, design brief §6); it starts at 1 (an optimistic prior: a new node
//!   gets its full share at once and earns its score from there).
//! - **latency_score** (dimensionless, in (0, 1], higher is better) of the TTFT EMA in
//!   milliseconds: `ref / (ref + ttft_ema_ms)` with `ref` = [`ScoreConfig::latency_ref_ms`]
//!   (default 1,000 ms): 1 at 0 ms, 0.5 at 1 s, 0.17 at 5 s. A node with no TTFT sample yet scores 1.
//!   TTFT samples come from streamed responses only (time from sending the attempt to its first
//!   content event); a non-streamed body's first byte is the whole answer, not a TTFT.
//! - **uptime_score** (in [0, 1]) of the age of the node's last liveness confirmation (a tunnel
//!   heartbeat, the node becoming routable, or a successful response): 1 up to
//!   [`ScoreConfig::uptime_full_secs`] (default 30 s, a missed 10 s keepalive plus its 20 s
//!   timeout), then linear down to 0 at [`ScoreConfig::uptime_zero_secs`] (default 90 s).
//! - **failure penalty** `p` in (0, 1] (start 1), the multiplier that moves traffic away from a
//!   misbehaving node in seconds, where the EMA alone cannot (a node failing half its attempts
//!   still has `success_rate_ema` 0.5, score ≈ 0.7, and would keep ~80 % of a healthy share):
//!   - a **mid-request disconnect** (the node's body broke after the response head) halves it:
//!     `p ← p·0.5` (design brief §5);
//!   - any **other node-fault failure** (connect failure, 5xx / 408 / 429, error event or empty
//!     stream before any content, no first content in time, a usage discrepancy) multiplies it by
//!     [`ScoreConfig::failure_penalty_factor`] (default 0.8);
//!   - a **success** gives back a share [`ScoreConfig::success_recovery`] (default 0.05) of what is
//!     missing: `p ← p + (1 − p)·0.05`;
//!   - and with time it recovers towards 1 with a half-life of
//!     [`ScoreConfig::penalty_half_life_secs`] (default 60 s): `p(t) = 1 − (1 − p₀)·2^(−t/h)`, so
//!     a node that gets no traffic is not punished for ever.
//!
//!   While `p < 1` the score is `min(score, max(0.05, score·p))`: never below the floor 0.05 (and
//!   never above the unpenalised score). The failures and successes balance at a penalty that falls
//!   with the failure rate: a node failing 1 attempt in 20 settles near `p` ≈ 0.9, 1 in 5 near 0.5,
//!   1 in 2 near 0.2 (its share of 10 equal nodes falls from 10 % to under 4 %), and one dropping
//!   half its streams mid-request near 0.1.
//!
//! Time is `tokio::time::Instant`, so tests run the score on tokio's paused clock.

use std::time::Duration;

use tokio::time::Instant;

/// Floor of a penalised score (design brief §5).
pub const DISCONNECT_SCORE_FLOOR: f64 = 0.05;

/// Constants of the score. [`Default`] gives the values stated in the module docs.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct ScoreConfig {
    /// EMA factor α in (0, 1]: the weight of the newest sample. Default 0.2.
    pub ema_alpha: f64,
    /// TTFT at which `latency_score` is 0.5, milliseconds. Default 1,000.
    pub latency_ref_ms: f64,
    /// Liveness age up to which `uptime_score` is 1, seconds. Default 30.
    pub uptime_full_secs: f64,
    /// Liveness age at which `uptime_score` reaches 0, seconds. Default 90.
    pub uptime_zero_secs: f64,
    /// Half-life of the failure penalty's recovery with time, seconds. Default 60.
    pub penalty_half_life_secs: f64,
    /// What a node-fault failure other than a mid-request disconnect multiplies the failure
    /// penalty by, in (0, 1]. Default 0.8. (A disconnect multiplies it by 0.5.)
    pub failure_penalty_factor: f64,
    /// The share of the missing penalty `1 − p` a success gives back, in [0, 1]. Default 0.05.
    pub success_recovery: f64,
}

impl Default for ScoreConfig {
    fn default() -> Self {
        Self {
            ema_alpha: 0.2,
            latency_ref_ms: 1_000.0,
            uptime_full_secs: 30.0,
            uptime_zero_secs: 90.0,
            penalty_half_life_secs: 60.0,
            failure_penalty_factor: 0.8,
            success_recovery: 0.05,
        }
    }
}

impl ScoreConfig {
    /// `ref / (ref + ttft_ms)`; 1 when there is no sample yet.
    pub fn latency_score(&self, ttft_ema_ms: Option<f64>) -> f64 {
        match ttft_ema_ms {
            None => 1.0,
            Some(ms) => {
                let reference = self.latency_ref_ms.max(f64::MIN_POSITIVE);
                reference / (reference + ms.max(0.0))
            }
        }
    }

    /// 1 up to `uptime_full_secs`, linear to 0 at `uptime_zero_secs`.
    pub fn uptime_score(&self, age: Duration) -> f64 {
        let age_secs = age.as_secs_f64();
        if age_secs <= self.uptime_full_secs {
            1.0
        } else if age_secs >= self.uptime_zero_secs {
            0.0
        } else {
            1.0 - (age_secs - self.uptime_full_secs)
                / (self.uptime_zero_secs - self.uptime_full_secs)
        }
    }

    fn alpha(&self) -> f64 {
        if self.ema_alpha.is_finite() {
            self.ema_alpha.clamp(f64::MIN_POSITIVE, 1.0)
        } else {
            0.2
        }
    }
}

/// The score and its parts at one instant, as the admin API shows them.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct ScoreParts {
    /// The final score in [0, 1], higher is better.
    pub score: f64,
    /// Success rate EMA in [0, 1].
    pub success_rate_ema: f64,
    /// TTFT EMA in milliseconds; `None` before the first streamed sample.
    pub ttft_ema_ms: Option<f64>,
    /// `latency_score(ttft_ema_ms)` in (0, 1].
    pub latency_score: f64,
    /// `uptime_score(last_seen)` in [0, 1].
    pub uptime_score: f64,
    /// Seconds since the last liveness confirmation.
    pub last_seen_secs: f64,
    /// The failure penalty now, in (0, 1]; 1 = none.
    pub failure_penalty: f64,
}

/// The mutable state behind one node's score.
#[derive(Clone, Debug)]
pub(crate) struct ScoreState {
    success_rate_ema: f64,
    ttft_ema_ms: Option<f64>,
    last_seen: Instant,
    penalty: f64,
    penalty_at: Instant,
}

impl ScoreState {
    pub(crate) fn new(now: Instant) -> Self {
        Self {
            success_rate_ema: 1.0,
            ttft_ema_ms: None,
            last_seen: now,
            penalty: 1.0,
            penalty_at: now,
        }
    }

    pub(crate) fn seen(&mut self, now: Instant) {
        self.last_seen = self.last_seen.max(now);
    }

    pub(crate) fn success(&mut self, cfg: &ScoreConfig, now: Instant) {
        self.success_rate_ema += cfg.alpha() * (1.0 - self.success_rate_ema);
        self.seen(now);
        let p = self.penalty_at(cfg, now);
        if p < 1.0 {
            let recovery = finite_or(cfg.success_recovery, 0.05).clamp(0.0, 1.0);
            self.set_penalty(p + (1.0 - p) * recovery, now);
        }
    }

    /// A node-fault failure other than a mid-request disconnect.
    pub(crate) fn failure(&mut self, cfg: &ScoreConfig, now: Instant) {
        self.fail_ema(cfg);
        let factor = finite_or(cfg.failure_penalty_factor, 0.8).clamp(f64::MIN_POSITIVE, 1.0);
        self.set_penalty(self.penalty_at(cfg, now) * factor, now);
    }

    fn fail_ema(&mut self, cfg: &ScoreConfig) {
        self.success_rate_ema += cfg.alpha() * (0.0 - self.success_rate_ema);
    }

    fn set_penalty(&mut self, p: f64, now: Instant) {
        // below the score floor a lower penalty changes nothing but the recovery time
        self.penalty = p.clamp(DISCONNECT_SCORE_FLOOR, 1.0);
        self.penalty_at = now;
    }

    pub(crate) fn ttft(&mut self, cfg: &ScoreConfig, ttft: Duration) {
        let ms = ttft.as_secs_f64() * 1_000.0;
        self.ttft_ema_ms = Some(match self.ttft_ema_ms {
            None => ms,
            Some(ema) => ema + cfg.alpha() * (ms - ema),
        });
    }

    pub(crate) fn disconnect(&mut self, cfg: &ScoreConfig, now: Instant) {
        self.fail_ema(cfg);
        self.set_penalty(self.penalty_at(cfg, now) * 0.5, now);
    }

    fn penalty_at(&self, cfg: &ScoreConfig, now: Instant) -> f64 {
        if self.penalty >= 1.0 {
            return 1.0;
        }
        let elapsed = now.saturating_duration_since(self.penalty_at).as_secs_f64();
        let half_life = finite_or(cfg.penalty_half_life_secs, 60.0).max(f64::MIN_POSITIVE);
        1.0 - (1.0 - self.penalty) * (-elapsed / half_life).exp2()
    }

    pub(crate) fn parts(&self, cfg: &ScoreConfig, now: Instant) -> ScoreParts {
        let age = now.saturating_duration_since(self.last_seen);
        let latency_score = cfg.latency_score(self.ttft_ema_ms);
        let uptime_score = cfg.uptime_score(age);
        let base = 0.5 * self.success_rate_ema + 0.3 * latency_score + 0.2 * uptime_score;
        let penalty = self.penalty_at(cfg, now);
        let score = if penalty < 1.0 {
            base.min((base * penalty).max(DISCONNECT_SCORE_FLOOR))
        } else {
            base
        };
        ScoreParts {
            score: score.clamp(0.0, 1.0),
            success_rate_ema: self.success_rate_ema,
            ttft_ema_ms: self.ttft_ema_ms,
            latency_score,
            uptime_score,
            last_seen_secs: age.as_secs_f64(),
            failure_penalty: penalty,
        }
    }
}

fn finite_or(x: f64, default: f64) -> f64 {
    if x.is_finite() {
        x
    } else {
        default
    }
}

/// `max(vram_mib, 1) · (0.2 + 0.8·score)` (design brief §5).
///
/// `vram_mib` is the node's own claim from its hello and is not verified: callers must cap it
/// first. [`NodeRegistry`](crate::NodeRegistry) passes `min(vram_mib, max_vram_mib)`
/// ([`RegistryConfig::max_vram_mib`](crate::RegistryConfig), default 192 GiB), so a node
/// claiming huge VRAM weighs no more than one with the cap.
pub fn weight(vram_mib: u64, score: f64) -> f64 {
    // u64 → f64 loses precision only above 2^53 MiB
    #[allow(clippy::cast_precision_loss)]
    let vram = vram_mib.max(1) as f64;
    vram * (0.2 + 0.8 * score.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests;
