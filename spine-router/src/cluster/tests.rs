//! Tests of multi-instance mode against the real Redis on 127.0.0.1:6379 (each test under its
//! own key prefix, deleted at the end).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::{AffinityKey, AffinityStore, NodeRegistry};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use spine_core::{ModelId, NodeDescriptor, NodeId};
use spine_transport::{StaticAuthenticator, TunnelServer, TunnelServerConfig};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::*;

pub(super) const REDIS: &str = "redis://127.0.0.1:6379";

fn prefix(test: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "spinetest:{test}:{}:{}:",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A llama.cpp node serving `models` (no context limit, every endpoint) with 4 slots on 8 GiB.
pub(super) fn desc(models: &[&str]) -> NodeDescriptor {
    spine_test_support::node_serving_models(models, 4, 8192)
}

struct Instance {
    cluster: Cluster,
    registry: NodeRegistry,
    stop: CancellationToken,
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn instance(prefix: &str, id: &str, redis_url: &str, internal_addr: &str) -> Instance {
    let server = TunnelServer::new(
        TunnelServerConfig::default(),
        Arc::new(StaticAuthenticator::new()),
        Arc::new(()),
    );
    instance_with(prefix, id, redis_url, internal_addr, server.tunnels()).await
}

/// An instance on the real Redis whose tunnels are `tunnels`.
async fn instance_on(
    prefix: &str,
    id: &str,
    internal_addr: &str,
    tunnels: spine_transport::Tunnels,
) -> Instance {
    instance_with(prefix, id, REDIS, internal_addr, tunnels).await
}

async fn instance_with(
    prefix: &str,
    id: &str,
    redis_url: &str,
    internal_addr: &str,
    tunnels: spine_transport::Tunnels,
) -> Instance {
    let registry = NodeRegistry::new();
    let stop = CancellationToken::new();
    let mut config = ClusterConfig::new(redis_url, SECRET);
    config.instance_id = id.into();
    config.key_prefix = prefix.into();
    let cluster = Cluster::start(
        &config,
        connect_redis(redis_url).unwrap(),
        internal_addr.into(),
        registry.clone(),
        vec![ModelId::new("m")],
        tunnels,
        stop.clone(),
    )
    .await;
    Instance {
        cluster,
        registry,
        stop,
    }
}

/// Writes the directory entry an owner publishes for `node` (serving model `m`, TTL 60 s) and
/// adds it to the node index.
async fn publish_node(
    conn: &mut redis::aio::MultiplexedConnection,
    p: &str,
    node: &str,
    owner: &str,
) {
    let _: () = redis::cmd("SET")
        .arg(format!("{p}node:{node}"))
        .arg(format!(
            "{owner} {}",
            serde_json::to_string(&desc(&["m"])).unwrap()
        ))
        .arg("PX")
        .arg(60_000)
        .query_async(conn)
        .await
        .unwrap();
    let _: i64 = redis::cmd("SADD")
        .arg(format!("{p}nodes"))
        .arg(node)
        .query_async(conn)
        .await
        .unwrap();
}

/// A connection of its own to the real Redis.
pub(super) async fn raw() -> redis::aio::MultiplexedConnection {
    redis::Client::open(REDIS)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn cleanup(prefix: &str) {
    let mut conn = raw().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    if !keys.is_empty() {
        let _: i64 = redis::cmd("DEL")
            .arg(&keys)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

async fn eventually(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let until = tokio::time::Instant::now() + within;
    while !f() {
        assert!(
            tokio::time::Instant::now() < until,
            "not within {within:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn client_name_keeps_only_safe_characters() {
    assert_eq!(client_name("spine:", "gw-0a1b2c3d"), "spine-gw-0a1b2c3d");
    assert_eq!(client_name("t:x y:", "a"), "txy-a");
}

#[tokio::test]
async fn directory_refresh_and_release_compare_the_owner() {
    let p = prefix("dir");
    let a = instance(&p, "gw-a", REDIS, "127.0.0.1:1001").await;
    let b = instance(&p, "gw-b", REDIS, "127.0.0.1:1002").await;
    let n1 = NodeId::new("n1");
    let mut conn = raw().await;

    a.cluster.claim(&n1, &desc(&["m"])).await.unwrap();
    assert!(a.cluster.refresh(&n1, &desc(&["m"])).await.unwrap());
    let ttl_ms: i64 = redis::cmd("PTTL")
        .arg(format!("{p}node:n1"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl_ms > 0 && ttl_ms <= 5000, "{ttl_ms}");
    // the node reconnected to b: a's refresh and release no longer touch it
    b.cluster.claim(&n1, &desc(&["m"])).await.unwrap();
    assert!(!a.cluster.refresh(&n1, &desc(&["m"])).await.unwrap());
    assert!(!a.cluster.release(&n1).await.unwrap());
    let value: String = redis::cmd("GET")
        .arg(format!("{p}node:n1"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(value.starts_with("gw-b {"), "{value}");
    let dir = a.cluster.read_directory().await.unwrap();
    assert_eq!(dir.len(), 1);
    assert_eq!(
        (
            dir[0].node.as_str(),
            dir[0].owner.as_str(),
            dir[0].owner_addr.as_str()
        ),
        ("n1", "gw-b", "127.0.0.1:1002")
    );
    assert_eq!(dir[0].descriptor, desc(&["m"]));

    // an entry whose owner has no liveness key is not offered; an index member whose entry
    // expired is dropped from the index
    let _: () = redis::cmd("SET")
        .arg(format!("{p}node:n9"))
        .arg(format!(
            "gw-dead {}",
            serde_json::to_string(&desc(&["m"])).unwrap()
        ))
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: i64 = redis::cmd("SADD")
        .arg(format!("{p}nodes"))
        .arg(vec!["n9", "ghost"])
        .query_async(&mut conn)
        .await
        .unwrap();
    let dir = a.cluster.read_directory().await.unwrap();
    assert_eq!(
        dir.iter().map(|e| e.node.as_str()).collect::<Vec<_>>(),
        ["n1"]
    );
    let ghost: bool = redis::cmd("SISMEMBER")
        .arg(format!("{p}nodes"))
        .arg("ghost")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!ghost);

    // b's entry reaches a's registry as a remote node, catalog-filtered, and leaves with it
    let n2 = NodeId::new("n2");
    b.cluster.local_ready(&n2, &desc(&["m", "not-in-catalog"]));
    eventually("n2 synced into a", Duration::from_secs(3), || {
        a.registry.contains(&n2)
    })
    .await;
    assert_eq!(a.registry.descriptor(&n2), Some(desc(&["m"])));
    assert_eq!(
        a.cluster.owner_of(&n2),
        Some(("gw-b".to_owned(), "127.0.0.1:1002".to_owned()))
    );
    // b's own registry is fed by its tunnel events, never by its own entries
    assert!(!b.registry.contains(&n2));
    b.cluster.local_gone(&n2);
    eventually("n2 gone from a", Duration::from_secs(3), || {
        !a.registry.contains(&n2)
    })
    .await;

    // release by the owner removes entry and index member
    assert!(b.cluster.release(&n1).await.unwrap());
    assert!(a.cluster.read_directory().await.unwrap().is_empty());

    // graceful leave removes the liveness key at once
    b.cluster.leave().await;
    let alive: bool = redis::cmd("EXISTS")
        .arg(format!("{p}instance:gw-b"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!alive);
    drop((a, b));
    cleanup(&p).await;
}

#[tokio::test]
async fn one_named_redis_connection_per_instance() {
    let p = prefix("conn");
    let id = format!("gw-conn{}", std::process::id());
    let a = instance(&p, &id, REDIS, "127.0.0.1:1001").await;
    let store = RedisAffinity::new(a.cluster.clone(), 60);
    // one Redis round trip, as the liveness check makes it (printed: part of the hop overhead)
    let mut took = Vec::new();
    for _ in 0..500 {
        let started = std::time::Instant::now();
        let _: Option<String> = a
            .cluster
            .redis(
                "test",
                redis::cmd("GET").arg(a.cluster.key("instance:gw-x")),
            )
            .await
            .unwrap();
        took.push(started.elapsed());
    }
    took.sort();
    println!(
        "redis GET through the shared connection: p50 {:?} p99 {:?}",
        took[took.len() / 2],
        took[took.len() * 99 / 100]
    );
    // many concurrent calls share the one multiplexed connection
    let mut calls = Vec::new();
    for i in 0..200u64 {
        let store = store.clone();
        calls.push(tokio::spawn(async move {
            let key = AffinityKey::Conversation(i);
            let m = ModelId::new("m");
            store.set(&m, &key, &NodeId::new("n")).await.unwrap();
            store.get(&m, &key).await.unwrap()
        }));
    }
    for c in calls {
        assert_eq!(c.await.unwrap(), Some(NodeId::new("n")));
    }
    let mut conn = raw().await;
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut conn)
        .await
        .unwrap();
    let name = format!("name={}", client_name(&p, &id));
    let named = list.lines().filter(|l| l.contains(&name)).count();
    assert_eq!(named, 1, "{list}");
    drop(a);
    cleanup(&p).await;
}

use spine_test_support::CutProxy;

#[tokio::test]
async fn redis_down_degrades_to_local_and_recovers() {
    let p = prefix("down");
    let proxy = CutProxy::start("127.0.0.1:6379".parse().unwrap())
        .await
        .unwrap();
    let a = instance(
        &p,
        "gw-a",
        &format!("redis://{}", proxy.addr()),
        "127.0.0.1:1001",
    )
    .await;
    let b = instance(&p, "gw-b", REDIS, "127.0.0.1:1002").await;
    let n1 = NodeId::new("n1");
    b.cluster.local_ready(&n1, &desc(&["m"]));
    eventually("n1 synced into a", Duration::from_secs(3), || {
        a.registry.contains(&n1)
    })
    .await;
    let store = RedisAffinity::new(a.cluster.clone(), 60);
    let (m, key) = (ModelId::new("m"), AffinityKey::Conversation(1));
    store.set(&m, &key, &n1).await.unwrap();
    assert_eq!(store.get(&m, &key).await.unwrap(), Some(n1.clone()));

    proxy.cut().await;
    // every call fails within its bound: no request hangs on Redis
    for _ in 0..5 {
        let started = std::time::Instant::now();
        let r = store.get(&m, &key).await;
        let took = started.elapsed();
        println!(
            "affinity get with Redis cut: {took:?} ({:?})",
            r.as_ref().err()
        );
        assert!(r.is_err());
        assert!(took < Duration::from_millis(300), "{took:?}");
    }
    assert!(a.cluster.redis_down());
    // remote nodes age out (REMOTE_TTL = 5 s); b, with Redis, keeps n1
    eventually("n1 aged out of a", Duration::from_secs(8), || {
        !a.registry.contains(&n1)
    })
    .await;

    proxy.restore().unwrap();
    eventually("a recovered", Duration::from_secs(10), || {
        a.registry.contains(&n1) && !a.cluster.redis_down()
    })
    .await;
    assert_eq!(store.get(&m, &key).await.unwrap(), Some(n1.clone()));
    drop((a, b));
    cleanup(&p).await;
}

const SECRET: &str = "0123456789abcdef-secret";

/// A relay error as the reference gateway renders it: its status, OpenAI's error shape.
fn render(e: &RelayError) -> http::Response<spine_core::BoxBody> {
    let status = e.status();
    let kind = if status.is_server_error() {
        "api_error"
    } else {
        "invalid_request_error"
    };
    let body =
        serde_json::json!({"error": {"message": e.to_string(), "type": kind, "code": e.code()}});
    http::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(spine_core::BoxBody::new(
            Full::new(Bytes::from(body.to_string())).map_err(|n| match n {}),
        ))
        .unwrap()
}

/// One request to an internal listener: status, `x-spine-refusal`, JSON body.
async fn h2_request(
    addr: std::net::SocketAddr,
    method: http::Method,
    headers: &[(&str, &str)],
    body: Bytes,
) -> (u16, Option<String>, serde_json::Value) {
    let client: hyper_util::client::legacy::Client<_, Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let resp = client
        .request(req.body(Full::new(body)).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let refusal = resp
        .headers()
        .get("x-spine-refusal")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        refusal,
        serde_json::from_slice(&body).unwrap_or_default(),
    )
}

/// The `Authorization` value a forwarder holding `secret` sends to `target` for a POST of
/// `body` to node `node` at `t_unix_ms` with `nonce`.
fn signature(
    secret: &str,
    target: &str,
    t_unix_ms: u64,
    nonce: u8,
    method: &str,
    node: &str,
    body: &[u8],
) -> String {
    use sha2::Digest as _;
    wire::SignedHead {
        target,
        t_unix_ms,
        nonce: [nonce; 16],
        method,
        path_and_query: "/v1/chat/completions",
        node: node.as_bytes(),
        body_sha256: sha2::Sha256::digest(body).into(),
    }
    .authorization(&wire::cluster_mac(secret.as_bytes()))
    .unwrap()
    .to_str()
    .unwrap()
    .to_owned()
}

/// An owner instance `gw-owner` with a real tunnel listener, one node `n1` on it, and its
/// internal listener ([`owner_with_node`]); `seen`: the bodies a recording node got.
struct Owner {
    instance: Instance,
    internal_addr: std::net::SocketAddr,
    tunnels: spine_transport::Tunnels,
    seen: Arc<std::sync::Mutex<Vec<Bytes>>>,
    tasks: Vec<tokio::task::AbortHandle>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// An owner with one node `n1` whose agent records the body of every chat request and
/// answers 200 `{"ok":true}`.
async fn owner_with_recording_node(p: &str) -> Owner {
    let seen: Arc<std::sync::Mutex<Vec<Bytes>>> = Arc::default();
    let record = seen.clone();
    let agent = tower::service_fn(move |req: http::Request<hyper::body::Incoming>| {
        let record = record.clone();
        async move {
            // the tunnel's own probes (health, models) are not relayed requests
            if req.uri().path() == "/v1/chat/completions" {
                let body = req.into_body().collect().await.unwrap().to_bytes();
                record.lock().unwrap().push(body);
            }
            let resp = http::Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .body(spine_core::BoxBody::new(
                    Full::new(Bytes::from_static(b"{\"ok\":true}")).map_err(|n| match n {}),
                ))
                .unwrap();
            Ok::<_, std::convert::Infallible>(resp)
        }
    });
    let mut owner = owner_with_node(p, agent).await;
    owner.seen = seen;
    owner
}

/// An owner instance `gw-owner` with a real (plaintext) tunnel listener, one node `n1` on it
/// whose agent is `agent`, and its internal listener; returns once n1's tunnel is up.
async fn owner_with_node<A>(p: &str, agent: A) -> Owner
where
    A: tower::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<spine_core::BoxBody>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    A::Future: Send + 'static,
{
    use spine_transport::{NodeIdentity, TunnelClient, TunnelClientConfig};
    let n1 = NodeId::new("n1");
    let identity = NodeIdentity::generate().unwrap();
    let auth = StaticAuthenticator::new().with_key(identity.public_key_text(), n1.clone());
    let server = TunnelServer::new(TunnelServerConfig::default(), Arc::new(auth), Arc::new(()));
    let tunnels = server.tunnels();
    let tunnel_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tunnel_port = tunnel_listener.local_addr().unwrap().port();
    let tunnel_task = tokio::spawn(async move {
        let _ = server.serve(tunnel_listener, None).await;
    });
    let internal_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let internal_addr = internal_listener.local_addr().unwrap();
    let instance = instance_on(p, "gw-owner", &internal_addr.to_string(), tunnels.clone()).await;
    let internal_task = tokio::spawn(serve_internal(
        internal_listener,
        instance.cluster.clone(),
        spine_transport::ListenerLimits::default(),
        render,
    ));
    let mut config = TunnelClientConfig::new(
        format!("ws://127.0.0.1:{tunnel_port}/v1/tunnel"),
        identity,
        desc(&["m"]),
    );
    config.allow_insecure_plaintext = true;
    let node_task = tokio::spawn(TunnelClient::new(config).unwrap().run(agent));
    eventually(
        "n1's tunnel up on the owner",
        Duration::from_secs(5),
        || tunnels.contains(&n1),
    )
    .await;
    Owner {
        instance,
        internal_addr,
        tunnels,
        seen: Arc::default(),
        tasks: vec![
            tunnel_task.abort_handle(),
            internal_task.abort_handle(),
            node_task.abort_handle(),
        ],
    }
}

/// `POST` of `body` to `n1` through the internal listener at `addr`, signed for `gw-owner`, tried
/// until it is relayed (the node may still be warming up for a moment: each try is a fresh
/// nonce), for 5 s at most: the last try's signature and answer.
async fn post_signed_until_relayed(
    addr: std::net::SocketAddr,
    body: &Bytes,
) -> (String, (u16, Option<String>, serde_json::Value)) {
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut nonce = 1u8;
    loop {
        let auth = signature(
            SECRET,
            "gw-owner",
            wire::unix_ms(),
            nonce,
            "POST",
            "n1",
            body,
        );
        let headers = [("x-spine-node-id", "n1"), ("authorization", auth.as_str())];
        let answer = h2_request(addr, http::Method::POST, &headers, body.clone()).await;
        if answer.0 == 200 || tokio::time::Instant::now() >= until {
            return (auth, answer);
        }
        nonce += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The internal listener relays a request signed for it, and refuses every other with its own
/// 401 code (and `x-spine-refusal`), before anything reaches the tunnel. Real tunnel, real
/// internal listener, real Redis.
#[tokio::test]
async fn internal_listener_checks_the_forwarding_signature() {
    let p = prefix("auth");
    let owner = owner_with_recording_node(&p).await;
    let addr = owner.internal_addr;
    let body = Bytes::from_static(b"{\"model\":\"m\",\"messages\":[]}");
    let now = wire::unix_ms();
    let post = |auth: String, body: Bytes| async move {
        let headers = [("x-spine-node-id", "n1"), ("authorization", auth.as_str())];
        h2_request(addr, http::Method::POST, &headers, body).await
    };

    // correctly signed: relayed, the node gets exactly the body
    let (good, (status, refusal, json)) = post_signed_until_relayed(addr, &body).await;
    assert_eq!((status, refusal), (200, None), "{json}");
    assert_eq!(json["ok"], true);
    assert_eq!(*owner.seen.lock().unwrap(), vec![body.clone()]);

    let other = Bytes::from_static(b"{\"model\":\"m\",\"messages\":[],\"max_tokens\":100000}");
    let cases: Vec<(&str, Option<String>, Bytes, &str)> = vec![
        (
            "missing header",
            None,
            body.clone(),
            "missing_cluster_signature",
        ),
        (
            "the old bearer secret",
            Some(format!("Bearer {SECRET}")),
            body.clone(),
            "invalid_cluster_signature",
        ),
        (
            "wrong secret",
            Some(signature(
                "another-secret-0123456",
                "gw-owner",
                now,
                101,
                "POST",
                "n1",
                &body,
            )),
            body.clone(),
            "invalid_cluster_signature",
        ),
        (
            "signed for another node",
            Some(signature(SECRET, "gw-owner", now, 102, "POST", "n2", &body)),
            body.clone(),
            "invalid_cluster_signature",
        ),
        (
            "wrong target instance",
            Some(signature(SECRET, "gw-other", now, 103, "POST", "n1", &body)),
            body.clone(),
            "wrong_cluster_target",
        ),
        (
            "31 s old",
            Some(signature(
                SECRET,
                "gw-owner",
                now - 31_000,
                104,
                "POST",
                "n1",
                &body,
            )),
            body.clone(),
            "stale_cluster_signature",
        ),
        (
            "31 s ahead",
            Some(signature(
                SECRET,
                "gw-owner",
                now + 31_000,
                105,
                "POST",
                "n1",
                &body,
            )),
            body.clone(),
            "stale_cluster_signature",
        ),
        (
            "replayed",
            Some(good.clone()),
            body.clone(),
            "replayed_cluster_signature",
        ),
        (
            "body altered after signing",
            Some(signature(SECRET, "gw-owner", now, 106, "POST", "n1", &body)),
            other.clone(),
            "cluster_body_mismatch",
        ),
    ];
    for (what, auth, body, code) in cases {
        let mut headers = vec![("x-spine-node-id", "n1")];
        if let Some(auth) = &auth {
            headers.push(("authorization", auth.as_str()));
        }
        let (status, refusal, json) = h2_request(addr, http::Method::POST, &headers, body).await;
        assert_eq!(status, 401, "{what}: {json}");
        assert_eq!(json["error"]["code"], code, "{what}");
        assert_eq!(json["error"]["type"], "invalid_request_error", "{what}");
        assert!(json["error"]["message"].is_string(), "{what}");
        assert_eq!(refusal.as_deref(), Some(code), "{what}");
    }
    // a signed GET is no relay either; a signed request for a node that is not here is a refusal
    let auth = signature(SECRET, "gw-owner", now, 107, "GET", "n1", &body);
    let headers = [("x-spine-node-id", "n1"), ("authorization", auth.as_str())];
    let (status, _, _) = h2_request(addr, http::Method::GET, &headers, body.clone()).await;
    assert_eq!(status, 405);
    let auth = signature(SECRET, "gw-owner", now, 108, "POST", "n9", &body);
    let headers = [("x-spine-node-id", "n9"), ("authorization", auth.as_str())];
    let (status, refusal, json) =
        h2_request(addr, http::Method::POST, &headers, body.clone()).await;
    assert_eq!((status, refusal.as_deref()), (503, Some("node_moved")));
    assert_eq!(json["error"]["code"], "node_moved");
    // a body over the gateway's limit (plus the slack): 413, unread past the bound
    owner.instance.cluster.set_max_request_body_bytes(1024);
    let big = Bytes::from(vec![b' '; 1024 + internal::FORWARDED_BODY_SLACK_BYTES + 1]);
    let auth = signature(SECRET, "gw-owner", now, 109, "POST", "n1", &big);
    let (status, refusal, json) = post(auth, big).await;
    assert_eq!(
        (status, refusal.as_deref()),
        (413, Some("request_too_large"))
    );
    assert_eq!(json["error"]["code"], "request_too_large");
    assert_eq!(json["error"]["type"], "invalid_request_error");

    // nothing but the one good request reached the node
    assert_eq!(*owner.seen.lock().unwrap(), vec![body]);
    assert!(owner.tunnels.contains(&NodeId::new("n1")));
    drop(owner);
    cleanup(&p).await;
}

#[test]
fn the_replay_cache_refuses_a_nonce_until_it_expires_and_is_bounded() {
    let mut cache = internal::ReplayCache::new(2);
    assert_eq!(cache.record(&[1; 16], 1_000, 0), Ok(()));
    assert_eq!(
        cache.record(&[1; 16], 1_000, 999),
        Err(internal::RelayRefusal::Replayed)
    );
    assert_eq!(cache.record(&[2; 16], 1_500, 999), Ok(()));
    // full of unexpired nonces: refused, nothing evicted
    assert_eq!(
        cache.record(&[3; 16], 1_500, 1_000),
        Err(internal::RelayRefusal::ReplayCacheFull)
    );
    assert_eq!(
        cache.record(&[1; 16], 1_000, 1_000),
        Err(internal::RelayRefusal::Replayed)
    );
    assert_eq!(cache.len(), 2);
    // past its expiry the first is pruned, which makes room
    assert_eq!(cache.record(&[3; 16], 2_000, 1_001), Ok(()));
    assert_eq!(cache.len(), 2);
    assert_eq!(
        cache.record(&[2; 16], 1_500, 1_001),
        Err(internal::RelayRefusal::Replayed)
    );
}

/// What the forwarder sends to the address an owner's liveness key names: a fake owner (a plain
/// h2 listener standing in for whatever that address is) captures it. The secret is nowhere in
/// it; the signature verifies for the owner the directory named and for no other instance.
#[tokio::test]
async fn the_forwarder_signs_and_never_sends_the_secret() {
    use tower::Service as _;
    let p = prefix("sign");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(http::request::Parts, Bytes)>();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fake_addr = listener.local_addr().unwrap();
    let fake = tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let tx = tx.clone();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let tx = tx.clone();
                        async move {
                            let (parts, body) = req.into_parts();
                            let body = body.collect().await.unwrap().to_bytes();
                            let _ = tx.send((parts, body));
                            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                                Bytes::from_static(b"{}"),
                            )))
                        }
                    });
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
            });
        }
    });

    // the directory names gw-b as n1's owner, alive at the fake owner's address
    let mut conn = raw().await;
    publish_node(&mut conn, &p, "n1", "gw-b").await;
    let _: () = redis::cmd("SET")
        .arg(format!("{p}instance:gw-b"))
        .arg(fake_addr.to_string())
        .arg("PX")
        .arg(60_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    let a = instance(&p, "gw-a", REDIS, "127.0.0.1:1001").await;
    let n1 = NodeId::new("n1");
    eventually("n1 synced into a", Duration::from_secs(3), || {
        a.registry.contains(&n1)
    })
    .await;

    let body = Bytes::from_static(
        b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}",
    );
    let mut req = http::Request::post("/v1/chat/completions?x=1")
        .header("authorization", "Bearer sk-the-callers-own-key")
        .header("content-type", "application/json")
        .body(spine_core::BoxBody::new(
            Full::new(body.clone()).map_err(|n| match n {}),
        ))
        .unwrap();
    req.extensions_mut().insert(n1.clone());
    let resp = cluster_service(&a.cluster).call(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let (parts, received) = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap()
        .unwrap();
    fake.abort();
    drop(a);
    cleanup(&p).await;

    assert_eq!(received, body);
    assert_eq!(
        parts.uri.path_and_query().unwrap(),
        "/v1/chat/completions?x=1"
    );
    assert_eq!(parts.headers["x-spine-node-id"], "n1");
    for (name, value) in &parts.headers {
        let bytes = value.as_bytes();
        assert!(
            !bytes.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
            "the secret travels in {name}"
        );
        assert!(
            !bytes.windows(8).any(|w| w == b"sk-the-c"),
            "the caller's key travels in {name}"
        );
    }
    assert_eq!(parts.headers.get_all("authorization").iter().count(), 1);
    let auth = parts.headers["authorization"].clone();
    assert!(auth
        .to_str()
        .unwrap()
        .starts_with("Spine-HMAC-SHA256 v=1,i=gw-b,t="));

    let mac = wire::cluster_mac(SECRET.as_bytes());
    let verify = |own_id: &str, auth: &http::HeaderValue| {
        internal::verify_head(
            &mac,
            own_id,
            wire::unix_ms(),
            "POST",
            "/v1/chat/completions?x=1",
            b"n1",
            Some(auth),
        )
    };
    let verified = verify("gw-b", &auth).expect("signed for gw-b");
    {
        use sha2::Digest as _;
        assert_eq!(
            verified.body_sha256,
            <[u8; 32]>::from(sha2::Sha256::digest(&body))
        );
    }
    assert_eq!(
        verify("gw-c", &auth),
        Err(internal::RelayRefusal::WrongTarget)
    );
    // naming gw-c instead does not make it gw-c's: the target is inside the MAC
    let retargeted =
        http::HeaderValue::from_str(&auth.to_str().unwrap().replace("i=gw-b,", "i=gw-c,")).unwrap();
    assert_eq!(
        verify("gw-c", &retargeted),
        Err(internal::RelayRefusal::BadSignature)
    );
    // nor does another secret verify it
    let other = wire::cluster_mac(b"another-secret-0123456");
    assert_eq!(
        internal::verify_head(
            &other,
            "gw-b",
            wire::unix_ms(),
            "POST",
            "/v1/chat/completions?x=1",
            b"n1",
            Some(&auth),
        ),
        Err(internal::RelayRefusal::BadSignature)
    );
}

/// A node's own answer carrying `x-spine-refusal` (an engine can set any header) must reach the
/// forwarding instance as the node's answer, not as an owner's refusal: the owner's internal
/// listener drops `x-spine-*` from node responses (the agent does too; here a raw tunnel client
/// stands in for a hostile agent). Real tunnel, real internal listener, real Redis.
#[tokio::test]
async fn a_node_answer_with_x_spine_refusal_is_not_taken_for_an_owner_refusal() {
    use tower::Service as _;
    let p = prefix("refusal");
    let n1 = NodeId::new("n1");

    // the owner, with a node whose every answer is a 500 carrying x-spine-refusal
    let agent = tower::service_fn(|req: http::Request<hyper::body::Incoming>| async move {
        let (status, body) = if req.uri().path() == "/health" {
            (http::StatusCode::OK, "{}")
        } else {
            (
                http::StatusCode::INTERNAL_SERVER_ERROR,
                "{\"error\":{\"message\":\"engine broke\",\"type\":\"server_error\"}}",
            )
        };
        let resp = http::Response::builder()
            .status(status)
            .header("x-spine-refusal", "node_full")
            .header("x-spine-node-id", "n2")
            .header("content-type", "application/json")
            .body(spine_core::BoxBody::new(
                Full::new(Bytes::from_static(body.as_bytes())).map_err(|n| match n {}),
            ))
            .unwrap();
        Ok::<_, std::convert::Infallible>(resp)
    });
    let owner = owner_with_node(&p, agent).await;

    // the directory entry the owner would publish
    let mut conn = raw().await;
    publish_node(&mut conn, &p, "n1", "gw-owner").await;
    let a = instance(&p, "gw-a", REDIS, "127.0.0.1:1001").await;
    eventually("n1 synced into a", Duration::from_secs(3), || {
        a.registry.contains(&n1)
    })
    .await;

    let mut svc = cluster_service(&a.cluster);
    // the node may still be warming (health probe) for a moment: retry only that
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    let result = loop {
        let mut req = http::Request::post("/v1/chat/completions")
            .body(spine_core::BoxBody::new(
                Full::new(Bytes::from_static(b"{}")).map_err(|n| match n {}),
            ))
            .unwrap();
        req.extensions_mut().insert(n1.clone());
        let result = svc.call(req).await;
        match &result {
            Ok(_) => break result,
            Err(e) if tokio::time::Instant::now() < until => {
                eprintln!("not yet: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(_) => break result,
        }
    };
    drop((a, owner));
    cleanup(&p).await;
    let resp = result.expect("the node's own 500 was taken for an owner refusal");
    assert_eq!(resp.status(), 500);
    assert!(resp.headers().get("x-spine-refusal").is_none());
    assert!(resp.headers().get("x-spine-node-id").is_none());
    assert_eq!(
        resp.headers().get("content-type").unwrap(),
        "application/json"
    );
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body).unwrap()["error"]["message"],
        "engine broke"
    );
}

/// A captured forwarded request replayed (within its 30 s window) against the same owner
/// instance id after the owner restarted: the new process's replay cache is empty, so a request
/// signed before the process began is refused as stale and never reaches the tunnel.
#[tokio::test]
async fn a_capture_replayed_after_the_owner_restarts_is_refused() {
    let p = prefix("probe-restart");
    let body = Bytes::from_static(b"{\"model\":\"m\",\"messages\":[]}");
    let owner = owner_with_recording_node(&p).await;
    let addr = owner.internal_addr;
    // the captured request: signed for gw-owner, relayed once
    let (captured, (status, _, json)) = post_signed_until_relayed(addr, &body).await;
    assert_eq!(status, 200, "{json}");
    // the owner restarts (deploy): same instance id, fresh process state
    drop(owner);
    cleanup(&p).await;
    let owner = owner_with_recording_node(&p).await;
    let headers = [
        ("x-spine-node-id", "n1"),
        ("authorization", captured.as_str()),
    ];
    let (status, refusal, json) = h2_request(
        owner.internal_addr,
        http::Method::POST,
        &headers,
        body.clone(),
    )
    .await;
    let seen = owner.seen.lock().unwrap().len();
    drop(owner);
    cleanup(&p).await;
    assert_eq!(
        (status, refusal.as_deref(), seen),
        (401, Some("stale_cluster_signature"), 0),
        "replayed request after restart: {json}"
    );
}

/// One forwarder whose clock is 29 s ahead (within the allowed skew) sends nonces that expire
/// later than those that arrive after them; pruning must still find the expired ones (with an
/// arrival-order queue, 1,917 of these valid requests were refused although the load stays
/// below the cap).
#[test]
fn the_replay_cache_prunes_by_expiry_whatever_the_arrival_order() {
    // ~83 forwarded requests a second: 2,500 unexpired in a 30 s window, under the cap of 3,000
    let run = |with_skewed: bool| {
        let mut cache = internal::ReplayCache::new(3_000);
        let mut refused = 0;
        for (n, ms) in (0..90_000u64).step_by(12).enumerate() {
            let now = 1_000_000 + ms;
            let mut nonce = [0u8; 16];
            nonce[..8].copy_from_slice(&(n as u64).to_be_bytes());
            // one request a second from an instance whose clock is 29 s ahead (allowed skew)
            let t = if with_skewed && ms % 996 == 0 {
                now + 29_000
            } else {
                now
            };
            if cache.record(&nonce, t + 30_000, now).is_err() {
                refused += 1;
            }
        }
        refused
    };
    assert_eq!(run(false), 0, "control");
    let refused = run(true);
    assert_eq!(
        refused, 0,
        "refused {refused} valid forwarded requests once one peer's clock is 29 s ahead"
    );
}
