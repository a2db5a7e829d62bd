#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]
use std::sync::Mutex;

use spine_core::{BoxBody, NodeDescriptor, NodeId};
use spine_transport::{
    StaticAuthenticator, TunnelClient, TunnelClientConfig, TunnelServer, TunnelServerConfig,
    Tunnels,
};
use tokio::net::TcpListener;

use super::*;

/// One slot of model `m` (what the tunnel's hello carries; its values do not matter here).
fn descriptor() -> NodeDescriptor {
    spine_test_support::node_serving("m", 1)
}

/// A plaintext tunnel listener that knows `identity` as node `n1`.
async fn gateway(identity: &NodeIdentity) -> (u16, Tunnels) {
    let auth = StaticAuthenticator::new().with_key(identity.public_key_text(), NodeId::new("n1"));
    let server = TunnelServer::new(TunnelServerConfig::default(), Arc::new(auth), Arc::new(()));
    let tunnels = server.tunnels();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(server.serve(listener, None));
    (port, tunnels)
}

/// A TCP proxy to `port` whose connections the test can cut (a gateway's `kill -9`, as the
/// agent sees it: its tunnel's socket closes).
async fn proxy(port: u16) -> (u16, Arc<Mutex<Vec<tokio::task::AbortHandle>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let own = listener.local_addr().unwrap().port();
    let conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
    let conns2 = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let task = tokio::spawn(async move {
                if let Ok(mut server) = TcpStream::connect(("127.0.0.1", port)).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
            conns2.lock().unwrap().push(task.abort_handle());
        }
    });
    (own, conns)
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let started = tokio::time::Instant::now();
    while !f() {
        assert!(started.elapsed() < Duration::from_secs(5), "{what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    started.elapsed()
}

/// A standby agent with the active one's identity is refused `duplicate_session` while the
/// active one lives, and retries on the short fixed interval (1 s), not its backoff (here
/// 30 s → 60 s): once the active agent dies it takes over within seconds.
#[tokio::test]
async fn a_standby_agent_takes_over_within_seconds_after_duplicate_session() {
    let identity = NodeIdentity::generate().unwrap();
    let (port, tunnels) = gateway(&identity).await;
    let client = |version: &str| {
        let mut d = descriptor();
        d.agent_version = version.into();
        let mut c = TunnelClientConfig::new(
            format!("ws://127.0.0.1:{port}/v1/tunnel"),
            identity.clone(),
            d,
        );
        c.allow_insecure_plaintext = true;
        TunnelClient::new(c).unwrap()
    };
    let service = tower::service_fn(|_req: Request<hyper::body::Incoming>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(BoxBody::default()))
    });
    let backoff = (Duration::from_secs(30), Duration::from_secs(60));
    let holder = |tunnels: &Tunnels| {
        tunnels
            .connected()
            .first()
            .map(|(_, d)| d.agent_version.clone())
    };
    let active = tokio::spawn(run_failover(
        vec![client("active")],
        backoff,
        service,
        std::future::pending(),
    ));
    eventually("the active agent routable", || {
        holder(&tunnels).as_deref() == Some("active")
    })
    .await;
    let standby = tokio::spawn(run_failover(
        vec![client("standby")],
        backoff,
        service,
        std::future::pending(),
    ));
    // refused several times while the active one lives (a doubling backoff would now be
    // at its 30 s floor)
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(holder(&tunnels).as_deref(), Some("active"));
    // the active agent dies: its tunnel's socket closes
    active.abort();
    let started = tokio::time::Instant::now();
    while holder(&tunnels).as_deref() != Some("standby") {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the standby did not take over"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = started.elapsed();
    println!("standby took over {took:?} after the active agent died");
    // 1 s retry + health probe (1 s interval) + handshake, on a loaded machine
    assert!(took < Duration::from_secs(5), "{took:?}");
    standby.abort();
}

#[tokio::test]
async fn a_dead_gateway_hands_the_node_to_the_next_url_at_once() {
    let identity = NodeIdentity::generate().unwrap();
    let (port1, tunnels1) = gateway(&identity).await;
    let (port2, tunnels2) = gateway(&identity).await;
    let (proxied1, conns1) = proxy(port1).await;
    // nothing listens on the first URL
    let dead = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_port = dead.local_addr().unwrap().port();
    drop(dead);
    let clients: Vec<TunnelClient> = [dead_port, proxied1, port2]
        .iter()
        .map(|p| {
            let mut c = TunnelClientConfig::new(
                format!("ws://127.0.0.1:{p}/v1/tunnel"),
                identity.clone(),
                descriptor(),
            );
            c.allow_insecure_plaintext = true;
            TunnelClient::new(c).unwrap()
        })
        .collect();
    let service = tower::service_fn(|_req: Request<hyper::body::Incoming>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(BoxBody::default()))
    });
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    // a long backoff: the hand-over must not wait for it
    let agent = tokio::spawn(run_failover(
        clients,
        (Duration::from_secs(30), Duration::from_secs(60)),
        service,
        async {
            let _ = stop_rx.await;
        },
    ));
    let n1 = NodeId::new("n1");
    eventually("tunnel on the second url", || tunnels1.contains(&n1)).await;
    assert!(!tunnels2.contains(&n1));

    for c in conns1.lock().unwrap().drain(..) {
        c.abort();
    }
    let took = eventually("tunnel on the third url", || tunnels2.contains(&n1)).await;
    println!("node on the next gateway {took:?} after its tunnel broke");
    assert!(took < Duration::from_secs(2), "{took:?}");

    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(10), agent)
        .await
        .unwrap()
        .unwrap();
    eventually("tunnel closed on stop", || !tunnels2.contains(&n1)).await;
}
