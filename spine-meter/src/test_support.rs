//! Helpers shared by this crate's unit tests: fixture loading, the real model tokenizer, and the
//! metering layer's fixtures (a funded ledger, recorded events, requests and node answers).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use base64::Engine as _;

use crate::ledger::{SettleResult, Settlement};
#[cfg(feature = "tokenizer")]
use crate::tokenizer::ModelTokenizer;

/// The fixtures directory (`SPINE_FIXTURES`, default the repository's `fixtures/`, a copy of the
/// team's shared captures).
pub(crate) fn fixtures_dir() -> PathBuf {
    std::env::var_os("SPINE_FIXTURES").map_or_else(
        || PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures")),
        PathBuf::from,
    )
}

/// A llama.cpp capture's body: the bytes after the HTTP head.
pub(crate) fn strip_http_head(bytes: &[u8]) -> &[u8] {
    let pos = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| p + 4)
        .or_else(|| bytes.windows(2).position(|w| w == b"\n\n").map(|p| p + 2))
        .expect("capture has an HTTP head");
    &bytes[pos..]
}

/// A llama.cpp capture's body, by file name.
pub(crate) fn capture_body(name: &str) -> Vec<u8> {
    let path = fixtures_dir().join("llama.cpp").join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    strip_http_head(&bytes).to_vec()
}

/// One case of `hostile-streams.json`.
#[derive(Debug, Clone)]
pub(crate) struct HostileCase {
    pub(crate) id: String,
    pub(crate) reads: Vec<Vec<u8>>,
    pub(crate) request: serde_json::Value,
    pub(crate) expect: serde_json::Value,
}

pub(crate) fn hostile_cases() -> Vec<HostileCase> {
    let path = fixtures_dir().join("hostile-streams.json");
    let text = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: serde_json::Value = serde_json::from_slice(&text).unwrap();
    json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| HostileCase {
            id: c["id"].as_str().unwrap().to_owned(),
            reads: c["reads_b64"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    base64::engine::general_purpose::STANDARD
                        .decode(r.as_str().unwrap())
                        .unwrap()
                })
                .collect(),
            request: c["request"].clone(),
            expect: c["expect"].clone(),
        })
        .collect()
}

/// The model file: `SPINE_MODEL_GGUF`, default `~/.cache/spine/models/SmolLM2-135M-Instruct.Q4_1.gguf`.
/// Panics with a clear message when it is missing: tests that need it must not pass silently.
#[cfg(feature = "tokenizer")]
pub(crate) fn model_gguf() -> PathBuf {
    let path = std::env::var_os("SPINE_MODEL_GGUF").map_or_else(
        || {
            let home = std::env::var_os("HOME").unwrap_or_default();
            PathBuf::from(home).join(".cache/spine/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        PathBuf::from,
    );
    assert!(
        path.is_file(),
        "model file {} is missing: set SPINE_MODEL_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf",
        path.display()
    );
    path
}

/// The SmolLM2 tokenizer, built once per test binary.
#[cfg(feature = "tokenizer")]
pub(crate) fn smollm_tokenizer() -> Arc<ModelTokenizer> {
    static TOK: OnceLock<Arc<ModelTokenizer>> = OnceLock::new();
    TOK.get_or_init(|| Arc::new(ModelTokenizer::from_gguf(model_gguf()).unwrap()))
        .clone()
}

// ---- the metering layer's suites (`meter::tests`, `meter::tests_billing`) ----

/// Meter events as the suites watch them: each settlement is sent on a channel (see
/// [`next_settled`]), each discrepancy report is kept in `.1`.
pub(crate) struct RecordedEvents(
    tokio::sync::mpsc::UnboundedSender<(Settlement, SettleResult)>,
    pub(crate) std::sync::Mutex<Vec<crate::meter::DiscrepancyReport>>,
);

/// The settlements [`RecordedEvents`] sends, in order.
pub(crate) type SettledRx = tokio::sync::mpsc::UnboundedReceiver<(Settlement, SettleResult)>;

impl RecordedEvents {
    /// The events, and the receiver of their settlements.
    pub(crate) fn new() -> (Arc<Self>, SettledRx) {
        let (tx, settled) = tokio::sync::mpsc::unbounded_channel();
        (
            Arc::new(Self(tx, std::sync::Mutex::new(Vec::new()))),
            settled,
        )
    }
}

impl crate::meter::MeterEvents for RecordedEvents {
    fn on_settled(&self, s: &Settlement, r: &SettleResult) {
        let _ = self.0.send((s.clone(), *r));
    }
    fn on_discrepancy(&self, report: &crate::meter::DiscrepancyReport) {
        self.1.lock().unwrap().push(report.clone());
    }
}

/// The next settlement; panics when none comes within 10 s.
pub(crate) async fn next_settled(settled: &mut SettledRx) -> (Settlement, SettleResult) {
    tokio::time::timeout(std::time::Duration::from_secs(10), settled.recv())
        .await
        .unwrap()
        .unwrap()
}

/// What the meter suites start from: an in-memory ledger with an account `acct` holding
/// `credit_micros` (idempotency key `k`) and an operator `op` with one node (public key `pk`).
#[cfg(feature = "sqlite")]
pub(crate) struct FundedLedger {
    pub(crate) ledger: Arc<crate::SqliteLedger>,
    pub(crate) account: spine_core::AccountId,
    pub(crate) operator: spine_core::OperatorId,
    pub(crate) node: spine_core::NodeId,
}

#[cfg(feature = "sqlite")]
impl FundedLedger {
    pub(crate) async fn new(credit_micros: u64) -> Self {
        let ledger = Arc::new(crate::SqliteLedger::in_memory().await.unwrap());
        let account = spine_core::AccountId::from("acct");
        ledger.create_account(&account).await.unwrap();
        ledger
            .add_credits(&account, credit_micros, "k")
            .await
            .unwrap();
        let operator = spine_core::OperatorId::from("op");
        ledger.create_operator(&operator).await.unwrap();
        let node = ledger.register_node(&operator, "pk").await.unwrap();
        Self {
            ledger,
            account,
            operator,
            node,
        }
    }
}

/// A catalog of one model, `smollm2`: the SmolLM2 tokenizer at `price`, with a context window
/// of `max_context_tokens`.
#[cfg(feature = "tokenizer")]
pub(crate) fn smollm_catalog(
    price: crate::Price,
    max_context_tokens: u64,
) -> crate::meter::Catalog {
    let mut catalog = crate::meter::Catalog::new();
    catalog.insert(
        spine_core::ModelId::from("smollm2"),
        crate::meter::CatalogEntry {
            tokenizer: smollm_tokenizer(),
            price,
            max_context_tokens,
        },
    );
    catalog
}

/// `POST /v1/chat/completions` with `body`, carrying the `RequestId` `id` and the `AccountId`
/// `account`, as the gateway hands it to the metering layer.
pub(crate) fn chat_request(
    id: &str,
    account: spine_core::AccountId,
    body: bytes::Bytes,
) -> http::Request<spine_core::BoxBody> {
    let mut req = http::Request::post("/v1/chat/completions")
        .body(spine_test_support::full(body))
        .unwrap();
    req.extensions_mut().insert(spine_core::RequestId::from(id));
    req.extensions_mut().insert(account);
    req
}

/// A node's answer as the router hands it back: `body` as `content_type`, with the `NodeId`
/// `node` in its extensions (status 200).
pub(crate) fn node_response(
    node: spine_core::NodeId,
    content_type: &'static str,
    body: spine_core::BoxBody,
) -> http::Response<spine_core::BoxBody> {
    let mut resp = http::Response::new(body);
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    resp.extensions_mut().insert(node);
    resp
}
