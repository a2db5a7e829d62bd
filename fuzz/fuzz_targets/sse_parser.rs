//! The SSE parser over arbitrary bytes split at an arbitrary point: never panics, and splitting
//! the input into two reads gives the same events as one read.
#![no_main]
use libfuzzer_sys::fuzz_target;
use spine_meter::sse::{parse_all, SseParser};

fuzz_target!(|input: (u16, &[u8])| {
    let (split, bytes) = input;
    let whole = parse_all(bytes);
    let cut = usize::from(split) % (bytes.len() + 1);
    let mut parser = SseParser::new();
    let mut events = Vec::new();
    let split_result = parser
        .feed(&bytes[..cut], &mut events)
        .and_then(|()| parser.feed(&bytes[cut..], &mut events))
        .and_then(|()| parser.finish(&mut events));
    if let (Ok(whole), Ok(())) = (&whole, &split_result) {
        assert_eq!(whole, &events);
    }
});
