//! Multi-instance mode (design brief §8), behind the `redis` feature: several gateway instances
//! share PostgreSQL (ledger, accounts, keys) and Redis (directory, liveness, affinity, rate
//! limits).
//!
//! Each instance
//! - keeps one shared Redis connection ([`redis::aio::ConnectionManager`]: multiplexed,
//!   reconnecting), named `<prefix without punctuation>-<instance_id>` (`CLIENT SETNAME`);
//! - writes its liveness key `P instance:<id>` → internal address (TTL 3 s, every 1 s);
//! - publishes each node whose tunnel it holds in the directory, `P node:<id>` →
//!   `<instance_id> <descriptor JSON>` (TTL 5 s, refreshed every 1 s only while it still owns
//!   the entry: a compare in a Lua script), indexed in the set `P nodes`;
//! - reads the directory every 500 ms into its [`NodeRegistry`] as *remote* nodes (a local
//!   tunnel always wins), skipping nodes whose owner's liveness key is gone;
//! - dispatches requests for remote nodes to the owner's internal HTTP/2 listener
//!   ([`ClusterService`]: [`DirectoryDispatch`](crate::DirectoryDispatch) with
//!   this instance's [`Cluster`] as the [`NodeDirectory`](crate::NodeDirectory), which checks the
//!   owner's liveness key), and relays requests other instances forward to it into its own
//!   tunnels ([`serve_internal`], [`internal_router`]). Each forwarded request is signed
//!   (HMAC-SHA256 keyed with the cluster secret, bound to the target instance, a timestamp, a
//!   nonce, the head and the body's SHA-256); the secret itself never leaves the instance.
//!
//! Every Redis call has a [`REDIS_TIMEOUT`] bound. Redis down: local nodes keep serving, remote
//! nodes age out of the registry after [`REMOTE_TTL`], affinity falls back to the in-memory
//! table, one warning is logged and `spine_cluster_redis_up` reads 0; all of it recovers when
//! Redis answers again.
//!
//! Wiring, in outline: [`connect_redis`], then [`Cluster::start`] with this instance's
//! [`ClusterConfig`], [`NodeRegistry`] and tunnels; feed it the tunnels' lifecycle
//! ([`Cluster::local_ready`], [`Cluster::local_gone`]); give the router
//! [`RedisAffinity`] and, as its inner service, [`cluster_service`]; serve the internal listener
//! with [`serve_internal`]; call [`Cluster::leave`] on shutdown. The reference gateway's
//! `main.rs` does exactly this.
//!
//! Keys assume one Redis server (or a primary with replicas): the Lua scripts read keys they do
//! not declare, which Redis Cluster forbids.

mod affinity;
mod config;
mod directory;
mod forward;
mod internal;
mod tunnels;
mod wire;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::ConnectionManager;
use spine_core::{ModelId, NodeDescriptor, NodeId};
use tokio::sync::mpsc;
use tokio::time::Instant;

pub use affinity::RedisAffinity;
pub use config::{ClusterConfig, ClusterConfigError};
pub use forward::{
    cluster_service, BodyIdle, ClusterError, ClusterService, Forwarder, BODY_IDLE_TIMEOUT,
    CONNECT_TIMEOUT, HEAD_TIMEOUT,
};
pub use internal::{
    internal_router, serve_internal, RelayError, RelayRefusal, FORWARDED_BODY_SLACK_BYTES,
    MAX_CLOCK_SKEW_MS, REPLAY_CACHE_CAP,
};
pub use tunnels::{join, tunnel_dispatch, tunnel_route_layer, JoinError, RegistryEvents};
pub use wire::{
    KEEP_ALIVE_INTERVAL, KEEP_ALIVE_TIMEOUT, MAX_CONCURRENT_STREAMS, SIGNATURE_SCHEME,
    X_SPINE_NODE_ID, X_SPINE_REFUSAL,
};

use crate::NodeRegistry;

/// Bound on every Redis call on a request path or in a background loop.
pub const REDIS_TIMEOUT: Duration = Duration::from_millis(100);
/// Lifetime of an instance's liveness key.
pub const LIVENESS_TTL: Duration = Duration::from_secs(3);
/// Lifetime of a directory entry; its owner refreshes it every [`REFRESH_EVERY`].
pub const DIRECTORY_TTL: Duration = Duration::from_secs(5);
/// How often the liveness key and the own directory entries are refreshed.
pub const REFRESH_EVERY: Duration = Duration::from_secs(1);
/// How often the directory is read into the registry.
pub const SYNC_EVERY: Duration = Duration::from_millis(500);
/// A remote node not confirmed by the directory for this long leaves the registry (Redis
/// down, or its entry expired).
pub const REMOTE_TTL: Duration = DIRECTORY_TTL;
/// How long an owner found unreachable is skipped by the directory sync (its liveness key may
/// outlive it by up to [`LIVENESS_TTL`]).
pub const SUSPECT_FOR: Duration = LIVENESS_TTL;
/// Most directory entries one sync reads.
pub const MAX_SYNC_NODES: usize = 10_000;
/// The gateway's default `max_request_body_bytes` (4 MiB), the internal listener's body bound
/// until [`Cluster::set_max_request_body_bytes`] sets the configured one.
pub const DEFAULT_MAX_REQUEST_BODY_BYTES: usize = 4 * 1024 * 1024;

/// Counter of requests forwarded to another instance, `result` = `ok`, `owner_dead`,
/// `unreachable`, `timeout`, `node_moved`, `node_full`, `refused` (the owner's internal listener
/// refused the signature or the body: `cluster_secret`, clocks or body limits differ), `redis_error`,
/// `error` (the forwarded request could not be built).
pub const FORWARDED: &str = "spine_cluster_forwarded_total";
/// Histogram: seconds from forwarding a request to the owner's response head.
pub const FORWARD_SECONDS: &str = "spine_cluster_forward_seconds";
/// Counter of failed or timed-out Redis calls, `op` label.
pub const REDIS_ERRORS: &str = "spine_cluster_redis_errors_total";
/// Gauge: 1 while the last Redis call succeeded, 0 after a failure.
pub const REDIS_UP: &str = "spine_cluster_redis_up";
/// Gauge: live entries in the directory at the last sync (every instance's nodes).
pub const DIRECTORY_NODES: &str = "spine_cluster_directory_nodes";
/// Gauge: remote nodes (tunnel on another instance) in this instance's registry.
pub const REMOTE_NODES: &str = "spine_cluster_remote_nodes";
/// Counter of requests relayed by the internal listener, `result` = `ok`, `node_moved`,
/// `node_full`, `error` (the node failed before its head), or a refusal before the tunnel:
/// `missing_signature`, `bad_signature`, `wrong_target`, `stale`, `replayed`, `replay_cache_full`,
/// `too_large`, `body_error`, `body_mismatch`.
pub const RELAYED: &str = "spine_cluster_relayed_total";

/// Registers the descriptions of the metrics above with the installed `metrics` recorder; call
/// it once after installing one.
pub fn describe() {
    metrics::describe_counter!(
        FORWARDED,
        "Requests forwarded to the instance holding the node's tunnel"
    );
    metrics::describe_histogram!(
        FORWARD_SECONDS,
        metrics::Unit::Seconds,
        "Time from forwarding a request to the owning instance's response head"
    );
    metrics::describe_counter!(REDIS_ERRORS, "Redis calls that failed or timed out");
    metrics::describe_gauge!(REDIS_UP, "1 while Redis answers, 0 after a failed call");
    metrics::describe_gauge!(
        DIRECTORY_NODES,
        "Nodes in the shared directory at the last sync"
    );
    metrics::describe_gauge!(REMOTE_NODES, "Nodes routed through another instance");
    metrics::describe_counter!(
        RELAYED,
        "Requests relayed for other instances into local tunnels"
    );
}

/// Errors talking to Redis.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisError {
    /// No answer within the bound ([`REDIS_TIMEOUT`]).
    #[error("redis call timed out after {0:?}")]
    Timeout(Duration),
    /// Redis answered with an error, or the connection failed.
    #[error("redis call failed")]
    Redis(#[source] redis::RedisError),
}

/// `CLIENT SETNAME` value of an instance: the key prefix without characters Redis names refuse
/// (only letters, digits, `.`, `_`, `-` are kept), a dash, the instance id.
pub fn client_name(prefix: &str, instance_id: &str) -> String {
    let clean: String = prefix
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        .collect();
    format!("{clean}-{instance_id}")
}

/// A remote node in the registry.
#[derive(Debug, Clone)]
struct Remote {
    owner: String,
    /// The owner's internal address at the last sync (used while Redis is down).
    owner_addr: String,
    descriptor: NodeDescriptor,
    confirmed: Instant,
}

/// A directory write, applied in order by one task.
#[derive(Debug)]
enum DirOp {
    Claim(NodeId, NodeDescriptor),
    Release(NodeId),
}

struct Inner {
    instance_id: String,
    prefix: String,
    client_name: String,
    /// HMAC-SHA256 keyed with the cluster secret (the secret itself is not kept).
    mac: wire::ClusterMac,
    /// Nonces of the forwarded requests relayed within their validity window.
    nonces: Mutex<internal::ReplayCache>,
    /// When this process began (Unix ms): the replay cache knows no nonce from before it, so a
    /// request signed earlier is refused as stale (a capture replayed after a restart).
    started_unix_ms: u64,
    /// The gateway's `max_request_body_bytes`: bounds a forwarded body (plus
    /// [`internal::FORWARDED_BODY_SLACK_BYTES`]).
    max_request_body_bytes: AtomicUsize,
    internal_addr: String,
    redis: ConnectionManager,
    registry: NodeRegistry,
    catalog: Vec<ModelId>,
    tunnels: spine_transport::Tunnels,
    /// Nodes whose tunnel is here and routable, with the descriptor they published.
    local: Mutex<HashMap<NodeId, NodeDescriptor>>,
    /// Nodes routed through another instance.
    remote: Mutex<HashMap<NodeId, Remote>>,
    /// Owners found dead or unreachable, until when they are skipped.
    suspects: Mutex<HashMap<String, Instant>>,
    redis_down: AtomicBool,
    ops: mpsc::UnboundedSender<DirOp>,
}

/// This instance's part in the cluster: the shared Redis connection, the directory kept in it
/// and the remote nodes it feeds into the [`NodeRegistry`]. Cheap to clone (one shared state).
///
/// It is the [`NodeDirectory`](crate::NodeDirectory) of [`cluster_service`].
#[derive(Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("instance_id", &self.inner.instance_id)
            .field("internal_addr", &self.inner.internal_addr)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Opens the one shared Redis connection of an instance (lazily: an instance starts even while
/// Redis is down and connects when it returns). Connect timeout 500 ms, response timeout 2 s.
///
/// # Errors
///
/// The URL does not parse.
pub fn connect_redis(url: &str) -> Result<ConnectionManager, redis::RedisError> {
    let client = redis::Client::open(url)?;
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_millis(500)))
        .set_response_timeout(Some(Duration::from_secs(2)))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500));
    redis::aio::ConnectionManager::new_lazy_with_config(client, config)
}

impl Cluster {
    /// Joins the cluster: names the Redis connection, publishes liveness, and starts the
    /// refresh/sync loop (stopped by `shutdown`). `internal_addr` is the address other
    /// instances dial for this one's internal listener (`config.internal_advertise`, else the
    /// internal listener's bound address); `catalog` lists the models this instance serves
    /// (remote nodes are registered with those only). Must be called within a tokio runtime
    /// (it spawns two tasks).
    ///
    /// A Redis that does not answer does not fail the start: [`Cluster::redis_down`] then
    /// reads `true` and the instance serves its local nodes until Redis answers.
    ///
    /// # Cancel safety
    ///
    /// Dropped before it returns, nothing has been spawned; at most the liveness key was
    /// written (it expires after [`LIVENESS_TTL`]).
    pub async fn start(
        config: &ClusterConfig,
        redis: ConnectionManager,
        internal_addr: String,
        registry: NodeRegistry,
        catalog: Vec<ModelId>,
        tunnels: spine_transport::Tunnels,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Self {
        let (ops, rx) = mpsc::unbounded_channel();
        let cluster = Self {
            inner: Arc::new(Inner {
                instance_id: config.instance_id.clone(),
                prefix: config.key_prefix.clone(),
                client_name: client_name(&config.key_prefix, &config.instance_id),
                mac: wire::cluster_mac(config.secret.as_bytes()),
                nonces: Mutex::new(internal::ReplayCache::new(internal::REPLAY_CACHE_CAP)),
                started_unix_ms: wire::unix_ms(),
                max_request_body_bytes: AtomicUsize::new(DEFAULT_MAX_REQUEST_BODY_BYTES),
                internal_addr,
                redis,
                registry,
                catalog,
                tunnels,
                local: Mutex::default(),
                remote: Mutex::default(),
                suspects: Mutex::default(),
                redis_down: AtomicBool::new(false),
                ops,
            }),
        };
        metrics::gauge!(REDIS_UP).set(1.0);
        // first liveness write before the ready line, so peers can dial us at once
        let _ = cluster.refresh_liveness().await;
        tokio::spawn(cluster.clone().run_ops(rx));
        tokio::spawn(cluster.clone().run_loop(shutdown));
        cluster
    }

    /// This instance's id.
    pub fn instance_id(&self) -> &str {
        &self.inner.instance_id
    }

    /// A handle on the instance's one shared Redis connection (a clone shares it).
    pub fn redis_connection(&self) -> ConnectionManager {
        self.inner.redis.clone()
    }

    /// HMAC-SHA256 keyed with the cluster secret: signs forwarded requests and checks the ones
    /// relayed here (clone it per message).
    pub(crate) fn mac(&self) -> &wire::ClusterMac {
        &self.inner.mac
    }

    /// Records the nonce of a forwarded request signed at `t_unix_ms`, refused as a replay until
    /// its timestamp leaves the window ([`internal::MAX_CLOCK_SKEW_MS`]).
    ///
    /// # Errors
    ///
    /// The request was signed before this process began ([`internal::RelayRefusal::Stale`]: the
    /// nonces of the previous process are not known, so a capture replayed after a restart is
    /// refused; a peer whose clock is behind sees this for at most its skew after the start),
    /// the nonce was seen before ([`internal::RelayRefusal::Replayed`]), or the replay cache is
    /// full of unexpired nonces ([`internal::RelayRefusal::ReplayCacheFull`]).
    pub(crate) fn record_nonce(
        &self,
        nonce: &[u8; 16],
        t_unix_ms: u64,
        now_unix_ms: u64,
    ) -> Result<(), internal::RelayRefusal> {
        if t_unix_ms < self.inner.started_unix_ms {
            return Err(internal::RelayRefusal::Stale);
        }
        lock(&self.inner.nonces).record(
            nonce,
            t_unix_ms.saturating_add(internal::MAX_CLOCK_SKEW_MS),
            now_unix_ms,
        )
    }

    /// Sets the gateway's request body limit, bytes (default
    /// [`DEFAULT_MAX_REQUEST_BODY_BYTES`]): the internal listener refuses a forwarded body over it
    /// plus [`internal::FORWARDED_BODY_SLACK_BYTES`] with 413. Every instance should use the same.
    pub fn set_max_request_body_bytes(&self, bytes: usize) {
        self.inner
            .max_request_body_bytes
            .store(bytes, Ordering::Relaxed);
    }

    /// Most bytes of a forwarded body the internal listener reads.
    pub fn max_forwarded_body_bytes(&self) -> usize {
        self.inner
            .max_request_body_bytes
            .load(Ordering::Relaxed)
            .saturating_add(internal::FORWARDED_BODY_SLACK_BYTES)
    }

    /// The tunnels of this instance (the local nodes).
    pub fn tunnels(&self) -> &spine_transport::Tunnels {
        &self.inner.tunnels
    }

    /// `rest` under this instance's key prefix (`config.key_prefix`): every Redis key the
    /// cluster uses, and those other shared state (rate limits) should use.
    pub fn key(&self, rest: &str) -> String {
        format!("{}{rest}", self.inner.prefix)
    }

    /// Runs a Redis command with [`REDIS_TIMEOUT`], counting failures and logging the first
    /// one of an outage (and the recovery).
    pub(crate) async fn redis<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        cmd: &redis::Cmd,
    ) -> Result<T, RedisError> {
        let mut conn = self.inner.redis.clone();
        let res = tokio::time::timeout(REDIS_TIMEOUT, cmd.query_async::<T>(&mut conn)).await;
        self.outcome(op, res)
    }

    /// As [`Cluster::redis`] for a Lua script.
    pub(crate) async fn script<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, RedisError> {
        let mut conn = self.inner.redis.clone();
        let res =
            tokio::time::timeout(REDIS_TIMEOUT, invocation.invoke_async::<T>(&mut conn)).await;
        self.outcome(op, res)
    }

    fn outcome<T>(
        &self,
        op: &'static str,
        res: Result<redis::RedisResult<T>, tokio::time::error::Elapsed>,
    ) -> Result<T, RedisError> {
        let err = match res {
            Ok(Ok(v)) => {
                if self.inner.redis_down.swap(false, Ordering::AcqRel) {
                    tracing::info!("Redis answers again; directory, shared affinity and shared rate limits are back");
                    metrics::gauge!(REDIS_UP).set(1.0);
                }
                return Ok(v);
            }
            Ok(Err(e)) => RedisError::Redis(e),
            Err(_) => RedisError::Timeout(REDIS_TIMEOUT),
        };
        metrics::counter!(REDIS_ERRORS, "op" => op).increment(1);
        if !self.inner.redis_down.swap(true, Ordering::AcqRel) {
            metrics::gauge!(REDIS_UP).set(0.0);
            tracing::warn!(
                op,
                error = %err,
                "Redis unreachable: serving local nodes only; remote nodes leave routing within \
                 5 s, affinity falls back to this instance's table"
            );
        }
        Err(err)
    }

    /// Whether the last Redis call failed.
    pub fn redis_down(&self) -> bool {
        self.inner.redis_down.load(Ordering::Acquire)
    }

    /// `CLIENT SETNAME` (again after a reconnect) and the liveness key, in one round trip.
    async fn refresh_liveness(&self) -> Result<(), RedisError> {
        let mut pipe = redis::pipe();
        pipe.cmd("CLIENT")
            .arg("SETNAME")
            .arg(&self.inner.client_name)
            .ignore()
            .cmd("SET")
            .arg(self.key(&format!("instance:{}", self.inner.instance_id)))
            .arg(&self.inner.internal_addr)
            .arg("PX")
            .arg(LIVENESS_TTL.as_millis() as u64)
            .ignore();
        let mut conn = self.inner.redis.clone();
        let res = tokio::time::timeout(REDIS_TIMEOUT, pipe.query_async::<()>(&mut conn)).await;
        self.outcome("liveness", res)
    }

    /// A node became routable on this instance's tunnel: it is published in the directory
    /// (the whole descriptor; each instance filters by its own catalog). Call it from the
    /// tunnels' `TunnelEvents::node_ready`.
    pub fn local_ready(&self, node: &NodeId, descriptor: &NodeDescriptor) {
        lock(&self.inner.local).insert(node.clone(), descriptor.clone());
        lock(&self.inner.remote).remove(node);
        let _ = self
            .inner
            .ops
            .send(DirOp::Claim(node.clone(), descriptor.clone()));
    }

    /// A node's tunnel on this instance is gone: its directory entry is removed (if this
    /// instance still owns it). Call it from the tunnels' `TunnelEvents::node_gone`.
    pub fn local_gone(&self, node: &NodeId) {
        lock(&self.inner.local).remove(node);
        let _ = self.inner.ops.send(DirOp::Release(node.clone()));
    }

    async fn run_ops(self, mut rx: mpsc::UnboundedReceiver<DirOp>) {
        while let Some(op) = rx.recv().await {
            let res = match &op {
                DirOp::Claim(node, descriptor) => self.claim(node, descriptor).await,
                DirOp::Release(node) => self.release(node).await.map(|_| ()),
            };
            if let Err(e) = res {
                // the refresh loop republishes local nodes; a lost release expires
                tracing::debug!(?op, error = %e, "directory write failed");
            }
        }
    }

    async fn run_loop(self, shutdown: tokio_util::sync::CancellationToken) {
        let mut sync = tokio::time::interval(SYNC_EVERY);
        sync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut refresh = tokio::time::interval(REFRESH_EVERY);
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = refresh.tick() => {
                    let _ = self.refresh_liveness().await;
                    self.refresh_local().await;
                }
                _ = sync.tick() => self.sync().await,
            }
        }
    }

    /// Graceful shutdown: the liveness key and this instance's directory entries go at once, so
    /// peers stop forwarding here without waiting for the TTLs.
    ///
    /// # Cancel safety
    ///
    /// Dropped midway, the remaining entries and the liveness key expire at their TTLs.
    pub async fn leave(&self) {
        let nodes: Vec<NodeId> = lock(&self.inner.local).keys().cloned().collect();
        for node in nodes {
            let _ = self.release(&node).await;
        }
        let key = self.key(&format!("instance:{}", self.inner.instance_id));
        let _ = self.redis::<i64>("leave", redis::cmd("DEL").arg(key)).await;
    }

    /// Marks `owner` unreachable for [`SUSPECT_FOR`] and drops its nodes from routing.
    pub(crate) fn suspect(&self, owner: &str) {
        lock(&self.inner.suspects).insert(owner.to_owned(), Instant::now() + SUSPECT_FOR);
        let gone: Vec<NodeId> = {
            let mut remote = lock(&self.inner.remote);
            let gone: Vec<NodeId> = remote
                .iter()
                .filter(|(_, r)| r.owner == owner)
                .map(|(n, _)| n.clone())
                .collect();
            for n in &gone {
                remote.remove(n);
            }
            gone
        };
        for n in &gone {
            if !self.inner.tunnels.contains(n) {
                self.inner.registry.node_gone(n);
            }
        }
        metrics::gauge!(REMOTE_NODES).set(lock(&self.inner.remote).len() as f64);
        tracing::warn!(
            owner,
            nodes = gone.len(),
            "instance unreachable; its nodes leave routing"
        );
    }

    /// Drops one remote node from routing until the directory names it again.
    pub(crate) fn forget(&self, node: &NodeId) {
        lock(&self.inner.remote).remove(node);
        if !self.inner.tunnels.contains(node) {
            self.inner.registry.node_gone(node);
        }
    }

    /// The instance holding `node`'s tunnel and its internal address at the last sync, when it
    /// is a remote node.
    pub fn owner_of(&self, node: &NodeId) -> Option<(String, String)> {
        lock(&self.inner.remote)
            .get(node)
            .map(|r| (r.owner.clone(), r.owner_addr.clone()))
    }
}

#[cfg(test)]
mod tests;
