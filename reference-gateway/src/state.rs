//! Shared state of the gateway's HTTP handlers, and tunnel TLS material.

use std::path::PathBuf;
use std::sync::Arc;

use spine_core::ModelId;
use spine_meter::Store;
use spine_router::NodeRegistry;

use crate::api::Stack;
use crate::config::Config;
use crate::limits::RateLimits;

/// What the public and admin handlers share.
pub(crate) struct AppState {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) registry: NodeRegistry,
    /// The live tunnels (connected nodes, routable or still in their warm-up probe).
    pub(crate) tunnels: spine_transport::Tunnels,
    pub(crate) stack: Stack,
    pub(crate) catalog_ids: Vec<ModelId>,
    pub(crate) admin_token: String,
    /// Per-key RPM/TPM limits (TPM also sits in the stack as the meter's admission hook).
    pub(crate) limits: Arc<RateLimits>,
    /// Renders `GET /metrics`.
    pub(crate) metrics: metrics_exporter_prometheus::PrometheusHandle,
}

/// The tunnel listener's TLS configuration and the certificate agents should trust.
pub(crate) struct TunnelTls {
    pub(crate) server_config: Arc<rustls::ServerConfig>,
    /// PEM file agents pass as `--ca-file` (the certificate itself when self-signed).
    pub(crate) ca_file: PathBuf,
}

/// Loads the configured certificate and key, or generates a self-signed pair for
/// `localhost`, `127.0.0.1` and `tunnel_tls_hosts` into the data dir (reused on restart).
pub(crate) fn tunnel_tls(
    config: &Config,
) -> Result<TunnelTls, Box<dyn std::error::Error + Send + Sync>> {
    let (cert_path, key_path) = match (&config.tunnel_tls_cert_file, &config.tunnel_tls_key_file) {
        (Some(c), Some(k)) => (c.clone(), k.clone()),
        _ => {
            let cert_path = config.data_dir.join("tunnel-cert.pem");
            let key_path = config.data_dir.join("tunnel-key.pem");
            if !cert_path.exists() || !key_path.exists() {
                let mut names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
                names.extend(config.tunnel_tls_hosts.iter().cloned());
                let (cert_pem, key_pem) = spine_transport::self_signed_cert(&names)?;
                std::fs::write(&cert_path, cert_pem)?;
                write_private(&key_path, key_pem.as_bytes())?;
                tracing::info!(cert = %cert_path.display(), "generated self-signed tunnel certificate");
            }
            (cert_path, key_path)
        }
    };
    let cert_pem = std::fs::read_to_string(&cert_path)?;
    let key_pem = std::fs::read_to_string(&key_path)?;
    let server_config = spine_transport::server_config_from_pem(&cert_pem, &key_pem)?;
    Ok(TunnelTls {
        server_config,
        ca_file: cert_path,
    })
}

fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        opts.mode(0o600);
    }
    opts.open(path)?.write_all(bytes)
}
