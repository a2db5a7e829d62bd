use serde::{Deserialize, Serialize};

use crate::ModelId;

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
}

/// One model a node serves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelDescriptor {
    /// The id callers use in `"model"`.
    pub id: ModelId,
    /// The engine's context window, in tokens, when the engine reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_context_tokens: Option<u64>,
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
}
