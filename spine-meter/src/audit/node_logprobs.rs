//! Scoring the node's own token choices from the logprobs it reports (design brief §10).
//!
//! Re-tokenizing the delivered text scores positions an honest node never sampled (its
//! tokenization may differ from the reference's) and, on sampled traffic, gives only a bound of
//! the node's token's surprisal. A node that reports its logprobs names its tokens and claims,
//! for each, the raw model's log-probability of it (llama.cpp's `logprob` without
//! `post_sampling_probs` is the softmax of the raw logits, before any sampler, whatever the
//! request's temperature). The reference, teacher-forced through the same tokens, computes the
//! same number: an honest node's claim agrees with it up to numerical noise (measured in
//! `docs/trust.md`), a substitute's does not, and a node that makes the numbers up does not
//! know the reference's.
//!
//! - [`NodeLogprobs`]: choice 0's list as the metering layer captured it from the node's
//!   answer (stream or not), bounded; [`parse_node_logprobs`] reads one `logprobs` member.
//! - [`TokenVocabulary`]: the reference model's tokens by their bytes, read from its GGUF;
//!   [`align`] maps the node's tokens to ids, checking that they spell the delivered text.
//! - [`logprob_observations`]: one [`Observation::Logprob`] per position, an *event* when the
//!   node's claim and the reference's logprob differ by more than
//!   [`ScoreConfig::logprob_event_nats`](super::ScoreConfig::logprob_event_nats).
//!
//! A node that was asked for its logprobs and sent none, or a list that does not spell what it
//! delivered, gives one event of [`MISSING_DELTA_NATS`] for the audit.
//!
//! Positions are scored up to the first token that cannot be mapped to one reference id: an
//! entry whose bytes are no single token of the vocabulary (llama.cpp sends a token that
//! completes a UTF-8 character, or that ends a held-back partial stop string, with the bytes of
//! the tokens held before it), an empty entry (a held-back token, the end-of-generation token),
//! or an entry whose `id` (when the node sends one) is not the vocabulary's id of its bytes.

use std::collections::HashMap;

use serde_json::Value;

use super::sprt::Observation;

/// The |Δ| recorded for the one event of an audit whose node was asked for logprobs and sent
/// none, or sent a list that is not its delivered text, nats.
pub const MISSING_DELTA_NATS: f64 = 3.0;

/// Most entries one capture keeps, whatever the tap asks (a memory bound per request).
pub const MAX_NODE_TOKENS: usize = 4096;

/// One generated token as the node reported it.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeToken {
    /// The token's bytes (`bytes` when the node sent them, else `token`'s UTF-8).
    pub bytes: Vec<u8>,
    /// The node's claimed natural log of the token's probability.
    pub logprob: f64,
    /// The token id, when the node sent one (llama.cpp does).
    pub id: Option<u64>,
}

/// Why a node's logprobs could not be read (one event for the audit: the node was asked).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NodeLogprobsError {
    /// The `logprobs` member is not JSON, not an object or has no token list.
    #[error("the node's logprobs are not a token list")]
    Shape,
    /// A token entry has no token text, or no finite logprob at most 0.
    #[error("the node's logprobs list a token without text or logprob")]
    Entry,
}

/// Choice 0's logprobs as captured from a node's answer, for an audit.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeLogprobs {
    /// The tokens in order (at most the capture's bound).
    pub tokens: Vec<NodeToken>,
    /// The first reading error, when one chunk's list was malformed.
    pub error: Option<NodeLogprobsError>,
    /// Whether any `logprobs` member arrived at all.
    pub seen: bool,
    max_tokens: usize,
}

impl NodeLogprobs {
    /// An empty capture keeping at most `max_tokens` entries (and at most [`MAX_NODE_TOKENS`]).
    pub fn new(max_tokens: usize) -> Self {
        Self {
            max_tokens: max_tokens.min(MAX_NODE_TOKENS),
            ..Self::default()
        }
    }

    /// Adds one choice-0 `logprobs` member (`None` or JSON `null`: nothing). A malformed one
    /// is recorded in [`error`](Self::error) and ends the capture.
    pub fn push(&mut self, logprobs: Option<&Value>) {
        let Some(v) = logprobs.filter(|v| !v.is_null()) else {
            return;
        };
        self.seen = true;
        if self.error.is_some() || self.tokens.len() >= self.max_tokens {
            return;
        }
        let room = self.max_tokens - self.tokens.len();
        if let Err(e) = read_list(v, &mut self.tokens, room) {
            self.error = Some(e);
        }
    }

    /// Whether the capture holds a usable list: one arrived, and none was malformed.
    pub fn is_usable(&self) -> bool {
        self.seen && self.error.is_none() && !self.tokens.is_empty()
    }
}

/// Reads one `logprobs` member (JSON bytes) into at most `max_tokens` tokens.
///
/// Two shapes are read: `{"content": [{"token", "bytes", "logprob", "id"?}, …]}` (OpenAI chat;
/// llama.cpp uses it for completions too) and OpenAI's legacy completions shape
/// `{"tokens": […], "token_logprobs": […]}`. `null` is an empty list.
///
/// # Errors
///
/// [`NodeLogprobsError`] when the bytes are not one of those shapes or an entry lacks its text
/// or a finite logprob at most 0 (a rounding of up to 1e-3 above 0 is read as 0).
pub fn parse_node_logprobs(
    json: &[u8],
    max_tokens: usize,
) -> Result<Vec<NodeToken>, NodeLogprobsError> {
    let v: Value = serde_json::from_slice(json).map_err(|_| NodeLogprobsError::Shape)?;
    let mut out = Vec::new();
    if !v.is_null() {
        read_list(&v, &mut out, max_tokens.min(MAX_NODE_TOKENS))?;
    }
    Ok(out)
}

fn read_list(v: &Value, out: &mut Vec<NodeToken>, room: usize) -> Result<(), NodeLogprobsError> {
    let obj = v.as_object().ok_or(NodeLogprobsError::Shape)?;
    if let Some(content) = obj.get("content").filter(|c| !c.is_null()) {
        let entries = content.as_array().ok_or(NodeLogprobsError::Shape)?;
        for e in entries.iter().take(room) {
            let text = e.get("token").and_then(Value::as_str);
            let bytes = match e.get("bytes") {
                Some(Value::Array(b)) => Some(bytes_of(b)?),
                None | Some(Value::Null) => None,
                Some(_) => return Err(NodeLogprobsError::Entry),
            };
            let bytes = bytes
                .or_else(|| text.map(|t| t.as_bytes().to_vec()))
                .ok_or(NodeLogprobsError::Entry)?;
            let logprob = logprob_of(e.get("logprob"))?;
            let id = match e.get("id") {
                None | Some(Value::Null) => None,
                Some(i) => Some(i.as_u64().ok_or(NodeLogprobsError::Entry)?),
            };
            out.push(NodeToken { bytes, logprob, id });
        }
        return Ok(());
    }
    let tokens = obj
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or(NodeLogprobsError::Shape)?;
    let lps = obj
        .get("token_logprobs")
        .and_then(Value::as_array)
        .ok_or(NodeLogprobsError::Shape)?;
    if tokens.len() != lps.len() {
        return Err(NodeLogprobsError::Shape);
    }
    for (t, lp) in tokens.iter().zip(lps).take(room) {
        let text = t.as_str().ok_or(NodeLogprobsError::Entry)?;
        out.push(NodeToken {
            bytes: text.as_bytes().to_vec(),
            logprob: logprob_of(Some(lp))?,
            id: None,
        });
    }
    Ok(())
}

fn bytes_of(b: &[Value]) -> Result<Vec<u8>, NodeLogprobsError> {
    b.iter()
        .map(|x| {
            x.as_u64()
                .and_then(|x| u8::try_from(x).ok())
                .ok_or(NodeLogprobsError::Entry)
        })
        .collect()
}

fn logprob_of(v: Option<&Value>) -> Result<f64, NodeLogprobsError> {
    let lp = v
        .and_then(Value::as_f64)
        .filter(|lp| lp.is_finite() && *lp <= 1e-3)
        .ok_or(NodeLogprobsError::Entry)?;
    Ok(lp.min(0.0))
}

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
    by_bytes: HashMap<Vec<u8>, u32>,
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
        let mut by_bytes = HashMap::with_capacity(tokens.len());
        for (id, text) in tokens.iter().enumerate() {
            let kept = types
                .and_then(|t| t.get(id))
                .is_none_or(|t| matches!(t, 1 | 4 | 6));
            let Ok(id) = u32::try_from(id) else { break };
            if !kept {
                continue;
            }
            if let Some(bytes) = decode(text).filter(|b| !b.is_empty()) {
                by_bytes.entry(bytes).or_insert(id);
            }
        }
        Ok(Self { by_bytes })
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
fn gpt2_bytes(text: &str) -> Option<Vec<u8>> {
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
fn spm_bytes(text: &str) -> Option<Vec<u8>> {
    if let Some(hex) = text
        .strip_prefix("<0x")
        .and_then(|t| t.strip_suffix('>'))
        .filter(|h| h.len() == 2)
    {
        return u8::from_str_radix(hex, 16).ok().map(|b| vec![b]);
    }
    Some(text.replace('\u{2581}', " ").into_bytes())
}

/// The node's tokens mapped to reference ids, with its claims.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AlignedTokens {
    /// Reference ids of the scored prefix.
    pub ids: Vec<u32>,
    /// The node's claimed logprob of each.
    pub logprobs: Vec<f64>,
}

/// Why a node's list cannot be scored against what it delivered (one event: the node claimed
/// tokens it did not deliver).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the node's logprobs do not spell its delivered text (at byte {0})")]
pub struct Misaligned(pub usize);

/// Maps the node's `tokens` to reference ids, checking they spell `text` (choice 0's
/// delivered text, possibly cut at the capture cap); at most `max_tokens` positions.
///
/// Stops (without error) at the first token that is not exactly one vocabulary token (module
/// docs), that is not whole UTF-8, or that runs past the end of `text`.
///
/// # Errors
///
/// [`Misaligned`] when a token's bytes are not the text at its place.
pub fn align(
    vocab: &TokenVocabulary,
    tokens: &[NodeToken],
    text: &[u8],
    max_tokens: usize,
) -> Result<AlignedTokens, Misaligned> {
    let mut out = AlignedTokens::default();
    let mut offset = 0usize;
    for t in tokens {
        if out.ids.len() >= max_tokens || t.bytes.is_empty() {
            break;
        }
        let rest = &text[offset.min(text.len())..];
        if !rest.starts_with(&t.bytes) {
            if t.bytes.starts_with(rest) {
                break; // the capture cap cut this token's text
            }
            return Err(Misaligned(offset));
        }
        if std::str::from_utf8(&t.bytes).is_err() {
            break;
        }
        let Some(id) = vocab.id(&t.bytes) else { break };
        if t.id.is_some_and(|claimed| claimed != u64::from(id)) {
            break;
        }
        out.ids.push(id);
        out.logprobs.push(t.logprob);
        offset += t.bytes.len();
    }
    Ok(out)
}

/// One observation per position: `node` the node's claims, `reference` the reference's
/// logprob of the same forced token (`None`: not listed, not scored); an event when they differ
/// by more than `event_nats`.
pub fn logprob_observations(
    node: &[f64],
    reference: &[Option<f64>],
    event_nats: f64,
) -> Vec<Observation> {
    node.iter()
        .zip(reference)
        .filter_map(|(n, r)| {
            let r = (*r)?;
            let delta = (n - r).abs();
            let delta = if delta.is_nan() { f64::INFINITY } else { delta };
            Some(Observation::Logprob {
                delta,
                event: delta > event_nats,
            })
        })
        .collect()
}

/// The observation of an audit whose node sent no usable list: one event of
/// [`MISSING_DELTA_NATS`].
pub fn missing_observation() -> Observation {
    Observation::Logprob {
        delta: MISSING_DELTA_NATS,
        event: true,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn vocab() -> TokenVocabulary {
        let tokens: Vec<String> = ["Hello", "Ġworld", "!", "<|im_end|>", "Ċ", "é"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        TokenVocabulary::from_tokens("gpt2", &tokens, Some(&[1, 1, 1, 3, 1, 1])).unwrap()
    }

    #[test]
    fn gpt2_alphabet_decodes_space_newline_and_high_bytes() {
        assert_eq!(gpt2_bytes("Ġworld").unwrap(), b" world");
        assert_eq!(gpt2_bytes("Ċ").unwrap(), b"\n");
        // "é" is U+00E9, printable in the alphabet: byte 0xE9
        assert_eq!(gpt2_bytes("é").unwrap(), vec![0xe9]);
        assert_eq!(gpt2_bytes("Ã©").unwrap(), "é".as_bytes());
        assert_eq!(spm_bytes("▁the").unwrap(), b" the");
        assert_eq!(spm_bytes("<0x0A>").unwrap(), b"\n");
    }

    #[test]
    fn vocabulary_keeps_normal_tokens_only() {
        let v = vocab();
        assert_eq!(v.id(b"Hello"), Some(0));
        assert_eq!(v.id(b" world"), Some(1));
        assert_eq!(v.id(b"<|im_end|>"), None);
        assert_eq!(v.id(b"\n"), Some(4));
    }

    #[test]
    fn parses_chat_and_legacy_shapes() {
        let chat = br#"{"content":[{"id":0,"token":"Hello","bytes":[72,101,108,108,111],"logprob":-0.5,"top_logprobs":[]},{"token":" world","logprob":0.0001}]}"#;
        let t = parse_node_logprobs(chat, 10).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].bytes, b"Hello");
        assert_eq!(t[0].id, Some(0));
        assert_eq!(t[1].logprob, 0.0);
        assert_eq!(parse_node_logprobs(chat, 1).unwrap().len(), 1);
        let legacy = br#"{"tokens":["Hello"," world"],"token_logprobs":[-1.0,-2.0]}"#;
        let t = parse_node_logprobs(legacy, 10).unwrap();
        assert_eq!(t[1].bytes, b" world");
        assert_eq!(t[1].logprob, -2.0);
        assert_eq!(parse_node_logprobs(b"null", 10).unwrap(), vec![]);
        for bad in [
            &br#"{"content":[{"token":"a","logprob":0.5}]}"#[..],
            br#"{"content":[{"token":"a"}]}"#,
            br#"{"content":[{"logprob":-1}]}"#,
            br#"{"content":[{"token":"a","bytes":[256],"logprob":-1}]}"#,
            br#"{"tokens":["a"],"token_logprobs":[]}"#,
            br#"[1]"#,
            b"{",
        ] {
            assert!(parse_node_logprobs(bad, 10).is_err(), "{:?}", bad);
        }
    }

    fn tok(s: &str, lp: f64) -> NodeToken {
        NodeToken {
            bytes: s.as_bytes().to_vec(),
            logprob: lp,
            id: None,
        }
    }

    #[test]
    fn align_maps_and_stops_at_unmappable_or_cut_tokens() {
        let v = vocab();
        let toks = [tok("Hello", -0.1), tok(" world", -0.2), tok("!\n", -0.3)];
        let a = align(&v, &toks, b"Hello world!\n", 10).unwrap();
        assert_eq!(a.ids, vec![0, 1]);
        assert_eq!(a.logprobs, vec![-0.1, -0.2]);
        // cut by the capture cap
        let a = align(&v, &toks, b"Hello wor", 10).unwrap();
        assert_eq!(a.ids, vec![0]);
        // an empty entry (a held-back token) stops
        let a = align(&v, &[tok("", -1.0), tok("Hello", -0.1)], b"Hello", 10).unwrap();
        assert!(a.ids.is_empty());
        // a claimed id that is not the vocabulary's stops
        let mut t = tok("Hello", -0.1);
        t.id = Some(7);
        assert!(align(&v, &[t], b"Hello", 10).unwrap().ids.is_empty());
        assert_eq!(align(&v, &toks, b"Hello there", 10), Err(Misaligned(5)));
        assert_eq!(align(&v, &toks, b"Hello world!\n", 1).unwrap().ids, vec![0]);
    }

    #[test]
    fn observations_fire_past_the_event_threshold() {
        let o = logprob_observations(&[-0.1, -0.2, -5.0], &[Some(-0.3), None, Some(-1.0)], 1.0);
        assert_eq!(o.len(), 2);
        assert!(!o[0].is_event());
        assert!(o[1].is_event());
        assert!(missing_observation().is_event());
    }

    #[test]
    fn capture_is_bounded_and_records_malformed_lists() {
        let mut c = NodeLogprobs::new(2);
        let v: Value = serde_json::from_str(
            r#"{"content":[{"token":"a","logprob":-1},{"token":"b","logprob":-1},{"token":"c","logprob":-1}]}"#,
        )
        .unwrap();
        c.push(Some(&v));
        c.push(Some(&v));
        assert_eq!(c.tokens.len(), 2);
        assert!(c.is_usable());
        let mut c = NodeLogprobs::new(8);
        c.push(Some(&Value::Null));
        assert!(!c.seen);
        c.push(Some(&serde_json::json!({"content": 3})));
        assert_eq!(c.error, Some(NodeLogprobsError::Shape));
        assert!(!c.is_usable());
    }
}
