//! Scale load tool: opens N simulated nodes against one tunnel server, each with a real
//! TCP + TLS + WebSocket connection and a signed ed25519 handshake, serving HTTP/2 like an agent;
//! reports the server's resident memory per tunnel and the handshake rate.
//!
//! ```text
//! cargo run -p spine-transport --example tunnel_load -- [--nodes N] [--sources K] [--concurrency C]
//!     [--hold-secs S] [--health-check-secs H]
//! ```
//!
//! The server runs in a child process (this binary with `--serve`) so its memory is measured
//! alone: `VmRSS` from `/proc/<pid>/status` before the first tunnel and once all N are ready,
//! divided by N. Source addresses 127.0.0.1 ..= 127.0.0.K spread the connections past the
//! ~28,000 ephemeral ports per source address; the file-descriptor limit is raised with
//! `prlimit` (root may raise the hard limit; otherwise the soft limit goes up to the hard one).
//! Prints one JSON line with the results on stdout.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use spine_core::{BoxBody, EngineKind, ModelDescriptor, ModelId, NodeDescriptor, NodeId};
use spine_transport::{
    NodeAuthenticator, NodeIdentity, RefusalReason, TunnelClient, TunnelClientConfig, TunnelEvents,
    TunnelServer, TunnelServerConfig,
};
use tokio::io::AsyncBufReadExt as _;
use tokio::net::TcpListener;

const FD_LIMIT: u64 = 1_048_576;

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().expect("a number"))
}

fn seed(i: u64) -> [u8; 32] {
    let mut s = [7u8; 32];
    s[..8].copy_from_slice(&i.to_le_bytes());
    s
}

fn descriptor() -> NodeDescriptor {
    NodeDescriptor {
        engine: EngineKind::LlamaCpp,
        models: vec![ModelDescriptor {
            id: ModelId::new("sim"),
            max_context_tokens: None,
            endpoints: None,
        }],
        vram_mib: 0,
        max_concurrency: 4,
        agent_version: "tunnel-load".into(),
    }
}

fn raise_fd_limit() {
    let pid = std::process::id().to_string();
    let status = std::process::Command::new("prlimit")
        .args(["--pid", &pid, &format!("--nofile={FD_LIMIT}:{FD_LIMIT}")])
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        eprintln!(
            "tunnel_load: could not raise RLIMIT_NOFILE to {FD_LIMIT} (need root); continuing"
        );
    }
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Keys derived from the node index, so both processes know them without exchanging them.
struct DerivedKeys(HashMap<String, NodeId>);

impl NodeAuthenticator for DerivedKeys {
    fn authenticate<'a>(
        &'a self,
        public_key_text: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<NodeId, RefusalReason>> + Send + 'a>> {
        let res = self
            .0
            .get(public_key_text)
            .cloned()
            .ok_or(RefusalReason::UnknownKey);
        Box::pin(std::future::ready(res))
    }
}

struct Count(Arc<AtomicUsize>);

impl TunnelEvents for Count {
    fn node_ready(&self, _node: &NodeId, _descriptor: &NodeDescriptor) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn node_gone(&self, _node: &NodeId) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Child: the tunnel server. Prints `port <p>` once listening, then `ready <n>` lines.
async fn serve(nodes: u64, health_check_secs: u64) {
    let keys = (0..nodes)
        .map(|i| {
            let id = NodeIdentity::from_seed(&seed(i));
            (id.public_key_text(), NodeId::new(format!("node_{i}")))
        })
        .collect();
    let (cert, key) =
        spine_transport::self_signed_cert(&["localhost".into(), "127.0.0.1".into()]).unwrap();
    std::fs::write(std::env::temp_dir().join("tunnel_load_ca.pem"), &cert).unwrap();
    let tls = spine_transport::server_config_from_pem(&cert, &key).unwrap();
    let mut config = TunnelServerConfig::default();
    config.health_check_interval = Duration::from_secs(health_check_secs);
    config.handshake_timeout = Duration::from_secs(60);
    config.challenge_max_age = Duration::from_secs(60);
    let ready = Arc::new(AtomicUsize::new(0));
    let server = TunnelServer::new(
        config,
        Arc::new(DerivedKeys(keys)),
        Arc::new(Count(ready.clone())),
    );
    let listener = TcpListener::bind("0.0.0.0:0").await.unwrap();
    // a deep accept queue for the connection bursts
    let port = listener.local_addr().unwrap().port();
    println!("port {port}");
    tokio::spawn(server.serve(listener, Some(tls)));
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        println!("ready {}", ready.load(Ordering::Relaxed));
    }
}

fn agent_service() -> impl tower::Service<
    http::Request<hyper::body::Incoming>,
    Response = http::Response<BoxBody>,
    Error = Infallible,
    Future = impl Send + 'static,
> + Clone
       + Send
       + 'static {
    tower::service_fn(|req: http::Request<hyper::body::Incoming>| async move {
        let body = if req.uri().path() == "/v1/models" {
            Bytes::from_static(br#"{"object":"list","data":[{"id":"sim"}]}"#)
        } else {
            Bytes::from_static(br#"{"status":"ok"}"#)
        };
        Ok::<_, Infallible>(http::Response::new(
            Full::new(body).map_err(|e| match e {}).boxed_unsync(),
        ))
    })
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let nodes = arg(&args, "--nodes", 1000);
    let health_check_secs = arg(&args, "--health-check-secs", 300);
    raise_fd_limit();
    if args.iter().any(|a| a == "--serve") {
        return serve(nodes, health_check_secs).await;
    }
    let sources = arg(&args, "--sources", 8).clamp(1, 250);
    let concurrency = arg(&args, "--concurrency", 128).max(1);
    let hold_secs = arg(&args, "--hold-secs", 10);

    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--serve",
            "--nodes",
            &nodes.to_string(),
            "--health-check-secs",
            &health_check_secs.to_string(),
        ])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let server_pid = child.id().unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let port: u16 = loop {
        let line = lines.next_line().await.unwrap().expect("server output");
        if let Some(p) = line.strip_prefix("port ") {
            break p.parse().unwrap();
        }
    };
    let ready = Arc::new(AtomicUsize::new(0));
    let ready_seen = ready.clone();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(n) = line.strip_prefix("ready ") {
                ready_seen.store(n.parse().unwrap_or(0), Ordering::Relaxed);
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_before_kib = rss_kib(server_pid);
    let ca = std::fs::read_to_string(std::env::temp_dir().join("tunnel_load_ca.pem")).unwrap();
    let tls = spine_transport::client_config_with_ca(&ca).unwrap();

    let started = Instant::now();
    let failures = Arc::new(AtomicUsize::new(0));
    let limit = Arc::new(tokio::sync::Semaphore::new(concurrency as usize));
    let client_load_pid = std::process::id();
    for i in 0..nodes {
        let permit = limit.clone().acquire_owned().await.unwrap();
        let mut config = TunnelClientConfig::new(
            format!("wss://localhost:{port}/v1/tunnel"),
            NodeIdentity::from_seed(&seed(i)),
            descriptor(),
        );
        config.tls = Some(tls.clone());
        config.local_addr = Some(IpAddr::V4(Ipv4Addr::new(
            127,
            0,
            0,
            1 + (i % sources) as u8,
        )));
        // the gateway pings every 10 s; the simulated agents only answer
        config.keepalive_interval = Duration::from_secs(3600);
        config.ws_ping_interval = Duration::from_secs(3600);
        let failures = failures.clone();
        tokio::spawn(async move {
            let client = TunnelClient::new(config).unwrap();
            match client.connect().await {
                Ok(session) => {
                    drop(permit);
                    let _ = session.serve(agent_service()).await;
                }
                Err(e) => {
                    drop(permit);
                    if failures.fetch_add(1, Ordering::Relaxed) < 5 {
                        eprintln!("node {i}: {e}");
                    }
                }
            }
        });
    }
    // all handshakes answered: wait until every accepted node passed its first health probe
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let r = ready.load(Ordering::Relaxed) as u64;
        let f = failures.load(Ordering::Relaxed) as u64;
        if r + f >= nodes || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let ramp = started.elapsed();
    let held = ready.load(Ordering::Relaxed) as u64;
    // let the tunnels sit idle (keepalive pings flowing), then measure
    tokio::time::sleep(Duration::from_secs(hold_secs)).await;
    let held_after = ready.load(Ordering::Relaxed) as u64;
    let rss_after_kib = rss_kib(server_pid);
    let per_tunnel_kib =
        (rss_after_kib.saturating_sub(rss_before_kib)) as f64 / held_after.max(1) as f64;
    let result = serde_json::json!({
        "nodes": nodes,
        "tunnels_ready": held,
        "tunnels_held_after_idle": held_after,
        "failures": failures.load(Ordering::Relaxed),
        "sources": sources,
        "ramp_secs": ramp.as_secs_f64(),
        "handshakes_per_sec": held as f64 / ramp.as_secs_f64(),
        "server_rss_before_kib": rss_before_kib,
        "server_rss_after_kib": rss_after_kib,
        "server_kib_per_tunnel": per_tunnel_kib,
        "load_tool_rss_kib": rss_kib(client_load_pid),
        "seed_kib_per_tunnel": 40.0,
        "ratio_vs_seed": per_tunnel_kib / 40.0,
    });
    println!("{result}");
    let _ = child.kill().await;
}
