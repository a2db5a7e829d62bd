use serde::{Deserialize, Serialize};

use crate::{ModelId, RequestKind};

/// The inference engine behind a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum EngineKind {
    /// llama.cpp's `llama-server`.
    #[serde(rename = "llama.cpp")]
    LlamaCpp,
    /// vLLM's OpenAI-compatible server.
    #[serde(rename = "vllm")]
    Vllm,
    /// Ollama's OpenAI-compatible `/v1` paths.
    #[serde(rename = "ollama")]
    Ollama,
    /// SGLang's OpenAI-compatible server.
    #[serde(rename = "sglang")]
    Sglang,
}

impl EngineKind {
    /// The name used on the command line and on the wire (`llama.cpp`, `vllm`, `ollama`, `sglang`).
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::LlamaCpp => "llama.cpp",
            Self::Vllm => "vllm",
            Self::Ollama => "ollama",
            Self::Sglang => "sglang",
        }
    }

    /// Whether the engine generates `n` > 1 choices for one request.
    ///
    /// Ollama's OpenAI-compatible paths do not read `n` (its `docs/openai.md` lists `n` as an
    /// unsupported request field) and answer with one choice; llama.cpp (`n` / `n_cmpl`), vLLM and
    /// SGLang generate `n`. The router sends a request for several choices only to engines that
    /// generate them, so an honest node that cannot is never asked to (and never scored for it).
    pub fn generates_several_choices(&self) -> bool {
        !matches!(self, Self::Ollama)
    }
}

/// One model a node serves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelDescriptor {
    /// The id callers use in `"model"`.
    pub id: ModelId,
    /// The engine's context window, in tokens, when the engine reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_context_tokens: Option<u64>,
    /// The endpoints the engine answers for this model, when the agent probed them (at join and
    /// on each reconnect). `None` (an agent that predates the field, or a probe that could not
    /// tell): unknown, every endpoint is assumed served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<Endpoints>,
}

impl ModelDescriptor {
    /// Whether the model is served for requests of `kind` (unknown endpoints: yes).
    pub fn serves_kind(&self, kind: RequestKind) -> bool {
        self.endpoints.is_none_or(|e| e.serves(kind))
    }
}

/// Which OpenAI endpoints an engine answers for a model ([`ModelDescriptor::endpoints`]).
///
/// A field missing on the wire is `false`; fields a later agent adds are ignored by this one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoints {
    /// `POST /v1/chat/completions`.
    #[serde(default)]
    pub chat_completions: bool,
    /// `POST /v1/completions`.
    #[serde(default)]
    pub completions: bool,
    /// `POST /v1/embeddings`.
    #[serde(default)]
    pub embeddings: bool,
}

impl Endpoints {
    /// Whether requests of `kind` are served.
    pub fn serves(&self, kind: RequestKind) -> bool {
        match kind {
            RequestKind::ChatCompletions => self.chat_completions,
            RequestKind::Completions => self.completions,
            RequestKind::Embeddings => self.embeddings,
        }
    }
}

/// What a node says about itself in its tunnel handshake (design brief §4).
///
/// Self-reported and therefore untrusted: the gateway checks what it can (health, models) through
/// the tunnel before it routes to the node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeDescriptor {
    /// Engine kind.
    pub engine: EngineKind,
    /// Models the engine serves.
    pub models: Vec<ModelDescriptor>,
    /// GPU memory, MiB.
    pub vram_mib: u64,
    /// Concurrent requests the node accepts; advertised as HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`.
    pub max_concurrency: u32,
    /// The agent's version string.
    pub agent_version: String,
}

impl NodeDescriptor {
    /// Whether the node claims to serve `model`.
    pub fn serves(&self, model: &ModelId) -> bool {
        self.models.iter().any(|m| &m.id == model)
    }

    /// The node's descriptor of `model`, if it serves it.
    pub fn model(&self, model: &ModelId) -> Option<&ModelDescriptor> {
        self.models.iter().find(|m| &m.id == model)
    }
}

#[cfg(test)]
mod tests;
