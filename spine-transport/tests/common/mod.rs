//! What the tunnel suites (`tunnel.rs`, `write_stall.rs`) share: a node's descriptor, and the
//! raw TLS + WebSocket connection on which a test speaks the handshake by hand.

use futures_util::StreamExt as _;
use http::StatusCode;
use spine_core::NodeDescriptor;
use spine_transport::client_config_with_ca;
use spine_transport::handshake::{decode_gateway_message, Challenge, GatewayMessage};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

/// A raw tunnel connection, as a test agent holds it.
pub(crate) type RawWs = WebSocketStream<TlsStream<TcpStream>>;

/// A llama.cpp node serving `smollm2` (2048-token context) with 4 slots on 8 GiB, as agent
/// `agent_version`.
pub(crate) fn descriptor(agent_version: &str) -> NodeDescriptor {
    spine_test_support::smollm2_node(agent_version)
}

/// TLS to the gateway on 127.0.0.1:`port` as `localhost`, trusting `ca_pem`.
pub(crate) async fn raw_tls(port: u16, ca_pem: &str) -> TlsStream<TcpStream> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let connector = tokio_rustls::TlsConnector::from(client_config_with_ca(ca_pem).unwrap());
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    connector.connect(name, tcp).await.unwrap()
}

/// [`raw_tls`], upgraded to a WebSocket on `/v1/tunnel` (the upgrade must be accepted).
pub(crate) async fn raw_ws(port: u16, ca_pem: &str) -> RawWs {
    let tls = raw_tls(port, ca_pem).await;
    let url = format!("wss://localhost:{port}/v1/tunnel");
    let (ws, resp) = tokio_tungstenite::client_async(url, tls).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    ws
}

/// The gateway's first message, which must be its challenge.
pub(crate) async fn read_challenge(ws: &mut RawWs) -> Challenge {
    match ws.next().await.unwrap().unwrap() {
        Message::Text(t) => match decode_gateway_message(t.as_bytes()).unwrap() {
            GatewayMessage::Challenge(c) => c,
            other => panic!("expected a challenge, got {other:?}"),
        },
        other => panic!("expected text, got {other:?}"),
    }
}
