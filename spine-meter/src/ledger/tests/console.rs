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
        hold_and_settle(&*store, &id, &a, &node, |s| {
            s.key = Some(if i % 2 == 0 { "k1" } else { "k2" }.to_owned());
            if i == 6 {
                s.outcome = StreamOutcome::UpstreamFailed;
            }
            s.ttft_ms = Some(100 + i);
        })
        .await;
    }
    hold_and_settle(&*store, "req_b", &b, &node, |_| {}).await;

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

/// Rows of the records' own sums that the usage roll-up lacks, and rows of the roll-up the
/// records do not add up to (both 0 when `usage_daily` is exactly the records' sums).
const USAGE_MISMATCHES: [&str; 2] = [
    "SELECT COUNT(*) FROM (
        SELECT account_id, created_at_ms / 86400000 AS day, model, COALESCE(key_hash, '') AS key_hash,
               COUNT(*) AS requests, CAST(SUM(billed_prompt_tokens) AS BIGINT) AS prompt_tokens,
               CAST(SUM(billed_completion_tokens) AS BIGINT) AS completion_tokens,
               CAST(SUM(debit_micros) AS BIGINT) AS debit_micros
        FROM requests GROUP BY account_id, created_at_ms / 86400000, model, COALESCE(key_hash, '')
        EXCEPT
        SELECT account_id, day, model, key_hash, requests, prompt_tokens, completion_tokens, debit_micros
        FROM usage_daily) x",
    "SELECT COUNT(*) FROM (
        SELECT account_id, day, model, key_hash, requests, prompt_tokens, completion_tokens, debit_micros
        FROM usage_daily
        EXCEPT
        SELECT account_id, created_at_ms / 86400000 AS day, model, COALESCE(key_hash, '') AS key_hash,
               COUNT(*) AS requests, CAST(SUM(billed_prompt_tokens) AS BIGINT) AS prompt_tokens,
               CAST(SUM(billed_completion_tokens) AS BIGINT) AS completion_tokens,
               CAST(SUM(debit_micros) AS BIGINT) AS debit_micros
        FROM requests GROUP BY account_id, created_at_ms / 86400000, model, COALESCE(key_hash, '')) x",
];

/// As [`USAGE_MISMATCHES`] for `earnings_daily` (operator × day × model × node): requests served
/// to the end, completion tokens, credit paid (neither held nor forfeited).
const EARNINGS_MISMATCHES: [&str; 2] = [
    "SELECT COUNT(*) FROM (
        SELECT operator_id, created_at_ms / 86400000 AS day, model, node_id,
               CAST(SUM(CASE WHEN outcome = 'completed' THEN 1 ELSE 0 END) AS BIGINT) AS served,
               CAST(SUM(billed_completion_tokens) AS BIGINT) AS completion_tokens,
               CAST(SUM(CASE WHEN earnings IS NULL OR earnings = 'paid' THEN operator_credit_micros ELSE 0 END) AS BIGINT) AS earned
        FROM requests WHERE operator_id IS NOT NULL
        GROUP BY operator_id, created_at_ms / 86400000, model, node_id
        EXCEPT
        SELECT operator_id, day, model, node_id, requests_served, completion_tokens, earned_micros
        FROM earnings_daily) x",
    "SELECT COUNT(*) FROM (
        SELECT operator_id, day, model, node_id, requests_served, completion_tokens, earned_micros
        FROM earnings_daily
        EXCEPT
        SELECT operator_id, created_at_ms / 86400000 AS day, model, node_id,
               CAST(SUM(CASE WHEN outcome = 'completed' THEN 1 ELSE 0 END) AS BIGINT) AS served,
               CAST(SUM(billed_completion_tokens) AS BIGINT) AS completion_tokens,
               CAST(SUM(CASE WHEN earnings IS NULL OR earnings = 'paid' THEN operator_credit_micros ELSE 0 END) AS BIGINT) AS earned
        FROM requests WHERE operator_id IS NOT NULL
        GROUP BY operator_id, created_at_ms / 86400000, model, node_id) x",
];

/// Asserts that both roll-ups are exactly the records' sums, and that each node's totals on the
/// nodes page are its records' (served to the end; credit paid) for every node of `operators`.
async fn assert_rollups_are_the_records_sums(
    db: &TestDb,
    store: &dyn Store,
    c: &dyn ConsoleStore,
    operators: &[&OperatorId],
) {
    for sql in USAGE_MISMATCHES.iter().chain(&EARNINGS_MISMATCHES) {
        assert_eq!(db.scalar_i64(sql).await, 0, "{sql}");
    }
    for op in operators {
        let nodes = store.operator_nodes(op).await.unwrap();
        assert!(!nodes.is_empty());
        for n in &nodes {
            let id = n.node_id.as_str();
            let served = db
                .scalar_i64(&format!(
                    "SELECT COUNT(*) FROM requests WHERE node_id = '{id}' AND outcome = 'completed'"
                ))
                .await;
            let earned = db
                .scalar_i64(&format!(
                    "SELECT CAST(COALESCE(SUM(operator_credit_micros), 0) AS BIGINT) FROM requests
                     WHERE node_id = '{id}' AND (earnings IS NULL OR earnings = 'paid')"
                ))
                .await;
            assert_eq!(
                (n.requests_served, n.earned_micros),
                (served as u64, earned as u64),
                "{id}"
            );
        }
        // the earnings page sums the same rows over nodes: all of it is what the operator was
        // credited
        let days = c.operator_earnings(op, 0, i64::MAX, 500).await.unwrap();
        assert_eq!(
            days.iter().map(|d| d.earned_micros).sum::<u64>(),
            nodes.iter().map(|n| n.earned_micros).sum::<u64>()
        );
        assert_eq!(
            days.iter().map(|d| d.requests_served).sum::<u64>(),
            nodes.iter().map(|n| n.requests_served).sum::<u64>()
        );
        assert_eq!(
            nodes.iter().map(|n| n.earned_micros).sum::<u64>(),
            store.operator_earned_micros(op).await.unwrap()
        );
    }
}

/// After settlements of two accounts on three nodes of two operators (two models, a key or
/// none, every outcome, credit paid, held then paid, held then forfeited, one request without a
/// node) both roll-ups equal the records' sums, and the nodes page's per-node totals equal the
/// node's records.
async fn rollups_equal_the_records_sums_after_settlements(backend: Backend) {
    let (db, store, c) = console_setup(backend).await;
    let (a, n1, op) = setup_with(&*store, "").await;
    let n2 = store.register_node(&op, "ed25519:SECOND").await.unwrap();
    let (b, n3, op_b) = setup_with(&*store, "b").await;
    store.add_credits(&a, 1_000_000, "big-a").await.unwrap();
    store.add_credits(&b, 1_000_000, "big-b").await.unwrap();
    let outcomes = [
        StreamOutcome::Completed,
        StreamOutcome::ClientCancelled,
        StreamOutcome::Completed,
        StreamOutcome::UpstreamFailed,
        StreamOutcome::Rejected,
        StreamOutcome::CutAtBound,
    ];
    for i in 0..30_usize {
        let id = format!("r{i:02}");
        let acct = if i % 3 == 0 { &b } else { &a };
        let node = match i % 4 {
            0 => Some(n1.clone()),
            1 => Some(n2.clone()),
            2 => Some(n3.clone()),
            _ => None,
        };
        let model = if i % 2 == 0 { "m1" } else { "m2" };
        store
            .hold(
                RequestId::from(id.as_str()),
                acct.clone(),
                ModelId::from(model),
                1_000,
            )
            .await
            .unwrap();
        let mut s = settlement(&id, acct, node, outcomes[i % outcomes.len()]);
        s.model = ModelId::from(model);
        s.key = (i % 5 != 0).then(|| format!("k{}", i % 2));
        s.billed.completion_tokens = 10 + i as u64;
        s.earnings_held = i % 7 < 3;
        store.settle(s).await.unwrap();
    }
    assert_rollups_are_the_records_sums(&db, &*store, &*c, &[&op, &op_b]).await;
    // escrow: paid for one node × model, forfeited for another, still held elsewhere
    let paid = store
        .resolve_held_earnings(&n1, &ModelId::from("m1"), true)
        .await
        .unwrap();
    let lost = store
        .resolve_held_earnings(&n2, &ModelId::from("m2"), false)
        .await
        .unwrap();
    assert!(paid.micros > 0 && lost.micros > 0, "{paid:?} {lost:?}");
    assert!(
        db.scalar_i64("SELECT COUNT(*) FROM requests WHERE earnings = 'held'")
            .await
            > 0
    );
    assert_rollups_are_the_records_sums(&db, &*store, &*c, &[&op, &op_b]).await;
    let nodes = store.operator_nodes(&op).await.unwrap();
    assert_eq!(
        nodes.iter().map(|n| &n.node_id).collect::<Vec<_>>(),
        [&n1, &n2]
    );
    // n2 served none to the end (cancelled, cut, failed) but earned from the cancelled ones
    assert_eq!(nodes[1].requests_served, 0);
    assert!(nodes[0].requests_served > 0 && nodes.iter().all(|n| n.earned_micros > 0));
}

/// A database at schema version 7 with request records (written at version 6, before the
/// console's roll-ups, so version 7 filled them) migrates to version 8: the earnings roll-up is
/// per node, each node's totals are its records' (held and forfeited credit not earned), the
/// earnings page's days × models are unchanged, and escrow paid after the migration is added
/// to its node's row.
async fn version_7_with_records_migrates_to_per_node_earnings(backend: Backend) {
    let db = TestDb::new(backend).await;
    let migrations = db.migrations_sql();
    db.batch(match backend {
        Backend::Sqlite => "CREATE TABLE spine_schema_migrations (version INTEGER PRIMARY KEY, applied_at_ms INTEGER NOT NULL)",
        Backend::Postgres => "CREATE TABLE spine_schema_migrations (version BIGINT PRIMARY KEY, applied_at_ms BIGINT NOT NULL)",
    })
    .await;
    // versions `from..=to`, each recorded as the store records it
    let versions = |from: i64, to: i64| {
        let sql: String = migrations
            .iter()
            .filter(|(v, _)| (from..=to).contains(v))
            .map(|(v, sql)| {
                format!("{sql}\nINSERT INTO spine_schema_migrations (version, applied_at_ms) VALUES ({v}, 0);\n")
            })
            .collect();
        sql
    };
    db.batch(&versions(1, 6)).await;
    // day 20000 and 20001; op_1 has n_a and n_b, op_2 has n_c; r8 had no node
    let d1 = 20_000 * 86_400_000_i64 + 1_000;
    let d2 = d1 + 86_400_000;
    let records = [
        (
            "r1",
            "n_a",
            "op_1",
            "smollm2",
            "completed",
            d1,
            12,
            9,
            "NULL",
        ),
        (
            "r2",
            "n_a",
            "op_1",
            "smollm2",
            "completed",
            d2,
            13,
            9,
            "'paid'",
        ),
        (
            "r3",
            "n_a",
            "op_1",
            "other",
            "client_cancelled",
            d1,
            4,
            5,
            "NULL",
        ),
        (
            "r4",
            "n_b",
            "op_1",
            "smollm2",
            "completed",
            d1,
            20,
            7,
            "'held'",
        ),
        (
            "r5",
            "n_b",
            "op_1",
            "smollm2",
            "upstream_failed",
            d1,
            0,
            0,
            "NULL",
        ),
        (
            "r6",
            "n_b",
            "op_1",
            "other",
            "completed",
            d2,
            30,
            11,
            "'forfeited'",
        ),
        (
            "r7",
            "n_c",
            "op_2",
            "smollm2",
            "completed",
            d1,
            5,
            3,
            "NULL",
        ),
    ];
    let mut seed = String::from(
        "INSERT INTO accounts (id, created_at_ms) VALUES ('a', 0);
         INSERT INTO operators (id, earned_micros, created_at_ms) VALUES ('op_1', 23, 0), ('op_2', 3, 0);
         INSERT INTO nodes (node_id, operator_id, public_key_text, created_at_ms) VALUES
            ('n_a', 'op_1', 'ed25519:A', 1), ('n_b', 'op_1', 'ed25519:B', 2), ('n_c', 'op_2', 'ed25519:C', 3);
         INSERT INTO requests (request_id, account_id, model, outcome, node_id, operator_id,
            billed_prompt_tokens, billed_completion_tokens, usage_source, discrepancy,
            input_micros_per_mtok, output_micros_per_mtok, share_bps, cost_micros, debit_micros,
            operator_credit_micros, fee_micros, hold_micros, created_at_ms, earnings) VALUES
            ('r8', 'a', 'smollm2', 'completed', NULL, NULL, 1, 1, 'independent', FALSE, 0, 0, 0, 2, 2, 0, 2, 2, 1728000001000, NULL)",
    );
    for (id, node, op, model, outcome, at, completion, credit, earnings) in records {
        seed.push_str(&format!(
            ",\n            ('{id}', 'a', '{model}', '{outcome}', '{node}', '{op}', 10, {completion}, 'independent', FALSE, 0, 0, 7000, 20, 20, {credit}, 1, 20, {at}, {earnings})"
        ));
    }
    db.batch(&seed).await;
    db.batch(&versions(7, 7)).await;
    assert_eq!(
        db.scalar_i64("SELECT COUNT(*) FROM earnings_daily").await,
        5,
        "version 7's roll-up: op_1 × 2 days × 2 models, op_2 × 1"
    );

    let store = db.open().await;
    assert_eq!(
        db.scalar_i64("SELECT COUNT(*) FROM spine_schema_migrations")
            .await,
        db.migrations()
    );
    let c = store.clone().console();
    let totals = |nodes: Vec<NodeRecord>| {
        nodes
            .into_iter()
            .map(|n| (n.node_id.to_string(), n.requests_served, n.earned_micros))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        totals(
            store
                .operator_nodes(&OperatorId::from("op_1"))
                .await
                .unwrap()
        ),
        [("n_a".to_owned(), 2, 23), ("n_b".to_owned(), 2, 0)],
        "n_b: r4 held, r6 forfeited"
    );
    assert_eq!(
        totals(
            store
                .operator_nodes(&OperatorId::from("op_2"))
                .await
                .unwrap()
        ),
        [("n_c".to_owned(), 1, 3)]
    );
    let days = |rows: Vec<EarningsDay>| {
        rows.into_iter()
            .map(|d| {
                (
                    d.day,
                    d.model.to_string(),
                    d.requests_served,
                    d.completion_tokens,
                    d.earned_micros,
                )
            })
            .collect::<Vec<_>>()
    };
    let op_1 = OperatorId::from("op_1");
    assert_eq!(
        days(c.operator_earnings(&op_1, 0, i64::MAX, 100).await.unwrap()),
        [
            (20_001, "other".to_owned(), 1, 30, 0),
            (20_001, "smollm2".to_owned(), 1, 13, 9),
            (20_000, "other".to_owned(), 0, 4, 5),
            (20_000, "smollm2".to_owned(), 2, 32, 9),
        ]
    );
    assert_eq!(
        db.scalar_i64("SELECT COUNT(*) FROM earnings_daily").await,
        6,
        "per node: n_a × 3, n_b × 2, n_c × 1"
    );
    assert_rollups_are_the_records_sums(&db, &*store, &*c, &[&op_1]).await;
    // r4's escrow paid after the migration: n_b's row of day 20000
    let paid = store
        .resolve_held_earnings(&NodeId::from("n_b"), &ModelId::from("smollm2"), true)
        .await
        .unwrap();
    assert_eq!((paid.requests, paid.micros), (1, 7));
    assert_eq!(
        totals(store.operator_nodes(&op_1).await.unwrap()),
        [("n_a".to_owned(), 2, 23), ("n_b".to_owned(), 2, 7)]
    );
    assert_eq!(
        days(c.operator_earnings(&op_1, 0, i64::MAX, 100).await.unwrap())[3],
        (20_000, "smollm2".to_owned(), 2, 32, 16)
    );
    assert_rollups_are_the_records_sums(&db, &*store, &*c, &[&op_1]).await;
    // the model filter reads the new index
    let only_other = RequestFilter {
        model: Some("other".into()),
        ..RequestFilter::default()
    };
    let rows = c
        .account_requests(&AccountId::from("a"), &only_other, None, 50)
        .await
        .unwrap()
        .rows;
    assert_eq!(
        rows.iter()
            .map(|r| r.request_id.as_str())
            .collect::<Vec<_>>(),
        ["r6", "r3"]
    );
}

/// Pages of `account`'s request log with at most `max_scanned` records searched a page,
/// through the store's own statements: each page's request ids and whether it had a next.
async fn scanned_pages<B: crate::ledger::sql::Backend>(
    b: &B,
    account: &AccountId,
    filter: &RequestFilter,
    first: Option<PageCursor>,
    limit: u32,
    max_scanned: i64,
) -> Vec<(Vec<String>, bool)> {
    let mut pages = Vec::new();
    let mut cursor = first;
    loop {
        let page = crate::ledger::sql::console::account_requests_scanning(
            b,
            account,
            filter,
            cursor.as_ref(),
            limit,
            max_scanned,
        )
        .await
        .unwrap();
        assert!(pages.len() < 100, "paging ends");
        pages.push((
            page.rows.iter().map(|r| r.request_id.clone()).collect(),
            page.next.is_some(),
        ));
        match page.next {
            Some(next) => cursor = Some(PageCursor::decode(&next.encode()).unwrap()),
            None => return pages,
        }
    }
}

/// A key filter that matches few of an account's records searches at most `max_scanned`
/// records a page: pages with fewer rows (none, even) and a cursor at the last record searched,
/// then the older ones, every match exactly once, newest first, and no next page once no
/// record is left. A cursor of another account's record reads only the account's own.
async fn sparse_filters_search_a_bounded_number_of_records(backend: Backend) {
    let (db, store, _c) = console_setup(backend).await;
    let (a, node, _) = setup_with(&*store, "").await;
    let (b, _, _) = setup_with(&*store, "b").await;
    store.add_credits(&a, 1_000_000, "big").await.unwrap();
    // 12 records of `a`: key `k1` on req_01 and req_10, an upstream failure on req_05; `b`
    // has records with `k1` in between
    for i in 0..12 {
        let id = format!("req_{i:02}");
        hold_and_settle(&*store, &id, &a, &node, |s| {
            s.key = Some(if i == 1 || i == 10 { "k1" } else { "k2" }.to_owned());
            if i == 5 {
                s.outcome = StreamOutcome::UpstreamFailed;
            }
        })
        .await;
        if i % 4 == 0 {
            let id = format!("req_b{i:02}");
            hold_and_settle(&*store, &id, &b, &node, |s| s.key = Some("k1".to_owned())).await;
        }
    }
    let k1 = RequestFilter {
        key_hash: Some("k1".into()),
        ..RequestFilter::default()
    };
    let failed = RequestFilter {
        outcome: Some("upstream_failed".into()),
        ..RequestFilter::default()
    };
    let model_k1 = RequestFilter {
        model: Some("smollm2".into()),
        ..k1.clone()
    };
    let ids = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let check = |pages: Vec<(Vec<String>, bool)>, expected: Vec<(Vec<String>, bool)>| {
        assert_eq!(pages, expected);
    };
    macro_rules! run {
        ($ledger:expr) => {{
            let l = $ledger;
            // 4 records searched a page: req_11..08, 07..04, 03..00, then none left
            for filter in [&k1, &model_k1] {
                check(
                    scanned_pages(&l, &a, filter, None, 2, 4).await,
                    vec![
                        (ids(&["req_10"]), true),
                        (vec![], true),
                        (ids(&["req_01"]), true),
                        (vec![], false),
                    ],
                );
            }
            check(
                scanned_pages(&l, &a, &failed, None, 2, 4).await,
                vec![
                    (vec![], true),
                    (ids(&["req_05"]), true),
                    (vec![], true),
                    (vec![], false),
                ],
            );
            // a full page stops at its last row, as without a bound; the next searches the
            // 10 records left, fewer than the bound: the last page
            check(
                scanned_pages(&l, &a, &k1, None, 1, 12).await,
                vec![(ids(&["req_10"]), true), (ids(&["req_01"]), false)],
            );
            // more records searched than are left: one page, no next
            check(
                scanned_pages(&l, &a, &k1, None, 50, 13).await,
                vec![(ids(&["req_10", "req_01"]), false)],
            );
            // the bound is the default's: every match, no next
            let page = crate::ledger::sql::console::account_requests(&l, &a, &k1, None, 50)
                .await
                .unwrap();
            assert_eq!(page.rows.len(), 2);
            assert!(page.next.is_none());
            // a cursor at another account's record (`b`'s req_b08, settled between a's
            // req_08 and req_09): `a`'s own records below it only
            let b_rows = crate::ledger::sql::console::account_requests(
                &l,
                &b,
                &RequestFilter::default(),
                None,
                50,
            )
            .await
            .unwrap()
            .rows;
            let b08 = b_rows.iter().find(|r| r.request_id == "req_b08").unwrap();
            let foreign = PageCursor {
                at_ms: b08.created_at_ms,
                id: b08.request_id.clone(),
            };
            let pages = scanned_pages(&l, &a, &k1, Some(foreign.clone()), 2, 4).await;
            let rows: Vec<String> = pages.iter().flat_map(|p| p.0.clone()).collect();
            assert!(rows.contains(&"req_01".to_owned()), "{pages:?}");
            assert!(
                rows.iter().all(|r| r == "req_01" || r == "req_10"),
                "{pages:?}"
            );
            let pages = scanned_pages(&l, &b, &k1, Some(foreign), 2, 2).await;
            let rows: Vec<String> = pages.iter().flat_map(|p| p.0.clone()).collect();
            assert_eq!(rows, ids(&["req_b04", "req_b00"]), "{pages:?}");
        }};
    }
    match &db {
        TestDb::Sqlite { path, .. } => run!(SqliteLedger::open(path).await.unwrap()),
        TestDb::Postgres(pg) => run!(PgLedger::connect(&pg.url).await.unwrap()),
    }
}

/// The request log's statement for each filter the console offers reads the index that serves
/// it (SQLite's `EXPLAIN QUERY PLAN` on an empty ledger: the plan does not depend on row counts
/// there; PostgreSQL's plans at 1,000,000 records are in docs/benchmarks.md).
#[tokio::test]
async fn sqlite_request_log_filters_read_their_index() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteLedger::open(dir.path().join("ledger.db"))
        .await
        .unwrap();
    let account = AccountId::from("a");
    let cursor = PageCursor {
        at_ms: 5,
        id: "r".to_owned(),
    };
    let scan_end = PageCursor {
        at_ms: 2,
        id: "q".to_owned(),
    };
    // the page's statement (0: to the window's start, 1: to a scan's end) or the scan's end's
    let plan_of = |filter: RequestFilter, after: Option<PageCursor>, statement: u8| {
        let store = store.clone();
        let account = account.clone();
        let scan_end = scan_end.clone();
        async move {
            let (sql, args) = match statement {
                0 => crate::ledger::sql::console::account_requests_statement(
                    &account,
                    &filter,
                    after.as_ref(),
                    None,
                    50,
                ),
                1 => crate::ledger::sql::console::account_requests_statement(
                    &account,
                    &filter,
                    after.as_ref(),
                    Some(&scan_end),
                    50,
                ),
                _ => crate::ledger::sql::console::request_scan_end_statement(
                    &account,
                    &filter,
                    after.as_ref(),
                    10_000,
                ),
            };
            let explain = format!("EXPLAIN QUERY PLAN {sql}");
            let mut q = sqlx::query_as::<_, (i64, i64, i64, String)>(&explain);
            for arg in args {
                q = match arg {
                    crate::ledger::sql::Arg::I64(v) => q.bind(v),
                    crate::ledger::sql::Arg::Text(v) => q.bind(v.to_owned()),
                    other => panic!("unexpected {other:?}"),
                };
            }
            let rows = q.fetch_all(store.reader_pool()).await.unwrap();
            rows.into_iter().map(|r| r.3).collect::<Vec<_>>().join("; ")
        }
    };
    let plan = |filter: RequestFilter, after: Option<PageCursor>| plan_of(filter, after, 0);
    let model = RequestFilter {
        model: Some("m".into()),
        ..RequestFilter::default()
    };
    let p = plan(model.clone(), None).await;
    assert!(p.contains("requests_account_model_time"), "{p}");
    assert!(!p.contains("TEMP B-TREE"), "no sort: {p}");
    let p = plan(
        RequestFilter {
            key_hash: Some("k".into()),
            outcome: Some("completed".into()),
            ..model
        },
        Some(cursor.clone()),
    )
    .await;
    assert!(p.contains("requests_account_model_time"), "{p}");
    for filter in [
        RequestFilter::default(),
        RequestFilter {
            key_hash: Some("k".into()),
            ..RequestFilter::default()
        },
        RequestFilter {
            outcome: Some("upstream_failed".into()),
            since_ms: Some(0),
            until_ms: Some(86_400_000),
            ..RequestFilter::default()
        },
    ] {
        let p = plan(filter.clone(), Some(cursor.clone())).await;
        assert!(p.contains("requests_account_time"), "{p}");
        assert!(!p.contains("TEMP B-TREE"), "no sort: {p}");
        // a page bounded by the scan's end: one range, both ends row values
        let p = plan_of(filter.clone(), Some(cursor.clone()), 1).await;
        assert!(p.contains("requests_account_time"), "{p}");
        assert!(p.contains("(created_at_ms,request_id)>"), "{p}");
        assert!(p.contains("(created_at_ms,request_id)<"), "{p}");
        assert!(!p.contains("TEMP B-TREE"), "no sort: {p}");
        // the scan's end: the index alone
        let p = plan_of(filter, Some(cursor.clone()), 2).await;
        assert!(p.contains("COVERING INDEX requests_account_time"), "{p}");
        assert!(!p.contains("TEMP B-TREE"), "no sort: {p}");
    }
    let p = plan_of(
        RequestFilter {
            model: Some("m".into()),
            key_hash: Some("k".into()),
            ..RequestFilter::default()
        },
        None,
        2,
    )
    .await;
    assert!(
        p.contains("COVERING INDEX requests_account_model_time"),
        "{p}"
    );
    store.close().await;
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
        let r = hold_and_settle(&*store, &id, &a, &node, |s| {
            s.earnings_held = held;
            s.discrepancy = discrepancy;
        })
        .await;
        debits += r.debit_micros;
        if !held {
            paid += r.operator_credit_micros;
        }
    }
    // one request in flight of `b`
    place_hold(&*store, "p_live", &b, "smollm2", 77).await;
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
    rollups_equal_the_records_sums_after_settlements,
    version_7_with_records_migrates_to_per_node_earnings,
    platform_days_discrepancies_and_held_credit,
    sparse_filters_search_a_bounded_number_of_records,
);
