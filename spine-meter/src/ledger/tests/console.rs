//! The console's store ([`ConsoleStore`]) on both stores: users of exactly one account or
//! operator, sessions and links by hash (expiry, revocation, single use), every query scoped
//! to its owner, keyset pages that neither skip nor repeat a row.

use super::*;

async fn console_setup(backend: Backend) -> (TestDb, Arc<dyn Store>, Arc<dyn ConsoleStore>) {
    let db = TestDb::new(backend).await;
    let store = db.open().await;
    let console = store.clone().console();
    (db, store, console)
}

fn user(id: &str, email: &str, role: ConsoleRole) -> ConsoleUser {
    ConsoleUser {
        user_id: id.to_owned(),
        email: email.to_owned(),
        role,
        password_hash: Some("$argon2id$fake".to_owned()),
        created_at_ms: 0,
    }
}

async fn users_sessions_and_links(backend: Backend) {
    let (_db, store, c) = console_setup(backend).await;
    let (acct, _node, op) = setup_with(&*store, "").await;
    let builder = user("cu_1", "b@example.com", ConsoleRole::Builder(acct.clone()));
    c.create_console_user(&builder).await.unwrap();
    c.create_console_user(&user(
        "cu_2",
        "o@example.com",
        ConsoleRole::Operator(op.clone()),
    ))
    .await
    .unwrap();
    // the same e-mail again, an unknown owner
    assert!(matches!(
        c.create_console_user(&user(
            "cu_3",
            "b@example.com",
            ConsoleRole::Builder(acct.clone())
        ))
        .await,
        Err(LedgerError::Duplicate {
            what: "console user"
        })
    ));
    assert!(matches!(
        c.create_console_user(&user(
            "cu_4",
            "x@example.com",
            ConsoleRole::Builder(AccountId::from("nope"))
        ))
        .await,
        Err(LedgerError::UnknownAccount(_))
    ));
    assert!(matches!(
        c.create_console_user(&user(
            "cu_5",
            "y@example.com",
            ConsoleRole::Operator(OperatorId::from("nope"))
        ))
        .await,
        Err(LedgerError::UnknownOperator(_))
    ));
    let found = c
        .console_user_by_email("b@example.com")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.user_id, "cu_1");
    assert_eq!(found.role, ConsoleRole::Builder(acct.clone()));
    assert_eq!(found.password_hash.as_deref(), Some("$argon2id$fake"));
    assert!(c
        .console_user_by_email("B@example.com")
        .await
        .unwrap()
        .is_none());

    // sessions: live until expiry, revoked one by one or all of a user's
    let now = spine_core::unix_time_ms();
    c.create_console_session("s1", "cu_1", now + 60_000)
        .await
        .unwrap();
    c.create_console_session("s2", "cu_1", now + 60_000)
        .await
        .unwrap();
    c.create_console_session("s3", "cu_1", now - 1)
        .await
        .unwrap();
    assert_eq!(
        c.console_session("s1", now).await.unwrap().unwrap().user_id,
        "cu_1"
    );
    assert!(
        c.console_session("s3", now).await.unwrap().is_none(),
        "expired"
    );
    assert!(
        c.console_session("s1", now + 60_000)
            .await
            .unwrap()
            .is_none(),
        "expired later"
    );
    assert!(c.console_session("nope", now).await.unwrap().is_none());
    c.revoke_console_session("s1").await.unwrap();
    assert!(c.console_session("s1", now).await.unwrap().is_none());
    assert!(c.console_session("s2", now).await.unwrap().is_some());
    assert_eq!(
        c.revoke_console_sessions("cu_1").await.unwrap(),
        1,
        "s2 only (s1 revoked, s3 expired)"
    );
    assert!(c.console_session("s2", now).await.unwrap().is_none());

    // links: once, before expiry
    c.create_console_link("l1", "cu_2", now + 60_000)
        .await
        .unwrap();
    c.create_console_link("l2", "cu_2", now - 1).await.unwrap();
    let u = c.redeem_console_link("l1", now).await.unwrap().unwrap();
    assert_eq!(u.role, ConsoleRole::Operator(op));
    assert!(
        c.redeem_console_link("l1", now).await.unwrap().is_none(),
        "used"
    );
    assert!(
        c.redeem_console_link("l2", now).await.unwrap().is_none(),
        "expired"
    );
}

async fn keys_are_named_scoped_and_revocable(backend: Backend) {
    let (_db, store, c) = console_setup(backend).await;
    let (a, _, _) = setup_with(&*store, "a").await;
    let (b, _, _) = setup_with(&*store, "b").await;
    c.create_named_api_key(&a, "hash_a1", "prod <script>", "wxyz")
        .await
        .unwrap();
    c.create_named_api_key(&a, "hash_a2", "dev", "abcd")
        .await
        .unwrap();
    store.create_api_key(&b, "hash_b1").await.unwrap();
    store
        .set_key_limits(
            "hash_a1",
            KeyLimits {
                rpm_limit: Some(60),
                tpm_limit: Some(1_000),
            },
        )
        .await
        .unwrap();
    let page = c.account_keys(&a, None, 10).await.unwrap();
    let hashes: Vec<_> = page.rows.iter().map(|k| k.key_hash.as_str()).collect();
    assert_eq!(hashes.len(), 2);
    assert!(hashes.contains(&"hash_a1") && hashes.contains(&"hash_a2"));
    assert!(page.next.is_none());
    let a1 = page.rows.iter().find(|k| k.key_hash == "hash_a1").unwrap();
    assert_eq!(a1.name.as_deref(), Some("prod <script>"));
    assert_eq!(a1.key_hint.as_deref(), Some("wxyz"));
    assert_eq!(
        a1.limits,
        KeyLimits {
            rpm_limit: Some(60),
            tpm_limit: Some(1_000)
        }
    );
    // another account's key cannot be revoked through this account
    assert!(!c.revoke_api_key(&a, "hash_b1").await.unwrap());
    assert_eq!(
        store.account_for_key_hash("hash_b1").await.unwrap(),
        Some(b.clone())
    );
    assert!(c.revoke_api_key(&a, "hash_a1").await.unwrap());
    assert!(
        !c.revoke_api_key(&a, "hash_a1").await.unwrap(),
        "already revoked"
    );
    assert_eq!(
        store.account_for_key_hash("hash_a1").await.unwrap(),
        None,
        "a revoked key authenticates nothing"
    );
    assert_eq!(
        store.account_for_key_hash("hash_a2").await.unwrap(),
        Some(a.clone())
    );
    let page = c.account_keys(&a, None, 10).await.unwrap();
    assert!(page
        .rows
        .iter()
        .find(|k| k.key_hash == "hash_a1")
        .unwrap()
        .revoked_at_ms
        .is_some());
    assert_eq!(c.account_keys(&b, None, 10).await.unwrap().rows.len(), 1);
}

async fn request_log_pages_filters_and_aggregates(backend: Backend) {
    let (_db, store, c) = console_setup(backend).await;
    let (a, node, op) = setup_with(&*store, "").await;
    let (b, _, _) = setup_with(&*store, "b").await;
    store.add_credits(&a, 1_000_000, "big").await.unwrap();
    // 7 requests of `a` (keys k1 / k2 alternating), 1 of `b`
    for i in 0..7 {
        let id = format!("req_{i:02}");
        store
            .hold(
                RequestId::from(id.as_str()),
                a.clone(),
                ModelId::from("smollm2"),
                100,
            )
            .await
            .unwrap();
        let mut s = settlement(&id, &a, Some(node.clone()), StreamOutcome::Completed);
        s.key = Some(if i % 2 == 0 { "k1" } else { "k2" }.to_owned());
        if i == 6 {
            s.outcome = StreamOutcome::UpstreamFailed;
        }
        s.ttft_ms = Some(100 + i);
        store.settle(s).await.unwrap();
    }
    store
        .hold(
            RequestId::from("req_b"),
            b.clone(),
            ModelId::from("smollm2"),
            100,
        )
        .await
        .unwrap();
    store
        .settle(settlement(
            "req_b",
            &b,
            Some(node.clone()),
            StreamOutcome::Completed,
        ))
        .await
        .unwrap();

    // pages of 3: 3 + 3 + 1, no repeats, newest first, never `b`'s
    let all = RequestFilter::default();
    let mut seen = Vec::new();
    let mut cursor: Option<PageCursor> = None;
    let mut pages = 0;
    loop {
        let page = c
            .account_requests(&a, &all, cursor.as_ref(), 3)
            .await
            .unwrap();
        pages += 1;
        assert!(page.rows.len() <= 3);
        seen.extend(page.rows.iter().map(|r| r.request_id.clone()));
        match page.next {
            Some(next) => cursor = Some(PageCursor::decode(&next.encode()).unwrap()),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 7, "every request once: {seen:?}");
    assert!(!seen.contains(&"req_b".to_owned()));
    let first = c
        .account_requests(&a, &all, None, 1)
        .await
        .unwrap()
        .rows
        .remove(0);
    assert_eq!(
        first.billed,
        Usage {
            prompt_tokens: 34,
            completion_tokens: 12
        }
    );
    assert!(first.duration_ms.is_some_and(|d| d >= 0));
    assert_eq!(first.ttft_ms, Some(106), "the newest: req_06");
    assert_eq!(first.node, Some(node.clone()));

    let by_key = RequestFilter {
        key_hash: Some("k1".into()),
        ..RequestFilter::default()
    };
    assert_eq!(
        c.account_requests(&a, &by_key, None, 50)
            .await
            .unwrap()
            .rows
            .len(),
        4
    );
    let failed = RequestFilter {
        outcome: Some("upstream_failed".into()),
        ..RequestFilter::default()
    };
    let rows = c
        .account_requests(&a, &failed, None, 50)
        .await
        .unwrap()
        .rows;
    assert_eq!(
        rows.iter()
            .map(|r| r.request_id.as_str())
            .collect::<Vec<_>>(),
        ["req_06"]
    );
    assert_eq!(rows[0].debit_micros, 0);
    let future = RequestFilter {
        since_ms: Some(i64::MAX - 1),
        ..RequestFilter::default()
    };
    assert!(c
        .account_requests(&a, &future, None, 50)
        .await
        .unwrap()
        .rows
        .is_empty());
    let other_model = RequestFilter {
        model: Some("other".into()),
        ..RequestFilter::default()
    };
    assert!(c
        .account_requests(&a, &other_model, None, 50)
        .await
        .unwrap()
        .rows
        .is_empty());

    // usage per day × model × key, equal to the records' sums
    let cost = settlement("x", &a, None, StreamOutcome::Completed)
        .amounts(100, true)
        .debit_micros;
    let usage = c.account_usage(&a, 0, i64::MAX, 100).await.unwrap();
    assert_eq!(usage.len(), 2, "{usage:?}");
    let k1 = usage
        .iter()
        .find(|u| u.key_hash.as_deref() == Some("k1"))
        .unwrap();
    assert_eq!(
        (k1.requests, k1.prompt_tokens, k1.completion_tokens),
        (4, 4 * 34, 4 * 12)
    );
    assert_eq!(k1.debit_micros, 3 * cost, "req_06 failed: no debit");
    assert_eq!(k1.day, spine_core::unix_time_ms() / 86_400_000);
    assert!(c.account_usage(&a, 0, 1, 100).await.unwrap().is_empty());

    // earnings per day × model equal the operator's paid credits
    let earnings = c.operator_earnings(&op, 0, i64::MAX, 100).await.unwrap();
    assert_eq!(earnings.len(), 1);
    assert_eq!(earnings[0].requests_served, 7, "6 of a + 1 of b completed");
    assert_eq!(
        earnings[0].earned_micros,
        store.operator_earned_micros(&op).await.unwrap()
    );

    // credit history, paged
    let credits = c.account_credits(&a, None, 1).await.unwrap();
    assert_eq!(credits.rows.len(), 1);
    let rest = c
        .account_credits(&a, credits.next.as_ref(), 10)
        .await
        .unwrap();
    assert_eq!(rest.rows.len(), 1);
    assert!(rest.next.is_none());
    let mut keys = vec![
        credits.rows[0].idempotency_key.clone(),
        rest.rows[0].idempotency_key.clone(),
    ];
    keys.sort();
    assert_eq!(keys, ["big", "topup-1"]);
}

async fn enrollments_are_listed_and_revoked_per_operator(backend: Backend) {
    let (_db, store, c) = console_setup(backend).await;
    let (_, _, op) = setup_with(&*store, "").await;
    let (_, _, other) = setup_with(&*store, "o").await;
    let later = spine_core::unix_time_ms() + 3_600_000;
    store.create_enrollment(&op, "t1", later).await.unwrap();
    store.create_enrollment(&op, "t2", later).await.unwrap();
    store.create_enrollment(&other, "t3", later).await.unwrap();
    let page = c.operator_enrollments(&op, None, 10).await.unwrap();
    let mut hashes: Vec<_> = page.rows.iter().map(|e| e.token_hash.clone()).collect();
    hashes.sort();
    assert_eq!(hashes, ["t1", "t2"]);
    assert!(
        !c.revoke_enrollment(&op, "t3").await.unwrap(),
        "another operator's token"
    );
    assert!(c.revoke_enrollment(&op, "t1").await.unwrap());
    assert!(!c.revoke_enrollment(&op, "t1").await.unwrap());
    assert!(matches!(
        store.redeem_enrollment("t1", "ed25519:NEW1", None).await,
        Err(LedgerError::EnrollmentExpired)
    ));
    store
        .redeem_enrollment("t3", "ed25519:NEW3", None)
        .await
        .unwrap();
    assert!(
        !c.revoke_enrollment(&other, "t3").await.unwrap(),
        "redeemed"
    );
}

/// The earnings roll-up counts a request's operator credit once it is paid: held in escrow →
/// not yet; the audit passed → paid and counted; forfeited → never. Always equal to what the
/// operator was credited.
async fn earnings_rollup_counts_escrow_once_paid(backend: Backend) {
    let (_db, store, c) = console_setup(backend).await;
    let (a, node, op) = setup_with(&*store, "").await;
    store.add_credits(&a, 1_000_000, "big").await.unwrap();
    let settle = |id: &'static str, held: bool, model: &'static str| {
        let store = store.clone();
        let (a, node) = (a.clone(), node.clone());
        async move {
            store
                .hold(RequestId::from(id), a.clone(), ModelId::from(model), 100)
                .await
                .unwrap();
            let mut s = settlement(id, &a, Some(node), StreamOutcome::Completed);
            s.model = ModelId::from(model);
            s.earnings_held = held;
            store.settle(s).await.unwrap()
        }
    };
    let paid = settle("r_paid", false, "smollm2")
        .await
        .operator_credit_micros;
    let held = settle("r_held", true, "smollm2")
        .await
        .operator_credit_micros;
    let lost = settle("r_lost", true, "other").await.operator_credit_micros;
    assert!(paid > 0 && held > 0 && lost > 0);
    let earned = |rows: Vec<EarningsDay>, model: &str| {
        rows.iter()
            .filter(|r| r.model.as_str() == model)
            .map(|r| (r.requests_served, r.earned_micros))
            .fold((0, 0), |acc, x| (acc.0 + x.0, acc.1 + x.1))
    };
    let rows = c.operator_earnings(&op, 0, i64::MAX, 100).await.unwrap();
    assert_eq!(earned(rows.clone(), "smollm2"), (2, paid), "held: not yet");
    assert_eq!(earned(rows, "other"), (1, 0));
    store
        .resolve_held_earnings(&node, &ModelId::from("smollm2"), true)
        .await
        .unwrap();
    store
        .resolve_held_earnings(&node, &ModelId::from("other"), false)
        .await
        .unwrap();
    let rows = c.operator_earnings(&op, 0, i64::MAX, 100).await.unwrap();
    assert_eq!(earned(rows.clone(), "smollm2"), (2, paid + held));
    assert_eq!(earned(rows.clone(), "other"), (1, 0), "forfeited: never");
    let total: u64 = rows.iter().map(|r| r.earned_micros).sum();
    assert_eq!(total, store.operator_earned_micros(&op).await.unwrap());
    // a request without a key is usage under no key
    let usage = c.account_usage(&a, 0, i64::MAX, 100).await.unwrap();
    assert!(usage.iter().all(|u| u.key_hash.is_none()), "{usage:?}");
    assert_eq!(usage.iter().map(|u| u.requests).sum::<u64>(), 3);
}

/// The platform's page (schema version 9): a platform user (no account, no operator); the
/// days' debits and operator credits equal the records' (escrow once paid), the discrepancy
/// list holds only the records with one, newest first and paged, and credit held counts the
/// holds in flight and the escrow.
async fn platform_days_discrepancies_and_held_credit(backend: Backend) {
    let (_db, store, c) = console_setup(backend).await;
    let (a, node, op) = setup_with(&*store, "").await;
    let (b, _, _) = setup_with(&*store, "b").await;
    store.add_credits(&a, 1_000_000, "big").await.unwrap();
    c.create_console_user(&user("cu_p", "p@example.com", ConsoleRole::Platform))
        .await
        .unwrap();
    let now = spine_core::unix_time_ms();
    c.create_console_session("sp", "cu_p", now + 60_000)
        .await
        .unwrap();
    let u = c.console_session("sp", now).await.unwrap().unwrap();
    assert_eq!(u.role, ConsoleRole::Platform);
    let mut debits = 0;
    let mut paid = 0;
    for (i, (held, discrepancy)) in [(false, false), (false, true), (true, true), (false, false)]
        .into_iter()
        .enumerate()
    {
        let id = format!("p_{i}");
        store
            .hold(
                RequestId::from(id.as_str()),
                a.clone(),
                ModelId::from("smollm2"),
                100,
            )
            .await
            .unwrap();
        let mut s = settlement(&id, &a, Some(node.clone()), StreamOutcome::Completed);
        s.earnings_held = held;
        s.discrepancy = discrepancy;
        let r = store.settle(s).await.unwrap();
        debits += r.debit_micros;
        if !held {
            paid += r.operator_credit_micros;
        }
    }
    // one request in flight of `b`
    store
        .hold(
            RequestId::from("p_live"),
            b.clone(),
            ModelId::from("smollm2"),
            77,
        )
        .await
        .unwrap();
    let days = c.platform_days(0, i64::MAX, 100).await.unwrap();
    assert_eq!(days.len(), 1, "{days:?}");
    assert_eq!(
        (
            days[0].requests,
            days[0].debit_micros,
            days[0].operator_credit_micros
        ),
        (4, debits, paid)
    );
    assert_eq!(days[0].completion_tokens, 4 * 12);
    let ops = c.platform_operators(0, i64::MAX, 100).await.unwrap();
    assert_eq!(ops.len(), 1);
    assert_eq!(
        (
            &ops[0].operator,
            ops[0].requests_served,
            ops[0].earned_micros
        ),
        (&op, 4, paid)
    );
    let nodes = c.platform_nodes(None, 100).await.unwrap();
    assert!(nodes
        .rows
        .iter()
        .any(|n| n.node_id == node && n.operator == op));
    assert!(nodes.rows.len() >= 2, "every operator's nodes");
    let first = c.platform_discrepancies(None, 1).await.unwrap();
    assert_eq!(first.rows.len(), 1);
    assert_eq!(first.rows[0].request_id, "p_2", "newest first");
    assert_eq!(first.rows[0].account, a);
    let second = c
        .platform_discrepancies(first.next.as_ref(), 1)
        .await
        .unwrap();
    assert_eq!(
        (
            second.rows.len(),
            second.rows[0].request_id.as_str(),
            second.next
        ),
        (1, "p_1", None)
    );
    let held = c.platform_held().await.unwrap();
    assert_eq!((held.holds, held.hold_micros), (1, 77));
    assert!(held.oldest_hold_at_ms.is_some());
    assert_eq!(held.escrow_requests, 1);
    assert!(held.escrow_micros > 0);
}

macro_rules! console_tests {
    ($($t:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(super::Backend::Sqlite).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(super::Backend::Postgres).await;
                }
            )*
        }
    };
}

console_tests!(
    users_sessions_and_links,
    keys_are_named_scoped_and_revocable,
    request_log_pages_filters_and_aggregates,
    enrollments_are_listed_and_revoked_per_operator,
    earnings_rollup_counts_escrow_once_paid,
    platform_days_discrepancies_and_held_credit,
);
