//! The console's queries at scale (issue 18): seeds `ROWS` (default 1,000,000) request records
//! of one account (4 keys, 2 models, 90 days, 5 % not `completed`, one node) and a few of
//! another, with their daily roll-ups, into a fresh ledger, and 3 years × 20 nodes × 5 models
//! of earnings roll-up (109,500 rows) for a second operator; runs `ANALYZE`; then times each
//! query a console page runs, `RUNS` times after one warm-up, through `ConsoleStore` / `Store`
//! (store time only: no HTTP, no template), and prints the median and p95 per query and store.
//!
//! Each store is measured on its own fresh database: SQLite in a temp file, PostgreSQL in a new
//! database `spine_test_<hex>` on `SPINE_TEST_PG_URL` (default
//! `postgres://postgres@127.0.0.1:5432`), dropped at the end ([`spine_test_support::PgDb`]).
//!
//! Before the index of schema version 8 is built, the two statements that were slow before
//! version 8 are timed as they were, as a baseline in the same run: the nodes page counting
//! every record of each node, and the request log's `$n IS NULL OR model = $n` filter without
//! the `(account_id, model, created_at_ms, request_id)` index. The plans of the request log's
//! filters and of the nodes page are printed after the table (`EXPLAIN QUERY PLAN` / `EXPLAIN`).
//!
//! ```sh
//! cargo run -p spine-meter --example console_scale                       # SQLite, then PostgreSQL
//! SPINE_SCALE_STORES=sqlite SPINE_SCALE_ROWS=100000 cargo run -p spine-meter --example console_scale
//! ```
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::panic
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use spine_core::{AccountId, OperatorId};
use spine_meter::ledger::{ConsoleStore, PageCursor, RequestFilter, Store};
use spine_meter::{PgLedger, SqliteLedger};
use sqlx::{Connection as _, Row as _};

const RUNS: usize = 40;
const DAY_MS: i64 = 86_400_000;

/// The request log's columns, as `account_requests` reads them.
const REQUEST_COLUMNS: &str = "request_id, created_at_ms, key_hash, model, outcome, node_id,
    billed_prompt_tokens, billed_completion_tokens, claimed_prompt_tokens, claimed_completion_tokens,
    discrepancy, duration_ms, ttft_ms, debit_micros";

/// The nodes page before schema version 8: every record of each node counted, all time.
const NODES_BEFORE: &str =
    "SELECT o.id AS operator_id, n.node_id, n.public_key_text, n.name, n.created_at_ms,
        (SELECT COUNT(*) FROM requests r
          WHERE r.node_id = n.node_id AND r.outcome = 'completed') AS served,
        (SELECT CAST(COALESCE(SUM(r.operator_credit_micros), 0) AS BIGINT) FROM requests r
          WHERE r.node_id = n.node_id
            AND (r.earnings IS NULL OR r.earnings = 'paid')) AS earned
    FROM operators o LEFT JOIN nodes n ON n.operator_id = o.id
    WHERE o.id = $1
    ORDER BY n.created_at_ms, n.node_id";

/// The nodes page's statement now (`Store::operator_nodes`), for its plan.
const NODES_NOW: &str =
    "SELECT o.id AS operator_id, n.node_id, n.public_key_text, n.name, n.created_at_ms,
        COALESCE(e.served, 0) AS served, COALESCE(e.earned, 0) AS earned
    FROM operators o
    LEFT JOIN nodes n ON n.operator_id = o.id
    LEFT JOIN (SELECT node_id, CAST(SUM(requests_served) AS BIGINT) AS served,
                      CAST(SUM(earned_micros) AS BIGINT) AS earned
               FROM earnings_daily WHERE operator_id = $1 GROUP BY node_id) e
           ON e.node_id = n.node_id
    WHERE o.id = $1
    ORDER BY n.created_at_ms, n.node_id";

/// The request log's statement before schema version 8 (every filter bound, `NULL` for none).
fn requests_before() -> String {
    format!(
        "SELECT {REQUEST_COLUMNS} FROM requests
         WHERE account_id = $1
           AND ($2 IS NULL OR key_hash = $2)
           AND ($3 IS NULL OR model = $3)
           AND ($4 IS NULL OR outcome = $4)
           AND created_at_ms >= $5 AND created_at_ms < $6
           AND (created_at_ms, request_id) < ($7, $8)
         ORDER BY created_at_ms DESC, request_id DESC LIMIT $9"
    )
}

/// The request log's statement now for one filter column (as `account_requests` builds it:
/// down to the last record a page may search, or the window's start), for its plan.
fn requests_now(column: &str) -> String {
    format!(
        "SELECT {REQUEST_COLUMNS} FROM requests
         WHERE account_id = $1 AND {column} = $2
           AND (created_at_ms, request_id) >= ($3, '') AND (created_at_ms, request_id) < ($4, $5)
         ORDER BY created_at_ms DESC, request_id DESC LIMIT $6"
    )
}

/// The statement that finds the last record a key- or outcome-filtered page searches (the
/// 10,000th below the cursor), for its plan.
const SCAN_END_NOW: &str = "SELECT created_at_ms, request_id FROM requests
     WHERE account_id = $1
       AND (created_at_ms, request_id) >= ($2, '') AND (created_at_ms, request_id) < ($3, $4)
     ORDER BY created_at_ms DESC, request_id DESC LIMIT 1 OFFSET $5";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Sqlite,
    Postgres,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Sqlite => "SQLite",
            Kind::Postgres => "PostgreSQL",
        }
    }
}

/// A value bound to a raw statement.
#[derive(Clone, Debug)]
enum Bind {
    I64(i64),
    Text(&'static str),
    Null,
}

/// A connection of its own to the store's database, for the seed, the baseline and the plans.
enum Raw {
    Sqlite(sqlx::SqliteConnection),
    Postgres(sqlx::PgConnection),
}

macro_rules! bound {
    ($q:expr, $args:expr) => {{
        let mut q = $q;
        for a in $args {
            q = match a {
                Bind::I64(v) => q.bind(*v),
                Bind::Text(v) => q.bind(*v),
                Bind::Null => q.bind(None::<String>),
            };
        }
        q
    }};
}

impl Raw {
    async fn batch(&mut self, sql: &str) {
        match self {
            Raw::Sqlite(c) => sqlx::raw_sql(sql).execute(c).await.map(drop),
            Raw::Postgres(c) => sqlx::raw_sql(sql).execute(c).await.map(drop),
        }
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Runs `sql` and reads all its rows; returns how many.
    async fn rows(&mut self, sql: &str, args: &[Bind]) -> usize {
        match self {
            Raw::Sqlite(c) => bound!(sqlx::query(sql), args)
                .fetch_all(c)
                .await
                .map(|r| r.len()),
            Raw::Postgres(c) => bound!(sqlx::query(sql), args)
                .fetch_all(c)
                .await
                .map(|r| r.len()),
        }
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// The plan of `sql`, one line per row.
    async fn plan(&mut self, sql: &str, args: &[Bind]) -> Vec<String> {
        match self {
            Raw::Sqlite(c) => {
                let explain = format!("EXPLAIN QUERY PLAN {sql}");
                bound!(sqlx::query(&explain), args)
                    .fetch_all(c)
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| r.get::<String, _>(3))
                    .collect()
            }
            Raw::Postgres(c) => {
                let explain = format!("EXPLAIN {sql}");
                bound!(sqlx::query(&explain), args)
                    .fetch_all(c)
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| r.get::<String, _>(0))
                    .collect()
            }
        }
    }
}

fn stats(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    (ms(v[v.len() / 2]), ms(v[(v.len() * 95).div_ceil(100) - 1]))
}

/// `f` once to warm, then `RUNS` times: (median, p95) ms.
async fn time<F, Fut, T>(mut f: F) -> (f64, f64)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let _ = f().await;
    let mut took = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let t = Instant::now();
        let _ = f().await;
        took.push(t.elapsed());
    }
    stats(took)
}

/// As [`time`] for a statement on our own connection.
async fn time_raw(raw: &mut Raw, sql: &str, args: &[Bind]) -> (f64, f64) {
    raw.rows(sql, args).await;
    let mut took = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let t = Instant::now();
        raw.rows(sql, args).await;
        took.push(t.elapsed());
    }
    stats(took)
}

/// One store's results: `(query, median ms, p95 ms)` in the order measured, and the plans.
struct Measured {
    times: Vec<(String, (f64, f64))>,
    plans: Vec<(String, Vec<String>)>,
}

/// The records' seed for `rows` records of `node`, ending at `now` (the dialect's own row
/// generator; the same values on both stores).
fn seed_sql(kind: Kind, rows: i64, node: &str, now: i64) -> String {
    let (id, true_, false_, from) = match kind {
        Kind::Sqlite => (
            "printf('req_%024d', i)",
            "1",
            "0",
            format!(
                "(WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {}) SELECT i FROM n) AS n",
                rows - 1
            ),
        ),
        Kind::Postgres => (
            "'req_' || lpad(i::text, 24, '0')",
            "TRUE",
            "FALSE",
            format!("generate_series(0::BIGINT, {}) AS n(i)", rows - 1),
        ),
    };
    format!(
        "INSERT INTO requests (request_id, account_id, model, outcome, node_id, operator_id,
            billed_prompt_tokens, billed_completion_tokens, claimed_prompt_tokens, claimed_completion_tokens,
            usage_source, discrepancy, input_micros_per_mtok, output_micros_per_mtok, share_bps,
            cost_micros, debit_micros, operator_credit_micros, fee_micros, hold_micros, created_at_ms,
            key_hash, duration_ms, ttft_ms)
         SELECT {id}, CASE WHEN i % 1000 = 0 THEN 'acct_small' ELSE 'acct_big' END,
                CASE WHEN i % 3 = 0 THEN 'other-model' ELSE 'smollm2' END,
                CASE WHEN i % 20 = 0 THEN 'upstream_failed' ELSE 'completed' END,
                '{node}', 'op_big', 34 + i % 50, 10 + i % 200, 34 + i % 50, 10 + i % 200,
                'independent', CASE WHEN i % 1000 = 7 THEN {true_} ELSE {false_} END, 150000, 600000, 8000, 20, 20, 16, 4, 100,
                {now} - (i * {span} / {rows}), 'key_' || (i % 4), 900 + i % 500, 100 + i % 300
         FROM {from}",
        span = 90 * DAY_MS,
    )
}

/// 3 years × 20 nodes × 5 models of earnings roll-up for `op_history` (its nodes too): the
/// nodes page of an operator with a long history reads every row of it.
fn history_sql(kind: Kind, today: i64) -> String {
    let series = |last: i64| {
        match kind {
        Kind::Sqlite => format!(
            "(WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {last}) SELECT i FROM n) AS n"
        ),
        Kind::Postgres => format!("generate_series(0::BIGINT, {last}) AS n(i)"),
    }
    };
    format!(
        "INSERT INTO operators (id, created_at_ms) VALUES ('op_history', 0);
         INSERT INTO nodes (node_id, operator_id, public_key_text, created_at_ms)
             SELECT 'hnode_' || i, 'op_history', 'ed25519:H' || i, i FROM {nodes};
         INSERT INTO earnings_daily (operator_id, day, model, node_id, requests_served, completion_tokens, earned_micros)
             SELECT 'op_history', {today} - i / 100, 'model_' || (i % 5), 'hnode_' || ((i / 5) % 20), 10, 1000, 160
             FROM {rows};",
        nodes = series(19),
        rows = series(3 * 365 * 100 - 1),
    )
}

async fn measure(kind: Kind, rows: i64) -> Measured {
    // the store (migrated to the newest version), and a connection of our own
    let dir = tempfile::tempdir().unwrap();
    let pg = (kind == Kind::Postgres).then(spine_test_support::PgDb::create);
    let (store, mut raw): (Arc<dyn Store>, Raw) = match &pg {
        None => {
            let path = dir.path().join("ledger.db");
            let store = SqliteLedger::open(&path).await.unwrap();
            let c = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
                .await
                .unwrap();
            (Arc::new(store), Raw::Sqlite(c))
        }
        Some(db) => {
            let store = PgLedger::connect(&db.url).await.unwrap();
            let c = sqlx::PgConnection::connect(&db.url).await.unwrap();
            (Arc::new(store), Raw::Postgres(c))
        }
    };
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
    // the index of version 8 comes after the baseline
    raw.batch("DROP INDEX requests_account_model_time").await;
    raw.batch(&seed_sql(kind, rows, node.as_str(), now)).await;
    // the seed bypasses settlement: fill the daily roll-ups as the migrations do for records
    // that predate them (a settlement adds to them one request at a time)
    raw.batch(
        "INSERT INTO usage_daily (account_id, day, model, key_hash, requests, prompt_tokens, completion_tokens, debit_micros)
         SELECT account_id, created_at_ms / 86400000, model, COALESCE(key_hash, ''), COUNT(*),
                SUM(billed_prompt_tokens), SUM(billed_completion_tokens), SUM(debit_micros)
         FROM requests GROUP BY account_id, created_at_ms / 86400000, model, COALESCE(key_hash, '');
         INSERT INTO earnings_daily (operator_id, day, model, node_id, requests_served, completion_tokens, earned_micros)
         SELECT operator_id, created_at_ms / 86400000, model, node_id,
                SUM(CASE WHEN outcome = 'completed' THEN 1 ELSE 0 END), SUM(billed_completion_tokens),
                SUM(operator_credit_micros)
         FROM requests WHERE operator_id IS NOT NULL
         GROUP BY operator_id, created_at_ms / 86400000, model, node_id;",
    )
    .await;
    raw.batch(&history_sql(kind, now.div_euclid(DAY_MS))).await;
    // a hold per record, settled, and 10 still in flight (the platform's credit held)
    raw.batch(
        "INSERT INTO holds (request_id, account_id, model, amount_micros, state, created_at_ms)
         SELECT request_id, account_id, model, 100,
                CASE WHEN request_id IN (SELECT request_id FROM requests ORDER BY request_id LIMIT 10)
                     THEN 'held' ELSE 'settled' END,
                created_at_ms
         FROM requests",
    )
    .await;
    // PostgreSQL: what autovacuum does after a bulk insert (statistics, visibility map)
    raw.batch(match kind {
        Kind::Sqlite => "ANALYZE",
        Kind::Postgres => "VACUUM (ANALYZE)",
    })
    .await;
    println!(
        "{}: seeded {rows} request records and their roll-ups in {:.1} s",
        kind.name(),
        seed.elapsed().as_secs_f64()
    );

    let mut times: Vec<(String, (f64, f64))> = Vec::new();
    // the baseline: as before version 8
    times.push((
        "before v8: nodes, counting every record of the node".into(),
        time_raw(&mut raw, NODES_BEFORE, &[Bind::Text("op_big")]).await,
    ));
    let before_args = [
        Bind::Text("acct_big"),
        Bind::Null,
        Bind::Text("no-such-model"),
        Bind::Null,
        Bind::I64(i64::MIN),
        Bind::I64(i64::MAX),
        Bind::I64(i64::MAX),
        Bind::Text(""),
        Bind::I64(51),
    ];
    let before = requests_before();
    times.push((
        "before v8: request log, a model with no rows (no (account, model, time) index)".into(),
        time_raw(&mut raw, &before, &before_args).await,
    ));
    let built = Instant::now();
    raw.batch(
        "CREATE INDEX requests_account_model_time ON requests(account_id, model, created_at_ms, request_id)",
    )
    .await;
    raw.batch("ANALYZE").await;
    println!(
        "{}: built requests_account_model_time and analyzed in {:.1} s",
        kind.name(),
        built.elapsed().as_secs_f64()
    );

    let c: Arc<dyn ConsoleStore> = store.clone().console();
    let deep = PageCursor {
        at_ms: now - 45 * DAY_MS,
        id: "req_~".to_owned(),
    };
    let filter = |f: fn(&mut RequestFilter)| {
        let mut r = RequestFilter::default();
        f(&mut r);
        r
    };
    let all = RequestFilter::default();
    let by_key = filter(|f| f.key_hash = Some("key_2".into()));
    let no_key = filter(|f| f.key_hash = Some("key_unused".into()));
    let failed = filter(|f| f.outcome = Some("upstream_failed".into()));
    let no_outcome = filter(|f| f.outcome = Some("cut_at_bound".into()));
    let one_day = RequestFilter {
        since_ms: Some(now - 30 * DAY_MS),
        until_ms: Some(now - 29 * DAY_MS),
        ..RequestFilter::default()
    };
    let model = filter(|f| f.model = Some("other-model".into()));
    let no_model = filter(|f| f.model = Some("no-such-model".into()));
    let model_key_none = RequestFilter {
        model: Some("smollm2".into()),
        key_hash: Some("key_unused".into()),
        ..RequestFilter::default()
    };
    let history = OperatorId::from("op_history");
    let mut page = |name: &str, t: (f64, f64)| times.push((name.to_owned(), t));
    let log = |f: &RequestFilter, after: Option<&PageCursor>| {
        let (c, acct, f, after) = (c.clone(), acct.clone(), f.clone(), after.cloned());
        async move { c.account_requests(&acct, &f, after.as_ref(), 50).await }
    };
    page(
        "request log, first page of 50",
        time(|| log(&all, None)).await,
    );
    page(
        "request log, a page 45 days back (cursor)",
        time(|| log(&all, Some(&deep))).await,
    );
    page("request log, one key", time(|| log(&by_key, None)).await);
    page(
        "request log, a key with no rows (10,000 records searched)",
        time(|| log(&no_key, None)).await,
    );
    page(
        "request log, a key with no rows, 45 days back (search older)",
        time(|| log(&no_key, Some(&deep))).await,
    );
    page(
        "request log, outcome `upstream_failed` (5 %)",
        time(|| log(&failed, None)).await,
    );
    page(
        "request log, an outcome with no rows (10,000 records searched)",
        time(|| log(&no_outcome, None)).await,
    );
    page(
        "request log, one day 30 days back",
        time(|| log(&one_day, None)).await,
    );
    page(
        "request log, one model (1/3 of the records)",
        time(|| log(&model, None)).await,
    );
    page(
        "request log, a model with no rows",
        time(|| log(&no_model, None)).await,
    );
    page(
        "request log, a model and a key with no rows (10,000 of the model's searched)",
        time(|| log(&model_key_none, None)).await,
    );
    page(
        "usage, 7 days × model × key",
        time(|| c.account_usage(&acct, now - 7 * DAY_MS, now + 1, 500)).await,
    );
    page(
        "usage, 30 days × model × key",
        time(|| c.account_usage(&acct, now - 30 * DAY_MS, now + 1, 500)).await,
    );
    page("keys page", time(|| c.account_keys(&acct, None, 200)).await);
    page(
        "credit history page",
        time(|| c.account_credits(&acct, None, 50)).await,
    );
    page(
        "earnings, 30 days × model (summed over nodes)",
        time(|| c.operator_earnings(&op, now - 30 * DAY_MS, now + 1, 500)).await,
    );
    page(
        "nodes (`operator_nodes`: roll-up summed per node, all time)",
        time(|| store.operator_nodes(&op)).await,
    );
    page(
        "nodes, 3 years × 20 nodes × 5 models of roll-up (109,500 rows)",
        time(|| store.operator_nodes(&history)).await,
    );
    page(
        "earnings, 30 days × model, the same operator (3,000 rows)",
        time(|| c.operator_earnings(&history, now - 30 * DAY_MS, now + 1, 500)).await,
    );
    page("balance", time(|| store.account(&acct)).await);
    let deep_discrepancy = PageCursor {
        at_ms: now - 45 * DAY_MS,
        id: "req_~".to_owned(),
    };
    page(
        "platform: 30 days (roll-ups of every account)",
        time(|| c.platform_days(now - 30 * DAY_MS, now + 1, 500)).await,
    );
    page(
        "platform: 90 days",
        time(|| c.platform_days(now - 90 * DAY_MS, now + 1, 500)).await,
    );
    page(
        "platform: operators, 30 days",
        time(|| c.platform_operators(now - 30 * DAY_MS, now + 1, 500)).await,
    );
    page(
        "platform: all nodes, first page",
        time(|| c.platform_nodes(None, 50)).await,
    );
    page(
        "platform: discrepancies (0.1 %), first page",
        time(|| c.platform_discrepancies(None, 50)).await,
    );
    page(
        "platform: discrepancies, a page 45 days back",
        time(|| c.platform_discrepancies(Some(&deep_discrepancy), 50)).await,
    );
    page(
        "platform: credit held (holds in flight, escrow)",
        time(|| c.platform_held()).await,
    );

    // what the pages read, checked against the records: a key with no rows searches
    // 10,000 records and says where to search on
    let none = log(&no_key, None).await.unwrap();
    assert!(none.rows.is_empty() && none.next.is_some(), "{none:?}");
    let usage = c
        .account_usage(&acct, now - 30 * DAY_MS, now + 1, 500)
        .await
        .unwrap();
    let earnings = c
        .operator_earnings(&op, now - 30 * DAY_MS, now + 1, 500)
        .await
        .unwrap();
    let nodes = store.operator_nodes(&op).await.unwrap();
    println!(
        "{}: usage, 30 days: {} rows, {} requests; earnings, 30 days: {} rows, {} requests served; \
         nodes: {} served, {} micros earned (records: {} completed)",
        kind.name(),
        usage.len(),
        usage.iter().map(|u| u.requests).sum::<u64>(),
        earnings.len(),
        earnings.iter().map(|e| e.requests_served).sum::<u64>(),
        nodes[0].requests_served,
        nodes[0].earned_micros,
        rows - (rows + 19) / 20,
    );
    assert_eq!(
        nodes[0].requests_served,
        u64::try_from(rows - (rows + 19) / 20).unwrap()
    );

    let window = |v: &'static str| {
        [
            Bind::Text("acct_big"),
            Bind::Text(v),
            Bind::I64(i64::MIN),
            Bind::I64(i64::MAX),
            Bind::Text(""),
            Bind::I64(51),
        ]
    };
    let mut plans = Vec::new();
    for (name, sql, args) in [
        (
            "request log, model filter",
            requests_now("model"),
            window("no-such-model").to_vec(),
        ),
        (
            "request log, key filter",
            requests_now("key_hash"),
            window("key_unused").to_vec(),
        ),
        (
            "request log, outcome filter",
            requests_now("outcome"),
            window("upstream_failed").to_vec(),
        ),
        (
            "request log, the last record a filtered page searches",
            SCAN_END_NOW.to_owned(),
            vec![
                Bind::Text("acct_big"),
                Bind::I64(i64::MIN),
                Bind::I64(i64::MAX),
                Bind::Text(""),
                Bind::I64(9_999),
            ],
        ),
        (
            "nodes page",
            NODES_NOW.to_owned(),
            vec![Bind::Text("op_big")],
        ),
    ] {
        plans.push((name.to_owned(), raw.plan(&sql, &args).await));
    }
    drop(raw);
    drop(c);
    drop(store);
    Measured { times, plans }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rows: i64 = std::env::var("SPINE_SCALE_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let stores = std::env::var("SPINE_SCALE_STORES").unwrap_or_else(|_| "sqlite,postgres".into());
    let mut measured = Vec::new();
    for kind in [Kind::Sqlite, Kind::Postgres] {
        if stores
            .split(',')
            .any(|s| s.trim().eq_ignore_ascii_case(&format!("{kind:?}")))
        {
            measured.push((kind, measure(kind, rows).await));
        }
    }
    let Some((_, first)) = measured.first() else {
        panic!("SPINE_SCALE_STORES={stores}: name sqlite, postgres or both");
    };
    println!("\n{rows} request records, {RUNS} runs per query after one warm-up\n");
    let mut header = String::from("| query (page) |");
    let mut rule = String::from("|---|");
    for (kind, _) in &measured {
        header.push_str(&format!(" {0} median ms | {0} p95 ms |", kind.name()));
        rule.push_str("---|---|");
    }
    println!("{header}\n{rule}");
    for (i, (name, _)) in first.times.iter().enumerate() {
        let mut line = format!("| {name} |");
        for (_, m) in &measured {
            let (p50, p95) = m.times[i].1;
            line.push_str(&format!(" {p50:.1} | {p95:.1} |"));
        }
        println!("{line}");
    }
    for (kind, m) in &measured {
        for (name, plan) in &m.plans {
            println!("\n{} plan, {name}:", kind.name());
            for line in plan {
                println!("    {line}");
            }
        }
    }
}
