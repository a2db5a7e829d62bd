use std::error::Error as _;

use super::*;

#[test]
fn display_is_lowercase_and_names_the_refusal() {
    let e = TunnelError::refused(RefusalReason::UnknownKey);
    assert_eq!(e.to_string(), "tunnel handshake refused: unknown_key");
    assert!(e.is_refused());
    assert_eq!(e.refusal(), Some(RefusalReason::UnknownKey));
    assert!(!e.is_closed());

    let e = TunnelError::unknown_node().with_detail("node_1");
    assert_eq!(e.to_string(), "no live tunnel for node: node_1");
    assert!(e.is_unknown_node());
    assert_eq!(e.refusal(), None);
}

#[test]
fn source_is_kept() {
    let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
    let e = TunnelError::connect().with_source(io);
    assert!(e.is_connect());
    assert_eq!(
        e.source().map(|s| s.to_string()).as_deref(),
        Some("refused")
    );
}
