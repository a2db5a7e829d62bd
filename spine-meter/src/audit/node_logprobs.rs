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
//! What the pinned llama.cpp lists (`server-context.cpp` `process_token`, `send_final_response`;
//! `server-task.cpp` `probs_vector_to_json`), and how [`align`] reads it:
//!
//! - A token after which the generated text ends inside a UTF-8 character is not listed at all;
//!   the token that completes the character gets one entry: the bytes of the held-back tokens
//!   and its own, its own `id` and `logprob`. [`align`] feeds the held-back tokens as unscored
//!   context (their decomposition: [`align`]'s docs) and goes on.
//! - A token held back by a partial stop string gets an empty entry (its `id` and `logprob`);
//!   the next entry carries both texts. [`align`] scores the held tokens when the next entry's
//!   bytes start with exactly their bytes.
//! - The end-of-generation token gets an empty entry (or one carrying held text) whose id is a
//!   control token: alignment ends there.
//! - Non-streamed answers that stopped at a stop word drop as many entries from the end of the
//!   list as the stop word has tokens; a generation that ended inside an incomplete UTF-8
//!   sequence (a character cut at `max_tokens`, or a lone lead byte sampled before the last
//!   token or two) never lists the tokens held since it began (all of them held: no
//!   `logprobs` at all). Beyond that slack ([`honest_tail`]), a list that covers less of the
//!   delivered text than the node delivered ([`covered_bytes`]) is *short*: one event, as a
//!   missing list.
//!
//! A token that splits a UTF-8 character cannot be forced through the pinned llama.cpp's
//! token-id grammar: the reference feeds it as prompt ([`ForcedToken::split`]); its position is
//! never scored.

use serde_json::Value;

use super::reference::ForcedToken;
use super::sprt::Observation;

mod coverage;
mod vocab;
pub use coverage::{covered_bytes, honest_tail, longest_stop_bytes};
use coverage::{held_incomplete, stop_word_slack};
#[cfg(test)]
use vocab::{gpt2_bytes, spm_bytes};
pub use vocab::{TokenVocabulary, VocabularyError};

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

    /// Whether the capture kept as many entries as it may (later ones were not kept: the list
    /// cannot be judged short).
    pub fn is_full(&self) -> bool {
        self.tokens.len() >= self.max_tokens
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

/// The node's tokens mapped to reference ids, with its claims: one entry per token the
/// reference is fed, in order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AlignedTokens {
    /// The tokens, as the reference is asked to force them ([`ForceQuery`](super::ForceQuery)).
    pub tokens: Vec<ForcedToken>,
    /// The node's claimed logprob of each token, nats (`None` where not scored: a held-back
    /// token the node listed no logprob for, or one that splits a UTF-8 character).
    pub logprobs: Vec<Option<f64>>,
}

impl AlignedTokens {
    /// Positions scored (tokens with a claim).
    pub fn scored(&self) -> usize {
        self.logprobs.iter().filter(|l| l.is_some()).count()
    }

    fn push(&mut self, vocab: &TokenVocabulary, id: u32, claim: Option<f64>) {
        let split = vocab
            .bytes(id)
            .is_none_or(|b| std::str::from_utf8(b).is_err());
        let claim = claim.filter(|_| !split);
        self.tokens.push(ForcedToken {
            id,
            split,
            scored: claim.is_some(),
        });
        self.logprobs.push(claim);
    }
}

/// Why a node's list cannot be scored against what it delivered (one event: the node claimed
/// tokens it did not deliver).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the node's logprobs do not spell its delivered text (at byte {0})")]
pub struct Misaligned(pub usize);

/// Most empty entries (tokens held back by a partial stop string) carried to the next entry.
const MAX_HELD: usize = 64;

/// Maps the node's `tokens` to reference ids, checking they spell `text` (choice 0's
/// delivered text, possibly cut at the capture cap); at most `max_tokens` tokens (scored or
/// not).
///
/// An entry is read as llama.cpp writes it (module docs): its `id`'s bytes end its bytes, and
/// what comes before them (the prefix) is the text of tokens it held back:
///
/// - after empty entries (held by a partial stop string), the prefix must be exactly the held
///   tokens' bytes: those tokens are scored with their own entries' claims;
/// - else the tokens were held because the text ended inside a UTF-8 character after each:
///   the prefix is split into vocabulary tokens such that every cut, and the prefix's end, falls
///   inside a character of `text` (otherwise llama.cpp would have listed them), taking the split
///   with the **fewest tokens** when exactly one split has that count; none or a tie stops
///   alignment. The held tokens are fed as unscored context. Why fewest: the node's model was
///   trained on byte-pair-encoded text, where a mergeable byte pair is merged, so it samples
///   the merged token far more often; a wrong split changes the reference's context for every
///   later position (possibly false events for an honest node), so ambiguity is never guessed
///   beyond that one rule (measured in `docs/trust.md`).
///
/// Without an `id` (OpenAI's legacy shape) an entry must be exactly one vocabulary token.
///
/// Stops (without error) at an entry it cannot read so: the last entry when its `id` is out
/// of the vocabulary, a control token (the end of generation) or one whose bytes do not end the
/// entry (a stop word's token, its text cut before the stop word); an entry that is not whole UTF-8 (unless it is exactly its token); one that runs past
/// the end of `text` (the capture cap); a prefix with no split or a tie; or when `max_tokens`
/// would be passed.
///
/// # Errors
///
/// [`Misaligned`] when an entry's bytes are not the text at its place, or an entry that is not
/// the last has such an `id`, ends in an incomplete UTF-8 sequence, or (a request without stop
/// words: [`align_for`]) holds bytes that do not end in one — an honest llama.cpp never sends
/// such entries.
pub fn align(
    vocab: &TokenVocabulary,
    tokens: &[NodeToken],
    text: &[u8],
    max_tokens: usize,
) -> Result<AlignedTokens, Misaligned> {
    align_for(vocab, tokens, text, max_tokens, false)
}

/// [`align`] for a request with (`stop_words`) or without stop words. A streamed llama.cpp
/// answer sends no entry for a token a partial stop string held (its chunk has no content):
/// the next entry carries the held text before its own token's, text that need not end in an
/// incomplete sequence (measured: `" as the"` with the id of `" the"`, stop words `"\n"` and
/// `"s,"`). With stop words such a prefix stops alignment without an error.
///
/// # Errors
///
/// As [`align`].
pub fn align_for(
    vocab: &TokenVocabulary,
    tokens: &[NodeToken],
    text: &[u8],
    max_tokens: usize,
    stop_words: bool,
) -> Result<AlignedTokens, Misaligned> {
    let mut out = AlignedTokens::default();
    let mut offset = 0usize;
    // (id, claim) of empty entries: tokens a partial stop string held back
    let mut held: Vec<(u32, f64)> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        let spelled = match meets(&t.bytes, &text[offset..]) {
            Meets::Spells(n) => n,
            Meets::Cut => break, // the capture cap cut this token's text
            Meets::Diverges => return Err(Misaligned(offset)),
        };
        let readable = t.id.is_none_or(|id| {
            u32::try_from(id)
                .ok()
                .and_then(|id| vocab.bytes(id))
                .is_some_and(|b| t.bytes.ends_with(b))
        });
        if !t.bytes.is_empty() && !readable {
            // honest llama.cpp: only the last entry (end of generation, a stop word's token)
            if i + 1 < tokens.len() {
                return Err(Misaligned(offset));
            }
            break;
        }
        if t.bytes.is_empty() {
            let id = t.id.and_then(|id| u32::try_from(id).ok());
            match id.filter(|id| vocab.bytes(*id).is_some()) {
                Some(id) if held.len() < MAX_HELD => {
                    held.push((id, t.logprob));
                    continue;
                }
                Some(_) => break,
                // the end of generation: llama.cpp's last entry
                None if t.id.is_some() && i + 1 < tokens.len() => {
                    return Err(Misaligned(offset));
                }
                None => break,
            }
        }
        if held.is_empty() && !held_as_llama_cpp_holds(vocab, t, stop_words) {
            // not what an honest llama.cpp lists, except as its last entry (a stop word's)
            if i + 1 < tokens.len() {
                return Err(Misaligned(offset));
            }
            break;
        }
        let entry = if std::str::from_utf8(&t.bytes).is_ok() {
            entry_tokens(vocab, t, &held, text, offset)
        } else {
            invalid_entry_tokens(vocab, t, &held)
        };
        let Some(entry) = entry else {
            break;
        };
        if out.tokens.len() + entry.len() > max_tokens {
            break;
        }
        for (id, claim) in entry {
            out.push(vocab, id, claim);
        }
        held.clear();
        offset += spelled;
    }
    Ok(out)
}

/// How an entry's bytes meet the delivered text at its place.
enum Meets {
    /// The entry spells the text's next `n` bytes.
    Spells(usize),
    /// The text ends inside the entry (the capture cap cut it).
    Cut,
    /// The entry is not the text.
    Diverges,
}

fn meets(bytes: &[u8], rest: &[u8]) -> Meets {
    if rest.starts_with(bytes) {
        return Meets::Spells(bytes.len());
    }
    if std::str::from_utf8(bytes).is_err() {
        // llama.cpp's JSON (nlohmann's `replace`) delivers invalid UTF-8 as U+FFFD
        let lossy = String::from_utf8_lossy(bytes);
        if rest.starts_with(lossy.as_bytes()) {
            return Meets::Spells(lossy.len());
        }
        if lossy.as_bytes().starts_with(rest) {
            return Meets::Cut;
        }
    }
    if bytes.starts_with(rest) {
        Meets::Cut
    } else {
        Meets::Diverges
    }
}

/// The tokens one non-empty entry at `offset` of `text` stands for, with their claims
/// (`None`: held back, unlisted); `None` when the entry cannot be read ([`align`]).
fn entry_tokens(
    vocab: &TokenVocabulary,
    t: &NodeToken,
    held: &[(u32, f64)],
    text: &[u8],
    offset: usize,
) -> Option<Vec<(u32, Option<f64>)>> {
    let Some(id) = t.id else {
        if !held.is_empty() || vocab.shared.contains(&t.bytes) {
            return None;
        }
        return Some(vec![(vocab.id(&t.bytes)?, Some(t.logprob))]);
    };
    let id = u32::try_from(id).ok()?;
    let prefix = t.bytes.strip_suffix(vocab.bytes(id)?)?;
    let mut out = Vec::new();
    if !held.is_empty() {
        let spelled: Vec<u8> = held
            .iter()
            .filter_map(|(h, _)| vocab.bytes(*h))
            .flatten()
            .copied()
            .collect();
        if spelled != prefix {
            return None;
        }
        out.extend(held.iter().map(|(h, lp)| (*h, Some(*lp))));
    } else if !prefix.is_empty() {
        let ids = held_back_split(vocab, prefix, text, offset)?;
        out.extend(ids.into_iter().map(|h| (h, None)));
    }
    out.push((id, Some(t.logprob)));
    Some(out)
}

/// Whether the bytes `b` end in an incomplete UTF-8 sequence as llama.cpp's `validate_utf8`
/// sees it (`server-common.cpp`): a lead byte among the last 3 bytes with fewer bytes after it
/// than its character needs (every lead byte there is looked at, not only the last).
pub fn ends_incomplete(b: &[u8]) -> bool {
    (1..=b.len().min(4)).any(|i| {
        let c = b[b.len() - i];
        (c & 0xe0 == 0xc0 && i < 2) || (c & 0xf0 == 0xe0 && i < 3) || (c & 0xf8 == 0xf0 && i < 4)
    })
}

/// Whether a non-empty entry with an `id` (no empty entries before it) holds back tokens only as
/// the pinned llama.cpp does: it lists a token only once the text is complete
/// ([`ends_incomplete`]), so an entry never ends incomplete, and, for a request without stop
/// words, the bytes before its own token's (tokens it held) always do ([`align_for`]).
fn held_as_llama_cpp_holds(vocab: &TokenVocabulary, t: &NodeToken, stop_words: bool) -> bool {
    let Some(own) =
        t.id.and_then(|id| u32::try_from(id).ok())
            .and_then(|id| vocab.bytes(id))
    else {
        return true;
    };
    let prefix = t.bytes.strip_suffix(own).unwrap_or_default();
    !ends_incomplete(&t.bytes) && (stop_words || prefix.is_empty() || ends_incomplete(prefix))
}

/// The tokens of a non-empty entry that is not valid UTF-8 (the answer's JSON delivered its
/// invalid bytes as U+FFFD, [`meets`]), with their claims: an entry ending in its `id`'s bytes
/// whose bytes before them are tokens llama.cpp held behind a lead byte that never got its
/// character (`validate_utf8` kept the text incomplete: the lead byte's token and at most 2
/// bytes more), split as [`held_back_split`] splits (every cut where the held bytes so far end
/// incomplete, [`ends_incomplete`]: the text holds U+FFFD there) and fed as context; the entry's own token is scored unless it is itself
/// not valid UTF-8 (a stray byte: fed as context). `None` when it cannot be read.
fn invalid_entry_tokens(
    vocab: &TokenVocabulary,
    t: &NodeToken,
    held: &[(u32, f64)],
) -> Option<Vec<(u32, Option<f64>)>> {
    if !held.is_empty() {
        return None;
    }
    let id = u32::try_from(t.id?).ok()?;
    let prefix = t.bytes.strip_suffix(vocab.bytes(id)?)?;
    let mut out: Vec<(u32, Option<f64>)> = Vec::new();
    if !prefix.is_empty() {
        // llama.cpp held each of them because the text was still incomplete after it
        let ids = fewest_token_split(vocab, prefix, |j| ends_incomplete(&prefix[..j]))?;
        out.extend(ids.into_iter().map(|h| (h, None)));
    }
    // `AlignedTokens::push` drops the claim of a token that is not valid UTF-8
    out.push((id, Some(t.logprob)));
    Some(out)
}

/// The split of `prefix` (at `offset` of `text`) into the vocabulary tokens llama.cpp held
/// back: every cut after a token falls inside a UTF-8 character of `text` (a byte of `text`
/// that is a continuation byte follows it); the split with the fewest tokens, when exactly one
/// has that count (a byte string two ids share counts twice).
fn held_back_split(
    vocab: &TokenVocabulary,
    prefix: &[u8],
    text: &[u8],
    offset: usize,
) -> Option<Vec<u32>> {
    let inside = |j: usize| text.get(offset + j).is_some_and(|b| b & 0xc0 == 0x80);
    if !inside(prefix.len()) {
        return None;
    }
    fewest_token_split(vocab, prefix, inside)
}

/// The split of `prefix` into vocabulary tokens with the fewest tokens, every cut after a
/// token at a `j` where `cut_ok(j)`, when exactly one split has that count (a byte string two
/// ids share counts twice); `None` when there is none, or it is not unique, or `prefix` is
/// longer than held tokens can be (a token and 3 bytes).
fn fewest_token_split(
    vocab: &TokenVocabulary,
    prefix: &[u8],
    cut_ok: impl Fn(usize) -> bool,
) -> Option<Vec<u32>> {
    // cuts other than the start lie inside one character (at most 3 bytes after its first),
    // or after a lead byte that never got its character (at most 2 bytes after it)
    if prefix.len() > vocab.max_token_bytes() + 3 {
        return None;
    }
    // best[j]: (fewest tokens spelling prefix[..j], ways with that count capped at 2, the
    // last token's start, its id)
    let mut best: Vec<Option<(usize, u8, usize, u32)>> = vec![None; prefix.len() + 1];
    best[0] = Some((0, 1, 0, 0));
    for j in 1..=prefix.len() {
        if j < prefix.len() && !cut_ok(j) {
            continue;
        }
        let lo = j.saturating_sub(vocab.max_token_bytes());
        for i in lo..j {
            let Some((n, ways, _, _)) = best[i] else {
                continue;
            };
            let piece = &prefix[i..j];
            let Some(id) = vocab.id(piece) else { continue };
            let ways = if vocab.shared.contains(piece) {
                2
            } else {
                ways
            };
            best[j] = match best[j] {
                Some((m, w, li, lid)) if m < n + 1 => Some((m, w, li, lid)),
                Some((m, w, li, lid)) if m == n + 1 => Some((m, (w + ways).min(2), li, lid)),
                _ => Some((n + 1, ways, i, id)),
            };
        }
    }
    let (_, ways, _, _) = best[prefix.len()]?;
    if ways != 1 {
        return None;
    }
    let mut ids = Vec::new();
    let mut j = prefix.len();
    while j > 0 {
        let (_, _, i, id) = best[j]?;
        ids.push(id);
        j = i;
    }
    ids.reverse();
    Some(ids)
}

/// What an audit makes of a node's captured list ([`judge_node_list`]).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum NodeList {
    /// The node sent no usable list ([`NodeLogprobs::is_usable`]): one event, counted as
    /// missing.
    Unusable,
    /// The list does not spell the delivered text: one event, counted as missing.
    Misaligned(Misaligned),
    /// The list, not cut by the capture's bound, spells only `covered_bytes` of the delivered
    /// text's `delivered_bytes`, less than an honest llama.cpp's would ([`honest_tail`]): one
    /// event, counted as short.
    Short {
        /// Bytes of the text the list spells.
        covered_bytes: usize,
        /// Bytes delivered.
        delivered_bytes: usize,
    },
    /// The tokens to force and the node's claims ([`align`]).
    Aligned(AlignedTokens),
    /// The list spells the delivered text, but its token ids are not the catalog vocabulary's
    /// tokens of those bytes: another model's vocabulary (an honest llama.cpp on the catalog's
    /// GGUF never sends one). One event, counted as missing, **and** the list read again by
    /// its bytes alone (an entry that is one vocabulary token is scored; any other is split
    /// by longest match and fed as context), whose positions are scored like an aligned
    /// list's: the node's claims against the reference's logprobs of the same bytes. Measured (`docs/trust.md`): Gemma 3 270M served as SmolLM2
    /// reaches `failed` in its first audited reply this way, in four without.
    Foreign {
        /// Where the ids stopped reading ([`align`]'s error).
        at: Misaligned,
        /// The list read by its bytes (at least one scored position).
        by_bytes: AlignedTokens,
    },
}

/// Judges a node's captured list against its delivered `text` for a request `request_body`
/// (its `stop` words set the honest slack): unusable, misaligned, short, or aligned (at most
/// `max_tokens` tokens).
pub fn judge_node_list(
    vocab: &TokenVocabulary,
    capture: &NodeLogprobs,
    text: &[u8],
    request_body: &[u8],
    max_tokens: usize,
) -> NodeList {
    let max_token_bytes = vocab.max_token_bytes();
    let stop_bytes = longest_stop_bytes(request_body);
    if !capture.is_usable() {
        // every token held behind an incomplete sequence at the end, or every entry dropped
        // with the stop word's (`send_final_response`): llama.cpp leaves `logprobs` out
        // ([`honest_tail`])
        if capture.error.is_none()
            && capture.tokens.is_empty()
            && (held_incomplete(text, vocab) || stop_word_slack(text, stop_bytes, max_token_bytes))
        {
            return NodeList::Aligned(AlignedTokens::default());
        }
        return NodeList::Unusable;
    }
    let covered = match covered_bytes(&capture.tokens, text) {
        Ok(c) => c,
        Err(e) => return NodeList::Misaligned(e),
    };
    let tail = &text[covered..];
    // a list that spells nothing of the text held nothing behind an incomplete sequence:
    // llama.cpp would have listed no entry at all (above); only the stop words' slack is left
    let honest = if covered == 0 {
        tail.is_empty() || stop_word_slack(tail, stop_bytes, max_token_bytes)
    } else {
        honest_tail(tail, stop_bytes, vocab)
    };
    if !capture.is_full() && !honest {
        return NodeList::Short {
            covered_bytes: covered,
            delivered_bytes: text.len(),
        };
    }
    match align_for(vocab, &capture.tokens, text, max_tokens, stop_bytes > 0) {
        Ok(a) => NodeList::Aligned(a),
        // the bytes spell the text (`covered_bytes`), the ids do not read: read the bytes alone
        Err(at) if capture.tokens.iter().any(|t| t.id.is_some()) => {
            let by_bytes = align_by_bytes(vocab, &capture.tokens, text, max_tokens);
            if by_bytes.scored() > 0 {
                NodeList::Foreign { at, by_bytes }
            } else {
                NodeList::Misaligned(at)
            }
        }
        Err(e) => NodeList::Misaligned(e),
    }
}

/// A list in another vocabulary read by its bytes ([`NodeList::Foreign`]): an entry that is
/// one vocabulary token (spelled by no other) is scored with its claim; any other entry's bytes
/// are split into vocabulary tokens by longest match and fed as unscored context. This is no
/// claim about what the node sampled (an honest llama.cpp on the catalog's GGUF never sends
/// such a list), only a way to put a substitute's claims before the reference. Stops at
/// `max_tokens`, at the end of `text`, or at bytes no vocabulary token spells.
fn align_by_bytes(
    vocab: &TokenVocabulary,
    tokens: &[NodeToken],
    text: &[u8],
    max_tokens: usize,
) -> AlignedTokens {
    let mut out = AlignedTokens::default();
    let mut offset = 0usize;
    for t in tokens.iter().filter(|t| !t.bytes.is_empty()) {
        let Meets::Spells(n) = meets(&t.bytes, &text[offset..]) else {
            break;
        };
        // the delivered bytes (an invalid entry arrives as U+FFFD)
        let piece = &text[offset..offset + n];
        let entry: Vec<(u32, Option<f64>)> =
            match vocab.id(piece).filter(|_| !vocab.shared.contains(piece)) {
                Some(id) => vec![(id, Some(t.logprob))],
                None => match split_longest(vocab, piece) {
                    Some(ids) => ids.into_iter().map(|id| (id, None)).collect(),
                    None => break,
                },
            };
        if out.tokens.len() + entry.len() > max_tokens {
            break;
        }
        for (id, claim) in entry {
            out.push(vocab, id, claim);
        }
        offset += n;
    }
    out
}

/// `bytes` as vocabulary tokens, longest match first; `None` when some byte has none.
fn split_longest(vocab: &TokenVocabulary, mut bytes: &[u8]) -> Option<Vec<u32>> {
    let mut ids = Vec::new();
    while !bytes.is_empty() {
        let (len, id) = (1..=vocab.max_token_bytes().min(bytes.len()))
            .rev()
            .find_map(|l| vocab.id(&bytes[..l]).map(|id| (l, id)))?;
        ids.push(id);
        bytes = &bytes[len..];
    }
    Some(ids)
}

/// One observation per position both sides scored: `node` the node's claims (`None`: not
/// scored), `reference` the reference's logprob of the same forced token (`None`: not listed,
/// not scored); an event when they differ by more than `event_nats`.
pub fn logprob_observations(
    node: &[Option<f64>],
    reference: &[Option<f64>],
    event_nats: f64,
) -> Vec<Observation> {
    node.iter()
        .zip(reference)
        .filter_map(|(n, r)| {
            let (n, r) = ((*n)?, (*r)?);
            let delta = (n - r).abs();
            let delta = if delta.is_nan() { f64::INFINITY } else { delta };
            Some(Observation::Logprob {
                delta,
                event: delta > event_nats,
            })
        })
        .collect()
}

/// The observation of an audit whose node sent no usable list, or a short one: one event of
/// [`MISSING_DELTA_NATS`].
pub fn missing_observation() -> Observation {
    Observation::Logprob {
        delta: MISSING_DELTA_NATS,
        event: true,
    }
}

#[cfg(test)]
mod tests;
