//! A catalog entry loaded from the model's GGUF: its tokenizer and chat template, its identity
//! checked, its context window.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::gguf::DigestError;
use crate::meter::CatalogEntry;
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
