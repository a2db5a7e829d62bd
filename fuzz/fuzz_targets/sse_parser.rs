//! The SSE parser over arbitrary bytes split at an arbitrary point: never panics, splitting
//! the input into two reads gives the same events as one read, and reading it as one shared
//! read (whole events sliced, `feed_bytes`) gives the same events as a read per byte (every
//! line read line by line).
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
    let shared = bytes::Bytes::copy_from_slice(bytes);
    let mut parser = SseParser::new();
    let mut sliced = Vec::new();
    let sliced_result = parser
        .feed_bytes(&shared, &mut sliced)
        .and_then(|()| parser.finish(&mut sliced));
    let mut parser = SseParser::new();
    let mut per_byte = Vec::new();
    let per_byte_result = bytes
        .iter()
        .try_for_each(|b| parser.feed(std::slice::from_ref(b), &mut per_byte))
        .and_then(|()| parser.finish(&mut per_byte));
    // which cap a line breaks first depends on how it was split into reads: both fail or
    // neither, and the events before are the same
    assert_eq!(sliced_result.is_ok(), per_byte_result.is_ok());
    assert_eq!(sliced, per_byte);
});
