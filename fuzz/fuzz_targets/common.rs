//! Shared by the fuzz targets that need the real tokenizer or a metered service: the SmolLM2
//! GGUF's tokenizer (`SPINE_MODEL_GGUF`, default
//! `~/.cache/spine/models/SmolLM2-135M-Instruct.Q4_1.gguf`, from `scripts/setup.sh`) and a
//! `MeterLayer` over an in-memory ledger with one funded account.
#![allow(dead_code)]
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use spine_core::{AccountId, BoxBody, BoxError, ModelId, NodeId, RequestId};
use spine_meter::meter::{Catalog, CatalogEntry, MeterLayer};
use spine_meter::{ModelTokenizer, Price, SqliteLedger};

/// The SmolLM2 tokenizer, loaded once per process.
pub fn tokenizer() -> Arc<ModelTokenizer> {
    static TOK: OnceLock<Arc<ModelTokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = std::env::var_os("SPINE_MODEL_GGUF").map_or_else(
            || {
                PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                    .join(".cache/spine/models/SmolLM2-135M-Instruct.Q4_1.gguf")
            },
            PathBuf::from,
        );
        Arc::new(
            ModelTokenizer::from_gguf(&path)
                .unwrap_or_else(|e| panic!("{}: {e} (set SPINE_MODEL_GGUF)", path.display())),
        )
    })
    .clone()
}

/// A `MeterLayer` for model `m` (context 2,048, 1 µ per million tokens) over a fresh in-memory
/// ledger, with account `a` credited 2^40 µ: (layer, ledger, account).
pub async fn metered() -> (MeterLayer, Arc<SqliteLedger>, AccountId) {
    let ledger = Arc::new(SqliteLedger::in_memory().await.expect("ledger"));
    let account = AccountId::from("a");
    ledger.create_account(&account).await.expect("account");
    ledger
        .add_credits(&account, 1 << 40, "k")
        .await
        .expect("credits");
    let mut catalog = Catalog::new();
    catalog.insert(
        ModelId::from("m"),
        CatalogEntry {
            tokenizer: tokenizer(),
            price: Price {
                input_micros_per_mtok: 1,
                output_micros_per_mtok: 1,
            },
            max_context_tokens: 2048,
        },
    );
    (MeterLayer::new(ledger.clone(), catalog), ledger, account)
}

/// A node (as a service) that answers every request 200 with `data`, as `content_type`, cut
/// into reads of the first byte's value (at least 1), tagged as node `n`.
pub fn node_answering(
    data: &[u8],
    content_type: &'static str,
) -> impl tower::Service<
    http::Request<BoxBody>,
    Response = http::Response<BoxBody>,
    Error = BoxError,
    Future = impl Send,
> + Clone {
    let step = usize::from(data.first().copied().unwrap_or(1)).max(1);
    let reads: Vec<Bytes> = data.chunks(step).map(Bytes::copy_from_slice).collect();
    tower::service_fn(move |_req: http::Request<BoxBody>| {
        let reads = reads.clone();
        async move {
            let frames = futures_util::stream::iter(
                reads
                    .into_iter()
                    .map(|b| Ok::<_, BoxError>(http_body::Frame::data(b))),
            );
            let mut resp = http::Response::new(BoxBody::new(StreamBody::new(frames)));
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(content_type),
            );
            resp.extensions_mut().insert(NodeId::from("n"));
            Ok::<_, BoxError>(resp)
        }
    })
}

/// `POST path` with `body`, as request `r` of `account`.
pub fn request(path: &str, body: &'static [u8], account: &AccountId) -> http::Request<BoxBody> {
    let mut req = http::Request::post(path)
        .body(BoxBody::new(
            http_body_util::Full::new(Bytes::from_static(body)).map_err(|never| match never {}),
        ))
        .expect("request");
    req.extensions_mut().insert(RequestId::from("r"));
    req.extensions_mut().insert(account.clone());
    req
}

/// One request through the metered service on a fresh runtime: `body` to `path`, answered by
/// a node sending `data` as `content_type` ([`node_answering`]). `check` reads the outcome —
/// the response's status and whole body, or the layer's error — then the request must have
/// settled with nothing held.
pub fn meter_once(
    data: &[u8],
    content_type: &'static str,
    path: &str,
    body: &'static [u8],
    check: impl FnOnce(Result<(http::StatusCode, Bytes), BoxError>),
) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (layer, ledger, account) = metered().await;
        let settlements = layer.settlements();
        let node = node_answering(data, content_type);
        let req = request(path, body, &account);
        let outcome = match tower::ServiceExt::oneshot(tower::Layer::layer(&layer, node), req).await
        {
            Ok(resp) => {
                let status = resp.status();
                let out = resp.into_body().collect().await.expect("body").to_bytes();
                Ok((status, out))
            }
            Err(e) => Err(e),
        };
        check(outcome);
        settlements.drain().await;
        assert_eq!(
            ledger.account(&account).await.expect("balance").held_micros,
            0
        );
    });
}
