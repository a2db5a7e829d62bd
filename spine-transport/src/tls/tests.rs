#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;

#[test]
fn self_signed_cert_builds_both_configs() {
    let (cert, key) = self_signed_cert(&["localhost".into(), "127.0.0.1".into()]).unwrap();
    assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"));
    assert!(key.starts_with("-----BEGIN PRIVATE KEY-----"));
    let server = server_config_from_pem(&cert, &key).unwrap();
    assert_eq!(server.alpn_protocols, vec![b"http/1.1".to_vec()]);
    client_config_with_ca(&cert).unwrap();
}

#[test]
fn bad_pem_is_refused() {
    assert!(matches!(
        client_config_with_ca("nothing here"),
        Err(TlsError::NoCertificate)
    ));
    let (cert, _) = self_signed_cert(&["localhost".into()]).unwrap();
    let (_, other_key) = self_signed_cert(&["localhost".into()]).unwrap();
    assert!(matches!(
        server_config_from_pem(&cert, &other_key),
        Err(TlsError::Rustls(_))
    ));
}

#[cfg(unix)]
#[test]
fn the_data_dir_is_owner_only_and_so_is_the_tunnel_key() {
    use std::os::unix::fs::PermissionsExt as _;
    let mode = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or_default()
    };
    let Ok(tmp) = tempfile::tempdir() else {
        unreachable!("a temporary directory")
    };
    let dir = tmp.path().join("a/data");
    assert!(create_private_dir(&dir).is_ok());
    assert_eq!(mode(&dir), 0o700);
    // an existing directory open to others is tightened
    assert!(std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).is_ok());
    assert!(create_private_dir(&dir).is_ok());
    assert_eq!(mode(&dir), 0o700);

    let files = tls_files_or_self_signed(None, &dir, &["gw.example".to_owned()]);
    let Ok(files) = files else {
        unreachable!("{:?}", files.err())
    };
    assert_eq!(files.cert_path, dir.join("tunnel-cert.pem"));
    assert_eq!(mode(&files.key_path), 0o600);
    assert!(files.server_config().is_ok());
    // reused, not generated again
    let cert = std::fs::read(&files.cert_path).unwrap_or_default();
    let again = tls_files_or_self_signed(None, &dir, &[]).map(|f| f.cert_path);
    assert_eq!(again.ok(), Some(dir.join("tunnel-cert.pem")));
    assert_eq!(std::fs::read(&files.cert_path).unwrap_or_default(), cert);
}
