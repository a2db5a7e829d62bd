//! The Responses API translation over arbitrary bytes: a caller's `/v1/responses` body
//! (`chat_request`: a chat body that is one JSON object with `messages`, or an error naming
//! what is wrong) and a metered chat stream cut into arbitrary frames (`ResponsesSse`: every
//! event it writes is `event:` + one JSON `data` line with a `type`, numbered from 0, and the
//! stream ends with exactly one of `response.completed`, `response.incomplete`,
//! `response.failed`). Never a panic.
#![no_main]
use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use libfuzzer_sys::fuzz_target;
use spine_meter::responses::{chat_request, ResponseMeta, ResponsesSse};

struct Frames(VecDeque<Bytes>);

impl Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

fuzz_target!(|bytes: &[u8]| {
    if let Ok(t) = chat_request(bytes) {
        let chat: serde_json::Value = serde_json::from_slice(&t.chat_body).unwrap();
        assert!(chat["messages"].as_array().is_some_and(|m| !m.is_empty()));
    }
    // the stream: frames split where the input has a 0xff byte
    let frames = bytes
        .split(|&b| b == 0xff)
        .map(|f| Bytes::copy_from_slice(f))
        .collect();
    let mut body = ResponsesSse::new(Frames(frames), ResponseMeta::new("r", Default::default()));
    let waker = std::task::Waker::noop();
    let mut cx = Context::from_waker(waker);
    let mut out = Vec::new();
    while let Poll::Ready(Some(frame)) = Pin::new(&mut body).poll_frame(&mut cx) {
        out.extend_from_slice(&frame.unwrap().into_data().unwrap());
    }
    let text = String::from_utf8(out).unwrap();
    let mut ends = 0;
    let mut seq = 0;
    for block in text
        .split("\n\n")
        .filter(|b| !b.is_empty() && !b.starts_with(':'))
    {
        let mut lines = block.lines();
        let kind = lines.next().unwrap().strip_prefix("event: ").unwrap();
        let data: serde_json::Value =
            serde_json::from_str(lines.next().unwrap().strip_prefix("data: ").unwrap()).unwrap();
        assert!(lines.next().is_none());
        assert_eq!(data["type"], kind);
        assert_eq!(data["sequence_number"], seq);
        seq += 1;
        if matches!(
            kind,
            "response.completed" | "response.incomplete" | "response.failed"
        ) {
            ends += 1;
        }
    }
    assert_eq!(ends, 1, "{text}");
});
