//! Refusing an account that cannot pay before any template or tokenizer work.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use spine_core::AccountId;
use tokio::sync::Semaphore;

/// How long a refusal for lack of credit is remembered: a request from the same account within
/// this time that could not be paid for by the balance seen then is refused at once, before its
/// body is parsed, templated or tokenized. The memory is dropped when the account's hold is
/// placed, when one of its settlements commits (its holds shrink) and when credit is added
/// through [`CreditRefusals::credit_added`]; credit added by another process counts within
/// this time.
pub const REFUSED_CREDIT_TTL: Duration = Duration::from_secs(1);
/// How long a remembered refusal's answer is held back by default
/// ([`MeterConfig::refused_credit_delay`](super::MeterConfig::refused_credit_delay)).
pub const DEFAULT_REFUSED_CREDIT_DELAY: Duration = Duration::from_millis(250);
/// Most remembered refusals held back at once; past it they are answered at once. The delay
/// bounds a flood's rate per connection; this bounds the connections it keeps busy: a held-back
/// request is in flight, so a listener at its connection cap cannot evict its connection for a
/// new caller. Keep it well under the public listener's cap (the reference gateway's default
/// is 4,096 connections), so a flood never holds every connection.
pub const MAX_DELAYED_REFUSALS: usize = 1024;
/// Body bytes a remembered refusal reads per delay: a refused request whose body is larger is
/// held back one `refused_credit_delay` per started `REFUSED_BODY_BYTES_PER_DELAY` (a 4 MiB
/// body, 16 delays: 4 s by default), up to [`MAX_REFUSED_DELAYS`]. Reading and dropping a body
/// costs the gateway 0.15–0.22 ms of CPU per MiB (the kernel's copy; measured in
/// `docs/benchmarks.md`: 0.7–0.9 ms for 4 MiB, 55 µs for a small body on the same machine), so a
/// closed-loop flood from one connection then costs about the same CPU per second whatever its
/// bodies' size: about one small refusal's worth per delay.
pub const REFUSED_BODY_BYTES_PER_DELAY: usize = 256 * 1024;
/// Most delays one remembered refusal is held back, whatever its body's size (16: 4 s by
/// default, a 4 MiB body's share).
pub const MAX_REFUSED_DELAYS: u32 = 16;
/// Most accounts remembered; when full, the memory starts over (it is only a shortcut).
const MAX_REMEMBERED: usize = 65_536;

/// A handle on a [`MeterLayer`](super::MeterLayer)'s remembered refusals for lack of credit
/// ([`MeterLayer::credit_refusals`](super::MeterLayer::credit_refusals)): a process that adds
/// credit to an account calls [`CreditRefusals::credit_added`] so that the account's next
/// request is not refused on the balance remembered from before (another process's meter
/// forgets it within [`REFUSED_CREDIT_TTL`]). Cheap to clone.
#[derive(Clone, Debug)]
pub struct CreditRefusals(pub(crate) RefusedCredit);

impl CreditRefusals {
    /// Forgets any refusal remembered for `account`.
    pub fn credit_added(&self, account: &AccountId) {
        self.0.forget(account);
    }
}

/// The accounts whose last hold was refused for lack of credit, with the available balance then,
/// and the permits of the refusals being held back.
#[derive(Clone, Debug)]
pub(crate) struct RefusedCredit {
    accounts: Arc<Mutex<HashMap<AccountId, (u64, Instant)>>>,
    delayed: Arc<Semaphore>,
}

impl Default for RefusedCredit {
    fn default() -> Self {
        Self {
            accounts: Arc::default(),
            delayed: Arc::new(Semaphore::new(MAX_DELAYED_REFUSALS)),
        }
    }
}

impl RefusedCredit {
    /// Remembers that `account` had `available_micros` when a hold was refused.
    pub(crate) fn record(&self, account: &AccountId, available_micros: u64) {
        let mut map = self.accounts.lock().unwrap_or_else(PoisonError::into_inner);
        if map.len() >= MAX_REMEMBERED && !map.contains_key(account) {
            map.clear();
        }
        map.insert(account.clone(), (available_micros, Instant::now()));
    }

    /// Forgets `account` (its hold succeeded).
    pub(crate) fn forget(&self, account: &AccountId) {
        let mut map = self.accounts.lock().unwrap_or_else(PoisonError::into_inner);
        if !map.is_empty() {
            map.remove(account);
        }
    }

    /// The available balance remembered for `account` when it is below `min_cost_micros` and
    /// was seen within [`REFUSED_CREDIT_TTL`]: the request cannot be paid for.
    pub(crate) fn cannot_pay(&self, account: &AccountId, min_cost_micros: u64) -> Option<u64> {
        let map = self.accounts.lock().unwrap_or_else(PoisonError::into_inner);
        let (available, at) = map.get(account)?;
        (at.elapsed() < REFUSED_CREDIT_TTL && *available < min_cost_micros).then_some(*available)
    }

    /// Waits before a remembered refusal whose body was `body_bytes` long is answered:
    /// `delay` per started [`REFUSED_BODY_BYTES_PER_DELAY`] of body (at least one, at most
    /// [`MAX_REFUSED_DELAYS`]), unless [`MAX_DELAYED_REFUSALS`] are already waiting (then at
    /// once). A caller that cannot pay and sends again as soon as it is answered (a
    /// closed-loop flood) then gets one answer per connection per `delay` (per
    /// `REFUSED_BODY_BYTES_PER_DELAY` of body read), each costing a timer, instead of as many as
    /// a core can parse or copy; an honest caller whose credit ran out gets its 402 that much
    /// later.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future gives its permit back.
    pub(crate) async fn hold_back(&self, delay: Duration, body_bytes: usize) {
        if delay.is_zero() {
            return;
        }
        if let Ok(_permit) = self.delayed.try_acquire() {
            tokio::time::sleep(delay.saturating_mul(refused_delays(body_bytes))).await;
        }
    }
}

/// How many delays a remembered refusal of `body_bytes` is held back ([`RefusedCredit::hold_back`]).
fn refused_delays(body_bytes: usize) -> u32 {
    let started = body_bytes.div_ceil(REFUSED_BODY_BYTES_PER_DELAY).max(1);
    u32::try_from(started).map_or(MAX_REFUSED_DELAYS, |n| n.min(MAX_REFUSED_DELAYS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn holds_back_refusals_up_to_its_bound_then_answers_at_once() {
        let r = RefusedCredit::default();
        let delay = Duration::from_millis(250);
        let started = tokio::time::Instant::now();
        r.hold_back(delay, 100).await;
        assert_eq!(started.elapsed(), delay);
        // every permit taken: the next refusal is answered at once
        let _all = r
            .delayed
            .clone()
            .try_acquire_many_owned(u32::try_from(MAX_DELAYED_REFUSALS).unwrap_or(u32::MAX));
        assert!(_all.is_ok());
        let started = tokio::time::Instant::now();
        r.hold_back(delay, 100).await;
        assert_eq!(started.elapsed(), Duration::ZERO);
        drop(_all);
        r.hold_back(Duration::ZERO, 4 << 20).await;
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_larger_body_is_held_back_longer_up_to_its_bound() {
        let r = RefusedCredit::default();
        let delay = Duration::from_millis(250);
        for (body_bytes, delays) in [
            (0, 1),
            (REFUSED_BODY_BYTES_PER_DELAY, 1),
            (REFUSED_BODY_BYTES_PER_DELAY + 1, 2),
            (4 << 20, 16),
            (64 << 20, MAX_REFUSED_DELAYS),
            (usize::MAX, MAX_REFUSED_DELAYS),
        ] {
            let started = tokio::time::Instant::now();
            r.hold_back(delay, body_bytes).await;
            assert_eq!(started.elapsed(), delay * delays, "{body_bytes} bytes");
        }
    }

    #[test]
    fn remembers_a_refusal_for_its_ttl_and_forgets_on_success() {
        let r = RefusedCredit::default();
        let a = AccountId::new("acct_1");
        assert_eq!(r.cannot_pay(&a, 1), None);
        r.record(&a, 0);
        assert_eq!(r.cannot_pay(&a, 1), Some(0));
        // enough for this one
        r.record(&a, 10);
        assert_eq!(r.cannot_pay(&a, 10), None);
        assert_eq!(r.cannot_pay(&a, 11), Some(10));
        r.forget(&a);
        assert_eq!(r.cannot_pay(&a, 11), None);
    }
}
