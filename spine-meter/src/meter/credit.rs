//! Refusing an account that cannot pay before any template or tokenizer work.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use spine_core::AccountId;

/// How long a refusal for lack of credit is remembered: a request from the same account within
/// this time that could not be paid for by the balance seen then is refused at once, before its
/// body is read, templated or tokenized. Credits added meanwhile count from the next request
/// after it.
pub const REFUSED_CREDIT_TTL: Duration = Duration::from_secs(1);
/// Most accounts remembered; when full, the memory starts over (it is only a shortcut).
const MAX_REMEMBERED: usize = 65_536;

/// The accounts whose last hold was refused for lack of credit, with the available balance then.
#[derive(Clone, Debug, Default)]
pub(crate) struct RefusedCredit(Arc<Mutex<HashMap<AccountId, (u64, Instant)>>>);

impl RefusedCredit {
    /// Remembers that `account` had `available_micros` when a hold was refused.
    pub(crate) fn record(&self, account: &AccountId, available_micros: u64) {
        let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if map.len() >= MAX_REMEMBERED && !map.contains_key(account) {
            map.clear();
        }
        map.insert(account.clone(), (available_micros, Instant::now()));
    }

    /// Forgets `account` (its hold succeeded).
    pub(crate) fn forget(&self, account: &AccountId) {
        let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if !map.is_empty() {
            map.remove(account);
        }
    }

    /// The available balance remembered for `account` when it is below `min_cost_micros` and
    /// was seen within [`REFUSED_CREDIT_TTL`]: the request cannot be paid for.
    pub(crate) fn cannot_pay(&self, account: &AccountId, min_cost_micros: u64) -> Option<u64> {
        let map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let (available, at) = map.get(account)?;
        (at.elapsed() < REFUSED_CREDIT_TTL && *available < min_cost_micros).then_some(*available)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
