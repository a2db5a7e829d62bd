//! Scale-out end to end (issue 6, design brief §8): four real `reference-gateway` processes in
//! multi-instance mode on one fresh PostgreSQL database and one Redis (a key prefix of their
//! own), real `reference-agent`s over real TLS tunnels (one shared certificate), and
//! `spine-mock-engine` processes (real HTTP) as engines, one model per engine (`m0`…`m3`, and
//! `m4` for the stranded node below) so every answer says which node served it. Node `i` holds
//! its tunnel on instance `i`. Every measured number is printed with a label (`--nocapture`).
//!
//! - four instances started at the same instant on an empty database all come up (migrations
//!   once, each instance's liveness key `P instance:<id>` and PostgreSQL `instances` row there);
//! - every instance serves every node, whichever instance holds its tunnel;
//! - `kill -9` of instance 0, which holds node 0 (its agent knows every instance's URL) and node
//!   4 (its agent knows instance 0 only): for 6 s, past the dead instance's liveness and
//!   directory TTLs, requests to the survivors for `m4` fail with an OpenAI-shaped 503, ≥ 95 %
//!   of them in < 50 ms and every one in < 2 s (a hang would be the caller's timeout, seconds);
//!   node 0 reconnects to a survivor and `m0` is served again (time to recovery printed);
//! - 200 concurrent streams across instances: each instance's Redis connections (`CLIENT LIST`,
//!   by the `…-<instance_id>` client name) are one, before, during and after;
//! - a key's limits hold across instances: `rpm_limit` 10 → 10 of 40 requests over four
//!   instances admitted; `tpm_limit` 300 → the admitted requests bill ≤ 300 tokens;
//! - the ledger stays exact under 500 mixed requests through all instances (plain, streamed,
//!   cancelled mid-stream): every hold settles (each placed by a named instance), Σ debits =
//!   Σ operator credits + fees, no request charged twice, every instance shows the same balance;
//! - `cross_instance_hop_overhead` (ignored; a measurement): the same requests to the node's
//!   owner and to another instance, alternating, p50/p99 of both and the difference.
//!
//! Needs: the workspace binaries (`cargo build --workspace --bins`, for `reference-agent` and
//! `spine-mock-engine`), the SmolLM2 GGUF (tokenizer) from `scripts/setup.sh`, PostgreSQL at
//! `SPINE_TEST_PG_URL` (default `postgres://postgres@127.0.0.1:5432`, a user that may CREATE
//! DATABASE; `psql` on PATH) and Redis at `SPINE_TEST_REDIS_URL` (default
//! `redis://127.0.0.1:6379`); `scripts/services.sh` starts both. Each test creates its own
//! database (dropped at the end) and Redis prefix (`prefix*` deleted at the end); every child
//! process is killed on drop. The tests of this file run one at a time (they share 2 cores, and
//! the fail-fast bound is a latency).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::console::{csrf_in, Session};
use common::{header, keygen, post_json, sse_data, Gateway, PgDb, ADMIN_TOKEN, CREDITS, SHARE_BPS};
use serde_json::{json, Value};
use spine_test_support::{random_hex, Child, GatewayToml, Ready};
use tokio::process::Command;

/// Instances per cluster.
const INSTANCES: usize = 4;
/// Catalog models `m0`…`m4`: one per instance's node, and one for the node stranded on a dead
/// instance in the `kill -9` test.
const MODELS: usize = INSTANCES + 1;
const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
const CLUSTER_SECRET: &str = "e2e-cluster-secret-0123456789abcdef";
/// The per-request bound of the fail-fast acceptance point (issue 6): at least 95 % of the
/// requests for a dead owner's model complete (error or reroute) within it, …
const FAIL_FAST: Duration = Duration::from_millis(50);
/// … and every one within this (a hang is the caller's timeout: 5 s for status, 60 s for
/// inference in the seed). The slack between the two is for a debug build of 12 processes on
/// 2 cores: one local `no_capacity` answer took 282 ms there in CI-like conditions, so a tighter
/// bound would test the scheduler, not the gateway; the counts are printed.
const NO_HANG: Duration = Duration::from_secs(2);

/// The tests of this file run one at a time: each starts 12 processes on a 2-core machine.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn bin(name: &str) -> PathBuf {
    let gw = PathBuf::from(env!("CARGO_BIN_EXE_reference-gateway"));
    let path = gw.with_file_name(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.exists(),
        "{} missing: build the workspace binaries first (cargo build --workspace --bins)",
        path.display()
    );
    path
}

/// The tokenizer GGUF the catalog models load (`SPINE_MODEL_GGUF`, else the setup cache).
fn model_gguf() -> PathBuf {
    let path = std::env::var_os("SPINE_MODEL_GGUF").map_or_else(
        || {
            let cache = std::env::var_os("SPINE_CACHE").map_or_else(
                || PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/spine"),
                PathBuf::from,
            );
            cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        PathBuf::from,
    );
    assert!(
        path.exists(),
        "{} not found (set SPINE_MODEL_GGUF); run scripts/setup.sh",
        path.display()
    );
    path
}

// PostgreSQL: `common::PgDb` (a fresh database per test, dropped at the end).

// --- Redis ---------------------------------------------------------------------------------

fn redis_url() -> String {
    std::env::var("SPINE_TEST_REDIS_URL").unwrap_or_else(|_| DEFAULT_REDIS_URL.into())
}

/// A Redis key prefix of this test's own; `prefix*` is deleted on drop.
struct RedisPrefix {
    client: redis::Client,
    prefix: String,
}

impl RedisPrefix {
    fn create() -> Self {
        let url = redis_url();
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut conn = client.get_connection().unwrap_or_else(|e| {
            panic!("Redis is unreachable at {url} ({e}); start it with scripts/services.sh")
        });
        let pong: String = redis::cmd("PING").query(&mut conn).unwrap();
        assert_eq!(pong, "PONG");
        Self {
            client,
            prefix: format!("spinetest:{}:", random_hex()),
        }
    }

    fn conn(&self) -> redis::Connection {
        self.client.get_connection().unwrap()
    }

    /// The client names of every connection the server has (`CLIENT LIST`).
    fn client_names(&self) -> Vec<String> {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query(&mut self.conn())
            .unwrap();
        list.lines()
            .filter_map(|l| {
                l.split(' ')
                    .find_map(|f| f.strip_prefix("name="))
                    .map(str::to_owned)
            })
            .collect()
    }

    /// Connections whose client name is `…-<instance_id>` (the name each instance sets).
    fn connections_of(&self, instance_id: &str) -> usize {
        let suffix = format!("-{instance_id}");
        self.client_names()
            .iter()
            .filter(|n| n.ends_with(&suffix))
            .count()
    }

    fn get(&self, key: &str) -> Option<String> {
        redis::cmd("GET")
            .arg(format!("{}{key}", self.prefix))
            .query(&mut self.conn())
            .unwrap()
    }

    fn keys(&self) -> Vec<String> {
        let mut conn = self.conn();
        let mut keys = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}*", self.prefix))
                .arg("COUNT")
                .arg(1000)
                .query(&mut conn)
                .unwrap();
            keys.extend(batch);
            if next == 0 {
                return keys;
            }
            cursor = next;
        }
    }
}

impl Drop for RedisPrefix {
    fn drop(&mut self) {
        // the instances were killed just before (fields drop in order); give the last write a
        // moment to land, then delete everything under the prefix
        std::thread::sleep(Duration::from_millis(200));
        let keys = self.keys();
        if !keys.is_empty() {
            let deleted: Result<u64, _> = redis::cmd("DEL").arg(&keys).query(&mut self.conn());
            if let Err(e) = deleted {
                eprintln!("deleting {} keys under {}: {e}", keys.len(), self.prefix);
            }
        }
    }
}

// --- processes -----------------------------------------------------------------------------

/// A `spine-mock-engine` serving `model`.
struct Mock {
    _child: Child,
    url: String,
}

async fn start_mock(model: &str, completion_tokens: u64, itl_micros: u64) -> Mock {
    let mut cmd = Command::new(bin("spine-mock-engine"));
    cmd.args(["--model", model])
        .args(["--completion-tokens", &completion_tokens.to_string()])
        .args(["--itl-micros", &itl_micros.to_string()]);
    let mut child = Child::spawn(&format!("mock-{model}"), cmd).unwrap();
    let ready = child.read_json_line(Duration::from_secs(30)).await.unwrap();
    let url = format!("http://{}", ready["addr"].as_str().unwrap());
    Mock { _child: child, url }
}

/// One gateway instance.
struct Instance {
    gw: Gateway,
    /// Its `instance_id`, from the ready line.
    id: String,
    /// Its internal listener, from the ready line.
    internal: String,
}

/// What a cluster is started with.
struct Options {
    /// Extra top-level TOML keys for every instance.
    extra: String,
    /// `spine-mock-engine --completion-tokens`.
    completion_tokens: u64,
    /// `spine-mock-engine --itl-micros`.
    itl_micros: u64,
    /// `reference-agent --max-concurrency`.
    agent_concurrency: u32,
    /// Each agent knows every instance's URL (its own first), not only its own.
    failover: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            extra: String::new(),
            completion_tokens: 16,
            itl_micros: 0,
            agent_concurrency: 16,
            failover: false,
        }
    }
}

/// Four instances, four nodes (node `i` serves model `m<i>` and holds its tunnel on instance
/// `i`; with `failover` its agent knows every instance's URL, its own first), one funded
/// account.
///
/// Field order is drop order: processes first (killed on drop), then the Redis prefix is
/// cleaned and the database dropped.
struct Cluster {
    instances: Vec<Option<Instance>>,
    agents: Vec<Child>,
    mocks: Vec<Mock>,
    nodes: Vec<String>,
    operator: String,
    account: String,
    api_key: String,
    redis: RedisPrefix,
    db: PgDb,
    dir: tempfile::TempDir,
    opts: Options,
}

fn model(i: usize) -> String {
    format!("m{i}")
}

/// Writes the shared tunnel certificate (every instance presents the same one, so an agent
/// trusts all of them with one `--ca-file`); returns (cert, key) paths.
fn shared_tunnel_cert(dir: &Path) -> (PathBuf, PathBuf) {
    let (cert, key) =
        spine_transport::self_signed_cert(&["localhost".to_owned(), "127.0.0.1".to_owned()])
            .unwrap();
    let cert_path = dir.join("tunnel-cert.pem");
    let key_path = dir.join("tunnel-key.pem");
    std::fs::write(&cert_path, cert).unwrap();
    std::fs::write(&key_path, key).unwrap();
    (cert_path, key_path)
}

/// Writes instance `i`'s configuration and spawns it (does not wait for its ready line).
fn spawn_instance(
    dir: &Path,
    i: usize,
    db: &PgDb,
    redis: &RedisPrefix,
    tag: &str,
    extra: &str,
) -> Child {
    let data = dir.join(format!("gw{i}"));
    std::fs::create_dir_all(&data).unwrap();
    let gguf = model_gguf();
    let mut toml = GatewayToml::new(ADMIN_TOKEN, &data).line(&format!(
        r#"database_url = "{db}"
operator_share_bps = {SHARE_BPS}
shutdown_grace_secs = 5
tunnel_tls_cert_file = "{cert}"
tunnel_tls_key_file = "{key}"
redis_url = "{redis_url}"
redis_key_prefix = "{prefix}"
instance_id = "gw-{tag}-{i}"
internal_listen = "127.0.0.1:0"
cluster_secret = "{CLUSTER_SECRET}"
{extra}"#,
        db = db.url,
        cert = dir.join("tunnel-cert.pem").display(),
        key = dir.join("tunnel-key.pem").display(),
        redis_url = redis_url(),
        prefix = redis.prefix,
    ));
    for m in 0..MODELS {
        toml = toml.model(
            &model(m),
            &gguf,
            common::INPUT_PRICE,
            common::OUTPUT_PRICE,
            "",
        );
    }
    toml.spawn(
        &data.join("gateway.toml"),
        Path::new(env!("CARGO_BIN_EXE_reference-gateway")),
        "info",
        &format!("gateway-{i}"),
    )
    .unwrap()
}

/// Reads an instance's ready line.
async fn ready(mut child: Child) -> Result<Instance, String> {
    let ready = Ready::read(&mut child, Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    Ok(Instance {
        id: ready
            .instance_id
            .clone()
            .ok_or("ready line without \"instance_id\"")?,
        internal: ready
            .internal_addr
            .clone()
            .ok_or("ready line without \"internal_addr\"")?,
        gw: Gateway::from_ready(ready, child),
    })
}

/// Starts `n` instances at the same instant (all spawned before any ready line is read) on
/// `db`; returns each one's result and the time until the last ready line.
async fn start_instances(
    dir: &Path,
    n: usize,
    db: &PgDb,
    redis: &RedisPrefix,
    extra: &str,
) -> (Vec<Result<Instance, String>>, Duration) {
    let tag = random_hex();
    let started = Instant::now();
    let children: Vec<Child> = (0..n)
        .map(|i| spawn_instance(dir, i, db, redis, &tag[..6], extra))
        .collect();
    let results = futures_util::future::join_all(children.into_iter().map(ready)).await;
    (results, started.elapsed())
}

/// Starts `reference-agent run` for a node, with every URL of `gateways` in order
/// (`--gateway url1,url2,…`: tried in order, the next one when a tunnel ends).
fn start_agent(
    gateways: &[&str],
    identity: &Path,
    ca_file: &Path,
    engine_url: &str,
    concurrency: u32,
    name: &str,
) -> Child {
    let mut cmd = Command::new(bin("reference-agent"));
    cmd.arg("run")
        .arg("--gateway")
        .arg(gateways.join(","))
        .arg("--identity")
        .arg(identity)
        .arg("--ca-file")
        .arg(ca_file)
        .args(["--engine", "llama.cpp", "--engine-url", engine_url])
        .args(["--max-concurrency", &concurrency.to_string()])
        .env("RUST_LOG", "info");
    Child::spawn(name, cmd).unwrap()
}

/// Whether `gw`'s registry lists `node_id` as routable (its tunnel is on `gw`).
async fn listed(gw: &Gateway, node_id: &str) -> bool {
    let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
    nodes["data"]
        .as_array()
        .is_some_and(|a| a.iter().any(|n| n["node_id"] == node_id))
}

/// A non-streamed chat request for `model`: (status, body, latency).
async fn chat(gw: &Gateway, key: &str, model: &str, max_tokens: u64) -> (u16, Value, Duration) {
    let started = Instant::now();
    let resp = gw
        .http
        .post(format!("{}/v1/chat/completions", gw.public))
        .bearer_auth(key)
        .timeout(Duration::from_secs(30))
        .json(&json!({"model": model, "max_tokens": max_tokens,
                      "messages": [{"role": "user", "content": "Say the word the."}]}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    (status, body, started.elapsed())
}

impl Cluster {
    #[allow(clippy::print_stdout)] // reports what it measured
    async fn start(opts: Options) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let db = PgDb::create();
        let redis = RedisPrefix::create();
        shared_tunnel_cert(dir.path());
        let (results, took) =
            start_instances(dir.path(), INSTANCES, &db, &redis, &opts.extra).await;
        println!("cluster: {INSTANCES} instances ready in {took:?}");
        let instances: Vec<Option<Instance>> = results
            .into_iter()
            .map(|r| Some(r.unwrap_or_else(|e| panic!("{e}"))))
            .collect();
        let gw0 = &instances[0].as_ref().unwrap().gw;

        let (s, op) = gw0.admin_post("/admin/v1/operators", json!({})).await;
        assert_eq!(s, 201, "{op}");
        let operator = op["id"].as_str().unwrap().to_owned();
        let (s, acct) = gw0.admin_post("/admin/v1/accounts", json!({})).await;
        assert_eq!(s, 201, "{acct}");
        let account = acct["id"].as_str().unwrap().to_owned();
        let (s, key) = gw0
            .admin_post(&format!("/admin/v1/accounts/{account}/keys"), json!({}))
            .await;
        assert_eq!(s, 201, "{key}");
        let api_key = key["key"].as_str().unwrap().to_owned();
        let (s, c) = gw0
            .admin_post(
                &format!("/admin/v1/accounts/{account}/credits"),
                json!({"amount_micros": CREDITS, "idempotency_key": "cluster-topup"}),
            )
            .await;
        assert_eq!(s, 200, "{c}");

        let mut cluster = Cluster {
            instances,
            agents: Vec::new(),
            mocks: Vec::new(),
            nodes: Vec::new(),
            operator,
            account,
            api_key,
            redis,
            db,
            dir,
            opts,
        };
        for i in 0..INSTANCES {
            // its own instance first, then (failover) the others in order
            let urls: Vec<usize> = (0..if cluster.opts.failover { INSTANCES } else { 1 })
                .map(|k| (i + k) % INSTANCES)
                .collect();
            cluster.add_node(i, &urls).await;
        }
        for i in 0..INSTANCES {
            cluster.wait_listed(i, i, Duration::from_secs(30)).await;
        }
        // every instance has read every node from the directory
        let started = Instant::now();
        for on in 0..INSTANCES {
            for node in 0..INSTANCES {
                cluster.wait_served(node, on, Duration::from_secs(10)).await;
            }
        }
        println!(
            "cluster: every instance serves every node {:.2} s after the last owner listed it",
            started.elapsed().as_secs_f64()
        );
        cluster
    }

    /// Starts a mock engine for model `m<model_idx>` and an agent for a new node whose
    /// `--gateway` lists the instances `urls` in order (not waiting until it is routable);
    /// returns the node's index.
    async fn add_node(&mut self, model_idx: usize, urls: &[usize]) -> usize {
        let n = self.nodes.len();
        let mock = start_mock(
            &model(model_idx),
            self.opts.completion_tokens,
            self.opts.itl_micros,
        )
        .await;
        let (identity, public_key) = keygen(self.dir.path(), &format!("node{n}.key")).await;
        let (s, node) = self
            .gw(urls[0])
            .admin_post(
                "/admin/v1/nodes",
                json!({"operator_id": self.operator, "public_key": public_key}),
            )
            .await;
        assert_eq!(s, 201, "{node}");
        self.nodes
            .push(node["node_id"].as_str().unwrap().to_owned());
        let tunnels: Vec<&str> = urls.iter().map(|&i| self.gw(i).tunnel.as_str()).collect();
        let agent = start_agent(
            &tunnels,
            identity.as_path(),
            &self.dir.path().join("tunnel-cert.pem"),
            &mock.url,
            self.opts.agent_concurrency,
            &format!("agent-{n}"),
        );
        self.agents.push(agent);
        self.mocks.push(mock);
        n
    }

    fn gw(&self, i: usize) -> &Gateway {
        &self.instance(i).gw
    }

    fn instance(&self, i: usize) -> &Instance {
        self.instances[i].as_ref().expect("instance was killed")
    }

    /// Waits until node `node` is routable on instance `on` (its tunnel is there).
    async fn wait_listed(&self, node: usize, on: usize, limit: Duration) {
        let deadline = Instant::now() + limit;
        while !listed(self.gw(on), &self.nodes[node]).await {
            assert!(
                Instant::now() < deadline,
                "node {node} not routable on instance {on} within {limit:?}; agent stderr:\n{}\ngateway stderr:\n{}",
                self.agents[node].stderr_tail(30),
                self.gw(on).child.stderr_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until a request on instance `on` for node `node`'s model succeeds.
    async fn wait_served(&self, node: usize, on: usize, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let (s, body, _) = chat(self.gw(on), &self.api_key, &model(node), 4).await;
            if s == 200 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "instance {on} never served {} within {limit:?}: last answer {s} {body}\ngateway stderr:\n{}",
                model(node),
                self.gw(on).child.stderr_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn alive(&self) -> impl Iterator<Item = usize> + '_ {
        (0..INSTANCES).filter(|&i| self.instances[i].is_some())
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

// --- 1 ---------------------------------------------------------------------------------------

/// Four instances spawned at the same instant on an empty database: migrations run once under
/// the advisory lock, every instance prints its ready line, and each names its instance id and
/// internal listener and registers its liveness key in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_instances_start_at_once_on_an_empty_database() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let db = PgDb::create();
    let redis = RedisPrefix::create();
    shared_tunnel_cert(dir.path());
    assert_eq!(
        db.query_i64(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        )
        .await,
        0,
        "the database is not empty"
    );
    let (results, took) = start_instances(dir.path(), INSTANCES, &db, &redis, "").await;
    let up = results.iter().filter(|r| r.is_ok()).count();
    println!("simultaneous start: {up}/{INSTANCES} instances ready, the last after {took:?}");
    let instances: Vec<Instance> = results
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.unwrap_or_else(|e| panic!("instance {i}: {e}")))
        .collect();
    // migrations applied once
    let versions = db
        .query(
            "SELECT string_agg(version::text, ',' ORDER BY version) FROM spine_schema_migrations",
        )
        .await;
    assert!(!versions.is_empty());
    assert_eq!(
        db.query_i64("SELECT count(*) - count(DISTINCT version) FROM spine_schema_migrations")
            .await,
        0
    );
    println!("schema versions applied: {versions}");
    let mut ids: Vec<&str> = instances.iter().map(|i| i.id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), INSTANCES, "instance ids are not distinct");
    for inst in &instances {
        // every instance answers its admin API on the shared database
        let (s, acct) = inst.gw.admin_post("/admin/v1/accounts", json!({})).await;
        assert_eq!(s, 201, "{acct}");
        // liveness key: P instance:<id> → its internal address, with a short TTL
        let deadline = Instant::now() + Duration::from_secs(5);
        let addr = loop {
            if let Some(a) = redis.get(&format!("instance:{}", inst.id)) {
                break a;
            }
            assert!(
                Instant::now() < deadline,
                "no {}instance:{} key",
                redis.prefix,
                inst.id
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(
            addr.contains(&inst.internal) || inst.internal.contains(&addr),
            "{}instance:{} = {addr:?}, ready line says internal_addr {:?}",
            redis.prefix,
            inst.id,
            inst.internal
        );
        let ttl: i64 = redis::cmd("PTTL")
            .arg(format!("{}instance:{}", redis.prefix, inst.id))
            .query(&mut redis.conn())
            .unwrap();
        assert!(
            (1..=3000).contains(&ttl),
            "liveness key TTL {ttl} ms, want ≤ 3 s"
        );
    }
    let accounts = db.query_i64("SELECT count(*) FROM accounts").await;
    assert_eq!(accounts, INSTANCES as i64);
    // each instance heartbeats its row in PostgreSQL's `instances`
    let rows = db
        .query("SELECT string_agg(instance_id, ',' ORDER BY instance_id) FROM instances")
        .await;
    let mut want: Vec<&str> = instances.iter().map(|i| i.id.as_str()).collect();
    want.sort_unstable();
    assert_eq!(rows, want.join(","), "the instances table");
}

// --- 2 and 3 ---------------------------------------------------------------------------------

/// Every instance serves every node; then `kill -9` of instance 0, which holds the tunnels of
/// node 0 (`m0`; its agent knows every instance) and node 4 (`m4`; its agent knows instance 0
/// only): for 6 s (past the dead instance's liveness and directory TTLs) requests to the
/// survivors for `m4` fail, and requests for `m0` fail until node 0 has reconnected to a
/// survivor and are served after; the failures are OpenAI-shaped, ≥ 95 % of them under 50 ms and
/// all under 2 s (no hang). Then every survivor serves every model of a live node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_instance_serves_every_node_and_a_dead_owner_fails_fast() {
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start(Options {
        failover: true,
        ..Options::default()
    })
    .await;
    let key = cluster.api_key.clone();

    // --- every instance serves every node ---
    for on in 0..INSTANCES {
        for node in 0..INSTANCES {
            let (s, body, took) = chat(cluster.gw(on), &key, &model(node), 4).await;
            assert_eq!(s, 200, "instance {on}, {}: {body}", model(node));
            assert_eq!(body["model"], model(node).as_str(), "{body}");
            let hop = if on == node { "same" } else { "cross" };
            println!(
                "served: instance {on} → node {node} ({hop}-instance) {}",
                ms(took)
            );
        }
    }
    // the directory knows each node's owner, the liveness keys are there
    for i in 0..INSTANCES {
        assert!(
            cluster
                .redis
                .get(&format!("instance:{}", cluster.instance(i).id))
                .is_some(),
            "no liveness key for instance {i}"
        );
    }
    let keys = cluster.redis.keys();
    for node in &cluster.nodes {
        assert!(
            keys.iter().any(|k| k.contains(node.as_str())),
            "no directory key names node {node}: {keys:?}"
        );
    }

    // a fifth node, `m4`, whose agent knows instance 0 only: stranded when instance 0 dies
    let stranded = cluster.add_node(INSTANCES, &[0]).await;
    cluster
        .wait_listed(stranded, 0, Duration::from_secs(30))
        .await;
    for on in 0..INSTANCES {
        cluster
            .wait_served(stranded, on, Duration::from_secs(10))
            .await;
    }

    // --- kill -9 of instance 0: owner of node 0 (`m0`, agent with failover) and of node 4
    // (`m4`, no failover) ---
    let mut owner = cluster.instances[0].take().unwrap();
    let pid = owner.gw.child.id().unwrap();
    let killed_at = Instant::now();
    owner.gw.child.kill().await; // SIGKILL, then reaped
    println!("kill -9 of instance 0 (pid {pid}, owner of nodes 0 and 4)");

    // For 6 s (past the dead instance's liveness TTL, 3 s, and its directory entries' TTL, 5 s):
    // every survivor in turn gets a request for m4 (no live node: must fail fast) and for m0
    // (must fail fast until node 0 has reconnected, then be served).
    let mut m4_latencies = Vec::new();
    let mut m4_statuses = std::collections::BTreeMap::<String, usize>::new();
    let mut m0_statuses = std::collections::BTreeMap::<String, usize>::new();
    let mut m0_failed = Vec::new();
    let mut m0_served = Vec::new();
    let mut recovered: Option<(usize, Duration)> = None;
    let mut first_served = std::collections::HashMap::<usize, Duration>::new();
    let window = Duration::from_secs(6);
    let mut liveness_gone = None;
    while killed_at.elapsed() < window {
        if liveness_gone.is_none()
            && cluster
                .redis
                .get(&format!("instance:{}", owner.id))
                .is_none()
        {
            liveness_gone = Some(killed_at.elapsed());
        }
        for on in 1..INSTANCES {
            let (s, body, took) = chat(cluster.gw(on), &key, &model(INSTANCES), 4).await;
            *m4_statuses
                .entry(format!("{s} {}", body["error"]["code"]))
                .or_default() += 1;
            assert_ne!(
                s, 200,
                "m4 served with its only node's instance dead: {body}"
            );
            assert!(
                body["error"]["message"].is_string(),
                "not an OpenAI-shaped error: {s} {body}"
            );
            assert!(
                took < NO_HANG,
                "request {} for m4 on instance {on}, {} after the kill, took {} (bound {}): {s} {body}",
                m4_latencies.len() + 1,
                ms(killed_at.elapsed()),
                ms(took),
                ms(NO_HANG)
            );
            if took >= FAIL_FAST || body["error"]["code"] != "no_capacity" {
                println!(
                    "  m4 on instance {on}, {} after the kill: {s} {} in {}",
                    ms(killed_at.elapsed()),
                    body["error"]["code"],
                    ms(took)
                );
            }
            m4_latencies.push(took);

            let (s, body, took) = chat(cluster.gw(on), &key, "m0", 4).await;
            *m0_statuses
                .entry(format!("{s} {}", body["error"]["code"]))
                .or_default() += 1;
            if s == 200 {
                assert_eq!(body["model"], "m0");
                m0_served.push(took);
                if recovered.is_none() {
                    recovered = Some((on, killed_at.elapsed()));
                }
                first_served.entry(on).or_insert(killed_at.elapsed());
            } else {
                assert!(
                    body["error"]["message"].is_string(),
                    "not an OpenAI-shaped error: {s} {body}"
                );
                assert!(
                    took < NO_HANG,
                    "m0 on instance {on} failed after {} (bound {}): {s} {body}",
                    ms(took),
                    ms(NO_HANG)
                );
                m0_failed.push(took);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    m4_latencies.sort_unstable();
    let m4_slow = m4_latencies.iter().filter(|&&t| t >= FAIL_FAST).count();
    println!(
        "dead owner, stranded model m4: {} requests on the 3 survivors over {:.1} s after the kill, \
         statuses {m4_statuses:?}, latency p50 {} p99 {} max {}, {m4_slow} at or over {}",
        m4_latencies.len(),
        window.as_secs_f64(),
        ms(percentile(&m4_latencies, 0.5)),
        ms(percentile(&m4_latencies, 0.99)),
        ms(m4_latencies.last().copied().unwrap_or_default()),
        ms(FAIL_FAST)
    );
    m0_failed.sort_unstable();
    m0_served.sort_unstable();
    let m0_slow = m0_failed.iter().filter(|&&t| t >= FAIL_FAST).count();
    println!(
        "dead owner, failover model m0: {m0_statuses:?}: {} failed (max {}, {m0_slow} at or over \
         {}), {} served (p50 {} max {})",
        m0_failed.len(),
        ms(m0_failed.last().copied().unwrap_or_default()),
        ms(FAIL_FAST),
        m0_served.len(),
        ms(percentile(&m0_served, 0.5)),
        ms(m0_served.last().copied().unwrap_or_default()),
    );
    let failed = m4_latencies.len() + m0_failed.len();
    assert!(
        (m4_slow + m0_slow) * 20 <= failed,
        "{} of {failed} failed requests took {} or more (want ≥ 95 % under it)",
        m4_slow + m0_slow,
        ms(FAIL_FAST)
    );
    assert!(m4_latencies.len() >= 30, "too few requests in the window");
    let (on, after) = recovered.unwrap_or_else(|| {
        panic!(
            "node 0 never served again within {window:?}; agent stderr:\n{}",
            cluster.agents[0].stderr_tail(30)
        )
    });
    println!(
        "recovery: node 0 reconnected to a survivor and was served (via instance {on}) {:.3} s \
         after the kill",
        after.as_secs_f64()
    );
    let everywhere = (1..INSTANCES)
        .map(|i| *first_served.get(&i).expect("a survivor never served m0"))
        .max()
        .unwrap_or_default();
    println!(
        "recovery: every survivor served m0 again {:.3} s after the kill",
        everywhere.as_secs_f64()
    );
    // node 0's directory entry names a survivor now: `P node:<id>` → `<instance_id> <descriptor>`
    let entry = cluster
        .redis
        .get(&format!("node:{}", cluster.nodes[0]))
        .unwrap_or_default();
    let new_owner = entry.split(' ').next().unwrap_or_default().to_owned();
    assert!(
        (1..INSTANCES).any(|i| cluster.instance(i).id == new_owner),
        "node 0's directory entry does not name a survivor: {entry:?}"
    );
    println!("node 0 is now held by {new_owner}");
    // every survivor serves every model again
    for on in cluster.alive().collect::<Vec<_>>() {
        for node in 0..INSTANCES {
            cluster.wait_served(node, on, Duration::from_secs(10)).await;
        }
    }
    // the dead instance's liveness key expired on its own (TTL 3 s, no longer refreshed)
    let gone = liveness_gone.unwrap_or_else(|| {
        panic!(
            "liveness key {}instance:{} still there {window:?} after the kill",
            cluster.redis.prefix, owner.id
        )
    });
    println!(
        "liveness key of the dead instance gone {:.2} s after the kill",
        gone.as_secs_f64()
    );
    drop(owner);
}

// --- 4 ---------------------------------------------------------------------------------------

/// 200 concurrent streams across the four instances (same- and cross-instance): each instance's
/// Redis connections (`CLIENT LIST`, by the client name it sets) are the same before, during and
/// after: one shared connection, none per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_connections_stay_constant_under_200_streams() {
    const STREAMS: usize = 200;
    let _serial = SERIAL.lock().await;
    // 40 tokens 50 ms apart: every stream lasts ~2 s, so all 200 are open together
    let cluster = Cluster::start(Options {
        completion_tokens: 40,
        itl_micros: 50_000,
        agent_concurrency: 64,
        ..Options::default()
    })
    .await;
    let ids: Vec<String> = (0..INSTANCES)
        .map(|i| cluster.instance(i).id.clone())
        .collect();
    let count = |phase: &str| -> Vec<usize> {
        let counts: Vec<usize> = ids
            .iter()
            .map(|id| cluster.redis.connections_of(id))
            .collect();
        println!("redis connections per instance {phase}: {counts:?}");
        counts
    };
    let before = count("before");
    for (i, n) in before.iter().enumerate() {
        assert_eq!(
            *n,
            1,
            "instance {i} has {n} Redis connections named …-{}; want one shared connection. \
             Client names: {:?}",
            ids[i],
            cluster.redis.client_names()
        );
    }

    let open = std::sync::Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for j in 0..STREAMS {
        let gw = cluster.gw(j % INSTANCES);
        let (public, http) = (gw.public.clone(), gw.http.clone());
        let key = cluster.api_key.clone();
        let model = model((j / INSTANCES) % INSTANCES);
        let open = open.clone();
        tasks.push(tokio::spawn(async move {
            let mut resp = http
                .post(format!("{public}/v1/chat/completions"))
                .bearer_auth(&key)
                .json(&json!({"model": model, "stream": true, "max_tokens": 40,
                              "messages": [{"role": "user", "content": "Count."}]}))
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let mut body = Vec::new();
            let mut counted = false;
            while let Ok(Some(chunk)) = resp.chunk().await {
                if !counted {
                    open.fetch_add(1, Ordering::SeqCst);
                    counted = true;
                }
                body.extend_from_slice(&chunk);
            }
            if counted {
                open.fetch_sub(1, Ordering::SeqCst);
            }
            (status, String::from_utf8_lossy(&body).into_owned())
        }));
    }
    // during: sample while the streams are open
    let mut during = Vec::new();
    let mut max_open = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let now_open = open.load(Ordering::SeqCst);
        max_open = max_open.max(now_open);
        // half of them at once: enough to show the connection count does not follow the
        // streams (three quarters was seen missed at 145 of 200 on a loaded 2-core machine)
        if now_open as usize >= STREAMS / 2 {
            during.push(count(&format!("during ({now_open} streams open)")));
            if during.len() >= 3 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut ok = 0;
    for t in tasks {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, 200, "{body}");
        let events = sse_data(&body);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
        ok += 1;
    }
    println!("streams: {ok}/{STREAMS} completed, at most {max_open} open at once");
    assert!(
        !during.is_empty(),
        "never saw {} of the {STREAMS} streams open at once (max {max_open})",
        STREAMS / 2
    );
    let after = count("after");
    for d in &during {
        assert_eq!(d, &before, "Redis connections changed during the streams");
    }
    assert_eq!(after, before, "Redis connections changed after the streams");
}

// --- 5 ---------------------------------------------------------------------------------------

/// A new API key of the cluster's account, created on instance 0 with `limits` (e.g.
/// `{"rpm_limit": 10}`); multi-instance mode keeps per-key limits in PostgreSQL, so every
/// instance applies them.
async fn limited_key(cluster: &Cluster, limits: Value) -> String {
    let (s, key) = cluster
        .gw(0)
        .admin_post(
            &format!("/admin/v1/accounts/{}/keys", cluster.account),
            limits.clone(),
        )
        .await;
    assert_eq!(s, 201, "{key}");
    for (k, v) in limits.as_object().unwrap() {
        assert_eq!(&key[k], v, "{key}");
    }
    key["key"].as_str().unwrap().to_owned()
}

/// A key's limits hold across instances: `rpm_limit = 10`, 40 requests spread over the four
/// instances within a second → 10 admitted, not 40; `tpm_limit = 300`, 60 requests of ~25
/// tokens each → the admitted ones bill about 300 tokens in all, not 1200. The rest are 429 with
/// an OpenAI-shaped error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_rate_limit_holds_across_instances() {
    const RPM: usize = 10;
    const TPM: i64 = 300;
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options::default()).await;

    // --- RPM ---
    let key = limited_key(&cluster, json!({"rpm_limit": RPM})).await;
    let started = Instant::now();
    let mut admitted = 0;
    let mut per_instance = [0usize; INSTANCES];
    let mut refused = 0;
    for j in 0..RPM * INSTANCES {
        let on = j % INSTANCES;
        let (s, body, _) = chat(cluster.gw(on), &key, &model(on), 4).await;
        match s {
            200 => {
                admitted += 1;
                per_instance[on] += 1;
            }
            429 => {
                refused += 1;
                assert!(body["error"]["message"].is_string(), "{body}");
            }
            _ => panic!("instance {on}: {s} {body}"),
        }
    }
    let took = started.elapsed();
    println!(
        "rate limit: rpm_limit {RPM}, {} requests over {INSTANCES} instances in {:.2} s → \
         {admitted} admitted (per instance {per_instance:?}), {refused} refused (429)",
        RPM * INSTANCES,
        took.as_secs_f64()
    );
    // GCRA: a burst of RPM, then one more every 60/RPM s
    let refill = (took.as_secs_f64() / (60.0 / RPM as f64)).ceil() as usize;
    assert!(
        admitted >= RPM && admitted <= RPM + refill,
        "admitted {admitted}, want {RPM} (+ at most {refill} refilled in {took:?}); {INSTANCES} \
         instances must not give {INSTANCES}× the limit"
    );

    // --- TPM ---
    let key = limited_key(&cluster, json!({"tpm_limit": TPM})).await;
    let started = Instant::now();
    let mut ids = Vec::new();
    let mut refused = 0;
    for j in 0..60 {
        let on = j % INSTANCES;
        let resp = cluster
            .gw(on)
            .api_post(
                &key,
                "/v1/chat/completions",
                &json!({"model": model(on), "max_tokens": 4,
                        "messages": [{"role": "user", "content": "Say the word the."}]}),
            )
            .await;
        let s = resp.status().as_u16();
        let id = header(&resp, "x-request-id");
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        match s {
            200 => ids.push(id.expect("x-request-id")),
            429 => {
                refused += 1;
                assert!(body["error"]["message"].is_string(), "{body}");
            }
            _ => panic!("instance {on}: {s} {body}"),
        }
    }
    let took = started.elapsed();
    let mut billed = 0;
    let mut most = 0;
    for id in &ids {
        let rec = cluster.gw(0).record(id).await;
        let tokens = rec["billed"]["prompt_tokens"].as_i64().unwrap()
            + rec["billed"]["completion_tokens"].as_i64().unwrap();
        billed += tokens;
        most = most.max(tokens);
    }
    let refill = (took.as_secs_f64() * TPM as f64 / 60.0).ceil() as i64;
    println!(
        "rate limit: tpm_limit {TPM}, 60 requests (~{most} tokens each) over {INSTANCES} \
         instances in {:.2} s → {} admitted billing {billed} tokens, {refused} refused (429)",
        took.as_secs_f64(),
        ids.len()
    );
    assert!(
        billed <= TPM + refill && billed > TPM - 2 * most - refill,
        "admitted requests billed {billed} tokens, want about {TPM} (± one request of {most}, \
         + {refill} refilled); {INSTANCES} instances must not give {INSTANCES}× the limit"
    );
}

/// Several instances, one database: a builder signs in to the console of instance 1 (a user
/// the admin API of instance 0 created), the session works on instance 2's console too, and a
/// key revoked there stops at once on instance 1 and on every other instance within
/// `key_cache_ttl_secs`, though each had it cached from a request just before. Before the
/// cache had a time to live, the other instances kept serving a revoked key until they
/// restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_revoked_in_one_instances_console_stops_on_every_instance() {
    const TTL_SECS: u64 = 2;
    const PASSWORD: &str = "a long console passphrase";
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options {
        extra: format!("key_cache_ttl_secs = {TTL_SECS}"),
        ..Options::default()
    })
    .await;
    let key = limited_key(&cluster, json!({})).await;
    for on in 0..INSTANCES {
        let (s, body, _) = chat(cluster.gw(on), &key, &model(on), 4).await;
        assert_eq!(s, 200, "instance {on}: {body}");
    }
    let (s, user) = cluster
        .gw(0)
        .admin_post(
            "/admin/v1/console/users",
            json!({"email": "dev@example.com", "account_id": cluster.account, "password": PASSWORD}),
        )
        .await;
    assert_eq!(s, 201, "{user}");
    let mut one = Session::new(&cluster.gw(1).console);
    one.sign_in("dev@example.com", PASSWORD).await;
    // the same session on another instance's console
    let mut two = Session::new(&cluster.gw(2).console);
    two.cookie = one.cookie.clone();
    let (s, page, _) = two.get("/console/keys").await;
    assert_eq!(s, 200, "{page}");
    let (s, page, _) = one.get("/console/keys").await;
    assert_eq!(s, 200, "{page}");
    let csrf = csrf_in(&page).expect("a CSRF token on the keys page");
    let hash = spine_meter::keys::hash_api_key(&key);
    let (s, body, _) = one
        .post(
            "/console/keys/revoke",
            &[("key_hash", &hash), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(s, 303, "{body}");
    let revoked = Instant::now();
    let (s, body, _) = chat(cluster.gw(1), &key, &model(1), 4).await;
    assert_eq!(s, 401, "at once on the instance that revoked it: {body}");
    // a bound a hang would take, not a timing claim: the TTL is 2 s
    let limit = Duration::from_secs(60);
    for on in 0..INSTANCES {
        loop {
            let (s, body, _) = chat(cluster.gw(on), &key, &model(on), 4).await;
            if s == 401 {
                assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
                break;
            }
            assert_eq!(s, 200, "instance {on}: {body}");
            assert!(
                revoked.elapsed() < limit,
                "instance {on} still serves a key revoked {limit:?} ago"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    println!(
        "key cache: a key revoked in instance 1's console refused on all {INSTANCES} instances \
         {:.2} s after the revocation (key_cache_ttl_secs = {TTL_SECS})",
        revoked.elapsed().as_secs_f64()
    );
    // the account's other key is not touched
    let (s, body, _) = chat(cluster.gw(3), &cluster.api_key, &model(3), 4).await;
    assert_eq!(s, 200, "{body}");

    // sign-in attempts count across instances (Redis): wrong passwords for the address spread
    // over every instance's console meet one budget of 5 a minute (one already spent on the
    // sign-in above), not 5 per instance
    let started = Instant::now();
    let mut admitted = 0;
    for j in 0..4 * INSTANCES {
        let s = Session::new(&cluster.gw(j % INSTANCES).console);
        let (status, body, _) = s
            .post(
                "/console/signin",
                &[
                    ("email", "dev@example.com"),
                    ("password", "wrong password!"),
                ],
            )
            .await;
        match status {
            429 => {}
            303 => panic!("signed in with a wrong password: {body}"),
            _ => admitted += 1,
        }
    }
    let refill = (started.elapsed().as_secs_f64() / 12.0).ceil() as usize;
    println!(
        "sign-in: {} wrong-password attempts over {INSTANCES} instances → {admitted} checked, \
         the rest 429",
        4 * INSTANCES
    );
    assert!(
        (1..=4 + refill).contains(&admitted),
        "{admitted} attempts checked (budget 5 a minute, one spent, + {refill} refilled); \
         {INSTANCES} instances must not give {INSTANCES}× the budget"
    );
}

// --- 6 ---------------------------------------------------------------------------------------

/// ~500 mixed requests through all instances (streamed and not, same- and cross-instance, some
/// cancelled mid-stream): every hold settles, Σ debits = Σ operator credits + fees, no request is
/// charged twice, and every instance reports the same balance with nothing held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_stays_exact_under_cross_instance_load() {
    const REQUESTS: usize = 500;
    const CONCURRENCY: usize = 16;
    let _serial = SERIAL.lock().await;
    // 64 tokens 2 ms apart: a cancelled stream (max_tokens 64) is cut mid-way
    let cluster = Cluster::start(Options {
        completion_tokens: 64,
        itl_micros: 2_000,
        ..Options::default()
    })
    .await;
    // the start-up's warm-up requests are settled records too
    let records_before = cluster.db.query_i64("SELECT count(*) FROM requests").await;
    let started = Instant::now();
    let next = std::sync::Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for _ in 0..CONCURRENCY {
        let next = next.clone();
        let gws: Vec<(String, reqwest::Client)> = (0..INSTANCES)
            .map(|i| (cluster.gw(i).public.clone(), cluster.gw(i).http.clone()))
            .collect();
        let key = cluster.api_key.clone();
        workers.push(tokio::spawn(async move {
            // (request id, kind, status)
            let mut seen: Vec<(String, &'static str, u16)> = Vec::new();
            loop {
                let j = next.fetch_add(1, Ordering::SeqCst) as usize;
                if j >= REQUESTS {
                    return seen;
                }
                let (public, http) = &gws[j % INSTANCES];
                let model = model((j / INSTANCES) % INSTANCES);
                let kind = match j % 5 {
                    0 | 1 => "plain",
                    2 | 3 => "stream",
                    _ => "cancel",
                };
                let body = json!({"model": model, "stream": kind != "plain",
                                  "max_tokens": if kind == "cancel" { 64 } else { 8 },
                                  "messages": [{"role": "user", "content": format!("Request {j}.")}]});
                let mut resp =
                    post_json(http, &format!("{public}/v1/chat/completions"), &key, &body).await;
                let status = resp.status().as_u16();
                let id = header(&resp, "x-request-id").unwrap_or_default();
                if kind == "cancel" {
                    // first chunk, then hang up
                    let _ = resp.chunk().await;
                    drop(resp);
                } else {
                    while let Ok(Some(_)) = resp.chunk().await {}
                }
                seen.push((id, kind, status));
            }
        }));
    }
    let mut seen = Vec::new();
    for w in workers {
        seen.extend(w.await.unwrap());
    }
    let took = started.elapsed();
    let statuses = seen.iter().fold(
        std::collections::BTreeMap::<u16, usize>::new(),
        |mut m, s| {
            *m.entry(s.2).or_default() += 1;
            m
        },
    );
    println!(
        "ledger load: {} requests over {INSTANCES} instances in {:.2} s, statuses {statuses:?}",
        seen.len(),
        took.as_secs_f64()
    );
    assert_eq!(statuses.get(&200).copied(), Some(REQUESTS), "{statuses:?}");
    let mut ids: Vec<&str> = seen.iter().map(|s| s.0.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), REQUESTS, "request ids are not distinct");

    // every hold settles (cancelled streams settle when the gateway sees the caller leave)
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let held = cluster
            .db
            .query_i64("SELECT count(*) FROM holds WHERE state = 'held'")
            .await;
        if held == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{held} holds still active 30 s after the load"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let db = &cluster.db;
    // every hold was placed by one of the four instances, and each of them placed some
    let placed = db
        .query(
            "SELECT string_agg(instance_id || ':' || n, ' ' ORDER BY instance_id) FROM \
             (SELECT COALESCE(instance_id, '-') AS instance_id, count(*) AS n FROM holds \
              GROUP BY 1) h",
        )
        .await;
    println!("ledger: holds placed per instance: {placed}");
    for i in 0..INSTANCES {
        assert!(
            placed.contains(&format!("{}:", cluster.instance(i).id)),
            "no hold placed by instance {i}: {placed}"
        );
    }
    assert!(
        !placed.contains("-:"),
        "a hold without its instance: {placed}"
    );
    let records = db.query_i64("SELECT count(*) FROM requests").await;
    assert_eq!(
        records - records_before,
        REQUESTS as i64,
        "one settled record per request"
    );
    let in_ids = ids
        .iter()
        .map(|id| format!("'{}'", id.replace('\'', "''")))
        .collect::<Vec<_>>()
        .join(",");
    assert_eq!(
        db.query_i64(&format!(
            "SELECT count(*) FROM requests WHERE request_id IN ({in_ids})"
        ))
        .await,
        REQUESTS as i64,
        "a request the callers saw has no record"
    );
    let debits = db
        .query_i64("SELECT COALESCE(SUM(debit_micros), 0) FROM requests")
        .await;
    let credits = db
        .query_i64("SELECT COALESCE(SUM(operator_credit_micros), 0) FROM requests")
        .await;
    let fees = db
        .query_i64("SELECT COALESCE(SUM(fee_micros), 0) FROM requests")
        .await;
    println!(
        "ledger: Σ debits {debits} µ = Σ operator credits {credits} µ + Σ fees {fees} µ \
         ({} records, {} charged)",
        records,
        db.query_i64("SELECT count(*) FROM requests WHERE debit_micros > 0")
            .await
    );
    assert!(debits > 0, "nothing was charged");
    assert_eq!(debits, credits + fees);
    // double entry: the request entries sum to zero, one account debit per request at most
    assert_eq!(
        db.query_i64(
            "SELECT COALESCE(SUM(amount_micros), 0) FROM ledger_entries WHERE ref LIKE 'request:%'"
        )
        .await,
        0
    );
    assert_eq!(
        db.query_i64(
            "SELECT count(*) FROM (SELECT ref FROM ledger_entries WHERE party_kind = 'account' \
             AND ref LIKE 'request:%' GROUP BY ref HAVING count(*) > 1) AS twice"
        )
        .await,
        0,
        "a request was charged twice"
    );
    assert_eq!(
        db.query_i64(
            "SELECT -COALESCE(SUM(amount_micros), 0) FROM ledger_entries WHERE party_kind = 'account' \
             AND ref LIKE 'request:%'"
        )
        .await,
        debits,
        "ledger entries and request records disagree"
    );
    assert_eq!(
        db.query_i64("SELECT COALESCE(SUM(amount_micros), 0) FROM ledger_entries")
            .await,
        0,
        "the books do not balance"
    );
    assert_eq!(
        db.query_i64("SELECT COALESCE(SUM(held_micros), 0) FROM accounts")
            .await,
        0
    );
    // every instance's admin API says the same
    let expect_balance = CREDITS - u64::try_from(debits).unwrap();
    for i in 0..INSTANCES {
        assert_eq!(
            cluster.gw(i).balance(&cluster.account).await,
            (expect_balance, 0),
            "instance {i}'s view of the account"
        );
        assert_eq!(
            cluster.gw(i).earned(&cluster.operator).await,
            u64::try_from(credits).unwrap(),
            "instance {i}'s view of the operator"
        );
    }
    // cancelled streams are settled too, and none is charged more than a full answer
    let by_kind = |kind: &str| -> Vec<&str> {
        seen.iter()
            .filter(|s| s.1 == kind)
            .map(|s| s.0.as_str())
            .collect()
    };
    for (kind, max_tokens) in [("plain", 8), ("stream", 8), ("cancel", 64)] {
        let ids = by_kind(kind);
        let in_ids = ids
            .iter()
            .map(|id| format!("'{id}'"))
            .collect::<Vec<_>>()
            .join(",");
        let outcomes = cluster
            .db
            .query(&format!(
                "SELECT string_agg(outcome || ':' || n, ' ') FROM (SELECT outcome, count(*) AS n \
                 FROM requests WHERE request_id IN ({in_ids}) GROUP BY outcome ORDER BY outcome) o"
            ))
            .await;
        let most = cluster
            .db
            .query_i64(&format!(
                "SELECT max(billed_completion_tokens) FROM requests WHERE request_id IN ({in_ids})"
            ))
            .await;
        println!(
            "ledger: {kind}: {} requests, outcomes {outcomes}, most completion tokens billed {most}",
            ids.len()
        );
        assert!(
            most <= max_tokens,
            "a {kind} request billed {most} completion tokens, max_tokens {max_tokens}"
        );
        if kind != "cancel" {
            assert_eq!(outcomes, format!("completed:{}", ids.len()));
        }
    }
}

// --- 7 ---------------------------------------------------------------------------------------

/// The cross-instance hop, measured: the same non-streamed request (4 tokens) sent alternately to
/// the node's owner (same-instance) and to another instance (cross-instance), sequentially, 1000
/// of each after a warm-up; prints p50/p99 of both and the difference (goal ≤ +0.5 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, ~30 s: cargo test -p reference-gateway --test e2e_cluster -- --ignored --nocapture cross_instance_hop_overhead"]
async fn cross_instance_hop_overhead() {
    const N: usize = 1000;
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options::default()).await;
    let key = cluster.api_key.clone();
    let (same, cross) = (cluster.gw(0), cluster.gw(1));
    for _ in 0..100 {
        assert_eq!(chat(same, &key, "m0", 4).await.0, 200);
        assert_eq!(chat(cross, &key, "m0", 4).await.0, 200);
    }
    let mut same_lat = Vec::with_capacity(N);
    let mut cross_lat = Vec::with_capacity(N);
    for _ in 0..N {
        let (s, body, took) = chat(same, &key, "m0", 4).await;
        assert_eq!(s, 200, "{body}");
        same_lat.push(took);
        let (s, body, took) = chat(cross, &key, "m0", 4).await;
        assert_eq!(s, 200, "{body}");
        cross_lat.push(took);
    }
    same_lat.sort_unstable();
    cross_lat.sort_unstable();
    let (s50, s99) = (percentile(&same_lat, 0.5), percentile(&same_lat, 0.99));
    let (c50, c99) = (percentile(&cross_lat, 0.5), percentile(&cross_lat, 0.99));
    let diff = |a: Duration, b: Duration| (a.as_secs_f64() - b.as_secs_f64()) * 1000.0;
    println!("| path | p50 | p99 |");
    println!("|---|---|---|");
    println!("| same-instance (owner) | {} | {} |", ms(s50), ms(s99));
    println!("| cross-instance (forwarded) | {} | {} |", ms(c50), ms(c99));
    println!(
        "| hop overhead | {:+.2} ms | {:+.2} ms |",
        diff(c50, s50),
        diff(c99, s99)
    );
    println!("({N} requests per path, alternating, sequential; goal ≤ +0.5 ms at p50)");
}

/// Sends SIGCONT to a stopped process when dropped (also when the test panics).
struct Thaw(u32);

impl Drop for Thaw {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

/// An owner that stops answering without closing its sockets (SIGSTOP here; a machine crash or
/// a partition in production): the internal hop's HTTP/2 PINGs (1 s, answered within 3 s) fail
/// its connections, so a stream already forwarded through it ends with an error event, and a
/// non-streamed request forwarded while its liveness key still lives fails over, both within
/// a few seconds instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_owner_fails_forwarded_requests_within_seconds() {
    use futures_util::StreamExt as _;
    /// Acceptance bound: PING interval + timeout (4 s) with room for a loaded machine.
    const WITHIN: Duration = Duration::from_secs(10);
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options {
        completion_tokens: 400,
        itl_micros: 25_000,
        ..Options::default()
    })
    .await;
    let key = cluster.api_key.clone();
    let gw1 = cluster.gw(1);
    let resp = gw1
        .http
        .post(format!("{}/v1/chat/completions", gw1.public))
        .bearer_auth(&key)
        .json(
            &json!({"model": model(0), "stream": true, "max_tokens": 400,
                      "messages": [{"role": "user", "content": "Say the word the."}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let first = body.next().await;
    assert!(matches!(first, Some(Ok(_))), "{first:?}");
    let pid = cluster.gw(0).child.id().unwrap();
    let stop = std::process::Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .unwrap();
    assert!(stop.success());
    let thaw = Thaw(pid);
    let frozen_at = Instant::now();
    println!("SIGSTOP instance 0 (pid {pid}, owner of node 0) mid-stream");

    // a non-streamed request for m0 through instance 2 while the liveness key still lives
    let gw2_public = cluster.gw(2).public.clone();
    let key2 = key.clone();
    let nonstream = tokio::spawn(async move {
        let started = Instant::now();
        let r = reqwest::Client::new()
            .post(format!("{gw2_public}/v1/chat/completions"))
            .bearer_auth(&key2)
            .timeout(Duration::from_secs(20))
            .json(&json!({"model": "m0", "max_tokens": 4,
                          "messages": [{"role": "user", "content": "Say the word the."}]}))
            .send()
            .await;
        let outcome = match r {
            Ok(resp) => Ok((
                resp.status().as_u16(),
                resp.text().await.unwrap_or_default(),
            )),
            Err(e) => Err(format!("client error (timeout: {}): {e}", e.is_timeout())),
        };
        (started.elapsed(), outcome)
    });

    let mut after = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(c) = body.next().await {
            match c {
                Ok(b) => after.extend_from_slice(&b),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    })
    .await;
    let stream_wait = frozen_at.elapsed();
    let (ns_wait, ns_outcome) = nonstream.await.unwrap();
    drop(thaw);
    let after = String::from_utf8_lossy(&after);
    println!(
        "forwarded stream after the freeze: {} bytes, ended {ended:?} after {}",
        after.len(),
        ms(stream_wait)
    );
    println!(
        "non-streamed forwarded request during the freeze: {ns_outcome:?} after {}",
        ms(ns_wait)
    );
    assert!(
        ended.is_ok() && stream_wait < WITHIN,
        "the forwarded stream hung for {stream_wait:?} after its owner froze"
    );
    assert_eq!(ended, Ok(Ok(())), "the caller's stream ends cleanly");
    assert!(
        after.contains("\"code\":\"upstream_failed\"") && !after.contains("[DONE]"),
        "the stream ends with an error event: …{}",
        &after[after.len().saturating_sub(300)..]
    );
    assert!(
        ns_wait < WITHIN,
        "a non-streamed forwarded request hung for {ns_wait:?}: {ns_outcome:?}"
    );
    // node 0 is the only node serving m0 and its owner is frozen: an OpenAI-shaped error
    let (status, text) = ns_outcome.unwrap();
    assert!(status >= 500, "{status} {text}");
    let e: Value = serde_json::from_str(&text).unwrap();
    assert!(e["error"]["message"].is_string(), "{text}");
}

/// Every request one instance forwards to one owner shares one HTTP/2 connection; the owner's
/// internal listener allows 4,096 concurrent streams on it (hyper's default was 200: the 201st
/// forwarded request waited for another to end). 240 concurrent 6 s streams to node 0, first
/// on its own instance, then forwarded from another: the forwarded TTFB stays close to the
/// local one (queueing would add a whole stream, ≥ 6 s, to the slowest 40).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_200_forwarded_streams_to_one_owner_do_not_queue() {
    /// Over hyper's default 200, under the tunnel's per-node limit (256).
    const STREAMS: usize = 240;
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options {
        completion_tokens: 60,
        itl_micros: 100_000,
        agent_concurrency: 1000,
        ..Options::default()
    })
    .await;
    let key = cluster.api_key.clone();
    let mut max_ttfb = Vec::new();
    for on in [0usize, 1] {
        let public = cluster.gw(on).public.clone();
        let client = reqwest::Client::new();
        let started = Instant::now();
        let tasks: Vec<_> = (0..STREAMS)
            .map(|_| {
                let (client, public, key) = (client.clone(), public.clone(), key.clone());
                tokio::spawn(async move {
                    let t0 = Instant::now();
                    let mut resp = client
                        .post(format!("{public}/v1/chat/completions"))
                        .bearer_auth(&key)
                        .timeout(Duration::from_secs(60))
                        .json(&json!({"model": "m0", "stream": true, "max_tokens": 60,
                                      "messages": [{"role": "user", "content": "Say the word the."}]}))
                        .send()
                        .await
                        .map_err(|e| e.to_string())?;
                    let status = resp.status().as_u16();
                    let first = resp.chunk().await;
                    let ttfb = t0.elapsed();
                    if status != 200 {
                        return Err(format!("{status} {first:?}"));
                    }
                    while let Ok(Some(_)) = resp.chunk().await {}
                    Ok::<_, String>((status, ttfb))
                })
            })
            .collect();
        let mut ttfbs = Vec::new();
        let mut errors = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                Ok((200, d)) => ttfbs.push(d),
                Ok((s, _)) => errors.push(format!("status {s}")),
                Err(e) => errors.push(e),
            }
        }
        ttfbs.sort();
        let max = *ttfbs.last().unwrap_or(&Duration::ZERO);
        println!(
            "{STREAMS} streams for m0 (node 0, tunnel on instance 0) through instance {on}: ok {}, errors {:?}, TTFB p50 {} p90 {} max {} (all done in {:?})",
            ttfbs.len(),
            errors.iter().take(3).collect::<Vec<_>>(),
            ms(percentile(&ttfbs, 0.5)),
            ms(percentile(&ttfbs, 0.9)),
            ms(max),
            started.elapsed()
        );
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(ttfbs.len(), STREAMS);
        max_ttfb.push(max);
    }
    let (local, forwarded) = (max_ttfb[0], max_ttfb[1]);
    assert!(
        forwarded < local + Duration::from_secs(3),
        "forwarded streams queued: max TTFB {} forwarded vs {} local",
        ms(forwarded),
        ms(local)
    );
}
