use super::*;

#[test]
fn codes_are_stable_and_round_trip() {
    let table: Vec<(u16, &str)> = RefusalReason::ALL
        .iter()
        .map(|r| (r.close_code(), r.as_str()))
        .collect();
    assert_eq!(
        table,
        vec![
            (4001, "unknown_key"),
            (4002, "bad_signature"),
            (4003, "stale_challenge"),
            (4004, "unsupported_protocol"),
            (4005, "malformed_handshake"),
            (4006, "handshake_timeout"),
            (4007, "duplicate_session"),
            (4008, "internal_error"),
            (4009, "wrong_gateway"),
        ]
    );
    for r in RefusalReason::ALL {
        assert_eq!(RefusalReason::from_close_code(r.close_code()), Some(r));
        assert_eq!(RefusalReason::parse(r.as_str()), Some(r));
    }
    assert_eq!(RefusalReason::from_close_code(1000), None);
    assert_eq!(RefusalReason::parse("nope"), None);
}
