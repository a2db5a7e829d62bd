//! [`ConsoleHost`]: what the console reads of the application that serves it.

use std::sync::Arc;

use spine_core::ModelId;

use crate::audit::Auditor;
use crate::limits::RateLimits;
use crate::Store;

/// What the console needs of the gateway it is part of, beyond its store: the live state the
/// pages show and the caches a change made on a page must reach. The application implements it
/// on its shared state (the reference gateway on its `AppState`) and hands it to
/// [`ConsoleState::new`](super::ConsoleState::new) as an `Arc<dyn ConsoleHost>`, and to
/// [`admin_routes`](super::admin_routes) as the router's state.
///
/// Every method is called from request handlers: it must answer at once (no I/O).
pub trait ConsoleHost: Send + Sync + 'static {
    /// The gateway's store: accounts, keys, operators, nodes, records, and (through
    /// [`Store::console`]) the console's users, sessions and pages' queries.
    fn store(&self) -> &Arc<dyn Store>;

    /// The per-key RPM/TPM limits the gateway enforces: the keys page shows each key's
    /// effective limits and sets a key's own (within the defaults); the sign-in rate limit
    /// shares their Redis, when they have one ([`RateLimits::check_shared`]).
    fn rate_limits(&self) -> &RateLimits;

    /// A key was revoked on the keys page (`key_hash`: the hex SHA-256 of the key): drop it
    /// from any cache of keys the gateway authenticates with, so it is refused at once.
    fn forget_key(&self, key_hash: &str);

    /// The catalog's model ids, in the order the playground and the filters list them.
    fn models(&self) -> &[ModelId];

    /// The router's registry: a node's row shows it routable, and its models, from its
    /// [`snapshot`](spine_router::NodeRegistry::snapshot).
    fn registry(&self) -> &spine_router::NodeRegistry;

    /// The live tunnels: a node's row shows it connected, and while it is still in its
    /// warm-up probe, the models it announced.
    fn tunnels(&self) -> &spine_transport::Tunnels;

    /// The auditor, when the gateway audits nodes' models: a node's row shows its verdict per
    /// model. `None`: no audit column is filled.
    fn auditor(&self) -> Option<&Auditor>;
}
