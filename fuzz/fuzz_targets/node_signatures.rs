//! The gateway's checks of a node's own signatures over arbitrary bytes: an enrollment's
//! `proof` (key text, token and proof split from the input) and a status request's three
//! headers. Errors, never panics, and never accepts (the fuzzer cannot forge an ed25519
//! signature).
#![no_main]
use libfuzzer_sys::fuzz_target;
use spine_transport::node_status::{
    verify_enrollment_proof, verify_status_headers, X_SPINE_NODE_KEY, X_SPINE_SIGNATURE,
    X_SPINE_TIMESTAMP_MS,
};

fuzz_target!(|bytes: &[u8]| {
    let text = String::from_utf8_lossy(bytes);
    let mut parts = text.splitn(3, '\n');
    let (key, token, proof) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    assert!(verify_enrollment_proof(key, token, proof).is_err());
    let mut headers = http::HeaderMap::new();
    for (name, value) in [
        (X_SPINE_NODE_KEY, key),
        (X_SPINE_TIMESTAMP_MS, token),
        (X_SPINE_SIGNATURE, proof),
    ] {
        if let Ok(value) = http::HeaderValue::from_str(value) {
            headers.insert(name, value);
        }
    }
    let now_ms = token.trim().parse::<i64>().unwrap_or(0);
    assert!(verify_status_headers(&headers, now_ms).is_err());
});
