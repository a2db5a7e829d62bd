//! The reverse tunnel between the spine gateway and its nodes (design brief §4).
//!
//! A node behind NAT cannot be dialled, so its agent dials out: TCP → TLS (rustls) → WebSocket
//! upgrade on `GET /v1/tunnel`. The gateway sends a [`Challenge`](handshake::Challenge); the
//! agent answers with its ed25519 public key, a signature over the challenge, and its
//! [`NodeDescriptor`](spine_core::NodeDescriptor); the gateway accepts it or closes the WebSocket
//! with a [`RefusalReason`]. From then on the WebSocket's binary messages carry an HTTP/2
//! connection ([`WsIo`]) on which the gateway is the client and the agent the server: hundreds of
//! flow-controlled streams, PING keepalive, the node's stream limit as
//! `SETTINGS_MAX_CONCURRENT_STREAMS`, and RST_STREAM when a caller goes away.
//!
//! - Gateway: [`TunnelServer`] accepts tunnels; [`Tunnels`] / [`TunnelService`] send requests
//!   down them; [`NodeAuthenticator`] and [`TunnelEvents`] connect it to the node registry.
//! - Agent: [`TunnelClient`] dials, hand-shakes, serves a tower service, and reconnects with
//!   [`Backoff`].
//!
//! ```no_run
//! # async fn gateway() -> std::io::Result<()> {
//! use std::sync::Arc;
//! use spine_transport::{StaticAuthenticator, TunnelServer, TunnelServerConfig};
//!
//! let (cert, key) = spine_transport::self_signed_cert(&["localhost".into()]).map_err(std::io::Error::other)?;
//! let tls = spine_transport::server_config_from_pem(&cert, &key).map_err(std::io::Error::other)?;
//! let auth = StaticAuthenticator::new().with_key("ed25519:…", "node_1".into());
//! let server = TunnelServer::new(TunnelServerConfig::default(), Arc::new(auth), Arc::new(()));
//! let tunnels = server.tunnels(); // send requests with tunnels.send(&node, request)
//! let listener = tokio::net::TcpListener::bind("0.0.0.0:19000").await?;
//! server.serve(listener, Some(tls)).await
//! # }
//! ```

mod client;
mod error;
pub mod handshake;
mod identity;
pub mod metric;
mod refusal;
mod server;
mod tls;
mod ws_io;

pub use client::{Backoff, TunnelClient, TunnelClientConfig, TunnelSession};
pub use error::TunnelError;
pub use handshake::decode_hello;
pub use identity::{
    parse_public_key_text, public_key_text, IdentityError, NodeIdentity, PUBLIC_KEY_PREFIX,
};
pub use refusal::RefusalReason;
pub use server::{
    serve_listener, ModelStatus, NodeAuthenticator, StaticAuthenticator, TunnelEvents,
    TunnelServer, TunnelServerConfig, TunnelService, TunnelState, TunnelStatus, TunnelUpgrade,
    Tunnels, UpgradeBody, HEALTH_PATH, PROBE_PATH, TUNNEL_PATH,
};
pub use tls::{
    client_config_with_ca, self_signed_cert, server_config_from_pem, TlsError, TlsFiles,
};
pub use ws_io::{WsIo, DEFAULT_MAX_WRITE_MESSAGE_BYTES};

/// Log targets of the libraries under the tunnel whose `debug`/`trace` output contains message
/// payloads (request and response bodies). Applications must cap them at `info` whatever
/// `RUST_LOG` says, so prompts and completions never reach a log (design brief §9).
pub const PAYLOAD_LOGGING_TARGETS: &[&str] = &[
    "tungstenite",
    "tokio_tungstenite",
    "h2",
    "hyper",
    "hyper_util",
    "rustls",
];

/// The tunnel protocol version this crate speaks, sent in challenges and hellos.
pub const PROTOCOL_VERSION: u32 = 1;
