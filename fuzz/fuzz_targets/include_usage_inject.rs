//! `include_usage` injection over arbitrary bytes: never panics, and whatever it produces peeks as
//! a request that asks for usage.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(out) = spine_meter::inject_include_usage(bytes) {
        if let Ok(peek) = spine_core::RequestPeek::from_json(&out) {
            assert!(peek.include_usage);
        }
    }
});
