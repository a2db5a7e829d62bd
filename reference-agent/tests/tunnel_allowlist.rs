//! The agent is a safe guest (design brief §9): requests driven FROM THE GATEWAY SIDE through a
//! real TLS tunnel (spine-transport's `Tunnels::send`) to a running `reference-agent` process
//! reach only the engine's inference paths. Every other path or method is answered 403 by the
//! agent, logged without its body, and the engine sees nothing of it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt as _, Full};
use spine_core::{BoxBody, NodeId};
use spine_test_support::{Child, FakeEngine, FakeKind};
use spine_transport::{StaticAuthenticator, TunnelServer, TunnelServerConfig, Tunnels};
use tokio::process::Command;

const AGENT: &str = env!("CARGO_BIN_EXE_reference-agent");
/// Put in every refused request's body: must never reach the agent's log.
const SECRET_BODY: &str = "owner-secret-body-5f3a9c";

struct Harness<E = FakeEngine> {
    _dir: tempfile::TempDir,
    tunnels: Tunnels,
    node: NodeId,
    agent: Child,
    engine: E,
}

async fn start(kind: FakeKind, engine_flag: &str, model: &str) -> Harness {
    let engine = FakeEngine::start(kind, model, 4096).await.unwrap();
    let url = engine.url.clone();
    start_with(engine, &url, engine_flag).await
}

/// An in-process tunnel server and a `reference-agent run` process serving `engine_url`.
async fn start_with<E>(engine: E, engine_url: &str, engine_flag: &str) -> Harness<E> {
    let dir = tempfile::tempdir().unwrap();

    // the node's identity, registered with an in-process tunnel server
    let key = dir.path().join("node.key");
    let out = Command::new(AGENT)
        .args(["keygen", "--out"])
        .arg(&key)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let public = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let node = NodeId::new("node_1");
    let auth = StaticAuthenticator::new().with_key(public, node.clone());
    let mut config = TunnelServerConfig::default();
    config.health_probe_interval = Duration::from_millis(50);
    let server = TunnelServer::new(config, Arc::new(auth), Arc::new(()));
    let tunnels = server.tunnels();
    let (cert, key_pem) = spine_transport::self_signed_cert(&["localhost".into()]).unwrap();
    let tls = spine_transport::server_config_from_pem(&cert, &key_pem).unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, cert).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(server.serve(listener, Some(tls)));

    let mut cmd = Command::new(AGENT);
    cmd.arg("run")
        .arg("--gateway")
        .arg(format!("wss://localhost:{port}/v1/tunnel"))
        .arg("--identity")
        .arg(&key)
        .arg("--ca-file")
        .arg(&ca)
        .args(["--engine", engine_flag, "--engine-url", engine_url])
        .env("RUST_LOG", "trace");
    let agent = Child::spawn("agent", cmd).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while tunnels.connected().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the agent never became routable; stderr:\n{}",
            agent.stderr_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Harness {
        _dir: dir,
        tunnels,
        node,
        agent,
        engine,
    }
}

fn body(bytes: &'static str) -> BoxBody {
    Full::new(Bytes::from_static(bytes.as_bytes()))
        .map_err(|e| match e {})
        .boxed_unsync()
}

async fn send<E>(
    h: &Harness<E>,
    method: Method,
    path: &str,
    json: &'static str,
) -> (StatusCode, Bytes) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .header(
            "authorization",
            "Bearer sk-caller-key-must-not-reach-the-engine",
        )
        .header("x-spine-node", "node_1")
        .body(body(json))
        .unwrap();
    let resp = h.tunnels.send(&h.node, req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, bytes)
}

/// Paths of the engines' own APIs and of other local services, path tricks, and allowed paths
/// with the wrong method.
const FORBIDDEN: &[(&str, &str)] = &[
    ("GET", "/"),
    ("GET", "/slots"),
    ("POST", "/slots/0?action=save"),
    ("GET", "/props"),
    ("POST", "/props"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/completion"),
    ("GET", "/api/tags"),
    ("POST", "/api/pull"),
    ("DELETE", "/api/delete"),
    ("POST", "/api/chat"),
    ("GET", "/get_model_info"),
    ("POST", "/flush_cache"),
    ("POST", "/update_weights_from_disk"),
    ("GET", "/version"),
    ("GET", "/../../etc/passwd"),
    ("GET", "/v1/../slots"),
    ("POST", "/v1/chat/completions/../../slots"),
    ("POST", "/v1/chat/completions/"),
    ("POST", "/V1/chat/completions"),
    ("POST", "/v1/chat/completions%2F..%2F..%2Fslots"),
    ("POST", "//v1/chat/completions"),
    ("GET", "/v1/chat/completions"),
    ("PUT", "/v1/completions"),
    ("DELETE", "/v1/models"),
    ("POST", "/v1/models"),
    ("PATCH", "/v1/embeddings"),
    ("POST", "/health"),
    ("GET", "/v1/files"),
    ("POST", "/v1/audio/transcriptions"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forbidden_paths_through_the_tunnel_are_403_and_never_reach_the_engine() {
    let h = start(FakeKind::Vllm, "vllm", "m1").await;
    let before = h.engine.seen().len();
    for (method, path) in FORBIDDEN {
        let (status, bytes) = send(&h, method.parse().unwrap(), path, {
            // a body the log must never show
            "{\"model\":\"m1\",\"prompt\":\"owner-secret-body-5f3a9c\"}"
        })
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{method} {path}");
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {"message": "this path is not served by the node",
                "type": "invalid_request_error", "code": "path_not_allowed"}}),
            "{method} {path}"
        );
    }
    // since the node became routable (the agent's own start-up probes come before), the engine
    // saw nothing but the gateway's health probes (GET /health)
    let seen = h.engine.seen();
    let unexpected: Vec<_> = seen[before..]
        .iter()
        .filter(|r| !(r.method == "GET" && r.path == "/health"))
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert!(unexpected.is_empty(), "the engine saw {unexpected:?}");

    // every refusal was logged, without the body
    let log = h.agent.stderr_lines();
    let refusals = log
        .iter()
        .filter(|l| l.contains("refused a tunnel request outside the engine allowlist"))
        .count();
    assert_eq!(refusals, FORBIDDEN.len(), "{}", h.agent.stderr_tail(40));
    assert!(
        !log.iter().any(|l| l.contains(SECRET_BODY)),
        "a request body reached the agent's log"
    );

    // positive control: an allowed path reaches the engine, scrubbed
    let (status, bytes) = send(
        &h,
        Method::POST,
        "/v1/chat/completions?debug=1",
        "{\"model\":\"m1\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}",
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello from vllm");
    let chat: Vec<_> = h.engine.seen()[before..]
        .iter()
        .filter(|r| r.path != "/health")
        .cloned()
        .collect();
    assert_eq!(chat.len(), 1);
    assert_eq!(chat[0].method, "POST");
    assert_eq!(chat[0].path, "/v1/chat/completions");
    assert_eq!(chat[0].header("authorization"), None);
    assert_eq!(chat[0].header("x-spine-node"), None);
    assert_eq!(chat[0].header("content-type"), Some("application/json"));
}

/// Each engine fake behind a real agent and tunnel: health mapped to the engine's health path,
/// models and a streamed chat with usage pass through unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_engine_fake_serves_through_a_real_agent() {
    for (kind, flag, model, health) in [
        (
            FakeKind::Vllm,
            "vllm",
            "Qwen/Qwen2.5-0.5B-Instruct",
            "/health",
        ),
        (
            FakeKind::Sglang,
            "sglang",
            "qwen/qwen2.5-0.5b-instruct",
            "/health",
        ),
        (FakeKind::Ollama, "ollama", "smollm2:135m", "/api/version"),
        (FakeKind::Ollama, "auto", "smollm2:135m", "/api/version"),
    ] {
        let h = start(kind, flag, model).await;
        let (d_node, descriptor) = h.tunnels.connected().remove(0);
        assert_eq!(d_node, h.node);
        assert_eq!(descriptor.models.len(), 1, "{flag}");
        assert_eq!(descriptor.models[0].id.as_str(), model);
        assert_eq!(
            descriptor.models[0].max_context_tokens,
            Some(4096),
            "{flag}"
        );
        // the gateway's warm-up probe reached the engine's own health path
        assert!(
            h.engine
                .seen()
                .iter()
                .any(|r| r.method == "GET" && r.path == health),
            "{flag}: no probe of {health}"
        );
        let req = format!(
            "{{\"model\":\"{model}\",\"stream\":true,\"stream_options\":{{\"include_usage\":true}},\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}"
        );
        let req = Request::post("/v1/chat/completions")
            .header("content-type", "application/json")
            .body(
                Full::new(Bytes::from(req))
                    .map_err(|e| match e {})
                    .boxed_unsync(),
            )
            .unwrap();
        let resp = h.tunnels.send(&h.node, req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let text = String::from_utf8(
            resp.into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .to_vec(),
        )
        .unwrap();
        assert!(text.contains("\"usage\":{"), "{flag}: {text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{flag}: {text}");
        let (status, _) = send(&h, Method::GET, "/v1/models", "").await;
        assert_eq!(status, StatusCode::OK);
    }
}

/// llama.cpp's quirks, shown on the real engine and handled by the agent: `llama-server` answers
/// malformed JSON with 500 (the gateway would blame the node) and any model name with its loaded
/// model. Through the agent, the first is a 400 and the second a 404, and the engine sees
/// neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_cpp_quirks_are_answered_by_the_agent() {
    let engine = spine_test_support::Engine::discover().unwrap();
    let llama = spine_test_support::LlamaServer::start(&engine, 1)
        .await
        .unwrap();
    let url = llama.url.clone();
    let direct = reqwest::Client::new();
    // the quirks, on the engine itself
    let r = direct
        .post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 500);
    let r = direct
        .post(format!("{url}/v1/chat/completions"))
        .json(&serde_json::json!({"model": "gpt-4o", "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "llama-server answers any model name");

    let h = start_with(llama, &url, "llama.cpp").await;
    for (path, body, status, code) in [
        ("/v1/chat/completions", "{not json", 400, "invalid_json"),
        ("/v1/completions", "[1,2]", 400, "invalid_json"),
        ("/v1/completions", "[\"smollm2\"]", 400, "invalid_json"),
        ("/v1/completions", "{\"model\":\"smollm2\"} trailing", 400, "invalid_json"),
        (
            "/v1/chat/completions",
            "{\"model\":\"gpt-4o\",\"max_tokens\":1,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}",
            404,
            "model_not_found",
        ),
        ("/v1/embeddings", "{\"input\":\"no model\"}", 404, "model_not_found"),
    ] {
        let (s, bytes) = send(&h, Method::POST, path, body).await;
        assert_eq!(s.as_u16(), status, "{path} {body}");
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["error"]["code"], code, "{path} {body}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    // the served model still goes through
    let (s, bytes) = send(
        &h,
        Method::POST,
        "/v1/chat/completions",
        "{\"model\":\"smollm2\",\"max_tokens\":2,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}",
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["object"], "chat.completion");
    // the agent forwarded exactly one chat request: the refused ones never reached the engine
    let forwarded_chats = h
        .agent
        .stderr_lines()
        .iter()
        .filter(|l| l.contains("forwarding to the engine") && l.contains("/v1/chat/completions"))
        .count();
    assert_eq!(forwarded_chats, 1, "{}", h.agent.stderr_tail(30));
    drop(h.engine);
}
