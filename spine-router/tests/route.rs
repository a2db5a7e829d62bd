//! `Route` over scripted upstream services: retries before the first byte, never after; the
//! same body on every attempt; each attempt recorded against its own node.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt;
use spine_core::{
    BodyClassifier, BodySignal, BoxBody, BoxError, ClassifyBody, ModelId, NodeId, NodeSlot,
};
use spine_router::{AvoidNodes, NodeRegistry, RouteConfig, RouteError, RouteLayer};
use spine_test_support::{full, ScriptedBody, UpstreamService};
use tower::{Layer, ServiceExt};

mod common;
use common::{registry, request_streamed};

/// Test classifier: an event `data: tok` is content, `data: err` a failure.
#[derive(Debug)]
struct Words;

#[derive(Default)]
struct WordsClassifier {
    content: bool,
    failed: bool,
}

impl BodyClassifier for WordsClassifier {
    fn feed(&mut self, chunk: &[u8]) -> BodySignal {
        let text = String::from_utf8_lossy(chunk);
        if text.contains("data: err") {
            self.failed = true;
        } else if text.contains("data: tok") {
            self.content = true;
        }
        self.signal()
    }
    fn finish(&mut self) -> BodySignal {
        if !self.content {
            self.failed = true;
        }
        self.signal()
    }
}

impl WordsClassifier {
    fn signal(&self) -> BodySignal {
        if self.failed {
            BodySignal::Failed
        } else if self.content {
            BodySignal::Content
        } else {
            BodySignal::Pending
        }
    }
}

impl ClassifyBody for Words {
    fn classifier(&self, _content_type: Option<&str>) -> Box<dyn BodyClassifier> {
        Box::new(WordsClassifier::default())
    }
}

/// What a scripted node does.
#[derive(Clone, Copy, Debug)]
enum Script {
    Ok,
    Status503,
    /// A 500 that follows the request (llama-server's answer to a malformed `tools`).
    Status500,
    ConnectError,
    ErrorEvent,
    EmptyStream,
    /// One token, then the body breaks.
    BreakAfterToken,
    /// A 400: the caller's fault, or a node refusing work.
    Status400,
    /// A 413 (as 400).
    Status413,
    /// A 422 (as 400).
    Status422,
    /// A 429 (transient: another node may take it).
    Status429,
    /// A 404 from the node: it does not serve what it advertised (its fault, not the caller's).
    Status404,
    /// The whole answer after 121 s, as a non-streamed answer comes when generation is done.
    SlowWholeAnswer,
    /// The gateway's own per-node limit (a [`GatewayFull`] error).
    NodeFull,
    /// [`Script::NodeFull`] on its first two calls (a stream slot released a moment late), then
    /// [`Script::Ok`].
    FullTwice,
    /// A 2xx head, then nothing.
    SilentBody,
    /// Never answers at all.
    SilentHead,
}

/// The test's stand-in for the tunnel's node-full refusal.
#[derive(Debug)]
struct GatewayFull;

impl std::fmt::Display for GatewayFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("node full")
    }
}

impl std::error::Error for GatewayFull {}

fn is_gateway_full(e: &BoxError) -> bool {
    e.downcast_ref::<GatewayFull>().is_some()
}

fn status(code: u16, body: &'static str) -> http::Response<BoxBody> {
    http::Response::builder()
        .status(code)
        .body(full(body))
        .unwrap()
}

/// A streamed answer of scripted frames: `Ok` is a data frame, `Err` a body error.
fn sse(chunks: Vec<Result<&'static str, &'static str>>) -> http::Response<BoxBody> {
    http::Response::builder()
        .header("content-type", "text/event-stream")
        .body(BoxBody::new(ScriptedBody::frames(
            chunks
                .into_iter()
                .map(|c| c.map(Bytes::from).map_err(|e| e.to_owned())),
        )))
        .unwrap()
}

#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<(NodeId, Bytes)>>>);

fn upstream(scripts: HashMap<&'static str, Script>, log: Log) -> impl UpstreamService {
    let scripts = Arc::new(scripts);
    tower::service_fn(move |req: http::Request<BoxBody>| {
        let scripts = scripts.clone();
        let log = log.clone();
        async move {
            let node = req.extensions().get::<NodeId>().cloned().unwrap();
            let body = req.into_body().collect().await?.to_bytes();
            let calls = {
                let mut log = log.0.lock().unwrap();
                log.push((node.clone(), body));
                log.iter().filter(|(n, _)| *n == node).count()
            };
            let script = match scripts[node.as_str()] {
                Script::FullTwice if calls <= 2 => Script::NodeFull,
                Script::FullTwice => Script::Ok,
                script => script,
            };
            match script {
                Script::Ok => Ok(sse(vec![
                    Ok("data: role\n\n"),
                    Ok("data: tok\n\n"),
                    Ok("data: end\n\n"),
                ])),
                Script::Status503 => Ok(http::Response::builder()
                    .status(503)
                    .body(full("busy"))
                    .unwrap()),
                Script::Status500 => Ok(status(500, "Failed to parse tools")),
                Script::ConnectError => Err::<_, BoxError>("connect refused".into()),
                Script::ErrorEvent => Ok(sse(vec![Ok("data: role\n\n"), Ok("data: err\n\n")])),
                Script::EmptyStream => Ok(sse(vec![])),
                Script::BreakAfterToken => Ok(sse(vec![Ok("data: tok\n\n"), Err("tunnel lost")])),
                Script::Status400 => Ok(status(400, "bad request")),
                Script::Status413 => Ok(status(413, "too large")),
                Script::Status422 => Ok(status(422, "unprocessable")),
                Script::Status429 => Ok(status(429, "slow down")),
                Script::Status404 => Ok(status(404, "model not found")),
                Script::SlowWholeAnswer => {
                    tokio::time::sleep(std::time::Duration::from_secs(121)).await;
                    Ok(sse(vec![Ok("data: tok\n\n"), Ok("data: end\n\n")]))
                }
                Script::NodeFull => Err(BoxError::from(GatewayFull)),
                Script::FullTwice => unreachable!("resolved above"),
                Script::SilentBody => Ok(http::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(BoxBody::new(ScriptedBody::default().hang()))
                    .unwrap()),
                Script::SilentHead => std::future::pending().await,
            }
        }
    })
}

/// A route (default config, the test classifier) over one node per script, each registered
/// serving `m`: the registry, the log of what the nodes received, and the service.
fn scripted_route(
    scripts: &[(&'static str, Script)],
) -> (
    NodeRegistry,
    Log,
    impl tower::Service<http::Request<BoxBody>, Response = http::Response<BoxBody>, Error = BoxError>
        + Clone,
) {
    let names: Vec<&str> = scripts.iter().map(|(n, _)| *n).collect();
    let r = registry(&names);
    let log = Log::default();
    let svc = RouteLayer::new(r.clone())
        .classify(Arc::new(Words))
        .layer(upstream(scripts.iter().copied().collect(), log.clone()));
    (r, log, svc)
}

fn request(key: Option<&str>) -> (http::Request<BoxBody>, NodeSlot) {
    request_streamed(key, true)
}

fn stats(r: &NodeRegistry, node: &str) -> (u64, u64, u64) {
    let s = r
        .snapshot()
        .into_iter()
        .find(|s| s.node_id.as_str() == node)
        .unwrap();
    (s.attempts, s.failures, s.disconnects)
}

type Outcome = (
    NodeRegistry,
    Log,
    Result<(NodeId, Result<Bytes, BoxError>), BoxError>,
    NodeSlot,
);

async fn run_one(scripts: &[(&'static str, Script)], max_retries: u32) -> Outcome {
    run_one_streamed(scripts, max_retries, true).await
}

async fn run_one_streamed(
    scripts: &[(&'static str, Script)],
    max_retries: u32,
    stream: bool,
) -> Outcome {
    run_one_with(scripts, max_retries, stream, |layer| layer).await
}

async fn run_one_with(
    scripts: &[(&'static str, Script)],
    max_retries: u32,
    stream: bool,
    configure: fn(RouteLayer) -> RouteLayer,
) -> Outcome {
    let names: Vec<&str> = scripts.iter().map(|(n, _)| *n).collect();
    let r = registry(&names);
    let log = Log::default();
    let svc = RouteLayer::new(r.clone())
        .classify(Arc::new(Words))
        .config(RouteConfig {
            max_retries,
            ..RouteConfig::default()
        })
        .not_node_fault(is_gateway_full);
    let svc = configure(svc).layer(upstream(scripts.iter().copied().collect(), log.clone()));
    let (req, slot) = request_streamed(None, stream);
    let out = match svc.oneshot(req).await {
        Ok(resp) => {
            let node = resp
                .extensions()
                .get::<NodeId>()
                .cloned()
                .unwrap_or(NodeId::new("?"));
            let body = resp.into_body().collect().await.map(|c| c.to_bytes());
            Ok((node, body))
        }
        Err(e) => Err(e),
    };
    (r, log, out, slot)
}

#[tokio::test]
async fn failures_before_the_first_byte_are_retried_on_another_node() {
    // two answer-type failures that agree would end the request (see
    // `a_failure_every_node_gives_is_not_scored`), so those come in differing pairs here
    for (bad, other) in [
        (Script::Status503, Script::Status503),
        (Script::ConnectError, Script::ConnectError),
        (Script::ErrorEvent, Script::EmptyStream),
        (Script::EmptyStream, Script::Status500),
        (Script::Status500, Script::ErrorEvent),
    ] {
        // every failing node is tried at most once; the healthy one answers in the end
        let (r, log, out, slot) =
            run_one(&[("bad1", bad), ("bad2", other), ("good", Script::Ok)], 2).await;
        let (node, body) = out.unwrap();
        assert_eq!(node.as_str(), "good", "{bad:?}");
        assert_eq!(
            &body.unwrap()[..],
            b"data: role\n\ndata: tok\n\ndata: end\n\n"
        );
        assert_eq!(slot.get(), Some(NodeId::new("good")));
        let log = log.0.lock().unwrap().clone();
        // the same bytes on every attempt, each on a different node
        assert!(log.iter().all(|(_, b)| &b[..] == b"{\"model\":\"m\"}"));
        let mut nodes: Vec<&str> = log.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(nodes.last(), Some(&"good"));
        nodes.sort_unstable();
        nodes.dedup();
        assert_eq!(nodes.len(), log.len(), "{bad:?}: a node tried twice");
        assert_eq!(stats(&r, "good"), (1, 0, 0));
        // a failing node that was tried is scored (the healthy answer shows the request was
        // servable)
        for n in ["bad1", "bad2"] {
            let (attempts, failures, _) = stats(&r, n);
            assert_eq!(attempts, failures, "{bad:?} {n}");
            let tried = log.iter().filter(|(l, _)| l.as_str() == n).count() as u64;
            assert_eq!(attempts, tried, "{bad:?} {n}");
        }
        // all leases released
        assert!(r.snapshot().iter().all(|s| s.in_flight == 0));
    }
}

#[tokio::test]
async fn failure_after_the_first_byte_is_not_retried() {
    let (r, log, out, _) = run_one(
        &[
            ("a", Script::BreakAfterToken),
            ("b", Script::BreakAfterToken),
        ],
        2,
    )
    .await;
    let (_, body) = out.unwrap();
    let err = body.unwrap_err();
    assert_eq!(err.to_string(), "tunnel lost");
    assert_eq!(
        log.0.lock().unwrap().len(),
        1,
        "retried after a byte was forwarded"
    );
    let total: (u64, u64, u64) = ["a", "b"]
        .iter()
        .map(|n| stats(&r, n))
        .fold((0, 0, 0), |a, s| (a.0 + s.0, a.1 + s.1, a.2 + s.2));
    assert_eq!(total, (1, 1, 1));
    let halved = r
        .snapshot()
        .into_iter()
        .find(|s| s.disconnects == 1)
        .unwrap();
    assert!(halved.score.failure_penalty < 0.51);
}

#[tokio::test]
async fn retries_are_bounded_and_the_last_answer_is_returned() {
    let scripts = [
        ("a", Script::Status503),
        ("b", Script::Status503),
        ("c", Script::Status503),
        ("d", Script::Status503),
    ];
    let (_, log, out, _) = run_one(&scripts, 2).await;
    let (_, body) = out.unwrap();
    assert_eq!(&body.unwrap()[..], b"busy");
    assert_eq!(log.0.lock().unwrap().len(), 3);
    // no retry at all
    let (_, log, out, _) = run_one(
        &[("a", Script::ConnectError), ("b", Script::ConnectError)],
        0,
    )
    .await;
    assert_eq!(out.unwrap_err().to_string(), "connect refused");
    assert_eq!(log.0.lock().unwrap().len(), 1);
    // an error stream is handed back as it came when no node is left
    let (_, _, out, _) = run_one(&[("a", Script::ErrorEvent)], 2).await;
    assert_eq!(&out.unwrap().1.unwrap()[..], b"data: role\n\ndata: err\n\n");
}

#[tokio::test]
async fn the_answering_node_becomes_sticky() {
    let (r, log, svc) = scripted_route(&[("a", Script::Ok), ("b", Script::Ok), ("c", Script::Ok)]);
    for _ in 0..10 {
        let (req, _) = request(Some("chat-1"));
        let resp = svc.clone().oneshot(req).await.unwrap();
        resp.into_body().collect().await.unwrap();
    }
    let log = log.0.lock().unwrap();
    assert!(log.iter().all(|(n, _)| *n == log[0].0), "{log:?}");
    let hits: u64 = r.snapshot().iter().map(|s| s.sticky_hits).sum();
    assert_eq!(hits, 9);
}

#[tokio::test]
async fn no_peek_is_refused() {
    let r = registry(&["a"]);
    let svc = RouteLayer::new(r).layer(upstream(
        [("a", Script::Ok)].into_iter().collect(),
        Log::default(),
    ));
    let req = http::Request::new(BoxBody::default());
    let err = svc.oneshot(req).await.unwrap_err();
    assert_eq!(
        err.downcast_ref::<RouteError>(),
        Some(&RouteError::MissingPeek)
    );
}

#[tokio::test]
async fn a_refusal_from_two_nodes_is_the_requests_fault_and_passes_through_unscored() {
    // any two of 400 / 413 / 422: the request was bad, no third node, nobody scored
    for (first, second) in [
        (Script::Status400, Script::Status400),
        (Script::Status422, Script::Status400),
        (Script::Status413, Script::Status422),
    ] {
        let (r, log, out, _) = run_one(&[("a", first), ("b", second)], 2).await;
        let (node, body) = out.unwrap();
        assert_eq!(log.0.lock().unwrap().len(), 2, "{first:?} {second:?}");
        let second_node = log.0.lock().unwrap()[1].0.clone();
        assert_eq!(node, second_node, "the last refusal goes to the caller");
        let second_script = if second_node.as_str() == "a" {
            first
        } else {
            second
        };
        let expected: &[u8] = match second_script {
            Script::Status400 => b"bad request",
            Script::Status413 => b"too large",
            _ => b"unprocessable",
        };
        assert_eq!(&body.unwrap()[..], expected);
        for n in ["a", "b"] {
            assert_eq!(stats(&r, n), (0, 0, 0), "{n} scored");
        }
        assert!(r.snapshot().iter().all(|s| s.score.score > 0.99));
        assert!(r.snapshot().iter().all(|s| s.in_flight == 0));
    }
}

#[tokio::test]
async fn a_refusal_is_retried_and_scored_only_when_another_node_serves_the_request() {
    for refusal in [Script::Status400, Script::Status413, Script::Status422] {
        let mut refused_first_seen = 0;
        for run in 0..24 {
            let stream = run % 2 == 0;
            let (r, log, out, _) =
                run_one_streamed(&[("a", refusal), ("b", Script::Ok)], 2, stream).await;
            let (node, body) = out.unwrap();
            let log = log.0.lock().unwrap().clone();
            let refused_first = log[0].0.as_str() == "a";
            if refused_first {
                refused_first_seen += 1;
                // a refused, b served: a's refusal was its fault
                assert_eq!(log.len(), 2, "{refusal:?}");
                assert_eq!(stats(&r, "a"), (1, 1, 0), "{refusal:?}");
            } else {
                // b was picked first and served: a never saw the request
                assert_eq!(log.len(), 1, "{refusal:?}");
                assert_eq!(stats(&r, "a"), (0, 0, 0), "{refusal:?}");
            }
            assert_eq!(node.as_str(), "b");
            assert_eq!(stats(&r, "b").1, 0);
            assert!(!body.unwrap().is_empty());
            assert!(r.snapshot().iter().all(|s| s.in_flight == 0));
        }
        // a weighted random pick of two equal nodes: a is first in about half the runs
        assert!(refused_first_seen > 0, "{refusal:?}");
    }
}

#[tokio::test]
async fn a_lone_nodes_refusal_passes_through_unscored() {
    let (r, log, out, _) = run_one(&[("a", Script::Status422)], 2).await;
    assert_eq!(log.0.lock().unwrap().len(), 1);
    assert_eq!(&out.unwrap().1.unwrap()[..], b"unprocessable");
    assert_eq!(stats(&r, "a"), (0, 0, 0));
    assert!(r.snapshot().iter().all(|s| s.in_flight == 0));
}

#[tokio::test]
async fn a_429_is_retried_and_scored() {
    let (r, log, out, _) = run_one(&[("a", Script::Status429), ("b", Script::Status429)], 1).await;
    assert_eq!(&out.unwrap().1.unwrap()[..], b"slow down");
    assert_eq!(log.0.lock().unwrap().len(), 2);
    assert_eq!(stats(&r, "a"), (1, 1, 0));
    assert_eq!(stats(&r, "b"), (1, 1, 0));
    // a node that says it is full is sent fewer at once (`registry::limit`): one in flight of
    // 4 claimed, halved to at least 1
    for node in ["a", "b"] {
        assert_eq!(r.concurrency_limit(&NodeId::new(node)), Some(1), "{node}");
    }
    // a 404 is no overload signal
    let (r, _, _, _) = run_one(&[("a", Script::Status404), ("b", Script::Status404)], 1).await;
    assert_eq!(r.concurrency_limit(&NodeId::new("a")), Some(4));
}

#[tokio::test]
async fn a_404_from_a_node_is_its_fault_retried_and_scored() {
    let (r, log, out, _) = run_one(&[("a", Script::Status404), ("b", Script::Status404)], 1).await;
    assert_eq!(&out.unwrap().1.unwrap()[..], b"model not found");
    assert_eq!(
        log.0.lock().unwrap().len(),
        2,
        "a node's 404 was not retried"
    );
    assert_eq!(stats(&r, "a"), (1, 1, 0));
    assert_eq!(stats(&r, "b"), (1, 1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_long_non_streamed_answer_is_not_cut_by_the_first_token_deadline() {
    // 121 s > the 120 s default: only a streamed request has a first-content deadline
    let (r, log, out, _) = run_one_streamed(&[("slow", Script::SlowWholeAnswer)], 2, false).await;
    let (node, body) = out.unwrap();
    assert_eq!(node.as_str(), "slow");
    body.unwrap();
    assert_eq!(log.0.lock().unwrap().len(), 1);
    assert_eq!(stats(&r, "slow"), (1, 0, 0));
    // the same answer to a streamed request is cut at 120 s; late on the only node it tried,
    // nothing shows another node would have been faster: not scored
    let (r, _, out, _) = run_one_streamed(&[("slow", Script::SlowWholeAnswer)], 0, true).await;
    assert!(matches!(
        out.unwrap_err().downcast_ref::<RouteError>(),
        Some(RouteError::FirstContentTimeout(_))
    ));
    assert_eq!(stats(&r, "slow"), (0, 0, 0));
}

#[tokio::test]
async fn node_full_is_retried_but_not_scored() {
    let (r, log, out, _) = run_one(&[("f1", Script::NodeFull), ("f2", Script::NodeFull)], 1).await;
    assert!(out.unwrap_err().downcast_ref::<GatewayFull>().is_some());
    assert_eq!(
        log.0.lock().unwrap().len(),
        2,
        "not retried on the other node"
    );
    assert_eq!(stats(&r, "f1"), (0, 0, 0));
    assert_eq!(stats(&r, "f2"), (0, 0, 0));
    let (r, _, out, _) = run_one(&[("full", Script::NodeFull), ("good", Script::Ok)], 2).await;
    assert_eq!(out.unwrap().0.as_str(), "good");
    assert_eq!(stats(&r, "full"), (0, 0, 0));
    assert!(r.snapshot().iter().all(|s| s.in_flight == 0));
}

#[tokio::test]
async fn a_node_momentarily_full_is_picked_again_not_given_up() {
    // the race under a burst: the node's last stream ended, its tunnel slot not released yet
    let momentary = |layer: RouteLayer| layer.node_full(is_gateway_full);
    for max_retries in [0, 2] {
        let (r, log, out, _) =
            run_one_with(&[("only", Script::FullTwice)], max_retries, true, momentary).await;
        let (node, body) = out.unwrap();
        assert_eq!(node.as_str(), "only", "max_retries {max_retries}");
        body.unwrap();
        assert_eq!(log.0.lock().unwrap().len(), 3, "max_retries {max_retries}");
        // the two refusals are not scored; the success is
        assert_eq!(stats(&r, "only"), (1, 0, 0), "max_retries {max_retries}");
        assert!(r.snapshot().iter().all(|s| s.in_flight == 0));
    }
    // a node that stays full: picked again at most MAX_FULL_REPICKS times, then given up
    let (r, log, out, _) = run_one_with(&[("full", Script::NodeFull)], 0, true, momentary).await;
    assert!(out.unwrap_err().downcast_ref::<GatewayFull>().is_some());
    assert_eq!(
        log.0.lock().unwrap().len(),
        1 + spine_router::MAX_FULL_REPICKS as usize
    );
    assert_eq!(stats(&r, "full"), (0, 0, 0));
    assert!(r.snapshot().iter().all(|s| s.in_flight == 0));
}

#[tokio::test(start_paused = true)]
async fn a_silent_node_times_out_and_is_retried_elsewhere() {
    for silent in [Script::SilentBody, Script::SilentHead] {
        // both silent: each tried once, each late after the deadline, then a timeout error;
        // late on every node it tried, the request may be slow itself (a caller's long
        // prompt): no node scored
        let started = tokio::time::Instant::now();
        let (r, log, out, _) = run_one(&[("m1", silent), ("m2", silent)], 1).await;
        let err = out.unwrap_err();
        assert!(
            matches!(
                err.downcast_ref::<RouteError>(),
                Some(RouteError::FirstContentTimeout(_))
            ),
            "{silent:?}: {err}"
        );
        assert_eq!(log.0.lock().unwrap().len(), 2, "{silent:?}");
        assert_eq!(stats(&r, "m1"), (0, 0, 0), "{silent:?}");
        assert_eq!(stats(&r, "m2"), (0, 0, 0), "{silent:?}");
        assert!(started.elapsed() >= std::time::Duration::from_secs(240));
        assert!(r.snapshot().iter().all(|s| s.in_flight == 0));
        // late with no other request in flight: slow, not queueing (`registry::limit`)
        assert!(
            r.snapshot().iter().all(|s| s.concurrency_limit == 4),
            "{silent:?}"
        );
        // with a healthy node the request ends there, whichever order the nodes are tried in
        let (r, _, out, _) =
            run_one(&[("m1", silent), ("m2", silent), ("good", Script::Ok)], 2).await;
        let (node, body) = out.unwrap();
        assert_eq!(node.as_str(), "good", "{silent:?}");
        body.unwrap();
        for n in ["m1", "m2"] {
            let (attempts, failures, _) = stats(&r, n);
            assert_eq!(attempts, failures, "{silent:?} {n}");
        }
    }
}

fn penalty(r: &NodeRegistry, node: &str) -> f64 {
    r.snapshot()
        .into_iter()
        .find(|s| s.node_id.as_str() == node)
        .unwrap()
        .score
        .failure_penalty
}

#[tokio::test]
async fn a_failure_every_node_gives_is_not_scored() {
    for (bad, answer) in [
        (Script::Status500, &b"Failed to parse tools"[..]),
        (Script::ErrorEvent, &b"data: role\n\ndata: err\n\n"[..]),
        (Script::EmptyStream, &b""[..]),
    ] {
        let scripts = [("a", bad), ("b", bad), ("c", bad), ("d", bad)];
        let (r, log, out, _) = run_one(&scripts, 3).await;
        // the second identical answer ends the request: no third node burnt
        assert_eq!(log.0.lock().unwrap().len(), 2, "{bad:?}");
        assert_eq!(&out.unwrap().1.unwrap()[..], answer, "{bad:?}");
        for (n, _) in scripts {
            assert_eq!(stats(&r, n), (0, 0, 0), "{bad:?}: {n} was scored");
            assert!(penalty(&r, n) > 0.999, "{bad:?}: {n} was penalised");
        }
        assert!(r.snapshot().iter().all(|s| s.in_flight == 0));
    }
}

#[tokio::test]
async fn a_caller_cannot_aim_a_failing_request_at_a_node() {
    // the reviewer's attack: the same bad body, again and again, with one prompt_cache_key
    let (r, log, svc) = scripted_route(&[("a", Script::Status500), ("b", Script::Status500)]);
    for _ in 0..12 {
        let (req, _) = request(Some("victim"));
        let resp = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), 500);
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(log.0.lock().unwrap().len(), 24);
    for n in ["a", "b"] {
        assert_eq!(stats(&r, n), (0, 0, 0), "{n} was scored");
        let score = r.score(&NodeId::new(n)).unwrap();
        assert!(score.score > 0.99, "{n}: {score:?}");
    }
}

#[tokio::test]
async fn a_broken_node_is_scored_when_another_node_serves_the_request() {
    // the pick is weighted at random: over 20 requests the broken node is tried at least once
    // (the odds that it never is are about 2^-20)
    let (r, log, svc) = scripted_route(&[("broken", Script::Status500), ("good", Script::Ok)]);
    for _ in 0..20 {
        let (req, _) = request(None);
        let resp = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(
            resp.extensions().get::<NodeId>(),
            Some(&NodeId::new("good"))
        );
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"data: role\n\ndata: tok\n\ndata: end\n\n");
    }
    let tried = log
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|(n, _)| n.as_str() == "broken")
        .count() as u64;
    assert!(tried >= 1);
    assert_eq!(stats(&r, "broken"), (tried, tried, 0));
    assert_eq!(stats(&r, "good"), (20, 0, 0));
    assert!(penalty(&r, "broken") < 0.81, "{}", penalty(&r, "broken"));
}

#[tokio::test]
async fn a_lone_answer_type_failure_is_not_scored() {
    // one candidate: nothing to compare the 500 with (see `Route`'s docs)
    let (r, log, out, _) = run_one(&[("a", Script::Status500)], 2).await;
    assert_eq!(log.0.lock().unwrap().len(), 1);
    assert_eq!(&out.unwrap().1.unwrap()[..], b"Failed to parse tools");
    assert_eq!(stats(&r, "a"), (0, 0, 0));
    // a 500 and then another node's 400: the request is at fault, neither is scored
    let (r, _, out, _) = run_one(&[("a", Script::Status500), ("b", Script::Status400)], 2).await;
    assert_eq!(&out.unwrap().1.unwrap()[..], b"bad request");
    assert_eq!(stats(&r, "a"), (0, 0, 0));
    assert_eq!(stats(&r, "b"), (0, 0, 0));
    // a 500 and then a connect failure elsewhere: only the connect failure is scored
    let (r, log, _, _) = run_one(&[("a", Script::Status500), ("b", Script::ConnectError)], 2).await;
    assert_eq!(log.0.lock().unwrap().len(), 2);
    assert_eq!(stats(&r, "a"), (0, 0, 0));
    assert_eq!(stats(&r, "b"), (1, 1, 0));
}

/// A node's body after its head: one content event, then a frame every `every` (`more` of them)
/// and the end; `every: None`, nothing more, ever (a stalled engine on a live tunnel). Sets
/// `dropped` when dropped (the tunnel stream reset).
struct Stalling {
    first: Option<&'static str>,
    every: Option<std::time::Duration>,
    more: u32,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    dropped: Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Stalling {
    fn drop(&mut self) {
        self.dropped
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl http_body::Body for Stalling {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        use std::future::Future as _;
        let this = &mut *self;
        if let Some(first) = this.first.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(
                first.as_bytes(),
            )))));
        }
        let Some(every) = this.every else {
            return Poll::Pending;
        };
        if this.more == 0 {
            return Poll::Ready(None);
        }
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(every)));
        std::task::ready!(sleep.as_mut().poll(cx));
        this.more -= 1;
        sleep.as_mut().reset(tokio::time::Instant::now() + every);
        Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(
            b"data: tok\n\n",
        )))))
    }
}

/// Routes one streamed request to the lone node "s", which answers `status` with a
/// [`Stalling`] body; returns the registry, the response and the body's drop flag.
async fn stalling_node(
    config: RouteConfig,
    status: u16,
    every: Option<std::time::Duration>,
    more: u32,
) -> (
    NodeRegistry,
    http::Response<BoxBody>,
    Arc<std::sync::atomic::AtomicBool>,
) {
    let r = registry(&["s"]);
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = dropped.clone();
    let svc = RouteLayer::new(r.clone())
        .classify(Arc::new(Words))
        .config(config)
        .layer(tower::service_fn(move |_req: http::Request<BoxBody>| {
            let body = Stalling {
                first: Some("data: tok\n\n"),
                every,
                more,
                sleep: None,
                dropped: flag.clone(),
            };
            async move {
                Ok::<_, BoxError>(
                    http::Response::builder()
                        .status(status)
                        .header("content-type", "text/event-stream")
                        .body(BoxBody::new(body))
                        .unwrap(),
                )
            }
        }));
    let (req, _) = request(None);
    let resp = svc.oneshot(req).await.unwrap();
    (r, resp, dropped)
}

fn in_flight(r: &NodeRegistry) -> u32 {
    r.snapshot().iter().map(|s| s.in_flight).sum()
}

/// Waits for the body's next frame, failing the test (rather than hanging it) after an hour of
/// the paused clock.
async fn next_frame(body: &mut BoxBody) -> Option<Result<http_body::Frame<Bytes>, BoxError>> {
    tokio::time::timeout(std::time::Duration::from_secs(3600), body.frame())
        .await
        .expect("the body neither gave a frame nor ended within an hour")
}

#[tokio::test(start_paused = true)]
async fn a_stream_stalled_after_its_first_content_is_cut_and_scored_as_a_disconnect() {
    let timeout = std::time::Duration::from_secs(10);
    let config = RouteConfig {
        stream_idle_timeout: timeout,
        ..RouteConfig::default()
    };
    let (r, resp, dropped) = stalling_node(config, 200, None, 0).await;
    assert!(penalty(&r, "s") > 0.99);
    let mut body = resp.into_body();
    let first = next_frame(&mut body).await.unwrap().unwrap();
    assert_eq!(&first.into_data().unwrap()[..], b"data: tok\n\n");
    let started = tokio::time::Instant::now();
    let err = next_frame(&mut body).await.unwrap().unwrap_err();
    let waited = started.elapsed();
    assert_eq!(
        err.downcast_ref::<RouteError>(),
        Some(&RouteError::StreamIdleTimeout(timeout))
    );
    assert_eq!(
        err.to_string(),
        "node sent nothing for 10 s after the response began"
    );
    assert!(
        waited >= timeout && waited < timeout + std::time::Duration::from_secs(1),
        "{waited:?}"
    );
    // while the caller still holds the body: scored as a mid-request disconnect, the slot
    // freed, the node's body dropped (the tunnel stream reset)
    assert_eq!(stats(&r, "s"), (1, 1, 1));
    assert!(penalty(&r, "s") < 0.51, "{}", penalty(&r, "s"));
    assert_eq!(in_flight(&r), 0);
    assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
    // the body ends there; nothing is recorded twice
    assert!(next_frame(&mut body).await.is_none());
    drop(body);
    assert_eq!(stats(&r, "s"), (1, 1, 1));
}

#[tokio::test(start_paused = true)]
async fn a_slow_but_steady_stream_is_not_cut() {
    // a frame every timeout/2 for 5× the timeout
    let timeout = std::time::Duration::from_secs(10);
    let config = RouteConfig {
        stream_idle_timeout: timeout,
        ..RouteConfig::default()
    };
    let (r, resp, _) = stalling_node(config, 200, Some(timeout / 2), 10).await;
    let started = tokio::time::Instant::now();
    let mut body = resp.into_body();
    let mut frames = 0;
    while let Some(frame) = next_frame(&mut body).await {
        frame.unwrap();
        frames += 1;
    }
    assert_eq!(frames, 11);
    assert!(started.elapsed() >= timeout * 5, "{:?}", started.elapsed());
    assert_eq!(stats(&r, "s"), (1, 0, 0));
    assert!(penalty(&r, "s") > 0.99);
    assert_eq!(in_flight(&r), 0);
}

#[tokio::test(start_paused = true)]
async fn zero_disables_the_idle_timeout_and_the_default_is_120_s() {
    let config = RouteConfig {
        stream_idle_timeout: std::time::Duration::ZERO,
        ..RouteConfig::default()
    };
    let (r, resp, dropped) = stalling_node(config, 200, None, 0).await;
    let mut body = resp.into_body();
    next_frame(&mut body).await.unwrap().unwrap();
    // a day of silence: still pending, still holding the slot
    let day = std::time::Duration::from_secs(24 * 3600);
    assert!(tokio::time::timeout(day, body.frame()).await.is_err());
    assert_eq!(in_flight(&r), 1);
    assert_eq!(stats(&r, "s"), (0, 0, 0));
    assert!(!dropped.load(std::sync::atomic::Ordering::SeqCst));
    drop(body);
    assert_eq!(in_flight(&r), 0);

    let (r, resp, _) = stalling_node(RouteConfig::default(), 200, None, 0).await;
    let mut body = resp.into_body();
    next_frame(&mut body).await.unwrap().unwrap();
    let started = tokio::time::Instant::now();
    let err = next_frame(&mut body).await.unwrap().unwrap_err();
    assert_eq!(
        err.downcast_ref::<RouteError>(),
        Some(&RouteError::StreamIdleTimeout(
            std::time::Duration::from_secs(120)
        ))
    );
    let waited = started.elapsed();
    assert!(
        waited >= std::time::Duration::from_secs(120)
            && waited < std::time::Duration::from_secs(121),
        "{waited:?}"
    );
    assert_eq!(stats(&r, "s"), (1, 1, 1));
}

#[tokio::test(start_paused = true)]
async fn a_stalled_error_answer_is_cut_too_but_not_scored() {
    // a lone node's 500 goes to the caller as it came (an answer-type failure, not scored);
    // its body stalls after the first bytes
    let timeout = std::time::Duration::from_secs(10);
    let config = RouteConfig {
        stream_idle_timeout: timeout,
        max_retries: 0,
        ..RouteConfig::default()
    };
    let (r, resp, dropped) = stalling_node(config, 500, None, 0).await;
    assert_eq!(resp.status(), 500);
    let mut body = resp.into_body();
    next_frame(&mut body).await.unwrap().unwrap();
    let err = next_frame(&mut body).await.unwrap().unwrap_err();
    assert_eq!(
        err.downcast_ref::<RouteError>(),
        Some(&RouteError::StreamIdleTimeout(timeout))
    );
    assert_eq!(in_flight(&r), 0);
    assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(stats(&r, "s"), (0, 0, 0));
    assert!(next_frame(&mut body).await.is_none());
}

/// `stream_idle_timeout_secs` is a u64 from the config file or env; a huge value (meant as
/// "never") must not panic the body poll (`Instant + Duration` overflowed here before).
#[tokio::test]
async fn a_huge_stream_idle_timeout_does_not_panic() {
    let config = RouteConfig {
        stream_idle_timeout: std::time::Duration::from_secs(u64::MAX),
        ..RouteConfig::default()
    };
    let (_r, resp, _) = stalling_node(config, 200, None, 0).await;
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    let polled = tokio::spawn(async move {
        tokio::time::timeout(std::time::Duration::from_millis(50), body.frame())
            .await
            .is_err()
    })
    .await;
    assert!(matches!(polled, Ok(true)), "body poll panicked: {polled:?}");
}

/// A retry that waits in the queue does not keep the failed node's slot: the failed answer is
/// read (bounded) and its lease released first. Two nodes of one slot: "good" busy, "bad" free
/// and answering 503; the request fails on "bad", waits for "good", and meanwhile "bad" has
/// nothing in flight; once "good" frees, the request is served there.
#[tokio::test]
async fn a_retry_waiting_in_the_queue_holds_no_slot_of_the_failed_node() {
    let one_slot = |name: &str| (NodeId::new(name), spine_test_support::node_serving("m", 1));
    let r = NodeRegistry::new();
    let (good, d) = one_slot("good");
    r.node_ready(&good, &d);
    let busy = r.pick(&ModelId::new("m")).unwrap();
    assert_eq!(busy.node().as_str(), "good");
    let (bad, d) = one_slot("bad");
    r.node_ready(&bad, &d);
    let log = Log::default();
    let svc = RouteLayer::new(r.clone())
        .classify(Arc::new(Words))
        .layer(upstream(
            [("good", Script::Ok), ("bad", Script::Status503)]
                .into_iter()
                .collect(),
            log.clone(),
        ));
    let (req, _slot) = request(None);
    let call = tokio::spawn(svc.oneshot(req));
    // the request has failed on "bad" and waits for "good"
    let in_flight_of = |n: &str| {
        r.snapshot()
            .into_iter()
            .find(|s| s.node_id.as_str() == n)
            .map_or(0, |s| s.in_flight)
    };
    for _ in 0..500 {
        if log.0.lock().unwrap().len() == 1 && r.queue_snapshot().iter().any(|q| q.depth == 1) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(log.0.lock().unwrap().len(), 1, "tried on bad");
    assert!(
        r.queue_snapshot().iter().any(|q| q.depth == 1),
        "waiting for good"
    );
    assert_eq!(
        in_flight_of("bad"),
        0,
        "the failed node's slot is free while the retry waits"
    );
    drop(busy);
    let resp = tokio::time::timeout(std::time::Duration::from_secs(60), call)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(resp.extensions().get::<NodeId>().unwrap().as_str(), "good");
    resp.into_body().collect().await.unwrap();
    assert_eq!(in_flight(&r), 0);
}

#[tokio::test]
async fn avoided_nodes_are_never_picked_and_a_request_avoiding_all_fails() {
    let (_r, log, svc) = scripted_route(&[("a", Script::Ok), ("b", Script::Ok), ("c", Script::Ok)]);
    for _ in 0..20 {
        let (mut req, _) = request(None);
        req.extensions_mut()
            .insert(AvoidNodes(vec![NodeId::new("a"), NodeId::new("c")]));
        let resp = svc.clone().oneshot(req).await.unwrap();
        resp.into_body().collect().await.unwrap();
    }
    assert!(
        log.0.lock().unwrap().iter().all(|(n, _)| n.as_str() == "b"),
        "{:?}",
        log.0.lock().unwrap()
    );
    let (mut req, _) = request(None);
    req.extensions_mut().insert(AvoidNodes(
        ["a", "b", "c"].into_iter().map(NodeId::new).collect(),
    ));
    assert!(svc.clone().oneshot(req).await.is_err());
}

#[tokio::test]
async fn the_slot_carries_the_routed_nodes_context_for_the_model() {
    // the metering layer caps each choice's completion by the node's own context
    for context in [Some(2048u64), None] {
        let r = NodeRegistry::new();
        let mut node = spine_test_support::node_serving("m", 4);
        node.models[0].max_context_tokens = context;
        r.node_ready(&NodeId::new("good"), &node);
        let svc = RouteLayer::new(r).classify(Arc::new(Words)).layer(upstream(
            [("good", Script::Ok)].into_iter().collect(),
            Log::default(),
        ));
        let (req, slot) = request_streamed(None, true);
        let resp = svc.oneshot(req).await.unwrap();
        drop(resp.into_body().collect().await);
        assert_eq!(slot.get(), Some(NodeId::new("good")));
        assert_eq!(slot.context_tokens(), context);
    }
}

/// Each node's slots: a semaphore of `k` permits per `(node, k)`.
fn node_slots(
    slots: &[(&'static str, usize)],
) -> Arc<HashMap<&'static str, Arc<tokio::sync::Semaphore>>> {
    Arc::new(
        slots
            .iter()
            .map(|(n, k)| (*n, Arc::new(tokio::sync::Semaphore::new(*k))))
            .collect(),
    )
}

/// A registry of `config` where a node `liar` claims 256 slots beside `honest` claiming 4, and
/// a route over `upstream` with a 10 s first-content deadline (and the default 2 retries).
fn liar_beside_honest<U: UpstreamService>(
    config: spine_router::RegistryConfig,
    upstream: U,
) -> (NodeRegistry, spine_router::Route<U>) {
    let r = NodeRegistry::with_config(config);
    r.node_ready(
        &NodeId::new("liar"),
        &spine_test_support::node_serving("m", 256),
    );
    r.node_ready(
        &NodeId::new("honest"),
        &spine_test_support::node_serving("m", 4),
    );
    let svc = RouteLayer::new(r.clone())
        .classify(Arc::new(Words))
        .config(RouteConfig {
            first_content_timeout: std::time::Duration::from_secs(10),
            ..RouteConfig::default()
        })
        .layer(upstream);
    (r, svc)
}

/// Nodes that each serve `slots` requests at once, one second each (more wait in the node's
/// own queue, as an engine with fewer slots than it claims does), whatever they claim.
fn queueing_upstream(slots: &[(&'static str, usize)]) -> impl UpstreamService {
    let slots = node_slots(slots);
    tower::service_fn(move |req: http::Request<BoxBody>| {
        let slots = slots.clone();
        async move {
            let node = req.extensions().get::<NodeId>().cloned().unwrap();
            let _permit = slots[node.as_str()].clone().acquire_owned().await?;
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            Ok::<_, BoxError>(sse(vec![Ok("data: tok\n\n"), Ok("data: end\n\n")]))
        }
    })
}

/// A node claims 256 slots and serves one request at a time, beside an honest node of 4. The
/// first burst of 20 streamed requests finds the lie out: requests queued at the liar past the
/// first-content deadline are retried elsewhere. Thirty bursts later, each half an hour after
/// the last (its score has had time to recover), are held to the liar's learned limit
/// (`registry::limit`), whose growth starts again at each first token later than half the
/// deadline: no request waits for the deadline again, and every one is answered (without that
/// rule the limit grew back to 11 and timed out at bursts 12 and 26).
#[tokio::test(start_paused = true)]
async fn a_node_that_lies_about_its_concurrency_delays_one_burst_not_the_next() {
    let (r, svc) = liar_beside_honest(
        spine_router::RegistryConfig {
            limit_growth_max_ttft: std::time::Duration::from_secs(5),
            ..spine_router::RegistryConfig::default()
        },
        queueing_upstream(&[("liar", 1), ("honest", 4)]),
    );
    let liar = NodeId::new("liar");
    let burst = || {
        futures_util::future::join_all((0..20).map(|_| {
            let svc = svc.clone();
            async move {
                let resp = svc.oneshot(request_streamed(None, true).0).await?;
                resp.into_body().collect().await?;
                Ok::<_, BoxError>(())
            }
        }))
    };
    let failures = |r: &NodeRegistry| stats(r, "liar").1;
    for answered in burst().await {
        answered.unwrap();
    }
    let first = failures(&r);
    assert!(first > 0, "the first burst waited on the liar's queue");
    let limit = r.concurrency_limit(&liar).unwrap();
    assert!(limit < 10, "learned {limit}");
    let before = stats(&r, "liar").0;
    for _ in 0..30 {
        tokio::time::advance(std::time::Duration::from_secs(30 * 60)).await;
        for answered in burst().await {
            answered.unwrap();
        }
    }
    println!(
        "first burst: {first} timed out at the liar, learned limit {limit}; 30 bursts later: \
         {} attempts at the liar, {} timed out, limit {:?}",
        stats(&r, "liar").0 - before,
        failures(&r) - first,
        r.concurrency_limit(&liar)
    );
    assert!(
        stats(&r, "liar").0 > before,
        "the liar still serves what it can"
    );
    assert_eq!(failures(&r), first, "no request of a later burst timed out");
}

/// Nodes whose every stream sends its first token at once, then waits for one of the node's
/// `slots` (one second each) before the rest: never late for the first-content deadline.
fn early_token_upstream(slots: &[(&'static str, usize)]) -> impl UpstreamService {
    let slots = node_slots(slots);
    tower::service_fn(move |req: http::Request<BoxBody>| {
        let node = req.extensions().get::<NodeId>().cloned().unwrap();
        let slots = slots[node.as_str()].clone();
        async move {
            use futures_util::StreamExt;
            let first = futures_util::stream::once(async {
                Ok::<_, BoxError>(http_body::Frame::data(Bytes::from_static(b"data: tok\n\n")))
            });
            let rest = futures_util::stream::once(async move {
                let _permit = slots.acquire_owned().await?;
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                Ok::<_, BoxError>(http_body::Frame::data(Bytes::from_static(b"data: end\n\n")))
            });
            let body = http_body_util::StreamBody::new(first.chain(rest));
            Ok::<_, BoxError>(
                http::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(BoxBody::new(body))
                    .unwrap(),
            )
        }
    })
}

/// A node that claims 256 slots, sends every request's first token at once and then serves
/// them one at a time, beside an honest node of 4: never late, but its streams pause while
/// they wait. The metering layer reports a stream's longest pause (here: the time from its
/// head to its end, which is what it measures on this stream) and a pause longer than
/// `overload_pause` lowers the node's learned limit, so the next burst waits far less.
#[tokio::test(start_paused = true)]
async fn a_node_that_sends_first_tokens_at_once_and_queues_is_held_to_what_it_serves() {
    let (r, svc) = liar_beside_honest(
        spine_router::RegistryConfig {
            overload_pause: std::time::Duration::from_secs(10),
            ..spine_router::RegistryConfig::default()
        },
        early_token_upstream(&[("liar", 1), ("honest", 4)]),
    );
    let liar = NodeId::new("liar");
    let burst = || {
        futures_util::future::join_all((0..16).map(|_| {
            let svc = svc.clone();
            async move {
                let (req, slot) = request_streamed(None, true);
                let started = tokio::time::Instant::now();
                let resp = svc.oneshot(req).await?;
                resp.into_body().collect().await?;
                slot.report_pause(started.elapsed());
                Ok::<_, BoxError>(started.elapsed())
            }
        }))
    };
    let slowest = |answers: Vec<Result<std::time::Duration, BoxError>>| {
        answers.into_iter().map(Result::unwrap).max().unwrap()
    };
    let first = slowest(burst().await);
    let limit = r.concurrency_limit(&liar).unwrap();
    tokio::time::advance(std::time::Duration::from_secs(60)).await;
    let second = slowest(burst().await);
    println!(
        "slowest answer: first burst {first:?}, learned limit {limit}; second burst {second:?}, \
         limit {:?}",
        r.concurrency_limit(&liar)
    );
    assert!(limit < 16, "learned {limit}");
    assert!(second * 2 < first, "{second:?} against {first:?}");
}
