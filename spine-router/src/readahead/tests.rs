#![allow(clippy::unwrap_used)]
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http_body_util::StreamBody;

use super::*;

/// A node body of `n` frames of `len` bytes, counting the frames the node got to send and
/// saying (through `ended`) when it was dropped.
fn node_body(
    n: usize,
    len: usize,
    sent: Arc<AtomicUsize>,
    ended: tokio::sync::oneshot::Sender<()>,
) -> BoxBody {
    struct OnDrop(Option<tokio::sync::oneshot::Sender<()>>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(());
            }
        }
    }
    let guard = OnDrop(Some(ended));
    let stream = futures_util::stream::unfold((0usize, guard), move |(i, guard)| {
        let sent = sent.clone();
        async move {
            if i == n {
                return None;
            }
            sent.fetch_add(1, Ordering::SeqCst);
            let frame = Frame::data(Bytes::from(vec![b'x'; len]));
            Some((Ok::<_, BoxError>(frame), (i + 1, guard)))
        }
    });
    BoxBody::new(StreamBody::new(stream))
}

#[tokio::test(start_paused = true)]
async fn the_node_body_is_drained_and_dropped_before_the_caller_reads() {
    let sent = Arc::new(AtomicUsize::new(0));
    let (ended_tx, ended_rx) = tokio::sync::oneshot::channel();
    let body = read_ahead(node_body(10, 100, sent.clone(), ended_tx), 4096);
    // nobody reads yet: the node's body ends (and is dropped) anyway
    tokio::time::timeout(Duration::from_secs(10), ended_rx)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(sent.load(Ordering::SeqCst), 10);
    let bytes = body.collect().await.unwrap().to_bytes();
    assert_eq!(bytes.len(), 1000);
}

#[tokio::test(start_paused = true)]
async fn the_buffer_is_bounded() {
    let sent = Arc::new(AtomicUsize::new(0));
    let (ended_tx, mut ended_rx) = tokio::sync::oneshot::channel();
    // 100 frames of 1,000 bytes into a 10,000-byte buffer
    let mut body = read_ahead(node_body(100, 1000, sent.clone(), ended_tx), 10_000);
    tokio::time::sleep(Duration::from_millis(200)).await;
    // 10 frames fill it (joined into one: they were ready together); the 11th was read
    // from the node and waits for room
    assert_eq!(sent.load(Ordering::SeqCst), 11);
    assert!(
        ended_rx.try_recv().is_err(),
        "the node body must still be held"
    );
    // the caller takes what was buffered: room for ten more, the 11th among them
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first.len(), 10_000);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(sent.load(Ordering::SeqCst), 21);
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(rest.len(), 90_000);
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_leaves_stops_the_pump_and_drops_the_node_body() {
    let sent = Arc::new(AtomicUsize::new(0));
    let (ended_tx, ended_rx) = tokio::sync::oneshot::channel();
    let body = read_ahead(node_body(1000, 1000, sent.clone(), ended_tx), 10_000);
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(body);
    tokio::time::timeout(Duration::from_secs(10), ended_rx)
        .await
        .unwrap()
        .unwrap();
    assert!(sent.load(Ordering::SeqCst) < 1000);
}

#[tokio::test(start_paused = true)]
async fn an_error_comes_after_the_frames_before_it() {
    let frames: Vec<Result<Frame<Bytes>, BoxError>> = vec![
        Ok(Frame::data(Bytes::from_static(b"a"))),
        Err("node broke".into()),
    ];
    let mut body = read_ahead(
        BoxBody::new(StreamBody::new(futures_util::stream::iter(frames))),
        1024,
    );
    let a = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&a[..], b"a");
    let err = body.frame().await.unwrap().unwrap_err();
    assert_eq!(err.to_string(), "node broke");
    assert!(body.frame().await.is_none());
    assert!(body.is_end_stream());
}

#[tokio::test(start_paused = true)]
async fn frames_ready_together_are_joined_and_a_frame_alone_is_not_held_back() {
    let (node_tx, node_rx) =
        tokio::sync::mpsc::unbounded_channel::<Result<Frame<Bytes>, BoxError>>();
    for part in ["a", "b", "c"] {
        node_tx
            .send(Ok(Frame::data(Bytes::from_static(part.as_bytes()))))
            .unwrap();
    }
    let stream = futures_util::stream::unfold(node_rx, |mut rx| async move {
        rx.recv().await.map(|frame| (frame, rx))
    });
    let mut body = read_ahead(BoxBody::new(StreamBody::new(stream)), 4096);
    let wait = Duration::from_secs(10);
    let joined = tokio::time::timeout(wait, body.frame()).await.unwrap();
    let joined = joined.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&joined[..], b"abc");
    // one allocation of exactly its length: the memory it holds is what its permits count
    let joined = joined.try_into_mut().unwrap();
    assert_eq!(joined.capacity(), 3);
    // one frame, the node's body still open: passed on without waiting for more, in an
    // allocation of its own (the node's was a slice of a larger buffer)
    let read_buffer = Bytes::from(vec![b'd'; 8192]);
    node_tx
        .send(Ok(Frame::data(read_buffer.slice(..1))))
        .unwrap();
    drop(read_buffer);
    let alone = tokio::time::timeout(wait, body.frame()).await.unwrap();
    let alone = alone.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&alone[..], b"d");
    assert_eq!(alone.try_into_mut().unwrap().capacity(), 1);
    // trailers after data come after it, then the end
    node_tx
        .send(Ok(Frame::data(Bytes::from_static(b"e"))))
        .unwrap();
    node_tx
        .send(Ok(Frame::trailers(http::HeaderMap::new())))
        .unwrap();
    drop(node_tx);
    let e = tokio::time::timeout(wait, body.frame()).await.unwrap();
    assert_eq!(&e.unwrap().unwrap().into_data().unwrap()[..], b"e");
    let trailers = tokio::time::timeout(wait, body.frame()).await.unwrap();
    assert!(trailers.unwrap().unwrap().is_trailers());
    assert!(tokio::time::timeout(wait, body.frame())
        .await
        .unwrap()
        .is_none());
}
