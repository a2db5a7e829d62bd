//! The harness the end-to-end tests share: a real `reference-gateway` process, its admin API,
//! a node (keygen, registration, `reference-agent`) and the engine's own token count.
// every test binary includes this module and uses part of it
#![allow(dead_code, unreachable_pub)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use spine_test_support::{Child, Engine, GatewayToml, Ready};
use tokio::process::Command;

pub mod console;

pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789";
pub const INPUT_PRICE: u64 = 150_000; // micros per million prompt tokens
pub const OUTPUT_PRICE: u64 = 600_000; // micros per million completion tokens
pub const SHARE_BPS: u64 = 8000;
pub const CREDITS: u64 = 1_000_000;

pub fn agent_bin() -> PathBuf {
    let gw = PathBuf::from(env!("CARGO_BIN_EXE_reference-gateway"));
    let agent = gw.with_file_name(format!("reference-agent{}", std::env::consts::EXE_SUFFIX));
    assert!(
        agent.exists(),
        "{} missing: build the workspace binaries first (cargo build --workspace --bins)",
        agent.display()
    );
    agent
}

pub struct Gateway {
    pub child: Child,
    pub public: String,
    pub admin: String,
    pub tunnel: String,
    pub ca_file: PathBuf,
    /// `http://<console_addr>` (the console's listener).
    pub console: String,
    pub http: reqwest::Client,
}

impl Gateway {
    /// The gateway process's resident set, KiB (`VmRSS` of `/proc/<pid>/status`).
    pub fn rss_kib(&self) -> u64 {
        let pid = self.child.id().unwrap();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap()
    }

    pub async fn start(dir: &Path, engine: &Engine) -> Gateway {
        Self::start_with(dir, engine, "").await
    }

    /// Starts with `extra` top-level TOML keys (e.g. `default_rpm_limit = 5`).
    pub async fn start_with(dir: &Path, engine: &Engine, extra: &str) -> Gateway {
        Self::start_full(dir, engine, extra, "").await
    }

    /// As [`Gateway::start_with`], with `model_extra` keys in the `smollm2` catalog entry (e.g.
    /// `reference_url = "…"`).
    pub async fn start_full(
        dir: &Path,
        engine: &Engine,
        extra: &str,
        model_extra: &str,
    ) -> Gateway {
        let mut child = GatewayToml::new(ADMIN_TOKEN, &dir.join("data"))
            .line(&format!("operator_share_bps = {SHARE_BPS}"))
            // a test that sets its own grace period says so in `extra`
            .line(if extra.contains("shutdown_grace_secs") {
                ""
            } else {
                "shutdown_grace_secs = 120"
            })
            .line(extra)
            .model(
                "smollm2",
                &engine.model_gguf,
                INPUT_PRICE,
                OUTPUT_PRICE,
                model_extra,
            )
            .spawn(
                &dir.join("gateway.toml"),
                Path::new(env!("CARGO_BIN_EXE_reference-gateway")),
                "info",
                "gateway",
            )
            .unwrap();
        let ready = Ready::read(&mut child, Duration::from_secs(60))
            .await
            .unwrap();
        Self::from_ready(ready, child)
    }

    /// The gateway `child` that printed `ready`.
    pub fn from_ready(ready: Ready, child: Child) -> Gateway {
        Gateway {
            public: ready.public,
            admin: ready.admin,
            tunnel: ready.tunnel,
            ca_file: ready.tunnel_ca_file,
            console: ready.console.unwrap_or_default(),
            child,
            // idle connections are dropped by the client well before the gateway's 15 s
            // header-read timeout closes them: otherwise a request that reuses one just as the
            // gateway closes it (e.g. right after a SIGSTOP'd gateway resumes) is reset, the
            // keep-alive race every HTTP/1.1 client has (httpx keeps idle ones 5 s, undici 4 s)
            http: reqwest::Client::builder()
                .pool_idle_timeout(Duration::from_secs(4))
                .build()
                .unwrap(),
        }
    }

    /// A `method` request to the admin API at `path`, with the admin token.
    pub fn admin_request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.admin))
            .bearer_auth(ADMIN_TOKEN)
    }

    pub async fn admin_post(&self, path: &str, body: Value) -> (u16, Value) {
        status_and_json(self.admin_request(reqwest::Method::POST, path).json(&body)).await
    }

    pub async fn admin_get(&self, path: &str) -> (u16, Value) {
        status_and_json(self.admin_request(reqwest::Method::GET, path)).await
    }

    pub async fn balance(&self, account: &str) -> (u64, u64) {
        let (_, a) = self
            .admin_get(&format!("/admin/v1/accounts/{account}"))
            .await;
        (
            a["balance_micros"].as_u64().unwrap(),
            a["held_micros"].as_u64().unwrap(),
        )
    }

    /// `(balance, held)` once nothing is held any more (settlements commit just after an
    /// answer ends), or as it stands after 5 s.
    pub async fn balance_once_released(&self, account: &str) -> (u64, u64) {
        let mut balance = self.balance(account).await;
        for _ in 0..100 {
            if balance.1 == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            balance = self.balance(account).await;
        }
        balance
    }

    /// What `account` spent since its balance was `before`, once that is `want` (settlements
    /// commit just after an answer ends), or as it stands after 5 s.
    pub async fn spent_since(&self, account: &str, before: u64, want: u64) -> u64 {
        let mut spent = before - self.balance(account).await.0;
        for _ in 1..100 {
            if spent == want {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            spent = before - self.balance(account).await.0;
        }
        spent
    }

    pub async fn earned(&self, operator: &str) -> u64 {
        let (_, o) = self
            .admin_get(&format!("/admin/v1/operators/{operator}"))
            .await;
        o["earned_micros"].as_u64().unwrap()
    }

    /// `GET /metrics` (Prometheus text).
    pub async fn metrics(&self) -> String {
        let r = self
            .admin_request(reqwest::Method::GET, "/metrics")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.text().await.unwrap()
    }

    /// POST `body` to the public API at `path` with `key`.
    pub async fn api_post(&self, key: &str, path: &str, body: &Value) -> reqwest::Response {
        post_json(&self.http, &format!("{}{path}", self.public), key, body).await
    }

    /// The node's entry in `GET /admin/v1/nodes`, if listed.
    pub async fn node_view(&self, node_id: &str) -> Option<Value> {
        let (_, nodes) = self.admin_get("/admin/v1/nodes").await;
        nodes["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["node_id"] == node_id)
            .cloned()
    }

    /// The node's entry in `GET /admin/v1/nodes` (it must be listed).
    pub async fn node(&self, node_id: &str) -> Value {
        self.node_view(node_id)
            .await
            .unwrap_or_else(|| panic!("node {node_id} not listed"))
    }

    /// A short non-streamed chat ("Say hi.", 4 tokens): `(status, request id)`, the body read.
    pub async fn say_hi(&self, key: &str) -> (u16, String) {
        let resp = self
            .api_post(
                key,
                "/v1/chat/completions",
                &json!({"model":"smollm2","max_tokens":4,
                        "messages":[{"role":"user","content":"Say hi."}]}),
            )
            .await;
        let status = resp.status().as_u16();
        let id = resp
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let _ = resp.bytes().await;
        (status, id)
    }

    /// Asserts that every request of `ids` completed on `node`; the sum of their debits.
    pub async fn completed_on(&self, ids: &[String], node: &str) -> u64 {
        let mut debits = 0;
        for id in ids {
            let rec = self.record(id).await;
            assert_eq!(rec["outcome"], "completed", "{rec}");
            assert_eq!(rec["node"], node, "{rec}");
            debits += rec["debit_micros"].as_u64().unwrap();
        }
        debits
    }

    /// The settled record of `request_id`, asserted `upstream_failed` with nothing debited.
    pub async fn failed_unbilled(&self, request_id: &str) -> Value {
        let rec = self.record(request_id).await;
        assert_eq!(rec["outcome"], "upstream_failed", "{rec}");
        assert_eq!(rec["debit_micros"], 0, "{rec}");
        rec
    }

    /// The settled record; settlement runs after the body ends, so poll briefly.
    pub async fn record(&self, request_id: &str) -> Value {
        for _ in 0..100 {
            let (status, rec) = self
                .admin_get(&format!("/admin/v1/requests/{request_id}"))
                .await;
            if status == 200 {
                return rec;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("request {request_id} was never settled");
    }
}

/// POSTs `body` as JSON to `url` with the bearer token `key` (a caller's request from a task
/// that holds no [`Gateway`]).
pub async fn post_json(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    body: &Value,
) -> reqwest::Response {
    http.post(url)
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap()
}

/// The value of the header `name` of `resp`, if it has one.
pub fn header(resp: &reqwest::Response, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
}

/// Sends `req`: the answer's status and its body as JSON.
pub async fn status_and_json(req: reqwest::RequestBuilder) -> (u16, Value) {
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// Sends `req`: the answer's body as JSON, whatever its status.
pub async fn json_of(req: reqwest::RequestBuilder) -> Value {
    status_and_json(req).await.1
}

pub async fn keygen(dir: &Path, name: &str) -> (PathBuf, String) {
    let path = dir.join(name);
    let out = Command::new(agent_bin())
        .arg("keygen")
        .arg("--out")
        .arg(&path)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "keygen failed: {out:?}");
    let public = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(public.starts_with("ed25519:"), "keygen printed {public:?}");
    (path, public)
}

pub fn start_agent(gw: &Gateway, identity: &Path, engine_url: &str, name: &str) -> Child {
    start_agent_with(gw, identity, engine_url, name, 2)
}

/// As [`start_agent`], advertising `max_concurrency` slots.
pub fn start_agent_with(
    gw: &Gateway,
    identity: &Path,
    engine_url: &str,
    name: &str,
    max_concurrency: u32,
) -> Child {
    let mut cmd = Command::new(agent_bin());
    cmd.arg("run")
        .arg("--gateway")
        .arg(&gw.tunnel)
        .arg("--identity")
        .arg(identity)
        .arg("--ca-file")
        .arg(&gw.ca_file)
        .args(["--engine", "llama.cpp", "--engine-url", engine_url])
        .args(["--max-concurrency", &max_concurrency.to_string()])
        .env("RUST_LOG", "info");
    Child::spawn(name, cmd).unwrap()
}

/// The engine's own count: prompt = tokens of its rendered template (special tokens parsed);
/// completion = tokens of the text, plus the EOS token when it stopped on it.
pub struct EngineCounter {
    pub url: String,
    pub http: reqwest::Client,
}

impl EngineCounter {
    /// Tokens of `text` by the engine's `/tokenize`, special tokens parsed.
    async fn tokenize(&self, text: &str, add_special: bool) -> u64 {
        let r =
            json_of(self.http.post(format!("{}/tokenize", self.url)).json(
                &json!({"content": text, "add_special": add_special, "parse_special": true}),
            ))
            .await;
        r["tokens"].as_array().unwrap().len() as u64
    }

    pub async fn tokens(&self, text: &str) -> u64 {
        self.tokenize(text, false).await
    }

    /// Tokens of `text` as `/v1/completions` and `/v1/embeddings` tokenize a prompt: special
    /// tokens parsed, and BOS/EOS added when the model's vocabulary asks for them.
    pub async fn prompt_tokens(&self, text: &str) -> u64 {
        self.tokenize(text, true).await
    }

    pub async fn prompt(&self, messages: &Value) -> u64 {
        let r = json_of(
            self.http
                .post(format!("{}/apply-template", self.url))
                .json(&json!({ "messages": messages })),
        )
        .await;
        self.tokens(r["prompt"].as_str().unwrap()).await
    }

    pub async fn completion(&self, text: &str, finish_reason: &str) -> u64 {
        self.tokens(text).await + u64::from(finish_reason == "stop")
    }
}

pub fn cost(prompt: u64, completion: u64) -> (u64, u64, u64) {
    let cost = (prompt * INPUT_PRICE + completion * OUTPUT_PRICE).div_ceil(1_000_000);
    let operator = cost * SHARE_BPS / 10_000;
    (cost, operator, cost - operator)
}

/// The text a streamed chat delivered: the `delta.content` of its first choice, every event.
pub fn text_of(events: &[String]) -> String {
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// Asserts that a stream's `events` ended with `[DONE]` and none carried an error; `context`
/// is said on failure.
pub fn assert_clean_stream(events: &[String], context: &str) {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert!(
        events.iter().all(|e| !e.contains("\"error\"")),
        "{context}{events:?}"
    );
}

/// Asserts the money of a settled record `rec`: cost, operator credit and fee as [`cost`] of
/// `prompt` and `completion` tokens.
pub fn assert_split(rec: &Value, prompt: u64, completion: u64) {
    let (c, o, f) = cost(prompt, completion);
    assert_eq!(
        (
            rec["cost_micros"].as_u64(),
            rec["operator_credit_micros"].as_u64(),
            rec["fee_micros"].as_u64()
        ),
        (Some(c), Some(o), Some(f))
    );
}

/// Parses a complete SSE body into its `data:` payloads.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

/// What `setup` made: an operator with one routable node, and a funded account with a key.
pub struct Setup {
    pub operator: String,
    pub account: String,
    pub api_key: String,
    pub node_id: String,
    pub agent: Child,
}

/// An operator, and an account credited `CREDITS` (idempotency key `topup-1`) with an API key.
pub struct Tenant {
    pub operator: String,
    pub account: String,
    pub api_key: String,
}

/// A new account on `gw` with an API key and no credit: `(account, key)`.
pub async fn account_with_key(gw: &Gateway) -> (String, String) {
    let (s, acct) = gw.admin_post("/admin/v1/accounts", json!({})).await;
    assert_eq!(s, 201);
    let account = acct["id"].as_str().unwrap().to_owned();
    let (s, key) = gw
        .admin_post(&format!("/admin/v1/accounts/{account}/keys"), json!({}))
        .await;
    assert_eq!(s, 201);
    let key = key["key"].as_str().unwrap().to_owned();
    (account, key)
}

/// A further account on `gw` credited `micros` once, with an API key: `(account, key)`.
pub async fn account_with_credit(gw: &Gateway, micros: u64) -> (String, String) {
    let (account, key) = account_with_key(gw).await;
    let (s, credited) = gw
        .admin_post(
            &format!("/admin/v1/accounts/{account}/credits"),
            json!({"amount_micros": micros, "idempotency_key": "first"}),
        )
        .await;
    assert_eq!((s, credited["applied"].as_bool()), (200, Some(true)));
    (account, key)
}

/// Creates a [`Tenant`] on `gw` through its admin API.
pub async fn tenant(gw: &Gateway) -> Tenant {
    let (s, op) = gw.admin_post("/admin/v1/operators", json!({})).await;
    assert_eq!(s, 201);
    let operator = op["id"].as_str().unwrap().to_owned();
    let (account, api_key) = account_with_key(gw).await;
    let (s, credited) = gw
        .admin_post(
            &format!("/admin/v1/accounts/{account}/credits"),
            json!({"amount_micros": CREDITS, "idempotency_key": "topup-1"}),
        )
        .await;
    assert_eq!((s, credited["applied"].as_bool()), (200, Some(true)));
    Tenant {
        operator,
        account,
        api_key,
    }
}

/// Registers a new node key for `operator` (`<name>.key` in `dir`), starts a `reference-agent`
/// named `name` for it in front of `engine_url`, and waits until the node is routable (the
/// gateway's first health probe through the tunnel answered); returns (node id, agent).
pub async fn add_node(
    gw: &Gateway,
    dir: &Path,
    operator: &str,
    engine_url: &str,
    name: &str,
) -> (String, Child) {
    add_node_with(gw, dir, operator, engine_url, name, 2).await
}

/// A gateway on `dir` with the defaults ([`Gateway::start`]), its [`Tenant`], and one node named
/// `name` in front of `engine_url` ([`add_node`]): the start of the single-node tests.
pub async fn gateway_with_node(
    dir: &Path,
    engine: &Engine,
    engine_url: &str,
    name: &str,
) -> (Gateway, Tenant, String, Child) {
    let gw = Gateway::start(dir, engine).await;
    let t = tenant(&gw).await;
    let (node, agent) = add_node(&gw, dir, &t.operator, engine_url, name).await;
    (gw, t, node, agent)
}

/// As [`add_node`], the agent advertising `max_concurrency` slots.
pub async fn add_node_with(
    gw: &Gateway,
    dir: &Path,
    operator: &str,
    engine_url: &str,
    name: &str,
    max_concurrency: u32,
) -> (String, Child) {
    let (identity, public_key) = keygen(dir, &format!("{name}.key")).await;
    let (s, node) = gw
        .admin_post(
            "/admin/v1/nodes",
            json!({"operator_id": operator, "public_key": public_key}),
        )
        .await;
    assert_eq!(s, 201, "{node}");
    let node_id = node["node_id"].as_str().unwrap().to_owned();
    let agent = start_agent_with(gw, &identity, engine_url, name, max_concurrency);
    for _ in 0..300 {
        let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
        if nodes["data"]
            .as_array()
            .is_some_and(|a| a.iter().any(|n| n["node_id"] == node_id.as_str()))
        {
            return (node_id, agent);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "node {name} never became routable; agent stderr:\n{}\ngateway stderr:\n{}",
        agent.stderr_tail(30),
        gw.child.stderr_tail(30)
    );
}

/// Operator, account (credited `CREDITS` once, idempotently), API key, node key registered, agent
/// started and routable.
pub async fn setup(gw: &Gateway, dir: &Path, llama_url: &str) -> Setup {
    // --- accounts, operator, node ------------------------------------------------------------
    let Tenant {
        operator,
        account,
        api_key,
    } = tenant(gw).await;
    // the same idempotency key again changes nothing
    let (s, again) = gw
        .admin_post(
            &format!("/admin/v1/accounts/{account}/credits"),
            json!({"amount_micros": CREDITS, "idempotency_key": "topup-1"}),
        )
        .await;
    assert_eq!((s, again["applied"].as_bool()), (200, Some(false)));
    assert_eq!(gw.balance(&account).await, (CREDITS, 0));

    let (node_id, agent) = add_node(gw, dir, &operator, llama_url, "node").await;

    Setup {
        operator,
        account,
        api_key,
        node_id,
        agent,
    }
}

/// The value of the series `series` (name and labels exactly as rendered, e.g.
/// `spine_http_requests_total{route="/v1/completions",status="200"}`) in a Prometheus text
/// body; 0 when absent.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// The body type of the fake engines the e2e tests start (real HTTP, hostile where a real
/// engine cannot be).
pub type FakeBody = http_body_util::combinators::BoxBody<bytes::Bytes, std::io::Error>;

/// A whole response of a fake engine.
pub fn full(status: u16, content_type: &str, body: String) -> hyper::Response<FakeBody> {
    use http_body_util::BodyExt as _;
    hyper::Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(
            http_body_util::Full::new(bytes::Bytes::from(body))
                .map_err(|n| match n {})
                .boxed(),
        )
        .unwrap()
}

/// What a fake llama-server serving `smollm2` answers on `path` besides chat: `/health` and
/// `/v1/models` (what the agent reads to advertise the node); `None` for any other path.
pub fn fake_llama_meta(path: &str) -> Option<hyper::Response<FakeBody>> {
    match path {
        "/health" => Some(full(200, "application/json", r#"{"status":"ok"}"#.into())),
        "/v1/models" => Some(full(
            200,
            "application/json",
            json!({"object":"list","data":[{"id":"smollm2","object":"model","owned_by":"llamacpp","meta":{"n_ctx":4096}}]})
                .to_string(),
        )),
        _ => None,
    }
}

/// A streamed (`text/event-stream`) 200 answer of a fake engine.
pub fn sse<S>(frames: S) -> hyper::Response<FakeBody>
where
    S: futures_util::Stream<Item = Result<hyper::body::Frame<bytes::Bytes>, std::io::Error>>
        + Send
        + Sync
        + 'static,
{
    use http_body_util::BodyExt as _;
    hyper::Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .body(http_body_util::StreamBody::new(frames).boxed())
        .unwrap()
}

/// The first event of a fake engine's chat stream: the assistant's role, no content.
pub const ROLE_CHUNK: &str = "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"smollm2\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null},\"finish_reason\":null}]}\n\n";

/// A streamed 200 answer of a fake engine that sends `frames` one at a time, each `gap` after
/// the previous one (the first `gap` after the headers); an `Err` frame breaks the body there.
pub fn sse_paced(
    frames: Vec<Result<hyper::body::Frame<bytes::Bytes>, std::io::Error>>,
    gap: Duration,
) -> hyper::Response<FakeBody> {
    sse(futures_util::stream::unfold(
        frames.into_iter(),
        move |mut rest| async move {
            let next = rest.next()?;
            tokio::time::sleep(gap).await;
            Some((next, rest))
        },
    ))
}

/// Serves `answer` as a fake engine over real HTTP/1.1 on a free loopback port; returns its base
/// URL and the accept loop's task (abort it to stop accepting).
pub async fn serve_fake_engine<F, Fut>(answer: F) -> (String, tokio::task::JoinHandle<()>)
where
    F: Fn(hyper::Request<hyper::body::Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<hyper::Response<FakeBody>, std::convert::Infallible>>
        + Send
        + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(
                        hyper_util::rt::TokioIo::new(tcp),
                        hyper::service::service_fn(answer),
                    )
                    .await;
            });
        }
    });
    (url, task)
}

/// Serves a fake llama-server serving `smollm2` over real HTTP/1.1 on a free loopback port:
/// `/health` and `/v1/models` as [`fake_llama_meta`] answers them; any other request is read
/// whole and `answer` gets its path and body. Returns the base URL and the accept loop's task.
pub async fn serve_fake_llama<F, Fut>(answer: F) -> (String, tokio::task::JoinHandle<()>)
where
    F: Fn(String, bytes::Bytes) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = hyper::Response<FakeBody>> + Send + 'static,
{
    serve_fake_engine(move |req: hyper::Request<hyper::body::Incoming>| {
        let answer = answer.clone();
        async move {
            use http_body_util::BodyExt as _;
            let path = req.uri().path().to_owned();
            let body = req
                .into_body()
                .collect()
                .await
                .map(http_body_util::Collected::to_bytes)
                .unwrap_or_default();
            Ok(match fake_llama_meta(&path) {
                Some(meta) => meta,
                None => answer(path, body).await,
            })
        }
    })
    .await
}

/// The frames of one fake chat stream (an `Err` breaks the body there).
pub type FakeFrames = Vec<Result<hyper::body::Frame<bytes::Bytes>, std::io::Error>>;

/// Serves a fake llama-server (as [`serve_fake_llama`]) whose every chat completion is a stream
/// of `frames()` paced `gap` apart ([`sse_paced`]), counted in `chats`; any other path is a 404.
/// Returns the base URL and the accept loop's task.
pub async fn serve_fake_chat_stream<F>(
    chats: std::sync::Arc<std::sync::atomic::AtomicU64>,
    gap: Duration,
    frames: F,
) -> (String, tokio::task::JoinHandle<()>)
where
    F: Fn() -> FakeFrames + Clone + Send + Sync + 'static,
{
    serve_fake_llama(move |path, _| {
        let (chats, frames) = (chats.clone(), frames.clone());
        async move {
            if path == "/v1/chat/completions" {
                chats.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                sse_paced(frames(), gap)
            } else {
                full(404, "application/json", r#"{"error":"not found"}"#.into())
            }
        }
    })
    .await
}

// --- PostgreSQL ------------------------------------------------------------------------------

pub use spine_test_support::PgDb;

/// The ledger's own tables, read directly (not through the admin API), for [`audit_ledger`].
pub enum LedgerDb {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
}

impl LedgerDb {
    /// The ledger of a gateway started in `dir` (SQLite, read-only) or on `pg`.
    pub async fn open(dir: &Path, pg: Option<&PgDb>) -> Self {
        match pg {
            Some(db) => Self::Postgres(sqlx::PgPool::connect(&db.url).await.unwrap()),
            None => Self::Sqlite(
                sqlx::SqlitePool::connect(&format!(
                    "sqlite://{}?mode=ro",
                    dir.join("data/spine.db").display()
                ))
                .await
                .unwrap(),
            ),
        }
    }

    /// [`LedgerDb::int`] of `sql`, asked up to `tries` times `every` apart until it is `want`;
    /// the last answer.
    pub async fn int_once(&self, sql: &str, want: i64, tries: u32, every: Duration) -> i64 {
        let mut n = self.int(sql).await;
        for _ in 1..tries {
            if n == want {
                break;
            }
            tokio::time::sleep(every).await;
            n = self.int(sql).await;
        }
        n
    }

    /// One integer (first row, first column) of `sql`.
    pub async fn int(&self, sql: &str) -> i64 {
        match self {
            Self::Sqlite(p) => sqlx::query_scalar::<_, i64>(sql).fetch_one(p).await,
            Self::Postgres(p) => sqlx::query_scalar::<_, i64>(sql).fetch_one(p).await,
        }
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Whether `request_id` has a request record.
    pub async fn has_record(&self, request_id: &str) -> bool {
        let sql = "SELECT COUNT(*) FROM requests WHERE request_id = ";
        let n = match self {
            Self::Sqlite(p) => {
                sqlx::query_scalar::<_, i64>(&format!("{sql}?"))
                    .bind(request_id)
                    .fetch_one(p)
                    .await
            }
            Self::Postgres(p) => {
                sqlx::query_scalar::<_, i64>(&format!("{sql}$1"))
                    .bind(request_id)
                    .fetch_one(p)
                    .await
            }
        };
        n.unwrap() > 0
    }
}

/// What [`audit_ledger`] counted.
#[derive(Debug)]
pub struct Audit {
    pub holds: i64,
    pub records: i64,
    pub debits_micros: i64,
}

/// The ledger audit of the fault matrix (issue 14), asserted: once the gateway has released
/// what it holds (polled up to 60 s, the gateway still running), no hold is active; every hold
/// and every id in `accepted` (requests answered 200) has a request record; the ledger entries
/// sum to zero; Σ debits = Σ (operator credit + fee); the tenant's account paid exactly its
/// debits (it was credited [`CREDITS`] once and is the only paying account) and its operator
/// earned exactly the operator credits. `case` names the case in failures.
pub async fn audit_ledger(
    gw: &Gateway,
    ledger: &LedgerDb,
    t: &Tenant,
    accepted: &[String],
    case: &str,
) -> Audit {
    audit_ledger_of(
        gw,
        ledger,
        &[(&t.account, CREDITS)],
        &t.operator,
        accepted,
        case,
    )
    .await
}

/// [`audit_ledger`] with several paying accounts, each `(account, credited micros)`, and the
/// one operator of every node.
pub async fn audit_ledger_of(
    gw: &Gateway,
    ledger: &LedgerDb,
    accounts: &[(&str, u64)],
    operator: &str,
    accepted: &[String],
    case: &str,
) -> Audit {
    for (account, _) in accounts {
        let mut held = u64::MAX;
        for _ in 0..600 {
            held = gw.balance(account).await.1;
            if held == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(held, 0, "{case}: a hold stranded while the gateway runs");
    }
    let active = ledger
        .int("SELECT COUNT(*) FROM holds WHERE state = 'held'")
        .await;
    assert_eq!(active, 0, "{case}: holds still active");
    let unrecorded = ledger
        .int("SELECT COUNT(*) FROM holds h WHERE NOT EXISTS (SELECT 1 FROM requests r WHERE r.request_id = h.request_id)")
        .await;
    assert_eq!(unrecorded, 0, "{case}: holds without a request record");
    for id in accepted {
        assert!(
            ledger.has_record(id).await,
            "{case}: accepted request {id} has no record"
        );
    }
    let entries = ledger
        .int("SELECT CAST(COALESCE(SUM(amount_micros), 0) AS BIGINT) FROM ledger_entries")
        .await;
    assert_eq!(entries, 0, "{case}: the ledger entries do not sum to zero");
    let debits = ledger
        .int("SELECT CAST(COALESCE(SUM(debit_micros), 0) AS BIGINT) FROM requests")
        .await;
    let split = ledger
        .int("SELECT CAST(COALESCE(SUM(operator_credit_micros + fee_micros), 0) AS BIGINT) FROM requests")
        .await;
    assert_eq!(
        debits, split,
        "{case}: Σ debits ≠ Σ operator credits + fees"
    );
    let mut paid = 0i64;
    for (account, credited) in accounts {
        let (balance, _) = gw.balance(account).await;
        paid += *credited as i64 - balance as i64;
    }
    assert_eq!(
        paid, debits,
        "{case}: the accounts did not pay exactly their debits"
    );
    let credits = ledger
        .int("SELECT CAST(COALESCE(SUM(operator_credit_micros), 0) AS BIGINT) FROM requests")
        .await;
    assert_eq!(
        gw.earned(operator).await as i64,
        credits,
        "{case}: the operator did not earn exactly its credits"
    );
    Audit {
        holds: ledger.int("SELECT COUNT(*) FROM holds").await,
        records: ledger.int("SELECT COUNT(*) FROM requests").await,
        debits_micros: debits,
    }
}

/// How many of a llama-server's slots are generating (`GET /slots`).
pub async fn llama_slots_busy(http: &reqwest::Client, llama_url: &str) -> usize {
    let slots = json_of(http.get(format!("{llama_url}/slots"))).await;
    slots
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["is_processing"] == true)
        .count()
}
