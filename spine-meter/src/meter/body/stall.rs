//! The stall bound of a metered stream ([`StallClock`]).

use std::future::Future;
use std::pin::Pin;
use std::task::Context;
use std::time::Duration;

/// The bound on a stream without progress ([`StreamSettings::stream_stall_timeout`](super::StreamSettings)): progress
/// (new delivered text, a `finish_reason`) only stores a deadline; one `Sleep` (armed on the
/// first poll) re-arms itself to the latest deadline when it fires early. The clock stops while
/// the caller holds a frame: the time between a frame handed out and the caller's next poll
/// moves the deadline by as much, so a slow reader (whose frames wait in the read-ahead buffer)
/// never makes an honest node look stalled.
pub(in crate::meter) struct StallClock {
    timeout: Duration,
    /// When the stream is stalled; `None` before the first poll, or "never" (overflow).
    at: Option<tokio::time::Instant>,
    started: bool,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    /// When the last frame went to the caller (its next poll resumes the clock).
    handed_out: Option<tokio::time::Instant>,
    /// Whether the stream made progress yet (its first content).
    progressed: bool,
    /// The longest time between two progresses, caller-held time excluded.
    longest_pause: Duration,
}

impl StallClock {
    pub(in crate::meter) fn new(timeout: Duration) -> Option<Self> {
        (!timeout.is_zero()).then_some(Self {
            timeout,
            at: None,
            started: false,
            sleep: None,
            handed_out: None,
            progressed: false,
            longest_pause: Duration::ZERO,
        })
    }

    /// The longest time the stream went without progress between its first content and its
    /// last, time the caller held a frame excluded.
    pub(in crate::meter) fn longest_pause(&self) -> Duration {
        self.longest_pause
    }

    /// New text or a finish at `now`: the node made progress.
    pub(in crate::meter) fn progress(&mut self, now: tokio::time::Instant) {
        if self.started {
            if self.progressed {
                // `at` is the last progress plus the timeout (moved by caller-held time)
                let left = self
                    .at
                    .map_or(Duration::ZERO, |at| at.saturating_duration_since(now));
                self.longest_pause = self.longest_pause.max(self.timeout.saturating_sub(left));
            }
            self.progressed = true;
            self.at = now.checked_add(self.timeout);
        }
    }

    /// A frame goes to the caller at `now`: the clock stops until its next poll.
    pub(in crate::meter) fn handed_out(&mut self, now: tokio::time::Instant) {
        if self.started {
            self.handed_out = Some(now);
        }
    }

    /// The caller polls again at `now`: the time it held the frame does not count.
    pub(in crate::meter) fn resumed(&mut self, now: tokio::time::Instant) {
        if let Some(out) = self.handed_out.take() {
            let held = now.saturating_duration_since(out);
            self.at = self.at.and_then(|at| at.checked_add(held));
        }
    }

    /// True once the stream went without progress for the timeout (started on the first
    /// call, when a tokio runtime is there; without one the bound is not kept).
    pub(in crate::meter) fn passed(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.started {
            // not started without a runtime: progress then sets no deadline that a later call
            // would need a runtime's timer to wait for
            if tokio::runtime::Handle::try_current().is_err() {
                return false;
            }
            self.started = true;
            self.at = tokio::time::Instant::now().checked_add(self.timeout);
        }
        let Some(at) = self.at else {
            return false;
        };
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
        loop {
            if sleep.as_mut().poll(cx).is_pending() {
                return false;
            }
            // fired: progress (or a caller's pause) may have moved the deadline since
            let Some(at) = self.at else {
                return false;
            };
            if at <= tokio::time::Instant::now() {
                return true;
            }
            sleep.as_mut().reset(at);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::task::{Context, Waker};
    use std::time::Duration;

    use super::StallClock;

    /// Without a tokio runtime the bound is not kept, and polling it after progress does not
    /// panic (it used to start anyway, and the next call made a timer outside a runtime).
    #[test]
    fn without_a_runtime_the_clock_never_starts_and_never_panics() {
        let mut clock = StallClock::new(Duration::from_millis(1)).expect("a bound");
        let mut cx = Context::from_waker(Waker::noop());
        assert!(!clock.passed(&mut cx));
        clock.progress(tokio::time::Instant::now());
        clock.handed_out(tokio::time::Instant::now());
        clock.resumed(tokio::time::Instant::now());
        std::thread::sleep(Duration::from_millis(5));
        assert!(!clock.passed(&mut cx));
        assert_eq!(clock.longest_pause(), Duration::ZERO);
    }
}
