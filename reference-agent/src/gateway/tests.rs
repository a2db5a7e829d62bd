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
