//! Gateway configuration: a TOML file, every top-level key overridable by `SPINE_<KEY>` env vars.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use spine_meter::ledger::Database;
use spine_router::cluster::ClusterConfig;

#[derive(Clone, Copy)]
enum Kind {
    Str,
    Int,
    Bool,
}

/// Top-level keys that `SPINE_<UPPERCASE KEY>` environment variables may set, with their types.
const ENV_KEYS: &[(&str, Kind)] = &[
    ("public_listen", Kind::Str),
    ("tunnel_listen", Kind::Str),
    ("admin_listen", Kind::Str),
    ("console_listen", Kind::Str),
    ("console_secure_cookies", Kind::Bool),
    ("console_join_gateway_url", Kind::Str),
    ("admin_token", Kind::Str),
    ("data_dir", Kind::Str),
    ("database_url", Kind::Str),
    ("gateway_id", Kind::Str),
    ("tunnel_tls_cert_file", Kind::Str),
    ("tunnel_tls_key_file", Kind::Str),
    ("insecure_plaintext_tunnel", Kind::Bool),
    ("operator_share_bps", Kind::Int),
    ("max_request_body_bytes", Kind::Int),
    ("shutdown_grace_secs", Kind::Int),
    ("default_rpm_limit", Kind::Int),
    ("default_tpm_limit", Kind::Int),
    ("affinity_ttl_secs", Kind::Int),
    ("route_max_retries", Kind::Int),
    ("queue_max_wait_secs", Kind::Int),
    ("queue_max_depth", Kind::Int),
    ("load_aware_pick", Kind::Bool),
    ("first_token_timeout_secs", Kind::Int),
    ("stream_idle_timeout_secs", Kind::Int),
    ("max_vram_mib", Kind::Int),
    ("max_sse_line_bytes", Kind::Int),
    ("max_sse_event_bytes", Kind::Int),
    ("max_stream_duration_secs", Kind::Int),
    ("strip_engine_fields", Kind::Bool),
    ("refused_credit_delay_ms", Kind::Int),
    ("key_cache_ttl_secs", Kind::Int),
    ("max_buffered_request_bytes", Kind::Int),
    ("max_buffered_request_bytes_per_account", Kind::Int),
    ("max_unsettled_requests", Kind::Int),
    ("max_response_body_bytes", Kind::Int),
    ("response_body_timeout_secs", Kind::Int),
    ("node_stall_timeout_secs", Kind::Int),
    ("stream_buffer_bytes", Kind::Int),
    ("redis_url", Kind::Str),
    ("instance_id", Kind::Str),
    ("redis_key_prefix", Kind::Str),
    ("internal_listen", Kind::Str),
    ("internal_advertise", Kind::Str),
    ("cluster_secret", Kind::Str),
    ("header_read_timeout_ms", Kind::Int),
    ("body_read_timeout_ms", Kind::Int),
    ("idle_timeout_ms", Kind::Int),
    ("public_max_connections", Kind::Int),
    ("admin_max_connections", Kind::Int),
    ("tunnel_max_connections", Kind::Int),
    ("internal_max_connections", Kind::Int),
    ("console_max_connections", Kind::Int),
];

/// The gateway's configuration (design brief §7).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct Config {
    /// Public OpenAI-compatible API listener.
    pub(crate) public_listen: SocketAddr,
    /// Tunnel listener that agents dial (TLS unless `insecure_plaintext_tunnel`).
    pub(crate) tunnel_listen: SocketAddr,
    /// Admin API listener.
    pub(crate) admin_listen: SocketAddr,
    /// The console's listener (builders' and GPU operators' web pages, `docs/console.md`).
    pub(crate) console_listen: SocketAddr,
    /// Mark the console's session cookie `Secure`: set it when browsers reach the console
    /// over HTTPS (a TLS-terminating proxy in front of `console_listen`).
    pub(crate) console_secure_cookies: bool,
    /// The tunnel URL the console's `reference-agent join --gateway …` command names; default
    /// `wss://localhost:<tunnel port>`.
    pub(crate) console_join_gateway_url: Option<String>,
    /// Bearer token for the admin API. Required.
    pub(crate) admin_token: String,
    /// Directory for the SQLite ledger and generated TLS material.
    pub(crate) data_dir: PathBuf,
    /// Ledger database URL; default `sqlite://<data_dir>/spine.db`.
    pub(crate) database_url: Option<String>,
    /// This gateway's id, sent in tunnel challenges.
    pub(crate) gateway_id: String,
    /// PEM certificate chain for the tunnel listener; generated (self-signed) when absent.
    pub(crate) tunnel_tls_cert_file: Option<PathBuf>,
    /// PEM private key for the tunnel listener; generated with the certificate when absent.
    pub(crate) tunnel_tls_key_file: Option<PathBuf>,
    /// Extra DNS names / IPs for the generated tunnel certificate (`localhost` and `127.0.0.1`
    /// are always included).
    pub(crate) tunnel_tls_hosts: Vec<String>,
    /// The host names agents dial this gateway's tunnel by (the host of their `--gateway`
    /// URL). A tunnel hello signed for another name is refused `wrong_gateway`: a signature an
    /// agent made for a rogue gateway cannot be replayed here. Default: `localhost`,
    /// `127.0.0.1`, `::1` and `tunnel_tls_hosts`.
    pub(crate) tunnel_public_names: Vec<String>,
    /// Serve the tunnel as plain `ws://` without TLS. Only for local experiments.
    pub(crate) insecure_plaintext_tunnel: bool,
    /// Operator's share of each request's cost, in basis points (8000 = 80 %).
    pub(crate) operator_share_bps: u16,
    /// On SIGTERM, how long streams in flight may take to finish, seconds.
    pub(crate) shutdown_grace_secs: u64,
    /// Largest accepted request body, bytes.
    pub(crate) max_request_body_bytes: usize,
    /// Requests per minute allowed per API key without its own `rpm_limit`; 0 = unlimited.
    pub(crate) default_rpm_limit: u32,
    /// Tokens per minute (worst case reserved before forwarding, trued up at settlement) allowed
    /// per API key without its own `tpm_limit`; 0 = unlimited.
    pub(crate) default_tpm_limit: u64,
    /// How long a conversation sticks to the node that last served it, seconds (design brief
    /// §5); 0 disables affinity.
    pub(crate) affinity_ttl_secs: u64,
    /// Retries on another node before the first response byte (design brief §5).
    pub(crate) route_max_retries: u32,
    /// Longest a request waits for a slot when every node that could serve it is full,
    /// seconds (the admission queue, `spine_router::queue`); 0 disables the queue (such a
    /// request gets 503 `no_capacity` at once).
    pub(crate) queue_max_wait_secs: u64,
    /// Most requests waiting per model; past it, 503 `queue_full` with `Retry-After`.
    pub(crate) queue_max_depth: usize,
    /// Load-aware node pick (power of two choices, `spine_router::RegistryConfig::load_aware_pick`);
    /// `false` picks by weight alone among nodes with a free slot.
    pub(crate) load_aware_pick: bool,
    /// How long a node may take to send its first content (or an error answer) before the
    /// attempt counts as its failure and is retried elsewhere, seconds; 0 disables the deadline.
    pub(crate) first_token_timeout_secs: u64,
    /// Longest a node may send nothing once its response has begun (between two frames of its
    /// body), seconds; past it the stream ends with an error event, the node is scored as for a
    /// mid-request disconnect and the request settles. 0 disables the bound.
    pub(crate) stream_idle_timeout_secs: u64,
    /// Most VRAM, MiB, a node's self-reported `vram_mib` counts for in its routing weight.
    pub(crate) max_vram_mib: u64,
    /// Longest line of a node's SSE stream, bytes; a node that sends a longer one fails the
    /// request (`upstream_failed`) and is scored.
    pub(crate) max_sse_line_bytes: usize,
    /// Largest SSE event of a node's stream, bytes; as above.
    pub(crate) max_sse_event_bytes: usize,
    /// Longest a streamed response may last, seconds; past it the caller's stream ends with an
    /// error event. 0 disables the bound.
    pub(crate) max_stream_duration_secs: u64,
    /// Remove members outside OpenAI's response shape (llama.cpp's `timings`, cache counters,
    /// …) from what callers get: they tell one caller about other callers' requests.
    pub(crate) strip_engine_fields: bool,
    /// How long a remembered refusal for lack of credit is held back, ms (0: at once).
    pub(crate) refused_credit_delay_ms: u64,
    /// How long an API key found in the store is trusted without reading the store again,
    /// seconds: how long a key revoked through another instance keeps working here (0: every
    /// request reads the store).
    pub(crate) key_cache_ttl_secs: u64,
    /// Most bytes of request bodies being read at once (503 `server_busy` past it).
    pub(crate) max_buffered_request_bytes: u64,
    /// Most bytes of request bodies being read at once for one account (429
    /// `rate_limit_exceeded` past it; other accounts are served).
    pub(crate) max_buffered_request_bytes_per_account: u64,
    /// Most requests whose hold or settlement is not committed yet (0: no bound); at it, new
    /// requests wait
    /// for the ledger (up to 10 s, then 503 `server_busy`).
    pub(crate) max_unsettled_requests: u64,
    /// Most bytes of one non-streamed answer buffered (502 `response_too_large` past it, when
    /// the request could honestly be answered with more).
    pub(crate) max_response_body_bytes: u64,
    /// Longest a non-streamed answer's body may take from its head to its end, seconds (a node
    /// whose body trickles is cut: 502, settled `upstream_failed`, scored). 0 disables it.
    pub(crate) response_body_timeout_secs: u64,
    /// A routable node with requests in flight and nothing received on any of them for this
    /// long is probed at once; when the probe times out with still nothing received, the node
    /// leaves routing (`TunnelServerConfig::stall_timeout`). 0 disables it. Seconds.
    pub(crate) node_stall_timeout_secs: u64,
    /// Per response stream: how many bytes of a node's answer the gateway reads ahead of a slow
    /// caller, so the node's slot is freed when generation ends, not when the caller has read
    /// it all (`spine_router::ReadAheadLayer`).
    pub(crate) stream_buffer_bytes: u64,
    /// Redis URL (`redis://host:port[/db]`). Set: multi-instance mode (design brief §8), which
    /// needs a `postgres://` `database_url` and a `cluster_secret`.
    pub(crate) redis_url: Option<String>,
    /// This instance's name in Redis and PostgreSQL; default `gw-` and 8 random hex digits.
    /// Letters, digits, `.`, `_` and `-` only.
    pub(crate) instance_id: String,
    /// Every Redis key this instance reads or writes starts with it.
    pub(crate) redis_key_prefix: String,
    /// The internal HTTP/2 listener other instances forward requests to (multi-instance mode).
    pub(crate) internal_listen: SocketAddr,
    /// `host:port` other instances dial for the internal listener; default its bound address.
    pub(crate) internal_advertise: Option<String>,
    /// Shared secret (at least 16 bytes) that authenticates forwarding between instances.
    /// Required in multi-instance mode.
    pub(crate) cluster_secret: Option<String>,
    /// Every listener (public, admin, tunnel, internal): a connection must send a complete
    /// request head within this of its start (after TLS) and, on HTTP/1.1, of its previous
    /// response's end, or it is closed. Milliseconds.
    pub(crate) header_read_timeout_ms: u64,
    /// Every listener: a request body must arrive whole within this of its head, milliseconds.
    pub(crate) body_read_timeout_ms: u64,
    /// Every listener: a connection with no request in flight for this long is closed,
    /// milliseconds.
    pub(crate) idle_timeout_ms: u64,
    /// Most connections the public listener holds at once; at the cap the longest-idle one is
    /// closed to make room (a request in flight is never cut), or the new one when all are busy.
    pub(crate) public_max_connections: usize,
    /// As `public_max_connections`, for the admin listener.
    pub(crate) admin_max_connections: usize,
    /// As `public_max_connections`, for the tunnel listener (a connection counts until it is
    /// upgraded to a tunnel; `POST /v1/enroll` and `GET /v1/node/status` count too).
    pub(crate) tunnel_max_connections: usize,
    /// As `public_max_connections`, for the internal listener (multi-instance mode).
    pub(crate) internal_max_connections: usize,
    /// As `public_max_connections`, for the console listener.
    pub(crate) console_max_connections: usize,
    /// The model catalog: what callers may ask for, its tokenizer and its price.
    pub(crate) models: Vec<spine_meter::catalog::ModelConfig>,
    /// Audits of nodes' models against a trusted reference (design brief §10); active for the
    /// models that set `reference_url`.
    pub(crate) audit: spine_meter::audit::AuditSettings,
}

impl Default for Config {
    /// Every key's default; `admin_token` has none (`load` refuses a configuration without it).
    fn default() -> Self {
        Self {
            public_listen: SocketAddr::from(([127, 0, 0, 1], 8400)),
            tunnel_listen: SocketAddr::from(([0, 0, 0, 0], 19000)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 8401)),
            console_listen: SocketAddr::from(([127, 0, 0, 1], 8082)),
            console_secure_cookies: false,
            console_join_gateway_url: None,
            admin_token: String::new(),
            data_dir: PathBuf::from(".spine"),
            database_url: Default::default(),
            gateway_id: "spine-gateway".to_owned(),
            tunnel_tls_cert_file: Default::default(),
            tunnel_tls_key_file: Default::default(),
            tunnel_tls_hosts: Default::default(),
            tunnel_public_names: Default::default(),
            insecure_plaintext_tunnel: Default::default(),
            operator_share_bps: 8000,
            shutdown_grace_secs: 30,
            max_request_body_bytes: 4 * 1024 * 1024,
            default_rpm_limit: Default::default(),
            default_tpm_limit: Default::default(),
            affinity_ttl_secs: 30 * 60,
            route_max_retries: 2,
            queue_max_wait_secs: 30,
            queue_max_depth: 1024,
            load_aware_pick: true,
            first_token_timeout_secs: 120,
            stream_idle_timeout_secs: 120,
            max_vram_mib: 196_608,
            max_sse_line_bytes: spine_meter::sse::DEFAULT_MAX_EVENT_BYTES,
            max_sse_event_bytes: spine_meter::sse::DEFAULT_MAX_EVENT_BYTES,
            max_stream_duration_secs: 3600,
            strip_engine_fields: true,
            refused_credit_delay_ms: 250,
            key_cache_ttl_secs: 10,
            max_buffered_request_bytes: 256 * 1024 * 1024,
            max_buffered_request_bytes_per_account: 32 * 1024 * 1024,
            max_unsettled_requests: spine_meter::meter::DEFAULT_MAX_UNSETTLED_REQUESTS as u64,
            max_response_body_bytes: 16 * 1024 * 1024,
            response_body_timeout_secs: 120,
            node_stall_timeout_secs: 5,
            stream_buffer_bytes: 4 * 1024 * 1024,
            redis_url: Default::default(),
            instance_id: ClusterConfig::generated_instance_id(),
            redis_key_prefix: "spine:".to_owned(),
            internal_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            internal_advertise: Default::default(),
            cluster_secret: Default::default(),
            header_read_timeout_ms: 15_000,
            body_read_timeout_ms: 60_000,
            idle_timeout_ms: 60_000,
            public_max_connections: 4096,
            admin_max_connections: 256,
            tunnel_max_connections: 4096,
            internal_max_connections: 1024,
            console_max_connections: 256,
            models: Default::default(),
            audit: Default::default(),
        }
    }
}

/// Errors reading the configuration.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing configuration: {0}")]
    Parse(#[from] toml::de::Error),
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl Config {
    /// Reads `path` (if given), then applies `SPINE_*` environment overrides.
    pub(crate) fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let text = match path {
            Some(p) => std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                path: p.to_owned(),
                source,
            })?,
            None => String::new(),
        };
        let mut table: toml::Table = toml::from_str(&text)?;
        for (key, kind) in ENV_KEYS {
            let var = format!("SPINE_{}", key.to_ascii_uppercase());
            if let Ok(value) = std::env::var(&var) {
                let value = env_value(&value, *kind)
                    .ok_or_else(|| ConfigError::Invalid(format!("{var}: bad value {value:?}")))?;
                table.insert((*key).to_owned(), value);
            }
        }
        if !table.contains_key("admin_token") {
            return Err(<toml::de::Error as serde::de::Error>::missing_field("admin_token").into());
        }
        let config: Config = toml::Value::Table(table).try_into()?;
        if config.admin_token.len() < 16 {
            return Err(ConfigError::Invalid(
                "admin_token must be at least 16 characters".into(),
            ));
        }
        if config.operator_share_bps > 10_000 {
            return Err(ConfigError::Invalid(
                "operator_share_bps must be at most 10000".into(),
            ));
        }
        if config.tunnel_tls_cert_file.is_some() != config.tunnel_tls_key_file.is_some() {
            return Err(ConfigError::Invalid(
                "tunnel_tls_cert_file and tunnel_tls_key_file go together".into(),
            ));
        }
        for (key, ms) in [
            ("header_read_timeout_ms", config.header_read_timeout_ms),
            ("body_read_timeout_ms", config.body_read_timeout_ms),
            ("idle_timeout_ms", config.idle_timeout_ms),
        ] {
            if ms == 0 {
                return Err(ConfigError::Invalid(format!("{key} must be at least 1")));
            }
        }
        for (key, n) in [
            ("public_max_connections", config.public_max_connections),
            ("admin_max_connections", config.admin_max_connections),
            ("tunnel_max_connections", config.tunnel_max_connections),
            ("internal_max_connections", config.internal_max_connections),
            ("console_max_connections", config.console_max_connections),
        ] {
            if n == 0 {
                return Err(ConfigError::Invalid(format!("{key} must be at least 1")));
            }
        }
        config.check_cluster()?;
        Ok(config)
    }

    /// Multi-instance mode's requirements: PostgreSQL, a long enough secret, a usable id
    /// ([`ClusterConfig::validate`]).
    fn check_cluster(&self) -> Result<(), ConfigError> {
        if self.redis_url.is_none() {
            return Ok(());
        }
        if !matches!(self.database()?, Database::Postgres(_)) {
            return Err(ConfigError::Invalid(
                "redis_url is set (multi-instance mode): database_url must be postgres://… \
                 (several instances cannot share an SQLite ledger)"
                    .into(),
            ));
        }
        let secret = self.cluster_secret.clone().unwrap_or_default();
        self.cluster_with(secret)
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))
    }

    /// The names the tunnel accepts hellos for (`tunnel_public_names`, else its default).
    pub(crate) fn tunnel_public_names(&self) -> Vec<String> {
        if !self.tunnel_public_names.is_empty() {
            return self.tunnel_public_names.clone();
        }
        let mut names = vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
            "::1".to_owned(),
        ];
        names.extend(self.tunnel_tls_hosts.iter().cloned());
        names
    }

    /// The bounds of one listener: the shared timeouts and `max_connections`.
    pub(crate) fn listener_limits(
        &self,
        max_connections: usize,
    ) -> spine_transport::ListenerLimits {
        use std::time::Duration;
        spine_transport::ListenerLimits::default()
            .header_read_timeout(Duration::from_millis(self.header_read_timeout_ms))
            .body_read_timeout(Duration::from_millis(self.body_read_timeout_ms))
            .idle_timeout(Duration::from_millis(self.idle_timeout_ms))
            .max_connections(max_connections)
    }

    /// The multi-instance settings; `None` in single-instance mode (no `redis_url`).
    pub(crate) fn cluster(&self) -> Option<ClusterConfig> {
        self.redis_url.as_ref()?;
        Some(self.cluster_with(self.cluster_secret.clone()?))
    }

    fn cluster_with(&self, secret: String) -> ClusterConfig {
        let mut cluster = ClusterConfig::new(self.redis_url.clone().unwrap_or_default(), secret);
        cluster.instance_id.clone_from(&self.instance_id);
        cluster.key_prefix.clone_from(&self.redis_key_prefix);
        cluster.internal_listen = self.internal_listen;
        cluster
            .internal_advertise
            .clone_from(&self.internal_advertise);
        cluster
    }

    /// The ledger store `database_url` names ([`Database::from_url`]; default the file
    /// `<data_dir>/spine.db`).
    pub(crate) fn database(&self) -> Result<Database, ConfigError> {
        Database::from_url(self.database_url.as_deref(), &self.data_dir)
            .map_err(|e| ConfigError::Invalid(e.to_string()))
    }
}

/// Parses an environment value as the key's TOML type; `None` when it doesn't parse.
fn env_value(s: &str, kind: Kind) -> Option<toml::Value> {
    match kind {
        Kind::Str => Some(toml::Value::String(s.to_owned())),
        Kind::Int => s.parse::<i64>().ok().map(toml::Value::Integer),
        Kind::Bool => match s {
            "true" | "1" => Some(toml::Value::Boolean(true)),
            "false" | "0" => Some(toml::Value::Boolean(false)),
            _ => None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_text(text: &str) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().map_err(|source| ConfigError::Read {
            path: PathBuf::from("tempdir"),
            source,
        })?;
        let path = dir.path().join("gateway.toml");
        std::fs::write(&path, text).map_err(|source| ConfigError::Read {
            path: path.clone(),
            source,
        })?;
        Config::load(Some(&path))
    }

    #[test]
    fn multi_instance_mode_needs_postgres_and_a_secret() {
        let base = "admin_token = \"0123456789abcdef\"\nredis_url = \"redis://127.0.0.1:6379\"\n";
        let err = load_text(base)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("database_url must be postgres://"), "{err}");
        let pg = format!("{base}database_url = \"postgres://u@db/spine\"\n");
        let err = load_text(&pg)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("cluster_secret"), "{err}");
        let short = format!("{pg}cluster_secret = \"short\"\n");
        let err = load_text(&short)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("at least 16 bytes"), "{err}");
        let bad_id = format!("{pg}cluster_secret = \"0123456789abcdef\"\ninstance_id = \"a b\"\n");
        let err = load_text(&bad_id)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("instance_id"), "{err}");
        for unspecified in [
            "internal_listen = \"0.0.0.0:7100\"\n",
            "internal_listen = \"[::]:7100\"\n",
            "internal_advertise = \"0.0.0.0:7100\"\n",
        ] {
            let text = format!("{pg}cluster_secret = \"0123456789abcdef\"\n{unspecified}");
            let err = load_text(&text)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.contains("internal_advertise"), "{unspecified}: {err}");
        }
        let advertised = format!(
            "{pg}cluster_secret = \"0123456789abcdef\"\ninternal_listen = \"0.0.0.0:7100\"\n\
             internal_advertise = \"gw1.internal:7100\"\n"
        );
        assert!(load_text(&advertised).is_ok());

        let ok = format!("{pg}cluster_secret = \"0123456789abcdef\"\n");
        let config = load_text(&ok);
        assert!(config.is_ok(), "{:?}", config.err());
        let cluster = config.ok().and_then(|c| c.cluster());
        let Some(cluster) = cluster else {
            unreachable!("redis_url set")
        };
        assert_eq!(cluster.key_prefix, "spine:");
        assert_eq!(
            cluster.internal_listen,
            SocketAddr::from(([127, 0, 0, 1], 0))
        );
        assert_eq!(cluster.internal_advertise, None);
        assert!(
            cluster.instance_id.starts_with("gw-"),
            "{}",
            cluster.instance_id
        );
        assert_eq!(cluster.instance_id.len(), 11);
        assert!(!format!("{cluster:?}").contains("0123456789abcdef"));
        // two defaults differ
        assert_ne!(
            ClusterConfig::generated_instance_id(),
            ClusterConfig::generated_instance_id()
        );

        // single-instance mode: none of it is needed
        let single = load_text("admin_token = \"0123456789abcdef\"\n");
        assert!(single.is_ok_and(|c| c.cluster().is_none()));
    }

    #[test]
    fn env_values_are_typed() {
        assert_eq!(env_value("42", Kind::Int), Some(toml::Value::Integer(42)));
        assert_eq!(env_value("x", Kind::Int), None);
        assert_eq!(
            env_value("true", Kind::Bool),
            Some(toml::Value::Boolean(true))
        );
        assert_eq!(
            env_value("1234567890123456", Kind::Str),
            Some(toml::Value::String("1234567890123456".into()))
        );
    }
}
