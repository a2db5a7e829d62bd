//! Shared state of the gateway's HTTP handlers, and tunnel TLS material.

use std::path::PathBuf;
use std::sync::Arc;

use spine_core::ModelId;
use spine_meter::Store;
use spine_router::NodeRegistry;

use crate::config::Config;
use spine_meter::limits::RateLimits;

/// The spine service stack as the handlers call it: meter → route → tunnel.
pub(crate) type Stack = tower::util::BoxCloneSyncService<
    http::Request<spine_core::BoxBody>,
    http::Response<spine_core::BoxBody>,
    spine_core::BoxError,
>;

/// What the public and admin handlers share.
pub(crate) struct AppState {
    pub(crate) store: Arc<dyn Store>,
    /// Keys already found in `store` (see [`KeyCache`](crate::auth::KeyCache)).
    pub(crate) keys: crate::auth::KeyCache,
    pub(crate) registry: NodeRegistry,
    /// The live tunnels (connected nodes, routable or still in their warm-up probe).
    pub(crate) tunnels: spine_transport::Tunnels,
    pub(crate) stack: Stack,
    pub(crate) catalog_ids: Vec<ModelId>,
    /// `max_request_body_bytes`: bounds a body the handlers read themselves (`/v1/responses`).
    pub(crate) max_request_body_bytes: usize,
    pub(crate) admin_token: String,
    /// Per-key RPM/TPM limits (TPM also sits in the stack as the meter's admission hook).
    pub(crate) limits: Arc<RateLimits>,
    /// Audits nodes' models (design brief §10), when a catalog model has a reference.
    pub(crate) auditor: Option<spine_meter::audit::Auditor>,
    /// Renders `GET /metrics`.
    pub(crate) metrics: metrics_exporter_prometheus::PrometheusHandle,
}

impl AppState {
    /// The audit states of `node` (one per audited model), `[]` when nothing is audited.
    pub(crate) fn audit_json(&self, node: &spine_core::NodeId) -> serde_json::Value {
        self.auditor.as_ref().map_or_else(
            || serde_json::json!([]),
            |a| serde_json::json!(a.statuses_of(node)),
        )
    }
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

/// Creates `dir` (and its parents) owner-only (`0700` on Unix): it holds the SQLite ledger and
/// the tunnel's private key. An existing `dir` that group or others can enter is set to `0700`.
///
/// # Errors
///
/// When the directory cannot be created or its mode set.
pub(crate) fn create_private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let mode = std::fs::metadata(dir)?.permissions().mode();
        if mode & 0o077 != 0 {
            tracing::warn!(
                data_dir = %dir.display(),
                mode = %format_args!("{:o}", mode & 0o777),
                "data_dir was open to group or others; set to 0700"
            );
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & 0o700))?;
        }
        Ok(())
    }
    #[cfg(not(unix))]
    std::fs::create_dir_all(dir)
}

#[cfg(all(test, unix))]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    fn mode(p: &std::path::Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_data_dir_is_owner_only_and_so_is_the_tunnel_key() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/data");
        create_private_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        // an existing directory open to others is tightened
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        create_private_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);

        let key = dir.join("tunnel-key.pem");
        write_private(&key, b"k").unwrap();
        assert_eq!(mode(&key), 0o600);
    }
}
