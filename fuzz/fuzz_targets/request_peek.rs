//! The request peek over arbitrary bytes: errors, never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let _ = spine_core::RequestPeek::from_json(bytes);
});
