//! `MeterLayer` alone: a plain axum app that meters and bills any OpenAI-compatible upstream — no
//! tunnel, no router, no spine gateway.
//!
//! ```sh
//! cargo run -p spine-meter --example axum_meter -- <model.gguf> http://127.0.0.1:8080 127.0.0.1:9000
//! curl -s 127.0.0.1:9000/v1/chat/completions -H 'content-type: application/json' \
//!   -d '{"model":"smollm2","messages":[{"role":"user","content":"Hi"}]}' -D - | grep x-request-id
//! curl -s 127.0.0.1:9000/records/<x-request-id>      # what was billed
//! ```
//! Every request is billed to one demo account (credited 1,000,000 micros at start); a real
//! application derives the `AccountId` from its own authentication.
#![allow(clippy::print_stdout, clippy::expect_used, missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use spine_core::{AccountId, BoxBody, BoxError, RequestId};
use spine_meter::meter::{Catalog, CatalogEntry, MeterLayer};
use spine_meter::{Ledger, ModelTokenizer, Price, SqliteLedger};
use tower::{Layer, ServiceExt};

#[derive(Clone)]
struct App {
    metered:
        tower::util::BoxCloneSyncService<http::Request<BoxBody>, http::Response<BoxBody>, BoxError>,
    ledger: Arc<SqliteLedger>,
    next_id: Arc<AtomicU64>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let gguf = args
        .next()
        .ok_or("usage: axum_meter <model.gguf> <upstream url> [listen]")?;
    let upstream = args
        .next()
        .ok_or("usage: axum_meter <model.gguf> <upstream url> [listen]")?;
    let listen = args.next().unwrap_or_else(|| "127.0.0.1:9000".into());

    let ledger = Arc::new(SqliteLedger::in_memory().await?);
    let account = AccountId::new("demo");
    ledger.create_account(&account).await?;
    ledger.add_credits(&account, 1_000_000, "start").await?;
    let mut catalog = Catalog::new();
    let tokenizer = ModelTokenizer::from_gguf(&gguf)?;
    let max_context_tokens = tokenizer.context_length_tokens().unwrap_or(4096);
    catalog.insert(
        "smollm2".into(),
        CatalogEntry {
            tokenizer: Arc::new(tokenizer),
            price: Price {
                input_micros_per_mtok: 150_000,
                output_micros_per_mtok: 600_000,
            },
            max_context_tokens,
        },
    );

    // The upstream: any OpenAI-compatible server, reached with a plain HTTP client.
    let client: Client<_, BoxBody> = Client::builder(TokioExecutor::new()).build_http();
    let forward = tower::service_fn(move |mut req: http::Request<BoxBody>| {
        let client = client.clone();
        let uri = format!("{upstream}{}", req.uri().path());
        async move {
            *req.uri_mut() = uri.parse()?;
            let resp = client.request(req).await?;
            Ok::<_, BoxError>(resp.map(|b| BoxBody::new(b.map_err(BoxError::from))))
        }
    });
    let metered = MeterLayer::new(ledger.clone(), catalog)
        .operator_share_bps(8_000)
        .layer(forward);

    let app = App {
        metered: tower::util::BoxCloneSyncService::new(metered),
        ledger,
        next_id: Arc::new(AtomicU64::new(1)),
    };
    let router = Router::new()
        .route("/v1/chat/completions", post(proxy))
        .route("/records/{id}", get(record))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!(
        "metering proxy on http://{listen} → {}",
        std::env::args().nth(2).unwrap_or_default()
    );
    axum::serve(listener, router).await?;
    Ok(())
}

async fn proxy(State(app): State<App>, req: Request) -> Response {
    let id = RequestId::new(format!(
        "req_{}",
        app.next_id.fetch_add(1, Ordering::Relaxed)
    ));
    let (parts, body) = req.into_parts();
    let mut upstream = http::Request::from_parts(parts, BoxBody::new(body.map_err(BoxError::from)));
    upstream.extensions_mut().insert(id.clone());
    upstream.extensions_mut().insert(AccountId::new("demo"));
    let mut resp = match call(app.metered, upstream).await {
        Ok(resp) => resp.map(axum::body::Body::new).into_response(),
        Err(e) => (http::StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    resp.headers_mut()
        .insert("x-request-id", id.as_str().parse().expect("ascii id"));
    resp
}

type Metered =
    tower::util::BoxCloneSyncService<http::Request<BoxBody>, http::Response<BoxBody>, BoxError>;

/// Calls the metered service behind a boxed `Send` future: keeps the `dyn Error` inside `BoxBody`
/// out of the handler's own future type, which rustc otherwise cannot prove `Send` (a known
/// higher-ranked lifetime limitation when such a call sits directly in an axum handler).
fn call(
    svc: Metered,
    req: http::Request<BoxBody>,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<http::Response<BoxBody>, BoxError>> + Send>,
> {
    Box::pin(svc.oneshot(req))
}

async fn record(State(app): State<App>, Path(id): Path<String>) -> Response {
    match app.ledger.request_record(RequestId::new(id)).await {
        Ok(Some(r)) => Json(r).into_response(),
        Ok(None) => http::StatusCode::NOT_FOUND.into_response(),
        Err(e) => (http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
