//! Trust rung 1 end to end (issue 19, design brief §10): a real gateway auditing against a real
//! reference llama-server, two real agents on real llama.cpp — one honest, one serving the
//! model's weights requantized to Q2_K under the name `smollm2`. The substitute is `failed` and
//! gets no more traffic, the honest node is `passing`, and no caller ever sees an error.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{add_node, metric, tenant, Gateway, LedgerDb, Tenant};
use serde_json::{json, Value};
use spine_test_support::{Child, Engine, LlamaServer};

const TOPICS: &[&str] = &[
    "a lighthouse keeper",
    "the history of bread",
    "why the sky is blue",
    "a robot learning to paint",
    "how volcanoes form",
    "a cat who runs a bakery",
    "the water cycle",
    "a journey to the moon",
    "why leaves change colour",
    "a friendly dragon",
    "how bees make honey",
    "the first day of school",
];

/// One chat through the public API; panics on anything but a complete answer.
async fn chat(gw: &Gateway, key: &str, i: usize, stream: bool) {
    let topic = TOPICS[i % TOPICS.len()];
    let body = json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": format!("Write a few sentences about {topic}. ({i})")}],
        "max_tokens": 64,
        "temperature": 0,
        "stream": stream,
    });
    let r = gw.api_post(key, "/v1/chat/completions", &body).await;
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    assert_eq!(status, 200, "request {i}: {text}");
    if stream {
        assert!(text.contains("data: [DONE]"), "request {i}: {text}");
        assert!(!text.contains("\"error\""), "request {i}: {text}");
    } else {
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(
            v["choices"][0]["finish_reason"].is_string(),
            "request {i}: {text}"
        );
    }
}

fn audit_of(nodes: &Value, node_id: &str) -> Option<Value> {
    nodes["data"]
        .as_array()?
        .iter()
        .find(|n| n["node_id"] == node_id)
        .and_then(|n| n["audit"].as_array()?.first().cloned())
}

fn attempts_of(nodes: &Value, node_id: &str) -> u64 {
    nodes["data"]
        .as_array()
        .and_then(|a| a.iter().find(|n| n["node_id"] == node_id))
        .map_or(0, |n| n["attempts"].as_u64().unwrap_or(0))
}

/// A gateway auditing every completed request against a real reference llama-server, in front
/// of two real agents of one operator on real llama.cpp: one honest, one serving the model's
/// weights requantized to Q2_K under the same name.
struct SubstituteRig {
    // dropped in this order: the agents, the gateway, its directory, the engines
    _agents: [Child; 2],
    gw: Gateway,
    operator: String,
    api_key: String,
    honest_id: String,
    sub_id: String,
    dir: tempfile::TempDir,
    _engines: [LlamaServer; 3],
}

impl SubstituteRig {
    /// Starts it with `audit_extra` added to the gateway's `[audit]` table.
    async fn start(audit_extra: &str) -> Self {
        let engine = Engine::discover().unwrap();
        let substitute_gguf = engine.substitute_gguf().unwrap();
        let reference = LlamaServer::start(&engine, 1).await.unwrap();
        let honest = LlamaServer::start(&engine, 2).await.unwrap();
        let substitute = LlamaServer::start_model(&engine, &substitute_gguf, 2, &[])
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let gw = Gateway::start_full(
            dir.path(),
            &engine,
            // every completed request audited, so that a test needs few requests
            &format!(
                "[audit]\nrate_passing = 1.0\nrate_unverified = 1.0\nrate_suspect = 1.0\n{audit_extra}"
            ),
            &format!("reference_url = \"{}\"", reference.url),
        )
        .await;
        let Tenant {
            operator, api_key, ..
        } = tenant(&gw).await;
        let (honest_id, honest_agent) =
            add_node(&gw, dir.path(), &operator, &honest.url, "honest").await;
        let (sub_id, sub_agent) =
            add_node(&gw, dir.path(), &operator, &substitute.url, "substitute").await;
        Self {
            _agents: [honest_agent, sub_agent],
            gw,
            operator,
            api_key,
            honest_id,
            sub_id,
            dir,
            _engines: [reference, honest, substitute],
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_substitute_model_is_failed_and_unrouted_while_the_honest_node_passes() {
    // the text statistic (node logprobs, the default, are the test below)
    let rig = SubstituteRig::start("node_logprobs = false\n").await;
    let SubstituteRig {
        gw,
        operator,
        api_key,
        honest_id,
        sub_id,
        dir,
        ..
    } = &rig;

    // traffic until the substitute fails (every answer must be complete: audits never touch
    // the caller's response)
    let started = Instant::now();
    let mut i = 0;
    let failed_at_attempts = loop {
        chat(gw, api_key, i, i % 2 == 0).await;
        i += 1;
        let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
        if audit_of(&nodes, sub_id).is_some_and(|a| a["verdict"] == "failed") {
            // the router records an attempt when the answer's body is dropped, a moment after
            // the caller's last byte: read the count once the last request's is in
            tokio::time::sleep(Duration::from_secs(2)).await;
            let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
            break attempts_of(&nodes, sub_id);
        }
        assert!(
            started.elapsed() < Duration::from_secs(900),
            "the substitute was not failed after {i} requests; nodes: {nodes:#}\ngateway:\n{}",
            gw.child.stderr_tail(40)
        );
    };
    let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
    let sub = audit_of(&nodes, sub_id).unwrap();
    println!("substitute failed after {i} requests: {sub}");
    assert!(sub["statistic"].as_f64().unwrap() >= sub["fail_threshold"].as_f64().unwrap());
    assert!(sub["events"].as_u64().unwrap() > 0);

    // from now on every request goes to the honest node, and every one succeeds
    for j in 0..8 {
        chat(gw, api_key, i + j, j % 2 == 0).await;
    }
    let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
    assert_eq!(
        attempts_of(&nodes, sub_id),
        failed_at_attempts,
        "the failed node was routed again: {nodes:#}"
    );
    // the honest node: audited, never accused
    let deadline = Instant::now() + Duration::from_secs(900);
    let honest_audit = loop {
        let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
        let a = audit_of(&nodes, honest_id).expect("the honest node was audited");
        if a["verdict"] == "passing" || Instant::now() > deadline {
            break a;
        }
        chat(gw, api_key, i, false).await;
        i += 1;
    };
    println!("honest node: {honest_audit}");
    assert_eq!(honest_audit["verdict"], "passing", "{honest_audit}");
    assert_eq!(honest_audit["events"], 0, "{honest_audit}");

    // the verdict is in /metrics and the agent-facing node view
    let m = gw.metrics().await;
    let series =
        format!("spine_audit_verdict{{node=\"{sub_id}\",model=\"smollm2\",verdict=\"failed\"}}");
    assert_eq!(metric(&m, &series), 1.0, "{m}");
    assert!(
        metric(&m, "spine_audit_requests_total{result=\"audited\"}") >= 2.0,
        "{m}"
    );
    let (_, op) = gw
        .admin_get(&format!("/admin/v1/operators/{operator}"))
        .await;
    let sub_view = op["nodes"]
        .as_array()
        .and_then(|a| a.iter().find(|n| n["node_id"] == sub_id.as_str()))
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(sub_view["audit"][0]["verdict"], "failed", "{op:#}");

    // the books: earnings served while suspect were escrowed, then forfeited at `failed`;
    // the operator earned exactly the credits paid; the entries sum to zero
    let ledger = LedgerDb::open(dir.path(), None).await;
    let still_held = ledger
        .int_once(
            "SELECT COUNT(*) FROM requests WHERE earnings = 'held'",
            0,
            300,
            Duration::from_millis(100),
        )
        .await;
    assert_eq!(still_held, 0, "escrow left after the verdicts");
    let forfeited = ledger
        .int(&format!(
            "SELECT COUNT(*) FROM requests WHERE earnings = 'forfeited' AND node_id <> '{sub_id}'"
        ))
        .await;
    assert_eq!(forfeited, 0, "only the failed node forfeits");
    // the last answer's settlement lands a moment after the caller's last byte: compare the
    // operator's balance with the paid rows once the books are still (a real gap never closes)
    let paid_sql = "SELECT CAST(COALESCE(SUM(operator_credit_micros), 0) AS BIGINT) FROM requests WHERE earnings IS NULL OR earnings = 'paid'";
    let (mut paid, mut earned) = (-1, -2);
    for _ in 0..300 {
        paid = ledger.int(paid_sql).await;
        earned = gw.earned(operator).await as i64;
        if earned == paid && ledger.int(paid_sql).await == paid {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        earned, paid,
        "the operator's balance is not the sum of its paid requests"
    );
    let entries = ledger
        .int("SELECT CAST(COALESCE(SUM(amount_micros), 0) AS BIGINT) FROM ledger_entries")
        .await;
    assert_eq!(entries, 0);

    // the operator fixes the weights and asks for re-verification: routable again, unverified
    let (s, r) = gw
        .admin_post(
            &format!("/admin/v1/nodes/{sub_id}/reverify"),
            json!({"model": "smollm2"}),
        )
        .await;
    assert_eq!(
        (s, r["reverified_models"].clone()),
        (200, json!(["smollm2"]))
    );
    let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
    assert!(audit_of(&nodes, sub_id).is_none(), "{nodes:#}");
}

/// Creates the platform's challenge account `acct_challenges` with 1,000,000 µ of credit.
async fn fund_challenge_account(gw: &Gateway) {
    let (s, _) = gw
        .admin_post("/admin/v1/accounts", json!({"id": "acct_challenges"}))
        .await;
    assert_eq!(s, 201);
    let (s, _) = gw
        .admin_post(
            "/admin/v1/accounts/acct_challenges/credits",
            json!({"amount_micros": 1_000_000, "idempotency_key": "challenges-1"}),
        )
        .await;
    assert_eq!(s, 200);
}

/// Waits (at most 900 s, a hang's bound) until challenges alone make `node_id` `passing`, and
/// returns its audit view; panics if it is `failed` first.
async fn passing_on_challenges(gw: &Gateway, node_id: &str) -> Value {
    let started = Instant::now();
    loop {
        let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
        if let Some(a) = audit_of(&nodes, node_id) {
            if a["verdict"] == "passing" {
                return a;
            }
            assert_ne!(a["verdict"], "failed", "{a}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(900),
            "challenges never made the node pass; nodes: {nodes:#}\ngateway:\n{}",
            gw.child.stderr_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A node with no traffic is challenged (design brief §10): plausible chats on the normal path,
/// billed to the platform's challenge account, audited every time; the node's model passes
/// without a single caller request, and its operator is paid for the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_node_is_challenged_billed_to_the_platform_and_passes() {
    let engine = Engine::discover().unwrap();
    let reference = LlamaServer::start(&engine, 1).await.unwrap();
    let honest = LlamaServer::start(&engine, 2).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start_full(
        dir.path(),
        &engine,
        "[audit]\nchallenge_account = \"acct_challenges\"\nchallenge_interval_secs = 1\n",
        &format!("reference_url = \"{}\"", reference.url),
    )
    .await;
    fund_challenge_account(&gw).await;
    let Tenant { operator, .. } = tenant(&gw).await;
    let (node_id, _agent) = add_node(&gw, dir.path(), &operator, &honest.url, "idle").await;

    let audit = passing_on_challenges(&gw, &node_id).await;
    println!("idle node after challenges: {audit}");
    assert!(audit["audits"].as_u64().unwrap() >= 1, "{audit}");
    let m = gw.metrics().await;
    assert!(
        metric(&m, "spine_audit_challenges_total{result=\"answered\"}") >= 1.0,
        "{m}"
    );
    // billed to the challenge account; the node's operator is paid for the work
    let (balance, _) = gw.balance("acct_challenges").await;
    assert!(balance < 1_000_000, "challenges were not billed: {balance}");
    assert!(gw.earned(&operator).await > 0);
}

/// A node that tells challenges from its callers' requests and serves the real model only to
/// challenges: an HTTP proxy in front of two llama-servers. It is given a perfect oracle — the
/// test's callers' prompts end in `"(<n>)"`, which no challenge does — the strongest form of
/// the cheat (design brief §10: challenges only add coverage; audits of real traffic, chosen
/// after the fact, catch it).
struct ChallengeAwareNode {
    url: String,
    /// Chat requests sent to the real model (the ones that looked like challenges).
    to_model: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Chat requests sent to the substitute (the callers').
    to_substitute: std::sync::Arc<std::sync::atomic::AtomicU64>,
    _server: tokio::task::JoinHandle<()>,
}

impl ChallengeAwareNode {
    async fn start(model_url: String, substitute_url: String) -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::Arc;
        let client = reqwest::Client::new();
        let (to_model, to_substitute) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let counts = (Arc::clone(&to_model), Arc::clone(&to_substitute));
        let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
            let (client, model_url, substitute_url) =
                (client.clone(), model_url.clone(), substitute_url.clone());
            let (to_model, to_substitute) = (Arc::clone(&counts.0), Arc::clone(&counts.1));
            async move {
                let (parts, body) = req.into_parts();
                let bytes = axum::body::to_bytes(body, 1 << 20)
                    .await
                    .unwrap_or_default();
                let content = serde_json::from_slice::<Value>(&bytes)
                    .ok()
                    .and_then(|v| v["messages"][0]["content"].as_str().map(str::to_owned));
                let base = match content {
                    Some(c) if c.ends_with(')') && c.contains(". (") => {
                        to_substitute.fetch_add(1, Ordering::Relaxed);
                        substitute_url
                    }
                    Some(_) => {
                        to_model.fetch_add(1, Ordering::Relaxed);
                        model_url
                    }
                    None => model_url,
                };
                let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                let mut upstream = client.request(parts.method, format!("{base}{path}"));
                if let Some(ct) = parts.headers.get(http::header::CONTENT_TYPE) {
                    upstream = upstream.header(http::header::CONTENT_TYPE, ct);
                }
                let Ok(resp) = upstream.body(bytes).send().await else {
                    return http::Response::builder()
                        .status(502)
                        .body(axum::body::Body::empty())
                        .unwrap();
                };
                let mut answer = http::Response::builder().status(resp.status());
                if let Some(ct) = resp.headers().get(http::header::CONTENT_TYPE) {
                    answer = answer.header(http::header::CONTENT_TYPE, ct);
                }
                answer
                    .body(axum::body::Body::from_stream(resp.bytes_stream()))
                    .unwrap()
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            url,
            to_model,
            to_substitute,
            _server: server,
        }
    }
}

/// The fifth substitute: a node that serves the right model only to requests that look
/// like challenges (here it knows them perfectly) and Q2_K to its callers. Challenges alone
/// make it `passing`; the audits of its callers' traffic then fail it, and no caller sees an
/// error on the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_serves_the_model_only_to_challenges_is_failed_by_audits_of_its_traffic() {
    let engine = Engine::discover().unwrap();
    let substitute_gguf = engine.substitute_gguf().unwrap();
    let reference = LlamaServer::start(&engine, 1).await.unwrap();
    let model = LlamaServer::start(&engine, 2).await.unwrap();
    let substitute = LlamaServer::start_model(&engine, &substitute_gguf, 2, &[])
        .await
        .unwrap();
    let node = ChallengeAwareNode::start(model.url.clone(), substitute.url.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start_full(
        dir.path(),
        &engine,
        "[audit]\nrate_passing = 1.0\nrate_unverified = 1.0\nrate_suspect = 1.0\n\
         challenge_account = \"acct_challenges\"\nchallenge_interval_secs = 1\n",
        &format!("reference_url = \"{}\"", reference.url),
    )
    .await;
    fund_challenge_account(&gw).await;
    let Tenant {
        operator, api_key, ..
    } = tenant(&gw).await;
    let (node_id, _agent) = add_node(&gw, dir.path(), &operator, &node.url, "cheat").await;

    // no caller yet: challenges only, every one answered by the real model
    let started = Instant::now();
    let on_challenges = passing_on_challenges(&gw, &node_id).await;
    use std::sync::atomic::Ordering;
    let challenged = node.to_model.load(Ordering::Relaxed);
    println!("after challenges only ({challenged} answered by the model): {on_challenges}");
    assert!(challenged >= 1);
    assert_eq!(node.to_substitute.load(Ordering::Relaxed), 0);

    // callers now: their requests get Q2_K, and their audits fail the node
    let mut i = 0;
    let failed = loop {
        chat(&gw, &api_key, i, i % 2 == 0).await;
        i += 1;
        let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
        let a = audit_of(&nodes, &node_id).unwrap();
        if a["verdict"] == "failed" {
            break a;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1800),
            "the node was not failed after {i} caller requests: {a}\ngateway:\n{}",
            gw.child.stderr_tail(40)
        );
    };
    println!(
        "failed after {i} caller requests ({} sent to Q2_K, {} to the model in all): {failed}",
        node.to_substitute.load(Ordering::Relaxed),
        node.to_model.load(Ordering::Relaxed)
    );
    assert!(node.to_substitute.load(Ordering::Relaxed) >= 1);
    assert!(failed["statistic"].as_f64().unwrap() >= failed["fail_threshold"].as_f64().unwrap());
    let m = gw.metrics().await;
    assert!(
        metric(&m, "spine_audit_challenges_total{result=\"answered\"}") >= 1.0,
        "{m}"
    );
}

fn pin_to_core(pid: u32, core: u32) {
    let ok = std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", &core.to_string(), &pid.to_string()])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(ok, "taskset failed for pid {pid}");
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// The caller's latency with auditing on (every request audited, the worst case) vs off, in
/// one run (issue 19; `docs/trust.md`): two gateways, each with its own agent, in front of one
/// llama-server pinned to core 0; the reference pinned to core 1; requests alternate between
/// the two gateways. Prints p50 / p90 per side and the ratio.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: cargo test --workspace --test e2e_trust -- --ignored --nocapture audit_latency"]
async fn audit_latency_bench() {
    let engine = Engine::discover().unwrap();
    let node = LlamaServer::start_with_args(&engine, 2, &["-t", "1"])
        .await
        .unwrap();
    let reference = LlamaServer::start_with_args(&engine, 1, &["-t", "1"])
        .await
        .unwrap();
    pin_to_core(node.child.id().unwrap(), 0);
    pin_to_core(reference.child.id().unwrap(), 1);
    let dir_on = tempfile::tempdir().unwrap();
    let dir_off = tempfile::tempdir().unwrap();
    let on = Gateway::start_full(
        dir_on.path(),
        &engine,
        "[audit]\nrate_passing = 1.0\nrate_unverified = 1.0\nrate_suspect = 1.0\n",
        &format!("reference_url = \"{}\"", reference.url),
    )
    .await;
    let off = Gateway::start(dir_off.path(), &engine).await;
    let t_on = tenant(&on).await;
    let t_off = tenant(&off).await;
    let (_n1, _a1) = add_node(&on, dir_on.path(), &t_on.operator, &node.url, "on").await;
    let (_n2, _a2) = add_node(&off, dir_off.path(), &t_off.operator, &node.url, "off").await;
    let rounds = std::env::var("SPINE_AUDIT_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40usize);
    let (mut lat_on, mut lat_off) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        // both sides send round `i`'s prompt to the one node, and the second finds it in the
        // node's prompt cache: which side goes first alternates, or that side pays every
        // prompt's evaluation (measured: on/off 1.146 at p50 with "on" always first)
        let mut sides = [
            (&on, &t_on.api_key, &mut lat_on),
            (&off, &t_off.api_key, &mut lat_off),
        ];
        if i % 2 == 1 {
            sides.reverse();
        }
        for (gw, key, lat) in sides {
            let t = Instant::now();
            chat(gw, key, i, (i / 2) % 2 == 0).await;
            lat.push(t.elapsed().as_secs_f64() * 1000.0);
        }
    }
    lat_on.sort_by(f64::total_cmp);
    lat_off.sort_by(f64::total_cmp);
    let (_, nodes) = on.admin_get("/admin/v1/nodes").await;
    println!("audits on the 'on' gateway: {}", nodes["data"][0]["audit"]);
    for p in [0.5, 0.9] {
        let (a, b) = (percentile(&lat_on, p), percentile(&lat_off, p));
        println!(
            "p{:.0}: audit on {a:.1} ms, off {b:.1} ms, on/off {:.3}",
            p * 100.0,
            a / b
        );
    }
}

/// A reference that is down never fails a node and never blocks traffic (issue 19): every
/// caller is answered, each audit is inconclusive (counted, in the node's view and in
/// `/metrics`), and the node stays `unverified` and routed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_that_is_down_blocks_nothing_and_fails_no_one() {
    let engine = Engine::discover().unwrap();
    let honest = LlamaServer::start(&engine, 2).await.unwrap();
    let dead = format!(
        "http://127.0.0.1:{}",
        spine_test_support::free_port().unwrap()
    );
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start_full(
        dir.path(),
        &engine,
        "[audit]\nrate_passing = 1.0\nrate_unverified = 1.0\nrate_suspect = 1.0\n",
        &format!("reference_url = \"{dead}\""),
    )
    .await;
    let Tenant {
        operator, api_key, ..
    } = tenant(&gw).await;
    let (node_id, _agent) = add_node(&gw, dir.path(), &operator, &honest.url, "node").await;
    for i in 0..4 {
        chat(&gw, &api_key, i, i % 2 == 0).await;
    }
    let started = Instant::now();
    let audit = loop {
        let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
        if let Some(a) = audit_of(&nodes, &node_id) {
            if a["inconclusive"].as_u64() >= Some(4) {
                break a;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "audits never ended: {nodes:#}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(audit["verdict"], "unverified", "{audit}");
    assert_eq!(audit["tokens_audited"], 0, "{audit}");
    let m = gw.metrics().await;
    assert!(
        metric(&m, "spine_audit_requests_total{result=\"inconclusive\"}") >= 4.0,
        "{m}"
    );
    // still routed
    chat(&gw, &api_key, 9, false).await;
}

/// One sampled chat (temperature 0.8, a seed per request); returns the caller's body. Panics
/// on anything but a complete answer, or on logprobs the caller did not ask for.
async fn sampled_chat(gw: &Gateway, key: &str, i: usize, stream: bool) -> String {
    sampled_chat_with(gw, key, i, stream, None).await
}

/// [`sampled_chat`] with `stop` strings when given.
async fn sampled_chat_with(
    gw: &Gateway,
    key: &str,
    i: usize,
    stream: bool,
    stop: Option<Value>,
) -> String {
    let topic = TOPICS[i % TOPICS.len()];
    let mut body = json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": format!("Write a few sentences about {topic}. ({i})")}],
        "max_tokens": 64,
        "temperature": 0.8,
        "seed": i,
        "stream": stream,
    });
    if let Some(stop) = stop {
        body["stop"] = stop;
    }
    let r = gw.api_post(key, "/v1/chat/completions", &body).await;
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    assert_eq!(status, 200, "request {i}: {text}");
    assert!(!text.contains("logprobs"), "request {i}: {text}");
    if stream {
        assert!(text.contains("data: [DONE]"), "request {i}: {text}");
        assert!(!text.contains("\"error\""), "request {i}: {text}");
    }
    text
}

/// Node logprobs (`[audit] node_logprobs`, the default; `docs/trust.md`): on sampled traffic
/// the Q2_K substitute is `failed` on its own token choices while the honest node is not;
/// callers never see the logprobs the gateway asked the nodes for, and one who asks gets them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_logprobs_fail_a_sampled_substitute_and_callers_never_see_them() {
    let rig = SubstituteRig::start("").await;
    let SubstituteRig {
        gw,
        api_key,
        honest_id,
        sub_id,
        ..
    } = &rig;

    let started = Instant::now();
    let mut i = 0;
    loop {
        sampled_chat(gw, api_key, i, i % 2 == 0).await;
        i += 1;
        let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
        if audit_of(&nodes, sub_id).is_some_and(|a| a["verdict"] == "failed") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(900),
            "the substitute was not failed after {i} requests; nodes: {nodes:#}\ngateway:\n{}",
            gw.child.stderr_tail(40)
        );
    }
    let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
    let sub = audit_of(&nodes, sub_id).unwrap();
    println!("substitute failed after {i} requests: {sub}");
    assert!(sub["events"].as_u64().unwrap() > 0);

    // a few more to the honest node: audited on its logprobs, never failed; half of them with
    // stop strings whose prefixes are common (llama.cpp holds back a partial match and reports
    // those tokens later, or never when the stop string completes: the audit's stop-word slack)
    let stops = [json!([" the sea", "ing."]), json!(["\n", "s,"])];
    for j in 0..8 {
        let stop = (j % 2 == 1).then(|| stops[(j / 2) % 2].clone());
        sampled_chat_with(gw, api_key, i + j, j % 4 < 2, stop).await;
    }
    // every request is audited (rate 1.0): wait for all of them to be judged, one way or another
    let requests = i + 8;
    let judged = |m: &str| -> bool {
        let r = |result: &str| {
            metric(
                m,
                &format!("spine_audit_requests_total{{result=\"{result}\"}}"),
            )
        };
        let ended = r("audited") + r("inconclusive") + r("not_auditable") + r("dropped_queue_full");
        r("offered") >= requests as f64 && ended >= r("sampled")
    };
    let deadline = Instant::now() + Duration::from_secs(600);
    let honest_audit = loop {
        let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
        let a = audit_of(&nodes, honest_id);
        let done = judged(&gw.metrics().await);
        if (done && a.is_some()) || Instant::now() > deadline {
            break a.expect("the honest node was audited");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!(
        "audit results: {:?}",
        gw.metrics()
            .await
            .lines()
            .filter(|l| l.starts_with("spine_audit_requests_total{"))
            .collect::<Vec<_>>()
    );
    println!("honest node: {honest_audit}");
    for line in gw.child.stderr_tail(400).lines() {
        if line.contains("inconclusive") || line.contains("node logprobs") {
            println!("gateway: {line}");
        }
    }
    assert_ne!(honest_audit["verdict"], "failed", "{honest_audit}");
    assert_ne!(honest_audit["verdict"], "suspect", "{honest_audit}");
    let m = gw.metrics().await;
    assert!(
        metric(&m, "spine_audit_requests_total{result=\"node_logprobs\"}") >= 2.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "spine_audit_requests_total{result=\"node_logprobs_missing\"}"
        ),
        0.0,
        "{m}"
    );
    // an honest node's list always covers its text (no `node_logprobs_short` event)
    assert_eq!(
        metric(
            &m,
            "spine_audit_requests_total{result=\"node_logprobs_short\"}"
        ),
        0.0,
        "{m}"
    );

    // a caller who asks for logprobs gets them
    let body = json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "logprobs": true,
        "top_logprobs": 2,
    });
    let r = gw.api_post(api_key, "/v1/chat/completions", &body).await;
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().await.unwrap();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!content.is_empty(), "{v}");
    assert_eq!(
        content[0]["top_logprobs"].as_array().unwrap().len(),
        2,
        "{v}"
    );
}
