use std::time::Duration;

use spine_core::{ModelId, NodeId};

use crate::registry::tests::desc;
use crate::{NodeRegistry, Overload, RouteError};

fn leases(r: &NodeRegistry, n: usize) -> Vec<crate::InFlightLease> {
    (0..n)
        .map(|_| r.pick(&ModelId::new("m")).unwrap())
        .collect()
}

/// A node that claims 256 slots and was late with 19 requests in flight is held to 9 (half of
/// what it was sent), once per backoff however many were late together; the claim no longer
/// decides: at 9 in flight it takes no more.
#[tokio::test(start_paused = true)]
async fn a_node_that_queues_what_it_claims_is_held_to_half_of_what_it_was_sent() {
    let (r, liar) = (NodeRegistry::new(), NodeId::new("liar"));
    let late = |in_flight| Overload::Late { in_flight };
    r.node_ready(&liar, &desc(&["m"], 256));
    assert_eq!(r.concurrency_limit(&liar), Some(256));
    for _ in 0..10 {
        r.record_overload(&liar, late(19));
    }
    assert_eq!(r.concurrency_limit(&liar), Some(9));
    assert_eq!(r.snapshot()[0].concurrency_limit, 9);
    let held = leases(&r, 9);
    assert_eq!(
        r.pick(&ModelId::new("m")).map(|l| l.node().clone()),
        Err(RouteError::AtCapacity(ModelId::new("m")))
    );
    drop(held);
    // within the backoff: no second halving; after it, half of min(limit, in flight)
    tokio::time::advance(Duration::from_secs(4)).await;
    r.record_overload(&liar, late(9));
    assert_eq!(r.concurrency_limit(&liar), Some(9));
    tokio::time::advance(Duration::from_secs(2)).await;
    r.record_overload(&liar, late(9));
    assert_eq!(r.concurrency_limit(&liar), Some(4));
    // one request late with nothing else in flight shows no queue; a refusal still leaves one
    // slot
    tokio::time::advance(Duration::from_secs(6)).await;
    r.record_overload(&liar, late(1));
    assert_eq!(r.concurrency_limit(&liar), Some(4));
    r.record_overload(&liar, Overload::Refused);
    assert_eq!(r.concurrency_limit(&liar), Some(1));
}

/// The limit grows one slot per `limit` successes in a row while the node uses it (a late first
/// token starts the row again), never while it has room to spare, up to the claim; it survives
/// a reconnect, as the score does.
#[tokio::test(start_paused = true)]
async fn the_limit_grows_back_only_while_it_is_used() {
    let (r, node) = (NodeRegistry::new(), NodeId::new("n"));
    r.node_ready(&node, &desc(&["m"], 4));
    r.record_overload(&node, Overload::Late { in_flight: 4 });
    assert_eq!(r.concurrency_limit(&node), Some(2));
    // one request in flight under a limit of 2 uses it (in flight ≥ limit − 1)
    let one = leases(&r, 1);
    r.record_success(&node, None);
    assert_eq!(r.concurrency_limit(&node), Some(2));
    // a first token later than `limit_growth_max_ttft` (60 s) waited in the node's queue: the
    // row starts again
    r.record_success(&node, Some(Duration::from_secs(61)));
    r.record_success(&node, Some(Duration::from_secs(1)));
    assert_eq!(r.concurrency_limit(&node), Some(2));
    r.record_success(&node, Some(Duration::from_secs(1)));
    assert_eq!(r.concurrency_limit(&node), Some(3));
    // one in flight under 3: room to spare, no growth however many successes
    for _ in 0..50 {
        r.record_success(&node, None);
    }
    assert_eq!(r.concurrency_limit(&node), Some(3));
    drop(one);
    // a reconnect keeps what was learned
    r.node_gone(&node);
    r.node_ready(&node, &desc(&["m"], 4));
    assert_eq!(r.concurrency_limit(&node), Some(3));
    let _three = leases(&r, 3);
    for _ in 0..3 {
        r.record_success(&node, None);
    }
    assert_eq!(r.concurrency_limit(&node), Some(4));
    // at the claim: successes add nothing past it, and a larger claim is followed at once
    for _ in 0..20 {
        r.record_success(&node, None);
    }
    assert_eq!(r.concurrency_limit(&node), Some(4));
    r.node_ready(&node, &desc(&["m"], 8));
    assert_eq!(r.concurrency_limit(&node), Some(8));
}

/// A lowered limit makes the node look as loaded as it is: a pick compares
/// `in_flight / limit`, so the node that queued a burst is not the emptiest any more.
#[tokio::test(start_paused = true)]
async fn a_pick_compares_load_against_the_learned_limit() {
    let r = NodeRegistry::new();
    let (liar, honest) = (NodeId::new("liar"), NodeId::new("honest"));
    r.node_ready(&liar, &desc(&["m"], 256));
    r.record_overload(&liar, Overload::Late { in_flight: 8 });
    assert_eq!(r.concurrency_limit(&liar), Some(4));
    let _three = leases(&r, 3);
    r.node_ready(&honest, &desc(&["m"], 4));
    // the liar is at 3 / 4; the honest node takes the next one, and the liar the one after
    // only once the honest node is as loaded
    let next = r.pick(&ModelId::new("m")).unwrap();
    assert_eq!(next.node(), &honest);
    let picked: Vec<crate::InFlightLease> = (0..4)
        .map(|_| r.pick(&ModelId::new("m")).unwrap())
        .collect();
    let picked: Vec<&NodeId> = picked.iter().map(crate::InFlightLease::node).collect();
    assert_eq!(
        picked.iter().filter(|n| ***n == liar).count(),
        1,
        "the liar had one slot left: {picked:?}"
    );
}
