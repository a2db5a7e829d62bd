//! A fast mock OpenAI-compatible engine, shaped like llama.cpp's `llama-server`.
//!
//! Serves, over HTTP/1.1 and HTTP/2 (prior knowledge) with `TCP_NODELAY` on every accepted
//! socket:
//! - `GET /health` → `200 {"status":"ok"}` (llama-server's shape);
//! - `GET /v1/models` → one model, [`MockConfig::model_id`], with llama.cpp's `meta.n_ctx`;
//! - `POST /v1/chat/completions` and `POST /v1/completions`, streamed (`"stream": true`, SSE) or
//!   not. A response has [`MockConfig::completion_tokens`] tokens, or `max_tokens` when the
//!   request asks for fewer; token `i` is `MockConfig::token_texts[i % len]` (a cycle of
//!   different words: LiteLLM aborts a stream that repeats one chunk 100 times). `finish_reason` is
//!   `"length"` when `max_tokens` cut the answer, else `"stop"`. `usage` claims
//!   [`MockConfig::prompt_tokens`] and the number of tokens sent; a stream carries the usage-only
//!   chunk (`choices: []`) only when the request has `stream_options.include_usage: true`, as
//!   OpenAI does.
//!
//! **Timing.** The first token is due [`MockConfig::ttft_micros`] after the request body was
//! read, token `i` at `ttft + i × itl` (fixed schedule: a late event does not delay the next
//! ones). The non-streamed answer is sent when the last token is due. tokio's timer has 1 ms
//! granularity, so non-zero TTFT/ITL are whole milliseconds in practice; with zero ITL every
//! event is its own HTTP body frame, sent as fast as the connection takes them.
//!
//! **Timestamps.** Every streamed content chunk carries `"system_fingerprint":
//! "x_sent_ns:<digits>"`: the wall-clock (`CLOCK_REALTIME`) nanoseconds since the Unix epoch
//! when the mock handed the event to its connection. It rides in a member of OpenAI's chunk
//! shape so that a gateway which drops members outside that shape (spine's
//! `strip_engine_fields`, on by default) still relays it. A client on the same machine subtracts it from the arrival time to get the
//! per-event delivery delay (see [`crate::load`]); the difference between two paths is the
//! per-event latency the path adds.
//!
//! **Reconfiguration.** `POST /mock/config` with a JSON object of any of `prompt_tokens`,
//! `completion_tokens`, `ttft_micros`, `itl_micros` changes them for the requests that follow
//! (a benchmark switches the pacing between phases without restarting the engine); the answer
//! is the whole configuration. [`MockEngine::set_config`] does the same in process.
//!
//! Anything else is `404` with an OpenAI-shaped error; an unparsable body is `400`.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, PoisonError, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::time::{Instant, Sleep};

/// What the mock engine answers.
#[derive(Clone, Debug)]
pub struct MockConfig {
    /// The model id served on `/v1/models` and echoed in responses.
    pub model_id: String,
    /// Prompt tokens claimed in `usage` (the mock does not tokenize).
    pub prompt_tokens: u64,
    /// Completion tokens per response when the request's `max_tokens` does not ask for fewer.
    pub completion_tokens: u64,
    /// Time to first token, microseconds.
    pub ttft_micros: u64,
    /// Inter-token latency, microseconds.
    pub itl_micros: u64,
    /// The texts of successive tokens, cycled (default `" the", " a", " of", " and", " to",
    /// " in"`: each one token in SmolLM2's and GPT-2-style BPE vocabularies, so the completion
    /// claim matches an independent count). Must not be empty.
    pub token_texts: Vec<String>,
    /// Context window reported as `meta.n_ctx` on `/v1/models`, tokens.
    pub context_tokens: u64,
}

impl Default for MockConfig {
    /// `model_id` `"smollm2"`, 10 prompt tokens, 16 completion tokens, zero TTFT and ITL,
    /// six one-token words, 8192-token context.
    fn default() -> Self {
        Self {
            model_id: "smollm2".to_owned(),
            prompt_tokens: 10,
            completion_tokens: 16,
            ttft_micros: 0,
            itl_micros: 0,
            token_texts: [" the", " a", " of", " and", " to", " in"]
                .map(str::to_owned)
                .to_vec(),
            context_tokens: 8192,
        }
    }
}

/// A running mock engine; dropping it does not stop it (call [`MockEngine::shutdown`]).
#[derive(Debug)]
pub struct MockEngine {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl MockEngine {
    /// Binds `addr` (use port 0 for an ephemeral port) and serves `config` on the current
    /// tokio runtime.
    ///
    /// # Errors
    ///
    /// The bind error.
    pub async fn bind(addr: SocketAddr, config: MockConfig) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        Self::serve(listener, config)
    }

    /// Serves `config` on an already bound listener.
    ///
    /// # Errors
    ///
    /// When the listener's local address cannot be read.
    pub fn serve(listener: TcpListener, config: MockConfig) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new(config));
        let task = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        Ok(Self { addr, shared, task })
    }

    /// Replaces the configuration for the requests that follow (the model id and context
    /// window on `/v1/models` stay as they were at start).
    pub fn set_config(&self, config: MockConfig) {
        *self
            .shared
            .config
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::new(config);
    }

    /// The current configuration.
    pub fn config(&self) -> Arc<MockConfig> {
        self.shared.config()
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting connections (connections already open finish on their own).
    pub fn shutdown(self) {
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(_) => {
                // out of descriptors and the like: back off instead of spinning
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let shared = Arc::clone(&shared);
                async move { Ok::<_, Infallible>(handle(&shared, req).await) }
            });
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// Pre-encoded pieces shared by every response.
#[derive(Debug)]
struct Shared {
    config: RwLock<Arc<MockConfig>>,
    models: Bytes,
}

impl Shared {
    fn new(config: MockConfig) -> Self {
        let models = json!({
            "object": "list",
            "data": [{
                "id": config.model_id,
                "object": "model",
                "created": 0,
                "owned_by": "spine-bench",
                "meta": {"n_ctx": config.context_tokens, "n_ctx_train": config.context_tokens},
            }],
        });
        Self {
            models: Bytes::from(models.to_string()),
            config: RwLock::new(Arc::new(config)),
        }
    }

    fn config(&self) -> Arc<MockConfig> {
        Arc::clone(&self.config.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// `POST /mock/config`: merges the given numeric fields into the configuration.
    fn reconfigure(&self, patch: &Value) -> Result<Value, &'static str> {
        let Some(patch) = patch.as_object() else {
            return Err("the body is not a json object");
        };
        let mut cfg = (*self.config()).clone();
        for (key, value) in patch {
            let Some(n) = value.as_u64() else {
                return Err("every field must be a non-negative integer");
            };
            match key.as_str() {
                "prompt_tokens" => cfg.prompt_tokens = n,
                "completion_tokens" => cfg.completion_tokens = n,
                "ttft_micros" => cfg.ttft_micros = n,
                "itl_micros" => cfg.itl_micros = n,
                _ => return Err("unknown field"),
            }
        }
        let out = json!({
            "prompt_tokens": cfg.prompt_tokens,
            "completion_tokens": cfg.completion_tokens,
            "ttft_micros": cfg.ttft_micros,
            "itl_micros": cfg.itl_micros,
        });
        *self.config.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(cfg);
        Ok(out)
    }
}

/// The response body type: either a whole body or a paced SSE stream.
type MockBody = http_body_util::Either<Full<Bytes>, MockStream>;

fn whole(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<MockBody> {
    let mut resp = Response::new(http_body_util::Either::Left(Full::new(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    resp
}

fn error(status: StatusCode, message: &str) -> Response<MockBody> {
    let body = json!({"error": {"message": message, "type": "invalid_request_error", "code": status.as_u16()}});
    whole(status, "application/json", Bytes::from(body.to_string()))
}

/// Which endpoint a completion request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
}

async fn handle(shared: &Shared, req: Request<Incoming>) -> Response<MockBody> {
    let endpoint = match (req.method(), req.uri().path()) {
        (&Method::GET, "/health") => {
            return whole(
                StatusCode::OK,
                "application/json",
                Bytes::from_static(br#"{"status":"ok"}"#),
            )
        }
        (&Method::GET, "/v1/models" | "/models") => {
            return whole(StatusCode::OK, "application/json", shared.models.clone())
        }
        (&Method::POST, "/v1/chat/completions" | "/chat/completions") => Endpoint::Chat,
        (&Method::POST, "/v1/completions" | "/completions") => Endpoint::Completions,
        (&Method::POST, "/mock/config") => {
            let patch = match req.into_body().collect().await {
                Ok(b) => serde_json::from_slice::<Value>(&b.to_bytes()).unwrap_or(Value::Null),
                Err(_) => Value::Null,
            };
            return match shared.reconfigure(&patch) {
                Ok(cfg) => whole(
                    StatusCode::OK,
                    "application/json",
                    Bytes::from(cfg.to_string()),
                ),
                Err(why) => error(StatusCode::BAD_REQUEST, why),
            };
        }
        _ => return error(StatusCode::NOT_FOUND, "no such endpoint"),
    };
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return error(StatusCode::BAD_REQUEST, "cannot read the request body"),
    };
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "the body is not json");
    };
    let read_at = Instant::now();
    let cfg_now = shared.config();
    let cfg = &*cfg_now;
    let max_tokens = request
        .get("max_tokens")
        .or_else(|| request.get("max_completion_tokens"))
        .and_then(Value::as_u64);
    let tokens = max_tokens.map_or(cfg.completion_tokens, |m| m.min(cfg.completion_tokens));
    let finish = if max_tokens.is_some_and(|m| m <= cfg.completion_tokens) {
        "length"
    } else {
        "stop"
    };
    let stream = request.get("stream").and_then(Value::as_bool) == Some(true);
    let usage = json!({
        "prompt_tokens": cfg.prompt_tokens,
        "completion_tokens": tokens,
        "total_tokens": cfg.prompt_tokens + tokens,
    });
    if !stream {
        let last_due = read_at
            + Duration::from_micros(cfg.ttft_micros + cfg.itl_micros * tokens.saturating_sub(1));
        if last_due > Instant::now() {
            tokio::time::sleep_until(last_due).await;
        }
        let text = token_cycle(cfg)
            .take(usize::try_from(tokens).unwrap_or(0))
            .collect::<String>();
        let body = match endpoint {
            Endpoint::Chat => json!({
                "id": "chatcmpl-mock",
                "object": "chat.completion",
                "created": 0,
                "model": cfg.model_id,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }],
                "usage": usage,
            }),
            Endpoint::Completions => json!({
                "id": "cmpl-mock",
                "object": "text_completion",
                "created": 0,
                "model": cfg.model_id,
                "choices": [{"index": 0, "text": text, "finish_reason": finish}],
                "usage": usage,
            }),
        };
        return whole(
            StatusCode::OK,
            "application/json",
            Bytes::from(body.to_string()),
        );
    }
    let include_usage = request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true);
    let stream = MockStream::new(
        cfg,
        endpoint,
        tokens,
        finish,
        include_usage.then_some(usage),
        read_at,
    );
    let mut resp = Response::new(http_body_util::Either::Right(stream));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream"),
    );
    resp
}

/// The token texts, cycled forever (`" the"` when the configuration has none).
fn token_cycle(cfg: &MockConfig) -> impl Iterator<Item = &str> + '_ {
    let texts: &[String] = &cfg.token_texts;
    let fallback: &'static [&'static str] = &[" the"];
    let n = texts.len();
    (0..).map(move |i| {
        if n == 0 {
            fallback[0]
        } else {
            texts[i % n].as_str()
        }
    })
}

/// The streamed answer: one body frame per SSE event, paced by the TTFT/ITL schedule.
pub struct MockStream {
    /// Per token text (cycled): the content chunk's bytes up to the timestamp digits.
    chunk_heads: Vec<Bytes>,
    /// The content chunk's bytes after the timestamp digits.
    chunk_tail: Bytes,
    /// The events after the last token: finish chunk, optional usage chunk, `[DONE]`.
    tail: Vec<Bytes>,
    tokens: u64,
    sent_tokens: u64,
    tail_sent: usize,
    first_due: Instant,
    itl: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl std::fmt::Debug for MockStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockStream")
            .field("tokens", &self.tokens)
            .field("sent_tokens", &self.sent_tokens)
            .finish_non_exhaustive()
    }
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

impl MockStream {
    fn new(
        cfg: &MockConfig,
        endpoint: Endpoint,
        tokens: u64,
        finish: &str,
        usage: Option<Value>,
        read_at: Instant,
    ) -> Self {
        let (done_choice, object, id) = match endpoint {
            Endpoint::Chat => (
                json!([{"index": 0, "delta": {}, "finish_reason": finish}]),
                "chat.completion.chunk",
                "chatcmpl-mock",
            ),
            Endpoint::Completions => (
                json!([{"index": 0, "text": "", "finish_reason": finish}]),
                "text_completion",
                "cmpl-mock",
            ),
        };
        let model = Value::String(cfg.model_id.clone());
        let n_texts = cfg.token_texts.len().max(1);
        let chunk_heads = token_cycle(cfg)
            .take(n_texts)
            .map(|text| {
                let content = match endpoint {
                    Endpoint::Chat => {
                        json!([{"index": 0, "delta": {"content": text}, "finish_reason": null}])
                    }
                    Endpoint::Completions => {
                        json!([{"index": 0, "text": text, "finish_reason": null}])
                    }
                };
                Bytes::from(format!(
                    "data: {{\"id\":\"{id}\",\"object\":\"{object}\",\"created\":0,\"model\":{model},\"choices\":{content},\"system_fingerprint\":\"x_sent_ns:"
                ))
            })
            .collect();
        let mut tail = vec![sse(&json!({
            "id": id, "object": object, "created": 0, "model": cfg.model_id,
            "choices": done_choice,
        }))];
        if let Some(usage) = usage {
            tail.push(sse(&json!({
                "id": id, "object": object, "created": 0, "model": cfg.model_id,
                "choices": [], "usage": usage,
            })));
        }
        tail.push(Bytes::from_static(b"data: [DONE]\n\n"));
        Self {
            chunk_heads,
            chunk_tail: Bytes::from_static(b"\"}\n\n"),
            tail,
            tokens,
            sent_tokens: 0,
            tail_sent: 0,
            first_due: read_at + Duration::from_micros(cfg.ttft_micros),
            itl: Duration::from_micros(cfg.itl_micros),
            sleep: None,
        }
    }

    fn next_due(&self) -> Instant {
        let i = u32::try_from(self.sent_tokens).unwrap_or(u32::MAX);
        self.first_due + self.itl.saturating_mul(i)
    }

    fn token_event(&self) -> Bytes {
        let now_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let stamp = now_ns.to_string();
        let i = usize::try_from(self.sent_tokens).unwrap_or(0) % self.chunk_heads.len().max(1);
        let head = self.chunk_heads.get(i).map_or(&b""[..], |h| &h[..]);
        let mut out = Vec::with_capacity(head.len() + stamp.len() + self.chunk_tail.len());
        out.extend_from_slice(head);
        out.extend_from_slice(stamp.as_bytes());
        out.extend_from_slice(&self.chunk_tail);
        Bytes::from(out)
    }
}

impl Body for MockStream {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if this.sent_tokens < this.tokens {
            let due = this.next_due();
            if due > Instant::now() {
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
                sleep.as_mut().reset(due);
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
            let event = this.token_event();
            this.sent_tokens += 1;
            return Poll::Ready(Some(Ok(Frame::data(event))));
        }
        match this.tail.get(this.tail_sent) {
            Some(ev) => {
                this.tail_sent += 1;
                Poll::Ready(Some(Ok(Frame::data(ev.clone()))))
            }
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.sent_tokens >= self.tokens && self.tail_sent >= self.tail.len()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn raw_request(addr: SocketAddr, request: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        String::from_utf8(out).unwrap()
    }

    fn post(path: &str, body: &str) -> String {
        format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    fn body_of(resp: &str) -> &str {
        resp.split_once("\r\n\r\n").unwrap().1
    }

    #[tokio::test]
    async fn health_models_and_unknown_paths() {
        let engine = MockEngine::bind(([127, 0, 0, 1], 0).into(), MockConfig::default())
            .await
            .unwrap();
        let health = raw_request(
            engine.addr(),
            "GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        )
        .await;
        assert!(health.starts_with("HTTP/1.1 200"));
        assert_eq!(body_of(&health), r#"{"status":"ok"}"#);
        let models = raw_request(
            engine.addr(),
            "GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        )
        .await;
        let v: Value = serde_json::from_str(body_of(&models)).unwrap();
        assert_eq!(v["data"][0]["id"], "smollm2");
        assert_eq!(v["data"][0]["meta"]["n_ctx"], 8192);
        let missing = raw_request(
            engine.addr(),
            "GET /nope HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        )
        .await;
        assert!(missing.starts_with("HTTP/1.1 404"));
        let bad = raw_request(engine.addr(), &post("/v1/chat/completions", "{nope")).await;
        assert!(bad.starts_with("HTTP/1.1 400"));
        let v: Value = serde_json::from_str(body_of(&bad)).unwrap();
        assert_eq!(v["error"]["message"], "the body is not json");
        engine.shutdown();
    }

    #[tokio::test]
    async fn reconfiguration_applies_to_later_requests() {
        let engine = MockEngine::bind(([127, 0, 0, 1], 0).into(), MockConfig::default())
            .await
            .unwrap();
        let resp = raw_request(
            engine.addr(),
            &post("/mock/config", r#"{"prompt_tokens":33,"itl_micros":1000}"#),
        )
        .await;
        let v: Value = serde_json::from_str(body_of(&resp)).unwrap();
        assert_eq!(
            v,
            json!({"prompt_tokens": 33, "completion_tokens": 16, "ttft_micros": 0, "itl_micros": 1000})
        );
        assert_eq!(engine.config().prompt_tokens, 33);
        let bad = raw_request(engine.addr(), &post("/mock/config", r#"{"nope":1}"#)).await;
        assert!(bad.starts_with("HTTP/1.1 400"));
        let resp = raw_request(
            engine.addr(),
            &post("/v1/chat/completions", r#"{"messages":[],"max_tokens":1}"#),
        )
        .await;
        let v: Value = serde_json::from_str(body_of(&resp)).unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], 33);
        engine.set_config(MockConfig::default());
        assert_eq!(engine.config().prompt_tokens, 10);
        engine.shutdown();
    }

    #[tokio::test]
    async fn non_streamed_answer_honours_max_tokens() {
        let cfg = MockConfig {
            prompt_tokens: 7,
            completion_tokens: 5,
            ..MockConfig::default()
        };
        let engine = MockEngine::bind(([127, 0, 0, 1], 0).into(), cfg)
            .await
            .unwrap();
        let resp = raw_request(
            engine.addr(),
            &post(
                "/v1/chat/completions",
                r#"{"model":"smollm2","messages":[{"role":"user","content":"hi"}],"max_tokens":3}"#,
            ),
        )
        .await;
        let v: Value = serde_json::from_str(body_of(&resp)).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], " the a of");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10})
        );
        let resp = raw_request(
            engine.addr(),
            &post("/v1/completions", r#"{"model":"smollm2","prompt":"hi"}"#),
        )
        .await;
        let v: Value = serde_json::from_str(body_of(&resp)).unwrap();
        assert_eq!(v["choices"][0]["text"], " the a of and to");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        engine.shutdown();
    }

    /// The body of a chunked HTTP/1.1 response, de-chunked.
    fn dechunk(body: &str) -> String {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            out.push_str(&after[..n]);
            rest = &after[n + 2..];
        }
        out
    }

    #[tokio::test]
    async fn streamed_answer_events_usage_and_pacing() {
        let cfg = MockConfig {
            prompt_tokens: 4,
            completion_tokens: 3,
            itl_micros: 20_000,
            ..MockConfig::default()
        };
        let engine = MockEngine::bind(([127, 0, 0, 1], 0).into(), cfg)
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let resp = raw_request(
            engine.addr(),
            &post(
                "/v1/chat/completions",
                r#"{"model":"smollm2","stream":true,"stream_options":{"include_usage":true},"messages":[]}"#,
            ),
        )
        .await;
        // three tokens at 0, 20 and 40 ms: the stream cannot end before 40 ms
        assert!(started.elapsed() >= Duration::from_millis(40));
        assert!(resp.contains("content-type: text/event-stream"));
        let text = dechunk(body_of(&resp));
        let events: Vec<&str> = text.split_terminator("\n\n").collect();
        assert_eq!(events.len(), 6, "{text}");
        for (ev, word) in events[..3].iter().zip([" the", " a", " of"]) {
            let v: Value = serde_json::from_str(ev.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(v["choices"][0]["delta"]["content"], word);
            let stamp = v["system_fingerprint"].as_str().unwrap();
            let ns: u128 = stamp.strip_prefix("x_sent_ns:").unwrap().parse().unwrap();
            assert!(ns > 0);
        }
        let fin: Value = serde_json::from_str(events[3].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(fin["choices"][0]["finish_reason"], "stop");
        let usage: Value = serde_json::from_str(events[4].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["completion_tokens"], 3);
        assert_eq!(events[5], "data: [DONE]");
        // without include_usage: no usage chunk
        let resp = raw_request(
            engine.addr(),
            &post(
                "/v1/chat/completions",
                r#"{"model":"smollm2","stream":true,"messages":[]}"#,
            ),
        )
        .await;
        let text = dechunk(body_of(&resp));
        assert_eq!(text.split_terminator("\n\n").count(), 5);
        assert!(!text.contains("\"usage\""));
        engine.shutdown();
    }
}
