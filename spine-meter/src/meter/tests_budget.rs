//! `collect_limited`'s shared budget ([`super::collect_limited`]).
#![allow(clippy::unwrap_used)]
use std::sync::Arc;

use spine_core::{AccountId, BoxBody};
use spine_test_support::ScriptedBody;

use super::super::config::AccountBodyBytes;
use super::{collect_limited, AccountShare, MeterError};

/// A body of data frames of the given sizes.
fn body(parts: &[usize]) -> BoxBody {
    BoxBody::new(ScriptedBody::data(parts.iter().map(|&n| vec![b'x'; n])))
}

#[tokio::test]
async fn a_body_takes_its_kib_from_the_budget_while_it_is_read_and_gives_them_back() {
    let budget = Arc::new(tokio::sync::Semaphore::new(4)); // 4 KiB
    let got = collect_limited(body(&[1000, 1000, 2000]), 1 << 20, &budget, 4096, None)
        .await
        .unwrap();
    assert_eq!(got.len(), 4000);
    assert_eq!(budget.available_permits(), 4, "given back once whole");
    // a body that needs more than what is left of the budget is refused
    let _held = budget.clone().try_acquire_many_owned(3).unwrap();
    let refused = collect_limited(body(&[1000, 1000]), 1 << 20, &budget, 4096, None).await;
    assert!(matches!(
        refused,
        Err(MeterError::BodiesOverBudget { limit_bytes: 4096 })
    ));
    assert_eq!(
        budget.available_permits(),
        1,
        "nothing kept by the refused one"
    );
    // the per-request limit still answers first
    let too_large = collect_limited(body(&[3000]), 2000, &budget, 4096, None).await;
    assert!(matches!(
        too_large,
        Err(MeterError::BodyTooLarge { limit_bytes: 2000 })
    ));
}

/// Frames of the given sizes, then nothing, ever (a sender that stalls mid-body).
fn stalled(parts: &[usize]) -> BoxBody {
    BoxBody::new(ScriptedBody::data(parts.iter().map(|&n| vec![b'x'; n])).hang())
}

/// [`collect_limited`] of `body` from `account`, whose share of the 1 MiB `budget` in `shares`
/// is 256 KiB (1 MiB a body).
async fn collect_shared(
    body: BoxBody,
    budget: &Arc<tokio::sync::Semaphore>,
    shares: &AccountBodyBytes,
    account: &AccountId,
) -> Result<bytes::Bytes, MeterError> {
    let share = AccountShare {
        bytes: shares,
        account,
        limit: 256 * 1024,
    };
    collect_limited(body, 1 << 20, budget, 1 << 20, Some(share)).await
}

#[tokio::test]
async fn one_account_past_its_share_is_refused_while_others_are_served() {
    let budget = Arc::new(tokio::sync::Semaphore::new(1024)); // 1 MiB shared
    let shares = Arc::new(AccountBodyBytes::default());
    let (greedy, other) = (AccountId::from("greedy"), AccountId::from("other"));
    // the greedy account opens two bodies that stall at 100 KB each (200 KB of its 256 KiB
    // share); a third that needs 80 KB more is refused
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let (shares, account, budget) = (shares.clone(), greedy.clone(), budget.clone());
        tasks.push(tokio::spawn(async move {
            collect_shared(stalled(&[100_000]), &budget, &shares, &account).await
        }));
    }
    for _ in 0..100 {
        if shares.used(&greedy) == 200_000 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(shares.used(&greedy), 200_000);
    let refused = collect_shared(body(&[40_000, 40_000]), &budget, &shares, &greedy).await;
    assert!(
        matches!(
            refused,
            Err(MeterError::AccountBodiesOverBudget {
                limit_bytes: 262_144
            })
        ),
        "{:?}",
        refused.as_ref().map(bytes::Bytes::len)
    );
    // nothing kept by the refused body
    assert_eq!(shares.used(&greedy), 200_000);
    // another account is served meanwhile, from the same shared budget
    let got = collect_shared(body(&[100_000, 100_000]), &budget, &shares, &other)
        .await
        .unwrap();
    assert_eq!(got.len(), 200_000);
    assert_eq!(shares.used(&other), 0, "given back once whole");
    // the stalled senders go away: their share is given back
    for t in tasks {
        t.abort();
        let _ = t.await;
    }
    assert_eq!(shares.used(&greedy), 0);
    assert_eq!(budget.available_permits(), 1024);
}
