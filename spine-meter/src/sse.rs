//! Incremental, byte-level Server-Sent Events parser.
//!
//! Follows the WHATWG HTML "event stream interpretation" rules
//! (<https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation>):
//!
//! - lines end in CRLF, LF or CR, including a CR at the end of one read and the LF at the start
//!   of the next;
//! - `field:value` with one optional space after the colon; a line without a colon is a field with
//!   an empty value; lines starting with `:` are comments;
//! - `data` lines accumulate, joined with LF; a blank line dispatches the event; an event whose data
//!   buffer is empty (only comments, `id:`, `retry:`, `event:`) is not dispatched;
//! - a UTF-8 byte order mark at the start of the stream is ignored.
//!
//! UTF-8 is decoded only when an event is dispatched, so a character split across reads is never
//! damaged. Invalid UTF-8 is replaced with U+FFFD in [`SseEvent::data`] (as WHATWG's decoder does);
//! [`SseEvent::raw`] keeps the original bytes.
//!
//! Two deliberate deviations, both for metering:
//! - [`SseParser::finish`] dispatches an event still open at end of input (WHATWG discards it): a
//!   node that closes right after its final usage chunk without the blank line must still be
//!   metered. Its [`SseEvent::raw`] gets a `\n\n` appended so that it can be forwarded as a complete
//!   event.
//! - when a blank line that ends an event is a lone CR, [`SseEvent::raw`] ends in `\r\n` (an LF is
//!   added, and an LF that follows in the next read is consumed). This makes `raw` the same for
//!   every split of the input into reads; to any conforming client the bytes mean the same events.
//!
//! Memory is bounded: a line longer than [`SseParser::max_line_bytes`] or an event whose raw bytes
//! exceed [`SseParser::max_event_bytes`] is an error ([`SseError`]), after which the parser must not
//! be used again.

use bytes::Bytes;

/// Default cap on one line, in bytes (16 MiB).
pub const DEFAULT_MAX_LINE_BYTES: usize = 16 * 1024 * 1024;
/// Default cap on one event's raw bytes, in bytes (16 MiB).
pub const DEFAULT_MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// One dispatched event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    data: String,
    raw: Bytes,
    data_only: bool,
    utf8: bool,
}

impl SseEvent {
    /// The event's data: its `data` field values joined with LF.
    pub fn data(&self) -> &str {
        &self.data
    }

    /// The event's original bytes, from the start of its first line to the end of the blank line
    /// that dispatched it (see the module docs for the two normalisations).
    pub fn raw(&self) -> &Bytes {
        &self.raw
    }

    /// Whether every line of the event is a `data` field (no comment, `id`, `event`, `retry` or
    /// unknown field, no byte order mark) — when true, [`SseEvent::raw`] is safe to forward as is.
    pub fn is_data_only(&self) -> bool {
        self.data_only
    }

    /// Whether the event's data was valid UTF-8 (when not, [`SseEvent::data`] holds U+FFFD
    /// replacements and [`SseEvent::raw`] the invalid bytes).
    pub fn is_utf8(&self) -> bool {
        self.utf8
    }
}

/// Why the parser stopped.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SseError {
    /// A line grew past the configured cap before its line ending arrived.
    #[error("sse line longer than {limit_bytes} bytes")]
    LineTooLong {
        /// The cap, bytes.
        limit_bytes: usize,
    },
    /// An event's raw bytes grew past the configured cap before its blank line arrived.
    #[error("sse event larger than {limit_bytes} bytes")]
    EventTooLarge {
        /// The cap, bytes.
        limit_bytes: usize,
    },
}

/// What the pending CR (last byte of the previous read) means for an LF at the start of the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PendingCr {
    None,
    /// The CR ended a line of an open event: a following LF belongs to that event's raw bytes.
    InEvent,
    /// The CR ended a blank line (dispatch or discard): a following LF is consumed silently.
    Swallow,
}

/// An incremental SSE parser; feed it reads with [`SseParser::feed`], then call
/// [`SseParser::finish`] at end of input.
#[derive(Debug)]
pub struct SseParser {
    line: Vec<u8>,
    raw: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
    data_only: bool,
    pending_cr: PendingCr,
    first_line: bool,
    max_line_bytes: usize,
    max_event_bytes: usize,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::new()
    }
}

impl SseParser {
    /// A parser with [`DEFAULT_MAX_LINE_BYTES`] and [`DEFAULT_MAX_EVENT_BYTES`].
    pub fn new() -> Self {
        Self::with_limits(DEFAULT_MAX_LINE_BYTES, DEFAULT_MAX_EVENT_BYTES)
    }

    /// A parser with the given caps, in bytes.
    pub fn with_limits(max_line_bytes: usize, max_event_bytes: usize) -> Self {
        Self {
            line: Vec::new(),
            raw: Vec::new(),
            data: Vec::new(),
            has_data: false,
            data_only: true,
            pending_cr: PendingCr::None,
            first_line: true,
            max_line_bytes,
            max_event_bytes,
        }
    }

    /// The line cap, bytes.
    pub fn max_line_bytes(&self) -> usize {
        self.max_line_bytes
    }

    /// The event cap, bytes.
    pub fn max_event_bytes(&self) -> usize {
        self.max_event_bytes
    }

    /// Feeds one read; every event completed by it is pushed onto `out`, in order.
    ///
    /// # Errors
    ///
    /// [`SseError`] when a cap is exceeded. Events completed earlier in the same read are already
    /// in `out`.
    ///
    /// An event that arrives whole in one read as one `data:` line ended by `\n\n` (how
    /// llama.cpp, vLLM, SGLang and Ollama send each chunk) is taken in one piece; any other is
    /// read line by line. Either way the events are the same, for every split into reads.
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if input.is_empty() {
            return Ok(());
        }
        match std::mem::replace(&mut self.pending_cr, PendingCr::None) {
            PendingCr::None => {}
            PendingCr::InEvent => {
                if let Some((b'\n', rest)) = input.split_first() {
                    self.raw.push(b'\n');
                    input = rest;
                }
            }
            PendingCr::Swallow => {
                if let Some((b'\n', rest)) = input.split_first() {
                    input = rest;
                }
            }
        }
        loop {
            // between events: a whole plain event is taken in one piece (`whole_data_event`)
            if self.line.is_empty() && self.raw.is_empty() && self.pending_cr == PendingCr::None {
                if let Some(used) = self.whole_data_event(input, out) {
                    input = &input[used..];
                    continue;
                }
            }
            let Some(pos) = memchr::memchr2(b'\r', b'\n', input) else {
                break;
            };
            self.push_line_bytes(&input[..pos])?;
            let is_cr = input[pos] == b'\r';
            let mut consumed = pos + 1;
            let crlf = is_cr && input.get(consumed) == Some(&b'\n');
            if crlf {
                consumed += 1;
            }
            let cr_at_end = is_cr && !crlf && consumed == input.len();
            let term: &[u8] = if crlf {
                b"\r\n"
            } else if is_cr {
                b"\r"
            } else {
                b"\n"
            };
            self.end_line(term, cr_at_end, out)?;
            input = &input[consumed..];
        }
        self.push_line_bytes(input)
    }

    /// The event at the start of `input` when it is one `data:` line ended by `\n\n`, valid
    /// UTF-8 and within the caps: pushed onto `out` as the line-by-line reading would push it,
    /// and the bytes it used returned. `None` (nothing read) for anything else, which the
    /// line-by-line reading then decides, errors included. Called only between events.
    ///
    /// The raw bytes are copied, never a slice of the read: an event is forwarded and may wait
    /// in the caller's send buffers, which count it by its length, and a slice would keep the
    /// whole read (or the HTTP/2 buffer it came from) alive with it.
    fn whole_data_event(&mut self, input: &[u8], out: &mut Vec<SseEvent>) -> Option<usize> {
        let value = input.strip_prefix(b"data:")?;
        let end = b"data:".len() + memchr::memchr2(b'\r', b'\n', value)?;
        // one line, then the blank line that dispatches it; the caps as `push_line_bytes` and
        // `end_line` apply them (the line, then the event's raw bytes with both line endings)
        if input.get(end..end + 2) != Some(b"\n\n")
            || end > self.max_line_bytes
            || end + 3 > self.max_event_bytes
        {
            return None;
        }
        let value = &input[b"data:".len()..end];
        let data = std::str::from_utf8(value.strip_prefix(b" ").unwrap_or(value)).ok()?;
        let used = end + 2;
        let raw = Bytes::copy_from_slice(&input[..used]);
        // a first line that starts with `data:` carries no byte order mark
        self.first_line = false;
        out.push(SseEvent {
            data: data.to_owned(),
            raw,
            data_only: true,
            utf8: true,
        });
        Some(used)
    }

    /// Ends the input: a last unterminated line is taken as a line, and an event still open is
    /// dispatched (a documented deviation from WHATWG, see the module docs).
    ///
    /// # Errors
    ///
    /// [`SseError`] when a cap is exceeded.
    pub fn finish(&mut self, out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        self.pending_cr = PendingCr::None;
        if !self.line.is_empty() {
            self.end_line(b"\n", false, out)?;
        }
        if self.has_data {
            self.raw.extend_from_slice(b"\n");
            self.dispatch(out);
        }
        self.reset_event();
        Ok(())
    }

    fn push_line_bytes(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        if bytes.is_empty() {
            return Ok(());
        }
        if self.line.len() + bytes.len() > self.max_line_bytes {
            return Err(SseError::LineTooLong {
                limit_bytes: self.max_line_bytes,
            });
        }
        if self.raw.len() + self.line.len() + bytes.len() > self.max_event_bytes {
            return Err(SseError::EventTooLarge {
                limit_bytes: self.max_event_bytes,
            });
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    fn end_line(
        &mut self,
        term: &[u8],
        cr_at_end: bool,
        out: &mut Vec<SseEvent>,
    ) -> Result<(), SseError> {
        let mut line = std::mem::take(&mut self.line);
        if self.raw.len() + line.len() + term.len() + 1 > self.max_event_bytes {
            return Err(SseError::EventTooLarge {
                limit_bytes: self.max_event_bytes,
            });
        }
        self.raw.extend_from_slice(&line);
        self.raw.extend_from_slice(term);
        if std::mem::take(&mut self.first_line) && line.starts_with(b"\xEF\xBB\xBF") {
            line.drain(..3);
            self.data_only = false;
        }
        if line.is_empty() {
            if self.has_data {
                if term == b"\r" {
                    self.raw.push(b'\n');
                }
                self.dispatch(out);
            }
            self.reset_event();
            if cr_at_end {
                self.pending_cr = PendingCr::Swallow;
            }
        } else {
            self.field(&line);
            if cr_at_end {
                self.pending_cr = PendingCr::InEvent;
            }
        }
        // keep the allocation for the next line
        line.clear();
        self.line = line;
        Ok(())
    }

    fn field(&mut self, line: &[u8]) {
        if line.first() == Some(&b':') {
            self.data_only = false;
            return;
        }
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let value = &line[i + 1..];
                (&line[..i], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &[][..]),
        };
        if name == b"data" {
            self.data.extend_from_slice(value);
            self.data.push(b'\n');
            self.has_data = true;
        } else {
            self.data_only = false;
        }
    }

    fn dispatch(&mut self, out: &mut Vec<SseEvent>) {
        let mut data = std::mem::take(&mut self.data);
        data.pop(); // the trailing LF added by the last data line
        let (data, utf8) = match String::from_utf8(data) {
            Ok(s) => (s, true),
            Err(e) => (String::from_utf8_lossy(e.as_bytes()).into_owned(), false),
        };
        out.push(SseEvent {
            data,
            raw: Bytes::from(std::mem::take(&mut self.raw)),
            data_only: self.data_only,
            utf8,
        });
    }

    fn reset_event(&mut self) {
        self.raw.clear();
        self.data.clear();
        self.has_data = false;
        self.data_only = true;
    }
}

/// Parses a whole input in one go: [`SseParser::feed`] then [`SseParser::finish`] with the
/// default caps. The entry point for fuzzing.
///
/// # Errors
///
/// [`SseError`] when a cap is exceeded.
pub fn parse_all(input: &[u8]) -> Result<Vec<SseEvent>, SseError> {
    let mut parser = SseParser::new();
    let mut out = Vec::new();
    parser.feed(input, &mut out)?;
    parser.finish(&mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn datas(events: &[SseEvent]) -> Vec<&str> {
        events.iter().map(|e| e.data()).collect()
    }

    fn parse_reads(reads: &[&[u8]]) -> Vec<SseEvent> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for r in reads {
            p.feed(r, &mut out).unwrap();
        }
        p.finish(&mut out).unwrap();
        out
    }

    #[test]
    fn line_endings_and_multiline_data() {
        let ev = parse_all(b"data: A\r\ndata: B\r\ndata: C\r\n\n").unwrap();
        assert_eq!(datas(&ev), ["A\nB\nC"]);
        assert_eq!(ev[0].raw().as_ref(), b"data: A\r\ndata: B\r\ndata: C\r\n\n");
        let ev = parse_all(b"data:x\rdata:  y\r\rdata\n\n").unwrap();
        assert_eq!(datas(&ev), ["x\n y", ""]);
    }

    #[test]
    fn cr_then_lf_in_next_read() {
        let ev = parse_reads(&[b"data: x\r", b"\n\r", b"\ndata: [DONE]\r\n\r\n"]);
        assert_eq!(datas(&ev), ["x", "[DONE]"]);
        assert_eq!(ev[0].raw().as_ref(), b"data: x\r\n\r\n");
        assert_eq!(ev[1].raw().as_ref(), b"data: [DONE]\r\n\r\n");
    }

    #[test]
    fn comments_and_dataless_events_are_not_dispatched() {
        let ev = parse_all(b":\n\n: ping\n\nretry: 3000\n\nid: 7\n\ndata: Hi\n\n").unwrap();
        assert_eq!(datas(&ev), ["Hi"]);
        assert!(ev[0].is_data_only());
        let ev = parse_all(b"id: 1\ndata: Hi\n\n").unwrap();
        assert!(!ev[0].is_data_only());
    }

    #[test]
    fn utf8_split_across_reads() {
        let all = "data: \u{4f60}\u{1F642}\n\n".as_bytes();
        for i in 0..all.len() {
            let ev = parse_reads(&[&all[..i], &all[i..]]);
            assert_eq!(datas(&ev), ["\u{4f60}\u{1F642}"]);
            assert_eq!(ev[0].raw().as_ref(), all);
        }
    }

    #[test]
    fn trailing_event_at_eof() {
        let ev = parse_all(b"data: a\n\ndata: {\"usage\":1}").unwrap();
        assert_eq!(datas(&ev), ["a", "{\"usage\":1}"]);
        assert_eq!(ev[1].raw().as_ref(), b"data: {\"usage\":1}\n\n");
    }

    #[test]
    fn caps_give_clear_errors() {
        let mut p = SseParser::with_limits(8, 64);
        let mut out = Vec::new();
        assert_eq!(
            p.feed(b"data: 0123456789", &mut out),
            Err(SseError::LineTooLong { limit_bytes: 8 })
        );
        let mut p = SseParser::with_limits(8, 16);
        assert_eq!(
            p.feed(b"data: 1\ndata: 2\ndata: 3\n", &mut out),
            Err(SseError::EventTooLarge { limit_bytes: 16 })
        );
        assert_eq!(
            SseError::LineTooLong { limit_bytes: 8 }.to_string(),
            "sse line longer than 8 bytes"
        );
    }

    #[test]
    fn bom_is_ignored() {
        let ev = parse_all(b"\xEF\xBB\xBFdata: a\n\n").unwrap();
        assert_eq!(datas(&ev), ["a"]);
        assert!(!ev[0].is_data_only());
    }

    fn fixture_streams() -> Vec<Vec<u8>> {
        let dir = crate::test_support::fixtures_dir();
        let dir = dir.display();
        let mut out = Vec::new();
        for name in [
            "b_chat_stream_usage.txt",
            "b4_stream_with_sse_ping.txt",
            "c_chat_stream_nousage.txt",
            "d_v1_completions_stream.txt",
        ] {
            let path = format!("{dir}/llama.cpp/{name}");
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            out.push(crate::test_support::strip_http_head(&bytes).to_vec());
        }
        let hostile = crate::test_support::hostile_cases();
        for case in hostile {
            out.push(case.reads.concat());
        }
        // the same bytes with every line ending style
        let crlf = String::from_utf8_lossy(&out[0]).replace('\n', "\r\n");
        out.push(crlf.clone().into_bytes());
        out.push(crlf.replace("\r\n", "\r").into_bytes());
        out
    }

    #[test]
    fn every_two_and_three_way_split_of_fixtures_gives_the_same_events() {
        for stream in fixture_streams() {
            let whole = parse_all(&stream).unwrap();
            let n = stream.len();
            let step = (n / 300).max(1);
            for i in 0..=n {
                let ev = parse_reads(&[&stream[..i], &stream[i..]]);
                assert_eq!(ev, whole, "split at {i}");
                if i % step == 0 {
                    for j in (i..=n).step_by(step.max(7)) {
                        let ev = parse_reads(&[&stream[..i], &stream[i..j], &stream[j..]]);
                        assert_eq!(ev, whole, "split at {i},{j}");
                    }
                }
            }
        }
    }

    /// Every byte in a read of its own: no event is ever whole in one read, so each is read
    /// line by line (`SseParser::whole_data_event` never applies).
    fn parse_byte_by_byte(stream: &[u8], p: &mut SseParser) -> Result<Vec<SseEvent>, SseError> {
        let mut out = Vec::new();
        for b in stream {
            p.feed(std::slice::from_ref(b), &mut out)?;
        }
        p.finish(&mut out)?;
        Ok(out)
    }

    #[test]
    fn whole_events_read_in_one_piece_are_the_events_read_line_by_line() {
        let mut streams = fixture_streams();
        streams.extend([
            b"data: a\n\ndata:b\n\ndata:  c\n\ndata:\n\ndata: \xff\n\ndata: d\r\n\r\n".to_vec(),
            b"data: a\n\n: c\n\ndata: b\ndata: c\n\nid: 1\ndata: e\n\ndata: [DONE]\n\n".to_vec(),
            b"data: a\n\n\n\ndata: b\n\r\ndata: c\n\n".to_vec(),
        ]);
        for stream in streams {
            let whole = parse_all(&stream).unwrap();
            let lines = parse_byte_by_byte(&stream, &mut SseParser::new()).unwrap();
            assert_eq!(whole, lines, "{}", String::from_utf8_lossy(&stream));
        }
        // at the caps' edges (an event ended by LFs): the same events, or an error for both
        // (which cap a line breaks first depends on how it was split into reads, on either
        // path; with a CR ending a line, even whether a cap is broken does, on the line-by-line
        // path alone, by one byte)
        let event = b"data: 0123456789\n\n";
        for max_line in 10..20 {
            for max_event in 14..24 {
                let mut p = SseParser::with_limits(max_line, max_event);
                let mut whole = Vec::new();
                let fed = p.feed(event, &mut whole);
                let fed = fed.and_then(|()| p.finish(&mut whole)).map(|()| whole);
                let lines =
                    parse_byte_by_byte(event, &mut SseParser::with_limits(max_line, max_event));
                match (fed, lines) {
                    (Ok(fed), Ok(lines)) => assert_eq!(fed, lines, "caps {max_line}, {max_event}"),
                    (fed, lines) => assert!(
                        fed.is_err() && lines.is_err(),
                        "caps {max_line}, {max_event}"
                    ),
                }
            }
        }
    }

    #[test]
    fn hostile_reads_parse_as_expected() {
        for case in crate::test_support::hostile_cases() {
            let reads: Vec<&[u8]> = case.reads.iter().map(|r| r.as_slice()).collect();
            let ev = parse_reads(&reads);
            assert_eq!(ev, parse_all(&case.reads.concat()).unwrap(), "{}", case.id);
            if case.id == "H04" {
                assert_eq!(datas(&ev), ["A\nB\nC"]);
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn any_split_of_any_fixture_gives_the_same_events(
            which in 0usize..64,
            cuts in proptest::collection::vec(0.0f64..1.0, 0..12),
        ) {
            let streams = fixture_streams();
            let stream = &streams[which % streams.len()];
            let mut points: Vec<usize> = cuts.iter().map(|c| (c * stream.len() as f64) as usize).collect();
            points.sort_unstable();
            let mut reads = Vec::new();
            let mut last = 0;
            for p in points {
                reads.push(&stream[last..p]);
                last = p;
            }
            reads.push(&stream[last..]);
            proptest::prop_assert_eq!(parse_reads(&reads), parse_all(stream).unwrap());
        }

        #[test]
        fn never_panics_and_raw_is_bounded(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let mut p = SseParser::with_limits(64, 128);
            let mut out = Vec::new();
            if p.feed(&bytes, &mut out).is_ok() {
                let _ = p.finish(&mut out);
            }
            for e in &out {
                proptest::prop_assert!(e.raw().len() <= 128 + 1);
            }
        }
    }
}
