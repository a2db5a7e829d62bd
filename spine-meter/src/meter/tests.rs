#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;

use crate::Ledger;
use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use spine_core::{
    AccountId, BoxBody, BoxError, ModelId, NodeId, OperatorId, RequestId, StreamOutcome, Usage,
};
use spine_test_support::{body_fn, full, ScriptedBody, UpstreamService};
use tower::{Layer, Service, ServiceExt};

use super::*;
use crate::ledger::{SettleResult, Settlement};
use crate::test_support::{
    capture_body, chat_request, hostile_cases, next_settled, node_response, smollm_catalog,
    smollm_tokenizer, FundedLedger, RecordedEvents, SettledRx,
};
use crate::{Price, SqliteLedger};

const PRICE: Price = Price {
    input_micros_per_mtok: 1_000_000,
    output_micros_per_mtok: 2_000_000,
};

/// How a node's body ends after its reads: it ends, fails, or hangs forever.
#[derive(Debug, Clone, Copy)]
enum End {
    Eof,
    Error,
    Hang,
}

/// A node body replaying `reads`, then ending as `end` says.
fn replay(reads: Vec<Bytes>, end: End) -> ScriptedBody {
    let body = ScriptedBody::data(reads);
    match end {
        End::Eof => body,
        End::Error => body.fail("node connection reset"),
        End::Hang => body.hang(),
    }
}

/// Splits `bytes` into reads of `size` bytes.
fn reads_of(bytes: &[u8], size: usize) -> Vec<Bytes> {
    bytes.chunks(size).map(Bytes::copy_from_slice).collect()
}

struct Harness {
    ledger: Arc<SqliteLedger>,
    account: AccountId,
    operator: OperatorId,
    node: NodeId,
    settled: SettledRx,
    events: Arc<RecordedEvents>,
    upstream: Arc<Mutex<Option<Bytes>>>,
}

const START_MICROS: u64 = 100_000;

async fn harness() -> Harness {
    let FundedLedger {
        ledger,
        account,
        operator,
        node,
    } = FundedLedger::new(START_MICROS).await;
    let (events, settled) = RecordedEvents::new();
    Harness {
        ledger,
        account,
        operator,
        node,
        settled,
        events,
        upstream: Arc::new(Mutex::new(None)),
    }
}

fn catalog(max_context_tokens: u64) -> Catalog {
    smollm_catalog(PRICE, max_context_tokens)
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
        self.layer(2048)
            .layer(self.inner(status, content_type, reads, end))
    }

    /// The metering layer over the SmolLM2 catalog with a context window of `max_context_tokens`.
    fn layer(&self, max_context_tokens: u64) -> MeterLayer {
        MeterLayer::new(self.ledger.clone(), catalog(max_context_tokens))
            .operator_share_bps(7_000)
            .events(self.events.clone())
    }

    /// The metering layer (a context window of 2048 tokens) offering to `tap`, over a fake node
    /// ([`Self::inner`]) answering 200 with `body` in one read as `content_type`, then `end`.
    fn audited(
        &self,
        tap: Arc<dyn crate::audit::AuditTap>,
        content_type: &'static str,
        body: impl Into<Bytes>,
        end: End,
    ) -> Meter<impl UpstreamService> {
        self.layer(2048)
            .audit(tap)
            .layer(self.inner(200, content_type, vec![body.into()], end))
    }

    /// A fake node: records the upstream body, answers `status` with `reads` then `end`, and
    /// puts its `NodeId` into the response extensions.
    fn inner(
        &self,
        status: u16,
        content_type: &'static str,
        reads: Vec<Bytes>,
        end: End,
    ) -> impl UpstreamService {
        let node = self.node.clone();
        let upstream = self.upstream.clone();
        tower::service_fn(move |req: http::Request<BoxBody>| {
            let node = node.clone();
            let upstream = upstream.clone();
            let reads = reads.clone();
            async move {
                assert!(req.extensions().get::<spine_core::RequestPeek>().is_some());
                let body = req.into_body().collect().await?.to_bytes();
                *upstream.lock().unwrap() = Some(body);
                let body = BoxBody::new(replay(reads, end));
                let mut resp = node_response(node, content_type, body);
                *resp.status_mut() = http::StatusCode::from_u16(status).unwrap();
                Ok::<_, BoxError>(resp)
            }
        })
    }

    /// The caller's account.
    async fn balance(&self) -> crate::AccountBalance {
        self.ledger.account(&self.account).await.unwrap()
    }

    /// What the node's operator has earned.
    async fn operator_earned(&self) -> u64 {
        self.ledger
            .operator_earned_micros(&self.operator)
            .await
            .unwrap()
    }

    /// The ledger's record of request `id`.
    async fn record(&self, id: &str) -> Option<crate::RequestRecord> {
        self.ledger
            .request_record(RequestId::from(id))
            .await
            .unwrap()
    }

    /// Asserts the caller's account is as it started: nothing debited, nothing held.
    async fn assert_account_untouched(&self) {
        let b = self.balance().await;
        assert_eq!((b.balance_micros, b.held_micros), (START_MICROS, 0));
    }

    async fn settled(&mut self) -> (Settlement, SettleResult) {
        next_settled(&mut self.settled).await
    }
}

fn request(id: &str, body: &Value) -> http::Request<BoxBody> {
    let bytes = Bytes::from(serde_json::to_vec(body).unwrap());
    chat_request(id, AccountId::from("acct"), bytes)
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

/// `event` of the llama.cpp capture as the caller gets it: the model named as it asked.
fn callers_model(event: &str) -> String {
    event.replace(
        r#""model":"models/SmolLM2-135M-Instruct.Q4_1.gguf""#,
        r#""model":"smollm2""#,
    )
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
        // one frame per event; the usage-only chunk withheld; everything else byte-exact but
        // the model, the caller's catalog name (llama.cpp without `--alias` sends its file path)
        let mut want: Vec<String> = events.iter().map(|e| callers_model(e)).collect();
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
    let b = h.balance().await;
    assert_eq!(
        (b.balance_micros, b.held_micros),
        (START_MICROS - 4 * 58, 0)
    );
    assert_eq!(h.operator_earned().await, 4 * 40);
    assert_eq!(h.ledger.entries_sum_micros().await.unwrap(), 0);
    let rec = h.record("r7").await.unwrap();
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
    let mut want: Vec<String> = events.iter().map(|e| callers_model(e)).collect();
    let usage_at = want.iter().position(|e| e.contains("\"usage\"")).unwrap();
    // the gateway's own usage chunk: the stream's id, object, created, model and fingerprint,
    // `choices: []`, the billed usage — nothing else of the node's chunk (its timings)
    let node: Value = serde_json::from_str(want[usage_at].trim_start_matches("data: ")).unwrap();
    want[usage_at] = format!(
        "data: {{\"id\":{},\"object\":{},\"created\":{},\"model\":{},\"system_fingerprint\":{},\"choices\":[],\"usage\":{{\"prompt_tokens\":34,\"completion_tokens\":12,\"total_tokens\":46}}}}\n\n",
        node["id"], node["object"], node["created"], node["model"], node["system_fingerprint"]
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
    let b = h.balance().await;
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
        h.assert_account_untouched().await;
        assert_eq!(h.operator_earned().await, 0);
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
    h.assert_account_untouched().await;
}

// ---- caller gone before the response head ----

/// A fake router + node that never answers: optionally records `node` in the request's
/// `NodeSlot` (as `spine_router::Route` does when it picks), signals `reached`, then waits
/// forever — or fails, when `fail` is set.
fn pending_inner(
    node: Option<NodeId>,
    reached: Arc<tokio::sync::Notify>,
    fail: bool,
) -> impl UpstreamService {
    tower::service_fn(move |req: http::Request<BoxBody>| {
        let node = node.clone();
        let reached = reached.clone();
        async move {
            let slot = req.extensions().get::<spine_core::NodeSlot>().unwrap();
            if let Some(node) = node {
                slot.set(node);
            }
            reached.notify_one();
            if fail {
                return Err::<http::Response<BoxBody>, BoxError>("tunnel closed".into());
            }
            std::future::pending::<()>().await;
            Ok(http::Response::new(BoxBody::default()))
        }
    })
}

/// Calls `svc` and drops the response future as soon as the inner service was reached.
async fn drop_when_reached<S>(svc: S, req: http::Request<BoxBody>, reached: &tokio::sync::Notify)
where
    S: Service<http::Request<BoxBody>, Response = http::Response<BoxBody>, Error = BoxError>,
{
    tokio::select! {
        _ = svc.oneshot(req) => panic!("the inner service never answers"),
        () = reached.notified() => {}
    }
}

#[tokio::test]
async fn caller_gone_after_the_node_was_picked_pays_the_prompt() {
    let mut h = harness().await;
    let reached = Arc::new(tokio::sync::Notify::new());
    let svc = h
        .layer(2048)
        .layer(pending_inner(Some(h.node.clone()), reached.clone(), false));
    drop_when_reached(svc, request("gone", &chat(false, None)), &reached).await;
    let (s, r) = h.settled().await;
    assert_eq!(s.outcome, StreamOutcome::ClientCancelled);
    assert_eq!(s.node, Some(h.node.clone()));
    assert_eq!(
        (s.billed, s.claimed),
        (
            Usage {
                prompt_tokens: 34,
                completion_tokens: 0
            },
            None
        )
    );
    // 34 × 1 = 34 micros; operator floor(34 × 70 %) = 23, fee 11; hold 34 + 64 × 2 = 162
    assert_eq!(
        (
            r.cost_micros,
            r.debit_micros,
            r.operator_credit_micros,
            r.fee_micros,
            r.hold_micros
        ),
        (34, 34, 23, 11, 162)
    );
    let b = h.balance().await;
    assert_eq!((b.balance_micros, b.held_micros), (START_MICROS - 34, 0));
    assert_eq!(h.operator_earned().await, 23);
    assert_eq!(h.ledger.entries_sum_micros().await.unwrap(), 0);
    let rec = h.record("gone").await.unwrap();
    assert_eq!(
        (rec.outcome, rec.node, rec.operator, rec.debit_micros),
        (
            StreamOutcome::ClientCancelled,
            Some(h.node.clone()),
            Some(h.operator.clone()),
            34
        )
    );
}

#[tokio::test]
async fn caller_gone_before_any_node_was_picked_is_rejected_and_free() {
    let mut h = harness().await;
    let reached = Arc::new(tokio::sync::Notify::new());
    let svc = h
        .layer(2048)
        .layer(pending_inner(None, reached.clone(), false));
    drop_when_reached(svc, request("early", &chat(true, None)), &reached).await;
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, s.node, r.debit_micros, r.hold_micros),
        (StreamOutcome::Rejected, None, 0, 162)
    );
    h.assert_account_untouched().await;
}

#[tokio::test]
async fn inner_error_after_the_pick_is_upstream_failed_with_the_node_and_free() {
    let mut h = harness().await;
    let reached = Arc::new(tokio::sync::Notify::new());
    let svc = h
        .layer(2048)
        .layer(pending_inner(Some(h.node.clone()), reached, true));
    let err = svc
        .oneshot(request("lost", &chat(false, None)))
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "tunnel closed");
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, s.node, r.debit_micros, r.operator_credit_micros),
        (StreamOutcome::UpstreamFailed, Some(h.node.clone()), 0, 0)
    );
    h.assert_account_untouched().await;
}

/// A non-streamed answer past the request's byte bound (1 MiB + 8 KiB a token of its cap: 1.6 MiB
/// for 64 tokens) is the node's fault; one within the bound but past the gateway's buffer is the
/// gateway's limit: 502 `response_too_large`, settled `cut_at_bound` (the prompt paid, the operator
/// earns nothing, the node not scored).
#[tokio::test]
async fn a_non_streamed_answer_over_its_bound_is_the_nodes_fault_and_over_the_buffer_the_gateways()
{
    let capture = Bytes::from(capture_body("a_chat_nonstream.txt"));
    // over the bound: 2 MiB of body for a 64-token cap, under a 16 MiB buffer
    let trimmed = capture.trim_ascii_end();
    let mut padded = trimmed[..trimmed.len() - 1].to_vec();
    padded.extend_from_slice(b",\"pad\":\"");
    padded.extend(std::iter::repeat_n(b'x', 2 << 20));
    padded.extend_from_slice(b"\"}");
    let padded = Bytes::from(padded);
    let mut h = harness().await;
    let (svc, slot) = h.slot_node(h.layer(2048), "application/json", move || {
        full(padded.clone())
    });
    let err = svc
        .oneshot(request("over-bound", &chat(false, None)))
        .await
        .unwrap_err();
    match err.downcast_ref::<MeterError>() {
        Some(MeterError::UpstreamInvalid(got)) => {
            assert!(got.starts_with("the body is larger than"), "{got}");
        }
        _ => panic!("{err}"),
    }
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, r.debit_micros, r.operator_credit_micros),
        (StreamOutcome::UpstreamFailed, 0, 0)
    );
    assert!(slot.lock().unwrap().as_ref().unwrap().node_fault_reported());

    // within the bound, over a 100-byte buffer: the gateway's limit
    let mut h = harness().await;
    let (svc, slot) = h.slot_node(
        h.layer(2048).max_response_body_bytes(100),
        "application/json",
        move || full(capture.clone()),
    );
    let err = svc
        .oneshot(request("over-buffer", &chat(false, None)))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err.downcast_ref::<MeterError>(),
            Some(MeterError::AnswerTooLarge { limit_bytes: 100 })
        ),
        "{err}"
    );
    let (s, r) = h.settled().await;
    assert_eq!(
        (
            s.outcome,
            s.billed.completion_tokens,
            r.operator_credit_micros
        ),
        (StreamOutcome::CutAtBound, 0, 0)
    );
    assert_eq!(s.billed.prompt_tokens, 34);
    assert!(r.debit_micros > 0, "the prompt is paid");
    assert!(!slot.lock().unwrap().as_ref().unwrap().node_fault_reported());
    let b = h.balance().await;
    assert_eq!(
        (b.balance_micros, b.held_micros),
        (START_MICROS - r.debit_micros, 0)
    );
}

#[tokio::test]
async fn non_streamed_head_waits_for_the_whole_body_and_a_drop_meanwhile_pays_the_prompt() {
    let mut h = harness().await;
    let body = capture_body("a_chat_nonstream.txt");
    // the node sends its head and half its body, then stalls
    let svc = h.service(
        200,
        "application/json",
        vec![Bytes::copy_from_slice(&body[..body.len() / 2])],
        End::Hang,
    );
    let pending = tokio::time::timeout(
        std::time::Duration::from_millis(200),
        svc.oneshot(request("half", &chat(false, None))),
    )
    .await;
    assert!(pending.is_err(), "no head before the whole body");
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, s.node, s.billed, r.debit_micros),
        (
            StreamOutcome::ClientCancelled,
            Some(h.node.clone()),
            Usage {
                prompt_tokens: 34,
                completion_tokens: 0
            },
            34
        )
    );
}

// ---- malformed chat requests ----

fn invalid_message(err: &BoxError) -> Option<(String, &'static str)> {
    match err.downcast_ref::<MeterError>() {
        Some(MeterError::BadRequest(spine_core::PeekError::InvalidMessage { path, reason })) => {
            Some((path.clone(), *reason))
        }
        _ => None,
    }
}

#[tokio::test]
async fn malformed_or_unsupported_messages_are_400_and_never_forwarded() {
    let h = harness().await;
    let content = "expected a string or an array of content parts (null only for an assistant message with tool_calls)";
    let cases = [
        (
            json!({"model":"smollm2","messages":[{"role":"user","content":[
                {"type":"text","text":"What is this?"},
                {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}),
            "messages[0].content[1].type",
            "unsupported content part type for this model",
        ),
        (
            json!({"model":"smollm2","messages":[{"role":"user","content":42}]}),
            "messages[0].content",
            content,
        ),
        (
            json!({"model":"smollm2","messages":[{"role":"system","content":"hi"},{"content":"x"}]}),
            "messages[1].role",
            "expected a string",
        ),
        (
            json!({"model":"smollm2","messages":[{"role":"user","content":null}]}),
            "messages[0].content",
            content,
        ),
        (
            json!({"model":"smollm2","messages":[]}),
            "messages",
            "expected a non-empty array of message objects",
        ),
        (
            json!({"model":"smollm2","max_tokens":8}),
            "messages",
            "expected a non-empty array of message objects",
        ),
    ];
    for (i, (body, path, reason)) in cases.into_iter().enumerate() {
        let svc = h.service(200, "text/event-stream", Vec::new(), End::Eof);
        let id = format!("m{i}");
        let err = svc.oneshot(request(&id, &body)).await.unwrap_err();
        assert_eq!(
            invalid_message(&err),
            Some((path.to_owned(), reason)),
            "{body}"
        );
        assert_eq!(h.record(&id).await, None);
    }
    assert_eq!(h.upstream.lock().unwrap().as_ref(), None);
    h.assert_account_untouched().await;
}

#[tokio::test]
async fn text_content_parts_and_tool_call_messages_are_counted() {
    let mut h = harness().await;
    let body = capture_body("a_chat_nonstream.txt");
    let svc = h.service(200, "application/json", reads_of(&body, 100), End::Eof);
    let req = json!({"model":"smollm2","max_tokens":64,"messages":[
        {"role":"user","content":[{"type":"text","text":"Name three colors."}]}]});
    let resp = svc.oneshot(request("parts", &req)).await.unwrap();
    assert_eq!(resp.status(), 200);
    drop(resp);
    let (s, _) = h.settled().await;
    // the same prompt as the plain string: 34 tokens
    assert_eq!(
        (s.outcome, s.billed.prompt_tokens),
        (StreamOutcome::Completed, 34)
    );

    let svc = h.service(200, "application/json", reads_of(&body, 100), End::Eof);
    let req = json!({"model":"smollm2","max_tokens":64,"messages":[
        {"role":"user","content":"What is 6 × 7?"},
        {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"calc","arguments":"{}"}}]},
        {"role":"tool","tool_call_id":"c1","content":"42"}]});
    let resp = svc.oneshot(request("tools", &req)).await.unwrap();
    assert_eq!(resp.status(), 200);
    let (s, _) = h.settled().await;
    assert_eq!(s.outcome, StreamOutcome::Completed);
}

// ---- context length and max_tokens 0 ----

#[tokio::test]
async fn prompt_at_or_over_the_context_is_refused_before_the_node() {
    let h = harness().await;
    for context in [20, 34] {
        let svc = h
            .layer(context)
            .layer(h.inner(200, "text/event-stream", Vec::new(), End::Eof));
        let err = svc
            .oneshot(request("long", &chat(true, None)))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err.downcast_ref::<MeterError>(),
                Some(&MeterError::ContextLengthExceeded {
                    prompt_tokens: 34,
                    max_context_tokens
                }) if max_context_tokens == context
            ),
            "{err}"
        );
    }
    assert_eq!(
        MeterError::ContextLengthExceeded {
            prompt_tokens: 34,
            max_context_tokens: 34
        }
        .to_string(),
        "the prompt is 34 tokens and the model's context window is 34 tokens"
    );
    assert_eq!(h.upstream.lock().unwrap().as_ref(), None);
    assert_eq!(h.record("long").await, None);
    h.assert_account_untouched().await;
}

#[tokio::test]
async fn one_token_of_room_holds_and_bills_one_completion_token_and_max_tokens_0_is_refused() {
    let body = capture_body("a_chat_nonstream.txt");
    // max_tokens 0 is refused (SGLang would fall through to max_completion_tokens), never held
    {
        let h = harness().await;
        let svc =
            h.layer(2048)
                .layer(h.inner(200, "application/json", reads_of(&body, 100), End::Eof));
        let mut req = chat(false, None);
        req["max_tokens"] = json!(0);
        let err = svc.oneshot(request("zero", &req)).await.unwrap_err();
        assert!(
            matches!(
                err.downcast_ref::<MeterError>(),
                Some(MeterError::BadRequest(
                    spine_core::PeekError::InvalidField {
                        field: "max_tokens",
                        ..
                    }
                ))
            ),
            "{err}"
        );
    }
    // (context, max_tokens): one token of room
    for (context, max_tokens) in [(35u64, 64u64)] {
        let mut h = harness().await;
        let svc = h.layer(context).layer(h.inner(
            200,
            "application/json",
            reads_of(&body, 100),
            End::Eof,
        ));
        let mut req = chat(false, None);
        req["max_tokens"] = json!(max_tokens);
        let resp = svc.oneshot(request("one", &req)).await.unwrap();
        let got: Value = serde_json::from_slice(&frames(resp.into_body()).await.concat()).unwrap();
        assert_eq!(
            got["usage"],
            json!({"prompt_tokens":34,"completion_tokens":1,"total_tokens":35})
        );
        let (s, r) = h.settled().await;
        assert_eq!(
            s.billed,
            Usage {
                prompt_tokens: 34,
                completion_tokens: 1
            }
        );
        // hold = 34 × 1 + 1 × 2 = 36 = debit: never more than the hold
        assert_eq!((r.hold_micros, r.cost_micros, r.debit_micros), (36, 36, 36));
    }
}

// ---- non-streamed bodies that are not completions ----

#[tokio::test]
async fn invalid_non_streamed_2xx_bodies_are_errors_and_free() {
    let capture = capture_body("a_chat_nonstream.txt");
    let cases: Vec<(Vec<Bytes>, End, usize, &str)> = vec![
        (
            vec![Bytes::from_static(b"<html>bad gateway</html>")],
            End::Eof,
            1 << 20,
            "the body is not one JSON object",
        ),
        (
            vec![Bytes::from_static(
                br#"{"id":"x","object":"chat.completion","usage":{"prompt_tokens":34,"completion_tokens":3}}"#,
            )],
            End::Eof,
            1 << 20,
            "the body has no choices",
        ),
        (
            vec![Bytes::from_static(br#"{"choices":[]}"#)],
            End::Eof,
            1 << 20,
            "the body has no choices",
        ),
        (
            vec![Bytes::from_static(
                br#"{"choices":[{"index":0,"message":{"role":"assistant","content":"1. Red"}}]}"#,
            )],
            End::Eof,
            1 << 20,
            "choice 0 has no finish_reason",
        ),
        (
            vec![Bytes::from_static(
                br#"{"error":{"message":"out of memory"},"choices":[{"index":0,"message":{"content":""},"finish_reason":"stop"}]}"#,
            )],
            End::Eof,
            1 << 20,
            "the node's engine reported an error: out of memory",
        ),
    ];
    for (i, (reads, end, limit, why)) in cases.into_iter().enumerate() {
        let mut h = harness().await;
        let svc = h.layer(2048).max_response_body_bytes(limit).layer(h.inner(
            200,
            "application/json",
            reads,
            end,
        ));
        let err = svc
            .oneshot(request(&format!("inv{i}"), &chat(false, None)))
            .await
            .unwrap_err();
        match err.downcast_ref::<MeterError>() {
            Some(MeterError::UpstreamInvalid(got)) => assert_eq!(got, why),
            _ => panic!("{why}: {err}"),
        }
        let (s, r) = h.settled().await;
        assert_eq!(
            (s.outcome, s.node, r.debit_micros, r.operator_credit_micros),
            (StreamOutcome::UpstreamFailed, Some(h.node.clone()), 0, 0),
            "{why}"
        );
        h.assert_account_untouched().await;
    }
    assert_eq!(
        MeterError::UpstreamInvalid("the body has no choices".into()).to_string(),
        "invalid response from the node: the body has no choices"
    );

    // the node's body fails mid-way
    let mut h = harness().await;
    let svc = h.service(
        200,
        "application/json",
        vec![Bytes::copy_from_slice(&capture[..50])],
        End::Error,
    );
    let err = svc
        .oneshot(request("broken", &chat(false, None)))
        .await
        .unwrap_err();
    match err.downcast_ref::<MeterError>() {
        Some(e @ MeterError::UpstreamBody(_)) => {
            assert_eq!(
                std::error::Error::source(e).map(ToString::to_string),
                Some("node connection reset".to_owned())
            );
        }
        _ => panic!("{err}"),
    }
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, r.debit_micros),
        (StreamOutcome::UpstreamFailed, 0)
    );
}

// ---- choices not asked for and the per-choice cap ----

fn completion(choices: Value) -> Vec<Bytes> {
    vec![Bytes::from(
        serde_json::to_vec(&json!({"id":"c","object":"chat.completion","choices":choices}))
            .unwrap(),
    )]
}

#[tokio::test]
async fn choices_beyond_n_are_not_billed() {
    // non-streamed: n = 1, the node sends two choices
    let mut h = harness().await;
    let svc = h.service(
        200,
        "application/json",
        completion(json!([
            {"index":0,"message":{"role":"assistant","content":"1. Red"},"finish_reason":"stop"},
            {"index":1,"message":{"role":"assistant","content":"1. Red\n2. Blue\n3. Green"},"finish_reason":"stop"}
        ])),
        End::Eof,
    );
    let resp = svc
        .oneshot(request("n1", &chat(false, None)))
        .await
        .unwrap();
    let got: Value = serde_json::from_slice(&frames(resp.into_body()).await.concat()).unwrap();
    // only choice 0 reaches the client, and is billed: "1. Red" 3 tokens + EOS
    assert_eq!(got["choices"].as_array().map(Vec::len), Some(1));
    assert_eq!(
        got["usage"],
        json!({"prompt_tokens":34,"completion_tokens":4,"total_tokens":38})
    );
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, s.billed.completion_tokens),
        (StreamOutcome::Completed, 4)
    );
    assert_eq!(r.debit_micros, 34 + 4 * 2);

    // streamed: the extra choice is dropped (never delivered, billed, or waited for), the rest
    // forwarded byte for byte
    let events = [
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"1. Red\"},\"finish_reason\":null}]}\n\n",
        "data: {\"choices\":[{\"index\":1,\"delta\":{\"content\":\"1. Red\\n2. Blue\\n3. Green\"},\"finish_reason\":null}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: [DONE]\n\n",
    ];
    let mut h = harness().await;
    let svc = h.service(
        200,
        "text/event-stream",
        events
            .iter()
            .map(|e| Bytes::from_static(e.as_bytes()))
            .collect(),
        End::Eof,
    );
    let resp = svc
        .oneshot(request("n1s", &chat(true, None)))
        .await
        .unwrap();
    let got: Vec<String> = frames(resp.into_body())
        .await
        .iter()
        .map(|b| String::from_utf8(b.to_vec()).unwrap())
        .collect();
    assert_eq!(got, [events[0], events[2], events[3]]);
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, s.billed.completion_tokens, r.debit_micros),
        (StreamOutcome::Completed, 4, 42)
    );
}

#[tokio::test]
async fn completion_tokens_per_choice_are_capped_at_max_tokens() {
    // (max_tokens, text, finish_reason, billed completion tokens)
    let cases = [
        // 3 text tokens, stop, under the cap: + EOS
        (4u64, "1. Red", "stop", 4u64),
        // 3 text tokens, stop, at the cap: no EOS
        (3, "1. Red", "stop", 3),
        // 11 text tokens from a node that ignored max_tokens: capped
        (5, "1. Red\n2. Blue\n3. Green", "length", 5),
        (5, "1. Red\n2. Blue\n3. Green", "stop", 5),
    ];
    for (max_tokens, text, finish, want) in cases {
        let mut h = harness().await;
        let svc = h.service(
            200,
            "application/json",
            completion(json!([
                {"index":0,"message":{"role":"assistant","content":text},"finish_reason":finish}
            ])),
            End::Eof,
        );
        let mut req = chat(false, None);
        req["max_tokens"] = json!(max_tokens);
        let resp = svc.oneshot(request("cap", &req)).await.unwrap();
        drop(resp);
        let (s, r) = h.settled().await;
        assert_eq!(
            (s.billed.completion_tokens, r.debit_micros),
            (want, 34 + want * 2),
            "{max_tokens} {text:?} {finish}"
        );
    }

    // streamed capture (11 text tokens + stop) with max_tokens 11: no EOS, 11 billed
    let mut h = harness().await;
    let body = capture_body("b_chat_stream_usage.txt");
    let svc = h.service(200, "text/event-stream", reads_of(&body, 64), End::Eof);
    let mut req = chat(true, Some(true));
    req["max_tokens"] = json!(11);
    let resp = svc.oneshot(request("cap11", &req)).await.unwrap();
    let all = String::from_utf8(frames(resp.into_body()).await.concat()).unwrap();
    assert!(
        all.contains(r#""usage":{"prompt_tokens":34,"completion_tokens":11,"total_tokens":45}"#),
        "{all}"
    );
    let (s, r) = h.settled().await;
    assert_eq!(
        (
            s.outcome,
            s.billed.completion_tokens,
            r.debit_micros,
            r.hold_micros
        ),
        (StreamOutcome::Completed, 11, 56, 56)
    );
}

// --- issue 13 / 14: hostile nodes, bounded cost, holds owned from the start ---------------------

/// A node body that produces `event` `left` times, counting the bytes pulled.
fn endless(
    event: Bytes,
    mut left: usize,
    pulled: Arc<std::sync::atomic::AtomicU64>,
) -> impl Body<Data = Bytes, Error = BoxError> + Send + 'static {
    body_fn(move |_cx| {
        if left == 0 {
            return Poll::Ready(None);
        }
        left -= 1;
        pulled.fetch_add(event.len() as u64, std::sync::atomic::Ordering::Relaxed);
        Poll::Ready(Some(Ok(Frame::data(event.clone()))))
    })
}

/// The slot in which [`Harness::slot_node`] keeps the request's [`NodeSlot`](spine_core::NodeSlot).
type Slot = Arc<Mutex<Option<spine_core::NodeSlot>>>;

impl Harness {
    /// `layer` over a node answering every request with `body()`, keeping the request's
    /// [`NodeSlot`](spine_core::NodeSlot) in the slot that comes back too.
    fn slot_node<B, F>(
        &self,
        layer: MeterLayer,
        content_type: &'static str,
        body: F,
    ) -> (Meter<impl UpstreamService>, Slot)
    where
        B: Body<Data = Bytes, Error = BoxError> + Send + 'static,
        F: Fn() -> B + Clone + Send + 'static,
    {
        let (node, slot) = (self.node.clone(), Slot::default());
        let kept = slot.clone();
        let svc = layer.layer(tower::service_fn(move |req: http::Request<BoxBody>| {
            let (node, slot, body) = (node.clone(), kept.clone(), body.clone());
            async move {
                *slot.lock().unwrap() = req.extensions().get::<spine_core::NodeSlot>().cloned();
                Ok::<_, BoxError>(node_response(node, content_type, BoxBody::new(body())))
            }
        }));
        (svc, slot)
    }
}

/// The fault recorded on the request's node slot that [`Harness::slot_node`] kept.
fn node_fault(slot: &Mutex<Option<spine_core::NodeSlot>>) -> Option<spine_core::NodeFault> {
    slot.lock().unwrap().as_ref().unwrap().node_fault()
}

fn content_event(text: &str) -> Bytes {
    let chunk = json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"smollm2",
        "choices":[{"index":0,"delta":{"content":text},"finish_reason":null}]});
    Bytes::from(format!("data: {chunk}\n\n"))
}

#[tokio::test]
async fn a_node_streaming_past_the_cap_is_cut_at_its_bound_and_faulted() {
    // a hostile node streams without end (1 GiB in 16 KiB events): the gateway pulls a bounded
    // amount, delivers no more than the cap allows, settles upstream_failed, reports the fault
    for text in [
        "word ".repeat(3276),
        "x".repeat(16 * 1024),
        "日本".repeat(2730),
    ] {
        let mut h = harness().await;
        let pulled = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let event = content_event(&text);
        let (ev, p) = (event.clone(), pulled.clone());
        let (svc, slot) = h.slot_node(h.layer(2048), "text/event-stream", move || {
            endless(ev.clone(), (1 << 30) / ev.len(), p.clone())
        });
        let mut req = chat(true, None);
        req["max_tokens"] = json!(64);
        let resp = svc.oneshot(request("big", &req)).await.unwrap();
        let got = frames(resp.into_body()).await.concat();
        let events = ended_with_upstream_error(&got, "completion tokens a choice may have");
        let mut delivered = String::new();
        for e in &events[..events.len() - 1] {
            let v: Value = serde_json::from_str(e.data()).unwrap();
            delivered.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap());
        }
        let tok = smollm_tokenizer();
        // the cap (64) plus max(16, 6.4): never more delivered
        assert!(
            tok.count_text(&delivered) <= 80,
            "{}",
            tok.count_text(&delivered)
        );
        assert!(
            pulled.load(std::sync::atomic::Ordering::Relaxed) < 4 * 1024 * 1024,
            "pulled {}",
            pulled.load(std::sync::atomic::Ordering::Relaxed)
        );
        let (s, _) = h.settled().await;
        assert_eq!(s.outcome, StreamOutcome::UpstreamFailed);
        assert!(slot.lock().unwrap().as_ref().unwrap().node_fault_reported());
        assert_eq!(h.balance().await.held_micros, 0);
        assert_eq!(h.balance().await.balance_micros, START_MICROS);
    }
}

#[tokio::test]
async fn a_non_streamed_answer_over_the_cap_or_past_n_is_handled() {
    let mut h = harness().await;
    // 3 choices for n = 1, choice 0 within its cap: the others are removed, choice 0 billed
    let answer = json!({"id":"c","object":"chat.completion","created":1,"model":"smollm2",
        "choices":[
            {"index":0,"message":{"role":"assistant","content":"Red"},"finish_reason":"stop"},
            {"index":1,"message":{"role":"assistant","content":"FREE TEXT"},"finish_reason":"stop"},
            {"index":2,"message":{"role":"assistant","content":"MORE"},"finish_reason":"stop"}],
        "usage":{"prompt_tokens":34,"completion_tokens":2},
        "timings":{"cache_n":12}});
    let body = Bytes::from(answer.to_string());
    let (svc, slot) = h.slot_node(h.layer(2048), "application/json", move || {
        full(body.clone())
    });
    let resp = svc
        .oneshot(request("n1", &chat(false, None)))
        .await
        .unwrap();
    let text = String::from_utf8(frames(resp.into_body()).await.concat()).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["choices"].as_array().unwrap().len(), 1, "{v}");
    assert!(
        !text.contains("FREE") && !text.contains("timings"),
        "{text}"
    );
    let (s, _) = h.settled().await;
    assert_eq!(s.outcome, StreamOutcome::Completed);
    assert_eq!(s.billed.completion_tokens, 2); // "Red" + EOS
    assert!(!slot.lock().unwrap().as_ref().unwrap().node_fault_reported());

    // a choice far over its cap: refused, not billed, the node faulted
    let long = json!({"id":"c","object":"chat.completion","created":1,"model":"smollm2",
        "choices":[{"index":0,"message":{"role":"assistant","content":"word ".repeat(500)},
        "finish_reason":"length"}]});
    let body = Bytes::from(long.to_string());
    let (svc, slot) = h.slot_node(h.layer(2048), "application/json", move || {
        full(body.clone())
    });
    let mut req = chat(false, None);
    req["max_tokens"] = json!(16);
    let err = svc.oneshot(request("over", &req)).await.unwrap_err();
    assert!(matches!(
        err.downcast_ref::<MeterError>(),
        Some(MeterError::UpstreamInvalid(_))
    ));
    let (s, _) = h.settled().await;
    assert_eq!(s.outcome, StreamOutcome::UpstreamFailed);
    assert!(slot.lock().unwrap().as_ref().unwrap().node_fault_reported());
}

/// A ledger behind the traffic: its holds take `hold_delay` (a busy database, so a caller
/// can leave mid-hold), and each settlement first waits for a permit of `settle_gate`, when
/// there is one.
#[derive(Debug)]
struct SlowLedger {
    inner: Arc<SqliteLedger>,
    hold_delay: std::time::Duration,
    settle_gate: Option<Arc<tokio::sync::Semaphore>>,
}

impl Ledger for SlowLedger {
    fn hold(
        &self,
        request_id: RequestId,
        account: AccountId,
        model: ModelId,
        amount_micros: u64,
    ) -> crate::ledger::LedgerFuture<'_, ()> {
        Box::pin(async move {
            tokio::time::sleep(self.hold_delay).await;
            self.inner
                .hold(request_id, account, model, amount_micros)
                .await
        })
    }
    fn release(&self, request_id: RequestId) -> crate::ledger::LedgerFuture<'_, ()> {
        self.inner.release(request_id)
    }
    fn settle(&self, settlement: Settlement) -> crate::ledger::LedgerFuture<'_, SettleResult> {
        Box::pin(async move {
            if let Some(gate) = &self.settle_gate {
                gate.acquire().await.unwrap().forget();
            }
            self.inner.settle(settlement).await
        })
    }
    fn request_record(
        &self,
        request_id: RequestId,
    ) -> crate::ledger::LedgerFuture<'_, Option<crate::ledger::RequestRecord>> {
        self.inner.request_record(request_id)
    }
}

/// A streamed request of `account` through `svc`, read to its end.
async fn streamed<S: UpstreamService>(
    svc: Meter<S>,
    account: &'static str,
    id: &'static str,
) -> Result<(), BoxError> {
    let body = Bytes::from(serde_json::to_vec(&chat(true, None)).unwrap());
    let resp = svc
        .oneshot(chat_request(id, AccountId::from(account), body))
        .await?;
    frames(resp.into_body()).await;
    Ok(())
}

/// The [`MeterError`] of a refused request.
fn meter_error(e: &BoxError) -> Option<&MeterError> {
    e.downcast_ref::<MeterError>()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_behind_the_traffic_makes_new_requests_wait_before_their_hold() {
    let h = harness().await;
    for other in ["b", "c"] {
        let account = AccountId::from(other);
        h.ledger.create_account(&account).await.unwrap();
        let key = format!("credit-{other}");
        h.ledger
            .add_credits(&account, START_MICROS, &key)
            .await
            .unwrap();
    }
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let ledger = Arc::new(SlowLedger {
        inner: h.ledger.clone(),
        hold_delay: std::time::Duration::ZERO,
        settle_gate: Some(gate.clone()),
    });
    let body = capture_body("b_chat_stream_usage.txt");
    let layer = |max, wait| {
        MeterLayer::new(ledger.clone(), catalog(2048))
            .events(h.events.clone())
            .max_unsettled_requests(max, wait)
    };
    let node = || h.inner(200, "text/event-stream", reads_of(&body, 64), End::Eof);
    // a bound of 2, so a share of 1 an account: with `acct`'s answer unsettled, its next
    // request is refused at once (429), before its hold
    let short = layer(2, std::time::Duration::from_millis(100));
    let (settlements, svc) = (short.settlements(), short.layer(node()));
    streamed(svc.clone(), "acct", "a1").await.unwrap();
    assert_eq!(settlements.unsettled(), 1);
    let held = h.balance().await.held_micros;
    let refused = streamed(svc.clone(), "acct", "a2").await.unwrap_err();
    assert!(
        matches!(
            meter_error(&refused),
            Some(MeterError::AccountSettlementsBehind { limit: 1 })
        ),
        "{refused}"
    );
    assert_eq!(
        h.balance().await.held_micros,
        held,
        "no hold for the refused one"
    );
    // another account's request is taken (one of two); with two unsettled, a third account
    // waits, and past the wait is refused (503), before its hold
    streamed(svc.clone(), "b", "a3").await.unwrap();
    assert_eq!(settlements.unsettled(), 2);
    let refused = streamed(svc.clone(), "c", "a4").await.unwrap_err();
    assert!(
        matches!(
            meter_error(&refused),
            Some(MeterError::SettlementsBehind { limit: 2 })
        ),
        "{refused}"
    );
    gate.add_permits(2);
    settlements.drain().await;
    assert_eq!(settlements.unsettled(), 0);
    for (id, recorded) in [("a1", true), ("a2", false), ("a3", true), ("a4", false)] {
        assert_eq!(h.record(id).await.is_some(), recorded, "{id}");
    }
    // a long wait: the third account waits for a settlement, then is served
    let long = layer(2, std::time::Duration::from_secs(600));
    let (settlements, svc) = (long.settlements(), long.layer(node()));
    streamed(svc.clone(), "acct", "b1").await.unwrap();
    streamed(svc.clone(), "b", "b2").await.unwrap();
    let third = streamed(svc.clone(), "c", "b3");
    tokio::pin!(third);
    let early = tokio::time::timeout(std::time::Duration::from_millis(300), &mut third).await;
    assert!(early.is_err(), "served while the ledger was behind");
    assert_eq!(settlements.unsettled(), 2);
    gate.add_permits(1);
    third.await.unwrap();
    gate.add_permits(2);
    settlements.drain().await;
    assert!(h.record("b3").await.is_some());
    assert_eq!(h.balance().await.held_micros, 0);
    assert_eq!(h.ledger.entries_sum_micros().await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_leaving_at_any_point_never_strands_a_hold() {
    // 300 streamed requests, each dropped 0–3 ms after it was sent (while its hold is being
    // placed, at the node, or mid-stream): every hold is released while the gateway runs
    let h = harness().await;
    let ledger = Arc::new(SlowLedger {
        inner: h.ledger.clone(),
        hold_delay: std::time::Duration::from_millis(1),
        settle_gate: None,
    });
    let layer = MeterLayer::new(ledger, catalog(2048)).events(h.events.clone());
    let settlements = layer.settlements();
    let body = capture_body("b_chat_stream_usage.txt");
    let svc = layer.layer(h.inner(200, "text/event-stream", reads_of(&body, 64), End::Hang));
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for i in 0..300 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let after = std::time::Duration::from_micros(seed % 3_000);
        let svc = svc.clone();
        let fut = async move {
            let resp = svc
                .oneshot(request(&format!("c{i}"), &chat(true, None)))
                .await?;
            frames(resp.into_body()).await;
            Ok::<_, BoxError>(())
        };
        let _ = tokio::time::timeout(after, fut).await;
    }
    // everything that was held settles (the tasks are tracked), and nothing stays held
    tokio::time::timeout(std::time::Duration::from_secs(30), settlements.drain())
        .await
        .unwrap();
    let b = h.balance().await;
    assert_eq!(b.held_micros, 0, "a hold was stranded");
    assert_eq!(h.ledger.entries_sum_micros().await.unwrap(), 0);
}

#[tokio::test]
async fn an_account_that_cannot_pay_is_refused_before_counting_next_time() {
    let h = harness().await;
    let poor = AccountId::from("poor");
    h.ledger.create_account(&poor).await.unwrap();
    let svc = h
        .layer(2048)
        .layer(h.inner(200, "text/event-stream", Vec::new(), End::Eof));
    let mut req = request("p1", &chat(false, None));
    req.extensions_mut().insert(poor.clone());
    let err = svc.clone().oneshot(req).await.unwrap_err();
    assert!(matches!(
        err.downcast_ref::<MeterError>(),
        Some(MeterError::InsufficientCredit {
            available_micros: 0,
            ..
        })
    ));
    // the next one is refused from memory, before its body is even read: a body that is not
    // JSON would otherwise be a 400
    let req = chat_request("p2", poor.clone(), Bytes::from_static(b"not json"));
    let err = svc.clone().oneshot(req).await.unwrap_err();
    assert!(matches!(
        err.downcast_ref::<MeterError>(),
        Some(MeterError::InsufficientCredit {
            available_micros: 0,
            needed_micros: 3
        })
    ));
    // another account with nothing, sending a large prompt first: its balance is read before
    // the prompt is counted (the prompt is over the context too: it is never counted)
    let broke = AccountId::from("broke");
    h.ledger.create_account(&broke).await.unwrap();
    let mut big = chat(false, None);
    big["messages"][0]["content"] = json!("word ".repeat(40_000));
    let mut req = request("b1", &big);
    req.extensions_mut().insert(broke);
    let err = svc.clone().oneshot(req).await.unwrap_err();
    assert!(matches!(
        err.downcast_ref::<MeterError>(),
        Some(MeterError::InsufficientCredit {
            available_micros: 0,
            needed_micros: 3
        })
    ));
    // after the memory's TTL, the request is judged again (here: a 400 for the body)
    tokio::time::sleep(REFUSED_CREDIT_TTL).await;
    let req = chat_request("p3", poor, Bytes::from_static(b"not json"));
    let err = svc.oneshot(req).await.unwrap_err();
    assert!(matches!(
        err.downcast_ref::<MeterError>(),
        Some(MeterError::BadRequest(_))
    ));
}

/// A request body that declares `declared` bytes and never sends one: polling it waits forever.
struct NeverSent {
    declared: u64,
}

impl http_body::Body for NeverSent {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        std::task::Poll::Pending
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.declared)
    }
}

#[tokio::test]
async fn with_refuse_unread_bodies_an_account_that_cannot_pay_is_refused_without_reading_its_body()
{
    let h = harness().await;
    let svc = h
        .layer(2048)
        .refused_credit_delay(std::time::Duration::ZERO)
        .refuse_unread_bodies(true)
        .layer(h.inner(200, "text/event-stream", Vec::new(), End::Eof));
    let broke = AccountId::from("broke");
    h.ledger.create_account(&broke).await.unwrap();
    let never_sent = |id: &str, declared: u64| {
        let mut req = http::Request::post("/v1/chat/completions")
            .body(BoxBody::new(NeverSent { declared }))
            .unwrap();
        req.extensions_mut().insert(RequestId::from(id));
        req.extensions_mut().insert(broke.clone());
        req
    };
    let refused = |res: Result<http::Response<BoxBody>, BoxError>| match res {
        Err(e) => matches!(
            e.downcast_ref::<MeterError>(),
            Some(MeterError::InsufficientCredit {
                available_micros: 0,
                needed_micros: 3
            })
        ),
        Ok(_) => false,
    };
    // the first request declares a large body (4 MiB): the balance is read before the body,
    // which is never waited for (reading it would wait forever)
    let first = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        svc.clone().oneshot(never_sent("u1", 4 << 20)),
    )
    .await
    .expect("the refusal waited for the body");
    assert!(refused(first));
    // then, remembered: a large body is refused unread, a small one read first (its
    // connection stays open for the next request)
    let again = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        svc.clone().oneshot(never_sent("u2", 4 << 20)),
    )
    .await
    .expect("the remembered refusal waited for the body");
    assert!(refused(again));
    let small = chat_request("u3", broke.clone(), Bytes::from_static(b"not json"));
    assert!(refused(svc.clone().oneshot(small).await));
    // nothing was held or recorded for the account
    assert_eq!(h.ledger.account(&broke).await.unwrap().held_micros, 0);
}

/// An audit tap that keeps what it is offered.
#[derive(Default)]
struct Tap(Mutex<Vec<crate::audit::AuditSample>>);

impl crate::audit::AuditTap for Tap {
    fn max_completion_bytes(&self) -> usize {
        12
    }
    fn offer(&self, sample: crate::audit::AuditSample) {
        self.0.lock().unwrap().push(sample);
    }
}

#[tokio::test]
async fn completed_requests_offer_choice_zero_text_to_the_audit_tap_and_nothing_else_does() {
    let mut h = harness().await;
    let tap = Arc::new(Tap::default());
    let chunk = |index: u64, delta: Value, finish: Value| {
        format!(
            "data: {}\n\n",
            json!({"id":"c","object":"chat.completion.chunk","created":1,"model":"smollm2",
                "choices":[{"index":index,"delta":delta,"finish_reason":finish}]})
        )
    };
    let streamed = [
        chunk(
            0,
            json!({"role":"assistant","content":"Red, "}),
            Value::Null,
        ),
        chunk(0, json!({"content":"green and blue."}), Value::Null),
        chunk(0, json!({}), json!("stop")),
        "data: [DONE]\n\n".to_owned(),
    ]
    .concat();
    // streamed, completed: choice 0's text, cut at the tap's 12 bytes
    let svc = h.audited(tap.clone(), "text/event-stream", streamed.clone(), End::Eof);
    let resp = svc.oneshot(request("a1", &chat(true, None))).await.unwrap();
    frames(resp.into_body()).await;
    assert_eq!(h.settled().await.0.outcome, StreamOutcome::Completed);
    {
        let got = tap.0.lock().unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].completion, "Red, green a");
        assert_eq!(got[0].node, h.node);
        assert_eq!(got[0].request_id, RequestId::from("a1"));
        assert_eq!(got[0].kind, spine_core::RequestKind::ChatCompletions);
        let body: Value = serde_json::from_slice(&got[0].request_body).unwrap();
        assert_eq!(body["messages"][0]["content"], "Name three colors.");
    }
    // non-streamed, completed
    let json_body = json!({"id":"c","object":"chat.completion","created":1,"model":"smollm2",
        "choices":[{"index":0,"message":{"role":"assistant","content":"Blue."},"finish_reason":"stop"}],
        "usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}});
    let svc = h.audited(
        tap.clone(),
        "application/json",
        json_body.to_string(),
        End::Eof,
    );
    let resp = svc
        .oneshot(request("a2", &chat(false, None)))
        .await
        .unwrap();
    resp.into_body().collect().await.unwrap();
    assert_eq!(h.settled().await.0.outcome, StreamOutcome::Completed);
    assert_eq!(tap.0.lock().unwrap()[1].completion, "Blue.");
    // a stream the node broke (no finish): settled upstream_failed, never offered
    let broken = chunk(0, json!({"content":"Red"}), Value::Null);
    let svc = h.audited(tap.clone(), "text/event-stream", broken, End::Error);
    let resp = svc.oneshot(request("a3", &chat(true, None))).await.unwrap();
    frames(resp.into_body()).await;
    assert_eq!(h.settled().await.0.outcome, StreamOutcome::UpstreamFailed);
    // a reply with reasoning: not plain text, never offered
    let reasoning = [
        chunk(0, json!({"reasoning_content":"hmm"}), Value::Null),
        chunk(0, json!({"content":"Red."}), json!("stop")),
        "data: [DONE]\n\n".to_owned(),
    ]
    .concat();
    let svc = h.audited(tap.clone(), "text/event-stream", reasoning, End::Eof);
    let resp = svc.oneshot(request("a4", &chat(true, None))).await.unwrap();
    frames(resp.into_body()).await;
    assert_eq!(h.settled().await.0.outcome, StreamOutcome::Completed);
    assert_eq!(
        tap.0.lock().unwrap().len(),
        2,
        "only the two completed plain replies"
    );
}

// --- stalls: a node alive without progress, a non-streamed body that trickles -----------------

/// A node body that sends each event of `script` `every` apart, then (when `cycle` is not
/// empty) the events of `cycle` in turn, `every` apart, forever; ends after `script` otherwise.
fn timed(
    script: Vec<Bytes>,
    cycle: Vec<Bytes>,
    every: std::time::Duration,
) -> impl Body<Data = Bytes, Error = BoxError> + Send + 'static {
    let mut script = VecDeque::from(script);
    let mut next = 0;
    let mut sleep: Option<Pin<Box<tokio::time::Sleep>>> = None;
    body_fn(move |cx| {
        if script.is_empty() && cycle.is_empty() {
            return Poll::Ready(None);
        }
        let sleep = sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(every)));
        if std::future::Future::poll(sleep.as_mut(), cx).is_pending() {
            return Poll::Pending;
        }
        sleep.as_mut().reset(tokio::time::Instant::now() + every);
        let event = match script.pop_front() {
            Some(e) => e,
            None => {
                let i = next % cycle.len();
                next += 1;
                cycle[i].clone()
            }
        };
        Poll::Ready(Some(Ok(Frame::data(event))))
    })
}

fn chunk_event(choice: Value) -> Bytes {
    let chunk = json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"smollm2",
        "choices":[choice]});
    Bytes::from(format!("data: {chunk}\n\n"))
}

/// [`chunk_event`] of choice `index` with `delta` and `finish_reason` `finish`, as text.
fn delta_event(index: u64, delta: Value, finish: Value) -> String {
    let chunk = json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"smollm2",
        "choices":[{"index":index,"delta":delta,"finish_reason":finish}]});
    format!("data: {chunk}\n\n")
}

/// What a hostile node keeps a stream alive with, none of it progress: a comment, an empty
/// delta, a role-only chunk, a usage-only chunk, a chunk with no choice.
fn keepalive_without_progress() -> Vec<Bytes> {
    vec![
        Bytes::from_static(b": still here\n\n"),
        chunk_event(json!({"index":0,"delta":{"content":""},"finish_reason":null})),
        chunk_event(json!({"index":0,"delta":{"role":"assistant"},"finish_reason":null})),
        Bytes::from(format!(
            "data: {}\n\n",
            json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"smollm2",
                "choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}})
        )),
        chunk_event(json!({"index":0,"delta":{},"finish_reason":null})),
    ]
}

/// The events of a caller's stream `got` that the gateway cut for the node's fault: no
/// `[DONE]`, and last an error event (`upstream_failed`, `upstream_error`) whose message
/// contains `why`.
fn ended_with_upstream_error(got: &[u8], why: &str) -> Vec<crate::sse::SseEvent> {
    let events = crate::sse::parse_all(got).unwrap();
    assert!(events.iter().all(|e| e.data() != "[DONE]"));
    let last: Value = serde_json::from_str(events.last().unwrap().data()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_failed", "{last}");
    assert_eq!(last["error"]["type"], "upstream_error", "{last}");
    assert!(
        last["error"]["message"].as_str().unwrap().contains(why),
        "{last}"
    );
    events
}

/// The events of a caller's stream `got` that a stall cut (a node that made no progress).
fn ended_as_stalled(got: &[u8]) -> Vec<crate::sse::SseEvent> {
    ended_with_upstream_error(got, "no progress")
}

#[tokio::test]
async fn a_stream_alive_without_progress_is_cut_as_stalled_with_the_delivered_tokens_recorded() {
    let mut h = harness().await;
    // real time (the SQLite ledger's worker thread and a paused clock do not mix): short bounds
    let stall = std::time::Duration::from_millis(600);
    let (svc, slot) = h.slot_node(
        h.layer(2048).stream_stall_timeout(stall),
        "text/event-stream",
        || {
            timed(
                vec![
                    chunk_event(
                        json!({"index":0,"delta":{"role":"assistant"},"finish_reason":null}),
                    ),
                    content_event("Hello there"),
                ],
                keepalive_without_progress(),
                std::time::Duration::from_millis(50),
            )
        },
    );
    let started = tokio::time::Instant::now();
    let resp = svc
        .oneshot(request("stalled", &chat(true, Some(true))))
        .await
        .unwrap();
    let got = frames(resp.into_body()).await.concat();
    let took = started.elapsed();
    // cut once the bound passed after the last text (sent at 0.1 s), not before
    assert!(took >= stall, "{took:?}");
    assert!(took < stall * 8, "{took:?}");
    let events = ended_as_stalled(&got);
    let delivered: String = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e.data()).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(delivered, "Hello there");
    let (s, _) = h.settled().await;
    assert_eq!(s.outcome, StreamOutcome::UpstreamFailed);
    // the record keeps what was delivered; the caller pays nothing for a failed stream
    assert_eq!(
        s.billed.completion_tokens,
        smollm_tokenizer().count_text("Hello there")
    );
    assert_eq!(node_fault(&slot), Some(spine_core::NodeFault::Stalled));
    h.assert_account_untouched().await;
}

/// A node that keeps the gateway busy — each of its frames costs the gateway time to take in
/// (here 10 ms, a sleep inside the node body's poll), a frame that makes no progress every
/// other poll — is cut at the stall bound: the time a poll spends on the node's bytes is the
/// node's, not the caller's. (With the hand-out stamped at the poll's start, that time was
/// credited as the caller's and the stream ran on to the total bound: this test timed out.)
#[tokio::test]
async fn a_node_that_keeps_the_gateway_busy_without_progress_is_cut_as_stalled() {
    let mut h = harness().await;
    let stall = std::time::Duration::from_millis(300);
    let (svc, slot) = h.slot_node(
        h.layer(2048).stream_stall_timeout(stall),
        "text/event-stream",
        || {
            let mut script = VecDeque::from(vec![
                chunk_event(json!({"index":0,"delta":{"role":"assistant"},"finish_reason":null})),
                content_event("Hello there"),
            ]);
            let idle =
                chunk_event(json!({"index":0,"delta":{"role":"assistant"},"finish_reason":null}));
            let mut ready = false;
            body_fn(move |cx| {
                ready = !ready;
                if !ready {
                    // yield, so the runtime's timers run (no time passes here)
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
                let event = script.pop_front().unwrap_or_else(|| idle.clone());
                Poll::Ready(Some(Ok(Frame::data(event))))
            })
        },
    );
    let resp = svc
        .oneshot(request("busy-stall", &chat(true, Some(true))))
        .await
        .unwrap();
    // far above the bound: only a stream that is never cut reaches it
    let got = tokio::time::timeout(stall * 100, frames(resp.into_body()))
        .await
        .expect("the stream was not cut at the stall bound")
        .concat();
    ended_as_stalled(&got);
    assert_eq!(h.settled().await.0.outcome, StreamOutcome::UpstreamFailed);
    assert_eq!(node_fault(&slot), Some(spine_core::NodeFault::Stalled));
    h.assert_account_untouched().await;
}

#[tokio::test]
async fn a_slow_caller_does_not_make_a_progressing_node_look_stalled() {
    let mut h = harness().await;
    let stall = std::time::Duration::from_millis(400);
    let mut script: Vec<Bytes> = (0..6).map(|i| content_event(&format!(" w{i}"))).collect();
    script.push(chunk_event(
        json!({"index":0,"delta":{},"finish_reason":"stop"}),
    ));
    script.push(Bytes::from_static(b"data: [DONE]\n\n"));
    let (svc, slot) = h.slot_node(
        h.layer(2048).stream_stall_timeout(stall),
        "text/event-stream",
        move || {
            let mut script = script.clone();
            // keepalives between every two texts: not progress, not a stall either
            let mut with_pings = Vec::new();
            for e in script.drain(..) {
                with_pings.push(Bytes::from_static(b": ping\n\n"));
                with_pings.push(e);
            }
            timed(with_pings, Vec::new(), std::time::Duration::from_millis(60))
        },
    );
    let resp = svc
        .oneshot(request("slow-reader", &chat(true, None)))
        .await
        .unwrap();
    let mut body = resp.into_body();
    let mut got = Vec::new();
    while let Some(f) = body.frame().await {
        got.extend_from_slice(&f.unwrap().into_data().unwrap());
        // the caller takes 0.5 s over each frame: past the stall bound
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    let events = crate::sse::parse_all(&got).unwrap();
    assert_eq!(events.last().unwrap().data(), "[DONE]");
    let (s, _) = h.settled().await;
    assert_eq!(s.outcome, StreamOutcome::Completed);
    assert_eq!(node_fault(&slot), None);
}

#[tokio::test]
async fn a_non_streamed_body_that_trickles_is_cut_at_its_total_bound() {
    let mut h = harness().await;
    let bound = std::time::Duration::from_millis(500);
    let (svc, slot) = h.slot_node(
        h.layer(2048).response_body_timeout(bound),
        "application/json",
        || {
            // a byte every 50 ms, forever: never idle, never whole
            timed(
                vec![Bytes::from_static(b"{\"id\":\"x\",")],
                vec![Bytes::from_static(b" ")],
                std::time::Duration::from_millis(50),
            )
        },
    );
    let started = tokio::time::Instant::now();
    let err = svc
        .oneshot(request("trickle", &chat(false, None)))
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(took >= bound && took < bound * 8, "{took:?}");
    let err = err.downcast::<MeterError>().unwrap();
    assert!(matches!(*err, MeterError::UpstreamInvalid(_)), "{err:?}");
    let (s, _) = h.settled().await;
    assert_eq!(s.outcome, StreamOutcome::UpstreamFailed);
    assert_eq!(node_fault(&slot), Some(spine_core::NodeFault::Broke));
    h.assert_account_untouched().await;
}

// --- counting stops early: a prompt that cannot fit or cannot be paid for ------------------

#[tokio::test]
async fn a_large_prompt_past_the_context_or_the_balance_is_refused_before_it_is_all_counted() {
    let h = harness().await;
    let text = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. ".repeat(50_000); // 2.9 MB
    let body =
        json!({"model":"smollm2","max_tokens":8,"messages":[{"role":"user","content":text}]});
    // past the context: 400, counting stopped
    let svc = h
        .layer(4096)
        .layer(h.inner(200, "text/event-stream", Vec::new(), End::Eof));
    let err = svc.oneshot(request("ctx", &body)).await.unwrap_err();
    match err.downcast_ref::<MeterError>() {
        Some(&MeterError::PromptOverContext {
            at_least_tokens,
            max_context_tokens: 4096,
        }) => assert!(at_least_tokens >= 4096, "{at_least_tokens}"),
        other => panic!("{other:?}"),
    }
    // within a huge context, but past what the balance pays (100 000 micros at 1 micro a
    // prompt token: 100 000 tokens; the prompt is ~600 000): 402, counting stopped
    let svc = h
        .layer(10_000_000)
        .layer(h.inner(200, "text/event-stream", Vec::new(), End::Eof));
    let err = svc.oneshot(request("poor", &body)).await.unwrap_err();
    match err.downcast_ref::<MeterError>() {
        Some(&MeterError::InsufficientCredit {
            available_micros: START_MICROS,
            needed_micros,
        }) => assert!(needed_micros > START_MICROS, "{needed_micros}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(h.upstream.lock().unwrap().as_ref(), None);
    for id in ["ctx", "poor"] {
        assert_eq!(h.record(id).await, None);
    }
    h.assert_account_untouched().await;
}

// --- embeddings: an answer outside OpenAI's shape is the node's fault -------------------------

#[tokio::test]
async fn an_invalid_embeddings_answer_is_the_nodes_fault_and_free() {
    let mut h = harness().await;
    let valid = r#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]},{"object":"embedding","index":1,"embedding":[0.3,0.4]}],"model":"smollm2","usage":{"prompt_tokens":4,"total_tokens":4}}"#;
    let invalid = [
        r#"{"object":"list","data":[{"index":0,"embedding":[0.1,0.2]}]}"#,
        r#"{"object":"list","data":[{"index":0,"embedding":["a","b"]},{"index":1,"embedding":[1,2]}]}"#,
        r#"{"object":"list","data":[{"index":0,"embedding":[1,2]},{"index":0,"embedding":[1,2]}]}"#,
        r#"{"object":"list","data":[{"index":0,"embedding":[1,2]},{"index":1,"embedding":[1]}]}"#,
        r#"{"embeddings":[[1,2],[3,4]]}"#,
        r#"[[1,2],[3,4]]"#,
    ];
    for (i, answer) in std::iter::once(valid).chain(invalid).enumerate() {
        let body = Bytes::from_static(answer.as_bytes());
        let (svc, slot) = h.slot_node(h.layer(2048), "application/json", move || {
            full(body.clone())
        });
        let json = json!({"model":"smollm2","input":["red","green"]});
        let mut req = http::Request::post("/v1/embeddings")
            .body(full(json.to_string()))
            .unwrap();
        let id = format!("emb{i}");
        req.extensions_mut().insert(RequestId::from(id.as_str()));
        req.extensions_mut().insert(AccountId::from("acct"));
        let got = svc.oneshot(req).await;
        let (s, _) = h.settled().await;
        let fault = node_fault(&slot);
        if i == 0 {
            assert!(got.is_ok());
            assert_eq!(s.outcome, StreamOutcome::Completed);
            assert_eq!(fault, None);
            continue;
        }
        let err = got.unwrap_err();
        assert!(
            matches!(
                err.downcast_ref::<MeterError>(),
                Some(MeterError::UpstreamInvalid(_))
            ),
            "{answer}: {err}"
        );
        assert_eq!(s.outcome, StreamOutcome::UpstreamFailed, "{answer}");
        assert_eq!(fault, Some(spine_core::NodeFault::Broke), "{answer}");
    }
    // only the valid answer was paid
    let a = h.balance().await;
    assert_eq!(a.held_micros, 0);
    let paid = h.record("emb0").await.unwrap();
    assert_eq!(START_MICROS - a.balance_micros, paid.debit_micros);
}

mod answer;
mod choices;
mod embeddings;
mod surface;

/// An audit tap that audits `smollm2` on its nodes' own logprobs.
#[derive(Default)]
struct LogprobsTap(Mutex<Vec<crate::audit::AuditSample>>);

impl crate::audit::AuditTap for LogprobsTap {
    fn max_completion_bytes(&self) -> usize {
        4096
    }
    fn offer(&self, sample: crate::audit::AuditSample) {
        self.0.lock().unwrap().push(sample);
    }
    fn node_logprobs(&self, model: &spine_core::ModelId) -> bool {
        model.as_str() == "smollm2"
    }
    fn max_node_tokens(&self) -> usize {
        2
    }
}

/// A llama.cpp logprobs member for one token.
fn lp(token: &str, logprob: f64) -> Value {
    json!({"content":[{"id":1,"token":token,"bytes":token.as_bytes(),"logprob":logprob,
        "top_logprobs":[{"id":1,"token":token,"bytes":token.as_bytes(),"logprob":logprob}]}]})
}

#[tokio::test]
async fn node_logprobs_are_asked_for_captured_and_never_reach_a_caller_who_did_not_ask() {
    let mut h = harness().await;
    let tap = Arc::new(LogprobsTap::default());
    // llama.cpp's chunk shape: the choice's logprobs member last, only when asked
    let chunk = |delta: Value, finish: Value, logprobs: Option<Value>| {
        let mut choice = json!({"finish_reason":finish,"index":0,"delta":delta});
        if let Some(l) = logprobs {
            choice["logprobs"] = l;
        }
        format!(
            "data: {}\n\n",
            json!({"choices":[choice],"created":1,"id":"c","model":"smollm2","object":"chat.completion.chunk"})
        )
    };
    let stream = |with: bool| {
        [
            chunk(
                json!({"content":"Red"}),
                Value::Null,
                with.then(|| lp("Red", -0.25)),
            ),
            chunk(
                json!({"content":","}),
                Value::Null,
                with.then(|| lp(",", -1.5)),
            ),
            chunk(
                json!({"content":" blue"}),
                Value::Null,
                with.then(|| lp(" blue", -2.0)),
            ),
            chunk(json!({}), json!("stop"), None),
            "data: [DONE]\n\n".to_owned(),
        ]
        .concat()
    };
    // the caller did not ask: asked for upstream, captured (bounded at the tap's 2), stripped
    let svc = h.audited(tap.clone(), "text/event-stream", stream(true), End::Eof);
    let resp = svc
        .oneshot(request("l1", &chat(true, Some(false))))
        .await
        .unwrap();
    let got: Vec<u8> = frames(resp.into_body()).await.concat();
    let forwarded: Value =
        serde_json::from_slice(h.upstream.lock().unwrap().as_ref().unwrap()).unwrap();
    assert_eq!(
        (
            forwarded["logprobs"].clone(),
            forwarded["top_logprobs"].clone()
        ),
        (json!(true), json!(1))
    );
    h.settled().await;
    assert_eq!(String::from_utf8(got).unwrap(), stream(false));
    {
        let samples = tap.0.lock().unwrap();
        let node = samples[0].node_logprobs.as_ref().unwrap();
        assert!(node.is_usable());
        let claims: Vec<(&[u8], f64)> = node
            .tokens
            .iter()
            .map(|t| (&t.bytes[..], t.logprob))
            .collect();
        assert_eq!(claims, vec![(&b"Red"[..], -0.25), (&b","[..], -1.5)]);
        assert_eq!(samples[0].completion, "Red, blue");
    }
    // non-streamed: the choice's logprobs member removed, the answer otherwise the node's
    let answer = |with: bool| {
        let mut choice = json!({"finish_reason":"stop","index":0,"message":{"role":"assistant","content":"Red"}});
        if with {
            choice["logprobs"] = lp("Red", -0.25);
        }
        json!({"choices":[choice],"created":1,"model":"smollm2","object":"chat.completion",
            "usage":{"completion_tokens":1,"prompt_tokens":1,"total_tokens":2},"id":"c"})
    };
    let svc = h.audited(
        tap.clone(),
        "application/json",
        answer(true).to_string(),
        End::Eof,
    );
    let resp = svc
        .oneshot(request("l2", &chat(false, None)))
        .await
        .unwrap();
    let body: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    h.settled().await;
    assert_eq!(body["choices"], answer(false)["choices"]);
    assert_eq!(
        tap.0.lock().unwrap()[1]
            .node_logprobs
            .as_ref()
            .unwrap()
            .tokens
            .len(),
        1
    );
    // a caller who asked gets them, and the capture reads them; nothing injected
    let mut asked = chat(false, None);
    asked["logprobs"] = json!(true);
    let svc = h.audited(
        tap.clone(),
        "application/json",
        answer(true).to_string(),
        End::Eof,
    );
    let resp = svc.oneshot(request("l3", &asked)).await.unwrap();
    let body: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    h.settled().await;
    assert_eq!(body["choices"], answer(true)["choices"]);
    let forwarded: Value =
        serde_json::from_slice(h.upstream.lock().unwrap().as_ref().unwrap()).unwrap();
    assert!(forwarded.get("top_logprobs").is_none());
    assert!(tap.0.lock().unwrap()[2]
        .node_logprobs
        .as_ref()
        .unwrap()
        .is_usable());
    // a node that sent none although asked: captured as such (the auditor's one event)
    let svc = h.audited(
        tap.clone(),
        "application/json",
        answer(false).to_string(),
        End::Eof,
    );
    let resp = svc
        .oneshot(request("l4", &chat(false, None)))
        .await
        .unwrap();
    resp.into_body().collect().await.unwrap();
    h.settled().await;
    let samples = tap.0.lock().unwrap();
    let none = samples[3].node_logprobs.as_ref().unwrap();
    assert!(!none.seen && !none.is_usable());
}

/// Text an honest engine generated within its cap may COUNT more tokens than the cap: a
/// caller's `logit_bias {"478": 13}` makes llama.cpp write `"ell"` (token 478) over and over,
/// one token each, about 1.5 tokens each when counted. Judged on the fewest tokens that spell
/// it, such a stream is within the cap: completed, billed the cap (what was generated), no
/// fault and no discrepancy for the node. (Judged on the count, it was cut as the node's
/// fault and settled `upstream_failed`: the caller paid nothing for what it read.)
#[tokio::test]
async fn text_that_counts_past_the_cap_but_spells_within_it_is_billed_not_cut() {
    const CAP: u64 = 64;
    let mut stream = Vec::new();
    for _ in 0..CAP {
        stream.extend_from_slice(&content_event("ell"));
    }
    let last = json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"smollm2",
        "choices":[{"index":0,"delta":{},"finish_reason":"length"}]});
    stream.extend_from_slice(format!("data: {last}\n\ndata: [DONE]\n\n").as_bytes());
    let stream = Bytes::from(stream);
    let tok = smollm_tokenizer();
    let text = "ell".repeat(CAP as usize);
    // past the cap and its slack (64 + 16) as counted, within it at the fewest
    assert!(tok.count_generated_text(&text) > CAP + 16);
    assert!(tok.count_generated_text_and_fewest(&text).1 <= CAP);
    let mut h = harness().await;
    let (svc, slot) = h.slot_node(h.layer(2048), "text/event-stream", move || {
        full(stream.clone())
    });
    let mut req = chat(true, None);
    req["max_tokens"] = json!(CAP);
    let resp = svc.oneshot(request("ell", &req)).await.unwrap();
    let got = frames(resp.into_body()).await.concat();
    let events = crate::sse::parse_all(&got).unwrap();
    assert_eq!(events.last().unwrap().data(), "[DONE]");
    let mut delivered = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e.data()).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        delivered.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    assert_eq!(delivered, text);
    let (s, r) = h.settled().await;
    assert_eq!(s.outcome, StreamOutcome::Completed);
    assert_eq!(s.billed.completion_tokens, CAP);
    assert!(!s.discrepancy);
    // 34 prompt tokens × 1 µ + 64 × 2 µ = 162 µ; the operator's 70 % floored: 113 µ
    assert_eq!((r.debit_micros, r.operator_credit_micros), (162, 113));
    assert_eq!(node_fault(&slot), None);
}

/// Tool calls an SDK cannot read are the node's fault, as any other malformed chunk: a call
/// whose first delta lacks its `id` or `type`, or that never gets a function `name` (the SDK
/// shows `None`s, the Responses API a nameless call; a name in a later delta is fine, as
/// llama.cpp may send it), calls that skip an index (the SDK's stream helper indexes a list by
/// it: `IndexError`), a streamed call without `index`; and in a complete answer, a call without
/// `id`, `type` or `name`. Settled `upstream_failed` (nothing paid), node
/// faulted. Calls begun in order, continued by argument-only deltas, complete.
#[tokio::test]
async fn tool_calls_an_sdk_cannot_read_are_the_nodes_fault() {
    let chunk = |delta: Value, finish: Value| delta_event(0, delta, finish);
    let call = |index: u64, id: &str, name: &str, args: &str| {
        json!({"index": index, "id": id, "type": "function",
            "function": {"name": name, "arguments": args}})
    };
    let more = |index: u64, args: &str| json!({"index": index, "function": {"arguments": args}});
    let end = chunk(json!({}), json!("tool_calls")) + "data: [DONE]\n\n";
    let streams = [
        // a gap: 0, then 3
        (
            vec![
                json!({"tool_calls": [call(0, "a", "f", "{}")]}),
                json!({"tool_calls": [call(3, "b", "g", "{}")]}),
            ],
            Some("before tool call 1"),
        ),
        // a call begun without id, type and name
        (
            vec![json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"x\":1}"}}]})],
            Some("without its id"),
        ),
        // no index
        (
            vec![
                json!({"tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
            ],
            Some("has no index"),
        ),
        // in order, continued: fine
        (
            vec![
                json!({"tool_calls": [call(0, "a", "f", "")]}),
                json!({"tool_calls": [more(0, "{\"x\":")]}),
                json!({"tool_calls": [more(0, "1}"), call(1, "b", "g", "{}")]}),
            ],
            None,
        ),
        // named in a later delta, as llama.cpp does once its parser has read the name: fine
        (
            vec![
                json!({"tool_calls": [{"index": 0, "id": "a", "type": "function"}]}),
                json!({"tool_calls": [call(0, "a", "get_weather", "{}")]}),
            ],
            None,
        ),
        // never named
        (
            vec![
                json!({"tool_calls": [{"index": 0, "id": "a", "type": "function", "function": {"arguments": "{}"}}]}),
            ],
            Some("never named tool call 0"),
        ),
        // a call continued after the next began (the Python helper had announced it done)
        (
            vec![
                json!({"tool_calls": [call(0, "a", "f", "{")]}),
                json!({"tool_calls": [call(1, "b", "g", "{}")]}),
                json!({"tool_calls": [more(0, "}")]}),
            ],
            Some("after tool call 1 began"),
        ),
    ];
    for (deltas, fault) in streams {
        let body: String = deltas
            .iter()
            .map(|d| chunk(d.clone(), Value::Null))
            .collect::<String>()
            + &end;
        let body = Bytes::from(body);
        let mut h = harness().await;
        let (svc, slot) = h.slot_node(h.layer(2048), "text/event-stream", move || {
            full(body.clone())
        });
        let resp = svc
            .oneshot(request("calls", &chat(true, None)))
            .await
            .unwrap();
        let got = frames(resp.into_body()).await.concat();
        let events = crate::sse::parse_all(&got).unwrap();
        let last: Value = serde_json::from_str(events.last().unwrap().data()).unwrap_or_default();
        let (s, r) = h.settled().await;
        match fault {
            Some(why) => {
                let message = last["error"]["message"].as_str().unwrap_or_default();
                assert!(message.contains(why), "{why}: {last}");
                assert_eq!(
                    (s.outcome, r.debit_micros),
                    (StreamOutcome::UpstreamFailed, 0)
                );
                assert!(node_fault(&slot).is_some());
            }
            None => {
                assert_eq!(events.last().unwrap().data(), "[DONE]");
                assert_eq!(s.outcome, StreamOutcome::Completed);
                assert_eq!(node_fault(&slot), None);
            }
        }
    }
    // a complete answer's call without its id: a 502, nothing paid
    let answer = json!({"id":"c1","object":"chat.completion","created":1,"model":"smollm2",
        "choices":[{"index":0,"finish_reason":"tool_calls","message":{"role":"assistant",
            "content":null,"tool_calls":[{"type":"function","function":{"name":"f","arguments":"{}"}}]}}],
        "usage":{"prompt_tokens":34,"completion_tokens":5,"total_tokens":39}});
    let answer = Bytes::from(answer.to_string());
    let mut h = harness().await;
    let (svc, slot) = h.slot_node(h.layer(2048), "application/json", move || {
        full(answer.clone())
    });
    let err = svc
        .oneshot(request("answer", &chat(false, None)))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("lacks its id"), "{err}");
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, r.debit_micros),
        (StreamOutcome::UpstreamFailed, 0)
    );
    assert!(slot.lock().unwrap().as_ref().unwrap().node_fault_reported());
}

/// A tool call as an SDK shows it: `(id, name, arguments)`.
type SdkCall = (String, String, String);

/// What the official SDKs make of a streamed chat answer's tool calls: the Python SDK's
/// `accumulate_delta` appends every `id` and `name` string (and asserts a `function` in every
/// delta), the Node SDK's `ChatCompletionStream` keeps the last one. `(id, name, arguments)`
/// per call, for each SDK; `None` when the Python helper would fail.
fn sdk_tool_calls(events: &[u8]) -> (Option<Vec<SdkCall>>, Vec<SdkCall>) {
    let (mut python, mut node) = (Some(Vec::<SdkCall>::new()), Vec::<SdkCall>::new());
    // the Python SDK keeps `None` for arguments no delta carried
    let mut python_arguments = std::collections::BTreeSet::new();
    for event in crate::sse::parse_all(events).unwrap() {
        let Ok(c) = serde_json::from_str::<Value>(event.data()) else {
            continue;
        };
        for call in c["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let i = call["index"].as_u64().unwrap() as usize;
            let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            let (id, name, args) = (
                text(&call["id"]),
                text(&call["function"]["name"]),
                text(&call["function"]["arguments"]),
            );
            if call.get("function").is_none_or(Value::is_null) {
                python = None;
            }
            if call["function"]["arguments"].is_string() {
                python_arguments.insert(i);
            }
            if let Some(p) = python.as_mut() {
                if p.len() <= i {
                    p.resize(i + 1, Default::default());
                }
                p[i].0.push_str(&id);
                p[i].1.push_str(&name);
                p[i].2.push_str(&args);
            }
            if node.len() <= i {
                node.resize(i + 1, Default::default());
            }
            if !id.is_empty() {
                node[i].0 = id;
            }
            if !name.is_empty() {
                node[i].1 = name;
            }
            node[i].2.push_str(&args);
        }
    }
    if let Some(p) = python.as_mut() {
        for (i, call) in p.iter_mut().enumerate() {
            if !python_arguments.contains(&i) {
                call.2 = "None".to_owned();
            }
        }
    }
    (python, node)
}

/// However a node spells a streamed call's head — llama.cpp re-sends a grown name whole
/// (`compute_diffs`) and re-sends id and name when the id changes; a node may send later
/// names, ids, a `type` null, a delta without `function`, arguments before the name, a call
/// without arguments — the forwarded stream reads the same in both official SDKs (the Python
/// SDK appends what the Node SDK replaces): one id, the whole name, the arguments. A name the
/// gateway removed is not billed: a node padding later names is billed as the clean stream.
#[tokio::test]
async fn a_tool_calls_head_reads_alike_in_both_sdks() {
    let chunk = |call: Value, finish: Value| delta_event(0, json!({"tool_calls": [call]}), finish);
    let end = delta_event(0, json!({}), json!("tool_calls")) + "data: [DONE]\n\n";
    let head = |name: &str, args: &str| {
        json!({"index":0,"id":"call_1","type":"function",
        "function":{"name":name,"arguments":args}})
    };
    let later = |name: Option<&str>, args: &str| match name {
        Some(n) => json!({"index":0,"function":{"name":n,"arguments":args}}),
        None => json!({"index":0,"function":{"arguments":args}}),
    };
    let pad = "lorem ipsum dolor sit amet ".repeat(8);
    let want =
        |name: &str, args: &str| vec![("call_1".to_owned(), name.to_owned(), args.to_owned())];
    let cases: Vec<(&str, Vec<Value>, Vec<SdkCall>)> = vec![
        (
            "llama.cpp's grown name, re-sent whole with the id",
            vec![
                head("get", ""),
                json!({"index":0,"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":"}}),
                later(None, "\"Paris\"}"),
            ],
            want("get_weather", "{\"city\":\"Paris\"}"),
        ),
        (
            "a changed id and the same name after the arguments began",
            vec![
                head("get_weather", "{\"city\":"),
                json!({"index":0,"id":"call_2","type":"function","function":{"name":"get_weather","arguments":"\"Paris\"}"}}),
            ],
            want("get_weather", "{\"city\":\"Paris\"}"),
        ),
        (
            "padding names after the name was given",
            vec![
                head("get_weather", "{}"),
                later(Some(&pad), ""),
                later(Some(&pad), ""),
                later(Some("get_weather"), ""),
            ],
            want("get_weather", "{}"),
        ),
        (
            "arguments before the name, the name grown",
            vec![
                json!({"index":0,"id":"call_1","type":"function","function":{"arguments":"{}"}}),
                later(Some("get_wea"), ""),
                later(Some("get_weather"), ""),
            ],
            want("get_weather", "{}"),
        ),
        (
            "a call without arguments",
            vec![head("get_time", "")],
            want("get_time", ""),
        ),
        (
            "a call whose deltas never carry arguments",
            vec![json!({"index":0,"id":"call_1","type":"function","function":{"name":"get_time"}})],
            want("get_time", ""),
        ),
        (
            "a later delta with type null, one without function",
            vec![
                head("get_weather", "{"),
                json!({"index":0,"type":null,"function":{"arguments":"}"}}),
                json!({"index":0}),
            ],
            want("get_weather", "{}"),
        ),
    ];
    let clean = vec![head("get_weather", "{}")];
    let mut debits = Vec::new();
    for (case, deltas, want) in
        cases
            .into_iter()
            .chain([("clean", clean, want("get_weather", "{}"))])
    {
        let body: String = deltas
            .iter()
            .map(|d| chunk(d.clone(), Value::Null))
            .collect::<String>()
            + &end;
        let body = Bytes::from(body);
        let mut h = harness().await;
        let (svc, slot) = h.slot_node(h.layer(2048), "text/event-stream", move || {
            full(body.clone())
        });
        let resp = svc
            .oneshot(request("heads", &chat(true, None)))
            .await
            .unwrap();
        let got = frames(resp.into_body()).await.concat();
        let (python, node) = sdk_tool_calls(&got);
        assert_eq!(python.as_ref(), Some(&want), "{case}: Python SDK");
        assert_eq!(node, want, "{case}: Node SDK");
        let (s, r) = h.settled().await;
        assert_eq!(s.outcome, StreamOutcome::Completed, "{case}");
        assert_eq!(node_fault(&slot), None, "{case}");
        // billed: what the SDKs show, counted, and the EOS of a `tool_calls` finish
        let t = crate::test_support::smollm_tokenizer();
        let shown = t.count_generated_text(&want[0].1) + t.count_generated_text(&want[0].2);
        let billed = Usage {
            prompt_tokens: 34,
            completion_tokens: shown + 1,
        };
        assert_eq!(s.billed, billed, "{case}");
        assert_eq!(r.debit_micros, cost(billed), "{case}");
        debits.push((case, r.debit_micros));
    }
    let clean = debits.last().unwrap().1;
    let padded = debits
        .iter()
        .find(|(c, _)| c.starts_with("padding"))
        .unwrap()
        .1;
    assert_eq!(padded, clean, "removed names are not billed: {debits:?}");
}

/// The answer names the catalog model the caller asked for, not the node's own name for what it
/// serves (its word; llama.cpp without `--alias` sends its file path): every chunk and the
/// usage chunk of a stream, and a complete answer.
#[tokio::test]
async fn the_answer_names_the_callers_model_not_the_nodes() {
    let node_model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    let chunk = |delta: Value, finish: Value| {
        let c = json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":node_model,
            "choices":[{"index":0,"delta":delta,"finish_reason":finish}]});
        format!("data: {c}\n\n")
    };
    let body = chunk(json!({"role":"assistant","content":"Red"}), Value::Null)
        + &chunk(json!({}), json!("stop"))
        + "data: [DONE]\n\n";
    let body = Bytes::from(body);
    let mut h = harness().await;
    let (svc, _) = h.slot_node(h.layer(2048), "text/event-stream", move || {
        full(body.clone())
    });
    let resp = svc
        .oneshot(request("model", &chat(true, Some(true))))
        .await
        .unwrap();
    let got = frames(resp.into_body()).await.concat();
    let chunks: Vec<Value> = crate::sse::parse_all(&got)
        .unwrap()
        .iter()
        .filter_map(|e| serde_json::from_str(e.data()).ok())
        .collect();
    assert_eq!(chunks.len(), 3, "two chunks and the usage chunk");
    for c in &chunks {
        assert_eq!(c["model"], "smollm2", "{c}");
    }
    assert_eq!(h.settled().await.0.outcome, StreamOutcome::Completed);
    let answer = json!({"id":"c1","object":"chat.completion","created":1,"model":node_model,
        "choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"Red"}}],
        "usage":{"prompt_tokens":34,"completion_tokens":1,"total_tokens":35}});
    let answer = Bytes::from(answer.to_string());
    let mut h = harness().await;
    let (svc, _) = h.slot_node(h.layer(2048), "application/json", move || {
        full(answer.clone())
    });
    let resp = svc
        .oneshot(request("model", &chat(false, None)))
        .await
        .unwrap();
    let body: Value = serde_json::from_slice(&frames(resp.into_body()).await.concat()).unwrap();
    assert_eq!(body["model"], "smollm2", "{body}");
    assert_eq!(h.settled().await.0.outcome, StreamOutcome::Completed);
}

/// With `n` = 2, a node that begins choice 1 before choice 0: the caller's stream begins the
/// choices in order (an empty delta of choice 0 comes first), as the Python SDK's stream helper
/// files choices by arrival (it failed with `IndexError`); both are delivered and billed.
#[tokio::test]
async fn choices_begin_in_order_for_the_caller() {
    let chunk = delta_event;
    let body = chunk(1, json!({"role":"assistant","content":"Blue"}), Value::Null)
        + &chunk(0, json!({"role":"assistant","content":"Red"}), Value::Null)
        + &chunk(1, json!({}), json!("stop"))
        + &chunk(0, json!({}), json!("stop"))
        + "data: [DONE]\n\n";
    let body = Bytes::from(body);
    let mut h = harness().await;
    let (svc, slot) = h.slot_node(h.layer(2048), "text/event-stream", move || {
        full(body.clone())
    });
    let mut req = chat(true, None);
    req["n"] = json!(2);
    let resp = svc.oneshot(request("order", &req)).await.unwrap();
    let got = frames(resp.into_body()).await.concat();
    let mut begun = 0u64;
    let mut text = [String::new(), String::new()];
    for event in crate::sse::parse_all(&got).unwrap() {
        let Ok(c) = serde_json::from_str::<Value>(event.data()) else {
            continue;
        };
        for choice in c["choices"].as_array().into_iter().flatten() {
            let index = choice["index"].as_u64().unwrap();
            assert!(
                index <= begun,
                "choice {index} began before choice {begun}: {c}"
            );
            begun = begun.max(index + 1);
            text[index as usize].push_str(choice["delta"]["content"].as_str().unwrap_or_default());
        }
    }
    assert_eq!(text, ["Red".to_owned(), "Blue".to_owned()]);
    let (s, r) = h.settled().await;
    assert_eq!(s.outcome, StreamOutcome::Completed);
    assert_eq!(node_fault(&slot), None);
    // both choices billed, each with its `stop` EOS; the padding delta adds nothing
    let t = crate::test_support::smollm_tokenizer();
    let billed = Usage {
        prompt_tokens: 34,
        completion_tokens: t.count_generated_text("Red") + t.count_generated_text("Blue") + 2,
    };
    assert_eq!(s.billed, billed);
    assert_eq!(r.debit_micros, cost(billed));
}

/// A stream that paused after its first content (a node that sends the first token at once and
/// then queues the request): the metering layer reports the longest time without progress
/// between its first content and its end to the router through the `NodeSlot` (which lowers
/// the node's learned concurrency limit on a long one); keepalives, empty deltas and usage
/// chunks are no progress.
#[tokio::test]
async fn the_longest_pause_after_the_first_content_is_reported() {
    let mut h = harness().await;
    // real time (the SQLite ledger's worker thread and a paused clock do not mix)
    let every = std::time::Duration::from_millis(40);
    let mut script = vec![
        chunk_event(json!({"index":0,"delta":{"role":"assistant"},"finish_reason":null})),
        content_event("Hi"),
    ];
    script.extend(keepalive_without_progress());
    script.extend([
        content_event(" there"),
        chunk_event(json!({"index":0,"delta":{},"finish_reason":"stop"})),
        Bytes::from_static(b"data: [DONE]\n\n"),
    ]);
    let (svc, slot) = h.slot_node(
        h.layer(2048)
            .stream_stall_timeout(std::time::Duration::from_secs(30)),
        "text/event-stream",
        move || timed(script.clone(), Vec::new(), every),
    );
    let resp = svc
        .oneshot(request("pause", &chat(true, None)))
        .await
        .unwrap();
    frames(resp.into_body()).await;
    assert_eq!(h.settled().await.0.outcome, StreamOutcome::Completed);
    let pause = slot.lock().unwrap().as_ref().unwrap().longest_pause();
    // " there" came six events (5 without progress) after "Hi", 40 ms apart
    let pause = pause.expect("reported");
    assert!(pause >= every * 5 && pause < every * 50, "{pause:?}");
}
