//! The wait list on its own: `T` a waiter's label, `R` the label it is answered with. The
//! admission queue as the registry uses it is tested in `registry/acquire/tests.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use super::*;

type Queue = WaitQueue<usize, usize>;

fn queue(max_depth: usize) -> Queue {
    WaitQueue::new(QueueConfig {
        max_wait: Duration::from_secs(30),
        max_depth,
    })
}

fn model() -> ModelId {
    ModelId::new("m")
}

fn ticket(class: &str, weight: u32) -> QueueTicket {
    QueueTicket {
        class: class.into(),
        weight,
    }
}

/// A place for the waiter `label` of `class`; panics if it is answered or refused instead.
fn place<'q>(q: &'q Queue, class: &str, label: usize) -> Place<'q, usize, usize> {
    match q.enqueue(&model(), &ticket(class, 1), Instant::now(), |_| Ok(label)) {
        Enqueued::Waiting { place, .. } => place,
        Enqueued::Answered(_) => panic!("answered"),
        Enqueued::Full { .. } => panic!("full"),
    }
}

/// Serves up to `slots` waiters (each answered with its own label), skipping those in `skip`.
fn serve(q: &Queue, slots: usize, skip: &[usize]) {
    let left = std::cell::Cell::new(slots);
    q.wake(
        &model(),
        false,
        || left.get() > 0,
        |&label, _| {
            if skip.contains(&label) {
                Offer::Skip
            } else {
                left.set(left.get() - 1);
                Offer::Serve(label)
            }
        },
    );
}

/// The answers of `places`, each waited for until now at most.
async fn answers(places: Vec<Place<'_, usize, usize>>) -> Vec<Answer<usize>> {
    let mut out = Vec::new();
    for p in places {
        out.push(p.wait(Instant::now()).await);
    }
    out
}

#[tokio::test(start_paused = true)]
async fn waiters_are_served_in_fair_order_and_a_skipped_one_keeps_its_place() {
    let q = queue(100);
    let places = vec![
        place(&q, "burst", 0),
        place(&q, "burst", 1),
        place(&q, "burst", 2),
        place(&q, "single", 3),
    ];
    assert_eq!(q.waiting(), 4);
    // the burst's first (as early as the single one, and first in), then the single one; 0
    // cannot use the slot and keeps its place
    serve(&q, 2, &[0]);
    assert_eq!(q.waiting(), 2);
    serve(&q, 2, &[]);
    assert_eq!(q.waiting(), 0);
    assert_eq!(answers(places).await, vec![Ok(0), Ok(1), Ok(2), Ok(3)]);
    let s = &q.snapshot()[0];
    assert_eq!((s.depth, s.served, s.left, s.timed_out), (0, 4, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn the_order_of_service_follows_start_tags() {
    let q = queue(100);
    let places: Vec<_> = [("burst", 0), ("burst", 1), ("burst", 2), ("single", 3)]
        .into_iter()
        .map(|(class, label)| place(&q, class, label))
        .collect();
    let mut order = Vec::new();
    q.wake(
        &model(),
        false,
        || true,
        |&label, _| {
            order.push(label);
            Offer::Serve(label)
        },
    );
    assert_eq!(order, vec![0, 3, 1, 2]);
    drop(places);
}

#[tokio::test(start_paused = true)]
async fn a_failed_waiter_is_answered_and_counted_apart() {
    let q = queue(100);
    let p = place(&q, "x", 7);
    q.wake(&model(), true, || false, |&label, _| Offer::Fail(label + 1));
    assert_eq!(p.wait(Instant::now()).await, Ok(8));
    let s = &q.snapshot()[0];
    assert_eq!((s.depth, s.served), (0, 0));
    assert_eq!(q.waiting(), 0);
}

#[tokio::test(start_paused = true)]
async fn admit_answers_at_once_and_is_told_whether_others_wait() {
    let q = queue(100);
    let mut seen = Vec::new();
    let got = q.enqueue(&model(), &ticket("x", 1), Instant::now(), |behind| {
        seen.push(behind);
        Err(5)
    });
    assert!(matches!(got, Enqueued::Answered(5)));
    let first = place(&q, "x", 0);
    let Enqueued::Waiting { behind_others, .. } =
        q.enqueue(&model(), &ticket("y", 1), Instant::now(), |behind| {
            seen.push(behind);
            Ok(1)
        })
    else {
        panic!("not queued");
    };
    assert!(behind_others);
    assert_eq!(seen, vec![false, true]);
    drop(first);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_place_leaves_at_once() {
    let q = queue(100);
    let leaving = place(&q, "x", 0);
    let staying = place(&q, "y", 1);
    drop(leaving);
    assert_eq!(q.waiting(), 1);
    serve(&q, 1, &[]);
    assert_eq!(staying.wait(Instant::now()).await, Ok(1));
    let s = &q.snapshot()[0];
    assert_eq!((s.left, s.served, s.depth), (1, 1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_waiter_times_out_at_its_deadline_with_retry_after() {
    let q = queue(100);
    let p = place(&q, "x", 0);
    let started = Instant::now();
    let got = p.wait(started + Duration::from_secs(30)).await;
    assert_eq!(
        got,
        Err(Unserved::Timeout {
            retry_after: Duration::from_secs(1)
        })
    );
    assert_eq!(started.elapsed(), Duration::from_secs(30));
    let s = &q.snapshot()[0];
    assert_eq!((s.timed_out, s.depth), (1, 0));
    assert_eq!(q.waiting(), 0);
}

#[tokio::test(start_paused = true)]
async fn at_the_depth_limit_the_biggest_class_gives_up_its_newest_place() {
    let q = queue(3);
    let burst: Vec<_> = (0..3).map(|i| place(&q, "burst", i)).collect();
    let refused = q.enqueue(&model(), &ticket("burst", 1), Instant::now(), |_| Ok(9));
    assert!(
        matches!(refused, Enqueued::Full { retry_after } if retry_after >= Duration::from_secs(1))
    );
    let other = place(&q, "other", 99);
    assert_eq!(q.waiting(), 3);
    // the burst's newest was answered at once; the two others still wait (until now), and
    // leave one by one: 2 then 1 waiting, 1 s each (nothing was served yet)
    let timeout = |secs| {
        Err(Unserved::Timeout {
            retry_after: Duration::from_secs(secs),
        })
    };
    let got = answers(burst).await;
    assert_eq!(got[..2], [timeout(2), timeout(1)]);
    assert!(matches!(got[2], Err(Unserved::Full { .. })), "{got:?}");
    drop(other);
    let s = &q.snapshot()[0];
    assert_eq!(
        (s.refused_full, s.evicted, s.timed_out, s.left),
        (1, 1, 2, 1)
    );
}
