#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;

#[test]
fn gateway_urls() {
    let u = GatewayUrl::parse("wss://gw.example:19000/v1/tunnel").unwrap();
    assert_eq!(
        u,
        GatewayUrl {
            tls: true,
            host: "gw.example".into(),
            port: 19000
        }
    );
    assert_eq!(u.tunnel_url(), "wss://gw.example:19000/v1/tunnel");
    let u = GatewayUrl::parse("https://gw.example").unwrap();
    assert_eq!(u.port, 19000);
    assert_eq!(u.tunnel_url(), "wss://gw.example:19000/v1/tunnel");
    let u = GatewayUrl::parse("ws://127.0.0.1:4000").unwrap();
    assert_eq!(u.tunnel_url(), "ws://127.0.0.1:4000/v1/tunnel");
    let u = GatewayUrl::parse("wss://[::1]:19000").unwrap();
    assert_eq!(u.host, "::1");
    assert_eq!(u.tunnel_url(), "wss://[::1]:19000/v1/tunnel");
    for bad in ["ftp://x", "gw.example:19000", "", "wss://"] {
        assert!(GatewayUrl::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn status_headers_sign_the_documented_message() {
    let id = NodeIdentity::generate().unwrap();
    let h = status_headers(&id);
    assert_eq!(h[0], ("x-spine-node-key", id.public_key_text()));
    let ts: i64 = h[1].1.parse().unwrap();
    let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(&h[2].1)
        .unwrap();
    let sig = ed25519_dalek::Signature::from_slice(&sig).unwrap();
    id.verifying_key()
        .verify_strict(
            format!("spine-node-status/v1\n{ts}\n{}", id.public_key_text()).as_bytes(),
            &sig,
        )
        .unwrap();
}
