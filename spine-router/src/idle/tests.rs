#![allow(clippy::unwrap_used)]
use super::*;

/// Polls `timer` once with a no-op waker.
fn expired(timer: &mut IdleTimer) -> bool {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    timer.poll_expired(&mut cx)
}

#[tokio::test(start_paused = true)]
async fn expires_after_silence_and_frames_push_the_deadline() {
    assert!(IdleTimer::new(Duration::ZERO).is_none());
    let mut timer = IdleTimer::new(Duration::from_secs(10)).unwrap();
    assert_eq!(timer.timeout(), Duration::from_secs(10));
    assert!(!expired(&mut timer));
    tokio::time::advance(Duration::from_secs(6)).await;
    timer.frame();
    // the armed sleep fires at 10 s; the frame at 6 s moves the deadline to 16 s
    tokio::time::advance(Duration::from_secs(5)).await;
    assert!(!expired(&mut timer));
    tokio::time::advance(Duration::from_secs(4)).await;
    assert!(!expired(&mut timer));
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(expired(&mut timer));
}

#[tokio::test(start_paused = true)]
async fn a_timeout_too_large_for_the_clock_never_expires() {
    let mut timer = IdleTimer::new(Duration::from_secs(u64::MAX)).unwrap();
    tokio::time::advance(Duration::from_secs(86_400)).await;
    assert!(!expired(&mut timer));
    timer.frame();
    assert!(!expired(&mut timer));
}
