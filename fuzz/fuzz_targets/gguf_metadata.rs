//! The GGUF metadata reader over arbitrary bytes: errors, never panics or over-allocates.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let _ = spine_meter::gguf::GgufMetadata::parse(bytes);
});
