//! TLS configuration helpers for the tunnel (rustls with the ring provider).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Errors building TLS configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// Reading a PEM file failed.
    #[error("failed to read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The PEM text holds no usable certificate or key.
    #[error("invalid pem: {0}")]
    Pem(#[source] rustls_pki_types::pem::Error),
    /// The PEM text holds no certificate.
    #[error("no certificate in pem")]
    NoCertificate,
    /// rustls refused the configuration (for example a key that does not match the certificate).
    #[error("rustls configuration: {0}")]
    Rustls(#[source] rustls::Error),
    /// Certificate generation failed.
    #[error("certificate generation: {0}")]
    Generate(#[source] rcgen::Error),
}

/// A certificate chain and private key on disk, both PEM.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TlsFiles {
    /// The certificate chain, leaf first.
    pub cert_path: PathBuf,
    /// The private key (PKCS#8, PKCS#1 or SEC1).
    pub key_path: PathBuf,
}

impl TlsFiles {
    /// The chain at `cert_path` and the key at `key_path`; nothing is read until
    /// [`server_config`](Self::server_config).
    pub fn new(cert_path: impl Into<PathBuf>, key_path: impl Into<PathBuf>) -> Self {
        Self {
            cert_path: cert_path.into(),
            key_path: key_path.into(),
        }
    }

    /// Reads both files and builds a server configuration ([`server_config_from_pem`]).
    ///
    /// # Errors
    ///
    /// [`TlsError::Io`] when a file cannot be read, otherwise as [`server_config_from_pem`].
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let cert = read(&self.cert_path)?;
        let key = read(&self.key_path)?;
        server_config_from_pem(&cert, &key)
    }
}

fn read(path: &Path) -> Result<String, TlsError> {
    std::fs::read_to_string(path).map_err(|source| TlsError::Io {
        path: path.to_owned(),
        source,
    })
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A self-signed certificate for `subject_alt_names` (DNS names or IP addresses), as
/// `(cert_pem, key_pem)`; the key is ECDSA P-256 (rcgen's default), PKCS#8.
///
/// For tests and for a first deployment; agents then trust the certificate with `--ca-file`.
///
/// # Errors
///
/// [`TlsError::Generate`] when a name is invalid or key generation fails.
pub fn self_signed_cert(subject_alt_names: &[String]) -> Result<(String, String), TlsError> {
    let certified = rcgen::generate_simple_self_signed(subject_alt_names.to_vec())
        .map_err(TlsError::Generate)?;
    Ok((certified.cert.pem(), certified.signing_key.serialize_pem()))
}

fn certs_from_pem(pem: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(TlsError::Pem)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate);
    }
    Ok(certs)
}

/// A rustls server configuration (TLS 1.2 and 1.3, ring, no client authentication, ALPN
/// `http/1.1` for the WebSocket upgrade) from a PEM certificate chain and private key.
///
/// # Errors
///
/// [`TlsError::Pem`] / [`TlsError::NoCertificate`] for unusable PEM, [`TlsError::Rustls`] when the
/// key does not fit the certificate.
pub fn server_config_from_pem(
    cert_pem: &str,
    key_pem: &str,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let certs = certs_from_pem(cert_pem)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(TlsError::Pem)?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Rustls)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(TlsError::Rustls)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A rustls client configuration that trusts exactly the certificates in `ca_pem`: a private CA,
/// the gateway's self-signed certificate, or a bundle such as the system's (entries that cannot
/// be trust anchors are then skipped).
///
/// # Errors
///
/// [`TlsError::Pem`] / [`TlsError::NoCertificate`] for unusable PEM, [`TlsError::Rustls`] when a
/// certificate cannot be a trust anchor.
pub fn client_config_with_ca(ca_pem: &str) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    let certs = certs_from_pem(ca_pem)?;
    if certs.len() == 1 {
        // one certificate: report why it cannot be a trust anchor
        for cert in certs {
            roots.add(cert).map_err(TlsError::Rustls)?;
        }
    } else {
        // a bundle (such as the system's): skip the odd unparsable entry
        let (added, _ignored) = roots.add_parsable_certificates(certs);
        if added == 0 {
            return Err(TlsError::NoCertificate);
        }
    }
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Rustls)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The configured certificate and key, or a self-signed pair for `localhost`, `127.0.0.1` and
/// `extra_names` kept in `dir` as `tunnel-cert.pem` and `tunnel-key.pem` (generated when either
/// is missing, reused on restart; the key written owner-only). Agents trust the result's
/// `cert_path` with `--ca-file`.
///
/// # Errors
///
/// [`TlsError::Generate`] when a name is invalid, [`TlsError::Io`] when a file cannot be
/// written.
pub fn tls_files_or_self_signed(
    configured: Option<TlsFiles>,
    dir: &Path,
    extra_names: &[String],
) -> Result<TlsFiles, TlsError> {
    if let Some(files) = configured {
        return Ok(files);
    }
    let files = TlsFiles::new(dir.join("tunnel-cert.pem"), dir.join("tunnel-key.pem"));
    if !files.cert_path.exists() || !files.key_path.exists() {
        let mut names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
        names.extend(extra_names.iter().cloned());
        let (cert_pem, key_pem) = self_signed_cert(&names)?;
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| TlsError::Io { path, source }
        };
        std::fs::write(&files.cert_path, cert_pem).map_err(io(&files.cert_path))?;
        write_private(&files.key_path, key_pem.as_bytes()).map_err(io(&files.key_path))?;
        tracing::info!(cert = %files.cert_path.display(), "generated self-signed tunnel certificate");
    }
    Ok(files)
}

/// Writes `bytes` to `path`, created or truncated, owner-only (`0600` on Unix) when created.
///
/// # Errors
///
/// The file's I/O error.
pub fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
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

/// Creates `dir` (and its parents) owner-only (`0700` on Unix), as for a directory that holds
/// a ledger and private keys. An existing `dir` that group or others can enter is set to
/// `0700` (logged).
///
/// # Errors
///
/// When the directory cannot be created or its mode set.
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
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

#[cfg(test)]
mod tests;
