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

#[test]
fn the_write_buffer_always_takes_one_more_message_than_it_keeps() {
    // a small incoming message limit must not make the sink refuse a message it is ready for
    // (tungstenite fails a write past `max_write_buffer_size`, which would end the tunnel)
    for (max_message, max_write_message) in [
        (1024, 64 * 1024),
        (32 * 1024, 64 * 1024),
        (1 << 20, 1 << 20),
    ] {
        let config = super::ws_config(max_message, 4096, max_write_message);
        assert!(
            config.max_write_buffer_size >= config.write_buffer_size + max_write_message + 14,
            "{max_message} {max_write_message}: {config:?}"
        );
    }
}
