//! The web console's wiring (issue 18; the console itself is [`spine_meter::console`]): the
//! gateway's state as the console's [`ConsoleHost`], and the console's state over it, served on
//! its own listener (`console_listen`, default `127.0.0.1:8082`). See `docs/console.md`.

use std::sync::Arc;

use spine_core::ModelId;
use spine_meter::console::{ConsoleConfig, ConsoleHost, ConsoleState};
use spine_meter::limits::RateLimits;
use spine_meter::Store;

use crate::state::AppState;

impl ConsoleHost for AppState {
    fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    fn rate_limits(&self) -> &RateLimits {
        &self.limits
    }

    fn forget_key(&self, key_hash: &str) {
        self.keys.remove(key_hash);
    }

    fn models(&self) -> &[ModelId] {
        &self.catalog_ids
    }

    fn registry(&self) -> &spine_router::NodeRegistry {
        &self.registry
    }

    fn tunnels(&self) -> &spine_transport::Tunnels {
        &self.tunnels
    }

    fn auditor(&self) -> Option<&spine_meter::audit::Auditor> {
        self.auditor.as_ref()
    }
}

/// The console over the gateway's state; its playground calls the gateway's public API in
/// process. `join_gateway_url`: the tunnel URL the enrollment page's `join` command names.
///
/// # Errors
///
/// A template does not parse (a build defect: they are embedded).
pub(crate) fn state(
    app: Arc<AppState>,
    secure_cookies: bool,
    join_gateway_url: String,
) -> Result<ConsoleState, Box<dyn std::error::Error + Send + Sync>> {
    let public_api = crate::api::router(app.clone());
    let config = ConsoleConfig {
        secure_cookies,
        join_gateway_url,
    };
    Ok(ConsoleState::new(app, public_api, config)?)
}
