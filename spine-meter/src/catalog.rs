//! The model catalog as configured ([`ModelConfig`], the gateway's `[[models]]`) and loaded
//! ([`load_catalog`]): each entry from the model's GGUF, its tokenizer and chat template, its
//! identity checked, its context window.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use spine_core::ModelId;

use crate::audit::AuditedModel;
use crate::gguf::DigestError;
use crate::meter::{Catalog, CatalogEntry};
use crate::{ModelTokenizer, Price, TokenizerError};

/// Context window assumed when neither the configuration nor the GGUF gives one, tokens.
pub const DEFAULT_CONTEXT_TOKENS: u64 = 4096;

/// Why a catalog entry could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CatalogError {
    /// The GGUF is not the configured one (or cannot be read to check it).
    #[error(transparent)]
    Digest(#[from] DigestError),
    /// The tokenizer could not be loaded from the GGUF.
    #[error("loading {}", path.display())]
    Tokenizer {
        /// The GGUF.
        path: PathBuf,
        /// The cause.
        #[source]
        source: TokenizerError,
    },
    /// A configured model has no `gguf` to load its tokenizer from.
    #[error("model '{0}': set `gguf` to load its tokenizer")]
    NoGguf(String),
    /// Two configured models have the same id.
    #[error("model '{0}' is configured twice")]
    Duplicate(String),
    /// A configured model's entry could not be loaded.
    #[error("model '{id}'")]
    Model {
        /// The model's id.
        id: String,
        /// Why ([`CatalogError::Digest`] or [`CatalogError::Tokenizer`]).
        #[source]
        source: Box<CatalogError>,
    },
}

/// One catalog model as configured (a `[[models]]` table of the gateway's TOML).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The id callers use in `"model"`; nodes must serve it under the same id.
    pub id: String,
    /// GGUF file to read the tokenizer and chat template from.
    #[serde(default)]
    pub gguf: Option<PathBuf>,
    /// Price per million prompt tokens, micro-units.
    pub input_price_micros_per_mtok: u64,
    /// Price per million completion tokens, micro-units.
    pub output_price_micros_per_mtok: u64,
    /// Context window in tokens; default from the GGUF.
    #[serde(default)]
    pub max_context_tokens: Option<u64>,
    /// The model's identity: the SHA-256 of its GGUF (hex). When set, the gateway refuses to
    /// start unless `gguf` has exactly these bytes (the reference must serve the same file).
    #[serde(default)]
    pub gguf_sha256: Option<String>,
    /// A llama-server the gateway's operator runs and trusts with this model's exact weights:
    /// nodes serving the model are audited against it (design brief §10, `[audit]`).
    #[serde(default)]
    pub reference_url: Option<String>,
}

impl ModelConfig {
    /// The model's price.
    pub fn price(&self) -> Price {
        Price {
            input_micros_per_mtok: self.input_price_micros_per_mtok,
            output_micros_per_mtok: self.output_price_micros_per_mtok,
        }
    }

    /// The model as the auditor takes it (`node_logprobs`: `[audit] node_logprobs`); `None`
    /// without a `reference_url` (the model is not audited).
    pub fn audited(&self, node_logprobs: bool) -> Option<AuditedModel<'_>> {
        Some(AuditedModel {
            model: self.id.as_str(),
            reference_url: self.reference_url.as_deref()?,
            gguf: self.gguf.as_deref(),
            node_logprobs,
        })
    }
}

/// The catalog of `models`, each entry loaded from its GGUF ([`load_entry`]); logged (a
/// warning when it is empty: every completion request would be refused).
///
/// Blocking: reads and hashes each GGUF (call it at start-up, or in `spawn_blocking`).
///
/// # Errors
///
/// [`CatalogError::NoGguf`], [`CatalogError::Duplicate`], or [`CatalogError::Model`] with the
/// entry's own error: the first model that cannot be loaded.
pub fn load_catalog(models: &[ModelConfig]) -> Result<Catalog, CatalogError> {
    let mut catalog = Catalog::new();
    for m in models {
        let Some(gguf) = &m.gguf else {
            return Err(CatalogError::NoGguf(m.id.clone()));
        };
        let sha256 = m.gguf_sha256.as_deref();
        let entry = load_entry(gguf, sha256, m.price(), m.max_context_tokens).map_err(|e| {
            CatalogError::Model {
                id: m.id.clone(),
                source: Box::new(e),
            }
        })?;
        if catalog.insert(ModelId::new(m.id.as_str()), entry).is_some() {
            return Err(CatalogError::Duplicate(m.id.clone()));
        }
    }
    if catalog.is_empty() {
        tracing::warn!(
            "the catalog is empty: no [[models]] in the configuration, so every completion \
             request will be refused 404 model_not_found (docs/operations.md, `[[models]]`)"
        );
    } else {
        tracing::info!(models = ?catalog_ids(&catalog), "catalog loaded");
    }
    Ok(catalog)
}

/// The catalog's model ids, sorted.
pub fn catalog_ids(catalog: &Catalog) -> Vec<ModelId> {
    let mut ids: Vec<ModelId> = catalog.keys().cloned().collect();
    ids.sort();
    ids
}

/// The catalog entry of the model in `gguf` at `price`: when `sha256` is given the file must
/// have exactly those bytes ([`check_sha256`](crate::gguf::check_sha256)); the context window
/// is `max_context_tokens`, else the GGUF's, else [`DEFAULT_CONTEXT_TOKENS`].
///
/// # Errors
///
/// [`CatalogError`]: another file, or no tokenizer in it.
pub fn load_entry(
    gguf: &Path,
    sha256: Option<&str>,
    price: Price,
    max_context_tokens: Option<u64>,
) -> Result<CatalogEntry, CatalogError> {
    if let Some(want) = sha256 {
        crate::gguf::check_sha256(gguf, want)?;
    }
    let tokenizer = ModelTokenizer::from_gguf(gguf).map_err(|source| CatalogError::Tokenizer {
        path: gguf.to_owned(),
        source,
    })?;
    let max_context_tokens = max_context_tokens
        .or(tokenizer.context_length_tokens())
        .unwrap_or(DEFAULT_CONTEXT_TOKENS);
    Ok(CatalogEntry {
        tokenizer: Arc::new(tokenizer),
        price,
        max_context_tokens,
    })
}
