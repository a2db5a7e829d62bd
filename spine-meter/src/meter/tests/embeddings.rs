//! `/v1/embeddings`: what cannot be answered is refused before the hold, an answer over the
//! gateway's buffer is never charged, and the answer is rebuilt from OpenAI's members only.

use super::*;
use crate::TokenCounter as _;

/// An embeddings request of `body` as request `id` of the harness's account.
fn embed(id: &str, body: &Value) -> http::Request<BoxBody> {
    let mut req = http::Request::post("/v1/embeddings")
        .body(full(body.to_string()))
        .unwrap();
    req.extensions_mut().insert(RequestId::from(id));
    req.extensions_mut().insert(AccountId::from("acct"));
    req
}

/// A valid answer of `inputs` two-dimensional vectors.
fn answer(inputs: usize) -> Bytes {
    let data: Vec<Value> = (0..inputs)
        .map(|i| json!({"object":"embedding","index":i,"embedding":[0.25,-0.5]}))
        .collect();
    Bytes::from(
        json!({"object":"list","data":data,"model":"smollm2",
            "usage":{"prompt_tokens":inputs,"total_tokens":inputs}})
        .to_string(),
    )
}

/// The refusal `err` is, as the caller sees it (`openai_error` maps these variants to these
/// statuses): `(status, param, message)`.
fn refusal(err: &BoxError) -> (u16, Option<String>, String) {
    match err.downcast_ref::<MeterError>() {
        Some(MeterError::EmbeddingsRefused { param, message }) => {
            (400, Some((*param).to_owned()), message.clone())
        }
        Some(e @ MeterError::EmbeddingsTooLarge { .. }) => (502, None, e.to_string()),
        _ => panic!("not an embeddings refusal: {err}"),
    }
}

/// Sends `body` as request `id` and checks it was refused 400 on `param` before any node was
/// asked and before anything was recorded; returns the message.
async fn refused_before_the_node(h: &Harness, id: &str, body: &Value, param: &str) -> String {
    let svc = h
        .layer(2048)
        .layer(h.inner(200, "application/json", vec![answer(1)], End::Eof));
    let err = svc.oneshot(embed(id, body)).await.unwrap_err();
    let (status, got, message) = refusal(&err);
    assert_eq!((status, got.as_deref()), (400, Some(param)), "{message}");
    assert_eq!(h.upstream.lock().unwrap().as_ref(), None, "{id}");
    assert_eq!(h.record(id).await, None, "{id}");
    message
}

#[tokio::test]
async fn more_inputs_than_openai_allows_are_refused_before_the_node() {
    let h = harness().await;
    let body = json!({"model":"smollm2","input":vec!["a"; 2049]});
    let message = refused_before_the_node(&h, "many", &body, "input").await;
    assert!(message.contains("at most 2048"), "{message}");
    h.assert_account_untouched().await;
}

/// SmolLM2-135M's vectors have 576 elements (its GGUF's `llama.embedding_length`): with the
/// default 16 MiB buffer an honest answer fits 1,144 inputs as JSON numbers
/// ((16 MiB − 4 KiB) / (256 + 576 × 25) bytes), many more in base64.
#[tokio::test]
async fn inputs_whose_answer_cannot_fit_the_buffer_are_refused_before_the_node() {
    assert_eq!(smollm_tokenizer().embedding_dimensions(), Some(576));
    let h = harness().await;
    let body = json!({"model":"smollm2","input":vec!["a"; 1400]});
    let message = refused_before_the_node(&h, "big", &body, "input").await;
    assert!(message.contains("at most 1144 inputs"), "{message}");
    assert!(!message.contains("stream\": true"), "{message}");
    h.assert_account_untouched().await;

    // what fits goes to the node: 1,144 inputs as numbers, 1,400 in base64
    for (id, inputs, format) in [("fits", 1144, "float"), ("b64", 1400, "base64")] {
        let mut h = harness().await;
        let svc =
            h.layer(2048)
                .layer(h.inner(200, "application/json", vec![answer(inputs)], End::Eof));
        let body = json!({"model":"smollm2","input":vec!["a"; inputs],"encoding_format":format});
        let resp = svc.oneshot(embed(id, &body)).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert!(h.upstream.lock().unwrap().is_some(), "{id}");
        assert_eq!(h.settled().await.0.outcome, StreamOutcome::Completed);
    }
}

#[tokio::test]
async fn dimensions_other_than_the_models_own_are_refused() {
    let mut h = harness().await;
    for (id, dimensions) in [("d4", json!(4)), ("d0", json!(0)), ("dx", json!("576"))] {
        let body = json!({"model":"smollm2","input":"a","dimensions":dimensions});
        let message = refused_before_the_node(&h, id, &body, "dimensions").await;
        assert!(message.contains("576"), "{message}");
    }
    h.assert_account_untouched().await;
    // the model's own length (or null) is what the node returns anyway
    for (id, dimensions) in [("d576", json!(576)), ("dnull", Value::Null)] {
        let svc = h
            .layer(2048)
            .layer(h.inner(200, "application/json", vec![answer(1)], End::Eof));
        let body = json!({"model":"smollm2","input":"a","dimensions":dimensions});
        assert!(svc.oneshot(embed(id, &body)).await.is_ok(), "{id}");
        assert_eq!(h.settled().await.0.outcome, StreamOutcome::Completed);
    }
}

/// With the model's vector length known, an answer larger than one of its vectors can make
/// (here 1,000 elements of 24 characters for one 576-element vector) is the node's fault.
#[tokio::test]
async fn an_answer_larger_than_the_models_vectors_make_is_the_nodes_fault() {
    let mut h = harness().await;
    let vector = vec![Value::from(-0.012_318_301_945_924_759_f64); 1000];
    let body = Bytes::from(
        json!({"object":"list","data":[{"object":"embedding","index":0,"embedding":vector}],
            "model":"smollm2","usage":{"prompt_tokens":1,"total_tokens":1}})
        .to_string(),
    );
    assert!(body.len() > 4096 + 256 + 576 * 25);
    let (svc, slot) = h.slot_node(h.layer(2048), "application/json", move || {
        full(body.clone())
    });
    let err = svc
        .oneshot(embed("fat", &json!({"model":"smollm2","input":"a"})))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err.downcast_ref::<MeterError>(),
            Some(MeterError::UpstreamInvalid(_))
        ),
        "{err}"
    );
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, r.debit_micros),
        (StreamOutcome::UpstreamFailed, 0)
    );
    assert!(node_fault(&slot).is_some());
    h.assert_account_untouched().await;
}

/// The SmolLM2 tokenizer, without its vector length (a counter that does not know it).
#[derive(Debug)]
struct NoDimensions(Arc<crate::ModelTokenizer>);

impl crate::TokenCounter for NoDimensions {
    fn count_prompt(&self, body: &Value) -> Result<u64, crate::TokenizerError> {
        self.0.count_prompt(body)
    }
    fn count_text(&self, text: &str) -> u64 {
        self.0.count_text(text)
    }
    fn max_token_bytes(&self) -> u64 {
        crate::TokenCounter::max_token_bytes(&*self.0)
    }
}

/// The vector length unknown, an honest answer may be over the buffer: a 502 that does not
/// tell the caller to stream (embeddings cannot), and nothing charged for what it never got.
#[tokio::test]
async fn an_embeddings_answer_over_the_buffer_is_never_charged() {
    let mut h = harness().await;
    let mut catalog = Catalog::new();
    catalog.insert(
        ModelId::from("smollm2"),
        CatalogEntry {
            tokenizer: Arc::new(NoDimensions(smollm_tokenizer())),
            price: PRICE,
            max_context_tokens: 2048,
        },
    );
    let layer = MeterLayer::new(h.ledger.clone(), catalog)
        .operator_share_bps(7_000)
        .events(h.events.clone())
        .max_response_body_bytes(100);
    let (svc, slot) = h.slot_node(layer, "application/json", move || full(answer(2)));
    let err = svc
        .oneshot(embed(
            "cut",
            &json!({"model":"smollm2","input":["red","green"]}),
        ))
        .await
        .unwrap_err();
    let (status, _, message) = refusal(&err);
    assert_eq!(status, 502, "{message}");
    assert!(!message.contains("\"stream\": true"), "{message}");
    assert!(message.contains("fewer inputs"), "{message}");
    let (s, r) = h.settled().await;
    assert_eq!(
        (s.outcome, r.debit_micros, r.operator_credit_micros),
        (StreamOutcome::CutAtBound, 0, 0)
    );
    assert_eq!(node_fault(&slot), None);
    h.assert_account_untouched().await;
}

/// A hostile node's members beyond OpenAI's never reach the caller.
#[tokio::test]
async fn the_answer_is_rebuilt_from_openais_members_only() {
    let mut h = harness().await;
    let hostile = json!({"object":"list","extra":"x".repeat(1000),"model":"<b>evil</b>",
        "data":[
            {"<script>":"alert(1)","embedding":[1e-3,2]},
            {"object":"embedding","index":1,"embedding":[0.5,-1],"text":"y".repeat(20_000)}
        ],
        "usage":{"prompt_tokens":99,"total_tokens":99,"secret":true}});
    let body = Bytes::from(hostile.to_string());
    let (svc, _) = h.slot_node(h.layer(2048), "application/json", move || {
        full(body.clone())
    });
    let resp = svc
        .oneshot(embed(
            "strip",
            &json!({"model":"smollm2","input":["red","green"]}),
        ))
        .await
        .unwrap();
    let got: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let (s, _) = h.settled().await;
    assert_eq!(s.outcome, StreamOutcome::Completed);
    let billed = s.billed.prompt_tokens;
    assert_eq!(
        got,
        json!({"object":"list","data":[
                {"object":"embedding","index":0,"embedding":[1e-3,2]},
                {"object":"embedding","index":1,"embedding":[0.5,-1]}
            ],
            "model":"smollm2",
            "usage":{"prompt_tokens":billed,"total_tokens":billed}})
    );
}
