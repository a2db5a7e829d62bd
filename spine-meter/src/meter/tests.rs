#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use crate::Ledger;
use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use spine_core::{
    AccountId, BoxBody, BoxError, ModelId, NodeId, OperatorId, RequestId, StreamOutcome, Usage,
};
use tokio::sync::mpsc;
use tower::{Layer, Service, ServiceExt};

use super::*;
use crate::ledger::{SettleResult, Settlement};
use crate::test_support::{capture_body, hostile_cases, smollm_tokenizer};
use crate::{Price, SqliteLedger};

const PRICE: Price = Price {
    input_micros_per_mtok: 1_000_000,
    output_micros_per_mtok: 2_000_000,
};

/// A node body replaying reads; then ends, fails, or hangs forever.
#[derive(Debug)]
struct Replay {
    reads: VecDeque<Bytes>,
    end: End,
}

#[derive(Debug, Clone, Copy)]
enum End {
    Eof,
    Error,
    Hang,
}

impl Body for Replay {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(b) = self.reads.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        match self.end {
            End::Eof => Poll::Ready(None),
            End::Error => Poll::Ready(Some(Err("node connection reset".into()))),
            End::Hang => Poll::Pending,
        }
    }
}

/// Splits `bytes` into reads of `size` bytes.
fn reads_of(bytes: &[u8], size: usize) -> Vec<Bytes> {
    bytes.chunks(size).map(Bytes::copy_from_slice).collect()
}

struct Events(
    mpsc::UnboundedSender<(Settlement, SettleResult)>,
    Mutex<Vec<DiscrepancyReport>>,
);

impl MeterEvents for Events {
    fn on_settled(&self, s: &Settlement, r: &SettleResult) {
        let _ = self.0.send((s.clone(), *r));
    }
    fn on_discrepancy(&self, report: &DiscrepancyReport) {
        self.1.lock().unwrap().push(report.clone());
    }
}

struct Harness {
    ledger: Arc<SqliteLedger>,
    account: AccountId,
    operator: OperatorId,
    node: NodeId,
    settled: mpsc::UnboundedReceiver<(Settlement, SettleResult)>,
    events: Arc<Events>,
    upstream: Arc<Mutex<Option<Bytes>>>,
}

const START_MICROS: u64 = 100_000;

async fn harness() -> Harness {
    let ledger = Arc::new(SqliteLedger::in_memory().await.unwrap());
    let account = AccountId::from("acct");
    ledger.create_account(&account).await.unwrap();
    ledger
        .add_credits(&account, START_MICROS, "k")
        .await
        .unwrap();
    let operator = OperatorId::from("op");
    ledger.create_operator(&operator).await.unwrap();
    let node = ledger.register_node(&operator, "pk").await.unwrap();
    let (tx, settled) = mpsc::unbounded_channel();
    Harness {
        ledger,
        account,
        operator,
        node,
        settled,
        events: Arc::new(Events(tx, Mutex::new(Vec::new()))),
        upstream: Arc::new(Mutex::new(None)),
    }
}

impl Harness {
    fn service(
        &self,
        status: u16,
        content_type: &'static str,
        reads: Vec<Bytes>,
        end: End,
    ) -> impl Service<http::Request<BoxBody>, Response = http::Response<BoxBody>, Error = BoxError>
    {
        let mut catalog = Catalog::new();
        catalog.insert(
            ModelId::from("smollm2"),
            CatalogEntry {
                tokenizer: smollm_tokenizer(),
                price: PRICE,
                max_context_tokens: 2048,
            },
        );
        let node = self.node.clone();
        let upstream = self.upstream.clone();
        let inner = tower::service_fn(move |req: http::Request<BoxBody>| {
            let node = node.clone();
            let upstream = upstream.clone();
            let reads = reads.clone();
            async move {
                assert!(req.extensions().get::<spine_core::RequestPeek>().is_some());
                let body = req.into_body().collect().await?.to_bytes();
                *upstream.lock().unwrap() = Some(body);
                let mut resp = http::Response::new(BoxBody::new(Replay {
                    reads: reads.into(),
                    end,
                }));
                *resp.status_mut() = http::StatusCode::from_u16(status).unwrap();
                resp.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static(content_type),
                );
                resp.extensions_mut().insert(node);
                Ok::<_, BoxError>(resp)
            }
        });
        MeterLayer::new(self.ledger.clone(), catalog)
            .operator_share_bps(7_000)
            .events(self.events.clone())
            .layer(inner)
    }

    async fn settled(&mut self) -> (Settlement, SettleResult) {
        tokio::time::timeout(std::time::Duration::from_secs(10), self.settled.recv())
            .await
            .unwrap()
            .unwrap()
    }
}

fn request(id: &str, body: &Value) -> http::Request<BoxBody> {
    let bytes = Bytes::from(serde_json::to_vec(body).unwrap());
    let mut req = http::Request::post("/v1/chat/completions")
        .body(BoxBody::new(
            http_body_util::Full::new(bytes).map_err(|never| match never {}),
        ))
        .unwrap();
    req.extensions_mut().insert(RequestId::from(id));
    req.extensions_mut().insert(AccountId::from("acct"));
    req
}

async fn frames(body: BoxBody) -> Vec<Bytes> {
    let mut body = body;
    let mut out = Vec::new();
    while let Some(f) = body.frame().await {
        if let Ok(d) = f.unwrap().into_data() {
            out.push(d);
        }
    }
    out
}

fn chat(stream: bool, include_usage: Option<bool>) -> Value {
    let mut v = json!({"model":"smollm2","max_tokens":64,"messages":[{"role":"user","content":"Name three colors."}]});
    if stream {
        v["stream"] = json!(true);
    }
    if let Some(u) = include_usage {
        v["stream_options"] = json!({"include_usage": u});
    }
    v
}

/// The capture's events, as raw SSE event strings.
fn capture_events(name: &str) -> Vec<String> {
    let body = String::from_utf8(capture_body(name)).unwrap();
    body.split_inclusive("\n\n").map(str::to_owned).collect()
}

fn cost(u: Usage) -> u64 {
    PRICE.cost_micros(&u)
}

#[tokio::test]
async fn streamed_capture_without_usage_request_is_forwarded_byte_exact_minus_usage() {
    let mut h = harness().await;
    let events = capture_events("b_chat_stream_usage.txt");
    let body = capture_body("b_chat_stream_usage.txt");
    for read in [1usize, 7, 64, 4096] {
        let id = format!("r{read}");
        let svc = h.service(200, "text/event-stream", reads_of(&body, read), End::Eof);
        let resp = svc.oneshot(request(&id, &chat(true, None))).await.unwrap();
        let got = frames(resp.into_body()).await;
        // one frame per event; the usage-only chunk withheld; everything else byte-exact
        let mut want: Vec<String> = events.clone();
        want.retain(|e| !e.contains("\"usage\""));
        let got: Vec<String> = got
            .iter()
            .map(|b| String::from_utf8(b.to_vec()).unwrap())
            .collect();
        assert_eq!(got, want, "read size {read}");
        // upstream asked for usage
        let up: Value =
            serde_json::from_slice(h.upstream.lock().unwrap().as_ref().unwrap()).unwrap();
        assert_eq!(up["stream_options"], json!({"include_usage": true}));

        let (s, r) = h.settled().await;
        let prompt = smollm_tokenizer().count_prompt(&chat(true, None)).unwrap();
        assert_eq!(prompt, 34);
        // "1. Red\n2. Blue\n3. Green" + EOS (finish_reason stop) = 12, as the node claimed
        let billed = Usage {
            prompt_tokens: 34,
            completion_tokens: 12,
        };
        assert_eq!(s.outcome, StreamOutcome::Completed);
        assert_eq!(s.billed, billed);
        assert_eq!(
            s.claimed,
            Some(Usage {
                prompt_tokens: 34,
                completion_tokens: 12
            })
        );
        assert!(!s.discrepancy, "the claim matches the count");
        assert_eq!(s.node, Some(h.node.clone()));
        // 34 * 1 + 12 * 2 = 58 micros; operator 70% floor = 40; fee 18
        assert_eq!(
            (
                r.cost_micros,
                r.debit_micros,
                r.operator_credit_micros,
                r.fee_micros
            ),
            (58, 58, 40, 18)
        );
        assert_eq!(
            r.hold_micros,
            cost(Usage {
                prompt_tokens: 34,
                completion_tokens: 64
            })
        );
    }
    let b = h.ledger.account(&h.account).await.unwrap();
    assert_eq!(
        (b.balance_micros, b.held_micros),
        (START_MICROS - 4 * 58, 0)
    );
    assert_eq!(
        h.ledger.operator_earned_micros(&h.operator).await.unwrap(),
        4 * 40
    );
    assert_eq!(h.ledger.entries_sum_micros().await.unwrap(), 0);
    let rec = h
        .ledger
        .request_record(RequestId::from("r7"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (rec.outcome, rec.billed, rec.debit_micros, rec.fee_micros),
        (
            StreamOutcome::Completed,
            Usage {
                prompt_tokens: 34,
                completion_tokens: 12
            },
            58,
            18
        )
    );
    assert!(h.events.1.lock().unwrap().is_empty());
}

#[tokio::test]
async fn streamed_capture_with_usage_request_gets_one_billed_usage_chunk() {
    let mut h = harness().await;
    let events = capture_events("b_chat_stream_usage.txt");
    let body = capture_body("b_chat_stream_usage.txt");
    let svc = h.service(200, "text/event-stream", reads_of(&body, 13), End::Eof);
    let resp = svc
        .oneshot(request("u", &chat(true, Some(true))))
        .await
        .unwrap();
    let got: Vec<String> = frames(resp.into_body())
        .await
        .iter()
        .map(|b| String::from_utf8(b.to_vec()).unwrap())
        .collect();
    let mut want = events.clone();
    let usage_at = want.iter().position(|e| e.contains("\"usage\"")).unwrap();
    want[usage_at] = want[usage_at].replace(
        r#""usage":{"completion_tokens":12,"prompt_tokens":34,"total_tokens":46,"prompt_tokens_details":{"cached_tokens":33}}"#,
        r#""usage":{"prompt_tokens":34,"completion_tokens":12,"total_tokens":46}"#,
    );
    assert_eq!(got, want);
    assert_eq!(got.last().map(String::as_str), Some("data: [DONE]\n\n"));
    let (s, r) = h.settled().await;
    assert_eq!((s.outcome, r.debit_micros), (StreamOutcome::Completed, 58));
}

#[tokio::test]
async fn client_drop_mid_stream_pays_prompt_plus_delivered_without_eos() {
    let mut h = harness().await;
    let events = capture_events("b_chat_stream_usage.txt");
    // role chunk, "1", ".", " Red" then the node stalls
    let reads: Vec<Bytes> = events[..4].iter().map(|e| Bytes::from(e.clone())).collect();
    let svc = h.service(200, "text/event-stream", reads, End::Hang);
    let resp = svc.oneshot(request("d", &chat(true, None))).await.unwrap();
    let mut body = resp.into_body();
    for _ in 0..4 {
        body.frame().await.unwrap().unwrap();
    }
    drop(body);
    let (s, r) = h.settled().await;
    assert_eq!(s.outcome, StreamOutcome::ClientCancelled);
    let delivered = smollm_tokenizer().count_text("1. Red");
    assert_eq!(delivered, 3);
    assert_eq!(
        s.billed,
        Usage {
            prompt_tokens: 34,
            completion_tokens: 3
        }
    );
    // 34 + 3*2 = 40; operator 28, fee 12
    assert_eq!(
        (r.debit_micros, r.operator_credit_micros, r.fee_micros),
        (40, 28, 12)
    );
    let b = h.ledger.account(&h.account).await.unwrap();
    assert_eq!((b.balance_micros, b.held_micros), (START_MICROS - 40, 0));
}

#[tokio::test]
async fn truncated_or_failed_streams_pay_nothing() {
    for (id, end, cut) in [("t", End::Eof, 6usize), ("e", End::Error, 6)] {
        let mut h = harness().await;
        let events = capture_events("b_chat_stream_usage.txt");
        let reads: Vec<Bytes> = events[..cut]
            .iter()
            .map(|e| Bytes::from(e.clone()))
            .collect();
        let svc = h.service(200, "text/event-stream", reads, end);
        let resp = svc.oneshot(request(id, &chat(true, None))).await.unwrap();
        let got = frames(resp.into_body()).await;
        assert_eq!(got.len(), cut + 1);
        let last = String::from_utf8(got[cut].to_vec()).unwrap();
        assert!(last.starts_with("data: {\"error\":{"), "{last}");
        let (s, r) = h.settled().await;
        assert_eq!(s.outcome, StreamOutcome::UpstreamFailed);
        assert_eq!((r.cost_micros, r.debit_micros), (0, 0));
        let b = h.ledger.account(&h.account).await.unwrap();
        assert_eq!((b.balance_micros, b.held_micros), (START_MICROS, 0));
        assert_eq!(
            h.ledger.operator_earned_micros(&h.operator).await.unwrap(),
            0
        );
    }
}

#[tokio::test]
async fn hostile_streams_meet_their_expectations() {
    for case in hostile_cases() {
        if case.id == "H04" {
            continue; // parser-level case, no chat chunks
        }
        let mut h = harness().await;
        let mut req = chat(true, None);
        if let Some(obj) = case.request.as_object() {
            for (k, v) in obj {
                req[k] = v.clone();
            }
        }
        let reads = case.reads.iter().map(|r| Bytes::from(r.clone())).collect();
        let svc = h.service(200, "text/event-stream", reads, End::Eof);
        let resp = svc.oneshot(request(&case.id, &req)).await.unwrap();
        let got = frames(resp.into_body()).await;
        let all: Vec<u8> = got.concat();
        let events = crate::sse::parse_all(&all).unwrap();
        let mut text = String::new();
        let mut usage_chunks = 0;
        for e in &events {
            if e.data() == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(e.data()).unwrap();
            if v.get("usage").is_some_and(|u| !u.is_null()) {
                usage_chunks += 1;
            }
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                text.push_str(c);
            }
        }
        let ex = &case.expect;
        if let Some(t) = ex["client_text"].as_str() {
            assert_eq!(text, t, "{}", case.id);
        }
        let wants_usage = req["stream_options"]["include_usage"].as_bool() == Some(true);
        assert_eq!(usage_chunks, usize::from(wants_usage), "{}", case.id);
        let raw = String::from_utf8_lossy(&all);
        assert!(
            !raw.contains("\nid:") && !raw.starts_with("id:") && !raw.contains("data: :"),
            "{}",
            case.id
        );
        let (s, _) = h.settled().await;
        if let Some(o) = ex["outcome"].as_str() {
            assert_eq!(s.outcome.as_str(), o, "{}", case.id);
        }
        if let Some(c) = ex.get("claimed_usage").filter(|c| c.is_object()) {
            assert_eq!(
                s.claimed,
                Some(Usage {
                    prompt_tokens: c["prompt_tokens"].as_u64().unwrap(),
                    completion_tokens: c["completion_tokens"].as_u64().unwrap()
                }),
                "{}",
                case.id
            );
        }
        if ex["discrepancy"].as_bool() == Some(true) {
            assert!(s.discrepancy, "{}", case.id);
        }
        if s.outcome == StreamOutcome::Completed {
            assert!(raw.ends_with("data: [DONE]\n\n"), "{}", case.id);
        }
        if let Some(up) = ex.get("upstream_stream_options") {
            let sent: Value =
                serde_json::from_slice(h.upstream.lock().unwrap().as_ref().unwrap()).unwrap();
            assert_eq!(&sent["stream_options"], up, "{}", case.id);
        }
    }
}

#[tokio::test]
async fn non_streamed_usage_is_rewritten_to_the_billed_counts() {
    let mut h = harness().await;
    let body = capture_body("a_chat_nonstream.txt");
    let svc = h.service(
        200,
        "application/json; charset=utf-8",
        reads_of(&body, 100),
        End::Eof,
    );
    let resp = svc.oneshot(request("n", &chat(false, None))).await.unwrap();
    assert!(resp.headers().get(http::header::CONTENT_LENGTH).is_none());
    let got = frames(resp.into_body()).await.concat();
    let v: Value = serde_json::from_slice(&got).unwrap();
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens":34,"completion_tokens":12,"total_tokens":46})
    );
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "1. Red\n2. Blue\n3. Green"
    );
    let (s, r) = h.settled().await;
    assert_eq!((s.outcome, r.debit_micros), (StreamOutcome::Completed, 58));
}

#[tokio::test]
async fn refusals_come_before_the_node() {
    let h = harness().await;
    let svc = h.service(200, "text/event-stream", Vec::new(), End::Eof);
    let mut body = chat(true, None);
    body["model"] = json!("gpt-9");
    let err = svc.oneshot(request("x", &body)).await.unwrap_err();
    assert!(
        matches!(err.downcast_ref::<MeterError>(), Some(MeterError::UnknownModel(m)) if m.as_str() == "gpt-9")
    );

    let svc = h.service(200, "text/event-stream", Vec::new(), End::Eof);
    let mut body = chat(true, None);
    body["max_tokens"] = json!(100_000);
    body["n"] = json!(40);
    let err = svc.oneshot(request("y", &body)).await.unwrap_err();
    // hold = 34 + 40 * (2048 - 34) * 2 = 161_154 > 100_000
    assert!(matches!(
        err.downcast_ref::<MeterError>(),
        Some(MeterError::InsufficientCredit {
            available_micros: 100_000,
            needed_micros: 161_154
        })
    ));

    let svc = h.service(200, "text/event-stream", Vec::new(), End::Eof);
    let err = svc
        .oneshot(request("z", &json!({"messages": []})))
        .await
        .unwrap_err();
    assert!(matches!(
        err.downcast_ref::<MeterError>(),
        Some(MeterError::BadRequest(_))
    ));
    assert_eq!(h.upstream.lock().unwrap().as_ref(), None);
}

#[tokio::test]
async fn node_errors_and_inner_errors_settle_without_charge() {
    let mut h = harness().await;
    let svc = h.service(
        400,
        "application/json",
        vec![Bytes::from_static(b"{\"error\":{}}")],
        End::Eof,
    );
    let resp = svc
        .oneshot(request("bad", &chat(true, None)))
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(
        frames(resp.into_body()).await.concat(),
        b"{\"error\":{}}".to_vec()
    );
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, r.debit_micros),
        (StreamOutcome::UpstreamFailed, 0)
    );

    let failing = MeterLayer::new(h.ledger.clone(), {
        let mut c = Catalog::new();
        c.insert(
            ModelId::from("smollm2"),
            CatalogEntry {
                tokenizer: smollm_tokenizer(),
                price: PRICE,
                max_context_tokens: 2048,
            },
        );
        c
    })
    .events(h.events.clone())
    .layer(tower::service_fn(|_req: http::Request<BoxBody>| async {
        Err::<http::Response<BoxBody>, BoxError>("no node".into())
    }));
    let err = failing
        .oneshot(request("rej", &chat(false, None)))
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "no node");
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, s.node, r.debit_micros),
        (StreamOutcome::Rejected, None, 0)
    );
    let b = h.ledger.account(&h.account).await.unwrap();
    assert_eq!((b.balance_micros, b.held_micros), (START_MICROS, 0));
}
