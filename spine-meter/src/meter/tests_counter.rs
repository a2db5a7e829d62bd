//! The metering layer with a counter of the application's own: these tests need no optional
//! feature (`cargo test -p spine-meter --no-default-features --lib`), no model file and no SQL
//! store — what a user of `MeterLayer` alone compiles.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use spine_core::{AccountId, BoxBody, BoxError, ModelId, NodeId, RequestId, StreamOutcome, Usage};
use spine_test_support::full;
use tower::{Layer, ServiceExt};

use super::*;
use crate::ledger::{LedgerFuture, RequestRecord, SettleResult, Settlement};
use crate::test_support::{chat_request, node_response};
use crate::{Ledger, Price, TokenCounter, TokenizerError};

/// One token per whitespace-separated word; a chat prompt is the words of its messages'
/// `content` strings plus 2 per message (a stand-in for a template's role markers).
#[derive(Debug)]
struct WordCounter;

impl TokenCounter for WordCounter {
    fn count_prompt(&self, body: &Value) -> Result<u64, TokenizerError> {
        let messages = body
            .get("messages")
            .and_then(Value::as_array)
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

/// A ledger that holds anything and keeps each settlement it is given.
#[derive(Debug, Default)]
struct Recording {
    holds: Mutex<Vec<u64>>,
    settled: Mutex<Vec<Settlement>>,
}

impl Ledger for Recording {
    fn hold(
        &self,
        _request_id: RequestId,
        _account: AccountId,
        _model: ModelId,
        amount_micros: u64,
    ) -> LedgerFuture<'_, ()> {
        self.holds.lock().unwrap().push(amount_micros);
        Box::pin(async { Ok(()) })
    }
    fn release(&self, _request_id: RequestId) -> LedgerFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
    fn settle(&self, settlement: Settlement) -> LedgerFuture<'_, SettleResult> {
        self.settled.lock().unwrap().push(settlement);
        Box::pin(async {
            Ok(SettleResult {
                cost_micros: 0,
                debit_micros: 0,
                operator_credit_micros: 0,
                fee_micros: 0,
                hold_micros: 0,
                already_settled: false,
            })
        })
    }
    fn request_record(&self, _request_id: RequestId) -> LedgerFuture<'_, Option<RequestRecord>> {
        Box::pin(async { Ok(None) })
    }
}

const PRICE: Price = Price {
    input_micros_per_mtok: 1_000_000,
    output_micros_per_mtok: 2_000_000,
};

fn sse(chunks: &[Value]) -> Bytes {
    let mut out = String::new();
    for c in chunks {
        out.push_str(&format!("data: {c}\n\n"));
    }
    out.push_str("data: [DONE]\n\n");
    Bytes::from(out)
}

fn delta(content: &str, finish_reason: Option<&str>) -> Value {
    json!({"id":"c","object":"chat.completion.chunk","created":1,"model":"m",
        "choices":[{"index":0,"delta":{"content":content},"finish_reason":finish_reason}]})
}

#[tokio::test]
async fn meters_a_stream_with_the_applications_own_counter() {
    let ledger = Arc::new(Recording::default());
    let mut catalog = Catalog::new();
    catalog.insert(
        ModelId::from("m"),
        CatalogEntry {
            tokenizer: Arc::new(WordCounter),
            price: PRICE,
            max_context_tokens: 100,
        },
    );
    let usage = json!({"id":"c","object":"chat.completion.chunk","created":1,"model":"m",
        "choices":[],"usage":{"prompt_tokens":5,"completion_tokens":5,"total_tokens":10}});
    let node_body = sse(&[
        delta("Red green", None),
        delta(" and blue", None),
        delta("", Some("stop")),
        usage,
    ]);
    let node = tower::service_fn(move |_req: http::Request<BoxBody>| {
        let body = node_body.clone();
        async move {
            Ok::<_, BoxError>(node_response(
                NodeId::from("node-1"),
                "text/event-stream",
                full(body),
            ))
        }
    });
    let layer = MeterLayer::new(ledger.clone(), catalog);
    let settlements = layer.settlements();
    let body = json!({"model":"m","stream":true,"max_tokens":10,
        "stream_options":{"include_usage":true},
        "messages":[{"role":"user","content":"name three colors"}]});
    let req = chat_request(
        "req-1",
        AccountId::from("acct"),
        Bytes::from(body.to_string()),
    );

    let resp = layer.layer(node).oneshot(req).await.unwrap();
    let text = resp.into_body().collect().await.unwrap().to_bytes();
    settlements.drain().await;

    // prompt: 3 words + 2 for the one message; completion: 4 words + the EOS of `stop`
    let billed = Usage {
        prompt_tokens: 5,
        completion_tokens: 5,
    };
    // the hold: 5 prompt + 10 completion tokens at 1 and 2 micros each
    assert_eq!(*ledger.holds.lock().unwrap(), vec![25]);
    let settled = ledger.settled.lock().unwrap();
    assert_eq!(settled.len(), 1);
    assert_eq!(settled[0].outcome, StreamOutcome::Completed);
    assert_eq!(settled[0].billed, billed);
    assert_eq!(settled[0].claimed, Some(billed));
    assert!(!settled[0].discrepancy);
    assert_eq!(settled[0].node, Some(NodeId::from("node-1")));
    // the caller's usage chunk carries the billed counts
    let text = String::from_utf8(text.to_vec()).unwrap();
    assert!(
        text.contains(r#""usage":{"prompt_tokens":5,"completion_tokens":5,"total_tokens":10}"#),
        "{text}"
    );
}
