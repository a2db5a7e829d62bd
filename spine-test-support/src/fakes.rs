//! [`FakeEngine`]: small fakes of vLLM, Ollama and SGLang on a real socket (HTTP/1.1, hyper),
//! following each engine's documented API shapes, for the agent's adapter tests. llama.cpp is
//! tested against the real `llama-server` ([`crate::LlamaServer`]) instead.
//!
//! Shapes (from the engines' docs and sources):
//! - **vLLM** (`vllm serve`, OpenAI-compatible server): `GET /health` → 200 with an empty body;
//!   `GET /version` → `{"version"}`; `GET /v1/models` → `{"object":"list","data":[{"id",
//!   "object":"model","created","owned_by":"vllm","root","parent":null,"max_model_len",
//!   "permission":[…]}]}`; an unknown model → 404 `{"object":"error","message","type":
//!   "NotFoundError","param":null,"code":404}`; other paths → 404 `{"detail":"Not Found"}`.
//! - **SGLang** (`python -m sglang.launch_server`): `GET /health` → 200 empty;
//!   `GET /get_model_info` → `{"model_path","tokenizer_path","is_generation"}`; `GET /v1/models`
//!   → as vLLM with `"owned_by":"sglang"` and `max_model_len`.
//! - **Ollama** (`ollama serve`, port 11434): `GET /` → `Ollama is running`; `GET /api/version`
//!   → `{"version"}`; `GET /api/tags` → `{"models":[{"name","model","modified_at","size",
//!   "digest","details":{…}}]}`; `GET /api/ps` → loaded models with `context_length`;
//!   `POST /api/show` → `{"parameters":"num_ctx …","model_info":{"<arch>.context_length"},…}`;
//!   OpenAI-compatible paths under `/v1` (`GET /v1/models` → `{"object":"list","data":[{"id",
//!   "object":"model","created","owned_by":"library"}]}`); an unknown model → 404
//!   `{"error":{"message":"model \"…\" not found, try pulling it first","type":"api_error",…}}`.
//!
//! Chat and text completions (all three): non-streamed → a `chat.completion` /
//! `text_completion` object with `usage`; `"stream": true` → SSE chunks `Hello`, ` from`,
//! ` <engine>`, a `finish_reason: "stop"` chunk, then — when `stream_options.include_usage` is
//! true — a chunk with `"choices": []` and `usage`, then `data: [DONE]`. Usage is
//! `prompt_tokens` = the number of request body bytes / 4 (a stand-in count), completion 3.
//! Malformed JSON → 400 in the engine's error shape.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::Error;

/// Which engine a [`FakeEngine`] imitates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeKind {
    /// vLLM's OpenAI-compatible server.
    Vllm,
    /// Ollama.
    Ollama,
    /// SGLang.
    Sglang,
}

impl FakeKind {
    fn name(self) -> &'static str {
        match self {
            Self::Vllm => "vllm",
            Self::Ollama => "ollama",
            Self::Sglang => "sglang",
        }
    }
}

/// One request the fake received.
#[derive(Debug, Clone)]
pub struct SeenRequest {
    /// Method.
    pub method: String,
    /// Path and query.
    pub path: String,
    /// Header names and values (lowercase names).
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl SeenRequest {
    /// The value of header `name`, if sent.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug)]
struct Inner {
    kind: FakeKind,
    model: String,
    max_context_tokens: u64,
    seen: Mutex<Vec<SeenRequest>>,
}

/// A fake vLLM, Ollama or SGLang server on `127.0.0.1`; stops when dropped.
#[derive(Debug)]
pub struct FakeEngine {
    /// Base URL, `http://127.0.0.1:<port>`.
    pub url: String,
    inner: Arc<Inner>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeEngine {
    /// Starts a fake `kind` serving `model` with a context window of `max_context_tokens`.
    ///
    /// # Errors
    ///
    /// When no port can be bound.
    pub async fn start(
        kind: FakeKind,
        model: &str,
        max_context_tokens: u64,
    ) -> Result<Self, Error> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let inner = Arc::new(Inner {
            kind,
            model: model.to_owned(),
            max_context_tokens,
            seen: Mutex::new(Vec::new()),
        });
        let state = inner.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let state = state.clone();
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(handle(&state, req).await) }
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc),
                );
            }
        });
        Ok(Self { url, inner, task })
    }

    /// Every request received so far, in order.
    pub fn seen(&self) -> Vec<SeenRequest> {
        self.inner
            .seen
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default()
    }
}

fn respond(
    status: StatusCode,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        resp.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    resp
}

fn json_resp(status: StatusCode, v: &Value) -> Response<Full<Bytes>> {
    respond(status, "application/json", v.to_string())
}

fn not_found(kind: FakeKind) -> Response<Full<Bytes>> {
    match kind {
        FakeKind::Ollama => respond(StatusCode::NOT_FOUND, "text/plain", "404 page not found"),
        _ => json_resp(StatusCode::NOT_FOUND, &json!({"detail": "Not Found"})),
    }
}

fn engine_error(kind: FakeKind, status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    let v = match kind {
        FakeKind::Ollama => json!({"error": {"message": message, "type": "api_error",
            "param": null, "code": null}}),
        _ => json!({"object": "error", "message": message,
            "type": if status == StatusCode::NOT_FOUND { "NotFoundError" } else { "BadRequestError" },
            "param": null, "code": status.as_u16()}),
    };
    json_resp(status, &v)
}

async fn handle(state: &Inner, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes().to_vec())
        .unwrap_or_default();
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned());
    if let Ok(mut seen) = state.seen.lock() {
        seen.push(SeenRequest {
            method: parts.method.to_string(),
            path: path.clone(),
            headers: parts
                .headers
                .iter()
                .map(|(n, v)| {
                    (
                        n.as_str().to_owned(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            body: body.clone(),
        });
    }
    let kind = state.kind;
    let model = state.model.as_str();
    let ctx = state.max_context_tokens;
    let created = 1_764_400_000u64;
    match (&parts.method, parts.uri.path(), kind) {
        (&Method::GET, "/health", FakeKind::Vllm | FakeKind::Sglang) => {
            respond(StatusCode::OK, "application/json", "")
        }
        (&Method::GET, "/version", FakeKind::Vllm) => {
            json_resp(StatusCode::OK, &json!({"version": "0.11.0"}))
        }
        (&Method::GET, "/get_model_info", FakeKind::Sglang) => json_resp(
            StatusCode::OK,
            &json!({"model_path": format!("/models/{model}"), "tokenizer_path": format!("/models/{model}"),
                "is_generation": true, "preferred_sampling_params": null}),
        ),
        (&Method::GET, "/", FakeKind::Ollama) => respond(
            StatusCode::OK,
            "text/plain; charset=utf-8",
            "Ollama is running",
        ),
        (&Method::GET, "/api/version", FakeKind::Ollama) => {
            json_resp(StatusCode::OK, &json!({"version": "0.12.6"}))
        }
        (&Method::GET, "/api/tags", FakeKind::Ollama) => json_resp(
            StatusCode::OK,
            &json!({"models": [{"name": model, "model": model, "modified_at": "2025-11-20T10:00:00Z",
                "size": 270_898_672u64, "digest": "a".repeat(64),
                "details": {"parent_model": "", "format": "gguf", "family": "llama",
                    "families": ["llama"], "parameter_size": "134.52M", "quantization_level": "F16"}}]}),
        ),
        (&Method::GET, "/api/ps", FakeKind::Ollama) => json_resp(
            StatusCode::OK,
            &json!({"models": [{"name": model, "model": model, "size": 500_000_000u64,
                "digest": "a".repeat(64), "details": {"format": "gguf", "family": "llama"},
                "expires_at": "2025-11-20T10:05:00Z", "size_vram": 500_000_000u64,
                "context_length": ctx}]}),
        ),
        (&Method::POST, "/api/show", FakeKind::Ollama) => {
            let asked = serde_json::from_slice::<Value>(&body).ok().and_then(|v| {
                v.get("model")
                    .or(v.get("name"))
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            });
            if asked.as_deref() != Some(model) {
                return json_resp(
                    StatusCode::NOT_FOUND,
                    &json!({"error": format!("model '{}' not found", asked.unwrap_or_default())}),
                );
            }
            json_resp(
                StatusCode::OK,
                &json!({"modelfile": "", "parameters": format!("num_ctx                        {ctx}\nstop                           \"<|im_end|>\""),
                    "template": "", "details": {"format": "gguf", "family": "llama"},
                    "model_info": {"general.architecture": "llama", "llama.context_length": 8192},
                    "capabilities": ["completion"]}),
            )
        }
        (&Method::GET, "/v1/models", _) => {
            let entry = match kind {
                FakeKind::Ollama => {
                    json!({"id": model, "object": "model", "created": created, "owned_by": "library"})
                }
                _ => {
                    json!({"id": model, "object": "model", "created": created, "owned_by": kind.name(),
                    "root": format!("/models/{model}"), "parent": null, "max_model_len": ctx,
                    "permission": [{"id": "modelperm-0", "object": "model_permission", "created": created,
                        "allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
                        "allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
                        "organization": "*", "group": null, "is_blocking": false}]})
                }
            };
            json_resp(StatusCode::OK, &json!({"object": "list", "data": [entry]}))
        }
        (&Method::POST, p @ ("/v1/chat/completions" | "/v1/completions"), _) => {
            completion(kind, model, p == "/v1/chat/completions", &body)
        }
        _ => not_found(kind),
    }
}

fn completion(kind: FakeKind, model: &str, chat: bool, body: &[u8]) -> Response<Full<Bytes>> {
    let Ok(req) = serde_json::from_slice::<Value>(body) else {
        return engine_error(kind, StatusCode::BAD_REQUEST, "invalid JSON body");
    };
    let asked = req.get("model").and_then(Value::as_str).unwrap_or("");
    if asked != model {
        let message = match kind {
            FakeKind::Ollama => format!("model \"{asked}\" not found, try pulling it first"),
            _ => format!("The model `{asked}` does not exist."),
        };
        return engine_error(kind, StatusCode::NOT_FOUND, &message);
    }
    let stream = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = req
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let pieces = ["Hello", " from", &format!(" {}", kind.name())].map(|s| s.to_owned());
    let usage = json!({"prompt_tokens": body.len() / 4, "completion_tokens": pieces.len(),
        "total_tokens": body.len() / 4 + pieces.len()});
    let (object, chunk_object) = if chat {
        ("chat.completion", "chat.completion.chunk")
    } else {
        ("text_completion", "text_completion")
    };
    let id = format!("cmpl-fake-{}", kind.name());
    if !stream {
        let text: String = pieces.concat();
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"})
        } else {
            json!({"index": 0, "text": text, "finish_reason": "stop"})
        };
        return json_resp(
            StatusCode::OK,
            &json!({"id": id, "object": object, "created": 1_764_400_000u64, "model": model,
                "choices": [choice], "usage": usage}),
        );
    }
    let mut out = String::new();
    let mut event = |choices: Value, usage: Option<&Value>| {
        let mut v = json!({"id": id, "object": chunk_object, "created": 1_764_400_000u64,
            "model": model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u.clone();
        }
        out.push_str(&format!("data: {v}\n\n"));
    };
    for piece in &pieces {
        let choice = if chat {
            json!([{"index": 0, "delta": {"content": piece}, "finish_reason": null}])
        } else {
            json!([{"index": 0, "text": piece, "finish_reason": null}])
        };
        event(choice, None);
    }
    let last = if chat {
        json!([{"index": 0, "delta": {}, "finish_reason": "stop"}])
    } else {
        json!([{"index": 0, "text": "", "finish_reason": "stop"}])
    };
    event(last, None);
    if include_usage {
        event(json!([]), Some(&usage));
    }
    out.push_str("data: [DONE]\n\n");
    respond(StatusCode::OK, "text/event-stream", out)
}
