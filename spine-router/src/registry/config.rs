use std::time::Duration;

use crate::queue::QueueConfig;
use crate::score::ScoreConfig;

/// Settings of a [`NodeRegistry`](crate::NodeRegistry). [`Default`] gives the documented values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RegistryConfig {
    /// The score's constants (see [`ScoreConfig`]).
    pub score: ScoreConfig,
    /// How long a conversation sticks to its node after its last request. Default 30 min;
    /// `Duration::ZERO` disables affinity.
    pub affinity_ttl: Duration,
    /// Most affinity entries kept (about 100 bytes each). Default 1,000,000.
    pub max_affinity_entries: usize,
    /// Most VRAM, MiB, a node's self-reported `vram_mib` counts for in its pick weight.
    /// Default 196,608 (192 GiB). The claim is not verified: under the cap a healthy node that
    /// claims more gets more traffic; a failing one is held to
    /// [`probe_share`](Self::probe_share) by [`healthy_score`](Self::healthy_score).
    pub max_vram_mib: u64,
    /// The admission queue used when every candidate node is full (see [`crate::queue`]).
    pub queue: QueueConfig,
    /// Load (`in_flight / max_concurrency`) at or above which a conversation's sticky node
    /// yields to another candidate whose load is lower by at least 0.5 (e.g. with 4 slots: the
    /// sticky node has 3 requests in flight, another node at most 1). Default 0.75; 1.0 or more:
    /// the sticky node yields only when full (the behaviour before load-aware picks).
    pub affinity_yield_load: f64,
    /// Whether a pick is load-aware: two weighted draws, the less loaded wins, and a sticky
    /// node yields at [`affinity_yield_load`](Self::affinity_yield_load). `false`: one weighted
    /// draw among the nodes with a free slot, and a sticky node yields only when full (the pick
    /// before load-aware picks; kept to measure one against the other). Default `true`.
    pub load_aware_pick: bool,
    /// Score below which a node gets only [`probe_share`](Self::probe_share) of the picks
    /// while a candidate at or above it has a free slot (all of them when none has). Default
    /// 0.5: an honest node's score stays above 0.7 whatever its latency and heartbeat age
    /// (`0.5·success + 0.3·latency + 0.2·uptime`) and falls below 0.5 only under failures or
    /// usage discrepancies (about three in a row), so a failing node cannot keep a model's
    /// traffic by claiming more VRAM than the others: its score lowers its weight 5× at most.
    /// 0: no tiers.
    pub healthy_score: f64,
    /// Share of picks, in [0, 1], that go to the candidates below
    /// [`healthy_score`](Self::healthy_score) when both tiers have a free slot: enough traffic
    /// for a recovered node's successes to lift its score back (at 200 requests/s, 4 a second).
    /// Default 0.02.
    pub probe_share: f64,
    /// Least time between two decreases of a node's learned concurrency limit (see
    /// [`NodeRegistry::record_overload`](crate::NodeRegistry::record_overload)): the requests
    /// of one burst that time out together lower it once. Default 5 s.
    pub overload_backoff: Duration,
    /// Longest time to first token of a success that counts towards growing a node's learned
    /// concurrency limit: a later first token is a request that waited in the node's queue, and
    /// starts the count again (without it a node that serves fewer requests than it claims
    /// grows back to the deadline and times out again). Default 60 s, half the router's default first-content
    /// deadline; the reference gateway sets half of its `first_token_timeout_secs`.
    /// Non-streamed successes (no TTFT) always count; `Duration::ZERO`: every success does.
    pub limit_growth_max_ttft: Duration,
    /// Longest pause after its first token a streamed answer may take before it counts as an
    /// overload signal for its node ([`NodeRegistry::record_pause`](crate::NodeRegistry::record_pause)):
    /// as long as a first token may take. An honest engine pauses its streams while it reads
    /// another request's prompt (measured: 3.5 s for 580 tokens on one CPU thread), which a
    /// shorter bound would take for a queue. Default 120 s, the router's default first-content
    /// deadline; the reference gateway sets its `first_token_timeout_secs`. `Duration::ZERO`:
    /// no pause is one.
    pub overload_pause: Duration,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            score: ScoreConfig::default(),
            affinity_ttl: Duration::from_secs(30 * 60),
            max_affinity_entries: 1_000_000,
            max_vram_mib: 196_608,
            queue: QueueConfig::default(),
            affinity_yield_load: 0.75,
            load_aware_pick: true,
            healthy_score: 0.5,
            probe_share: 0.02,
            overload_backoff: Duration::from_secs(5),
            limit_growth_max_ttft: Duration::from_secs(60),
            overload_pause: Duration::from_secs(120),
        }
    }
}
