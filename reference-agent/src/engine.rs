//! Engine adapters: what the agent asks its local inference engine (health, served models, max
//! context) and each engine's quirks, behind one [`Engine`] trait (design brief §7, §9).
//!
//! | engine | health | models | max context |
//! |---|---|---|---|
//! | llama.cpp `llama-server` | `GET /health` (503 while loading) | `GET /v1/models` `data[].id` (the `--alias`) | `data[].meta.n_ctx` |
//! | vLLM | `GET /health` | `GET /v1/models` | `data[].max_model_len` |
//! | SGLang | `GET /health` | `GET /v1/models` | `data[].max_model_len` |
//! | Ollama | `GET /api/version` | `GET /v1/models` (OpenAI paths under `/v1`) | `GET /api/ps` `context_length` of the loaded model, else `num_ctx` from `POST /api/show`, else unknown |
//!
//! Quirk handled here: llama.cpp answers *any* model name with its loaded model and answers
//! malformed JSON with 500 (which the gateway would count against the node), so for llama.cpp
//! the agent's proxy checks the body itself ([`RequestGuard`]): malformed JSON → 400, a model the
//! engine does not serve → 404, both in OpenAI's error shape. vLLM, SGLang and Ollama refuse
//! unknown models and bad JSON themselves.
//!
//! `--engine auto` ([`detect`]): `GET /api/version` answering `{"version"}` → Ollama;
//! `GET /get_model_info` answering `{"model_path"}` → SGLang; `GET /v1/models` entries owned by
//! `llamacpp` (or carrying llama.cpp's `meta`) → llama.cpp, owned by `vllm` → vLLM.
//!
//! VRAM: [`detect_vram_mib`] runs `nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits`
//! and sums the GPUs; an absent binary or unusable output leaves the configured value.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt as _, Empty, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use spine_core::{BoxBody, Endpoints, EngineKind, ModelDescriptor, ModelId};

use crate::config::EngineArg;

/// The HTTP client the agent uses towards its engine (HTTP/1.1, `TCP_NODELAY`).
pub(crate) type EngineClient = Client<HttpConnector, BoxBody>;

/// Largest models/health response body read from the engine, bytes.
const MAX_PROBE_BODY_BYTES: usize = 1024 * 1024;

/// A client for the engine: plain HTTP, `TCP_NODELAY`, 5 s connect timeout, idle connections
/// kept 2 s: less than the engines' own keep-alive (llama.cpp's HTTP server closes an idle
/// connection after 5 s), so a request is rarely sent on a connection the engine is closing.
pub(crate) fn engine_client() -> EngineClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(2))
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .build(connector)
}

/// Errors talking to the engine.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EngineError {
    #[error("engine unreachable: {0}")]
    Unreachable(#[source] hyper_util::client::legacy::Error),
    #[error("engine answered {path} with status {status}")]
    Status {
        path: &'static str,
        status: StatusCode,
    },
    #[error("engine response to {path} could not be read: {source}")]
    Body {
        path: &'static str,
        #[source]
        source: spine_core::BoxError,
    },
    #[error("engine response to {path} is not the expected json: {source}")]
    Json {
        path: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("engine url is invalid: {0}")]
    Url(#[source] http::Error),
    #[error("could not tell which engine answers at {url} (llama.cpp, vLLM, Ollama or SGLang); pass --engine")]
    Undetected { url: String },
}

/// A boxed future returned by [`Engine`] methods.
pub(crate) type EngineFuture<'a, T> =
    Pin<Box<dyn Future<Output = Result<T, EngineError>> + Send + 'a>>;

/// How the proxy must check request bodies before the engine sees them (an engine quirk).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RequestGuard {
    /// Buffer `POST` bodies and answer malformed JSON with 400 and a model the engine does not
    /// serve with 404, instead of forwarding (llama.cpp).
    pub(crate) check_json_and_model: bool,
}

/// What the agent needs from an inference engine. Object safe: `Box<dyn Engine>`.
pub(crate) trait Engine: Send + Sync + std::fmt::Debug + 'static {
    /// The engine kind advertised to the gateway.
    fn kind(&self) -> EngineKind;

    /// The engine's health path, to which the tunnel's `GET /health` is mapped.
    fn health_path(&self) -> &'static str;

    /// The checks the proxy makes for this engine (see [`RequestGuard`]).
    fn request_guard(&self) -> RequestGuard {
        RequestGuard::default()
    }

    /// The HTTP client pointed at this engine.
    fn probe(&self) -> &Probe;

    /// `Ok` when the engine is up and its model loaded. Default: `GET` [`Self::health_path`]
    /// answers 2xx.
    fn health(&self) -> EngineFuture<'_, ()> {
        Box::pin(async move { self.probe().get(self.health_path()).await.map(|_| ()) })
    }

    /// The models the engine serves, with their context windows when known. Default: the
    /// OpenAI-compatible `GET /v1/models`.
    fn models(&self) -> EngineFuture<'_, Vec<ModelDescriptor>> {
        Box::pin(self.probe().openai_models())
    }
}

/// GETs and POSTs small JSON documents from the engine.
#[derive(Clone, Debug)]
pub(crate) struct Probe {
    base: Uri,
    client: EngineClient,
}

impl Probe {
    async fn send(
        &self,
        path: &'static str,
        req: http::request::Builder,
        body: BoxBody,
    ) -> Result<Bytes, EngineError> {
        let uri = join(&self.base, path).map_err(EngineError::Url)?;
        let req = req.uri(uri).body(body).map_err(EngineError::Url)?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(EngineError::Unreachable)?;
        let status = resp.status();
        if !status.is_success() {
            return Err(EngineError::Status { path, status });
        }
        let body = http_body_util::Limited::new(resp.into_body(), MAX_PROBE_BODY_BYTES)
            .collect()
            .await
            .map_err(|source| EngineError::Body { path, source })?;
        Ok(body.to_bytes())
    }

    async fn get(&self, path: &'static str) -> Result<Bytes, EngineError> {
        let body = Empty::<Bytes>::new().map_err(|e| match e {}).boxed_unsync();
        self.send(path, Request::get(path), body).await
    }

    async fn post_json(
        &self,
        path: &'static str,
        json: &serde_json::Value,
    ) -> Result<Bytes, EngineError> {
        let body = Full::new(Bytes::from(json.to_string()))
            .map_err(|e| match e {})
            .boxed_unsync();
        let req = Request::post(path).header(http::header::CONTENT_TYPE, "application/json");
        self.send(path, req, body).await
    }

    async fn get_json<T: for<'de> Deserialize<'de>>(
        &self,
        path: &'static str,
    ) -> Result<T, EngineError> {
        let body = self.get(path).await?;
        serde_json::from_slice(&body).map_err(|source| EngineError::Json { path, source })
    }

    /// `GET /v1/models` as model descriptors.
    async fn openai_models(&self) -> Result<Vec<ModelDescriptor>, EngineError> {
        const PATH: &str = "/v1/models";
        let body = self.get(PATH).await?;
        parse_models(&body).map_err(|source| EngineError::Json { path: PATH, source })
    }
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
    #[serde(default)]
    owned_by: Option<String>,
    /// llama.cpp
    #[serde(default)]
    meta: Option<ModelMeta>,
    /// vLLM, SGLang
    #[serde(default)]
    max_model_len: Option<u64>,
}

#[derive(Deserialize)]
struct ModelMeta {
    #[serde(default)]
    n_ctx: Option<u64>,
}

/// Parses an OpenAI-style `/v1/models` body: `data[].id`, with the context window from
/// llama.cpp's `meta.n_ctx` or vLLM/SGLang's `max_model_len` when present.
pub(crate) fn parse_models(body: &[u8]) -> Result<Vec<ModelDescriptor>, serde_json::Error> {
    let list: ModelList = serde_json::from_slice(body)?;
    Ok(list
        .data
        .into_iter()
        .map(|m| ModelDescriptor {
            id: ModelId::new(m.id),
            max_context_tokens: m.meta.and_then(|meta| meta.n_ctx).or(m.max_model_len),
            endpoints: None,
        })
        .collect())
}

/// llama.cpp's `llama-server`: `GET /health` (200 once the model is loaded, 503 while loading),
/// `GET /v1/models` (`data[].id`, the `--alias` when given; `data[].meta.n_ctx`).
#[derive(Clone, Debug)]
pub(crate) struct LlamaCpp(Probe);

/// vLLM's OpenAI-compatible server: `GET /health`, `GET /v1/models` with `max_model_len`.
#[derive(Clone, Debug)]
pub(crate) struct Vllm(Probe);

/// SGLang: `GET /health`, `GET /v1/models` with `max_model_len`.
#[derive(Clone, Debug)]
pub(crate) struct Sglang(Probe);

/// Ollama: `GET /api/version` for health, OpenAI paths under `/v1`, the context window from
/// `/api/ps` or `/api/show`.
#[derive(Clone, Debug)]
pub(crate) struct Ollama(Probe);

impl Engine for LlamaCpp {
    fn kind(&self) -> EngineKind {
        EngineKind::LlamaCpp
    }

    fn health_path(&self) -> &'static str {
        "/health"
    }

    fn request_guard(&self) -> RequestGuard {
        RequestGuard {
            check_json_and_model: true,
        }
    }

    fn probe(&self) -> &Probe {
        &self.0
    }

    /// `/v1/models`, then what the server really runs with: the context window of a slot from
    /// `/props` (`default_generation_settings.n_ctx`, which `-c` / `-np` set, not the model
    /// file's) and the endpoints it answers (`/v1/embeddings` answers only with `--embeddings`;
    /// one tiny embeddings request tells, see [`embeddings_answer`]).
    fn models(&self) -> EngineFuture<'_, Vec<ModelDescriptor>> {
        Box::pin(async move {
            let mut models = self.0.openai_models().await?;
            let props = self.0.get_json::<LlamaProps>("/props").await.ok();
            let n_ctx = props
                .and_then(|p| p.default_generation_settings)
                .and_then(|d| d.n_ctx)
                .filter(|n| *n > 0);
            for m in &mut models {
                if n_ctx.is_some() {
                    m.max_context_tokens = n_ctx;
                }
                let probe = serde_json::json!({ "model": m.id.as_str(), "input": "ping" });
                let embeddings =
                    embeddings_answer(&self.0.post_json("/v1/embeddings", &probe).await);
                m.endpoints = embeddings.map(|embeddings| Endpoints {
                    chat_completions: true,
                    completions: true,
                    embeddings,
                });
            }
            Ok(models)
        })
    }
}

#[derive(Deserialize)]
struct LlamaProps {
    #[serde(default)]
    default_generation_settings: Option<LlamaGenerationSettings>,
}

#[derive(Deserialize)]
struct LlamaGenerationSettings {
    #[serde(default)]
    n_ctx: Option<u64>,
}

/// What an embeddings probe says about the endpoint: a 2xx serves it; 501 (llama-server
/// without `--embeddings`: "This server does not support embeddings") does not; anything else
/// (unreachable, 404, 5xx) leaves it unknown (`None`: the gateway then assumes every endpoint, as
/// for an agent that predates the probe).
pub(crate) fn embeddings_answer(result: &Result<Bytes, EngineError>) -> Option<bool> {
    match result {
        Ok(_) => Some(true),
        Err(EngineError::Status { status, .. }) if *status == StatusCode::NOT_IMPLEMENTED => {
            Some(false)
        }
        Err(_) => None,
    }
}

impl Engine for Vllm {
    fn kind(&self) -> EngineKind {
        EngineKind::Vllm
    }

    fn health_path(&self) -> &'static str {
        "/health"
    }

    fn probe(&self) -> &Probe {
        &self.0
    }
}

impl Engine for Sglang {
    fn kind(&self) -> EngineKind {
        EngineKind::Sglang
    }

    fn health_path(&self) -> &'static str {
        "/health"
    }

    fn probe(&self) -> &Probe {
        &self.0
    }
}

#[derive(Deserialize)]
struct OllamaPs {
    #[serde(default)]
    models: Vec<OllamaPsEntry>,
}

#[derive(Deserialize)]
struct OllamaPsEntry {
    #[serde(default)]
    name: String,
    #[serde(default)]
    model: String,
    #[serde(default)]
    context_length: Option<u64>,
}

#[derive(Deserialize)]
struct OllamaShow {
    #[serde(default)]
    parameters: Option<String>,
}

/// `num_ctx` from Ollama's `/api/show` `parameters` text (`"num_ctx   4096\nstop …"`).
pub(crate) fn ollama_num_ctx(parameters: &str) -> Option<u64> {
    parameters.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        (words.next() == Some("num_ctx"))
            .then(|| words.next())
            .flatten()
            .and_then(|v| v.parse().ok())
    })
}

impl Ollama {
    /// The context window Ollama runs `model` with: the loaded model's `context_length`
    /// (`/api/ps`), else the model's `num_ctx` parameter (`/api/show`), else unknown (Ollama's
    /// default depends on its version and the GPU's memory).
    async fn context_tokens(&self, model: &str) -> Option<u64> {
        if let Ok(ps) = self.0.get_json::<OllamaPs>("/api/ps").await {
            if let Some(n) = ps
                .models
                .iter()
                .find(|m| m.name == model || m.model == model)
                .and_then(|m| m.context_length)
            {
                return Some(n);
            }
        }
        let body = self
            .0
            .post_json("/api/show", &serde_json::json!({ "model": model }))
            .await
            .ok()?;
        let show: OllamaShow = serde_json::from_slice(&body).ok()?;
        show.parameters.as_deref().and_then(ollama_num_ctx)
    }
}

impl Engine for Ollama {
    fn kind(&self) -> EngineKind {
        EngineKind::Ollama
    }

    fn health_path(&self) -> &'static str {
        "/api/version"
    }

    fn probe(&self) -> &Probe {
        &self.0
    }

    fn models(&self) -> EngineFuture<'_, Vec<ModelDescriptor>> {
        Box::pin(async move {
            let mut models = self.0.openai_models().await?;
            for m in &mut models {
                if m.max_context_tokens.is_none() {
                    m.max_context_tokens = self.context_tokens(m.id.as_str()).await;
                }
            }
            Ok(models)
        })
    }
}

/// The adapter for an explicit engine kind; `None` for `auto` (use [`detect`]).
pub(crate) fn adapter(kind: EngineArg, base: Uri, client: EngineClient) -> Option<Box<dyn Engine>> {
    let probe = Probe { base, client };
    Some(match kind {
        EngineArg::LlamaCpp => Box::new(LlamaCpp(probe)),
        EngineArg::Vllm => Box::new(Vllm(probe)),
        EngineArg::Ollama => Box::new(Ollama(probe)),
        EngineArg::Sglang => Box::new(Sglang(probe)),
        EngineArg::Auto => return None,
    })
}

#[derive(Deserialize)]
struct VersionDoc {
    version: String,
}

#[derive(Deserialize)]
struct SglangModelInfo {
    model_path: String,
}

/// Tells which engine answers at `base` (see the module docs for the probes).
///
/// # Errors
///
/// [`EngineError::Unreachable`] when nothing answers; [`EngineError::Undetected`] when something
/// answers that looks like none of the four.
pub(crate) async fn detect(
    base: Uri,
    client: EngineClient,
) -> Result<Box<dyn Engine>, EngineError> {
    let probe = Probe {
        base: base.clone(),
        client,
    };
    // Ollama: /api/version → {"version": "…"}
    match probe.get_json::<VersionDoc>("/api/version").await {
        Ok(v) if !v.version.is_empty() => return Ok(Box::new(Ollama(probe))),
        Err(e @ EngineError::Unreachable(_)) => return Err(e),
        _ => {}
    }
    // SGLang: /get_model_info → {"model_path": …}
    if probe
        .get_json::<SglangModelInfo>("/get_model_info")
        .await
        .is_ok_and(|i| !i.model_path.is_empty())
    {
        return Ok(Box::new(Sglang(probe)));
    }
    // llama.cpp and vLLM: who owns the models
    if let Ok(list) = probe.get_json::<ModelList>("/v1/models").await {
        if list
            .data
            .iter()
            .any(|m| m.meta.is_some() || m.owned_by.as_deref() == Some("llamacpp"))
        {
            return Ok(Box::new(LlamaCpp(probe)));
        }
        if list
            .data
            .iter()
            .any(|m| m.owned_by.as_deref() == Some("vllm"))
        {
            return Ok(Box::new(Vllm(probe)));
        }
    }
    Err(EngineError::Undetected {
        url: base.to_string(),
    })
}

/// The adapter for `kind`; for `auto`, detects the engine, retrying with backoff (0.5 s → 10 s)
/// while nothing answers or the answer is not recognised (the engine may still be starting).
pub(crate) async fn select(kind: EngineArg, base: Uri, client: EngineClient) -> Box<dyn Engine> {
    if let Some(engine) = adapter(kind, base.clone(), client.clone()) {
        return engine;
    }
    let mut backoff =
        spine_transport::Backoff::new(Duration::from_millis(500), Duration::from_secs(10));
    loop {
        match detect(base.clone(), client.clone()).await {
            Ok(engine) => {
                tracing::info!(engine = engine.kind().as_str(), url = %base, "engine detected");
                return engine;
            }
            Err(e) => {
                let delay = backoff.next_full();
                tracing::warn!(url = %base, error = %e, retry_in_ms = delay.as_millis() as u64, "engine not detected yet");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Total GPU memory of the lines of `nvidia-smi --query-gpu=memory.total --format=csv,…`, MiB:
/// one value per GPU, summed; a header line and a ` MiB` unit are accepted; `None` when no line
/// holds a number or the total is 0.
pub(crate) fn parse_nvidia_smi_memory_total(csv: &str) -> Option<u64> {
    let total = csv
        .lines()
        .filter_map(|line| {
            let field = line.split(',').next()?.trim();
            let number = field.strip_suffix("MiB").unwrap_or(field).trim();
            number.parse::<u64>().ok()
        })
        .try_fold(0u64, u64::checked_add)?;
    (total > 0).then_some(total)
}

/// Total GPU memory from `nvidia-smi`, MiB; `None` when it is absent, fails, or says nothing
/// useful (5 s limit).
pub(crate) async fn detect_vram_mib() -> Option<u64> {
    let run = tokio::process::Command::new("nvidia-smi")
        .args(["--query-gpu=memory.total", "--format=csv,noheader,nounits"])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .ok()?
        .ok()?;
    if !out.status.success() {
        return None;
    }
    parse_nvidia_smi_memory_total(&String::from_utf8_lossy(&out.stdout))
}

/// `base` (scheme, authority, optional path prefix) joined with an absolute `path`.
pub(crate) fn join(base: &Uri, path: &str) -> Result<Uri, http::Error> {
    let prefix = base.path().trim_end_matches('/');
    let mut parts = http::uri::Builder::new();
    if let Some(scheme) = base.scheme() {
        parts = parts.scheme(scheme.clone());
    }
    if let Some(authority) = base.authority() {
        parts = parts.authority(authority.clone());
    }
    parts.path_and_query(format!("{prefix}{path}")).build()
}

#[cfg(test)]
mod tests;
