//! [`IdleTimer`]: the bound on silence between two frames of a response body.

use std::future::Future;
use std::pin::Pin;
use std::task::Context;
use std::time::Duration;

use tokio::time::Instant;

/// Bounds the gap between two frames of a body without touching a timer per frame: each frame
/// only stores `Instant::now()`; one `Sleep` (created the first time the body is pending) is
/// re-armed to `last frame + timeout` when it fires early because frames came in the meantime.
///
/// Used by [`Route`](crate::Route) for [`RouteConfig::stream_idle_timeout`](crate::RouteConfig)
/// and by body wrappers of other hops (e.g. a gateway's cross-instance relay). Runs on Tokio's
/// clock (`tokio::time`), so a paused test clock drives it; outside a Tokio runtime the bound is
/// not kept ([`IdleTimer::poll_expired`] never reports expiry).
#[derive(Debug)]
pub struct IdleTimer {
    /// Longest gap allowed (not zero).
    timeout: Duration,
    /// When the body last gave a frame (at first: when the timer was made).
    last_frame: Instant,
    /// Fires at or before `last_frame + timeout`; `None` until first needed.
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl IdleTimer {
    /// A timer counting from now; `None` when `timeout` is zero (the bound is disabled).
    pub fn new(timeout: Duration) -> Option<Self> {
        (!timeout.is_zero()).then(|| Self {
            timeout,
            last_frame: Instant::now(),
            sleep: None,
        })
    }

    /// The longest gap allowed.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Records that the body gave a frame (one clock read).
    pub fn frame(&mut self) {
        self.last_frame = Instant::now();
    }

    /// Call while the body is pending: `true` once it has given nothing for the timeout;
    /// otherwise the timer is armed and `cx`'s waker registered with it.
    pub fn poll_expired(&mut self, cx: &mut Context<'_>) -> bool {
        // a timeout too large for the clock (e.g. u64::MAX seconds, meant as "never") never
        // expires
        let Some(deadline) = self.last_frame.checked_add(self.timeout) else {
            return false;
        };
        let sleep = match self.sleep.as_mut() {
            Some(sleep) => sleep,
            None => {
                if tokio::runtime::Handle::try_current().is_err() {
                    // no runtime, no timer: the bound cannot be kept
                    return false;
                }
                self.sleep
                    .insert(Box::pin(tokio::time::sleep_until(deadline)))
            }
        };
        loop {
            if sleep.as_mut().poll(cx).is_pending() {
                return false;
            }
            // fired: frames may have come since it was armed
            let Some(deadline) = self.last_frame.checked_add(self.timeout) else {
                return false;
            };
            if deadline <= Instant::now() {
                return true;
            }
            sleep.as_mut().reset(deadline);
        }
    }
}

#[cfg(test)]
mod tests;
