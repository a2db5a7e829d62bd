//! `reference-gateway`: spine's reference gateway (design brief §7).
//!
//! Wires the library crates together: API-key auth and the OpenAI-compatible public API, the
//! metering layer over the SQLite ledger, the router, the tunnel listener agents dial, and the
//! admin API. Logic a library user would need lives in the libraries, not here.
#![allow(clippy::print_stdout)] // the binary prints one machine-readable "ready" line

mod admin;
mod admin_cli;
mod api;
mod auth;
mod challenge;
mod config;
mod enroll;
mod error;
mod metrics;
mod state;

use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use spine_core::{ModelId, NodeDescriptor, NodeId};
use spine_meter::classify::SseClassify;
use spine_meter::limits;
use spine_meter::meter::{Catalog, CatalogEntry, MeterLayer};
use spine_meter::{InstanceUpkeep, ModelTokenizer, PgLedger, Price, SqliteLedger, Store};
use spine_router::cluster;
use spine_router::{NodeRegistry, QueueConfig, RegistryConfig, RouteConfig, RouteLayer};
use spine_transport::{
    NodeAuthenticator, RefusalReason, TunnelEvents, TunnelServer, TunnelServerConfig, TunnelService,
};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::util::BoxCloneSyncService;
use tower::ServiceBuilder;
use tower::ServiceExt as _;

use crate::config::{Config, Database};
use crate::state::AppState;

/// spine's reference gateway: an OpenAI-compatible endpoint in front of community GPU nodes.
#[derive(Debug, Parser)]
#[command(
    version,
    about,
    after_help = "Configuration keys and their defaults: docs/operations.md. Quick start: README.md, \
                  \"Run your own gateway and node\" (both in the source tree)."
)]
struct Cli {
    /// Configuration file (TOML). Every top-level key can also be set as `SPINE_<KEY>`.
    #[arg(long, env = "SPINE_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Calls a running gateway's admin API: accounts, keys, credits, operators, enrollments,
    /// nodes, requests, queues (`reference-gateway admin --help`).
    Admin(admin_cli::AdminArgs),
}

type MainError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() {
    spine_transport::logging::init();
    let mut cli = Cli::parse();
    if let Some(Command::Admin(args)) = cli.command.take() {
        if let Err(e) = admin_cli::run(args).await {
            eprintln!("reference-gateway admin: {e}");
            std::process::exit(1);
        }
        return;
    }
    raise_fd_limit();
    if let Err(e) = run(cli).await {
        // once, with its causes, whatever RUST_LOG filters (the log is the same stderr)
        eprintln!("reference-gateway: {}", spine_transport::ErrorChain(&*e));
        std::process::exit(1);
    }
}

/// Accept-queue length asked for on every listener (the kernel caps it at its own maximum,
/// `net.core.somaxconn`). Tokio's default (1024) overflows under a connection flood while the
/// accept loop catches up, and each dropped SYN costs its client a 1 s retransmit.
const LISTEN_BACKLOG: u32 = 4096;

/// Binds a listener with [`LISTEN_BACKLOG`] (and `SO_REUSEADDR` on Unix, as tokio's `bind`).
fn bind_listener(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Raises the soft limit on open files to the hard limit: every connection a listener holds is
/// a descriptor (up to the sum of the `*_max_connections`, plus the tunnels, the database and
/// engine sockets), and the usual soft default (1024) is far below the connection caps. Logs
/// the limit in force; a failure is logged and start-up goes on.
#[cfg(unix)]
fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let limit = getrlimit(Resource::Nofile);
    if limit.current == limit.maximum {
        tracing::info!(open_files = ?limit.current, "open file limit");
        return;
    }
    let raised = rustix::process::Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => tracing::info!(
            from = ?limit.current,
            to = ?limit.maximum,
            "open file limit raised to the hard limit"
        ),
        Err(e) => tracing::warn!(
            error = %e,
            open_files = ?limit.current,
            "could not raise the open file limit"
        ),
    }
}

#[cfg(not(unix))]
fn raise_fd_limit() {}

/// Registered public keys are the only nodes let in.
struct StoreAuthenticator(Arc<dyn Store>);

impl NodeAuthenticator for StoreAuthenticator {
    fn authenticate<'a>(
        &'a self,
        public_key_text: &'a str,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<NodeId, RefusalReason>> + Send + 'a>,
    > {
        Box::pin(async move {
            match self.0.node_for_public_key(public_key_text).await {
                Ok(Some(node)) => Ok(node),
                Ok(None) => Err(RefusalReason::UnknownKey),
                Err(e) => {
                    tracing::error!(error = %e, "node lookup failed");
                    Err(RefusalReason::Internal)
                }
            }
        })
    }
}

/// Tunnel lifecycle feeds the router's registry.
/// The second field is the catalog: a node is registered only with the catalog models its engine
/// serves (the others could never be billed; `GET /v1/node/status` lists them as unlisted).
/// In multi-instance mode the third field publishes local nodes in the shared directory (set
/// once the cluster has joined; tunnels are accepted only after that).
struct RegistryEvents(
    NodeRegistry,
    Vec<ModelId>,
    Arc<std::sync::OnceLock<cluster::Cluster>>,
);

impl TunnelEvents for RegistryEvents {
    fn node_ready(&self, node: &NodeId, descriptor: &NodeDescriptor) {
        let mut listed = descriptor.clone();
        listed.models.retain(|m| self.1.contains(&m.id));
        self.0.node_ready(node, &listed);
        if let Some(cluster) = self.2.get() {
            // the whole descriptor: each instance filters by its own catalog
            cluster.local_ready(node, descriptor);
        }
    }
    fn node_gone(&self, node: &NodeId) {
        self.0.node_gone(node);
        if let Some(cluster) = self.2.get() {
            cluster.local_gone(node);
        }
    }
    fn node_heartbeat(&self, node: &NodeId) {
        self.0.heartbeat(node);
    }
}

async fn run(cli: Cli) -> Result<(), MainError> {
    let config = Config::load(cli.config.as_deref())?;
    state::create_private_dir(&config.data_dir)?;
    let cluster_config = config.cluster();
    let shutdown = CancellationToken::new();
    // the PostgreSQL heartbeat runs until the process exits (cancelled at the very end), not
    // only until shutdown starts: the drain can last up to twice the grace period, and a lapsed
    // heartbeat would let another instance's sweep settle this instance's streams still flowing
    let upkeep_stop = CancellationToken::new();
    // the cluster keeps its liveness and directory entries fresh through the public drain (peers
    // still reach this instance's nodes while their streams finish); stopped just before leaving
    let cluster_stop = CancellationToken::new();

    let store: Arc<dyn Store> = match config.database()? {
        Database::Sqlite(path) => {
            let store = Arc::new(SqliteLedger::open(path).await?);
            // single instance: no request of a previous run is in flight; holds it left are stale
            let stale_holds = store.settle_stale_holds().await?;
            if stale_holds > 0 {
                tracing::warn!(
                    stale_holds,
                    "settled holds left active by the previous run as upstream_failed"
                );
            }
            store
        }
        Database::Postgres(url) => {
            // shared by any number of instances: holds carry this instance's id; at start the id
            // is claimed (refused while another live process heartbeats it: ids must be
            // unique; a restart under the same id waits up to 6 s for the previous process's
            // heartbeat to lapse), then only this instance's own leftovers (a previous run under
            // the same id) are settled, and the upkeep task heartbeats the `instances` row and
            // settles the holds of instances whose heartbeat lapsed, never a live instance's
            // request in flight
            let upkeep = InstanceUpkeep::default();
            let store = Arc::new(
                PgLedger::connect(&url)
                    .await?
                    .with_instance_id(config.instance_id.clone()),
            );
            store.claim_instance(upkeep.live_within).await?;
            let stale_holds = store.settle_stale_holds().await?;
            if stale_holds > 0 {
                tracing::warn!(
                    stale_holds,
                    "settled holds this instance left active in a previous run as upstream_failed"
                );
            }
            let _upkeep = store
                .clone()
                .spawn_instance_upkeep(upkeep, upkeep_stop.clone());
            tracing::info!(instance_id = %config.instance_id, "ledger on PostgreSQL");
            store
        }
    };

    let mut catalog = Catalog::new();
    for m in &config.models {
        let Some(gguf) = &m.gguf else {
            return Err(format!("model '{}': set `gguf` to load its tokenizer", m.id).into());
        };
        if let Some(want) = &m.gguf_sha256 {
            check_sha256(gguf, want).map_err(|e| format!("model '{}': {e}", m.id))?;
        }
        let tokenizer = ModelTokenizer::from_gguf(gguf).map_err(|e| {
            format!(
                "model '{}': loading {}: {}",
                m.id,
                gguf.display(),
                spine_transport::ErrorChain(&e)
            )
        })?;
        let max_context_tokens = m
            .max_context_tokens
            .or(tokenizer.context_length_tokens())
            .unwrap_or(4096);
        let entry = CatalogEntry {
            tokenizer: Arc::new(tokenizer),
            price: Price {
                input_micros_per_mtok: m.input_price_micros_per_mtok,
                output_micros_per_mtok: m.output_price_micros_per_mtok,
            },
            max_context_tokens,
        };
        if catalog.insert(ModelId::new(m.id.as_str()), entry).is_some() {
            return Err(format!("model '{}' is configured twice", m.id).into());
        }
    }
    let mut catalog_ids: Vec<ModelId> = catalog.keys().cloned().collect();
    catalog_ids.sort();
    if catalog_ids.is_empty() {
        tracing::warn!(
            "the catalog is empty: no [[models]] in the configuration, so every completion \
             request will be refused 404 model_not_found (docs/operations.md, `[[models]]`)"
        );
    } else {
        tracing::info!(models = ?catalog_ids, "catalog loaded");
    }

    let registry = NodeRegistry::with_config(RegistryConfig {
        affinity_ttl: std::time::Duration::from_secs(config.affinity_ttl_secs),
        max_vram_mib: config.max_vram_mib,
        queue: QueueConfig {
            max_wait: std::time::Duration::from_secs(config.queue_max_wait_secs),
            max_depth: config.queue_max_depth,
        },
        load_aware_pick: config.load_aware_pick,
        ..RegistryConfig::default()
    });
    let cluster_slot: Arc<std::sync::OnceLock<cluster::Cluster>> = Arc::default();
    let mut tunnel_config = TunnelServerConfig::default();
    tunnel_config.gateway_id = config.gateway_id.clone();
    tunnel_config.stall_timeout = std::time::Duration::from_secs(config.node_stall_timeout_secs);
    tunnel_config.public_names = config.tunnel_public_names();
    if config.tunnel_tls_cert_file.is_some()
        && config.tunnel_public_names.is_empty()
        && config.tunnel_tls_hosts.is_empty()
    {
        tracing::warn!(
            "tunnel_tls_cert_file is set but neither tunnel_public_names nor tunnel_tls_hosts: \
             agents dialling any name but localhost, 127.0.0.1 or ::1 are refused wrong_gateway"
        );
    }
    let tunnel_handshake_timeout = tunnel_config.handshake_timeout;
    let tunnel_server = TunnelServer::new(
        tunnel_config,
        Arc::new(StoreAuthenticator(store.clone())),
        Arc::new(RegistryEvents(
            registry.clone(),
            catalog_ids.clone(),
            cluster_slot.clone(),
        )),
    );
    let tunnels = tunnel_server.tunnels();

    let metrics = metrics::install()?;
    spine_transport::metric::describe();

    // Multi-instance mode: the shared Redis connection, the internal listener, the directory.
    let mut internal_listener = None;
    let cluster = match &cluster_config {
        Some(cc) => {
            cluster::describe();
            let redis = cluster::connect_redis(&cc.redis_url)
                .map_err(|e| format!("redis_url: {}", spine_transport::ErrorChain(&e)))?;
            let internal = bind_listener(cc.internal_listen)?;
            let internal_addr = match &cc.internal_advertise {
                Some(a) => a.clone(),
                None => internal.local_addr()?.to_string(),
            };
            let cluster = cluster::Cluster::start(
                cc,
                redis,
                internal_addr,
                registry.clone(),
                catalog_ids.clone(),
                tunnels.clone(),
                cluster_stop.clone(),
            )
            .await;
            // the internal listener's bound on forwarded bodies follows the public one
            cluster.set_max_request_body_bytes(config.max_request_body_bytes);
            if cluster.redis_down() {
                tracing::warn!("Redis unreachable at start; serving local nodes until it answers");
            }
            tracing::info!(instance_id = cluster.instance_id(), "multi-instance mode");
            let _ = cluster_slot.set(cluster.clone());
            internal_listener = Some(internal);
            Some(cluster)
        }
        None => None,
    };
    // per-key limits live in the store in both modes (so they survive a switch to several
    // instances); a `key_limits.json` kept by an earlier release is imported once
    let imported =
        limits::import_key_limits_file(&config.data_dir.join("key_limits.json"), &*store).await?;
    if imported > 0 {
        tracing::info!(
            keys = imported,
            "imported per-key limits from key_limits.json into the store (renamed to key_limits.json.imported)"
        );
    }
    // buckets: shared in Redis in multi-instance mode, in this process otherwise
    let limits = Arc::new(match &cluster {
        Some(cluster) => limits::RateLimits::with_redis(
            cluster.redis_connection(),
            cluster.key(""),
            config.default_rpm_limit,
            config.default_tpm_limit,
            store.clone(),
        ),
        None => limits::RateLimits::with_store(
            config.default_rpm_limit,
            config.default_tpm_limit,
            store.clone(),
        ),
    });
    // cancelled when the shutdown's grace period ends: streams still open end with an error
    // event (`stream_bound_reached`) and settle `cut_at_bound` instead of being cut mid-chunk
    let drain_deadline = CancellationToken::new();
    let meter = MeterLayer::new(store.clone().into_ledger(), catalog)
        .drain_deadline(drain_deadline.clone())
        .operator_share_bps(config.operator_share_bps)
        .max_request_body_bytes(config.max_request_body_bytes)
        .max_sse_bytes(config.max_sse_line_bytes, config.max_sse_event_bytes)
        .max_stream_duration(std::time::Duration::from_secs(
            config.max_stream_duration_secs,
        ))
        .strip_engine_fields(config.strip_engine_fields)
        .events(Arc::new(metrics::GatewayEvents {
            registry: registry.clone(),
        }))
        .admission(limits.clone());
    let auditor = start_auditor(&config, store.clone())?;
    let meter = match &auditor {
        Some(auditor) => {
            registry.set_model_trust(Arc::new(auditor.clone()));
            meter.audit(Arc::new(auditor.clone()))
        }
        None => meter,
    };
    let settlements = meter.settlements();
    let mut route = RouteLayer::new(registry.clone());
    if let Some(cluster) = &cluster {
        route = route.affinity_store(Arc::new(cluster::RedisAffinity::new(
            cluster.clone(),
            config.affinity_ttl_secs,
        )));
    }
    let dispatch: BoxCloneSyncService<
        http::Request<spine_core::BoxBody>,
        http::Response<spine_core::BoxBody>,
        spine_core::BoxError,
    > = match &cluster {
        Some(cluster) => BoxCloneSyncService::new(cluster::cluster_service(cluster)),
        None => BoxCloneSyncService::new(
            TunnelService::new(tunnels.clone()).map_err(spine_core::BoxError::from),
        ),
    };
    let stack = ServiceBuilder::new()
        .layer(meter)
        // below the meter: the node's answer is read at the node's pace into a bounded buffer
        // (its slot is freed when generation ends); the meter counts what the caller takes
        .layer(spine_router::ReadAheadLayer::new(
            usize::try_from(config.stream_buffer_bytes).unwrap_or(usize::MAX),
        ))
        .layer(
            route
                .classify(Arc::new(SseClassify))
                .config(RouteConfig {
                    max_retries: config.route_max_retries,
                    first_content_timeout: std::time::Duration::from_secs(
                        config.first_token_timeout_secs,
                    ),
                    stream_idle_timeout: std::time::Duration::from_secs(
                        config.stream_idle_timeout_secs,
                    ),
                    ..RouteConfig::default()
                })
                // the tunnel's per-node stream limit is the gateway's own, and a remote node's
                // owner being gone or unreachable is no fault of the node: retried, not scored
                .not_node_fault(|e| {
                    e.downcast_ref::<spine_transport::TunnelError>()
                        .is_some_and(spine_transport::TunnelError::is_node_full)
                        || cluster::ClusterError::not_node_fault(e)
                })
                // a stream slot released a moment late (or an HTTP/2 REFUSED_STREAM): the same
                // node is picked again after a short pause
                .node_full(|e| {
                    e.downcast_ref::<spine_transport::TunnelError>()
                        .is_some_and(|e| e.is_node_full() || e.is_stream_refused())
                        || cluster::ClusterError::is_node_full(e)
                }),
        )
        .service(dispatch);
    let stack = BoxCloneSyncService::new(stack);

    // Tunnel TLS: the configured files, or a self-signed pair kept in the data dir.
    let tls = if config.insecure_plaintext_tunnel {
        tracing::warn!("tunnel listener is PLAINTEXT (insecure_plaintext_tunnel = true)");
        None
    } else {
        Some(state::tunnel_tls(&config)?)
    };

    let state = Arc::new(AppState {
        store: store.clone(),
        keys: auth::KeyCache::default(),
        registry: registry.clone(),
        tunnels: tunnels.clone(),
        stack,
        catalog_ids,
        max_request_body_bytes: config.max_request_body_bytes,
        admin_token: config.admin_token.clone(),
        limits,
        auditor,
        metrics,
    });

    let public = bind_listener(config.public_listen)?;
    let tunnel = bind_listener(config.tunnel_listen)?;
    let admin = bind_listener(config.admin_listen)?;
    let ready = serde_json::json!({
        "event": "ready",
        "public_addr": public.local_addr()?.to_string(),
        "tunnel_addr": tunnel.local_addr()?.to_string(),
        "admin_addr": admin.local_addr()?.to_string(),
        "tunnel_tls": tls.is_some(),
        "tunnel_ca_file": tls.as_ref().map(|t| t.ca_file.display().to_string()),
        "instance_id": config.instance_id,
        "internal_addr": match &internal_listener {
            Some(l) => Some(l.local_addr()?.to_string()),
            None => None,
        },
    });
    // audit challenges for nodes with little traffic (design brief §10)
    if let (Some(auditor), Some(account)) = (&state.auditor, &config.audit.challenge_account) {
        let audited: Vec<ModelId> = config
            .models
            .iter()
            .filter(|m| m.reference_url.is_some())
            .map(|m| ModelId::new(m.id.as_str()))
            .collect();
        let interval = std::time::Duration::from_secs(config.audit.challenge_interval_secs.max(1));
        tokio::spawn(challenge::run(
            state.clone(),
            auditor.clone(),
            spine_core::AccountId::new(account.as_str()),
            audited,
            interval,
        ));
    }
    tracing::info!(%ready, "gateway listening");
    println!("{ready}");

    // Shutdown (SIGTERM / ctrl-c): stop accepting callers and admin calls at once, let streams in
    // flight finish for up to `shutdown_grace_secs` while tunnels stay up, then stop. Holds of
    // streams cut off by the deadline are settled `upstream_failed`: with SQLite at the next
    // start; with PostgreSQL at the next start under the same `instance_id`, or by another
    // instance's sweep 60 s after this one's heartbeat stops (always so with the random default
    // id, which no later start reuses).
    let public_app = api::router(state.clone());
    let admin_app = admin::router(state.clone());
    let mut public_task = tokio::spawn(
        spine_transport::LimitedServer::new(
            "public",
            config.listener_limits(config.public_max_connections),
        )
        .serve(public, public_app, shutdown.clone().cancelled_owned()),
    );
    let mut admin_task = tokio::spawn(
        spine_transport::LimitedServer::new(
            "admin",
            config.listener_limits(config.admin_max_connections),
        )
        .serve(admin, admin_app, shutdown.clone().cancelled_owned()),
    );
    // The tunnel listener: agents' WebSocket upgrade on `GET /v1/tunnel` (TLS unless the
    // insecure flag is set); other routes on the same listener are merged into `tunnel_app`.
    let tunnel_app: axum::Router = axum::Router::new()
        .route_service(
            spine_transport::TUNNEL_PATH,
            tunnel_server.upgrade_service(),
        )
        // node enrollment and the node's own status (enroll.rs)
        .merge(enroll::tunnel_router(state.clone()));
    let internal_task = internal_listener.zip(cluster.clone()).map(|(l, c)| {
        tokio::spawn(cluster::serve_internal(
            l,
            c,
            config.listener_limits(config.internal_max_connections),
            error::relay_error_response,
        ))
    });
    let mut tunnel_task = tokio::spawn(spine_transport::serve_listener(
        tunnel,
        tls.map(|t| t.server_config),
        config
            .listener_limits(config.tunnel_max_connections)
            .tls_handshake_timeout(tunnel_handshake_timeout),
        tunnel_app,
    ));

    let early_exit = tokio::select! {
        () = shutdown_signal() => None,
        r = &mut public_task => Some(("public", r)),
        r = &mut admin_task => Some(("admin", r)),
        r = &mut tunnel_task => Some(("tunnel", r)),
    };
    if let Some((which, r)) = early_exit {
        shutdown.cancel();
        cluster_stop.cancel();
        upkeep_stop.cancel();
        return Err(match r {
            Ok(Ok(())) => format!("{which} listener stopped unexpectedly").into(),
            Ok(Err(e)) => format!("{which} listener failed: {e}").into(),
            Err(e) => format!("{which} listener task failed: {e}").into(),
        });
    }
    tracing::info!(
        grace_secs = config.shutdown_grace_secs,
        "shutting down: no new requests; waiting for streams in flight"
    );
    shutdown.cancel();
    let grace = std::time::Duration::from_secs(config.shutdown_grace_secs);
    if tokio::time::timeout(grace, &mut public_task).await.is_err() {
        // each open stream ends with its error event and settles; the connections then close
        tracing::warn!("streams still open after the grace period; ending them");
        drain_deadline.cancel();
        if tokio::time::timeout(DRAIN_CUT_WRITE_BOUND, &mut public_task)
            .await
            .is_err()
        {
            tracing::warn!("connections still open after their streams were ended; closing them");
            public_task.abort();
        }
    }
    if let Some(cluster) = &cluster {
        // only now, after the public drain: during the grace period peers could still reach
        // this instance's nodes through the internal listener; from here they stop forwarding
        // here at once instead of at the TTLs
        cluster_stop.cancel();
        cluster.leave().await;
    }
    admin_task.abort();
    tunnel_task.abort();
    if let Some(t) = internal_task {
        t.abort();
    }
    // Every stream has ended (or was cut); commit their settlements before exiting.
    let drained = tokio::time::timeout(grace, settlements.drain())
        .await
        .is_ok();
    if drained {
        // every request of this process has ended and its settlement is committed: a hold still
        // active has no owner left; settled now, recorded as `shutdown` (not left to the next
        // start, which would log it as after a crash)
        match store.settle_holds_at_shutdown().await {
            Ok(0) => {}
            Ok(n) => tracing::warn!(
                holds = n,
                "settled holds no request owned at shutdown as upstream_failed (swept: shutdown)"
            ),
            Err(e) => tracing::warn!(error = %e, "shutdown sweep of holds failed"),
        }
    } else {
        // named, so an operator can reconcile them: the holds stay in the ledger and are
        // settled `upstream_failed` at the next start (SQLite, or PostgreSQL under the same
        // `instance_id`) or by another instance's sweep once this one's heartbeat has been
        // stopped for 60 s (PostgreSQL; the only way with the random default `instance_id`)
        tracing::error!(
            pending = settlements.pending(),
            request_ids = ?settlements.pending_request_ids(),
            "settlements still pending; their holds are settled upstream_failed at the next start under this instance_id, or by another instance's sweep 60 s after this one stops"
        );
    }
    upkeep_stop.cancel();
    tracing::info!("gateway stopped");
    Ok(())
}

/// How long streams ended at the grace period's end get to write their error event to callers
/// before the public listener is closed under them (a caller that reads nothing is cut).
const DRAIN_CUT_WRITE_BOUND: std::time::Duration = std::time::Duration::from_secs(5);

/// Refuses a GGUF whose SHA-256 is not `want` (hex): the model's identity (design brief §10).
fn check_sha256(path: &std::path::Path, want: &str) -> Result<(), String> {
    use sha2::Digest as _;
    let mut file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut hasher = sha2::Sha256::new();
    std::io::copy(&mut file, &mut hasher).map_err(|e| format!("{}: {e}", path.display()))?;
    let got: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if got.eq_ignore_ascii_case(want.trim()) {
        Ok(())
    } else {
        Err(format!(
            "{} has SHA-256 {got}, not the configured gguf_sha256 {want}: not the model's weights",
            path.display()
        ))
    }
}

/// The auditor, when a catalog model names a reference (design brief §10): each model with a
/// `reference_url` is audited against that llama-server; models without one are not audited.
fn start_auditor(
    config: &config::Config,
    store: Arc<dyn spine_meter::Store>,
) -> Result<Option<spine_meter::audit::Auditor>, MainError> {
    use spine_meter::audit::{Auditor, LlamaCppReference, ReferenceSet};
    let mut set = ReferenceSet::new();
    let mut any = false;
    for m in &config.models {
        if let Some(url) = &m.reference_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!(
                    "model '{}': reference_url must be an http:// URL of a llama-server (got {url})",
                    m.id
                )
                .into());
            }
            set = set.with(
                ModelId::new(m.id.as_str()),
                Arc::new(LlamaCppReference::new(url.as_str())),
            );
            any = true;
        }
    }
    if !any {
        return Ok(None);
    }
    let audit_config = config.audit.audit_config()?;
    tracing::info!(
        ?audit_config,
        "auditing nodes' models against their references"
    );
    Ok(Some(Auditor::spawn_with(
        audit_config,
        Arc::new(set),
        Arc::new(spine_meter::audit::EscrowOnVerdict::new(store)),
    )))
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
