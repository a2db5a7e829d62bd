#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use spine_core::{Endpoints, EngineKind, ModelDescriptor, NodeDescriptor, NodeId, RequestKind};
use tokio::sync::mpsc;

use super::*;
use crate::{InFlightLease, Needs, QueueConfig, RegistryConfig};

fn node(max_concurrency: u32, ctx: Option<u64>, embeddings: Option<bool>) -> NodeDescriptor {
    NodeDescriptor {
        engine: EngineKind::LlamaCpp,
        models: vec![ModelDescriptor {
            id: ModelId::new("m"),
            max_context_tokens: ctx,
            endpoints: embeddings.map(|embeddings| Endpoints {
                chat_completions: true,
                completions: true,
                embeddings,
            }),
        }],
        vram_mib: 1,
        max_concurrency,
        agent_version: "t".into(),
    }
}

fn registry(max_wait_secs: u64, max_depth: usize) -> NodeRegistry {
    NodeRegistry::with_config(RegistryConfig {
        queue: QueueConfig {
            max_wait: Duration::from_secs(max_wait_secs),
            max_depth,
        },
        ..RegistryConfig::default()
    })
}

fn ticket(class: &str) -> QueueTicket {
    QueueTicket {
        class: class.into(),
        weight: 1,
    }
}

fn ask<'a>(model: &'a ModelId, needs: Needs) -> Ask<'a> {
    Ask {
        model,
        preferred: None,
        exclude: &[],
        needs,
    }
}

async fn acquire(r: &NodeRegistry, class: &str, needs: Needs) -> Result<Pick, RouteError> {
    let m = ModelId::new("m");
    r.acquire(ask(&m, needs), Some(&ticket(class))).await
}

fn depth(r: &NodeRegistry) -> usize {
    r.queue_snapshot().first().map_or(0, |q| q.depth)
}

/// Lets spawned tasks run until the queue holds `n`.
async fn until_depth(r: &NodeRegistry, n: usize) {
    for _ in 0..10_000 {
        if depth(r) == n {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("queue depth {} never reached {n}", depth(r));
}

/// A queueing registry (`max_wait_secs`, `max_depth`) with one node `a` of one slot, and that
/// slot, held by a request of `class`.
async fn one_slot_held(max_wait_secs: u64, max_depth: usize, class: &str) -> (NodeRegistry, Pick) {
    let r = registry(max_wait_secs, max_depth);
    r.node_ready(&NodeId::new("a"), &node(1, None, None));
    let held = acquire(&r, class, Needs::default()).await.unwrap();
    (r, held)
}

/// The labels of the next `n` waiters served, in order, each lease released once received.
async fn serve_next(
    rx: &mut mpsc::UnboundedReceiver<(usize, Result<InFlightLease, RouteError>)>,
    n: usize,
) -> Vec<usize> {
    let mut served = Vec::new();
    for _ in 0..n {
        let (label, lease) = rx.recv().await.unwrap();
        served.push(label);
        drop(lease.unwrap());
    }
    served
}

/// Spawns a request of `class` that reports (its label, its lease) once served.
fn spawn_waiter(
    r: &NodeRegistry,
    class: &'static str,
    label: usize,
    tx: &mpsc::UnboundedSender<(usize, Result<InFlightLease, RouteError>)>,
) {
    let (r, tx) = (r.clone(), tx.clone());
    tokio::spawn(async move {
        let got = acquire(&r, class, Needs::default()).await.map(|p| p.lease);
        let _ = tx.send((label, got));
    });
}

#[tokio::test(start_paused = true)]
async fn a_full_node_queues_and_every_freed_slot_serves_the_next_waiter() {
    let r = registry(30, 100);
    r.node_ready(&NodeId::new("a"), &node(2, None, None));
    let held: Vec<Pick> = vec![
        acquire(&r, "x", Needs::default()).await.unwrap(),
        acquire(&r, "x", Needs::default()).await.unwrap(),
    ];
    let (tx, mut rx) = mpsc::unbounded_channel();
    for i in 0..5 {
        spawn_waiter(&r, "x", i, &tx);
        until_depth(&r, i + 1).await;
    }
    assert_eq!(r.snapshot()[0].in_flight, 2);
    drop(held);
    // two slots: the first two waiters, in arrival order
    let mut order = Vec::new();
    let mut leases = Vec::new();
    for _ in 0..2 {
        let (label, lease) = rx.recv().await.unwrap();
        order.push(label);
        leases.push(lease.unwrap());
    }
    assert_eq!(order, vec![0, 1]);
    assert_eq!(depth(&r), 3);
    assert_eq!(r.snapshot()[0].in_flight, 2);
    // each release serves one more
    while let Some(lease) = leases.pop() {
        drop(lease);
        if let Ok(Some((label, next))) =
            tokio::time::timeout(Duration::from_secs(1), rx.recv()).await
        {
            order.push(label);
            leases.push(next.unwrap());
        }
    }
    assert_eq!(order, vec![0, 1, 2, 3, 4]);
    assert_eq!(r.snapshot()[0].in_flight, 0);
    let q = &r.queue_snapshot()[0];
    assert_eq!((q.depth, q.served, q.timed_out, q.left), (0, 5, 0, 0));
    assert_eq!(r.inner.queue.waiting(), 0);
}

#[tokio::test(start_paused = true)]
async fn one_accounts_burst_does_not_starve_anothers_single_request() {
    let (r, held) = one_slot_held(3600, 2000, "burst").await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    for i in 0..1000 {
        spawn_waiter(&r, "burst", i, &tx);
    }
    until_depth(&r, 1000).await;
    spawn_waiter(&r, "single", 1000, &tx);
    until_depth(&r, 1001).await;
    drop(held);
    let served = serve_next(&mut rx, 3).await;
    // the burst's first request (tagged as early as the single one, and first in), then the
    // single request
    assert_eq!(served, vec![0, 1000, 1]);
}

#[tokio::test(start_paused = true)]
async fn a_heavier_weight_gets_its_share_while_both_wait() {
    let (r, held) = one_slot_held(3600, 100, "x").await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    for i in 0..20 {
        let (r2, tx) = (r.clone(), tx.clone());
        let (class, weight) = if i % 2 == 0 {
            ("light", 1)
        } else {
            ("heavy", 3)
        };
        tokio::spawn(async move {
            let m = ModelId::new("m");
            let t = QueueTicket {
                class: class.into(),
                weight,
            };
            let got = r2.acquire(ask(&m, Needs::default()), Some(&t)).await;
            let _ = tx.send((class, got.map(|p| p.lease)));
        });
        until_depth(&r, i + 1).await;
    }
    drop(held);
    let mut heavy = 0;
    for _ in 0..8 {
        let (class, lease) = rx.recv().await.unwrap();
        heavy += usize::from(class == "heavy");
        drop(lease.unwrap());
    }
    // 3:1 while both wait: 6 of the first 8
    assert_eq!(heavy, 6);
}

#[tokio::test(start_paused = true)]
async fn a_request_waits_until_the_deadline_then_gets_retry_after() {
    let (r, _held) = one_slot_held(30, 100, "x").await;
    let started = Instant::now();
    let got = acquire(&r, "y", Needs::default()).await.map(|p| p.sticky);
    assert_eq!(
        got,
        Err(RouteError::QueueTimeout {
            model: ModelId::new("m"),
            waited: Duration::from_secs(30),
            // nothing left the queue yet: 1 s per waiting request, at least 1
            retry_after: Duration::from_secs(1),
        })
    );
    assert_eq!(started.elapsed(), Duration::from_secs(30));
    let q = &r.queue_snapshot()[0];
    assert_eq!((q.depth, q.timed_out, q.served), (0, 1, 0));
    assert_eq!(r.inner.queue.waiting(), 0);
    // the queue disabled: at once
    let (r, _held) = one_slot_held(0, 100, "x").await;
    assert_eq!(
        acquire(&r, "y", Needs::default()).await.map(|p| p.sticky),
        Err(RouteError::AtCapacity(ModelId::new("m")))
    );
    assert_eq!(started.elapsed(), Duration::from_secs(30));
}

#[tokio::test(start_paused = true)]
async fn retry_after_follows_the_rate_the_queue_drains() {
    let (r, mut held) = one_slot_held(600, 100, "x").await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    for i in 0..10 {
        spawn_waiter(&r, "x", i, &tx);
        until_depth(&r, i + 1).await;
    }
    // one request leaves the queue every 4 s
    for _ in 0..5 {
        tokio::time::advance(Duration::from_secs(4)).await;
        drop(held);
        let (_, lease) = rx.recv().await.unwrap();
        held = Pick {
            lease: lease.unwrap(),
            sticky: crate::StickyOutcome::NoKey,
        };
    }
    let q = &r.queue_snapshot()[0];
    assert_eq!((q.depth, q.served), (5, 5));
    // 5 waiting × 4 s
    assert_eq!(q.retry_after_secs, 20);
    assert_eq!(q.mean_wait_ms.map(|m| m > 0), Some(true));
}

#[tokio::test(start_paused = true)]
async fn at_the_depth_limit_the_biggest_account_gives_up_its_newest_place() {
    let (r, held) = one_slot_held(30, 3, "x").await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    for i in 0..3 {
        spawn_waiter(&r, "burst", i, &tx);
        until_depth(&r, i + 1).await;
    }
    // the same account: refused at once
    let got = acquire(&r, "burst", Needs::default())
        .await
        .map(|p| p.sticky);
    assert!(
        matches!(&got, Err(RouteError::QueueFull { retry_after, .. }) if *retry_after >= Duration::from_secs(1)),
        "{got:?}"
    );
    // another account: takes the burst's newest place
    spawn_waiter(&r, "other", 99, &tx);
    let (label, evicted) = rx.recv().await.unwrap();
    assert_eq!(label, 2);
    assert!(matches!(evicted, Err(RouteError::QueueFull { .. })));
    assert_eq!(depth(&r), 3);
    drop(held);
    let served = serve_next(&mut rx, 3).await;
    assert_eq!(served, vec![0, 99, 1]);
    let q = &r.queue_snapshot()[0];
    assert_eq!((q.refused_full, q.evicted, q.served), (1, 1, 3));
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_leaves_frees_its_place_and_takes_no_slot() {
    let (r, held) = one_slot_held(30, 100, "x").await;
    let leaving = {
        let r = r.clone();
        tokio::spawn(async move { acquire(&r, "x", Needs::default()).await.is_ok() })
    };
    until_depth(&r, 1).await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_waiter(&r, "y", 1, &tx);
    until_depth(&r, 2).await;
    leaving.abort();
    assert!(leaving.await.is_err());
    assert_eq!(depth(&r), 1);
    drop(held);
    let (label, lease) = rx.recv().await.unwrap();
    assert_eq!(label, 1);
    assert_eq!(r.snapshot()[0].in_flight, 1);
    drop(lease);
    assert_eq!(r.snapshot()[0].in_flight, 0);
    let q = &r.queue_snapshot()[0];
    assert_eq!((q.left, q.served, q.depth), (1, 1, 0));
}

#[tokio::test(start_paused = true)]
async fn waiters_fail_at_once_when_the_last_node_goes_and_are_served_when_one_joins() {
    let (r, held) = one_slot_held(30, 100, "x").await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_waiter(&r, "x", 0, &tx);
    until_depth(&r, 1).await;
    // a second node joins: the waiter takes it
    r.node_ready(&NodeId::new("b"), &node(1, None, None));
    let (_, lease) = rx.recv().await.unwrap();
    assert_eq!(lease.as_ref().map(|l| l.node().as_str()), Ok("b"));
    // both full; a waiter; both nodes die
    spawn_waiter(&r, "x", 1, &tx);
    until_depth(&r, 1).await;
    let started = Instant::now();
    r.node_gone(&NodeId::new("a"));
    assert_eq!(depth(&r), 1, "b still serves the model");
    r.node_gone(&NodeId::new("b"));
    let (label, got) = rx.recv().await.unwrap();
    assert_eq!(label, 1);
    assert_eq!(
        got.map(|l| l.node().clone()),
        Err(RouteError::NoNodeForModel(ModelId::new("m")))
    );
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!(r.inner.queue.waiting(), 0);
    drop(held);
    drop(lease);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_the_freed_node_cannot_serve_does_not_block_the_next() {
    let r = registry(30, 100);
    r.node_ready(&NodeId::new("small"), &node(1, Some(1000), None));
    r.node_ready(&NodeId::new("big"), &node(1, Some(8000), None));
    let m = ModelId::new("m");
    let small = r.pick_preferring(&m, None, &[NodeId::new("big")]).unwrap();
    let big = r
        .pick_preferring(&m, None, &[NodeId::new("small")])
        .unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    {
        let (r, tx) = (r.clone(), tx.clone());
        tokio::spawn(async move {
            let needs = Needs {
                kind: None,
                prompt_tokens: Some(5000),
                choices: 1,
            };
            let got = acquire(&r, "long", needs).await.map(|p| p.lease);
            let _ = tx.send((0, got));
        });
    }
    until_depth(&r, 1).await;
    spawn_waiter(&r, "short", 1, &tx);
    until_depth(&r, 2).await;
    let big_node = big.lease.node().clone();
    drop(small);
    let (label, lease) = rx.recv().await.unwrap();
    assert_eq!((label, lease.unwrap().node().as_str()), (1, "small"));
    drop(big);
    let (label, lease) = rx.recv().await.unwrap();
    assert_eq!((label, lease.unwrap().node().clone()), (0, big_node));
}

#[tokio::test]
async fn capabilities_filter_the_candidates() {
    let r = registry(30, 100);
    r.node_ready(&NodeId::new("small"), &node(4, Some(2048), Some(false)));
    r.node_ready(&NodeId::new("big"), &node(4, Some(8192), Some(false)));
    let m = ModelId::new("m");
    let needs = |prompt| Needs {
        kind: Some(RequestKind::ChatCompletions),
        prompt_tokens: Some(prompt),
        choices: 1,
    };
    for _ in 0..20 {
        let p = r.pick_inner(ask(&m, needs(4000)), Instant::now()).unwrap();
        assert_eq!(p.lease.node().as_str(), "big");
    }
    assert_eq!(
        r.pick_inner(ask(&m, needs(8192)), Instant::now())
            .map(|p| p.sticky),
        Err(RouteError::ContextLengthExceeded {
            model: m.clone(),
            prompt_tokens: 8192,
            max_context_tokens: 8192
        })
    );
    let embeddings = Needs {
        kind: Some(RequestKind::Embeddings),
        prompt_tokens: Some(5),
        choices: 1,
    };
    assert_eq!(
        r.pick_inner(ask(&m, embeddings), Instant::now())
            .map(|p| p.sticky),
        Err(RouteError::Unsupported {
            model: m.clone(),
            kind: RequestKind::Embeddings
        })
    );
    // the queue fails those at once too
    assert!(matches!(
        acquire(&r, "x", embeddings).await,
        Err(RouteError::Unsupported { .. })
    ));
    // a node that serves embeddings, and one that predates the probe (unknown: assumed)
    r.node_ready(&NodeId::new("emb"), &node(4, Some(512), Some(true)));
    for _ in 0..20 {
        let p = r.pick_inner(ask(&m, embeddings), Instant::now()).unwrap();
        assert_eq!(p.lease.node().as_str(), "emb");
    }
    r.node_ready(&NodeId::new("old"), &node(4, None, None));
    for _ in 0..20 {
        let p = r
            .pick_inner(ask(&m, needs(100_000)), Instant::now())
            .unwrap();
        assert_eq!(p.lease.node().as_str(), "old");
    }
}

#[tokio::test]
async fn several_choices_go_only_to_engines_that_generate_them() {
    let r = registry(30, 100);
    let ollama = NodeDescriptor {
        engine: EngineKind::Ollama,
        ..node(4, None, None)
    };
    r.node_ready(&NodeId::new("ollama"), &ollama);
    let m = ModelId::new("m");
    let choices = |n| Needs {
        kind: Some(RequestKind::ChatCompletions),
        prompt_tokens: Some(5),
        choices: n,
    };
    // only an engine that ignores n: refused at once, from the pick and from the queue
    let refused = Err(RouteError::SeveralChoicesUnsupported {
        model: m.clone(),
        n: 2,
    });
    assert_eq!(
        r.pick_inner(ask(&m, choices(2)), Instant::now())
            .map(|p| p.sticky),
        refused
    );
    assert_eq!(
        acquire(&r, "x", choices(2)).await.map(|p| p.sticky),
        refused
    );
    // one choice (or an unset 0) still goes to it
    for n in [0, 1] {
        let p = r.pick_inner(ask(&m, choices(n)), Instant::now()).unwrap();
        assert_eq!(p.lease.node().as_str(), "ollama");
    }
    r.node_ready(&NodeId::new("llama"), &node(4, None, None));
    for _ in 0..20 {
        let p = r.pick_inner(ask(&m, choices(3)), Instant::now()).unwrap();
        assert_eq!(p.lease.node().as_str(), "llama");
    }
    let mut seen = std::collections::HashSet::new();
    for _ in 0..50 {
        let p = r.pick_inner(ask(&m, choices(1)), Instant::now()).unwrap();
        seen.insert(p.lease.node().as_str().to_owned());
    }
    assert_eq!(seen.len(), 2, "n = 1 goes to both engines: {seen:?}");
}

#[test]
fn the_pick_prefers_the_less_loaded_node() {
    let r = registry(30, 100);
    r.node_ready(&NodeId::new("a"), &node(10, None, None));
    r.node_ready(&NodeId::new("b"), &node(10, None, None));
    let m = ModelId::new("m");
    let b = [NodeId::new("b")];
    let busy: Vec<Pick> = (0..6)
        .map(|_| r.pick_preferring(&m, None, &b).unwrap())
        .collect();
    assert!(busy.iter().all(|p| p.lease.node().as_str() == "a"));
    // two candidates: the two draws are both, and the less loaded wins every time
    for _ in 0..50 {
        let p = r.pick(&m).unwrap();
        assert_eq!(p.node().as_str(), "b");
    }
}

#[test]
fn an_overloaded_sticky_node_yields() {
    let r = registry(30, 100);
    r.node_ready(&NodeId::new("a"), &node(4, None, None));
    r.node_ready(&NodeId::new("b"), &node(4, None, None));
    let m = ModelId::new("m");
    let a = NodeId::new("a");
    let b = [NodeId::new("b")];
    let mut busy: Vec<Pick> = (0..2)
        .map(|_| r.pick_preferring(&m, None, &b).unwrap())
        .collect();
    // a at 2/4 (below 0.75): still sticky
    let p = r.pick_preferring(&m, Some(Some(&a)), &[]).unwrap();
    assert_eq!(
        (p.lease.node().as_str(), p.sticky),
        ("a", crate::StickyOutcome::Hit)
    );
    busy.push(p);
    // a at 3/4, b at 0/4: yields
    let p = r.pick_preferring(&m, Some(Some(&a)), &[]).unwrap();
    assert_eq!(
        (p.lease.node().as_str(), p.sticky),
        ("b", crate::StickyOutcome::Miss)
    );
    // b at 1/4 = 0.75 - 0.5: still yields; at 2/4 no longer
    let p2 = r.pick_preferring(&m, Some(Some(&a)), &[]).unwrap();
    assert_eq!(p2.lease.node().as_str(), "b");
    let p3 = r.pick_preferring(&m, Some(Some(&a)), &[]).unwrap();
    assert_eq!(
        (p3.lease.node().as_str(), p3.sticky),
        ("a", crate::StickyOutcome::Hit)
    );
    drop((p, p2, p3, busy));
}
