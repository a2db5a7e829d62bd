//! Slow readers off the node (issue 14): `ReadAhead<Route<…>>` reads a node's answer at the
//! node's pace, so the node's slot is free once generation ends, however slowly the callers
//! read; without it, four slow readers hold a four-slot node.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use spine_core::{BodyClassifier, BodySignal, BoxBody, BoxError, ClassifyBody};
use spine_router::{NodeRegistry, ReadAheadLayer, RouteLayer};
use spine_test_support::UpstreamService;
use tower::{Layer, Service, ServiceExt};

mod common;

const FRAMES: usize = 30;

/// Any data is content.
#[derive(Debug)]
struct AnyData;

struct AnyDataClassifier;

impl BodyClassifier for AnyDataClassifier {
    fn feed(&mut self, _chunk: &[u8]) -> BodySignal {
        BodySignal::Content
    }
    fn finish(&mut self) -> BodySignal {
        BodySignal::Failed
    }
}

impl ClassifyBody for AnyData {
    fn classifier(&self, _content_type: Option<&str>) -> Box<dyn BodyClassifier> {
        Box::new(AnyDataClassifier)
    }
}

/// A node generating `FRAMES` events, one every 10 ms (300 ms of generation).
fn upstream() -> impl UpstreamService {
    tower::service_fn(|_req: http::Request<BoxBody>| async {
        let frames = futures_util::stream::unfold(0usize, |i| async move {
            if i == FRAMES {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            let frame = http_body::Frame::data(Bytes::from(format!("data: tok {i}\n\n")));
            Some((Ok::<_, BoxError>(frame), i + 1))
        });
        Ok::<_, BoxError>(
            http::Response::builder()
                .header("content-type", "text/event-stream")
                .body(BoxBody::new(StreamBody::new(frames)))
                .unwrap(),
        )
    })
}

/// One node, `n1`, with 4 slots.
fn registry() -> NodeRegistry {
    common::registry(&["n1"])
}

/// A streamed chat request, no cache key.
fn request() -> http::Request<BoxBody> {
    common::request_streamed(None, true).0
}

fn in_flight(r: &NodeRegistry) -> u32 {
    r.snapshot()[0].in_flight
}

/// A caller that reads one frame a second; returns how many bytes it got in all.
fn slow_reader(body: BoxBody) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut body = body;
        let mut bytes = 0;
        while let Some(frame) = body.frame().await {
            bytes += frame.unwrap().into_data().map_or(0, |d| d.len());
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        bytes
    })
}

fn expected_bytes() -> usize {
    (0..FRAMES)
        .map(|i| format!("data: tok {i}\n\n").len())
        .sum()
}

#[tokio::test(start_paused = true)]
async fn eight_slow_readers_on_four_slots_free_them_when_generation_ends() {
    let registry = registry();
    let route = RouteLayer::new(registry.clone())
        .classify(std::sync::Arc::new(AnyData))
        .layer(upstream());
    let mut svc = ReadAheadLayer::new(64 * 1024).layer(route);

    let mut readers = Vec::new();
    for round in 0..2 {
        for _ in 0..4 {
            let resp = svc.ready().await.unwrap().call(request()).await.unwrap();
            readers.push(slow_reader(resp.into_body()));
        }
        assert_eq!(
            in_flight(&registry),
            4,
            "round {round}: four streams generating"
        );
        // generation takes 300 ms; the readers have taken one frame each
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            in_flight(&registry),
            0,
            "round {round}: slots free once generation ended"
        );
    }
    // eight readers still reading (they need 30 s); a ninth caller is served at once
    assert!(readers.iter().all(|r| !r.is_finished()));
    let resp = svc.ready().await.unwrap().call(request()).await.unwrap();
    let ninth = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(ninth.len(), expected_bytes());
    assert_eq!(in_flight(&registry), 0);
    // every slow reader gets its whole answer in the end
    for r in readers {
        assert_eq!(r.await.unwrap(), expected_bytes());
    }
}

/// The contrast: without read-ahead, four slow readers hold the four slots for as long as they
/// read, and a fifth caller waits (in the admission queue) for one of them.
#[tokio::test(start_paused = true)]
async fn without_read_ahead_slow_readers_hold_the_slots() {
    let registry = registry();
    let mut svc = RouteLayer::new(registry.clone())
        .classify(std::sync::Arc::new(AnyData))
        .layer(upstream());
    let mut readers = Vec::new();
    for _ in 0..4 {
        let resp = svc.ready().await.unwrap().call(request()).await.unwrap();
        readers.push(slow_reader(resp.into_body()));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(in_flight(&registry), 4);
    let fifth = svc.ready().await.unwrap().call(request());
    assert!(
        tokio::time::timeout(Duration::from_secs(5), fifth)
            .await
            .is_err(),
        "the fifth caller got an answer while the four slow readers held every slot"
    );
    assert_eq!(in_flight(&registry), 4);
    for r in readers {
        r.abort();
    }
}
