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

mod chain;
mod client;
mod error;
pub mod handshake;
mod identity;
mod join;
mod listen;
#[cfg(feature = "logging")]
pub mod logging;

pub use chain::{tls_hint, ErrorChain};
pub mod metric;
pub mod node_status;
mod refusal;
mod serve;
mod server;
mod tls;
mod ws_io;

pub use client::{Backoff, NodeService, TunnelClient, TunnelClientConfig, TunnelSession};
pub use error::TunnelError;
pub use handshake::decode_hello;
pub use identity::{
    parse_public_key_text, public_key_text, IdentityError, NodeIdentity, PUBLIC_KEY_PREFIX,
};
pub use listen::{bind_listener, raise_fd_limit, shutdown_signal, LISTEN_BACKLOG};
pub use refusal::RefusalReason;
pub use serve::{
    BodyReadTimeout, InFlightGuard, LimitedServer, ListenerLimits, ListenerService, PeerAddr,
    TimedBody, TrackedBody,
};
pub use server::{
    serve_listener, ModelStatus, NodeAuthenticator, StaticAuthenticator, TunnelEvents,
    TunnelServer, TunnelServerConfig, TunnelService, TunnelState, TunnelStatus, TunnelUpgrade,
    Tunnels, UpgradeBody, HEALTH_PATH, PROBE_PATH, TUNNEL_PATH,
};
pub use tls::{
    client_config_with_ca, create_private_dir, self_signed_cert, server_config_from_pem,
    tls_files_or_self_signed, write_private, TlsError, TlsFiles,
};
pub use ws_io::{WsIo, DEFAULT_MAX_WRITE_MESSAGE_BYTES};

/// Log targets of the libraries in the gateway and the agent whose `debug`/`trace` output may
/// contain message payloads. Applications must cap them at `info` whatever `RUST_LOG` says, so
/// prompts and completions never reach a log (design brief §9):
///
/// - the tunnel and HTTP stack (`tungstenite`, `h2`, `hyper`, `rustls`, `reqwest`, `axum`,
///   `tower_http`): frames, bodies, and rejections quoting the JSON that failed to parse;
/// - `tokenizers`: its normalizer traces every character of the text it counts, so a prompt or
///   completion can be read back from a `trace` log;
/// - `minijinja`: chat templates render the messages.
///
/// `sqlx` is not capped: it logs SQL statements at `debug`, never bound values, and the ledger
/// holds no prompt text. A directive matches a target and the targets under it (`hyper` also
/// matches `hyper_util`); the list names each crate anyway.
pub const PAYLOAD_LOGGING_TARGETS: &[&str] = &[
    "tungstenite",
    "tokio_tungstenite",
    "h2",
    "hyper",
    "hyper_util",
    "rustls",
    "tokio_rustls",
    "reqwest",
    "axum",
    "tower_http",
    "tokenizers",
    "minijinja",
    "minijinja_contrib",
];

/// Whether `target` is one of [`PAYLOAD_LOGGING_TARGETS`] or a module under one. Log filters use
/// it to drop `debug`/`trace` events from these targets even when a more specific `RUST_LOG`
/// directive (`tokenizers::tokenizer=trace`) would let them through.
pub fn is_payload_logging_target(target: &str) -> bool {
    PAYLOAD_LOGGING_TARGETS.iter().any(|t| {
        target
            .strip_prefix(t)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
    })
}

/// The tunnel protocol version this crate speaks, sent in challenges and hellos.
/// Version 2 binds the hello to the gateway name the agent dialled ([`handshake::gateway_name`]).
pub const PROTOCOL_VERSION: u32 = 2;

#[cfg(test)]
mod tests;
