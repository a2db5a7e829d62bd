//! Gateway side of the tunnel: accept, verify, hold one HTTP/2 client per node.
//!
//! - `listener`: [`TunnelServer`] and [`serve_listener`], the accept loop;
//! - `upgrade`: [`TunnelUpgrade`], the WebSocket upgrade as a tower service;
//! - `session`: one tunnel after its upgrade: the signed handshake, the one-session-per-node
//!   table (reconnection race) and the HTTP/2 client;
//! - `health`: the session's health probes and stall detection;
//! - `tunnels`: [`Tunnels`], the send half; `service`: [`TunnelService`] over it;
//! - `body`: the per-node stream slot and the response body that holds it;
//! - `config`, `status`, `auth`, `events`, `state`: settings, the admin view of a tunnel, the
//!   hooks into the node store and the registry, the shared session table.

mod auth;
mod body;
mod config;
mod events;
mod health;
mod listener;
mod service;
mod session;
mod state;
mod status;
mod tunnels;
mod upgrade;

#[cfg(test)]
mod tests;

pub use auth::{NodeAuthenticator, StaticAuthenticator};
pub(crate) use config::ws_config;
pub use config::TunnelServerConfig;
pub use events::TunnelEvents;
pub use listener::{serve_listener, TunnelServer};
pub use service::TunnelService;
pub use status::{ModelStatus, TunnelState, TunnelStatus};
pub use tunnels::Tunnels;
pub use upgrade::{TunnelUpgrade, UpgradeBody};

/// The path agents upgrade on.
pub const TUNNEL_PATH: &str = "/v1/tunnel";

/// The path of the health probe sent through a new tunnel; the agent maps it to its engine's
/// health endpoint.
pub const HEALTH_PATH: &str = "/health";

/// The path of the liveness probe the gateway sends down an existing tunnel when a new session
/// for the same node arrives (reconnection race, design brief §4). The agent's tunnel layer
/// answers it itself with `204 No Content`, without involving its engine.
pub const PROBE_PATH: &str = "/_spine/probe";

/// Authority put in the URI of every request sent down a tunnel (the agent ignores it and talks
/// to its one configured engine).
const TUNNEL_AUTHORITY: &str = "spine-node";

fn now_ms() -> u64 {
    u64::try_from(spine_core::unix_time_ms()).unwrap_or(0)
}
