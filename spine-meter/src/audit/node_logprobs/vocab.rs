//! The reference model's tokens by their bytes, read from its GGUF ([`TokenVocabulary`]).

use std::collections::HashMap;

/// Why a vocabulary could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VocabularyError {
    /// The GGUF could not be read.
    #[cfg(feature = "tokenizer")]
    #[error("reading the gguf")]
    Gguf(#[source] crate::gguf::GgufError),
    /// The GGUF has no `tokenizer.ggml.tokens`.
    #[error("the gguf lists no tokenizer tokens")]
    NoTokens,
    /// `tokenizer.ggml.model` is not one whose token texts this reader decodes.
    #[error("tokenizer model '{0}' is not supported (gpt2 and llama are)")]
    Unsupported(String),
}

/// The reference model's vocabulary by token bytes: maps a node's token to the reference's id.
///
/// Only normal, user-defined and byte tokens are kept (control tokens such as the
/// end-of-generation token are never forced: llama.cpp answers 500 when a grammar holds one);
/// a byte string two tokens share keeps the lower id.
#[derive(Clone, Debug, Default)]
pub struct TokenVocabulary {
    pub(super) by_bytes: HashMap<Vec<u8>, u32>,
    /// Each id's bytes (empty: not kept).
    by_id: Vec<Vec<u8>>,
    /// Byte strings two kept tokens share (their id is ambiguous without the node's `id`).
    pub(super) shared: std::collections::HashSet<Vec<u8>>,
    /// Each kept token's bytes before a byte ≥ 0x80 that begins no whole character there (a
    /// lead byte whose character the token does not finish, or a stray byte), where the bytes
    /// before it are valid UTF-8 ([`Self::begins_broken_token`]).
    before_broken: std::collections::HashSet<Vec<u8>>,
    max_token_bytes: usize,
}

impl TokenVocabulary {
    /// Reads `tokenizer.ggml.tokens`, `tokenizer.ggml.token_type` and `tokenizer.ggml.model`
    /// from a GGUF's header.
    ///
    /// # Errors
    ///
    /// [`VocabularyError`] when the file cannot be read or its tokenizer is not one this reader
    /// decodes (`gpt2`: byte-level BPE; `llama`: SentencePiece with `▁` and `<0xXX>` byte
    /// tokens).
    #[cfg(feature = "tokenizer")]
    pub fn from_gguf(path: impl AsRef<std::path::Path>) -> Result<Self, VocabularyError> {
        let meta = crate::gguf::GgufMetadata::open(path).map_err(VocabularyError::Gguf)?;
        let tokens = meta
            .get_strings("tokenizer.ggml.tokens")
            .ok_or(VocabularyError::NoTokens)?;
        let types = meta.get_ints("tokenizer.ggml.token_type");
        let model = meta.get_str("tokenizer.ggml.model").unwrap_or("gpt2");
        Self::from_tokens(model, tokens, types.as_deref())
    }

    /// A vocabulary from a tokenizer model name (`gpt2` or `llama`), its token texts as the
    /// GGUF stores them, and their types (GGUF: 1 normal, 3 control, 4 user-defined, 6 byte;
    /// `None`: all kept).
    ///
    /// # Errors
    ///
    /// [`VocabularyError::Unsupported`] for another model.
    pub fn from_tokens(
        model: &str,
        tokens: &[String],
        types: Option<&[i64]>,
    ) -> Result<Self, VocabularyError> {
        let decode: fn(&str) -> Option<Vec<u8>> = match model {
            "gpt2" => gpt2_bytes,
            "llama" => spm_bytes,
            other => return Err(VocabularyError::Unsupported(other.to_owned())),
        };
        let mut v = Self {
            by_bytes: HashMap::with_capacity(tokens.len()),
            by_id: Vec::with_capacity(tokens.len()),
            ..Self::default()
        };
        for (id, text) in tokens.iter().enumerate() {
            let kept = types
                .and_then(|t| t.get(id))
                .is_none_or(|t| matches!(t, 1 | 4 | 6));
            let Ok(id) = u32::try_from(id) else { break };
            let bytes = decode(text)
                .filter(|b| kept && !b.is_empty())
                .unwrap_or_default();
            if !bytes.is_empty() {
                v.max_token_bytes = v.max_token_bytes.max(bytes.len());
                if let Err(e) = std::str::from_utf8(&bytes) {
                    v.before_broken.insert(bytes[..e.valid_up_to()].to_vec());
                }
                if v.by_bytes.contains_key(&bytes) {
                    v.shared.insert(bytes.clone());
                } else {
                    v.by_bytes.insert(bytes.clone(), id);
                }
            }
            v.by_id.push(bytes);
        }
        Ok(v)
    }

    /// The bytes of token `id` (`None`: out of range, or not kept: a control token).
    pub fn bytes(&self, id: u32) -> Option<&[u8]> {
        self.by_id
            .get(usize::try_from(id).ok()?)
            .map(Vec::as_slice)
            .filter(|b| !b.is_empty())
    }

    /// Whether some kept token is `text` followed by a byte that begins no whole character
    /// there (what the token's bytes before its first invalid UTF-8 byte are): the token an
    /// honest llama.cpp held at the end of its text behind an incomplete sequence starts so
    /// (`honest_tail`).
    pub fn begins_broken_token(&self, text: &[u8]) -> bool {
        self.before_broken.contains(text)
    }

    /// The most bytes one kept token spells.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// The id of the token whose bytes are `bytes`.
    pub fn id(&self, bytes: &[u8]) -> Option<u32> {
        self.by_bytes.get(bytes).copied()
    }

    /// Tokens kept.
    pub fn len(&self) -> usize {
        self.by_bytes.len()
    }

    /// Whether no token was kept.
    pub fn is_empty(&self) -> bool {
        self.by_bytes.is_empty()
    }
}

/// GPT-2's byte-level alphabet: the printable bytes stand for themselves, the other 68 bytes
/// for U+0100 onwards in byte order.
pub(super) fn gpt2_bytes(text: &str) -> Option<Vec<u8>> {
    fn printable(b: u32) -> bool {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    }
    text.chars()
        .map(|c| {
            let c = u32::from(c);
            if printable(c) {
                return u8::try_from(c).ok();
            }
            let n = c.checked_sub(256)?;
            (0u32..256)
                .filter(|b| !printable(*b))
                .nth(usize::try_from(n).ok()?)
                .and_then(|b| u8::try_from(b).ok())
        })
        .collect()
}

/// SentencePiece: `▁` is a space, `<0xAB>` one byte.
pub(super) fn spm_bytes(text: &str) -> Option<Vec<u8>> {
    if let Some(hex) = text
        .strip_prefix("<0x")
        .and_then(|t| t.strip_suffix('>'))
        .filter(|h| h.len() == 2)
    {
        return u8::from_str_radix(hex, 16).ok().map(|b| vec![b]);
    }
    Some(text.replace('\u{2581}', " ").into_bytes())
}
