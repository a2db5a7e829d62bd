//! `reference-gateway`: spine's reference gateway (design brief §7).
//!
//! Wires the library crates together: API-key auth and the OpenAI-compatible public API, the
//! metering layer over the SQLite ledger, the router, the tunnel listener agents dial, and the
//! admin API. Logic a library user would need lives in the libraries, not here.
#![allow(clippy::print_stdout)] // the binary prints one machine-readable "ready" line

mod admin;
mod admin_cli;
mod api;
mod config;
mod console;
mod error;
mod metrics;
mod state;

use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use spine_core::ModelId;
use spine_meter::classify::SseClassify;
use spine_meter::ledger::{drain_at_shutdown, open_store, StoreAuthenticator};
use spine_meter::limits;
use spine_meter::meter::{drain_streams, MeterLayer};
use spine_meter::Store;
use spine_router::cluster;
use spine_router::{NodeRegistry, QueueConfig, RegistryConfig, RouteConfig};
use spine_transport::{bind_listener, TunnelServer, TunnelServerConfig};

use tokio_util::sync::CancellationToken;
use tower::util::BoxCloneSyncService;
use tower::ServiceBuilder;

use crate::config::Config;
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
    spine_transport::raise_fd_limit();
    if let Err(e) = run(cli).await {
        // once, with its causes, whatever RUST_LOG filters (the log is the same stderr)
        eprintln!("reference-gateway: {}", spine_transport::ErrorChain(&*e));
        std::process::exit(1);
    }
}

async fn run(cli: Cli) -> Result<(), MainError> {
    let config = Config::load(cli.config.as_deref())?;
    spine_transport::create_private_dir(&config.data_dir)?;
    let cluster_config = config.cluster();
    let shutdown = CancellationToken::new();
    // the PostgreSQL heartbeat runs until the process exits (cancelled at the very end), not
    // only until shutdown starts: the drain can last up to twice the grace period, and a lapsed
    // heartbeat would let another instance's sweep settle this instance's streams still flowing
    let upkeep_stop = CancellationToken::new();
    // the cluster keeps its liveness and directory entries fresh through the public drain (peers
    // still reach this instance's nodes while their streams finish); stopped just before leaving
    let cluster_stop = CancellationToken::new();

    // SQLite: the previous run's holds are settled; PostgreSQL: holds carry this instance's
    // id, which is claimed, and the upkeep task heartbeats it until the process exits
    let store: Arc<dyn Store> = open_store(
        &config.database()?,
        &config.instance_id,
        upkeep_stop.clone(),
    )
    .await?;

    let catalog = spine_meter::catalog::load_catalog(&config.models)?;
    let catalog_ids = spine_meter::catalog::catalog_ids(&catalog);

    let registry = NodeRegistry::with_config(RegistryConfig {
        affinity_ttl: std::time::Duration::from_secs(config.affinity_ttl_secs),
        max_vram_mib: config.max_vram_mib,
        queue: QueueConfig {
            max_wait: std::time::Duration::from_secs(config.queue_max_wait_secs),
            max_depth: config.queue_max_depth,
        },
        load_aware_pick: config.load_aware_pick,
        limit_growth_max_ttft: std::time::Duration::from_secs(config.first_token_timeout_secs) / 2,
        overload_pause: std::time::Duration::from_secs(config.first_token_timeout_secs),
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
        Arc::new(cluster::RegistryEvents::new(
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
            // the internal listener's bound on forwarded bodies follows the public one
            let (cluster, internal) = cluster::join(
                cc,
                registry.clone(),
                catalog_ids.clone(),
                tunnels.clone(),
                config.max_request_body_bytes,
                cluster_stop.clone(),
            )
            .await?;
            let _ = cluster_slot.set(cluster.clone());
            internal_listener = Some(internal);
            Some(cluster)
        }
        None => None,
    };
    // per-key limits live in the store in both modes (so they survive a switch to several
    // instances); a `key_limits.json` kept by an earlier release is imported once
    limits::import_key_limits_file(&config.data_dir.join("key_limits.json"), &*store).await?;
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
        // the same bound as the router's silence bound, on progress instead of bytes: a node
        // that keeps its stream alive with comments or empty chunks is cut as stalled
        .stream_stall_timeout(std::time::Duration::from_secs(
            config.stream_idle_timeout_secs,
        ))
        .response_body_timeout(std::time::Duration::from_secs(
            config.response_body_timeout_secs,
        ))
        .strip_engine_fields(config.strip_engine_fields)
        .refused_credit_delay(std::time::Duration::from_millis(
            config.refused_credit_delay_ms,
        ))
        // every listener is a LimitedServer, which lingers on close: a 402 is answered before
        // the body is read and the caller still reads it
        .refuse_unread_bodies(true)
        .max_response_body_bytes(
            usize::try_from(config.max_response_body_bytes).unwrap_or(usize::MAX),
        )
        .max_buffered_request_bytes(
            usize::try_from(config.max_buffered_request_bytes).unwrap_or(usize::MAX),
        )
        .max_buffered_request_bytes_per_account(
            usize::try_from(config.max_buffered_request_bytes_per_account).unwrap_or(usize::MAX),
        )
        .max_unsettled_requests(
            usize::try_from(config.max_unsettled_requests).unwrap_or(usize::MAX),
            spine_meter::meter::UNSETTLED_WAIT,
        )
        // each usage discrepancy also lowers the node's score
        .events(Arc::new({
            let registry = registry.clone();
            spine_meter::metrics::MeterMetrics::new()
                .on_discrepancy(move |node| registry.record_discrepancy(node))
        }))
        .admission(limits.clone());
    // each catalog model with a `reference_url` is audited against that llama-server
    // (`[audit] node_logprobs`: scored on the nodes' own logprobs, the GGUF's vocabulary)
    let references = config
        .models
        .iter()
        .filter_map(|m| m.audited(config.audit.node_logprobs));
    let auditor = config.audit.spawn_auditor(references, store.clone())?;
    let meter = match &auditor {
        Some(auditor) => {
            registry.set_model_trust(Arc::new(auditor.clone()));
            meter.audit(Arc::new(auditor.clone()))
        }
        None => meter,
    };
    let settlements = meter.settlements();
    let credit_refusals = meter.credit_refusals();
    let body_gate = meter.body_gate();
    let route =
        cluster::tunnel_route_layer(registry.clone(), cluster.as_ref(), config.affinity_ttl_secs);
    let dispatch = cluster::tunnel_dispatch(cluster.as_ref(), &tunnels);
    let stack = ServiceBuilder::new()
        .layer(meter)
        // below the meter: the node's answer is read at the node's pace into a bounded buffer
        // (its slot is freed when generation ends); the meter counts what the caller takes
        .layer(spine_router::ReadAheadLayer::new(
            usize::try_from(config.stream_buffer_bytes).unwrap_or(usize::MAX),
        ))
        .layer(route.classify(Arc::new(SseClassify)).config(RouteConfig {
            max_retries: config.route_max_retries,
            first_content_timeout: std::time::Duration::from_secs(config.first_token_timeout_secs),
            stream_idle_timeout: std::time::Duration::from_secs(config.stream_idle_timeout_secs),
            ..RouteConfig::default()
        }))
        .service(dispatch);
    let stack = BoxCloneSyncService::new(stack);

    // Tunnel TLS: the configured files, or a self-signed pair kept in the data dir.
    let tls = if config.insecure_plaintext_tunnel {
        tracing::warn!("tunnel listener is PLAINTEXT (insecure_plaintext_tunnel = true)");
        None
    } else {
        let configured = config
            .tunnel_tls_cert_file
            .clone()
            .zip(config.tunnel_tls_key_file.clone());
        let files = spine_transport::tls_files_or_self_signed(
            configured.map(|(cert, key)| spine_transport::TlsFiles::new(cert, key)),
            &config.data_dir,
            &config.tunnel_tls_hosts,
        )?;
        Some((files.server_config()?, files.cert_path))
    };

    let state = Arc::new(AppState {
        store: store.clone(),
        credit_refusals,
        keys: spine_meter::keys::KeyCache::new(std::time::Duration::from_secs(
            config.key_cache_ttl_secs,
        )),
        registry: registry.clone(),
        tunnels: tunnels.clone(),
        stack,
        catalog_ids: catalog_ids.clone(),
        body_gate,
        admin_token: config.admin_token.clone(),
        limits,
        auditor: auditor.clone(),
        metrics,
        enrollment: spine_meter::enroll::NodeEnrollment::new(
            store.clone(),
            catalog_ids.clone(),
            Arc::new(state::Live {
                registry: registry.clone(),
                tunnels: tunnels.clone(),
            }),
            auditor,
        ),
    });

    let public = bind_listener(config.public_listen)?;
    let tunnel = bind_listener(config.tunnel_listen)?;
    let admin = bind_listener(config.admin_listen)?;
    let console_listener = bind_listener(config.console_listen)?;
    let ready = serde_json::json!({
        "event": "ready",
        "public_addr": public.local_addr()?.to_string(),
        "tunnel_addr": tunnel.local_addr()?.to_string(),
        "admin_addr": admin.local_addr()?.to_string(),
        "console_addr": console_listener.local_addr()?.to_string(),
        "tunnel_tls": tls.is_some(),
        "tunnel_ca_file": tls.as_ref().map(|(_, ca_file)| ca_file.display().to_string()),
        "instance_id": config.instance_id,
        "internal_addr": match &internal_listener {
            Some(l) => Some(l.local_addr()?.to_string()),
            None => None,
        },
    });
    // audit challenges for nodes with little traffic (design brief §10)
    let audited = config.models.iter().filter(|m| m.reference_url.is_some());
    let audited = audited.map(|m| ModelId::new(m.id.as_str())).collect();
    let challenges = state
        .auditor
        .as_ref()
        .and_then(|a| config.audit.challenges(a, audited));
    if let Some(challenges) = challenges {
        // routed to the challenged node only: every other routable node is avoided
        let (registry, stack) = (state.registry.clone(), state.stack.clone());
        let routable = move || {
            let nodes = registry.snapshot().into_iter();
            nodes
                .map(|n| {
                    (
                        n.node_id,
                        n.descriptor.models.into_iter().map(|m| m.id).collect(),
                    )
                })
                .collect()
        };
        tokio::spawn(challenges.run(routable, move |mut req, avoid| {
            req.extensions_mut().insert(spine_router::AvoidNodes(avoid));
            api::call_stack(stack.clone(), req)
        }));
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
    // the console (issue 18): builders' and GPU operators' pages on their own listener
    let join_url = config.console_join_gateway_url.clone().unwrap_or_else(|| {
        let port = tunnel
            .local_addr()
            .map_or(config.tunnel_listen.port(), |a| a.port());
        format!("wss://localhost:{port}")
    });
    let console_state = Arc::new(console::state(
        state.clone(),
        config.console_secure_cookies,
        join_url,
    )?);
    let mut console_task = tokio::spawn(spine_meter::console::serve(
        console_listener,
        console_state,
        config.listener_limits(config.console_max_connections),
        shutdown.clone(),
    ));
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
        // node enrollment and the node's own status (`spine_meter::enroll`)
        .merge(
            state
                .enrollment
                .clone()
                .tunnel_router()
                .layer(spine_meter::request_id::RequestIdLayer),
        );
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
        tls.map(|(server_config, _)| server_config),
        config
            .listener_limits(config.tunnel_max_connections)
            .tls_handshake_timeout(tunnel_handshake_timeout),
        tunnel_app,
    ));

    let early_exit = tokio::select! {
        () = spine_transport::shutdown_signal() => None,
        r = &mut public_task => Some(("public", r)),
        r = &mut admin_task => Some(("admin", r)),
        r = &mut console_task => Some(("console", r)),
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
    if !drain_streams(&mut public_task, grace, &drain_deadline).await {
        tracing::warn!("connections still open after their streams were ended; closing them");
        public_task.abort();
    }
    if let Some(cluster) = &cluster {
        // only now, after the public drain: during the grace period peers could still reach
        // this instance's nodes through the internal listener; from here they stop forwarding
        // here at once instead of at the TTLs
        cluster_stop.cancel();
        cluster.leave().await;
    }
    admin_task.abort();
    console_task.abort();
    tunnel_task.abort();
    if let Some(t) = internal_task {
        t.abort();
    }
    // Every stream has ended (or was cut); commit their settlements before exiting, then
    // settle the holds no request owns any more (or name the pending ones)
    drain_at_shutdown(&*store, &settlements, grace).await;
    upkeep_stop.cancel();
    tracing::info!("gateway stopped");
    Ok(())
}
