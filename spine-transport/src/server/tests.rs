#![allow(clippy::unwrap_used)]
use std::sync::Arc;

use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::WebSocketStream;

use super::session::run_session;
use super::{StaticAuthenticator, TunnelServer, TunnelServerConfig};

/// Every idle tunnel keeps its session task's state alive: keep it small (the scale budget
/// in docs/benchmarks.md counts it).
#[tokio::test]
async fn session_task_state_stays_small() {
    let (a, _b) = tokio::io::duplex(64);
    let ws = WebSocketStream::from_raw_socket(a, Role::Server, None).await;
    let server = TunnelServer::new(
        TunnelServerConfig::default(),
        Arc::new(StaticAuthenticator::new()),
        Arc::new(()),
    );
    let fut = run_session(server.shared.clone(), ws);
    let bytes = std::mem::size_of_val(&fut);
    assert!(bytes <= 6 * 1024, "run_session future is {bytes} bytes");
}
