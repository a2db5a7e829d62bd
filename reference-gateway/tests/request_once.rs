//! One request through the gateway's stack, composed as `main.rs` composes it
//! (`Meter<ReadAhead<Route<node>>>`), with the edge's `RequestContext` (issue 20): the caller's
//! body is collected once, by the metering layer, which parses it and hands the bytes and the
//! peek down as a `BufferedRequest`; the router sends exactly those bytes and never polls the
//! body it is handed. No network and no model file: a node stand-in and a counter of our own.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use spine_core::{
    AccountId, BoxBody, BoxError, BufferedRequest, ModelId, OperatorId, RequestContext, RequestId,
    RequestKind, StreamOutcome, Usage,
};
use spine_meter::meter::{Catalog, CatalogEntry, MeterLayer};
use spine_meter::{Ledger, Price, SqliteLedger, TokenCounter, TokenizerError};
use spine_router::{NodeRegistry, ReadAheadLayer, RouteLayer};
use spine_test_support::full;
use tower::{Layer, ServiceExt};

/// `inner`, counting the frames polled out of it and the data bytes they carried (its length
/// and end are `inner`'s).
fn counting(inner: BoxBody, frames: Arc<AtomicUsize>, data_bytes: Arc<AtomicUsize>) -> BoxBody {
    BoxBody::new(inner.map_frame(move |frame| {
        frames.fetch_add(1, Ordering::SeqCst);
        if let Some(data) = frame.data_ref() {
            data_bytes.fetch_add(data.len(), Ordering::SeqCst);
        }
        frame
    }))
}

/// One token per word; a chat prompt is its messages' words plus 2 per message.
#[derive(Debug)]
struct Words;

impl TokenCounter for Words {
    fn count_prompt(&self, body: &Value) -> Result<u64, TokenizerError> {
        let messages = body["messages"]
            .as_array()
            .ok_or(TokenizerError::NoPrompt)?;
        Ok(messages
            .iter()
            .map(|m| 2 + self.count_text(m["content"].as_str().unwrap_or("")))
            .sum())
    }
    fn count_text(&self, text: &str) -> u64 {
        text.split_whitespace().count() as u64
    }
    fn max_token_bytes(&self) -> u64 {
        64
    }
}

fn chunk(content: &str, finish_reason: Option<&str>) -> String {
    let c = json!({"id":"c","object":"chat.completion.chunk","created":1,"model":"m",
        "choices":[{"index":0,"delta":{"content":content},"finish_reason":finish_reason}]});
    format!("data: {c}\n\n")
}

#[tokio::test]
async fn the_body_is_collected_once_and_the_router_sends_the_meters_buffer() {
    let ledger = Arc::new(SqliteLedger::in_memory().await.unwrap());
    let account = AccountId::from("acct");
    ledger.create_account(&account).await.unwrap();
    ledger.add_credits(&account, 1_000_000, "k").await.unwrap();
    let operator = OperatorId::from("op");
    ledger.create_operator(&operator).await.unwrap();
    let node = ledger.register_node(&operator, "pk").await.unwrap();
    let registry = NodeRegistry::new();
    registry.node_ready(&node, &spine_test_support::node_serving("m", 4));
    let mut catalog = Catalog::new();
    catalog.insert(
        ModelId::new("m"),
        CatalogEntry {
            tokenizer: Arc::new(Words),
            price: Price {
                input_micros_per_mtok: 1_000_000,
                output_micros_per_mtok: 2_000_000,
            },
            max_context_tokens: 1_000,
        },
    );

    // the node stand-in: keeps what it was sent, answers a short stream
    let sent_to_node: Arc<Mutex<Vec<Bytes>>> = Arc::default();
    let node_svc = {
        let sent_to_node = sent_to_node.clone();
        tower::service_fn(move |req: http::Request<BoxBody>| {
            let sent_to_node = sent_to_node.clone();
            async move {
                let body = req.into_body().collect().await?.to_bytes();
                sent_to_node.lock().unwrap().push(body);
                let sse = format!(
                    "{}{}data: [DONE]\n\n",
                    chunk("Red and blue", None),
                    chunk("", Some("stop"))
                );
                let resp = http::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(full(sse))
                    .unwrap();
                Ok::<_, BoxError>(resp)
            }
        })
    };

    // between the meter and the router: what the meter hands down, and how much of the
    // request body anything below the meter reads
    let handed_down: Arc<Mutex<Option<BufferedRequest>>> = Arc::default();
    let below_frames = Arc::new(AtomicUsize::new(0));
    let probe = {
        let handed_down = handed_down.clone();
        let below_frames = below_frames.clone();
        tower::util::MapRequestLayer::new(move |req: http::Request<BoxBody>| {
            *handed_down.lock().unwrap() = req.extensions().get::<BufferedRequest>().cloned();
            let frames = below_frames.clone();
            req.map(|body| counting(body, frames, Arc::new(AtomicUsize::new(0))))
        })
    };
    let meter = MeterLayer::new(ledger.clone(), catalog);
    let settlements = meter.settlements();
    let route = RouteLayer::new(registry.clone())
        .classify(Arc::new(spine_meter::classify::SseClassify))
        .layer(node_svc);
    let stack = meter.layer(probe.layer(ReadAheadLayer::new(64 * 1024).layer(route)));

    // the edge: a typed context only (no separate RequestId / AccountId extensions, no
    // meaningful path), and a caller body that counts what is read from it
    let caller_body = json!({"model":"m","stream":true,"max_tokens":8,
        "messages":[{"role":"user","content":"name two colors"}]})
    .to_string();
    let caller_frames = Arc::new(AtomicUsize::new(0));
    let caller_bytes = Arc::new(AtomicUsize::new(0));
    let mut req = http::Request::post("/")
        .body(counting(
            full(caller_body.clone()),
            caller_frames.clone(),
            caller_bytes.clone(),
        ))
        .unwrap();
    let request_id = RequestId::from("req_once");
    req.extensions_mut().insert(
        RequestContext::new(
            request_id.clone(),
            account.clone(),
            RequestKind::ChatCompletions,
        )
        .with_key("keyhash")
        .with_session("s1"),
    );

    let resp = stack.oneshot(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let answer = resp.into_body().collect().await.unwrap().to_bytes();
    settlements.drain().await;

    // collected once: the caller's one frame, read by the meter
    assert_eq!(caller_frames.load(Ordering::SeqCst), 1);
    assert_eq!(caller_bytes.load(Ordering::SeqCst), caller_body.len());
    // parsed once, above the router: it received the meter's bytes and peek, and sent exactly
    // those bytes (the caller's, with include_usage set) without polling its request body
    let buffered = handed_down.lock().unwrap().clone().unwrap();
    let mut expected: Value = serde_json::from_str(&caller_body).unwrap();
    expected["stream_options"] = json!({"include_usage": true});
    assert_eq!(
        serde_json::from_slice::<Value>(&buffered.body).unwrap(),
        expected
    );
    assert_eq!(buffered.peek.model, ModelId::new("m"));
    assert!(buffered.peek.stream);
    assert_eq!(buffered.peek.max_tokens, Some(8));
    // 3 words + 2 for the one message
    assert_eq!(buffered.prompt_tokens, 5);
    assert_eq!(*sent_to_node.lock().unwrap(), vec![buffered.body.clone()]);
    assert_eq!(below_frames.load(Ordering::SeqCst), 0);

    // and the request was metered as before: the caller got the text, the ledger the bill
    let answer = String::from_utf8(answer.to_vec()).unwrap();
    assert!(answer.contains("Red and blue"), "{answer}");
    let record = ledger.request_record(request_id).await.unwrap().unwrap();
    assert_eq!(record.outcome, StreamOutcome::Completed);
    assert_eq!(record.node, Some(node));
    assert_eq!(
        record.billed,
        Usage {
            prompt_tokens: 5,
            completion_tokens: 4,
        }
    );
}
