//! Property: the weighted pick's frequencies match `weight / Σ weights` (design brief §5) for
//! any VRAM sizes and score histories, within each tier: when nodes both at or above and below
//! the healthy score (`RegistryConfig::healthy_score`, 0.5) have a free slot, those below share
//! `probe_share` (2 %) of the picks and the others the rest.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::HashMap;

use proptest::prelude::*;
use spine_core::{EngineKind, ModelDescriptor, ModelId, NodeDescriptor, NodeId};
use spine_router::NodeRegistry;

const PICKS: u32 = 20_000;

fn descriptor(vram_mib: u64) -> NodeDescriptor {
    NodeDescriptor {
        engine: EngineKind::LlamaCpp,
        models: vec![ModelDescriptor {
            id: ModelId::new("m"),
            max_context_tokens: None,
            endpoints: None,
        }],
        vram_mib,
        max_concurrency: 8,
        agent_version: "prop".into(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn pick_frequencies_match_weights(
        nodes in proptest::collection::vec((0u64..=81_920, 0u8..6, 0u8..3), 2..7)
    ) {
        // a runtime only for tokio's clock, which the score reads
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let _guard = rt.enter();
        let registry = NodeRegistry::new();
        for (i, (vram, failures, disconnects)) in nodes.iter().enumerate() {
            let id = NodeId::new(format!("n{i}"));
            registry.node_ready(&id, &descriptor(*vram));
            for _ in 0..*failures {
                registry.record_failure(&id);
            }
            for _ in 0..*disconnects {
                registry.record_disconnect(&id);
            }
        }
        let snapshot = registry.snapshot();
        let tier_total = |healthy: bool| -> f64 {
            snapshot.iter().filter(|s| (s.score.score >= 0.5) == healthy).map(|s| s.weight).sum()
        };
        let (above, below) = (tier_total(true), tier_total(false));
        let tiered = above > 0.0 && below > 0.0;
        // each node's expected share of the picks
        let shares: HashMap<NodeId, f64> = snapshot
            .iter()
            .map(|s| {
                let p = match (tiered, s.score.score >= 0.5) {
                    (false, _) => s.weight / (above + below),
                    (true, true) => 0.98 * s.weight / above,
                    (true, false) => 0.02 * s.weight / below,
                };
                (s.node_id.clone(), p)
            })
            .collect();
        let mut counts: HashMap<NodeId, u32> = HashMap::new();
        for _ in 0..PICKS {
            let lease = registry.pick(&ModelId::new("m")).unwrap();
            *counts.entry(lease.node().clone()).or_default() += 1;
        }
        for (id, &p) in &shares {
            let observed = f64::from(counts.get(id).copied().unwrap_or(0)) / f64::from(PICKS);
            // binomial: 5 standard deviations (false alarm < 1e-6 per node)
            let sd = (p * (1.0 - p) / f64::from(PICKS)).sqrt();
            prop_assert!(
                (observed - p).abs() <= 5.0 * sd + 1e-4,
                "node {id}: expected {p:.4}, observed {observed:.4} (shares {shares:?})"
            );
        }
    }
}
