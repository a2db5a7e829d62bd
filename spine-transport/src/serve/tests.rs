#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;

#[test]
fn defaults_are_the_documented_ones() {
    let l = ListenerLimits::default();
    assert_eq!(l.header_read_timeout, Duration::from_secs(15));
    assert_eq!(l.body_read_timeout, Duration::from_secs(60));
    assert_eq!(l.idle_timeout, Duration::from_secs(60));
    assert_eq!(l.tls_handshake_timeout, Duration::from_secs(10));
    assert_eq!(l.max_connections, 4096);
    assert_eq!(l.lingering_time, Duration::from_secs(30));
    assert_eq!(l.lingering_timeout, Duration::from_secs(5));
}
