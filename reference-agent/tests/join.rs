//! The GPU owner's flow against the real parts: a real `reference-gateway` process (SQLite
//! ledger, TLS tunnel listener), a real llama.cpp `llama-server`, and the `reference-agent`
//! binary.
//!
//! - `join` goes from nothing (no key, no config) to a routable node in one command; the time of
//!   that command until the gateway routes to the node is measured and printed;
//! - `status` shows it connected with its model; after one paid request it shows the request and
//!   the earnings, equal to the ledger's operator credit;
//! - enrollment refusals (unknown, used token; bad key; unsigned status) are OpenAI-shaped;
//! - at `RUST_LOG=trace`, neither the gateway's nor the agent's log contains the prompt or the
//!   completion text.
//!
//! Needs the workspace binaries built (`cargo build --workspace --bins`) and the engine from
//! `scripts/setup.sh`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use spine_test_support::{stdout_of, Child, Engine, GatewayToml, LlamaServer, Ready};
use tokio::process::Command;

const AGENT: &str = env!("CARGO_BIN_EXE_reference-agent");
const ADMIN_TOKEN: &str = "test-admin-token-join-0123456789";

fn gateway_bin() -> PathBuf {
    let gw = Path::new(AGENT)
        .with_file_name(format!("reference-gateway{}", std::env::consts::EXE_SUFFIX));
    assert!(
        gw.exists(),
        "{} missing: build the workspace binaries first (cargo build --workspace --bins)",
        gw.display()
    );
    gw
}

struct Gateway {
    child: Child,
    public: String,
    admin: String,
    tunnel_addr: String,
    ca_file: PathBuf,
    http: reqwest::Client,
    /// Trusts the gateway's self-signed tunnel certificate.
    tunnel_http: reqwest::Client,
}

impl Gateway {
    async fn start(dir: &Path, engine: &Engine, rust_log: &str) -> Gateway {
        let mut child = GatewayToml::new(ADMIN_TOKEN, &dir.join("data"))
            .line("operator_share_bps = 8000")
            .model("smollm2", &engine.model_gguf, 150_000, 600_000, "")
            .spawn(
                &dir.join("gateway.toml"),
                &gateway_bin(),
                rust_log,
                "gateway",
            )
            .unwrap();
        let ready = Ready::read(&mut child, Duration::from_secs(60))
            .await
            .unwrap();
        let ca_file = ready.tunnel_ca_file;
        let cert = reqwest::Certificate::from_pem(&std::fs::read(&ca_file).unwrap()).unwrap();
        Gateway {
            public: ready.public,
            admin: ready.admin,
            tunnel_addr: ready.tunnel_addr,
            ca_file,
            child,
            http: reqwest::Client::new(),
            tunnel_http: reqwest::Client::builder()
                .add_root_certificate(cert)
                .build()
                .unwrap(),
        }
    }

    /// The tunnel listener as agents dial it (`localhost` is in the self-signed certificate).
    fn tunnel_url(&self) -> String {
        let port = self.tunnel_addr.rsplit(':').next().unwrap();
        format!("wss://localhost:{port}")
    }

    fn tunnel_https(&self, path: &str) -> String {
        let port = self.tunnel_addr.rsplit(':').next().unwrap();
        format!("https://localhost:{port}{path}")
    }

    async fn admin(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.admin))
            .bearer_auth(ADMIN_TOKEN);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    /// Operator, enrollment token, and a funded account with a key: `(operator, token, key)`.
    async fn provision(&self) -> (String, String, String) {
        let (s, op) = self
            .admin(
                reqwest::Method::POST,
                "/admin/v1/operators",
                Some(json!({})),
            )
            .await;
        assert_eq!(s, 201, "{op}");
        let op = op["id"].as_str().unwrap().to_owned();
        let (s, enr) = self
            .admin(
                reqwest::Method::POST,
                &format!("/admin/v1/operators/{op}/enrollments"),
                Some(json!({"ttl_secs": 600})),
            )
            .await;
        assert_eq!(s, 201, "{enr}");
        assert_eq!(enr["operator_id"], op.as_str());
        assert_eq!(enr["ttl_secs"], 600);
        let token = enr["token"].as_str().unwrap().to_owned();
        assert!(token.starts_with("spine-enroll-"), "{token}");
        let (s, acct) = self
            .admin(reqwest::Method::POST, "/admin/v1/accounts", Some(json!({})))
            .await;
        assert_eq!(s, 201);
        let acct = acct["id"].as_str().unwrap().to_owned();
        let (s, key) = self
            .admin(
                reqwest::Method::POST,
                &format!("/admin/v1/accounts/{acct}/keys"),
                Some(json!({})),
            )
            .await;
        assert_eq!(s, 201);
        let key = key["key"].as_str().unwrap().to_owned();
        let (s, _) = self
            .admin(
                reqwest::Method::POST,
                &format!("/admin/v1/accounts/{acct}/credits"),
                Some(json!({"amount_micros": 1_000_000, "idempotency_key": format!("join-test-{acct}")})),
            )
            .await;
        assert_eq!(s, 200);
        (op, token, key)
    }

    /// The operator's view of its nodes (`GET /admin/v1/operators/{id}`).
    async fn operator(&self, op: &str) -> Value {
        let (s, v) = self
            .admin(
                reqwest::Method::GET,
                &format!("/admin/v1/operators/{op}"),
                None,
            )
            .await;
        assert_eq!(s, 200, "{v}");
        v
    }
}

/// `reference-agent join … --json` for `gw`, serving `engine_url`; config and key under `dir`.
fn join_cmd(gw: &Gateway, dir: &Path, token: &str, engine_url: &str, rust_log: &str) -> Command {
    let mut cmd = Command::new(AGENT);
    cmd.arg("join")
        .arg("--gateway")
        .arg(gw.tunnel_url())
        .arg("--token")
        .arg(token)
        .arg("--ca-file")
        .arg(&gw.ca_file)
        .args(["--engine-url", engine_url, "--name", "desk-gpu", "--json"])
        .arg("--config")
        .arg(dir.join("agent").join("agent.toml"))
        .env("RUST_LOG", rust_log)
        .env_remove("SPINE_AGENT_CONFIG")
        .env_remove("SPINE_AGENT_ENROLLMENT_TOKEN");
    cmd
}

async fn status_json(config: &Path) -> Value {
    let out = Command::new(AGENT)
        .args(["status", "--json", "--config"])
        .arg(config)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "status failed: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_from_nothing_to_serving_then_status_shows_model_and_earnings() {
    let engine = Engine::discover().unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(dir.path(), &engine, "info").await;
    let (op, token, key) = gw.provision().await;
    let config = dir.path().join("agent").join("agent.toml");
    assert!(!config.exists());

    // one command: engine auto-detected, key generated, token redeemed, config written, serving
    let started = Instant::now();
    let mut agent = Child::spawn(
        "agent",
        join_cmd(&gw, dir.path(), &token, &llama.url, "info"),
    )
    .unwrap();
    let joined = agent.read_json_line(Duration::from_secs(30)).await.unwrap();
    assert_eq!(joined["event"], "joined");
    assert_eq!(joined["operator_id"], op.as_str());
    assert_eq!(joined["engine"], "llama.cpp");
    assert_eq!(joined["routable_models"], json!(["smollm2"]));
    let node = joined["node_id"].as_str().unwrap().to_owned();
    let routable_after = loop {
        let v = gw.operator(&op).await;
        if v["nodes"][0]["routable"] == true {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "not routable after 30 s: {v}; agent:\n{}",
            agent.stderr_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    eprintln!(
        "join → routable: {} ms (one command, engine already running)",
        routable_after.as_millis()
    );
    let written = std::fs::read_to_string(&config).unwrap();
    assert!(written.contains("engine = \"llama.cpp\""), "{written}");
    assert!(written.contains("/v1/tunnel"), "{written}");
    assert!(dir.path().join("agent").join("node.key").exists());

    // the operator view and the node's own status
    let v = gw.operator(&op).await;
    assert_eq!(v["nodes"][0]["node_id"], node.as_str());
    assert_eq!(v["nodes"][0]["name"], "desk-gpu");
    assert_eq!(v["nodes"][0]["connected"], true);
    assert_eq!(v["nodes"][0]["models"], json!(["smollm2"]));
    let s = status_json(&config).await;
    assert_eq!(s["node_id"], node.as_str());
    assert_eq!(s["operator_id"], op.as_str());
    assert_eq!(s["connected"], true);
    assert_eq!(s["routable"], true);
    assert_eq!(s["models"], json!(["smollm2"]));
    assert_eq!(s["requests_served"], 0);
    assert_eq!(s["earned_micros"], 0);
    let out = Command::new(AGENT)
        .args(["status", "--config"])
        .arg(&config)
        .output()
        .await
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("connected, routable"), "{text}");
    assert!(text.contains("models:      smollm2"), "{text}");

    // one paid request → the status shows it and the earnings the ledger credited
    let r = gw
        .http
        .post(format!("{}/v1/chat/completions", gw.public))
        .bearer_auth(&key)
        .json(&json!({"model": "smollm2", "max_tokens": 8,
            "messages": [{"role": "user", "content": "Say hi."}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let request_id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
    let _: Value = r.json().await.unwrap();
    let record = loop {
        let (s, rec) = gw
            .admin(
                reqwest::Method::GET,
                &format!("/admin/v1/requests/{request_id}"),
                None,
            )
            .await;
        if s == 200 {
            break rec;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(record["node"], node.as_str());
    let credit = record["operator_credit_micros"].as_u64().unwrap();
    assert!(credit > 0, "{record}");
    let s = status_json(&config).await;
    assert_eq!(s["requests_served"], 1, "{s}");
    assert_eq!(s["earned_micros"], credit, "{s}");
    assert_eq!(s["operator_earned_micros"], credit, "{s}");
    let v = gw.operator(&op).await;
    assert_eq!(v["earned_micros"], credit);
    assert_eq!(v["requests_served"], 1);

    use spine_transport::node_status::enrollment_proof;
    // the token is spent: another key is refused; the same key (a retry) gets the same node
    let other = spine_transport::NodeIdentity::generate().unwrap();
    let r = gw
        .tunnel_http
        .post(gw.tunnel_https("/v1/enroll"))
        .json(
            &json!({"token": token, "public_key": other.public_key_text(),
                      "proof": enrollment_proof(&other, &token)}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "enrollment_token_used");
    let own =
        spine_transport::NodeIdentity::load(dir.path().join("agent").join("node.key")).unwrap();
    let r = gw
        .tunnel_http
        .post(gw.tunnel_https("/v1/enroll"))
        .json(&json!({"token": token, "public_key": own.public_key_text(),
                      "proof": enrollment_proof(&own, &token)}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let again: Value = r.json().await.unwrap();
    assert_eq!(again["node_id"], node.as_str());
    for (body, status, code) in [
        (
            json!({"token": "spine-enroll-nope", "public_key": other.public_key_text(),
                   "proof": enrollment_proof(&other, "spine-enroll-nope")}),
            401,
            "invalid_enrollment_token",
        ),
        (
            json!({"token": token, "public_key": own.public_key_text()}),
            400,
            "enrollment_proof_required",
        ),
        // another node's key with a proof by a key the sender holds: refused
        (
            json!({"token": token, "public_key": own.public_key_text(),
                   "proof": enrollment_proof(&other, &token)}),
            401,
            "invalid_node_signature",
        ),
        (
            json!({"token": token, "public_key": "ed25519:short"}),
            400,
            "invalid_public_key",
        ),
        (json!({"token": token}), 400, "invalid_json"),
    ] {
        let r = gw
            .tunnel_http
            .post(gw.tunnel_https("/v1/enroll"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status, "{body}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], code, "{body}");
    }
    // key squatting: a token's holder posts a key it does not hold (a node that has not
    // enrolled yet), so that node's work would be credited to the token's operator: refused,
    // and the token is not spent by the attempt
    let (_, fresh_token, _) = gw.provision().await;
    let victim = spine_transport::NodeIdentity::generate().unwrap();
    let squatter = spine_transport::NodeIdentity::generate().unwrap();
    let enroll = |body: Value| {
        gw.tunnel_http
            .post(gw.tunnel_https("/v1/enroll"))
            .json(&body)
            .send()
    };
    let r = enroll(
        json!({"token": fresh_token, "public_key": victim.public_key_text(),
                          "proof": enrollment_proof(&squatter, &fresh_token)}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 401);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "invalid_node_signature", "{e}");
    let r = enroll(
        json!({"token": fresh_token, "public_key": squatter.public_key_text(),
                          "proof": enrollment_proof(&squatter, &fresh_token)}),
    )
    .await
    .unwrap();
    assert_eq!(
        r.status(),
        201,
        "the refused attempt did not spend the token"
    );
    // the status endpoint needs the node's signature
    let r = gw
        .tunnel_http
        .get(gw.tunnel_https("/v1/node/status"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "invalid_node_signature");

    // joining again on this machine is refused: the config (and key) are never overwritten
    let out = join_cmd(&gw, dir.path(), &token, &llama.url, "info")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("joined already"),
        "{out:?}"
    );

    // the agent stops: the status says so
    agent.kill().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = status_json(&config).await;
        if s["connected"] == false {
            assert_eq!(s["routable"], false);
            assert_eq!(s["models"], json!([]));
            assert_eq!(s["earned_micros"], credit);
            break;
        }
        assert!(Instant::now() < deadline, "still connected: {s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(gw.child);
}

/// A distinctive prompt through gateway → tunnel → agent → llama.cpp at the most verbose log
/// level: neither the gateway's nor the agent's log contains the prompt or the completion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_prompt_or_completion_text_in_either_log_at_trace() {
    const PROMPT_MARK: &str = "zebraquokka7731";
    let engine = Engine::discover().unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    // `trace`, plus directives naming the payload-logging libraries' modules: more specific than
    // the binaries' caps, so only the hard cap keeps them out
    let rust_log = "trace,tokenizers::tokenizer::normalizer=trace,minijinja=trace,h2::codec=trace";
    let gw = Gateway::start(dir.path(), &engine, rust_log).await;
    let (op, token, key) = gw.provision().await;
    let mut agent = Child::spawn(
        "agent",
        join_cmd(&gw, dir.path(), &token, &llama.url, rust_log),
    )
    .unwrap();
    let joined = agent.read_json_line(Duration::from_secs(30)).await.unwrap();
    assert_eq!(joined["event"], "joined");
    let deadline = Instant::now() + Duration::from_secs(30);
    while gw.operator(&op).await["nodes"][0]["routable"] != true {
        assert!(Instant::now() < deadline, "{}", agent.stderr_tail(20));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let prompt = format!("Repeat exactly: {PROMPT_MARK} violet lighthouse. Then count to five.");
    let mut completions = Vec::new();
    // non-streamed chat
    let r = gw
        .http
        .post(format!("{}/v1/chat/completions", gw.public))
        .bearer_auth(&key)
        .json(
            &json!({"model": "smollm2", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    completions.push(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned(),
    );
    // streamed chat
    let r = gw
        .http
        .post(format!("{}/v1/chat/completions", gw.public))
        .bearer_auth(&key)
        .json(
            &json!({"model": "smollm2", "max_tokens": 24, "stream": true, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let sse = r.text().await.unwrap();
    let mut streamed = String::new();
    for line in sse.lines() {
        if let Some(data) = line.strip_prefix("data: ") {
            if let Ok(chunk) = serde_json::from_str::<Value>(data) {
                if let Some(c) = chunk["choices"][0]["delta"]["content"].as_str() {
                    streamed.push_str(c);
                }
            }
        }
    }
    completions.push(streamed);
    // text completion
    let r = gw
        .http
        .post(format!("{}/v1/completions", gw.public))
        .bearer_auth(&key)
        // greedy, as the others: a sampled answer was once only whitespace (an empty needle)
        .json(&json!({"model": "smollm2", "max_tokens": 16, "temperature": 0, "prompt": prompt}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    completions.push(v["choices"][0]["text"].as_str().unwrap().to_owned());

    // settle, then stop both so their logs are complete
    tokio::time::sleep(Duration::from_millis(500)).await;
    agent.kill().await;
    let mut gw_child = gw.child;
    gw_child.kill().await;

    let gateway_log = gw_child.stderr_lines();
    let agent_log = agent.stderr_lines();
    // the run really was verbose: both logs hold debug/trace lines (the payload-logging
    // libraries' own, which used to be most of the gateway's TRACE lines, are capped)
    assert!(
        gateway_log
            .iter()
            .any(|l| l.contains("TRACE") || l.contains("DEBUG")),
        "the gateway log has no DEBUG/TRACE line"
    );
    assert!(
        agent_log
            .iter()
            .any(|l| l.contains("TRACE") || l.contains("DEBUG")),
        "the agent log has no DEBUG/TRACE line"
    );
    // the three requests, each logged (method and path only) at debug
    let forwarded = agent_log
        .iter()
        .filter(|l| l.contains("forwarding to the engine") && l.contains("completions"))
        .count();
    assert_eq!(forwarded, 3, "{}", agent_log.join("\n"));
    // needles: the prompt's mark, the whole prompt, each completion, and every run of 3+ words
    // of each completion (a partial leak is a leak)
    let mut needles = vec![PROMPT_MARK.to_owned(), prompt.clone()];
    for c in &completions {
        let c = c.trim();
        assert!(
            !c.is_empty(),
            "an empty completion proves nothing: {completions:?}"
        );
        needles.push(c.to_owned());
        let words: Vec<&str> = c.split_whitespace().collect();
        for w in words.windows(3) {
            let needle = w.join(" ");
            if needle.len() >= 12 {
                needles.push(needle);
            }
        }
    }
    for (name, log) in [("gateway", &gateway_log), ("agent", &agent_log)] {
        assert!(log.len() > 5, "{name} log suspiciously short");
        // no DEBUG/TRACE line at all from a library that may log payloads: the tokenizer traces
        // each character it normalizes, so a grep for whole strings would miss such a leak
        if let Some(line) = log.iter().find(|l| payload_target_below_info(l)) {
            panic!("the {name} log has a DEBUG/TRACE line from a payload-logging target: {line}");
        }
        for needle in &needles {
            if let Some(line) = log.iter().find(|l| l.contains(needle.as_str())) {
                panic!("the {name} log contains {needle:?}: {line}");
            }
        }
    }
    eprintln!(
        "log grep: {} gateway lines, {} agent lines, {} needles, none found",
        gateway_log.len(),
        agent_log.len(),
        needles.len()
    );
}

/// `line` without ANSI escape sequences (`ESC [ … letter`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Whether a `tracing` fmt line is at DEBUG or TRACE and comes from one of
/// [`spine_transport::PAYLOAD_LOGGING_TARGETS`] (`… TRACE tokenizers::tokenizer::normalizer: …`,
/// possibly with spans between the level and the target).
fn payload_target_below_info(line: &str) -> bool {
    let line = strip_ansi(line);
    let mut words = line.split_whitespace();
    if !words.any(|w| w == "TRACE" || w == "DEBUG") {
        return false;
    }
    // after the level: the spans (`name{fields}:`), then the target, each ending in ':'
    let target = words.take_while(|w| w.ends_with(':')).last();
    target.is_some_and(|t| spine_transport::is_payload_logging_target(t.trim_end_matches(':')))
}

#[test]
fn payload_target_lines_are_recognised() {
    let leak =
        "2026-11-29T21:00:00.000000Z TRACE tokenizers::tokenizer::normalizer: ### 's' with size 1";
    assert!(payload_target_below_info(leak));
    let colored = "\u{1b}[2m2026-11-29T21:00:00Z\u{1b}[0m \u{1b}[35mTRACE\u{1b}[0m \u{1b}[2mtokenizers::tokenizer::normalizer\u{1b}[0m\u{1b}[2m:\u{1b}[0m ### 's'";
    assert!(payload_target_below_info(colored));
    assert!(payload_target_below_info(
        "2026-11-29T21:00:00Z DEBUG h2::codec::framed_read: received frame=Data"
    ));
    assert!(!payload_target_below_info(
        "2026-11-29T21:00:00Z  INFO tokenizers::tokenizer: loaded"
    ));
    assert!(!payload_target_below_info(
        "2026-11-29T21:00:00Z TRACE spine_transport::server: stream opened"
    ));
    assert!(payload_target_below_info(
        "2026-11-29T21:00:00Z TRACE conn{peer=1}:stream: h2::proto::streams: send data"
    ));
    assert!(!payload_target_below_info(
        "2026-11-29T21:00:00Z DEBUG spine_transport::client: speaking h2: ok"
    ));
}

/// The catalog decides what counts: `join` in front of an engine (here a vLLM fake) serving
/// only a model the gateway's catalog lacks is refused BEFORE the token is redeemed (issue 16):
/// it says which names the catalog has, writes no config, registers no node, and the same token
/// then enrolls the node once the engine serves a catalog name. A request for the unlisted
/// model is refused before routing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_outside_the_catalog_are_never_registered() {
    let engine = Engine::discover().unwrap();
    let fake = spine_test_support::FakeEngine::start(
        spine_test_support::FakeKind::Vllm,
        "Qwen/Qwen2.5-0.5B-Instruct",
        32768,
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(dir.path(), &engine, "info").await;
    let (op, token, key) = gw.provision().await;
    let out = join_cmd(&gw, dir.path(), &token, &fake.url, "info")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("none of the engine's models (Qwen/Qwen2.5-0.5B-Instruct) is in the gateway's catalog (smollm2)")
            && stderr.contains("it was not used"),
        "{stderr}"
    );
    let config = dir.path().join("agent").join("agent.toml");
    assert!(!config.exists(), "a config was written for a refused join");
    assert_eq!(
        gw.operator(&op).await["nodes"],
        json!([]),
        "no node registered"
    );
    let r = gw
        .http
        .post(format!("{}/v1/chat/completions", gw.public))
        .bearer_auth(&key)
        .json(&json!({"model": "Qwen/Qwen2.5-0.5B-Instruct",
            "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert!(!fake.seen().iter().any(|r| r.path == "/v1/chat/completions"));

    // the owner serves the model under the catalog's name: the same token enrolls the node
    let renamed =
        spine_test_support::FakeEngine::start(spine_test_support::FakeKind::Vllm, "smollm2", 8192)
            .await
            .unwrap();
    let out = join_cmd(&gw, dir.path(), &token, &renamed.url, "info")
        .arg("--no-serve")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8(stdout_of(out, "")).unwrap();
    let joined: Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
    assert_eq!(joined["routable_models"], json!(["smollm2"]));
    assert!(config.exists());
    assert_eq!(
        gw.operator(&op).await["nodes"].as_array().map(Vec::len),
        Some(1)
    );
}
