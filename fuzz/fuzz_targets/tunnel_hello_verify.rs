//! The gateway's whole check of an agent's hello over arbitrary bytes: decode, then verify the
//! signature against a fixed challenge. Errors with a refusal reason, never panics, and never
//! accepts (the fuzzer cannot forge an ed25519 signature).
#![no_main]
use libfuzzer_sys::fuzz_target;
use spine_transport::handshake::Challenge;

fuzz_target!(|bytes: &[u8]| {
    let challenge = Challenge {
        nonce: "00".repeat(32),
        gateway_id: "gw-fuzz".into(),
        issued_at_ms: 1_700_000_000_000,
        protocol_version: spine_transport::PROTOCOL_VERSION,
    };
    if let Ok(hello) = spine_transport::decode_hello(bytes) {
        assert!(hello.verify(&challenge).is_err());
    }
});
