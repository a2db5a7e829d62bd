//! Every listener of a real gateway process is bounded: a slowloris head is cut at
//! `header_read_timeout_ms` on the public, admin and tunnel listeners, and with 10,000 idle
//! connections held open (five times `public_max_connections`, with a header timeout long
//! enough that none of them times out first) a paid request still succeeds: idle connections
//! are evicted to make room. The data directory and the ledger files are owner-only. Loopback
//! only.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{
    account_with_key, add_node, full, gateway_with_node, header, serve_fake_llama, tenant,
    FakeBody, Gateway,
};
use serde_json::{json, Value};
use spine_test_support::Engine;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Only a hang takes this long.
const HANG: Duration = Duration::from_secs(60);

/// Idle connections the flood holds. This process holds one descriptor per connection (the
/// gateway at most `FLOOD_CAP`); [`raise_fd_limit`] makes room for them.
const IDLE_CONNECTIONS: usize = 10_000;

/// `public_max_connections` of the flooded gateway.
const FLOOD_CAP: usize = 2_000;

/// Opening the flood is bounded: loopback connects take well under a millisecond each; only a
/// stuck accept loop (SYNs dropped at a full backlog, retried after seconds) takes this long.
const FLOOD_BOUND: Duration = Duration::from_secs(300);

/// Raises this process's soft open-file limit to its hard limit and returns the soft limit in
/// force.
#[cfg(unix)]
fn raise_fd_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: limit.maximum,
                maximum: limit.maximum,
            },
        )
        .unwrap();
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

#[cfg(not(unix))]
fn raise_fd_limit() -> u64 {
    u64::MAX
}

async fn fake_llama(path: String) -> hyper::Response<FakeBody> {
    match path.as_str() {
        "/v1/chat/completions" => full(
            200,
            "application/json",
            json!({
                "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "smollm2",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}
            })
            .to_string(),
        ),
        _ => full(404, "application/json", r#"{"error":"not found"}"#.into()),
    }
}

fn addr(url: &str) -> String {
    url.trim_start_matches("http://")
        .trim_start_matches("wss://")
        .trim_end_matches("/v1/tunnel")
        .to_owned()
}

/// Trickles a head that never completes, one byte per 100 ms; returns how long until the
/// gateway closed the connection.
async fn slowloris(addr: &str) -> Duration {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let started = Instant::now();
    let head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    for b in head {
        if tcp.write_all(&[*b]).await.is_err() {
            return started.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        if started.elapsed() > HANG {
            panic!("{addr}: still open after {HANG:?}");
        }
    }
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout(HANG, tcp.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return started.elapsed(),
            Ok(Ok(_)) => {}
            Err(_) => panic!("{addr}: still open after {HANG:?}"),
        }
    }
}

async fn paid_chat(gw: &Gateway, api_key: &str) -> (u16, Value) {
    post_in_time(
        gw,
        api_key,
        "/v1/chat/completions",
        &json!({"model": "smollm2", "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hello"}]}),
    )
    .await
}

/// POSTs `body` to the public API at `path` with `api_key`, answered within [`HANG`]: the
/// status and the JSON body.
async fn post_in_time(gw: &Gateway, api_key: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = tokio::time::timeout(HANG, gw.api_post(api_key, path, body))
        .await
        .unwrap_or_else(|_| panic!("{path} answered in time"));
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_is_cut_on_every_listener_and_files_are_owner_only() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start_with(dir.path(), &engine, "header_read_timeout_ms = 1000").await;

    // --- files: owner-only data dir, ledger and tunnel key ----------------------------------
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let data = dir.path().join("data");
        assert_eq!(mode(&data), 0o700);
        assert_eq!(mode(&data.join("spine.db")), 0o600);
        assert_eq!(mode(&data.join("tunnel-key.pem")), 0o600);
        for side in ["spine.db-wal", "spine.db-shm"] {
            let p = data.join(side);
            if p.exists() {
                assert_eq!(mode(&p), 0o600, "{side}");
            }
        }
    }

    // --- slowloris on each listener: cut at ~1 s --------------------------------------------
    for (name, listener) in [("public", addr(&gw.public)), ("admin", addr(&gw.admin))] {
        let took = slowloris(&listener).await;
        assert!(
            took >= Duration::from_millis(900),
            "{name}: cut after {took:?}"
        );
        assert!(took < Duration::from_secs(30), "{name}: cut after {took:?}");
    }
    // the tunnel listener is TLS: a client that never finishes its handshake is cut at the
    // tunnel's handshake timeout (10 s); after TLS its head bound is the same as above
    // (spine-transport's tests/limits.rs trickles a head through TLS)
    let mut silent = TcpStream::connect(addr(&gw.tunnel)).await.unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 64];
    let r = tokio::time::timeout(HANG, silent.read(&mut buf)).await;
    assert!(matches!(r, Ok(Ok(0) | Err(_))), "{r:?}");
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(9), "tunnel: cut after {took:?}");
    assert!(took < HANG, "tunnel: cut after {took:?}");
    let metrics = gw.metrics().await;
    for listener in ["public", "admin"] {
        assert_eq!(
            common::metric(
                &metrics,
                &format!(
                    "spine_listener_connections_closed_total{{listener=\"{listener}\",reason=\"header_timeout\"}}"
                ),
            ),
            1.0,
            "{listener}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_idle_connections_do_not_stop_paid_requests() {
    let soft = raise_fd_limit();
    let needed = u64::try_from(IDLE_CONNECTIONS).unwrap() + 1_024;
    assert!(
        soft >= needed,
        "this test holds {IDLE_CONNECTIONS} connections: the open-file limit ({soft}) must be at \
         least {needed} (raise the hard limit: ulimit -Hn)"
    );
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // a header timeout far longer than the flood takes: every idle connection is still open
    // when the paid request comes, so room is made by eviction alone
    let gw = Gateway::start_with(
        dir.path(),
        &engine,
        &format!("header_read_timeout_ms = 600000\npublic_max_connections = {FLOOD_CAP}"),
    )
    .await;
    let (url, _engine_task) = serve_fake_llama(|path, _| fake_llama(path)).await;
    let t = tenant(&gw).await;
    let (_node, _agent) = add_node(&gw, dir.path(), &t.operator, &url, "node").await;
    let (status, body) = paid_chat(&gw, &t.api_key).await;
    assert_eq!(status, 200, "{body}");

    let public = addr(&gw.public);
    let started = Instant::now();
    let flood = async {
        let mut idle = Vec::with_capacity(IDLE_CONNECTIONS);
        for _ in 0..IDLE_CONNECTIONS {
            match TcpStream::connect(&public).await {
                Ok(tcp) => idle.push(tcp),
                Err(e) => panic!("connect {} failed: {e}", idle.len()),
            }
        }
        idle
    };
    let idle = tokio::time::timeout(FLOOD_BOUND, flood)
        .await
        .unwrap_or_else(|_| panic!("{IDLE_CONNECTIONS} connects took over {FLOOD_BOUND:?}"));
    let opened = started.elapsed();
    // the gateway holds the cap's worth of idle connections: the paid request's connection
    // evicts one (a fresh client: its pooled connection was evicted long ago)
    let fresh = reqwest::Client::new();
    let started = Instant::now();
    let r = tokio::time::timeout(
        HANG,
        fresh
            .post(format!("{}/v1/chat/completions", gw.public))
            .bearer_auth(&t.api_key)
            .json(&json!({"model": "smollm2", "max_tokens": 8,
                          "messages": [{"role": "user", "content": "Hello"}]}))
            .send(),
    )
    .await
    .expect("paid request in time")
    .unwrap();
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    let took = started.elapsed();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "Hi", "{body}");
    eprintln!(
        "{IDLE_CONNECTIONS} idle connections opened in {opened:?}; paid request took {took:?}"
    );
    // the cap held by eviction alone: of the 10,000 + 2 connections the public listener
    // accepted (the first paid request's, the flood, the fresh client's), all but the cap's
    // worth were closed, evicted (the first one may have reached its idle timeout first, should
    // the flood take over a minute); no head timed out and none was refused (none was busy)
    let metrics = gw.metrics().await;
    let closed = |reason: &str| {
        common::metric(
            &metrics,
            &format!(
                "spine_listener_connections_closed_total{{listener=\"public\",reason=\"{reason}\"}}"
            ),
        )
    };
    assert_eq!(closed("header_timeout"), 0.0);
    assert_eq!(closed("cap"), 0.0);
    assert_eq!(
        closed("evicted") + closed("idle_timeout"),
        (IDLE_CONNECTIONS + 2 - FLOOD_CAP) as f64
    );
    assert!(closed("evicted") >= (IDLE_CONNECTIONS + 1 - FLOOD_CAP) as f64);
    drop(idle);
    drop(gw);
}

/// Issue 13's attacker, F4: a caller refused 402 for lack of credit, then topped up through the
/// admin API, is served by its very next request — not refused (and held back 250 ms) on the
/// balance the meter remembered from before the top-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_top_up_lifts_a_remembered_refusal_at_once() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (url, _task) = serve_fake_llama(|path, _body| fake_llama(path)).await;
    let (gw, _t, _node, _agent) = gateway_with_node(dir.path(), &engine, &url, "node").await;
    let (account, key) = account_with_key(&gw).await;
    // refused, then refused again from the meter's memory (held back)
    for _ in 0..2 {
        let (status, body) = paid_chat(&gw, &key).await;
        assert_eq!(status, 402, "{body}");
    }
    // `/v1/responses` (read and translated by the gateway before the meter) goes through the
    // same gate: a body no translation could serve is refused for the credit, not parsed
    let (status, body) = post_in_time(
        &gw,
        &key,
        "/v1/responses",
        &json!({"model": "smollm2", "input": 42}),
    )
    .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (402, Some("insufficient_quota")),
        "{body}"
    );
    let (s, _) = gw
        .admin_post(
            &format!("/admin/v1/accounts/{account}/credits"),
            json!({"amount_micros": 1_000_000, "idempotency_key": "top-up"}),
        )
        .await;
    assert_eq!(s, 200);
    let (status, body) = paid_chat(&gw, &key).await;
    assert_eq!(status, 200, "the next request after the top-up: {body}");
    let (status, body) = post_in_time(
        &gw,
        &key,
        "/v1/responses",
        &json!({"model": "smollm2", "max_output_tokens": 8, "input": "Hello"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "response", "{body}");
}

/// An enrollment body past `MAX_ENROLL_BODY_BYTES` (16 KiB) on the tunnel listener is a 413 in
/// OpenAI's error shape, not axum's plain-text rejection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_enrollment_is_an_openai_shaped_413() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    let (client, base) = tunnel_listener_client(&gw);
    let body = json!({"token": "x".repeat(20_000), "public_key": "ed25519:x"});
    let resp = client
        .post(format!("{base}/v1/enroll"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);
    let e: Value = resp.json().await.unwrap();
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    assert_eq!(e["error"]["code"], "request_too_large", "{e}");
    assert!(e["error"]["message"].is_string(), "{e}");
}

/// What an anonymous client or a careless admin script can make the tunnel and admin listeners
/// refuse is in OpenAI's error shape, with each answer's `x-request-id`: a path parameter that
/// is not UTF-8 (`%FF`; axum's rejection is plain text), a wrong method or URL on the tunnel
/// listener (an empty body), and a NUL in an id, which PostgreSQL cannot compare (a 400, never
/// a retryable 503). (An admin body past the 2 MB limit, answered before it is read, is
/// `spine-meter`'s `tests/hostile_routes.rs`: over a socket the client may see the connection
/// closed before the answer.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tunnel_and_admin_listeners_refuse_in_openais_shape() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    async fn openai_error(resp: reqwest::Response, status: u16, code: &str, what: &str) {
        assert_eq!(resp.status(), status, "{what}");
        assert!(
            header(&resp, "x-request-id").is_some_and(|id| id.starts_with("req_")),
            "{what}"
        );
        let text = resp.text().await.unwrap();
        let e: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{what}: {text:?}"));
        assert_eq!(e["error"]["code"], code, "{what}: {e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{what}: {e}");
        assert!(e["error"]["message"].is_string(), "{what}: {e}");
        assert!(e["error"].get("param").is_some(), "{what}: {e}");
    }
    use reqwest::Method;
    for (method, path) in [
        (Method::GET, "/admin/v1/accounts/%FF"),
        (Method::POST, "/admin/v1/accounts/%FF/keys"),
        (Method::POST, "/admin/v1/accounts/%FF/credits"),
        (Method::GET, "/admin/v1/operators/%FF"),
        (Method::POST, "/admin/v1/operators/%FF/enrollments"),
        (Method::POST, "/admin/v1/nodes/%FF/reverify"),
        (Method::GET, "/admin/v1/requests/%FF"),
        (Method::POST, "/admin/v1/console/users/%FF/revoke-sessions"),
    ] {
        let what = format!("{method} {path}");
        let resp = gw.admin_request(method, path).send().await.unwrap();
        openai_error(resp, 400, "invalid_path", &what).await;
    }
    let resp = gw
        .admin_request(Method::GET, "/admin/v1/accounts/a%00b")
        .send()
        .await
        .unwrap();
    openai_error(resp, 400, "invalid_text", "NUL in an account id").await;
    // admin answers (a new key, a refusal) are never cached
    let resp = gw
        .admin_request(Method::POST, "/admin/v1/accounts")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    assert_eq!(header(&resp, "cache-control").as_deref(), Some("no-store"));
    let resp = gw
        .http
        .get(format!("{}/admin/v1/queues", gw.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(header(&resp, "cache-control").as_deref(), Some("no-store"));
    // the tunnel listener: anyone can reach it
    let (client, base) = tunnel_listener_client(&gw);
    let resp = client
        .get(format!("{base}/v1/enroll"))
        .send()
        .await
        .unwrap();
    openai_error(resp, 405, "method_not_allowed", "GET /v1/enroll").await;
    let resp = client
        .get(format!("{base}/admin/v1/accounts"))
        .send()
        .await
        .unwrap();
    openai_error(
        resp,
        404,
        "not_found",
        "an admin URL on the tunnel listener",
    )
    .await;
}

/// A client that trusts the gateway's tunnel certificate, and the tunnel listener's
/// `https://host:port` (where `/v1/enroll` and the node's status are served).
fn tunnel_listener_client(gw: &Gateway) -> (reqwest::Client, String) {
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&gw.ca_file).unwrap()).unwrap();
    let client = reqwest::Client::builder()
        .add_root_certificate(ca)
        .build()
        .unwrap();
    let base = gw
        .tunnel
        .replacen("wss://", "https://", 1)
        .replace("/v1/tunnel", "");
    (client, base)
}

/// What the official Python SDK (no retries) made of one chat request whose user message is
/// `content_bytes` long: the HTTP status of the `APIStatusError` it raised and its error code,
/// or the name of any other exception (a connection error: the answer never reached it).
const SDK_LARGE_BODY: &str = r#"
import json, sys
import openai
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0, timeout=120)
out = []
for size in sys.argv[3:]:
    try:
        client.chat.completions.create(
            model="smollm2", max_tokens=8,
            messages=[{"role": "user", "content": "x" * int(size)}])
        out.append({"status": 200})
    except openai.APIStatusError as e:
        code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
        out.append({"status": e.status_code, "code": code})
    except Exception as e:
        out.append({"exception": type(e).__name__, "message": str(e)})
print(json.dumps(out))
"#;

/// Answers given before a request body is read reach a caller still sending it: the official
/// SDK, sending a 4 MiB prompt from a key that cannot pay, gets the 402 (its balance is read
/// before the body, then the refusal is remembered), and an 8 MiB one the 413 — not a reset
/// connection (a broken pipe, which the SDKs retry) because the gateway closed a socket with
/// the body unread: its listeners linger on close. The refusals are answered at once
/// (`refused_credit_delay_ms = 0`), while the caller is still writing most of its body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_before_the_body_reach_an_sdk_still_sending_it() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (url, _task) = serve_fake_llama(|path, _body| fake_llama(path)).await;
    // every refusal answered at once: the caller is still writing most of its body
    let gw = Gateway::start_with(dir.path(), &engine, "refused_credit_delay_ms = 0").await;
    let t = tenant(&gw).await;
    let (_node, _agent) = add_node(&gw, dir.path(), &t.operator, &url, "node").await;
    let (_account, broke_key) = account_with_key(&gw).await;
    let sdk = |key: String, sizes: Vec<usize>| {
        let (python, public) = (engine.python.clone(), gw.public.clone());
        async move {
            let out = tokio::time::timeout(
                HANG * 3,
                tokio::process::Command::new(python)
                    .arg("-c")
                    .arg(SDK_LARGE_BODY)
                    .arg(format!("{public}/v1"))
                    .arg(key)
                    .args(sizes.iter().map(ToString::to_string))
                    .output(),
            )
            .await
            .expect("the SDK run hung")
            .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            serde_json::from_slice::<Vec<Value>>(&out.stdout).unwrap()
        }
    };
    let four_mib = (4 << 20) - 4096;
    // the first refusal reads the balance before the body, the second is remembered
    let refused = sdk(broke_key.clone(), vec![four_mib, four_mib]).await;
    let expected = json!({"status": 402, "code": "insufficient_quota"});
    assert_eq!(refused, [expected.clone(), expected], "what the SDK saw");
    // a hyper-based client (reqwest) sending the same body: it reads the answer only if its
    // write was not reset
    let body = json!({"model": "smollm2", "max_tokens": 8,
        "messages": [{"role": "user", "content": "x".repeat(four_mib)}]});
    let client = reqwest::Client::new();
    // `times` chats with `body` from `key` on one pooled client, each answered `status`
    let expect_each = |key: String, body: Value, times: usize, status: u16| {
        let (client, url) = (client.clone(), format!("{}/v1/chat/completions", gw.public));
        async move {
            for _ in 0..times {
                let sent = tokio::time::timeout(
                    HANG,
                    client.post(&url).bearer_auth(&key).json(&body).send(),
                )
                .await
                .expect("reqwest hung");
                let got = sent
                    .map(|r| r.status().as_u16())
                    .map_err(|e| format!("{e:?}"));
                assert_eq!(got, Ok(status), "what reqwest saw");
            }
        }
    };
    expect_each(broke_key.clone(), body, 20, 402).await;
    // and a body past `max_request_body_bytes`, from a key that can pay: 413, unread
    let too_large = json!({"model": "smollm2", "max_tokens": 8,
        "messages": [{"role": "user", "content": "x".repeat(8 << 20)}]});
    expect_each(t.api_key.clone(), too_large, 5, 413).await;
    // past `max_request_body_bytes` (4 MiB): refused on its declared length, unread
    let too_large = sdk(t.api_key.clone(), vec![8 << 20]).await;
    assert_eq!(
        too_large,
        [json!({"status": 413, "code": "request_too_large"})],
        "what the SDK saw"
    );
}
