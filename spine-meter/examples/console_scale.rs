//! The console's queries at scale (issue 18): seeds `ROWS` (default 1,000,000) request records
//! of one account (4 keys, 2 models, 90 days, 5 % not `completed`) and a few of another into a
//! fresh SQLite ledger, then times each query a console page runs, `RUNS` times, and prints the
//! median and p95 per query.
//!
//! ```sh
//! cargo run -p spine-meter --example console_scale            # SQLite (dependencies at opt-level 1)
//! SPINE_SCALE_ROWS=100000 cargo run -p spine-meter --example console_scale
//! ```
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    missing_docs
)]

use std::time::{Duration, Instant};

use spine_core::{AccountId, OperatorId};
use spine_meter::ledger::{ConsoleStore, PageCursor, RequestFilter, Store};
use spine_meter::SqliteLedger;
use sqlx::Connection as _;

const RUNS: usize = 40;
const DAY_MS: i64 = 86_400_000;

fn stats(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    (ms(v[v.len() / 2]), ms(v[(v.len() * 95).div_ceil(100) - 1]))
}

async fn time<F, Fut, T>(name: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let _ = f().await; // warm
    let mut took = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let t = Instant::now();
        let _ = f().await;
        took.push(t.elapsed());
    }
    let (p50, p95) = stats(took);
    println!("| {name} | {p50:.1} | {p95:.1} |");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rows: i64 = std::env::var("SPINE_SCALE_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let store = SqliteLedger::open(&path).await.unwrap();
    let acct = AccountId::from("acct_big");
    let op = OperatorId::from("op_big");
    store.create_account(&acct).await.unwrap();
    store
        .create_account(&AccountId::from("acct_small"))
        .await
        .unwrap();
    store.create_operator(&op).await.unwrap();
    let node = store.register_node(&op, "ed25519:SCALE").await.unwrap();
    let now = spine_core::unix_time_ms();
    let seed = Instant::now();
    {
        let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
            .await
            .unwrap();
        let insert = format!(
            "INSERT INTO requests (request_id, account_id, model, outcome, node_id, operator_id,
                billed_prompt_tokens, billed_completion_tokens, claimed_prompt_tokens, claimed_completion_tokens,
                usage_source, discrepancy, input_micros_per_mtok, output_micros_per_mtok, share_bps,
                cost_micros, debit_micros, operator_credit_micros, fee_micros, hold_micros, created_at_ms,
                key_hash, duration_ms, ttft_ms)
             WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {last})
             SELECT printf('req_%024d', i), CASE WHEN i % 1000 = 0 THEN 'acct_small' ELSE 'acct_big' END,
                    CASE WHEN i % 3 = 0 THEN 'other-model' ELSE 'smollm2' END,
                    CASE WHEN i % 20 = 0 THEN 'upstream_failed' ELSE 'completed' END,
                    '{node}', 'op_big', 34 + i % 50, 10 + i % 200, 34 + i % 50, 10 + i % 200,
                    'independent', CASE WHEN i % 1000 = 7 THEN 1 ELSE 0 END, 150000, 600000, 8000, 20, 20, 16, 4, 100,
                    {now} - (i * {span} / {rows}), 'key_' || (i % 4), 900 + i % 500, 100 + i % 300
             FROM n",
            last = rows - 1,
            node = node.as_str(),
            span = 90 * DAY_MS,
        );
        sqlx::query(&insert).execute(&mut c).await.unwrap();
        // the seed bypasses settlement: fill the daily roll-ups as the migration does for
        // records that predate it (a settlement adds to them one request at a time)
        sqlx::query(
            "INSERT INTO usage_daily (account_id, day, model, key_hash, requests, prompt_tokens, completion_tokens, debit_micros)
             SELECT account_id, created_at_ms / 86400000, model, COALESCE(key_hash, ''), COUNT(*),
                    SUM(billed_prompt_tokens), SUM(billed_completion_tokens), SUM(debit_micros)
             FROM requests GROUP BY account_id, created_at_ms / 86400000, model, COALESCE(key_hash, '')",
        )
        .execute(&mut c)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO earnings_daily (operator_id, day, model, requests_served, completion_tokens, earned_micros)
             SELECT operator_id, created_at_ms / 86400000, model,
                    SUM(CASE WHEN outcome = 'completed' THEN 1 ELSE 0 END), SUM(billed_completion_tokens),
                    SUM(operator_credit_micros)
             FROM requests WHERE operator_id IS NOT NULL GROUP BY operator_id, created_at_ms / 86400000, model",
        )
        .execute(&mut c)
        .await
        .unwrap();
        // a hold per record, settled, and 10 still in flight (the platform's credit held)
        sqlx::query(
            "INSERT INTO holds (request_id, account_id, model, amount_micros, state, created_at_ms)
             SELECT request_id, account_id, model, 100,
                    CASE WHEN rowid % (SELECT COUNT(*) / 10 FROM requests) = 0 THEN 'held' ELSE 'settled' END,
                    created_at_ms
             FROM requests",
        )
        .execute(&mut c)
        .await
        .unwrap();
        sqlx::query("ANALYZE").execute(&mut c).await.unwrap();
    }
    println!(
        "seeded {rows} request records in {:.1} s (SQLite, {})",
        seed.elapsed().as_secs_f64(),
        path.display()
    );
    let c: std::sync::Arc<dyn ConsoleStore> = std::sync::Arc::new(store.clone()).console();
    let all = RequestFilter::default();
    let deep = PageCursor {
        at_ms: now - 45 * DAY_MS,
        id: "req_~".to_owned(),
    };
    let by_key = RequestFilter {
        key_hash: Some("key_2".into()),
        ..RequestFilter::default()
    };
    let failed = RequestFilter {
        outcome: Some("upstream_failed".into()),
        ..RequestFilter::default()
    };
    let one_day = RequestFilter {
        since_ms: Some(now - 30 * DAY_MS),
        until_ms: Some(now - 29 * DAY_MS),
        ..RequestFilter::default()
    };
    let rare_model = RequestFilter {
        model: Some("no-such-model".into()),
        ..RequestFilter::default()
    };
    println!("| query (page) | median ms | p95 ms |\n|---|---|---|");
    time("request log, first page of 50", || {
        c.account_requests(&acct, &all, None, 50)
    })
    .await;
    time("request log, a page 45 days back (cursor)", || {
        c.account_requests(&acct, &all, Some(&deep), 50)
    })
    .await;
    time("request log, one key", || {
        c.account_requests(&acct, &by_key, None, 50)
    })
    .await;
    time("request log, outcome upstream_failed (5 %)", || {
        c.account_requests(&acct, &failed, None, 50)
    })
    .await;
    time("request log, one day 30 days back", || {
        c.account_requests(&acct, &one_day, None, 50)
    })
    .await;
    time("request log, a model with no rows (worst case)", || {
        c.account_requests(&acct, &rare_model, None, 50)
    })
    .await;
    time("usage, 7 days × model × key", || {
        c.account_usage(&acct, now - 7 * DAY_MS, now + 1, 500)
    })
    .await;
    time("usage, 30 days × model × key", || {
        c.account_usage(&acct, now - 30 * DAY_MS, now + 1, 500)
    })
    .await;
    time("keys (api_keys page)", || c.account_keys(&acct, None, 200)).await;
    time("credit history page", || c.account_credits(&acct, None, 50)).await;
    time("earnings, 30 days × model", || {
        c.operator_earnings(&op, now - 30 * DAY_MS, now + 1, 500)
    })
    .await;
    time("nodes (operator_nodes: served and earned per node)", || {
        store.operator_nodes(&op)
    })
    .await;
    time("balance", || store.account(&acct)).await;
    let deep_discrepancy = PageCursor {
        at_ms: now - 45 * DAY_MS,
        id: "req_~".to_owned(),
    };
    time("platform: 30 days (roll-ups of every account)", || {
        c.platform_days(now - 30 * DAY_MS, now + 1, 500)
    })
    .await;
    time("platform: 90 days", || {
        c.platform_days(now - 90 * DAY_MS, now + 1, 500)
    })
    .await;
    time("platform: operators, 30 days", || {
        c.platform_operators(now - 30 * DAY_MS, now + 1, 500)
    })
    .await;
    time("platform: all nodes, first page", || {
        c.platform_nodes(None, 50)
    })
    .await;
    time("platform: discrepancies (0.1 %), first page", || {
        c.platform_discrepancies(None, 50)
    })
    .await;
    time("platform: discrepancies, a page 45 days back", || {
        c.platform_discrepancies(Some(&deep_discrepancy), 50)
    })
    .await;
    time("platform: credit held (holds in flight, escrow)", || {
        c.platform_held()
    })
    .await;
    let usage = c
        .account_usage(&acct, now - 30 * DAY_MS, now + 1, 500)
        .await
        .unwrap();
    let earnings = c
        .operator_earnings(&op, now - 30 * DAY_MS, now + 1, 500)
        .await
        .unwrap();
    println!(
        "usage, 30 days: {} rows, {} requests; earnings, 30 days: {} rows, {} requests served",
        usage.len(),
        usage.iter().map(|u| u.requests).sum::<u64>(),
        earnings.len(),
        earnings.iter().map(|e| e.requests_served).sum::<u64>()
    );
}
