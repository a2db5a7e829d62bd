#![allow(clippy::unwrap_used, clippy::expect_used)]
use spine_core::EngineKind;

use super::*;

fn config(url: &str) -> TunnelClientConfig {
    TunnelClientConfig::new(
        url,
        NodeIdentity::from_seed(&[9u8; 32]),
        NodeDescriptor {
            engine: EngineKind::LlamaCpp,
            models: vec![],
            vram_mib: 0,
            max_concurrency: 1,
            agent_version: "t".into(),
        },
    )
}

#[test]
fn backoff_doubles_to_the_cap_and_resets() {
    let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
    let full: Vec<u64> = (0..7).map(|_| b.next_full().as_secs()).collect();
    assert_eq!(full, vec![1, 2, 4, 8, 16, 30, 30]);
    b.reset();
    for expected_max in [1000u128, 2000, 4000, 8000, 16000, 30000, 30000] {
        let d = b.next_jittered().as_millis();
        assert!(
            d >= expected_max / 2 && d <= expected_max,
            "{d} vs {expected_max}"
        );
    }
}

#[test]
fn plaintext_needs_the_insecure_flag_and_wss_needs_tls() {
    let err = TunnelClient::new(config("ws://127.0.0.1:19000/v1/tunnel")).unwrap_err();
    assert!(err.is_config());
    let mut c = config("ws://127.0.0.1:19000/v1/tunnel");
    c.allow_insecure_plaintext = true;
    assert!(TunnelClient::new(c).is_ok());

    let err = TunnelClient::new(config("wss://gw.example:19000/v1/tunnel")).unwrap_err();
    assert!(err.is_config());
    assert_eq!(
        err.to_string(),
        "invalid tunnel configuration: wss:// gateway url needs a tls configuration"
    );
    let err = TunnelClient::new(config("https://gw.example/v1/tunnel")).unwrap_err();
    assert!(err.is_config());
}

#[test]
fn target_defaults_ports() {
    let mut c = config("ws://[::1]/v1/tunnel");
    c.allow_insecure_plaintext = true;
    let t = parse_target(&c).unwrap();
    assert_eq!((t.host.as_str(), t.port), ("::1", 80));
}
