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
