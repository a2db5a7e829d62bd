//! Picks that may wait: the registry's side of the admission queue ([`crate::queue`]). The
//! queue keeps the waiters; this side decides whether a request waits, answers each waiter with
//! a pick or an error, and offers the queue the slots that free.

use std::time::Duration;

use spine_core::ModelId;
use tokio::time::Instant;

use super::{Ask, NodeRegistry, Pick, QueuedAsk, RouteError};
use crate::queue::{Enqueued, Offer, QueueSnapshot, QueueTicket, Unserved};

impl NodeRegistry {
    /// Picks a node for `ask`, waiting in the model's admission queue (see [`crate::queue`])
    /// when every node that could serve it is full, at most
    /// [`QueueConfig::max_wait`](crate::QueueConfig::max_wait). `ticket`: the request's fairness
    /// class; `None` (or the queue disabled in [`QueueConfig`](crate::QueueConfig)) never waits,
    /// as [`NodeRegistry::pick_preferring`].
    ///
    /// # Errors
    ///
    /// [`RouteError::NoNodeForModel`], [`RouteError::Unsupported`],
    /// [`RouteError::ContextLengthExceeded`] at once (or while waiting, when the nodes that could
    /// serve it go away); [`RouteError::QueueFull`] (at once, or while waiting when its place
    /// goes to another account's request), [`RouteError::QueueTimeout`] after `max_wait`;
    /// [`RouteError::AtCapacity`] when not queued.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves the queue at once; no slot is held for it.
    pub async fn acquire(
        &self,
        ask: Ask<'_>,
        ticket: Option<&QueueTicket>,
    ) -> Result<Pick, RouteError> {
        let deadline = Instant::now() + self.inner.config.queue.max_wait;
        self.acquire_until(ask, ticket, deadline).await
    }

    /// As [`acquire`](Self::acquire), waiting at most until `deadline` (and never longer than
    /// [`QueueConfig::max_wait`](crate::QueueConfig::max_wait)): the several attempts of one
    /// request share one deadline. A deadline already past does not wait.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire).
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire).
    pub async fn acquire_until(
        &self,
        ask: Ask<'_>,
        ticket: Option<&QueueTicket>,
        deadline: Instant,
    ) -> Result<Pick, RouteError> {
        let config = self.inner.config.queue;
        let ticket = ticket.filter(|_| Instant::now() < deadline);
        let Some(ticket) = ticket.filter(|_| config.enabled()) else {
            return self.pick_inner(ask, Instant::now());
        };
        let now = Instant::now();
        let admit = |behind_others: bool| {
            if behind_others {
                // fail fast when no node could ever serve it; otherwise wait behind the others
                self.servable(&ask).map_err(Err)?;
            } else {
                match self.pick_inner(ask, now) {
                    Err(RouteError::AtCapacity(_)) => {}
                    other => return Err(other),
                }
            }
            Ok(QueuedAsk::of(&ask))
        };
        let (place, behind_others) = match self.inner.queue.enqueue(ask.model, ticket, now, admit) {
            Enqueued::Answered(reply) => return reply,
            Enqueued::Full { retry_after } => {
                return Err(RouteError::QueueFull {
                    model: ask.model.clone(),
                    retry_after,
                })
            }
            Enqueued::Waiting {
                place,
                behind_others,
            } => (place, behind_others),
        };
        if behind_others {
            // a slot may be free that the waiters ahead cannot use, or this one is first now
            self.dispatch_models(std::slice::from_ref(ask.model), false);
        }
        let answer = place.wait(deadline.min(now + config.max_wait)).await;
        answer.unwrap_or_else(|unserved| Err(unserved_error(ask.model, unserved, config.max_wait)))
    }

    /// Offers free slots to the waiters of `models`, in fair order. `fail_unservable`: also
    /// scan when no slot is free, failing the waiters no routable node could serve any more.
    pub(crate) fn dispatch_models(&self, models: &[ModelId], fail_unservable: bool) {
        for model in models {
            self.inner.queue.wake(
                model,
                fail_unservable,
                || self.free_slots(model) > 0,
                |queued, now| match self.pick_inner(queued.ask(model), now) {
                    Err(RouteError::AtCapacity(_)) => Offer::Skip,
                    Ok(pick) => Offer::Serve(Ok(pick)),
                    Err(e) => Offer::Fail(Err(e)),
                },
            );
        }
    }

    /// Every model's queue now, sorted by model.
    pub fn queue_snapshot(&self) -> Vec<QueueSnapshot> {
        self.inner.queue.snapshot()
    }
}

/// The error of a request of `model` that the queue answered itself.
fn unserved_error(model: &ModelId, unserved: Unserved, max_wait: Duration) -> RouteError {
    match unserved {
        Unserved::Full { retry_after } => RouteError::QueueFull {
            model: model.clone(),
            retry_after,
        },
        Unserved::Timeout { retry_after } => RouteError::QueueTimeout {
            model: model.clone(),
            waited: max_wait,
            retry_after,
        },
        // the queue went away without an answer: only when the registry itself is gone
        Unserved::Closed => RouteError::AtCapacity(model.clone()),
    }
}

#[cfg(test)]
mod tests;
