//! Several gateway instances on one PostgreSQL database (design brief §8, issue 6 part C):
//! holds owned by the instance that placed them, stale-hold sweeps that never touch a live
//! instance's request, and PostgreSQL going away under the metering layer (holds refused quickly
//! as "unavailable", a settlement made during the cut committed after it, books exact).
//!
//! Real PostgreSQL at `SPINE_TEST_PG_URL` (default `postgres://postgres@127.0.0.1:5432`); each
//! test creates its own database and drops it at the end. PostgreSQL itself is never stopped: a
//! TCP proxy in front of it is cut and restored instead. The metering test needs the SmolLM2
//! model file (`SPINE_MODEL_GGUF`, default `~/.cache/spine/models/SmolLM2-135M-Instruct.Q4_1.gguf`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use sqlx::postgres::PgConnectOptions;
use sqlx::Connection as _;
use tower::ServiceExt;

use spine_core::{AccountId, BoxBody, BoxError, ModelId, NodeId, OperatorId, RequestId};
use spine_meter::meter::{CatalogEntry, MeterError, MeterLayer};
use spine_meter::{Ledger, ModelTokenizer, PgLedger, PgPoolConfig, Price, Settlement, Store};

const PRICE: Price = Price {
    input_micros_per_mtok: 150_000_000,
    output_micros_per_mtok: 600_000_000,
};

use spine_test_support::pg_server_url;

/// A fresh database for one test, dropped (`WITH (FORCE)`) on drop.
struct FreshDb {
    db: spine_test_support::PgDb,
}

impl FreshDb {
    async fn new() -> Self {
        Self {
            db: spine_test_support::PgDb::create(),
        }
    }

    /// Options for this database, at `host:port` (the server, or a proxy in front of it).
    fn options(&self, at: Option<SocketAddr>) -> PgConnectOptions {
        let mut o = PgConnectOptions::from_str(&pg_server_url())
            .unwrap()
            .database(&self.db.name);
        if let Some(addr) = at {
            o = o.host(&addr.ip().to_string()).port(addr.port());
        }
        o
    }

    fn server_addr() -> SocketAddr {
        let o = PgConnectOptions::from_str(&pg_server_url()).unwrap();
        let host = match o.get_host() {
            "localhost" => "127.0.0.1",
            h => h,
        };
        format!("{host}:{}", o.get_port()).parse().unwrap()
    }

    async fn ledger(&self, instance: Option<&str>) -> PgLedger {
        let l = PgLedger::connect_with(self.options(None)).await.unwrap();
        match instance {
            Some(id) => l.with_instance_id(id),
            None => l,
        }
    }
}

use spine_test_support::CutProxy;

/// Locks `acct`'s row from a connection of its own (`SELECT … FOR UPDATE` in a transaction left
/// open) until [`unlock`] or the connection's drop.
async fn lock_account_row(db: &FreshDb, acct: &AccountId) -> sqlx::PgConnection {
    let mut locker = sqlx::PgConnection::connect_with(&db.options(None))
        .await
        .unwrap();
    sqlx::query("BEGIN").execute(&mut locker).await.unwrap();
    sqlx::query("SELECT balance_micros FROM accounts WHERE id = $1 FOR UPDATE")
        .bind(acct.as_str())
        .execute(&mut locker)
        .await
        .unwrap();
    locker
}

/// Ends [`lock_account_row`]'s transaction.
async fn unlock(locker: &mut sqlx::PgConnection) {
    sqlx::query("ROLLBACK").execute(locker).await.unwrap();
}

async fn funded_account(store: &dyn Store, micros: u64) -> AccountId {
    let acct = AccountId::from("acct");
    store.create_account(&acct).await.unwrap();
    assert!(store.add_credits(&acct, micros, "seed").await.unwrap());
    acct
}

fn failed_settlement(id: &RequestId, acct: &AccountId) -> Settlement {
    Settlement {
        request_id: id.clone(),
        account: acct.clone(),
        node: None,
        model: ModelId::from("m"),
        outcome: spine_core::StreamOutcome::Completed,
        billed: spine_core::Usage {
            prompt_tokens: 10,
            completion_tokens: 5,
        },
        claimed: None,
        usage_source: spine_core::UsageSource::Independent,
        discrepancy: false,
        price: PRICE,
        share_bps: 7_000,
        earnings_held: false,
        key: None,
        ttft_ms: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_instances_holds_survive_peers_and_are_settled_once_after_it_stops_heartbeating() {
    let db = FreshDb::new().await;
    let stale_after = Duration::from_secs(2);
    let a = db.ledger(Some("gw-a")).await;
    a.heartbeat().await.unwrap();
    let acct = funded_account(&a, 1_000_000).await;
    let model = ModelId::from("m");
    let (a1, a2) = (RequestId::from("req-a1"), RequestId::from("req-a2"));
    a.hold(a1.clone(), acct.clone(), model.clone(), 1_000)
        .await
        .unwrap();
    a.hold(a2.clone(), acct.clone(), model.clone(), 2_000)
        .await
        .unwrap();

    // B starts (its own leftovers: none) and sweeps while A is alive: A's holds are untouched
    let b = db.ledger(Some("gw-b")).await;
    b.heartbeat().await.unwrap();
    assert_eq!(b.settle_stale_holds().await.unwrap(), 0);
    assert_eq!(b.settle_orphaned_holds(stale_after).await.unwrap(), 0);
    assert_eq!(a.account(&acct).await.unwrap().held_micros, 3_000);
    let b1 = RequestId::from("req-b1");
    b.hold(b1.clone(), acct.clone(), model.clone(), 400)
        .await
        .unwrap();
    // a hold from before instance ids (no instance) is nobody's: the sweep settles it
    let legacy = db.ledger(None).await;
    let l1 = RequestId::from("req-legacy");
    legacy
        .hold(l1.clone(), acct.clone(), model.clone(), 50)
        .await
        .unwrap();

    // A stops heartbeating; B and C keep theirs; past the bound both sweep at once
    let c = db.ledger(Some("gw-c")).await;
    tokio::time::sleep(stale_after + Duration::from_millis(500)).await;
    b.heartbeat().await.unwrap();
    c.heartbeat().await.unwrap();
    let (nb, nc) = tokio::join!(
        b.settle_orphaned_holds(stale_after),
        c.settle_orphaned_holds(stale_after)
    );
    let (nb, nc) = (nb.unwrap(), nc.unwrap());
    eprintln!("orphaned holds settled: by B {nb}, by C {nc}");
    assert_eq!(
        nb + nc,
        3,
        "A's two holds and the legacy one, each exactly once"
    );
    // B's own in-flight hold is still there
    assert_eq!(a.account(&acct).await.unwrap().held_micros, 400);
    for id in [&a1, &a2, &l1] {
        let rec = b.request_record(id.clone()).await.unwrap().unwrap();
        assert_eq!(
            rec.outcome,
            spine_core::StreamOutcome::UpstreamFailed,
            "{id}"
        );
        assert_eq!(rec.debit_micros, 0);
        assert_eq!(rec.swept, Some(spine_meter::SweepKind::Orphan), "{id}");
    }
    assert_eq!(b.settle_orphaned_holds(stale_after).await.unwrap(), 0);

    // A comes back late and settles a1 as completed: already settled, nothing moves
    let late = a.settle(failed_settlement(&a1, &acct)).await.unwrap();
    assert!(late.already_settled);
    assert_eq!(late.debit_micros, 0);

    // B restarts under its id: its own leftover (b1) is settled at start, nobody else's
    let d = db.ledger(Some("gw-d")).await;
    d.heartbeat().await.unwrap();
    let d1 = RequestId::from("req-d1");
    d.hold(d1.clone(), acct.clone(), model.clone(), 7)
        .await
        .unwrap();
    let b_again = db.ledger(Some("gw-b")).await;
    assert_eq!(b_again.settle_stale_holds().await.unwrap(), 1);
    assert!(b_again.request_record(b1).await.unwrap().is_some());
    assert!(b_again.request_record(d1).await.unwrap().is_none());
    let balance = a.account(&acct).await.unwrap();
    assert_eq!(balance.held_micros, 7);
    assert_eq!(balance.balance_micros, 1_000_000);
    assert_eq!(a.entries_sum_micros().await.unwrap(), 0);
}

fn model_gguf() -> PathBuf {
    let path = std::env::var_os("SPINE_MODEL_GGUF").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/spine/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        PathBuf::from,
    );
    assert!(path.is_file(), "model file {} is missing", path.display());
    path
}

fn chat(id: &str, acct: &AccountId) -> http::Request<BoxBody> {
    let body = serde_json::json!({
        "model": "smol",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
    });
    let mut req = http::Request::post("/v1/chat/completions")
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(BoxBody::new(
            Full::new(Bytes::from(serde_json::to_vec(&body).unwrap()))
                .map_err(|never| match never {}),
        ))
        .unwrap();
    req.extensions_mut().insert(RequestId::from(id));
    req.extensions_mut().insert(acct.clone());
    req
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cut_refuses_holds_quickly_and_a_settlement_made_during_it_commits_after() {
    let db = FreshDb::new().await;
    let direct = db.ledger(None).await;
    let acct = funded_account(&direct, 10_000_000).await;
    let op = OperatorId::from("op");
    direct.create_operator(&op).await.unwrap();
    let node = direct.register_node(&op, "ed25519:scaleout").await.unwrap();

    let proxy = CutProxy::start(FreshDb::server_addr()).await.unwrap();
    // the acquire timeout stays at its default (30 s, for queueing on a busy pool): with
    // PostgreSQL unreachable the wait is bounded by the unavailable timeout instead
    let unavailable_timeout = Duration::from_secs(1);
    let config = PgPoolConfig::default().unavailable_timeout(unavailable_timeout);
    assert!(config.acquire_timeout >= Duration::from_secs(30));
    let ledger = Arc::new(
        PgLedger::connect_with_config(db.options(Some(proxy.addr())), config)
            .await
            .unwrap()
            .with_instance_id("gw-cut"),
    );
    let tokenizer = Arc::new(ModelTokenizer::from_gguf(model_gguf()).unwrap());
    let mut catalog = spine_meter::meter::Catalog::new();
    catalog.insert(
        ModelId::from("smol"),
        CatalogEntry {
            tokenizer,
            price: PRICE,
            max_context_tokens: 2048,
        },
    );
    let layer = MeterLayer::new(ledger.clone(), catalog);
    let settlements = layer.settlements();

    // the node answers only when the test says so
    let (entered_tx, entered_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let svc = tower::ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn({
            let gate = gate.clone();
            let node = node.clone();
            move |_req: http::Request<BoxBody>| {
                let gate = gate.clone();
                let node = node.clone();
                let entered = entered_tx.clone();
                async move {
                    let _ = entered.send(());
                    gate.acquire().await.unwrap().forget();
                    let body = serde_json::json!({
                        "id": "cmpl-1", "object": "chat.completion", "model": "smol",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "Hello there!"}}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    });
                    let mut resp = http::Response::new(BoxBody::new(
                        Full::new(Bytes::from(serde_json::to_vec(&body).unwrap()))
                            .map_err(|never| match never {}),
                    ));
                    resp.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/json"),
                    );
                    resp.extensions_mut().insert::<NodeId>(node);
                    Ok::<_, BoxError>(resp)
                }
            }
        }));

    // r1 is held and at the node when PostgreSQL goes away
    let mut entered_rx = entered_rx;
    let in_flight = tokio::spawn(svc.clone().oneshot(chat("req-inflight", &acct)));
    tokio::time::timeout(Duration::from_secs(10), entered_rx.recv())
        .await
        .unwrap()
        .unwrap();
    let held = direct.account(&acct).await.unwrap().held_micros;
    assert!(held > 0);
    proxy.cut().await;

    // a new paid request: its hold cannot be placed; refused, unavailable, within the bound
    let started = Instant::now();
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        svc.clone().oneshot(chat("req-during-cut", &acct)),
    )
    .await
    .expect("a hold with PostgreSQL cut must not hang");
    let elapsed = started.elapsed();
    let err = match refused {
        Ok(resp) => panic!("answered {} with PostgreSQL cut", resp.status()),
        Err(e) => e,
    };
    let meter_err = err.downcast_ref::<MeterError>().expect("a meter error");
    match meter_err {
        MeterError::Ledger(e) => assert!(e.is_unavailable(), "{e:?}"),
        other => panic!("expected a ledger error, got {other:?}"),
    }
    eprintln!(
        "hold with PostgreSQL cut refused after {} ms (unavailable timeout {} ms)",
        elapsed.as_millis(),
        unavailable_timeout.as_millis()
    );
    // far below the 30 s a busy pool may queue for; generous for a loaded machine
    assert!(
        elapsed < unavailable_timeout + Duration::from_secs(5),
        "{elapsed:?}"
    );
    // the next hold is refused within the bound as well (the pool is not full here, so this
    // holds through the pool-size rule alone; the health latch is not isolated by this test)
    let started = Instant::now();
    let again = ledger
        .hold(
            RequestId::from("req-during-cut-2"),
            acct.clone(),
            ModelId::from("smol"),
            1_000,
        )
        .await;
    let elapsed = started.elapsed();
    eprintln!(
        "second hold with PostgreSQL cut refused after {} ms",
        elapsed.as_millis()
    );
    assert!(again.is_err_and(|e| e.is_unavailable()));
    assert!(
        elapsed < unavailable_timeout + Duration::from_secs(5),
        "{elapsed:?}"
    );

    // the in-flight request completes during the cut: the caller gets the answer, the
    // settlement is pending, named, and retried
    gate.add_permits(1);
    let resp = tokio::time::timeout(Duration::from_secs(10), in_flight)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), http::StatusCode::OK);
    let _ = resp.into_body().collect().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        settlements.pending_request_ids(),
        vec![RequestId::from("req-inflight")]
    );
    assert!(direct
        .request_record(RequestId::from("req-inflight"))
        .await
        .unwrap()
        .is_none());

    // PostgreSQL back: the settlement commits (exactly once), the books are exact
    proxy.restore().unwrap();
    let restored = Instant::now();
    tokio::time::timeout(Duration::from_secs(30), settlements.drain())
        .await
        .expect("the settlement commits after PostgreSQL returns");
    eprintln!(
        "settlement committed {} ms after PostgreSQL returned",
        restored.elapsed().as_millis()
    );
    assert!(settlements.pending_request_ids().is_empty());
    // and holds are placed again
    let after = RequestId::from("req-after-cut");
    ledger
        .hold(after.clone(), acct.clone(), ModelId::from("smol"), 1_000)
        .await
        .unwrap();
    ledger.release(after).await.unwrap();
    let rec = direct
        .request_record(RequestId::from("req-inflight"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.outcome, spine_core::StreamOutcome::Completed);
    assert_eq!(rec.node, Some(node));
    assert!(rec.debit_micros > 0);
    assert_eq!(
        rec.debit_micros,
        rec.operator_credit_micros + rec.fee_micros
    );
    assert!(direct
        .request_record(RequestId::from("req-during-cut"))
        .await
        .unwrap()
        .is_none());
    let balance = direct.account(&acct).await.unwrap();
    assert_eq!(balance.held_micros, 0);
    assert_eq!(balance.balance_micros, 10_000_000 - rec.debit_micros);
    let totals = direct.entry_totals().await.unwrap();
    // Σ debits = Σ credits + fees: accounts gave exactly what operators and the platform got
    assert_eq!(
        -(totals.accounts_micros + totals.external_micros),
        totals.operators_micros + totals.platform_micros
    );
    assert_eq!(totals.operators_micros, rec.operator_credit_micros as i64);
    assert_eq!(totals.platform_micros, rec.fee_micros as i64);
    assert_eq!(totals.sum_micros(), 0);
    assert_eq!(
        direct.operator_earned_micros(&op).await.unwrap(),
        rec.operator_credit_micros
    );
}

/// A hold placed by a gateway of the release before instance ids (no instance id) during a
/// rolling upgrade is in flight on that gateway: an upgraded instance's sweep leaves it alone
/// until it is older than `stale_after`, so the old gateway's `completed` settlement charges it.
/// Only a legacy hold older than the bound (its gateway is gone) is swept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_legacy_hold_is_left_to_its_gateway_and_only_an_old_one_is_swept() {
    let db = FreshDb::new().await;
    let stale_after = Duration::from_secs(1);
    let new = db.ledger(Some("gw-new")).await;
    new.heartbeat().await.unwrap();
    let acct = funded_account(&new, 1_000_000).await;
    let old = db.ledger(None).await; // the previous release: no instance id
    let inflight = RequestId::from("req-old-inflight");
    old.hold(inflight.clone(), acct.clone(), ModelId::from("m"), 5_000)
        .await
        .unwrap();
    // milliseconds old: not swept, even with the production bound or a 1 s one
    assert_eq!(
        new.settle_orphaned_holds(Duration::from_secs(60))
            .await
            .unwrap(),
        0
    );
    assert_eq!(new.settle_orphaned_holds(stale_after).await.unwrap(), 0);
    let done = old
        .settle(failed_settlement(&inflight, &acct))
        .await
        .unwrap();
    eprintln!(
        "fresh legacy hold: completed settlement already_settled {} debit {}",
        done.already_settled, done.debit_micros
    );
    assert!(!done.already_settled);
    assert!(done.debit_micros > 0, "the completed request was free");

    // a legacy hold whose gateway went away: swept once it is older than the bound
    let abandoned = RequestId::from("req-old-abandoned");
    old.hold(abandoned.clone(), acct.clone(), ModelId::from("m"), 700)
        .await
        .unwrap();
    assert_eq!(new.settle_orphaned_holds(stale_after).await.unwrap(), 0);
    tokio::time::sleep(stale_after + Duration::from_millis(300)).await;
    assert_eq!(new.settle_orphaned_holds(stale_after).await.unwrap(), 1);
    let rec = new.request_record(abandoned).await.unwrap().unwrap();
    assert_eq!(rec.outcome, spine_core::StreamOutcome::UpstreamFailed);
    let balance = new.account(&acct).await.unwrap();
    assert_eq!(balance.held_micros, 0);
    assert_eq!(balance.balance_micros, 1_000_000 - done.debit_micros);
    assert_eq!(new.entries_sum_micros().await.unwrap(), 0);
}

/// Two processes configured with one `instance_id`: the second refuses to start (its claim
/// fails after waiting out the liveness bound) and so never settles the first one's holds in
/// flight. Once the first stops heartbeating, a restart under the id takes it over and settles
/// the leftovers; the old process's heartbeat is then refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_with_a_live_instance_id_is_refused_and_settles_nothing() {
    let db = FreshDb::new().await;
    let live_within = Duration::from_secs(1);
    let a = Arc::new(db.ledger(Some("gw-same")).await);
    a.claim_instance(live_within).await.unwrap();
    let acct = funded_account(&*a, 1_000_000).await;
    let (r1, r2) = (RequestId::from("req-a1"), RequestId::from("req-a2"));
    for r in [&r1, &r2] {
        a.hold(r.clone(), acct.clone(), ModelId::from("m"), 5_000)
            .await
            .unwrap();
    }
    let mut upkeep = spine_meter::InstanceUpkeep::default();
    upkeep.heartbeat_interval = Duration::from_millis(200);
    upkeep.sweep_interval = Duration::from_secs(3600);
    upkeep.live_within = live_within;
    let stop_a = tokio_util::sync::CancellationToken::new();
    let a_upkeep = a.clone().spawn_instance_upkeep(upkeep, stop_a.clone());

    let b = db.ledger(Some("gw-same")).await;
    let started = Instant::now();
    let refused = b.claim_instance(live_within).await;
    let waited = started.elapsed();
    eprintln!("second process under a live id: {refused:?} after {waited:?}");
    match &refused {
        Err(e @ spine_meter::LedgerError::InstanceIdLive { instance_id, .. }) => {
            assert_eq!(instance_id, "gw-same");
            assert!(e.to_string().contains("ids must be unique"), "{e}");
        }
        other => panic!("the second process took a live id: {other:?}"),
    }
    assert!(
        waited >= live_within,
        "gave up before the bound: {waited:?}"
    );
    assert!(waited < Duration::from_secs(10), "{waited:?}");
    // nothing of A's was touched; A settles its request as completed and is charged
    assert_eq!(a.account(&acct).await.unwrap().held_micros, 10_000);
    let done = a.settle(failed_settlement(&r1, &acct)).await.unwrap();
    assert!(!done.already_settled);
    assert!(done.debit_micros > 0);

    // A stops (crash): a restart under the id waits out the bound, takes the id over and
    // settles A's leftover r2
    stop_a.cancel();
    a_upkeep.await.unwrap();
    let restarted = db.ledger(Some("gw-same")).await;
    let started = Instant::now();
    restarted.claim_instance(live_within).await.unwrap();
    eprintln!(
        "restart under the id claimed it after {:?}",
        started.elapsed()
    );
    assert_eq!(restarted.settle_stale_holds().await.unwrap(), 1);
    let rec = restarted.request_record(r2).await.unwrap().unwrap();
    assert_eq!(rec.outcome, spine_core::StreamOutcome::UpstreamFailed);
    assert_eq!(rec.swept, Some(spine_meter::SweepKind::Restart));
    // the old process, were it still alive, can no longer heartbeat under the id
    assert!(matches!(
        a.heartbeat_within(live_within).await,
        Err(spine_meter::LedgerError::InstanceIdLive { .. })
    ));
    let balance = restarted.account(&acct).await.unwrap();
    assert_eq!(balance.held_micros, 0);
    assert_eq!(balance.balance_micros, 1_000_000 - done.debit_micros);
    assert_eq!(restarted.entries_sum_micros().await.unwrap(), 0);
}

/// A burst of holds on one account while its row is locked for longer than the old 2 s acquire
/// timeout (another transaction, `FOR UPDATE`): the holds queue for the pool's 2 connections and
/// for the row, and all of them are placed once the lock goes. A busy pool on a healthy database
/// is not an outage: none is refused as unavailable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_on_one_locked_account_queues_for_the_pool_and_every_hold_is_placed() {
    const HOLDS: u64 = 20;
    const HOLD_MICROS: u64 = 1_000;
    let db = FreshDb::new().await;
    let ledger = Arc::new(
        PgLedger::connect_with_config(db.options(None), PgPoolConfig::default().max_connections(2))
            .await
            .unwrap(),
    );
    let acct = funded_account(&*ledger, 1_000_000).await;

    let mut locker = lock_account_row(&db, &acct).await;

    let started = Instant::now();
    let holds: Vec<_> = (0..HOLDS)
        .map(|i| {
            let ledger = ledger.clone();
            let acct = acct.clone();
            tokio::spawn(async move {
                ledger
                    .hold(
                        RequestId::from(format!("req-burst-{i}")),
                        acct,
                        ModelId::from("m"),
                        HOLD_MICROS,
                    )
                    .await
            })
        })
        .collect();
    // the row stays locked well past the 2 s a pool acquire used to wait at most
    tokio::time::sleep(Duration::from_secs(3)).await;
    unlock(&mut locker).await;

    let mut refused = Vec::new();
    for h in holds {
        if let Err(e) = tokio::time::timeout(Duration::from_secs(60), h)
            .await
            .expect("a queued hold must finish once the lock is gone")
            .unwrap()
        {
            refused.push(format!("{e} (unavailable: {})", e.is_unavailable()));
        }
    }
    eprintln!(
        "{HOLDS} holds behind a 3 s row lock, pool of 2: {} refused, all done after {} ms",
        refused.len(),
        started.elapsed().as_millis()
    );
    assert!(refused.is_empty(), "refused holds: {refused:?}");
    let balance = ledger.account(&acct).await.unwrap();
    assert_eq!(balance.held_micros, HOLDS * HOLD_MICROS);
    assert_eq!(balance.balance_micros, 1_000_000);
    assert_eq!(ledger.entries_sum_micros().await.unwrap(), 0);
}

/// A hold whose caller goes away while it waits on the account's row lock (the client
/// disconnected, an outer timeout fired) must leave nothing held once the lock goes: nobody
/// would ever settle or release it. (A hold sent as a lone self-committing statement committed
/// after the lock went, leaving the credit held until the instance restarted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_cancelled_while_it_waits_on_the_row_lock_leaves_nothing_held() {
    let db = FreshDb::new().await;
    let ledger = db.ledger(None).await;
    let acct = funded_account(&ledger, 1_000_000).await;

    let mut locker = lock_account_row(&db, &acct).await;
    // the caller gives up while the hold waits for the row
    let cancelled = tokio::time::timeout(
        Duration::from_millis(500),
        ledger.hold(
            RequestId::from("req-cancelled"),
            acct.clone(),
            ModelId::from("m"),
            1_000,
        ),
    )
    .await;
    assert!(
        cancelled.is_err(),
        "the hold could not have finished behind the lock"
    );
    unlock(&mut locker).await;
    drop(locker);

    // whatever the server still had of it has run by now
    tokio::time::sleep(Duration::from_secs(1)).await;
    let balance = ledger.account(&acct).await.unwrap();
    assert_eq!(
        (balance.balance_micros, balance.held_micros),
        (1_000_000, 0),
        "a cancelled hold left credit held"
    );
    let mut check = sqlx::PgConnection::connect_with(&db.options(None))
        .await
        .unwrap();
    let holds: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM holds")
        .fetch_one(&mut check)
        .await
        .unwrap();
    assert_eq!(holds, 0);
    // and the ledger still works
    ledger
        .hold(
            RequestId::from("req-after"),
            acct.clone(),
            ModelId::from("m"),
            1_000,
        )
        .await
        .unwrap();
    assert_eq!(ledger.account(&acct).await.unwrap().held_micros, 1_000);
}
