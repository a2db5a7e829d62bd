//! Helpers shared by this crate's unit tests: fixture loading and the real model tokenizer.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use base64::Engine as _;

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
