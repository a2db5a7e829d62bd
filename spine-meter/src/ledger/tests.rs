#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;
use crate::price::Price;

const PRICE: Price = Price {
    input_micros_per_mtok: 150_000,
    output_micros_per_mtok: 600_000,
};

async fn setup() -> (SqliteLedger, AccountId, NodeId, OperatorId) {
    let l = SqliteLedger::in_memory().await.unwrap();
    let acct = AccountId::from("acct_1");
    l.create_account(&acct).await.unwrap();
    assert!(l.add_credits(&acct, 1_000, "topup-1").await.unwrap());
    let op = OperatorId::from("op_1");
    l.create_operator(&op).await.unwrap();
    let node = l.register_node(&op, "ed25519:AAAA").await.unwrap();
    (l, acct, node, op)
}

fn settlement(
    req: &str,
    acct: &AccountId,
    node: Option<NodeId>,
    outcome: StreamOutcome,
) -> Settlement {
    Settlement {
        request_id: RequestId::from(req),
        account: acct.clone(),
        node,
        model: ModelId::from("smollm2"),
        outcome,
        billed: Usage {
            prompt_tokens: 34,
            completion_tokens: 12,
        },
        claimed: Some(Usage {
            prompt_tokens: 34,
            completion_tokens: 12,
        }),
        usage_source: UsageSource::Independent,
        discrepancy: false,
        price: PRICE,
        share_bps: 7_000,
    }
}

#[tokio::test]
async fn store_operations_for_the_gateway() {
    let (l, acct, node, op) = setup().await;
    assert_eq!(node, NodeId::from("node_1"));
    // same idempotency key twice: applied once
    assert!(!l.add_credits(&acct, 1_000, "topup-1").await.unwrap());
    assert!(l.add_credits(&acct, 500, "topup-2").await.unwrap());
    assert_eq!(
        l.account(&acct).await.unwrap(),
        AccountBalance {
            balance_micros: 1_500,
            held_micros: 0,
            available_micros: 1_500
        }
    );
    assert!(matches!(
        l.add_credits(&AccountId::from("nope"), 1, "k").await,
        Err(LedgerError::UnknownAccount(_))
    ));
    assert!(matches!(
        l.create_account(&acct).await,
        Err(LedgerError::Duplicate { what: "account" })
    ));
    l.create_api_key(&acct, "hash-1").await.unwrap();
    assert_eq!(
        l.account_for_key_hash("hash-1").await.unwrap(),
        Some(acct.clone())
    );
    assert_eq!(l.account_for_key_hash("hash-2").await.unwrap(), None);
    assert!(matches!(
        l.create_api_key(&acct, "hash-1").await,
        Err(LedgerError::Duplicate { what: "api key" })
    ));
    assert_eq!(
        l.node_for_public_key("ed25519:AAAA").await.unwrap(),
        Some(node.clone())
    );
    assert_eq!(l.node_operator(&node).await.unwrap(), op);
    assert!(matches!(
        l.register_node(&op, "ed25519:AAAA").await,
        Err(LedgerError::Duplicate {
            what: "node public key"
        })
    ));
    assert!(matches!(
        l.register_node(&OperatorId::from("x"), "k2").await,
        Err(LedgerError::UnknownOperator(_))
    ));
    assert_eq!(l.operator_earned_micros(&op).await.unwrap(), 0);
    assert_eq!(l.entries_sum_micros().await.unwrap(), 0);
}

#[tokio::test]
async fn hold_refuses_past_available_with_exact_numbers() {
    let (l, acct, _, _) = setup().await;
    l.hold(
        RequestId::from("r1"),
        acct.clone(),
        ModelId::from("smollm2"),
        700,
    )
    .await
    .unwrap();
    let err = l
        .hold(
            RequestId::from("r2"),
            acct.clone(),
            ModelId::from("smollm2"),
            301,
        )
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        LedgerError::InsufficientCredit {
            available_micros: 300,
            needed_micros: 301
        }
    ));
    assert!(matches!(
        l.hold(
            RequestId::from("r1"),
            acct.clone(),
            ModelId::from("smollm2"),
            1
        )
        .await,
        Err(LedgerError::Duplicate { what: "hold" })
    ));
    assert_eq!(l.account(&acct).await.unwrap().held_micros, 700);
    l.release(RequestId::from("r1")).await.unwrap();
    l.release(RequestId::from("r1")).await.unwrap();
    assert_eq!(l.account(&acct).await.unwrap().available_micros, 1_000);
}

#[tokio::test]
async fn settle_moves_exact_amounts_once() {
    let (l, acct, node, op) = setup().await;
    l.hold(
        RequestId::from("r1"),
        acct.clone(),
        ModelId::from("smollm2"),
        100,
    )
    .await
    .unwrap();
    let s = settlement("r1", &acct, Some(node.clone()), StreamOutcome::Completed);
    let first = l.settle(s.clone()).await.unwrap();
    // 34*0.15 + 12*0.6 = 12.3 -> 13; operator 70% floor = 9; fee 4
    assert_eq!(
        first,
        SettleResult {
            cost_micros: 13,
            debit_micros: 13,
            operator_credit_micros: 9,
            fee_micros: 4,
            hold_micros: 100,
            already_settled: false
        }
    );
    let again = l.settle(s).await.unwrap();
    assert!(again.already_settled);
    assert_eq!(again.debit_micros, 13);
    assert_eq!(
        l.account(&acct).await.unwrap(),
        AccountBalance {
            balance_micros: 987,
            held_micros: 0,
            available_micros: 987
        }
    );
    assert_eq!(l.operator_earned_micros(&op).await.unwrap(), 9);
    assert_eq!(l.entries_sum_micros().await.unwrap(), 0);
    let rec = l
        .request_record(RequestId::from("r1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.outcome, StreamOutcome::Completed);
    assert_eq!(rec.node, Some(node));
    assert_eq!(rec.operator, Some(op));
    assert_eq!(rec.billed.total_tokens(), 46);
    assert_eq!(
        (
            rec.cost_micros,
            rec.debit_micros,
            rec.operator_credit_micros,
            rec.fee_micros,
            rec.hold_micros
        ),
        (13, 13, 9, 4, 100)
    );
    assert!(rec.created_at_ms > 0);
    assert_eq!(l.request_record(RequestId::from("zz")).await.unwrap(), None);
}

#[tokio::test]
async fn failed_and_rejected_pay_nothing_and_debit_is_capped_by_the_hold() {
    let (l, acct, node, op) = setup().await;
    l.hold(
        RequestId::from("f"),
        acct.clone(),
        ModelId::from("smollm2"),
        100,
    )
    .await
    .unwrap();
    let r = l
        .settle(settlement(
            "f",
            &acct,
            Some(node.clone()),
            StreamOutcome::UpstreamFailed,
        ))
        .await
        .unwrap();
    assert_eq!((r.cost_micros, r.debit_micros, r.hold_micros), (0, 0, 100));
    l.settle(settlement("rej", &acct, None, StreamOutcome::Rejected))
        .await
        .unwrap();
    l.hold(
        RequestId::from("c"),
        acct.clone(),
        ModelId::from("smollm2"),
        5,
    )
    .await
    .unwrap();
    let r = l
        .settle(settlement("c", &acct, Some(node), StreamOutcome::Completed))
        .await
        .unwrap();
    assert_eq!(
        (
            r.cost_micros,
            r.debit_micros,
            r.operator_credit_micros,
            r.fee_micros
        ),
        (13, 5, 3, 2)
    );
    assert_eq!(l.account(&acct).await.unwrap().balance_micros, 995);
    assert_eq!(l.operator_earned_micros(&op).await.unwrap(), 3);
    assert_eq!(l.entries_sum_micros().await.unwrap(), 0);
    let rec = l
        .request_record(RequestId::from("rej"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (rec.outcome, rec.node, rec.debit_micros),
        (StreamOutcome::Rejected, None, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_holds_on_a_file_never_overdraw() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let l = SqliteLedger::open(&path).await.unwrap();
    // migrations are idempotent: open the same file again
    let l2 = SqliteLedger::open(&path).await.unwrap();
    let acct = AccountId::from("a");
    l.create_account(&acct).await.unwrap();
    l.add_credits(&acct, 1_000, "k").await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..24 {
        let l = if i % 2 == 0 { l.clone() } else { l2.clone() };
        let acct = acct.clone();
        tasks.push(tokio::spawn(async move {
            l.hold(
                RequestId::new(format!("r{i}")),
                acct,
                ModelId::from("smollm2"),
                100,
            )
            .await
        }));
    }
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(()) => ok += 1,
            Err(LedgerError::InsufficientCredit { .. }) => {}
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(ok, 10);
    let b = l.account(&acct).await.unwrap();
    assert_eq!(
        (b.balance_micros, b.held_micros, b.available_micros),
        (1_000, 1_000, 0)
    );
}

#[derive(Debug, Clone)]
enum Op {
    Hold(u8, u64),
    Settle(u8, u16, u16, bool),
    Release(u8),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        (0u8..12, 0u64..400).prop_map(|(r, a)| Op::Hold(r, a)),
        (0u8..12, 0u16..3000, 0u16..3000, any::<bool>())
            .prop_map(|(r, p, c, ok)| Op::Settle(r, p, c, ok)),
        (0u8..12).prop_map(Op::Release),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config { cases: 32, ..Default::default() })]
    #[test]
    fn random_holds_settles_releases_keep_the_books(ops in proptest::collection::vec(op(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let (l, acct, node, op) = setup().await;
            for o in ops {
                match o {
                    Op::Hold(r, a) => { let _ = l.hold(RequestId::new(format!("r{r}")), acct.clone(), ModelId::from("smollm2"), a).await; }
                    Op::Release(r) => l.release(RequestId::new(format!("r{r}"))).await.unwrap(),
                    Op::Settle(r, p, c, ok) => {
                        let mut s = settlement(&format!("r{r}"), &acct, Some(node.clone()), if ok { StreamOutcome::Completed } else { StreamOutcome::ClientCancelled });
                        s.billed = Usage { prompt_tokens: u64::from(p) * 1000, completion_tokens: u64::from(c) * 1000 };
                        l.settle(s).await.unwrap();
                    }
                }
                let b = l.account(&acct).await.unwrap();
                assert!(b.held_micros <= b.balance_micros);
                assert_eq!(l.entries_sum_micros().await.unwrap(), 0);
            }
            let b = l.account(&acct).await.unwrap();
            let earned = l.operator_earned_micros(&op).await.unwrap();
            let fees: i64 = sqlx::query_scalar("SELECT COALESCE(SUM(amount_micros),0) FROM ledger_entries WHERE party_kind = 'platform'").fetch_one(l.pool()).await.unwrap();
            assert_eq!(1_000 - b.balance_micros, earned + u64::try_from(fees).unwrap());
        });
    }
}

#[tokio::test]
async fn credit_key_reused_for_another_account_or_amount_is_a_conflict() {
    let (l, acct, _, _) = setup().await;
    let other = AccountId::from("acct_2");
    l.create_account(&other).await.unwrap();
    // same account, same amount: a retry, nothing changes
    assert!(!l.add_credits(&acct, 1_000, "topup-1").await.unwrap());
    // different amount
    match l.add_credits(&acct, 999, "topup-1").await {
        Err(LedgerError::IdempotencyConflict { idempotency_key }) => {
            assert_eq!(idempotency_key, "topup-1");
        }
        other => panic!("{other:?}"),
    }
    // different account, same amount
    assert!(matches!(
        l.add_credits(&other, 1_000, "topup-1").await,
        Err(LedgerError::IdempotencyConflict { .. })
    ));
    // unknown account with a used key: the key's conflict is reported
    assert!(matches!(
        l.add_credits(&AccountId::from("nope"), 1_000, "topup-1")
            .await,
        Err(LedgerError::IdempotencyConflict { .. })
    ));
    assert_eq!(
        LedgerError::IdempotencyConflict {
            idempotency_key: "k".into()
        }
        .to_string(),
        "idempotency key \"k\" was already used for a different credit"
    );
    assert_eq!(l.account(&acct).await.unwrap().balance_micros, 1_000);
    assert_eq!(l.account(&other).await.unwrap().balance_micros, 0);
    assert_eq!(l.entries_sum_micros().await.unwrap(), 0);
    let credits: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM credits")
        .fetch_one(l.pool())
        .await
        .unwrap();
    assert_eq!(credits, 1);
}

#[tokio::test]
async fn stale_holds_after_a_crash_settle_upstream_failed_at_no_cost() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let (acct, node, op) = {
        let l = SqliteLedger::open(&path).await.unwrap();
        let acct = AccountId::from("a");
        l.create_account(&acct).await.unwrap();
        l.add_credits(&acct, 1_000, "k").await.unwrap();
        let op = OperatorId::from("op");
        l.create_operator(&op).await.unwrap();
        let node = l.register_node(&op, "pk").await.unwrap();
        l.hold(
            RequestId::from("s1"),
            acct.clone(),
            ModelId::from("m1"),
            300,
        )
        .await
        .unwrap();
        l.hold(
            RequestId::from("s2"),
            acct.clone(),
            ModelId::from("m2"),
            200,
        )
        .await
        .unwrap();
        // a settled and a released request are not stale
        l.hold(
            RequestId::from("done"),
            acct.clone(),
            ModelId::from("m1"),
            100,
        )
        .await
        .unwrap();
        let mut s = settlement("done", &acct, Some(node.clone()), StreamOutcome::Completed);
        s.model = ModelId::from("m1");
        l.settle(s).await.unwrap();
        l.hold(
            RequestId::from("gone"),
            acct.clone(),
            ModelId::from("m1"),
            50,
        )
        .await
        .unwrap();
        l.release(RequestId::from("gone")).await.unwrap();
        l.pool().close().await;
        (acct, node, op)
    };
    // the gateway restarts
    let l = SqliteLedger::open(&path).await.unwrap();
    assert_eq!(
        l.account(&acct).await.unwrap(),
        AccountBalance {
            balance_micros: 987,
            held_micros: 500,
            available_micros: 487
        }
    );
    assert_eq!(l.settle_stale_holds().await.unwrap(), 2);
    assert_eq!(l.settle_stale_holds().await.unwrap(), 0);
    assert_eq!(
        l.account(&acct).await.unwrap(),
        AccountBalance {
            balance_micros: 987,
            held_micros: 0,
            available_micros: 987
        }
    );
    assert_eq!(l.operator_earned_micros(&op).await.unwrap(), 9);
    assert_eq!(l.entries_sum_micros().await.unwrap(), 0);
    for (id, model, hold) in [("s1", "m1", 300), ("s2", "m2", 200)] {
        let rec = l
            .request_record(RequestId::from(id))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (
                rec.account.clone(),
                rec.model.clone(),
                rec.outcome,
                rec.node.clone(),
                rec.operator.clone(),
                rec.billed,
                rec.claimed
            ),
            (
                acct.clone(),
                ModelId::from(model),
                StreamOutcome::UpstreamFailed,
                None,
                None,
                Usage::default(),
                None
            )
        );
        assert_eq!(
            (
                rec.cost_micros,
                rec.debit_micros,
                rec.operator_credit_micros,
                rec.fee_micros,
                rec.hold_micros
            ),
            (0, 0, 0, 0, hold)
        );
    }
    // the completed request's record is untouched
    let done = l
        .request_record(RequestId::from("done"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (done.outcome, done.node, done.debit_micros),
        (StreamOutcome::Completed, Some(node), 13)
    );
    assert_eq!(
        l.request_record(RequestId::from("gone")).await.unwrap(),
        None
    );
}

#[tokio::test]
async fn migration_2_upgrades_a_version_1_file_and_old_holds_settle_as_unknown_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    {
        // a file as version 1 left it: no `holds.model`, one hold active
        let l = SqliteLedger::open(&path).await.unwrap();
        let acct = AccountId::from("a");
        l.create_account(&acct).await.unwrap();
        l.add_credits(&acct, 1_000, "k").await.unwrap();
        l.hold(RequestId::from("old"), acct, ModelId::from("m"), 400)
            .await
            .unwrap();
        sqlx::raw_sql(
            "ALTER TABLE holds DROP COLUMN model; DELETE FROM spine_schema_migrations WHERE version = 2;",
        )
        .execute(l.pool())
        .await
        .unwrap();
        l.pool().close().await;
    }
    let l = SqliteLedger::open(&path).await.unwrap();
    let versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM spine_schema_migrations ORDER BY version")
            .fetch_all(l.pool())
            .await
            .unwrap();
    assert_eq!(versions, vec![1, 2]);
    assert_eq!(l.settle_stale_holds().await.unwrap(), 1);
    let rec = l
        .request_record(RequestId::from("old"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (rec.model, rec.outcome, rec.debit_micros, rec.hold_micros),
        (
            ModelId::from("unknown"),
            StreamOutcome::UpstreamFailed,
            0,
            400
        )
    );
    let b = l.account(&AccountId::from("a")).await.unwrap();
    assert_eq!((b.balance_micros, b.held_micros), (1_000, 0));
}
