//! Agent settings: command-line flags, `SPINE_AGENT_*` environment variables, and an optional
//! TOML file with the same keys in snake_case. Flags and environment win over the file.
//!
//! `reference-agent join` writes that file (default [`default_config_path`]); `run` without
//! `--config` and without `--gateway` reads it from there, and `status` always does.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use http::Uri;
use serde::{Deserialize, Serialize};

/// Default `max_concurrency`.
pub(crate) const DEFAULT_MAX_CONCURRENCY: u32 = 4;

/// Places a system CA bundle is usually found, for `wss://` without `--ca-file`.
const SYSTEM_CA_BUNDLES: [&str; 4] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
    "/etc/ssl/ca-bundle.pem",
];

/// Engine kinds on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Deserialize, Serialize)]
pub(crate) enum EngineArg {
    /// llama.cpp's `llama-server`.
    #[value(name = "llama.cpp")]
    #[serde(rename = "llama.cpp")]
    LlamaCpp,
    /// vLLM's OpenAI-compatible server.
    #[value(name = "vllm")]
    #[serde(rename = "vllm")]
    Vllm,
    /// Ollama (its OpenAI-compatible `/v1` paths).
    #[value(name = "ollama")]
    #[serde(rename = "ollama")]
    Ollama,
    /// SGLang.
    #[value(name = "sglang")]
    #[serde(rename = "sglang")]
    Sglang,
    /// Detect which of the four answers at the engine URL (`engine::detect`).
    #[value(name = "auto")]
    #[serde(rename = "auto")]
    Auto,
}

/// Options of `reference-agent run`.
#[derive(Debug, Default, clap::Args)]
pub(crate) struct RunArgs {
    /// TOML file with the same keys as these flags, in snake_case.
    #[arg(long, env = "SPINE_AGENT_CONFIG")]
    pub(crate) config: Option<PathBuf>,
    /// Gateway tunnel URL, `wss://host:19000/v1/tunnel`; several instances comma-separated
    /// (tried in order; on disconnect the next one).
    #[arg(long, env = "SPINE_AGENT_GATEWAY")]
    pub(crate) gateway: Option<String>,
    /// Identity file written by `reference-agent keygen`.
    #[arg(long, env = "SPINE_AGENT_IDENTITY")]
    pub(crate) identity: Option<PathBuf>,
    /// PEM file of the CA (or self-signed certificate) to trust for the gateway; default: the
    /// system bundle.
    #[arg(long, env = "SPINE_AGENT_CA_FILE")]
    pub(crate) ca_file: Option<PathBuf>,
    /// Allow a plaintext `ws://` gateway URL. INSECURE: prompts cross the network in clear.
    #[arg(long, env = "SPINE_AGENT_INSECURE_PLAINTEXT_TUNNEL")]
    pub(crate) insecure_plaintext_tunnel: bool,
    /// Engine kind.
    #[arg(long, env = "SPINE_AGENT_ENGINE", value_enum)]
    pub(crate) engine: Option<EngineArg>,
    /// Engine base URL, `http://127.0.0.1:8080`.
    #[arg(long, env = "SPINE_AGENT_ENGINE_URL")]
    pub(crate) engine_url: Option<String>,
    /// Concurrent requests this node accepts (HTTP/2 max concurrent streams). Default 4.
    #[arg(long, env = "SPINE_AGENT_MAX_CONCURRENCY")]
    pub(crate) max_concurrency: Option<u32>,
    /// GPU memory, MiB; 0 or absent: the config file, else `nvidia-smi`, else 0.
    #[arg(long, env = "SPINE_AGENT_VRAM_MIB")]
    pub(crate) vram_mib: Option<u64>,
    /// Advertise only this model id (of those the engine serves).
    #[arg(long, env = "SPINE_AGENT_MODEL")]
    pub(crate) model: Option<String>,
}

/// The TOML file.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileConfig {
    /// One URL, several comma-separated, or a TOML array of URLs (kept comma-joined here).
    #[serde(
        default,
        deserialize_with = "one_or_many",
        skip_serializing_if = "Option::is_none"
    )]
    pub(crate) gateway: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) identity: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ca_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) insecure_plaintext_tunnel: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) engine: Option<EngineArg>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) engine_url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) max_concurrency: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) vram_mib: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) model: Option<String>,
}

/// `gateway = "url"`, `gateway = "url1,url2"` or `gateway = ["url1", "url2"]`, as one
/// comma-separated string.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(Some(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => s,
        OneOrMany::Many(v) => v.join(","),
    }))
}

/// Where `join` writes the config and `status` / `run` look for it:
/// `$XDG_CONFIG_HOME/spine/agent.toml`, else `$HOME/.config/spine/agent.toml`; `None` when
/// neither variable is set.
pub(crate) fn default_config_path() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".config"))
        })?;
    Some(base.join("spine").join("agent.toml"))
}

/// Errors resolving settings.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConfigError {
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid config file {}: {source}", path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    #[error("missing setting {0} (flag --{1}, env SPINE_AGENT_{2}, or config key {0})")]
    Missing(&'static str, &'static str, &'static str),
    #[error("invalid engine url {url:?}: must be http://host:port")]
    EngineUrl { url: String },
    #[error("max_concurrency must be at least 1")]
    MaxConcurrency,
    #[error("cannot read ca file {}: {source}", path.display())]
    CaFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("gateway urls must all be wss:// (or all ws://)")]
    MixedGatewaySchemes,
    #[error("no ca file given and no system ca bundle found; pass --ca-file")]
    NoSystemRoots,
    #[error("tls: {0}")]
    Tls(#[from] spine_transport::TlsError),
}

/// Resolved settings for `run`.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// The first gateway URL (all share its scheme and TLS trust).
    pub(crate) gateway: String,
    /// Every gateway URL, in the order they are tried (design brief §8: several instances).
    pub(crate) gateways: Vec<String>,
    pub(crate) identity: PathBuf,
    pub(crate) ca_file: Option<PathBuf>,
    pub(crate) insecure_plaintext_tunnel: bool,
    pub(crate) engine: EngineArg,
    pub(crate) engine_url: Uri,
    pub(crate) max_concurrency: u32,
    pub(crate) vram_mib: Option<u64>,
    pub(crate) model: Option<String>,
}

impl Settings {
    /// Flags/env over the file over defaults. Without `--config` and `--gateway`, the file
    /// `join` wrote ([`default_config_path`]) is read when it exists.
    pub(crate) fn resolve(args: RunArgs) -> Result<Self, ConfigError> {
        let file = match &args.config {
            Some(path) => load_file(path)?,
            None if args.gateway.is_none() => match default_config_path() {
                Some(path) if path.is_file() => load_file(&path)?,
                _ => FileConfig::default(),
            },
            None => FileConfig::default(),
        };
        Self::merge(args, file)
    }

    fn merge(args: RunArgs, file: FileConfig) -> Result<Self, ConfigError> {
        let gateway = args
            .gateway
            .or(file.gateway)
            .ok_or(ConfigError::Missing("gateway", "gateway", "GATEWAY"))?;
        let gateways: Vec<String> = gateway
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect();
        let Some(gateway) = gateways.first().cloned() else {
            return Err(ConfigError::Missing("gateway", "gateway", "GATEWAY"));
        };
        let scheme = |u: &str| u.split("://").next().map(str::to_owned);
        if gateways.iter().any(|u| scheme(u) != scheme(&gateway)) {
            return Err(ConfigError::MixedGatewaySchemes);
        }
        let identity = args
            .identity
            .or(file.identity)
            .ok_or(ConfigError::Missing("identity", "identity", "IDENTITY"))?;
        let engine_url = args
            .engine_url
            .or(file.engine_url)
            .ok_or(ConfigError::Missing(
                "engine_url",
                "engine-url",
                "ENGINE_URL",
            ))?;
        let parsed: Uri = engine_url.parse().map_err(|_| ConfigError::EngineUrl {
            url: engine_url.clone(),
        })?;
        if parsed.scheme_str() != Some("http") || parsed.authority().is_none() {
            return Err(ConfigError::EngineUrl { url: engine_url });
        }
        let max_concurrency = args
            .max_concurrency
            .or(file.max_concurrency)
            .unwrap_or(DEFAULT_MAX_CONCURRENCY);
        if max_concurrency == 0 {
            return Err(ConfigError::MaxConcurrency);
        }
        Ok(Self {
            gateway,
            gateways,
            identity,
            ca_file: args.ca_file.or(file.ca_file),
            insecure_plaintext_tunnel: args.insecure_plaintext_tunnel
                || file.insecure_plaintext_tunnel.unwrap_or(false),
            engine: args.engine.or(file.engine).unwrap_or(EngineArg::LlamaCpp),
            engine_url: parsed,
            max_concurrency,
            vram_mib: args.vram_mib.filter(|v| *v > 0).or(file.vram_mib),
            model: args.model.or(file.model),
        })
    }

    /// The TLS client configuration for a `wss://` gateway: the CA file, else the system bundle.
    /// `None` for `ws://`.
    pub(crate) fn tls_config(&self) -> Result<Option<Arc<rustls::ClientConfig>>, ConfigError> {
        if !self.gateway.starts_with("wss://") {
            return Ok(None);
        }
        tls_client_config(self.ca_file.as_deref()).map(Some)
    }
}

/// A rustls client configuration trusting `ca_file` (PEM), else the system CA bundle.
pub(crate) fn tls_client_config(
    ca_file: Option<&Path>,
) -> Result<Arc<rustls::ClientConfig>, ConfigError> {
    {
        let path = match ca_file {
            Some(path) => path.to_owned(),
            None => SYSTEM_CA_BUNDLES
                .iter()
                .map(PathBuf::from)
                .find(|p| p.is_file())
                .ok_or(ConfigError::NoSystemRoots)?,
        };
        let pem = std::fs::read_to_string(&path).map_err(|source| ConfigError::CaFile {
            path: path.clone(),
            source,
        })?;
        Ok(spine_transport::client_config_with_ca(&pem)?)
    }
}

pub(crate) fn load_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|source| ConfigError::Parse {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests;
