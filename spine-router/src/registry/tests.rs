use super::*;

pub(crate) fn desc(models: &[&str], max_concurrency: u32) -> NodeDescriptor {
    spine_test_support::node_serving_models(models, max_concurrency, 0)
}

#[test]
fn picks_only_nodes_serving_the_model() {
    let r = NodeRegistry::new();
    r.node_ready(&NodeId::new("a"), &desc(&["m1"], 4));
    r.node_ready(&NodeId::new("b"), &desc(&["m2"], 4));
    for _ in 0..50 {
        let lease = r.pick(&ModelId::new("m2"));
        assert_eq!(lease.map(|l| l.node().clone()), Ok(NodeId::new("b")));
    }
    assert_eq!(
        r.pick(&ModelId::new("m3")).map(|l| l.node().clone()),
        Err(RouteError::NoNodeForModel(ModelId::new("m3")))
    );
    assert_eq!(r.models(), vec![ModelId::new("m1"), ModelId::new("m2")]);
}

#[test]
fn capacity_is_enforced_and_released() {
    let r = NodeRegistry::new();
    r.node_ready(&NodeId::new("a"), &desc(&["m"], 2));
    let l1 = r.pick(&ModelId::new("m"));
    let l2 = r.pick(&ModelId::new("m"));
    assert!(l1.is_ok() && l2.is_ok());
    assert_eq!(
        r.pick(&ModelId::new("m")).map(|l| l.node().clone()),
        Err(RouteError::AtCapacity(ModelId::new("m")))
    );
    assert_eq!(r.snapshot()[0].in_flight, 2);
    drop(l1);
    assert_eq!(r.snapshot()[0].in_flight, 1);
    assert!(r.pick(&ModelId::new("m")).is_ok());
}

#[test]
fn gone_nodes_are_not_picked() {
    let r = NodeRegistry::new();
    r.node_ready(&NodeId::new("a"), &desc(&["m"], 2));
    r.node_gone(&NodeId::new("a"));
    assert_eq!(
        r.pick(&ModelId::new("m")).map(|l| l.node().clone()),
        Err(RouteError::NoNodeForModel(ModelId::new("m")))
    );
    assert!(r.snapshot().is_empty());
}

#[test]
fn excluded_nodes_are_not_picked() {
    let r = NodeRegistry::new();
    r.node_ready(&NodeId::new("a"), &desc(&["m"], 9));
    r.node_ready(&NodeId::new("b"), &desc(&["m"], 9));
    for _ in 0..50 {
        let p = r.pick_for(&ModelId::new("m"), None, &[NodeId::new("a")]);
        assert_eq!(p.map(|p| p.lease.node().clone()), Ok(NodeId::new("b")));
    }
    assert_eq!(
        r.pick_for(
            &ModelId::new("m"),
            None,
            &[NodeId::new("a"), NodeId::new("b")]
        )
        .map(|p| p.sticky),
        Err(RouteError::NoNodeForModel(ModelId::new("m")))
    );
}

#[test]
fn claimed_vram_is_capped_in_the_weight() {
    let r = NodeRegistry::with_config(RegistryConfig {
        max_vram_mib: 1024,
        ..RegistryConfig::default()
    });
    let mut liar = desc(&["m"], 10_000);
    liar.vram_mib = u64::MAX / 2;
    let mut honest = desc(&["m"], 10_000);
    honest.vram_mib = 1024;
    r.node_ready(&NodeId::new("liar"), &liar);
    r.node_ready(&NodeId::new("honest"), &honest);
    let snap = r.snapshot();
    assert_eq!(snap[0].weight, snap[1].weight, "{snap:?}");
    // the claim counts up to the cap and no further: about half the picks each
    let mut liar_picks = 0u32;
    let mut leases = Vec::new();
    for _ in 0..2000 {
        let lease = r.pick(&ModelId::new("m"));
        assert!(lease.is_ok());
        if let Ok(lease) = lease {
            liar_picks += u32::from(lease.node().as_str() == "liar");
            leases.push(lease);
        }
    }
    assert!((800..1200).contains(&liar_picks), "{liar_picks}");
    // the default cap is 192 GiB
    assert_eq!(RegistryConfig::default().max_vram_mib, 196_608);
}

/// The attacker's case: a node flagged for usage discrepancies (score ≈ 0.25) that claims the
/// VRAM cap kept every request of its model against an honest node claiming none, because the
/// score lowers a weight 5× at most. Now it gets what the healthy node has no slot for, and
/// the probe share.
#[tokio::test(start_paused = true)]
async fn a_failing_node_gets_traffic_only_when_the_healthy_ones_are_full() {
    let m = ModelId::new("m");
    // a liar claiming all the VRAM there is, flagged 5 times, beside an honest 2-slot node
    let with = |config: RegistryConfig| {
        let r = NodeRegistry::with_config(config);
        let mut liar = desc(&["m"], 100);
        liar.vram_mib = u64::MAX;
        r.node_ready(&NodeId::new("liar"), &liar);
        r.node_ready(&NodeId::new("honest"), &desc(&["m"], 2));
        for _ in 0..5 {
            r.record_discrepancy(&NodeId::new("liar"));
        }
        r
    };
    let liar_picks = |r: &NodeRegistry, picks: usize| {
        (0..picks)
            .filter(|_| r.pick(&m).is_ok_and(|l| l.node().as_str() == "liar"))
            .count()
    };
    // no probes first: the tiers alone
    let r = with(RegistryConfig {
        probe_share: 0.0,
        ..RegistryConfig::default()
    });
    let liar_score = r.score(&NodeId::new("liar")).map(|s| s.score);
    assert!(liar_score.is_some_and(|s| s < 0.5), "{liar_score:?}");
    let snap = r.snapshot();
    let weight_of = |id: &str| {
        snap.iter()
            .find(|n| n.node_id.as_str() == id)
            .map_or(0.0, |n| n.weight)
    };
    // the weight alone still favours it by far: the tier is what decides
    assert!(weight_of("liar") > 1000.0 * weight_of("honest"), "{snap:?}");
    for _ in 0..200 {
        let lease = r.pick(&m);
        assert_eq!(lease.map(|l| l.node().clone()), Ok(NodeId::new("honest")));
    }
    // a conversation sticky to the failing node moves too
    let key = AffinityKey::PromptCacheKey("c".into());
    r.remember(&m, &key, &NodeId::new("liar"));
    let sticky = r.pick_for(&m, Some(&key), &[]);
    assert_eq!(
        sticky.map(|p| (p.lease.node().clone(), p.sticky)),
        Ok((NodeId::new("honest"), StickyOutcome::Miss))
    );
    // the honest node full (2 slots): the failing one takes the overflow rather than a refusal
    let held: Vec<_> = (0..2).map(|_| r.pick(&m)).collect();
    assert!(held
        .iter()
        .all(|l| l.as_ref().is_ok_and(|l| l.node().as_str() == "honest")));
    assert_eq!(
        r.pick(&m).map(|l| l.node().clone()),
        Ok(NodeId::new("liar"))
    );
    drop(held);
    // the default probe share: about 2 % of picks go to it while it is below the healthy score
    let probes = liar_picks(&with(RegistryConfig::default()), 10_000);
    // binomial(10,000, 0.02): 200 ± 14
    assert!((100..300).contains(&probes), "{probes}");
    // with tiers off (`healthy_score` 0) the weight decides again: one request at a time (both
    // idle, so the first draw wins), the liar takes nearly all
    let tiers_off = RegistryConfig {
        healthy_score: 0.0,
        ..RegistryConfig::default()
    };
    let picks = liar_picks(&with(tiers_off), 100);
    assert!(picks > 90, "{picks}");
}

#[tokio::test(start_paused = true)]
async fn affinity_hit_miss_and_overwrite() {
    let r = NodeRegistry::new();
    let m = ModelId::new("m");
    r.node_ready(&NodeId::new("a"), &desc(&["m"], 1));
    r.node_ready(&NodeId::new("b"), &desc(&["m"], 1));
    let key = AffinityKey::PromptCacheKey("chat-1".into());
    let first = r.pick_for(&m, Some(&key), &[]);
    let Ok(first) = first else {
        unreachable!("two free nodes")
    };
    assert_eq!(first.sticky, StickyOutcome::New);
    let node = first.lease.node().clone();
    r.remember(&m, &key, &node);
    drop(first);
    for _ in 0..20 {
        let p = r
            .pick_for(&m, Some(&key), &[])
            .map(|p| (p.lease.node().clone(), p.sticky));
        assert_eq!(p, Ok((node.clone(), StickyOutcome::Hit)));
    }
    // sticky node full: miss, the other node, the entry still points at the old node
    let busy = r.pick_for(&m, Some(&key), &[]);
    assert!(busy.is_ok());
    let other = r
        .pick_for(&m, Some(&key), &[])
        .map(|p| (p.lease.node().clone(), p.sticky));
    assert!(matches!(&other, Ok((n, StickyOutcome::Miss)) if *n != node));
    drop(busy);
    drop(other);
    // sticky node gone: miss, and the caller overwrites
    r.node_gone(&node);
    let p = r.pick_for(&m, Some(&key), &[]);
    let Ok(p) = p else {
        unreachable!("one free node")
    };
    assert_eq!(p.sticky, StickyOutcome::Miss);
    let new_node = p.lease.node().clone();
    assert_ne!(new_node, node);
    r.remember(&m, &key, &new_node);
    drop(p);
    let p = r
        .pick_for(&m, Some(&key), &[])
        .map(|p| (p.lease.node().clone(), p.sticky));
    assert_eq!(p, Ok((new_node.clone(), StickyOutcome::Hit)));
    // the key is per model
    r.node_ready(&NodeId::new("c"), &desc(&["m2"], 1));
    let p = r
        .pick_for(&ModelId::new("m2"), Some(&key), &[])
        .map(|p| p.sticky);
    assert_eq!(p, Ok(StickyOutcome::New));
    let snap = r.snapshot();
    let b = snap.iter().find(|s| s.node_id == new_node);
    assert_eq!(b.map(|s| (s.sticky_hits, s.affinity_entries)), Some((1, 1)));
}

#[tokio::test(start_paused = true)]
async fn affinity_expires_after_ttl() {
    let r = NodeRegistry::with_config(RegistryConfig {
        affinity_ttl: Duration::from_secs(60),
        ..RegistryConfig::default()
    });
    let m = ModelId::new("m");
    r.node_ready(&NodeId::new("a"), &desc(&["m"], 4));
    let key = AffinityKey::Conversation(1);
    r.remember(&m, &key, &NodeId::new("a"));
    tokio::time::advance(Duration::from_secs(59)).await;
    assert_eq!(
        r.pick_for(&m, Some(&key), &[]).map(|p| p.sticky),
        Ok(StickyOutcome::Hit)
    );
    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!(
        r.pick_for(&m, Some(&key), &[]).map(|p| p.sticky),
        Ok(StickyOutcome::New)
    );
}

#[tokio::test(start_paused = true)]
async fn stats_feed_the_score_and_survive_reconnects() {
    let r = NodeRegistry::new();
    let a = NodeId::new("a");
    r.node_ready(&a, &desc(&["m"], 1));
    r.record_discrepancy(&a);
    r.record_discrepancy(&a);
    r.record_discrepancy(&NodeId::new("b"));
    let s = &r.snapshot()[0];
    assert_eq!(s.discrepancies, 2);
    assert!((s.score.success_rate_ema - 0.64).abs() < 1e-9);
    r.record_success(&a, Some(Duration::from_millis(500)));
    r.record_failure(&a);
    r.record_disconnect(&a);
    r.node_gone(&a);
    r.node_ready(&a, &desc(&["m"], 1));
    let s = &r.snapshot()[0];
    assert_eq!(
        (s.discrepancies, s.attempts, s.failures, s.disconnects),
        (2, 3, 2, 1)
    );
    assert_eq!(s.score.ttft_ema_ms, Some(500.0));
    assert!(s.score.failure_penalty < 0.51);
    assert_eq!(r.discrepancies(&NodeId::new("b")), 1);
    assert_eq!(r.discrepancies(&NodeId::new("c")), 0);
    // heartbeats keep uptime at 1; silence lowers it
    tokio::time::advance(Duration::from_secs(60)).await;
    assert!((r.snapshot()[0].score.uptime_score - 0.5).abs() < 1e-6);
    r.heartbeat(&a);
    assert!((r.snapshot()[0].score.uptime_score - 1.0).abs() < 1e-9);
}

/// A [`ModelTrust`] that fails the listed (node, model) pairs.
struct FailedPairs(Vec<(&'static str, &'static str)>);

impl ModelTrust for FailedPairs {
    fn routable(&self, node: &NodeId, model: &ModelId) -> bool {
        !self
            .0
            .iter()
            .any(|(n, m)| node.as_str() == *n && model.as_str() == *m)
    }
}

#[test]
fn a_node_whose_model_audit_failed_is_not_routed_that_model() {
    let r = NodeRegistry::new();
    r.node_ready(&NodeId::new("a"), &desc(&["m1", "m2"], 4));
    r.node_ready(&NodeId::new("b"), &desc(&["m1"], 4));
    r.set_model_trust(Arc::new(FailedPairs(vec![("a", "m1")])));
    for _ in 0..50 {
        let lease = r.pick(&ModelId::new("m1"));
        assert_eq!(lease.map(|l| l.node().clone()), Ok(NodeId::new("b")));
        // the same node still serves the model it did not fail
        let lease = r.pick(&ModelId::new("m2"));
        assert_eq!(lease.map(|l| l.node().clone()), Ok(NodeId::new("a")));
    }
    // the only node of a model, failed: no node serves it
    r.node_gone(&NodeId::new("b"));
    assert_eq!(
        r.pick(&ModelId::new("m1")).map(|l| l.node().clone()),
        Err(RouteError::NoNodeForModel(ModelId::new("m1")))
    );
    assert_eq!(r.free_slots(&ModelId::new("m1")), 0);
    assert_eq!(r.free_slots(&ModelId::new("m2")), 4);
    // and `GET /v1/models` does not list it
    assert_eq!(r.models(), vec![ModelId::new("m2")]);
}
