//! The SSE parser over arbitrary bytes split at an arbitrary point: never panics, splitting
//! the input into two reads gives the same events as one read, and one read (whole events
//! taken in one piece) gives the same events as a read per byte (every line read line by
//! line).
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
    let mut parser = SseParser::new();
    let mut per_byte = Vec::new();
    let per_byte_result = bytes
        .iter()
        .try_for_each(|b| parser.feed(std::slice::from_ref(b), &mut per_byte))
        .and_then(|()| parser.finish(&mut per_byte));
    // (with small caps, a CR-ended line can break a cap in one split and not in another; the
    // default caps are out of the fuzzer's reach)
    if let (Ok(whole), Ok(())) = (&whole, &per_byte_result) {
        assert_eq!(whole, &per_byte);
    }
});
