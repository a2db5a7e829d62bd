//! Engine adapters: what the agent asks its local inference engine (health, models).

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt as _, Empty};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use spine_core::{BoxBody, EngineKind, ModelDescriptor, ModelId};

/// The HTTP client the agent uses towards its engine (HTTP/1.1, `TCP_NODELAY`).
pub(crate) type EngineClient = Client<HttpConnector, BoxBody>;

/// Largest models/health response body read from the engine, bytes.
const MAX_PROBE_BODY_BYTES: usize = 1024 * 1024;

/// A client for the engine: plain HTTP, `TCP_NODELAY`, 5 s connect timeout.
pub(crate) fn engine_client() -> EngineClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new()).build(connector)
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
}

/// What the agent needs from an inference engine.
pub(crate) trait Engine: Send + Sync + 'static {
    /// The engine kind advertised to the gateway.
    fn kind(&self) -> EngineKind;

    /// The engine's health path, to which the tunnel's `GET /health` is mapped.
    fn health_path(&self) -> &'static str;

    /// `Ok` when the engine is up and its model loaded.
    fn health(&self) -> impl std::future::Future<Output = Result<(), EngineError>> + Send;

    /// The models the engine serves, with their context windows when known.
    fn models(
        &self,
    ) -> impl std::future::Future<Output = Result<Vec<ModelDescriptor>, EngineError>> + Send;
}

/// llama.cpp's `llama-server`: `GET /health` (200 once the model is loaded, 503 while loading),
/// `GET /v1/models` (`data[].id`, the `--alias` when given; `data[].meta.n_ctx`).
#[derive(Clone, Debug)]
pub(crate) struct LlamaCpp {
    base: Uri,
    client: EngineClient,
}

impl LlamaCpp {
    pub(crate) fn new(base: Uri, client: EngineClient) -> Self {
        Self { base, client }
    }

    async fn get(&self, path: &'static str) -> Result<Bytes, EngineError> {
        let uri = join(&self.base, path).map_err(EngineError::Url)?;
        let req = Request::get(uri)
            .body(Empty::<Bytes>::new().map_err(|e| match e {}).boxed_unsync())
            .map_err(EngineError::Url)?;
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
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
    #[serde(default)]
    meta: Option<ModelMeta>,
}

#[derive(Deserialize)]
struct ModelMeta {
    #[serde(default)]
    n_ctx: Option<u64>,
}

/// Parses an OpenAI-style `/v1/models` body, reading llama.cpp's `meta.n_ctx` when present.
pub(crate) fn parse_models(body: &[u8]) -> Result<Vec<ModelDescriptor>, serde_json::Error> {
    let list: ModelList = serde_json::from_slice(body)?;
    Ok(list
        .data
        .into_iter()
        .map(|m| ModelDescriptor {
            id: ModelId::new(m.id),
            max_context_tokens: m.meta.and_then(|meta| meta.n_ctx),
        })
        .collect())
}

impl Engine for LlamaCpp {
    fn kind(&self) -> EngineKind {
        EngineKind::LlamaCpp
    }

    fn health_path(&self) -> &'static str {
        "/health"
    }

    async fn health(&self) -> Result<(), EngineError> {
        self.get("/health").await.map(|_| ())
    }

    async fn models(&self) -> Result<Vec<ModelDescriptor>, EngineError> {
        const PATH: &str = "/v1/models";
        let body = self.get(PATH).await?;
        parse_models(&body).map_err(|source| EngineError::Json { path: PATH, source })
    }
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
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// The body of `GET /v1/models` as captured from llama-server
    /// (/work/shared/fixtures/llama.cpp/d_v1_models.txt), with `--alias smollm2`.
    const MODELS: &str = r#"{"models":[{"name":"smollm2","model":"smollm2","modified_at":"","size":"","digest":"","type":"model","description":"","tags":[""],"capabilities":["completion"],"parameters":"","details":{"parent_model":"","format":"gguf","family":"","families":[""],"parameter_size":"","quantization_level":""}}],"object":"list","data":[{"id":"smollm2","aliases":["smollm2"],"tags":[],"object":"model","created":1795965210,"owned_by":"llamacpp","meta":{"vocab_type":2,"n_vocab":49152,"n_ctx":8192,"n_ctx_train":8192,"n_embd":576,"n_params":134515008,"size":96576768,"ftype":"Q4_1"}}]}"#;

    #[test]
    fn parses_llama_cpp_models_with_context() {
        assert_eq!(
            parse_models(MODELS.as_bytes()).unwrap(),
            vec![ModelDescriptor {
                id: ModelId::new("smollm2"),
                max_context_tokens: Some(8192),
            }]
        );
        // other engines: no meta
        assert_eq!(
            parse_models(br#"{"object":"list","data":[{"id":"m","object":"model"}]}"#).unwrap(),
            vec![ModelDescriptor {
                id: ModelId::new("m"),
                max_context_tokens: None,
            }]
        );
        assert!(parse_models(b"{}").is_err());
    }

    #[test]
    fn join_keeps_the_base_prefix() {
        let base: Uri = "http://127.0.0.1:8080".parse().unwrap();
        assert_eq!(
            join(&base, "/v1/models").unwrap().to_string(),
            "http://127.0.0.1:8080/v1/models"
        );
        let base: Uri = "http://127.0.0.1:11434/ollama/".parse().unwrap();
        assert_eq!(
            join(&base, "/v1/models").unwrap().to_string(),
            "http://127.0.0.1:11434/ollama/v1/models"
        );
    }
}
