//! The GPU owner's commands: `join` (one command from nothing to serving) and `status` (what the
//! gateway sees of this node).
//!
//! `join --gateway <url> --token <enrollment token>`:
//! 1. finds the engine (`--engine`, default `auto`; `--engine-url`, default the engine's usual
//!    port on 127.0.0.1: llama.cpp 8080, vLLM 8000, Ollama 11434, SGLang 30000) and reads its
//!    models, before spending the token;
//! 2. loads the node identity if the file exists, else generates it (an identity is never
//!    overwritten);
//! 3. redeems the token at the gateway's `POST /v1/enroll` with the public key;
//! 4. writes the config file (never over an existing one);
//! 5. starts serving, exactly as `reference-agent run --config <file>`.
//!
//! Of the engine's models only those in the gateway's catalog are ever routed. `join` sends the
//! engine's models with the token; when none is in the catalog the gateway refuses without
//! spending the token, and `join` stops before writing anything but the identity, saying which
//! names the catalog has, so the owner can fix the model name (llama.cpp `--alias`, vLLM/SGLang
//! `--served-model-name`, Ollama `ollama cp`) and join again with the same token.

use std::path::{Path, PathBuf};

use clap::Args;
use http::{Method, Uri};
use serde_json::{json, Value};
use spine_core::{EngineKind, ModelDescriptor};
use spine_transport::NodeIdentity;
use tracing::info;

use crate::config::{self, EngineArg, FileConfig, RunArgs};
use crate::engine::{self, Engine};
use crate::gateway::{self, GatewayEndpoint, GatewayUrl};
use crate::AnyError;

/// Options of `reference-agent join`.
#[derive(Debug, Args)]
pub(crate) struct JoinArgs {
    /// The gateway's tunnel listener, `wss://host:19000` (a `/v1/tunnel` path is accepted).
    #[arg(long)]
    pub(crate) gateway: String,
    /// The one-time enrollment token the gateway's operator gave you.
    #[arg(long, env = "SPINE_AGENT_ENROLLMENT_TOKEN", hide_env_values = true)]
    pub(crate) token: String,
    /// PEM file of the CA (or self-signed certificate) to trust for the gateway; default: the
    /// system bundle.
    #[arg(long)]
    pub(crate) ca_file: Option<PathBuf>,
    /// Allow a plaintext `ws://` gateway. INSECURE: prompts cross the network in clear.
    #[arg(long)]
    pub(crate) insecure_plaintext_tunnel: bool,
    /// Engine kind; `auto` detects it.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) engine: EngineArg,
    /// Engine base URL; default: the engine's usual port on 127.0.0.1 (auto: each is tried).
    #[arg(long)]
    pub(crate) engine_url: Option<String>,
    /// Where to write the config; default `~/.config/spine/agent.toml`.
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// The node identity file; default `node.key` beside the config. Reused when it exists.
    #[arg(long)]
    pub(crate) identity: Option<PathBuf>,
    /// A name for this node, shown to its operator (1–64 characters).
    #[arg(long)]
    pub(crate) name: Option<String>,
    /// Concurrent requests this node accepts. Default 4.
    #[arg(long)]
    pub(crate) max_concurrency: Option<u32>,
    /// GPU memory, MiB; default `nvidia-smi`, else 0.
    #[arg(long)]
    pub(crate) vram_mib: Option<u64>,
    /// Advertise only this model id (of those the engine serves).
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Print one JSON line (`{"event":"joined",…}`) instead of the text summary.
    #[arg(long)]
    pub(crate) json: bool,
    /// Enroll and write the config, but do not start serving.
    #[arg(long)]
    pub(crate) no_serve: bool,
}

/// Options of `reference-agent status`.
#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// The config `join` wrote; default `~/.config/spine/agent.toml`.
    #[arg(long, env = "SPINE_AGENT_CONFIG")]
    pub(crate) config: Option<PathBuf>,
    /// Print the gateway's answer as JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

/// The usual local URL of each engine.
fn default_engine_url(kind: EngineArg) -> &'static str {
    match kind {
        EngineArg::LlamaCpp | EngineArg::Auto => "http://127.0.0.1:8080",
        EngineArg::Vllm => "http://127.0.0.1:8000",
        EngineArg::Ollama => "http://127.0.0.1:11434",
        EngineArg::Sglang => "http://127.0.0.1:30000",
    }
}

fn engine_arg(kind: EngineKind) -> EngineArg {
    match kind {
        EngineKind::Vllm => EngineArg::Vllm,
        EngineKind::Ollama => EngineArg::Ollama,
        EngineKind::Sglang => EngineArg::Sglang,
        _ => EngineArg::LlamaCpp,
    }
}

fn parse_engine_url(url: &str) -> Result<Uri, AnyError> {
    let uri: Uri = url
        .parse()
        .map_err(|_| format!("invalid engine url {url:?}: must be http://host:port"))?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(format!("invalid engine url {url:?}: must be http://host:port").into());
    }
    Ok(uri)
}

/// The engine, its URL and its models: the given URL, else the kind's default URL, else (auto)
/// each engine's default URL in turn.
async fn find_engine(
    kind: EngineArg,
    url: Option<&str>,
) -> Result<(Box<dyn Engine>, String, Vec<ModelDescriptor>), AnyError> {
    let candidates: Vec<&str> = match (url, kind) {
        (Some(u), _) => vec![u],
        (None, EngineArg::Auto) => [
            EngineArg::LlamaCpp,
            EngineArg::Vllm,
            EngineArg::Ollama,
            EngineArg::Sglang,
        ]
        .into_iter()
        .map(default_engine_url)
        .collect(),
        (None, k) => vec![default_engine_url(k)],
    };
    let mut errors = Vec::new();
    for candidate in candidates {
        let base = parse_engine_url(candidate)?;
        let client = engine::engine_client();
        let found = match engine::adapter(kind, base.clone(), client.clone()) {
            Some(e) => Ok(e),
            None => engine::detect(base, client).await,
        };
        let engine = match found {
            Ok(e) => e,
            Err(e) => {
                errors.push(format!("{candidate}: {e}"));
                continue;
            }
        };
        if let Err(e) = engine.health().await {
            errors.push(format!(
                "{candidate}: {} is not healthy: {e}",
                engine.kind().as_str()
            ));
            continue;
        }
        let models = engine.models().await?;
        return Ok((engine, candidate.to_owned(), models));
    }
    Err(format!(
        "no running engine found ({}); start it first, or pass --engine and --engine-url",
        errors.join("; ")
    )
    .into())
}

/// An absolute form of `path` (relative to the current directory), for the config file.
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
}

/// Writes `text` to a new file (never over an existing one), creating its directory.
fn write_new(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()
}

/// `reference-agent join`: see the module docs.
#[allow(clippy::print_stdout)] // the summary on stdout is the command's output
pub(crate) async fn join(args: JoinArgs) -> Result<(), AnyError> {
    let url = GatewayUrl::parse(&args.gateway)?;
    if !url.tls && !args.insecure_plaintext_tunnel {
        return Err(
            "a ws:// or http:// gateway sends prompts in clear; use wss:// or pass --insecure-plaintext-tunnel"
                .into(),
        );
    }
    let config_path = args
        .config
        .clone()
        .or_else(config::default_config_path)
        .ok_or("no config directory ($XDG_CONFIG_HOME or $HOME); pass --config")?;
    if config_path.exists() {
        return Err(format!(
            "{} exists: this machine has joined already. Start it with `reference-agent run --config {}`, or pass another --config",
            config_path.display(),
            config_path.display()
        )
        .into());
    }
    let identity_path = args
        .identity
        .clone()
        .unwrap_or_else(|| config_path.with_file_name("node.key"));

    // the engine first: a missing engine must not use up the token
    let (engine, engine_url, models) = find_engine(args.engine, args.engine_url.as_deref()).await?;
    info!(engine = engine.kind().as_str(), url = %engine_url, models = models.len(), "engine found");

    let tls = if url.tls {
        Some(config::tls_client_config(args.ca_file.as_deref())?)
    } else {
        None
    };
    let endpoint = GatewayEndpoint::new(&url, tls)?;

    let identity = if identity_path.exists() {
        let identity = NodeIdentity::load(&identity_path)?;
        info!(path = %identity_path.display(), "reusing the existing node identity");
        identity
    } else {
        if let Some(dir) = identity_path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let identity = NodeIdentity::generate()?;
        identity.save(&identity_path)?;
        info!(path = %identity_path.display(), "node identity generated");
        identity
    };

    // the engine's models go with the token: the gateway refuses (without spending the token)
    // when none of them is in its catalog
    let offered: Vec<&str> = models
        .iter()
        .map(|m| m.id.as_str())
        .filter(|m| args.model.as_deref().is_none_or(|w| w == *m))
        .collect();
    let mut body = json!({
        "token": args.token,
        "public_key": identity.public_key_text(),
        "proof": spine_transport::node_status::enrollment_proof(&identity, &args.token),
        "models": offered,
    });
    if let Some(name) = &args.name {
        body["node_name"] = json!(name);
    }
    let answer = endpoint
        .request_json(Method::POST, "/v1/enroll", &[], Some(&body))
        .await
        .map_err(|e| format!("enrollment failed: {}", spine_transport::ErrorChain(&e)))?;
    let node_id = answer["node_id"].as_str().unwrap_or_default().to_owned();
    let operator_id = answer["operator_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let catalog: Vec<String> = answer["catalog_models"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| m.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    info!(node = %node_id, operator = %operator_id, "enrolled");

    let served: Vec<&str> = models
        .iter()
        .map(|m| m.id.as_str())
        .filter(|m| args.model.as_deref().is_none_or(|w| w == *m))
        .collect();
    let (routable, unlisted): (Vec<&str>, Vec<&str>) =
        served.iter().partition(|m| catalog.iter().any(|c| c == *m));

    let file = FileConfig {
        gateway: Some(url.tunnel_url()),
        identity: Some(absolute(&identity_path)),
        ca_file: args.ca_file.as_deref().map(absolute),
        insecure_plaintext_tunnel: args.insecure_plaintext_tunnel.then_some(true),
        engine: Some(engine_arg(engine.kind())),
        engine_url: Some(engine_url.clone()),
        max_concurrency: args.max_concurrency,
        vram_mib: args.vram_mib,
        model: args.model.clone(),
    };
    let text = format!(
        "# written by `reference-agent join` for node {node_id} (operator {operator_id})\n{}",
        toml::to_string(&file)?
    );
    write_new(&config_path, &text)
        .map_err(|e| format!("cannot write {}: {e}", config_path.display()))?;

    if args.json {
        println!(
            "{}",
            json!({
                "event": "joined",
                "node_id": node_id,
                "operator_id": operator_id,
                "engine": engine.kind().as_str(),
                "engine_url": engine_url,
                "routable_models": routable,
                "unlisted_models": unlisted,
                "config": config_path,
                "identity": identity_path,
            })
        );
    } else {
        println!("Joined the gateway as node {node_id} (operator {operator_id}).");
        println!("  engine:   {} at {engine_url}", engine.kind().as_str());
        println!(
            "  models:   {}",
            if routable.is_empty() {
                "none routable".to_owned()
            } else {
                routable.join(", ")
            }
        );
        if !unlisted.is_empty() {
            println!(
                "  ignored:  {} (not in the gateway's catalog)",
                unlisted.join(", ")
            );
        }
        println!("  config:   {}", config_path.display());
        println!(
            "  identity: {} (keep it; it is this node)",
            identity_path.display()
        );
    }
    if routable.is_empty() {
        return Err(format!(
            "none of the engine's models ({}) is in the gateway's catalog ({}); serve one under a catalog name (llama.cpp --alias, vLLM/SGLang --served-model-name, `ollama cp`), then `reference-agent run --config {}`",
            served.join(", "),
            catalog.join(", "),
            config_path.display()
        )
        .into());
    }
    if args.no_serve {
        return Ok(());
    }
    if !args.json {
        println!(
            "Serving now. Check it with `reference-agent status --config {}`.",
            config_path.display()
        );
    }
    crate::run(RunArgs {
        config: Some(config_path),
        ..RunArgs::default()
    })
    .await
}

/// Micros as a decimal amount with six places (`1234567` → `1.234567`).
fn format_micros(micros: u64) -> String {
    format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000)
}

fn names(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| m.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The status answer as text for a GPU owner.
pub(crate) fn format_status(v: &Value) -> String {
    let connected = v["connected"].as_bool().unwrap_or(false);
    let routable = v["routable"].as_bool().unwrap_or(false);
    let state = match (connected, routable) {
        (true, true) => "connected, routable (receiving requests)",
        (true, false) => "connected, not routable yet (the gateway is probing the engine)",
        _ => "NOT CONNECTED (start `reference-agent run`; nothing is earned while disconnected)",
    };
    let models = names(&v["models"]);
    let unlisted = names(&v["unlisted_models"]);
    let served = v["requests_served"].as_u64().unwrap_or(0);
    let mut out = String::new();
    let name = v["name"]
        .as_str()
        .map(|n| format!(" \"{n}\""))
        .unwrap_or_default();
    out.push_str(&format!(
        "Node {}{name} (operator {})\n",
        v["node_id"].as_str().unwrap_or("?"),
        v["operator_id"].as_str().unwrap_or("?")
    ));
    out.push_str(&format!("  connection:  {state}\n"));
    out.push_str(&format!(
        "  models:      {}\n",
        if models.is_empty() {
            "none routable".to_owned()
        } else {
            models.join(", ")
        }
    ));
    if !unlisted.is_empty() {
        out.push_str(&format!(
            "  not routed:  {} (not in the gateway's catalog: {})\n",
            unlisted.join(", "),
            names(&v["catalog_models"]).join(", ")
        ));
    }
    for a in v["audit"].as_array().into_iter().flatten() {
        let verdict = a["verdict"].as_str().unwrap_or("?");
        let what = match verdict {
            "failed" => " (NOT ROUTED: the audit found another model; fix the weights, then ask the gateway's operator to re-verify)",
            "suspect" => " (earnings at risk: audits disagree with the reference more than an honest node's)",
            _ => "",
        };
        out.push_str(&format!(
            "  audit:       {} {verdict}{what}; {} tokens audited, {} disagreed, statistic {:.2} (fails at {:.2})\n",
            a["model"].as_str().unwrap_or("?"),
            a["tokens_audited"].as_u64().unwrap_or(0),
            a["events"].as_u64().unwrap_or(0),
            a["statistic"].as_f64().unwrap_or(0.0),
            a["fail_threshold"].as_f64().unwrap_or(0.0),
        ));
    }
    out.push_str(&format!(
        "  in flight:   {}\n",
        v["in_flight"].as_u64().unwrap_or(0)
    ));
    out.push_str(&format!(
        "  served:      {served} request{}\n",
        if served == 1 { "" } else { "s" }
    ));
    out.push_str(&format!(
        "  earned:      {} by this node; {} by the operator in total (credits)\n",
        format_micros(v["earned_micros"].as_u64().unwrap_or(0)),
        format_micros(v["operator_earned_micros"].as_u64().unwrap_or(0))
    ));
    out
}

/// `reference-agent status`: asks the gateway (`GET /v1/node/status`, signed with the node key)
/// and prints its view.
#[allow(clippy::print_stdout)] // the status on stdout is the command's output
pub(crate) async fn status(args: StatusArgs) -> Result<(), AnyError> {
    let path = args
        .config
        .or_else(config::default_config_path)
        .ok_or("no config directory ($XDG_CONFIG_HOME or $HOME); pass --config")?;
    if !path.is_file() {
        return Err(format!(
            "no agent config at {}: join first (`reference-agent join --gateway … --token …`) or pass --config",
            path.display()
        )
        .into());
    }
    let file = config::load_file(&path)?;
    let gateway = file
        .gateway
        .as_deref()
        // several instances: ask the first
        .and_then(|g| g.split(',').map(str::trim).next())
        .ok_or_else(|| format!("{}: no `gateway`", path.display()))?;
    let identity_path = file
        .identity
        .as_deref()
        .ok_or_else(|| format!("{}: no `identity`", path.display()))?;
    let url = GatewayUrl::parse(gateway)?;
    let tls = if url.tls {
        Some(config::tls_client_config(file.ca_file.as_deref())?)
    } else {
        None
    };
    let identity = NodeIdentity::load(identity_path)?;
    let endpoint = GatewayEndpoint::new(&url, tls)?;
    let headers = gateway::status_headers(&identity);
    let answer = endpoint
        .request_json(Method::GET, "/v1/node/status", &headers, None)
        .await?;
    if args.json {
        println!("{answer}");
    } else {
        print!("{}", format_status(&answer));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
