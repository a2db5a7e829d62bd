//! criterion micro-benchmarks of the metering hot paths (issue 7):
//!
//! - `sse_parse`: [`SseParser`] over a real llama.cpp stream capture
//!   (`fixtures/llama.cpp/b_chat_stream_usage.txt`), fed whole and one event per read;
//!   throughput in events;
//! - `meter_body`: one streamed request through the public [`MeterLayer`] (SQLite ledger in
//!   memory, the real SmolLM2 tokenizer): hold, every event through `MeterBody` (SSE parse,
//!   usage capture, egress shaping), independent completion count, settlement. Two stream
//!   lengths: the marginal cost per event is `(t(256) − t(16)) / 240`;
//! - `token_counting`: token counting with the real SmolLM2 tokenizer, throughput in tokens,
//!   side by side in one run: `count_text_tokens` ([`ModelTokenizer::count_text`], the fast
//!   path, word cache warm) and `count_text_full_tokens` ([`ModelTokenizer::count_text_full`],
//!   the tokenizers crate's full `encode`) on the same English prose; `count_text_new_words`
//!   is the fast path's worst case, every word never seen before (each iteration a text of
//!   fresh words, so every word misses the cache and BPE runs), its throughput the mean tokens
//!   of 50 such texts (they differ by a few tokens).
//!
//! - `refused_credit`: a chat request with a 4 MiB prompt from an account with no credit, side
//!   by side: `first_refusal` (the layer has not seen the account yet: the prompt is templated
//!   and counted before it is refused — here for being over the context, the same work) and `remembered_refusal` (refused again within
//!   `REFUSED_CREDIT_TTL`, before its body is read); and `paid_small` (a 20-token paid chat,
//!   non-streamed) for scale.
//!
//! - `prompt_count`: a 4 MiB chat prompt templated and counted whole
//!   ([`ModelTokenizer::count_prompt`]) against counted until it passes a limit
//!   (`TokenCounter::count_prompt_within`): the context window (refused on its bytes) and the
//!   tokens a balance pays for (counted in 64 KiB pieces until past it).
//!
//! The tokenizer comes from `SPINE_MODEL_GGUF` (default
//! `~/.cache/spine/models/SmolLM2-135M-Instruct.Q4_1.gguf`); without it the groups that need it
//! are skipped with a message. Run: `cargo bench -p spine-meter --bench meter`.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use http_body::Body;
use http_body_util::BodyExt;
use spine_core::{AccountId, BoxBody, BoxError, ModelId, NodeId, OperatorId, RequestId};
use spine_meter::meter::{Catalog, CatalogEntry, MeterLayer};
use spine_meter::sse::{SseEvent, SseParser};
use spine_meter::{ModelTokenizer, Price, SqliteLedger};
use spine_test_support::{full, ScriptedBody, UpstreamService};
use tower::{Layer, Service, ServiceExt};

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fixtures/llama.cpp"
    ))
    .join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let head_end = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(0, |p| p + 4);
    bytes[head_end..].to_vec()
}

fn model_gguf() -> Option<PathBuf> {
    let path = std::env::var_os("SPINE_MODEL_GGUF").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/spine/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        PathBuf::from,
    );
    if path.is_file() {
        Some(path)
    } else {
        eprintln!(
            "{} is missing (set SPINE_MODEL_GGUF): skipping the tokenizer benchmarks",
            path.display()
        );
        None
    }
}

fn sse_parse(c: &mut Criterion) {
    let body = fixture("b_chat_stream_usage.txt");
    let mut events = Vec::new();
    let mut p = SseParser::new();
    p.feed(&body, &mut events).unwrap();
    p.finish(&mut events).unwrap();
    let n = events.len() as u64;
    let per_event: Vec<Bytes> = events.iter().map(|e| e.raw().clone()).collect();
    let mut group = c.benchmark_group("sse_parse");
    group.throughput(Throughput::Elements(n));
    group.bench_function("whole_stream_one_read", |b| {
        let mut out: Vec<SseEvent> = Vec::with_capacity(64);
        b.iter(|| {
            let mut p = SseParser::new();
            p.feed(std::hint::black_box(&body), &mut out).unwrap();
            p.finish(&mut out).unwrap();
            assert_eq!(out.len() as u64, n);
            out.clear();
        });
    });
    group.bench_function("one_event_per_read", |b| {
        let mut out: Vec<SseEvent> = Vec::with_capacity(4);
        b.iter(|| {
            let mut p = SseParser::new();
            let mut count = 0u64;
            for read in &per_event {
                p.feed(std::hint::black_box(read), &mut out).unwrap();
                count += out.len() as u64;
                out.clear();
            }
            p.finish(&mut out).unwrap();
            assert_eq!(count + out.len() as u64, n);
            out.clear();
        });
    });
    group.finish();
}

/// llama.cpp-shaped stream of `tokens` content chunks, a finish chunk, a usage chunk, `[DONE]`.
fn node_stream(tokens: usize) -> Vec<Bytes> {
    let chunk = |choices: &str, extra: &str| {
        Bytes::from(format!(
            "data: {{\"choices\":{choices},\"created\":1795965209,\"id\":\"chatcmpl-8hnb48W3uKhiu0bQMqLfFb285dUrBiZK\",\"model\":\"smollm2\",\"system_fingerprint\":\"b0-unknown\",\"object\":\"chat.completion.chunk\"{extra}}}\n\n"
        ))
    };
    let mut out = Vec::with_capacity(tokens + 3);
    for _ in 0..tokens {
        out.push(chunk(
            r#"[{"finish_reason":null,"index":0,"delta":{"content":" the"}}]"#,
            "",
        ));
    }
    out.push(chunk(
        r#"[{"finish_reason":"length","index":0,"delta":{}}]"#,
        "",
    ));
    out.push(chunk(
        "[]",
        &format!(
            r#","usage":{{"completion_tokens":{tokens},"prompt_tokens":15,"total_tokens":{}}}"#,
            tokens + 15
        ),
    ));
    out.push(Bytes::from_static(b"data: [DONE]\n\n"));
    out
}

/// The SmolLM2 tokenizer and a current-thread runtime, for the groups that meter requests;
/// `None` without the model.
fn tokenizer_and_runtime() -> Option<(Arc<ModelTokenizer>, tokio::runtime::Runtime)> {
    let gguf = model_gguf()?;
    let tokenizer = Arc::new(ModelTokenizer::from_gguf(&gguf).unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    Some((tokenizer, rt))
}

/// An in-memory SQLite ledger where `funded` holds more credit than a run spends and each of
/// `unfunded` nothing, with one node (operator `op`); and a catalog of `smollm2` at `price`
/// (8192-token context).
async fn ledger_and_catalog(
    tokenizer: Arc<ModelTokenizer>,
    funded: &AccountId,
    unfunded: &[&AccountId],
    price: Price,
) -> (Arc<SqliteLedger>, Catalog, NodeId) {
    let ledger = Arc::new(SqliteLedger::in_memory().await.unwrap());
    for account in unfunded {
        ledger.create_account(account).await.unwrap();
    }
    ledger.create_account(funded).await.unwrap();
    ledger
        .add_credits(funded, 1_000_000_000_000_000, "bench")
        .await
        .unwrap();
    let operator = OperatorId::from("op");
    ledger.create_operator(&operator).await.unwrap();
    let node = ledger.register_node(&operator, "pk").await.unwrap();
    let mut catalog = Catalog::new();
    catalog.insert(
        ModelId::from("smollm2"),
        CatalogEntry {
            tokenizer,
            price,
            max_context_tokens: 8192,
        },
    );
    (ledger, catalog, node)
}

/// A node that reads the request's body and answers `body()` as `content_type`, its `NodeId`
/// in the response's extensions.
fn node_answering<B, F>(node: NodeId, content_type: &'static str, body: F) -> impl UpstreamService
where
    B: Body<Data = Bytes, Error = BoxError> + Send + 'static,
    F: Fn() -> B + Clone + Send + 'static,
{
    tower::service_fn(move |req: http::Request<BoxBody>| {
        let (node, body) = (node.clone(), body.clone());
        async move {
            let _ = req.into_body().collect().await?;
            let mut resp = http::Response::new(BoxBody::new(body()));
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(content_type),
            );
            resp.extensions_mut().insert(node);
            Ok::<_, BoxError>(resp)
        }
    })
}

/// `POST /v1/chat/completions` with `body`, as request `id` of `account`.
fn chat_request(body: &Bytes, account: &AccountId, id: String) -> http::Request<BoxBody> {
    let mut req = http::Request::post("/v1/chat/completions")
        .body(full(body.clone()))
        .unwrap();
    req.extensions_mut().insert(RequestId::from(id));
    req.extensions_mut().insert(account.clone());
    req
}

fn meter_body(c: &mut Criterion) {
    let Some((tokenizer, rt)) = tokenizer_and_runtime() else {
        return;
    };
    let account = AccountId::from("bench");
    let price = Price {
        input_micros_per_mtok: 1,
        output_micros_per_mtok: 1,
    };
    let (ledger, catalog, node) = rt.block_on(ledger_and_catalog(tokenizer, &account, &[], price));
    let layer = MeterLayer::new(ledger, catalog);
    let mut group = c.benchmark_group("meter_body");
    // request ids must be unique across the whole run (the ledger refuses a second hold)
    let mut i = 0u64;
    for tokens in [16usize, 256] {
        let reads = node_stream(tokens);
        let request_body = Bytes::from(format!(
            r#"{{"model":"smollm2","max_tokens":{tokens},"stream":true,"messages":[{{"role":"user","content":"Say the word the, many times."}}]}}"#
        ));
        group.throughput(Throughput::Elements(reads.len() as u64));
        let inner = node_answering(node.clone(), "text/event-stream", move || {
            ScriptedBody::data(reads.clone())
        });
        let mut svc = layer.layer(inner);
        let settlements = layer.settlements();
        group.bench_with_input(
            BenchmarkId::new("streamed_request_events", tokens + 3),
            &tokens,
            |b, _| {
                b.iter(|| {
                    rt.block_on(async {
                        i += 1;
                        let req = chat_request(&request_body, &account, format!("req_{i}"));
                        let resp = svc.ready().await.unwrap().call(req).await.unwrap();
                        let mut body = resp.into_body();
                        let mut frames = 0usize;
                        while let Some(f) = body.frame().await {
                            f.unwrap();
                            frames += 1;
                        }
                        assert!(frames >= tokens + 2);
                        drop(body);
                        settlements.drain().await;
                    });
                });
            },
        );
    }
    group.finish();
}

fn token_counting(c: &mut Criterion) {
    let Some(gguf) = model_gguf() else { return };
    let tokenizer = ModelTokenizer::from_gguf(&gguf).unwrap();
    let paragraph = "The gateway meters every token against its own count, using the model's \
        tokenizer and chat template, holds the caller's prepaid credit before forwarding, and \
        settles after the stream ends. Nodes dial out over a WebSocket tunnel that carries HTTP/2. ";
    let text = paragraph.repeat(20);
    let tokens = tokenizer.count_text_full(&text);
    assert_eq!(tokenizer.count_text(&text), tokens);
    let mut group = c.benchmark_group("token_counting");
    group.throughput(Throughput::Elements(tokens));
    group.bench_function(BenchmarkId::new("count_text_tokens", tokens), |b| {
        b.iter(|| {
            assert_eq!(tokenizer.count_text(std::hint::black_box(&text)), tokens);
        });
    });
    group.bench_function(BenchmarkId::new("count_text_full_tokens", tokens), |b| {
        b.iter(|| {
            assert_eq!(
                tokenizer.count_text_full(std::hint::black_box(&text)),
                tokens
            );
        });
    });
    // fresh words: " q" + 5 letters from a counter (11.9 M of them), 200 words per text
    let mut next = 0u64;
    let mut fresh_text = move || {
        let mut out = String::with_capacity(200 * 6);
        for _ in 0..200 {
            let mut i = next;
            next += 1;
            out.push_str(" q");
            for _ in 0..5 {
                out.push(char::from(b'a' + (i % 26) as u8));
                i /= 26;
            }
        }
        out
    };
    let samples: Vec<String> = (0..50).map(|_| fresh_text()).collect();
    let sample_tokens: u64 = samples.iter().map(|t| tokenizer.count_text_full(t)).sum();
    for t in &samples {
        assert_eq!(tokenizer.count_text(t), tokenizer.count_text_full(t));
    }
    let fresh_tokens = sample_tokens / 50;
    group.throughput(Throughput::Elements(fresh_tokens));
    group.bench_function(
        BenchmarkId::new("count_text_new_words", fresh_tokens),
        |b| {
            b.iter_batched(
                &mut fresh_text,
                |t| tokenizer.count_text(std::hint::black_box(&t)),
                criterion::BatchSize::SmallInput,
            );
        },
    );
    group.finish();
}

fn refused_credit(c: &mut Criterion) {
    let Some((tokenizer, rt)) = tokenizer_and_runtime() else {
        return;
    };
    let (poor, rich) = (AccountId::from("poor"), AccountId::from("rich"));
    let price = Price {
        input_micros_per_mtok: 150_000,
        output_micros_per_mtok: 600_000,
    };
    let (ledger, catalog, node) =
        rt.block_on(ledger_and_catalog(tokenizer, &rich, &[&poor], price));
    // 4 MiB of prose: far over the context, but the credit check comes first
    let prompt =
        "The quick brown fox jumps over the lazy dog. ".repeat((4 * 1024 * 1024 - 1024) / 45);
    let big = Bytes::from(format!(
        r#"{{"model":"smollm2","max_tokens":16,"messages":[{{"role":"user","content":"{prompt}"}}]}}"#
    ));
    let small = Bytes::from_static(
        br#"{"model":"smollm2","max_tokens":8,"messages":[{"role":"user","content":"Say hi."}]}"#,
    );
    let answer = Bytes::from_static(
        br#"{"id":"c","object":"chat.completion","created":1,"model":"smollm2","choices":[{"index":0,"message":{"role":"assistant","content":"Hi!"},"finish_reason":"stop"}]}"#,
    );
    let inner = node_answering(node, "application/json", move || full(answer.clone()));
    let mut group = c.benchmark_group("refused_credit");
    group.sample_size(10);
    let mut i = 0u64;
    group.bench_function("first_refusal_4mib_prompt", |b| {
        b.iter(|| {
            // a layer that has not seen the account: counts the prompt, then the hold refuses
            let svc = MeterLayer::new(ledger.clone(), catalog.clone()).layer(inner.clone());
            i += 1;
            let err = rt
                .block_on(svc.oneshot(chat_request(&big, &poor, format!("f{i}"))))
                .unwrap_err();
            // counted whole, then refused (the prompt is also over the context window: the
            // same work, done before either refusal)
            let e = err.to_string();
            assert!(
                e.contains("insufficient") || e.contains("context window"),
                "{e}"
            );
        });
    });
    let layer = MeterLayer::new(ledger.clone(), catalog.clone());
    let settlements = layer.settlements();
    let mut svc = layer.layer(inner.clone());
    rt.block_on(async {
        let err = svc
            .ready()
            .await
            .unwrap()
            .call(chat_request(&small, &poor, "seen".into()))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("insufficient"), "{err}");
    });
    group.sample_size(100);
    group.bench_function("remembered_refusal_4mib_prompt", |b| {
        b.iter(|| {
            i += 1;
            let err = rt
                .block_on(async {
                    svc.ready()
                        .await
                        .unwrap()
                        .call(chat_request(&big, &poor, format!("r{i}")))
                        .await
                })
                .unwrap_err();
            assert!(err.to_string().contains("insufficient"), "{err}");
        });
    });
    group.bench_function("paid_small", |b| {
        b.iter(|| {
            i += 1;
            rt.block_on(async {
                let resp = svc
                    .ready()
                    .await
                    .unwrap()
                    .call(chat_request(&small, &rich, format!("p{i}")))
                    .await
                    .unwrap();
                let _ = resp.into_body().collect().await.unwrap();
                settlements.drain().await;
            });
        });
    });
    group.finish();
}

/// A 4 MiB chat prompt counted whole against counted until it passes a limit (issue 13: an
/// account that cannot pay, a prompt that cannot fit, is refused before the work).
fn prompt_count(c: &mut Criterion) {
    use spine_meter::tokenizer::Counted;
    use spine_meter::TokenCounter;
    let Some(gguf) = model_gguf() else { return };
    let tokenizer = Arc::new(ModelTokenizer::from_gguf(&gguf).unwrap());
    let prompt =
        "The quick brown fox jumps over the lazy dog. ".repeat((4 * 1024 * 1024 - 1024) / 45);
    let body = serde_json::json!({"model":"smollm2","max_tokens":16,
        "messages":[{"role":"user","content":prompt}]});
    let whole = tokenizer.count_prompt(&body).unwrap();
    let mut group = c.benchmark_group("prompt_count");
    group.sample_size(10);
    group.bench_function(BenchmarkId::new("full_count_4mib_prompt", whole), |b| {
        b.iter(|| tokenizer.count_prompt(std::hint::black_box(&body)).unwrap());
    });
    // the context of the gateway's SmolLM2 (8,192 tokens): refused on the byte bound
    group.bench_function("refused_over_context_8192_4mib_prompt", |b| {
        b.iter(|| {
            let n = tokenizer
                .count_prompt_within(std::hint::black_box(&body), 8191)
                .unwrap();
            assert!(matches!(n, Counted::AtLeast(_)), "{n:?}");
        });
    });
    // an account whose balance pays 100,000 prompt tokens (15,000 micros at 0.15 $/M), within a
    // context large enough to hold the prompt: counted in 64 KiB pieces until it passes
    group.bench_function("refused_over_balance_100k_tokens_4mib_prompt", |b| {
        b.iter(|| {
            let n = tokenizer
                .count_prompt_within(std::hint::black_box(&body), 100_000)
                .unwrap();
            assert!(matches!(n, Counted::AtLeast(_)), "{n:?}");
        });
    });
    group.finish();
}

criterion_group!(
    benches,
    sse_parse,
    meter_body,
    token_counting,
    refused_credit,
    prompt_count
);
criterion_main!(benches);
