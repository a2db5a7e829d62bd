//! An agent's answer bodies on the tunnel: data frames that are ready together go down it as
//! one.
//!
//! Why: an engine streams one chunk per token (llama.cpp, vLLM, SGLang and Ollama write each
//! SSE event as an HTTP/1.1 chunk), and hyper's HTTP/1 client hands a body over one chunk per
//! turn of its connection task. Passed on as they come, each token is one HTTP/2 DATA frame on
//! the tunnel, and the gateway pays per frame as well: decoding, flow control, its read-ahead
//! buffer (issue 17, `docs/benchmarks.md`). [`JoinReady`] gives the engine's connection one
//! turn of the scheduler after each chunk (as `WsIo` puts off a flush by one) and joins what it
//! hands over meanwhile, so a burst of tokens crosses the tunnel as one frame while a token
//! that arrives alone goes on at once, one turn later.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Response;
use http_body::{Body, Frame, SizeHint};
use spine_core::{BoxBody, BoxError};

/// What one joined frame holds at most, bytes, unless its first frame alone is larger: the
/// gateway's HTTP/2 frames carry at most 16 KiB (RFC 9113's default `SETTINGS_MAX_FRAME_SIZE`,
/// which hyper keeps), so a join never becomes two frames on the tunnel.
const JOIN_MAX_BYTES: usize = 16 * 1024;

/// How many frames one join takes at most: so that a frame is held at most this many turns of
/// the scheduler (an engine with a backlog hands over a chunk every turn), and empty or tiny
/// frames end a join as surely as large ones.
const JOIN_MAX_FRAMES: usize = 32;

/// `response` with its body's ready data frames joined ([`JoinReady`]) when it is an event
/// stream (`text/event-stream`); any other answer as it is (a complete answer comes in one or a
/// few frames, and a turn put off after its first would part it from its head on the tunnel:
/// measured, −17 % requests per second on the non-streamed closed loop).
pub(crate) fn joined(response: Response<BoxBody>) -> Response<BoxBody> {
    if !spine_core::is_event_stream_response(response.headers()) {
        return response;
    }
    response.map(|inner| BoxBody::new(JoinReady::new(inner)))
}

pin_project_lite::pin_project! {
    /// A body whose data frames that arrive within one turn of the scheduler of each other are
    /// handed on as one frame of at most [`JOIN_MAX_BYTES`] and [`JOIN_MAX_FRAMES`] frames.
    ///
    /// After each data frame it wakes its task and answers `Pending` once, so that the tasks
    /// already ready (the engine's connection among them) run first; it then takes every frame
    /// that came meanwhile, and hands the join on when a poll of the inner body finds nothing
    /// or a bound is reached. So a frame that arrives alone goes on one turn later, and none is
    /// held more than [`JOIN_MAX_FRAMES`] turns. Trailers, an error and the end come after the
    /// data before them, in order. Holds at most one join and one frame; dropping it drops them
    /// (cancel safe: nothing else is pending).
    pub(crate) struct JoinReady<B> {
        #[pin]
        inner: B,
        // data frames taken and not handed on yet
        parts: Vec<Bytes>,
        // their bytes
        parts_len: usize,
        // a data frame that would have taken the join past its bound: the next join's first
        next: Option<Bytes>,
        // a frame (trailers) or an error that came after `parts`
        held: Option<Result<Frame<Bytes>, BoxError>>,
        // the inner body ended
        ended: bool,
    }
}

impl<B> JoinReady<B> {
    /// `inner`, its ready frames joined.
    pub(crate) fn new(inner: B) -> Self {
        Self {
            inner,
            parts: Vec::new(),
            parts_len: 0,
            next: None,
            held: None,
            ended: false,
        }
    }

    /// Bytes taken from the inner body and not handed on yet.
    fn taken_len(&self) -> u64 {
        let next = self.next.as_ref().map_or(0, Bytes::len);
        self.parts_len.saturating_add(next) as u64
    }
}

/// `parts` as one frame: the one part as it is, several copied into one allocation of exactly
/// their length.
fn one_frame(parts: &mut Vec<Bytes>, parts_len: &mut usize) -> Frame<Bytes> {
    *parts_len = 0;
    if parts.len() == 1 {
        return Frame::data(parts.pop().unwrap_or_default());
    }
    let one = spine_core::concat_exact(parts.iter());
    parts.clear();
    Frame::data(one)
}

impl<B> Body for JoinReady<B>
where
    B: Body<Data = Bytes, Error = BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        if this.parts.is_empty() {
            if let Some(held) = this.held.take() {
                return Poll::Ready(Some(held));
            }
            match this.next.take() {
                Some(next) => {
                    *this.parts_len = next.len();
                    this.parts.push(next);
                }
                None if *this.ended => return Poll::Ready(None),
                None => {}
            }
        }
        loop {
            if *this.ended
                || this.held.is_some()
                || this.next.is_some()
                || *this.parts_len >= JOIN_MAX_BYTES
                || this.parts.len() >= JOIN_MAX_FRAMES
            {
                return Poll::Ready(Some(Ok(one_frame(this.parts, this.parts_len))));
            }
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Pending if this.parts.is_empty() => return Poll::Pending,
                // nothing more came during the turn: the join goes on (the inner body keeps
                // the waker: at worst one spurious wake-up)
                Poll::Pending => {
                    return Poll::Ready(Some(Ok(one_frame(this.parts, this.parts_len))))
                }
                Poll::Ready(None) => {
                    *this.ended = true;
                    if this.parts.is_empty() {
                        return Poll::Ready(None);
                    }
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data)
                        if !this.parts.is_empty()
                            && this.parts_len.saturating_add(data.len()) > JOIN_MAX_BYTES =>
                    {
                        *this.ended = this.inner.is_end_stream();
                        *this.next = Some(data);
                    }
                    Ok(data) => {
                        *this.parts_len = this.parts_len.saturating_add(data.len());
                        this.parts.push(data);
                        if this.inner.is_end_stream() {
                            *this.ended = true;
                        } else if *this.parts_len < JOIN_MAX_BYTES
                            && this.parts.len() < JOIN_MAX_FRAMES
                        {
                            // one turn for the tasks already ready (the engine's connection)
                            cx.waker().wake_by_ref();
                            return Poll::Pending;
                        }
                    }
                    Err(frame) if this.parts.is_empty() => return Poll::Ready(Some(Ok(frame))),
                    Err(frame) => *this.held = Some(Ok(frame)),
                },
                Poll::Ready(Some(Err(e))) if this.parts.is_empty() => {
                    return Poll::Ready(Some(Err(e)))
                }
                Poll::Ready(Some(Err(e))) => *this.held = Some(Err(e)),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.parts.is_empty()
            && self.next.is_none()
            && self.held.is_none()
            && (self.ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let taken = self.taken_len();
        if self.ended {
            return SizeHint::with_exact(taken);
        }
        let inner = self.inner.size_hint();
        let mut hint = SizeHint::new();
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(taken));
        }
        hint.set_lower(
            inner
                .lower()
                .saturating_add(taken)
                .min(hint.upper().unwrap_or(u64::MAX)),
        );
        hint
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::collections::VecDeque;

    use http_body_util::BodyExt as _;
    use spine_test_support::body_fn;

    use super::*;

    /// A body that gives `frames` one per poll, each after `pending_between` polls answered
    /// `Pending` (a wake-up each), as hyper's HTTP/1 client does; then the end.
    fn script(
        frames: Vec<Result<Frame<Bytes>, BoxError>>,
        pending_between: usize,
    ) -> impl Body<Data = Bytes, Error = BoxError> + Unpin {
        let mut frames: VecDeque<_> = frames.into();
        let mut pending_left = 0;
        body_fn(move |cx| {
            if pending_left > 0 {
                pending_left -= 1;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            pending_left = pending_between;
            Poll::Ready(frames.pop_front())
        })
    }

    fn data(s: &'static str) -> Result<Frame<Bytes>, BoxError> {
        Ok(Frame::data(Bytes::from_static(s.as_bytes())))
    }

    async fn frames<B>(body: JoinReady<B>) -> Vec<Result<Frame<Bytes>, String>>
    where
        B: Body<Data = Bytes, Error = BoxError>,
    {
        let mut body = Box::pin(body);
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            out.push(frame.map_err(|e| e.to_string()));
        }
        assert!(body.is_end_stream());
        out
    }

    fn as_data(frames: &[Result<Frame<Bytes>, String>]) -> Vec<String> {
        frames
            .iter()
            .map(|f| match f {
                Ok(f) => match f.data_ref() {
                    Some(d) => String::from_utf8_lossy(d).into_owned(),
                    None => "<trailers>".to_owned(),
                },
                Err(e) => format!("<error {e}>"),
            })
            .collect()
    }

    #[tokio::test]
    async fn frames_ready_together_go_as_one_and_a_frame_alone_is_not_held() {
        // ready one after another: joined
        let got = frames(JoinReady::new(script(
            vec![data("a"), data("b"), data("c")],
            0,
        )))
        .await;
        assert_eq!(as_data(&got), ["abc"]);
        // each after a pending poll (nothing came during the turn): one by one
        let got = frames(JoinReady::new(script(
            vec![data("a"), data("b"), data("c")],
            1,
        )))
        .await;
        assert_eq!(as_data(&got), ["a", "b", "c"]);
    }

    #[tokio::test]
    async fn trailers_and_errors_come_after_the_data_before_them() {
        let trailers = Ok(Frame::trailers(http::HeaderMap::new()));
        let got = frames(JoinReady::new(script(
            vec![data("a"), data("b"), trailers, data("c")],
            0,
        )))
        .await;
        assert_eq!(as_data(&got), ["ab", "<trailers>", "c"]);
        let got = frames(JoinReady::new(script(
            vec![data("a"), Err("boom".into()), data("c")],
            0,
        )))
        .await;
        assert_eq!(as_data(&got), ["a", "<error boom>", "c"]);
    }

    #[tokio::test]
    async fn a_join_is_bounded() {
        let big = || Ok(Frame::data(Bytes::from(vec![b'x'; 6 * 1024])));
        let got = frames(JoinReady::new(script(
            vec![big(), big(), big(), big(), big()],
            0,
        )))
        .await;
        let lens: Vec<usize> = got
            .iter()
            .map(|f| f.as_ref().unwrap().data_ref().unwrap().len())
            .collect();
        // a third 6 KiB would pass the bound: it starts the next join
        assert_eq!(lens, [12 * 1024, 12 * 1024, 6 * 1024]);
        // at most JOIN_MAX_FRAMES frames, empty ones counted: a frame is held a bounded
        // number of turns however small the frames behind it
        let mut frames_in = vec![data("a")];
        frames_in.extend((0..40).map(|_| data("")));
        frames_in.push(data("b"));
        let got = frames(JoinReady::new(script(frames_in, 0))).await;
        // "a" and 31 empty frames, then 9 and "b" (without the bound: one frame, "ab")
        assert_eq!(as_data(&got), ["a", "b"]);
        let tiny: Vec<_> = (0..40).map(|_| data("x")).collect();
        let got = frames(JoinReady::new(script(tiny, 0))).await;
        assert_eq!(as_data(&got), ["x".repeat(32), "x".repeat(8)]);
    }

    #[tokio::test]
    async fn only_event_streams_are_joined() {
        let two = || {
            let body = script(vec![data("a"), data("b")], 0)
                .map_err(|e| e)
                .boxed_unsync();
            Response::new(body)
        };
        for (content_type, parts) in [
            (Some("text/event-stream"), 1),
            (Some("Text/Event-Stream; charset=utf-8"), 1),
            (Some(" text/event-stream;charset=utf-8"), 1),
            (Some("text/event-stream x"), 1),
            (Some("text/event-streamx"), 2),
            (Some("text/event"), 2),
            (Some("application/json"), 2),
            (None, 2),
        ] {
            let mut response = two();
            if let Some(v) = content_type {
                response.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static(v),
                );
            }
            let mut body = joined(response).into_body();
            let mut got = 0;
            while let Some(frame) = body.frame().await {
                frame.unwrap();
                got += 1;
            }
            assert_eq!(got, parts, "{content_type:?}");
        }
    }

    #[tokio::test]
    async fn the_size_hint_counts_what_is_joined_and_not_handed_on() {
        let body = http_body_util::Full::new(Bytes::from_static(b"hello"))
            .map_err(|e| match e {})
            .boxed_unsync();
        let mut joined = Box::pin(JoinReady::new(body));
        assert_eq!(joined.size_hint().exact(), Some(5));
        let frame = joined.frame().await.unwrap().unwrap();
        assert_eq!(frame.data_ref().map(Bytes::len), Some(5));
        assert!(joined.is_end_stream());
        assert!(joined.frame().await.is_none());
    }
}
