//! Reference node agent for spine (design brief §7, §9).
//!
//! Dials the gateway's tunnel listener, proves the node's identity, and serves the allowed
//! inference paths of one local engine over the tunnel. Logs go to stderr (`RUST_LOG`); request
//! and response bodies are never logged.

mod config;
mod engine;
mod gateway;
mod operator;
mod proxy;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use spine_core::NodeDescriptor;
use spine_transport::{Backoff, NodeIdentity, TunnelClient, TunnelClientConfig};
use tracing::{error, info, warn};

use crate::config::{RunArgs, Settings};
use crate::engine::Engine;
use crate::proxy::EngineProxy;

/// spine reference agent: turns a local inference engine into a spine node.
#[derive(Debug, Parser)]
#[command(
    name = "reference-agent",
    version,
    args_conflicts_with_subcommands = true,
    after_help = "Joining a gateway, engines and options: README.md (\"Operator quick start\") and \
                  docs/operations.md in the source tree."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Without a subcommand: `run` with these options.
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate a node identity (ed25519) and print its public key, to register with the gateway.
    Keygen {
        /// Where to write the identity (32-byte seed, hex, mode 0600). Never overwritten.
        #[arg(long, env = "SPINE_AGENT_IDENTITY")]
        out: PathBuf,
    },
    /// Connect to the gateway and serve the local engine (the default).
    Run(RunArgs),
    /// Join a gateway in one command: find the engine, create the node key, redeem the
    /// enrollment token, write the config, and start serving.
    Join(Box<operator::JoinArgs>),
    /// Show what the gateway sees of this node: connection, routable models, requests served,
    /// earnings.
    Status(operator::StatusArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    // on a worker thread: the future `main` blocks on is polled on the main thread, and every
    // frame it would exchange with the spawned tasks (the tunnel's connection with the
    // requests it serves) would wake a thread across (measured: ~2 futex calls a request)
    match tokio::spawn(agent_main()).await {
        Ok(code) => code,
        Err(e) => {
            error!("{}", Chain(&e));
            ExitCode::FAILURE
        }
    }
}

async fn agent_main() -> ExitCode {
    spine_transport::logging::init();
    let cli = Cli::parse();
    let res = match cli.command {
        Some(Command::Keygen { out }) => keygen(&out),
        Some(Command::Run(args)) => run(args).await,
        Some(Command::Join(args)) => operator::join(*args).await,
        Some(Command::Status(args)) => operator::status(args).await,
        None => run(cli.run).await,
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{}", Chain(&*e));
            ExitCode::FAILURE
        }
    }
}

type AnyError = Box<dyn std::error::Error + Send + Sync>;

use spine_transport::ErrorChain as Chain;

#[allow(clippy::print_stdout)] // the public key on stdout is the command's output
fn keygen(out: &std::path::Path) -> Result<(), AnyError> {
    let identity = NodeIdentity::generate()?;
    identity.save(out)?;
    info!(path = %out.display(), "identity written");
    println!("{}", identity.public_key_text());
    Ok(())
}

/// Waits until the engine is healthy, retrying with backoff (0.5 s → 10 s).
async fn wait_for_engine(engine: &dyn Engine, url: &str) {
    let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(10));
    let mut attempt = 1u32;
    loop {
        match engine.health().await {
            Ok(()) => {
                info!(engine = engine.kind().as_str(), %url, "engine healthy");
                return;
            }
            Err(e) => {
                let delay = backoff.next_full();
                if attempt == 1 {
                    info!(%url, error = %Chain(&e), "waiting for the engine to become healthy");
                } else {
                    warn!(%url, attempt, error = %Chain(&e), retry_in_ms = delay.as_millis() as u64, "engine not healthy yet");
                }
                attempt = attempt.saturating_add(1);
                tokio::time::sleep(delay).await;
            }
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// Longest wait for a graceful stop after SIGTERM / ctrl-c: the tunnel's drain bound
/// (`TunnelClientConfig::drain_timeout`, 30 s) plus time for the WebSocket close. A second signal
/// stops at once.
const SHUTDOWN_BOUND: Duration = Duration::from_secs(35);

async fn run(args: RunArgs) -> Result<(), AnyError> {
    let settings = Settings::resolve(args)?;
    // Graceful shutdown (design brief §4): on SIGTERM the tunnel sends GOAWAY, requests in
    // flight finish (up to the drain timeout), then the WebSocket closes cleanly.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let serving = serve(settings, stop_rx);
    tokio::pin!(serving);
    tokio::select! {
        res = &mut serving => return res,
        () = shutdown_signal() => {}
    }
    info!("shutting down: draining the tunnel");
    let _ = stop_tx.send(true);
    tokio::select! {
        res = tokio::time::timeout(SHUTDOWN_BOUND, &mut serving) => match res {
            Ok(res) => res,
            Err(_) => {
                warn!("graceful shutdown took too long; stopping");
                Ok(())
            }
        },
        () = shutdown_signal() => {
            warn!("second signal; stopping at once");
            Ok(())
        }
    }
}

/// Resolves once `stop` says so (or its sender is gone).
async fn stopped(mut stop: tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

async fn serve(
    settings: Settings,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), AnyError> {
    let identity = NodeIdentity::load(&settings.identity)?;
    info!(public_key = %identity.public_key_text(), "identity loaded");

    let client = engine::engine_client();
    // before the tunnel is up there is nothing to drain: a stop ends the waits for the engine
    // at once (an unreachable engine kept the agent 35 s on SIGTERM)
    let engine_url = settings.engine_url.to_string();
    let ready = async {
        let engine =
            engine::select(settings.engine, settings.engine_url.clone(), client.clone()).await;
        wait_for_engine(&*engine, &engine_url).await;
        engine
    };
    let engine = tokio::select! {
        engine = ready => engine,
        () = stopped(stop.clone()) => {
            info!("stopped before the engine was ready");
            return Ok(());
        }
    };
    let mut models = engine.models().await?;
    if let Some(wanted) = &settings.model {
        models.retain(|m| m.id.as_str() == wanted);
        if models.is_empty() {
            return Err(format!("the engine does not serve model {wanted:?}").into());
        }
    }
    if models.is_empty() {
        return Err("the engine reports no models".into());
    }
    let vram_mib = match settings.vram_mib {
        Some(v) if v > 0 => v,
        _ => engine::detect_vram_mib().await.unwrap_or(0),
    };
    let served: Vec<spine_core::ModelId> = models.iter().map(|m| m.id.clone()).collect();
    let descriptor = NodeDescriptor {
        engine: engine.kind(),
        models,
        vram_mib,
        max_concurrency: settings.max_concurrency,
        agent_version: format!("reference-agent/{}", env!("CARGO_PKG_VERSION")),
    };
    info!(
        models = ?descriptor.models.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
        vram_mib,
        max_concurrency = descriptor.max_concurrency,
        "serving"
    );

    // one client per gateway instance (design brief §8): on disconnect the next one
    let tls = settings.tls_config()?;
    let mut tunnels = Vec::new();
    let mut backoff = (Duration::from_secs(1), Duration::from_secs(30));
    for url in &settings.gateways {
        let mut config = TunnelClientConfig::new(url.clone(), identity.clone(), descriptor.clone());
        config.allow_insecure_plaintext = settings.insecure_plaintext_tunnel;
        config.tls = tls.clone();
        backoff = (config.backoff_min, config.backoff_max);
        tunnels.push(TunnelClient::new(config)?);
    }
    let proxy = EngineProxy::new(client, settings.engine_url.clone(), engine.health_path())
        .with_guard(engine.request_guard(), served);
    // a drain waits for requests in flight, which only an engine that still works can end:
    // once stopping, when requests are in flight yet the engine has sent nothing for
    // ENGINE_QUIET_TO_CHECK and then fails its health check, it hangs, and the drain ends at
    // once (its requests fail on the gateway, their callers pay nothing). An engine that
    // streams (bytes flow) or that answers its health check is never cut: a busy engine whose
    // health answer is slow keeps its drain.
    let activity = proxy.activity();
    let engine_hung_while_draining = async {
        stopped(stop.clone()).await;
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            if activity.in_flight() == 0 || activity.quiet_for() < ENGINE_QUIET_TO_CHECK {
                continue;
            }
            match tokio::time::timeout(ENGINE_CHECK_TIMEOUT, engine.health()).await {
                Ok(Ok(())) => {}
                _ if activity.quiet_for() >= ENGINE_QUIET_TO_CHECK => return,
                _ => {}
            }
        }
    };
    tokio::select! {
        () = gateway::run_failover(tunnels, backoff, proxy, stopped(stop.clone())) => {
            info!("tunnel drained and closed");
        }
        () = engine_hung_while_draining => {
            warn!("the engine stopped answering while the tunnel drained; closing without waiting for its requests");
        }
    }
    Ok(())
}

/// While draining, how long the engine may send nothing, with requests in flight, before its
/// health is checked.
const ENGINE_QUIET_TO_CHECK: Duration = Duration::from_secs(2);
/// While draining, the engine's health check is given this long (SGLang's own check takes 1 s).
const ENGINE_CHECK_TIMEOUT: Duration = Duration::from_secs(2);
