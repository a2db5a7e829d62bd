//! The timers of a metered stream: the keepalive, the total bound and the process's drain.

use std::future::Future;
use std::task::Context;

use super::{State, KEEPALIVE_INTERVAL};

impl State {
    /// The keepalive timer restarts after every frame the client gets (`now`: the poll's
    /// reading of the clock).
    pub(super) fn reset_keepalive(&mut self, now: tokio::time::Instant) {
        if let Some(sleep) = self.keepalive.as_mut() {
            sleep.as_mut().reset(now + KEEPALIVE_INTERVAL);
        }
    }

    /// Polls the keepalive timer (started on first use, when a tokio runtime is there): true
    /// when the client has had no frame for [`KEEPALIVE_INTERVAL`].
    pub(super) fn keepalive_due(&mut self, cx: &mut Context<'_>) -> bool {
        if self.keepalive.is_none() {
            if tokio::runtime::Handle::try_current().is_err() {
                return false;
            }
            self.keepalive = Some(Box::pin(tokio::time::sleep(KEEPALIVE_INTERVAL)));
        }
        let Some(sleep) = self.keepalive.as_mut() else {
            return false;
        };
        if sleep.as_mut().poll(cx).is_ready() {
            self.reset_keepalive(self.now);
            // register the waker on the restarted timer
            if let Some(sleep) = self.keepalive.as_mut() {
                let _ = sleep.as_mut().poll(cx);
            }
            return true;
        }
        false
    }

    /// Polls the total bound (started on the first poll, when a tokio runtime is there and a
    /// bound is set): true once it passed.
    pub(super) fn deadline_passed(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.deadline_started {
            self.deadline_started = true;
            let bound = self.settings.max_stream_duration;
            if !bound.is_zero() && tokio::runtime::Handle::try_current().is_ok() {
                if let Some(at) = tokio::time::Instant::now().checked_add(bound) {
                    self.deadline = Some(Box::pin(tokio::time::sleep_until(at)));
                }
            }
        }
        self.deadline
            .as_mut()
            .is_some_and(|d| d.as_mut().poll(cx).is_ready())
    }

    /// Polls the drain deadline (its wait registered on the first poll): true once the
    /// process's drain ended and open streams must end.
    pub(super) fn drain_deadline_passed(&mut self, cx: &mut Context<'_>) -> bool {
        if self.drain_wait.is_none() {
            let Some(token) = self.settings.drain_deadline.as_ref() else {
                return false;
            };
            self.drain_wait = Some(Box::pin(token.clone().cancelled_owned()));
        }
        self.drain_wait
            .as_mut()
            .is_some_and(|w| w.as_mut().poll(cx).is_ready())
    }
}
