//! How much of the delivered text a node's list must spell: what an honest llama.cpp leaves
//! unlisted at the end of a reply ([`honest_tail`]).

use serde_json::Value;

use super::{meets, Meets, Misaligned, NodeToken, TokenVocabulary};

/// Bytes of `text` the node's entries spell together, from its start (`text.len()` when they
/// run past its end: the capture cap cut the text). An entry that is not valid UTF-8 spells
/// its U+FFFD replacement (what llama.cpp's JSON delivers).
///
/// # Errors
///
/// [`Misaligned`] when an entry's bytes are not the text at its place.
pub fn covered_bytes(tokens: &[NodeToken], text: &[u8]) -> Result<usize, Misaligned> {
    let mut offset = 0usize;
    for t in tokens {
        match meets(&t.bytes, &text[offset..]) {
            Meets::Spells(n) => offset += n,
            Meets::Cut => return Ok(text.len()),
            Meets::Diverges => return Err(Misaligned(offset)),
        }
    }
    Ok(offset)
}

/// Whether an honest llama.cpp may leave `tail` (the delivered text after what its list
/// spells) unlisted, for a request whose longest stop word is `stop_bytes` long (0: none), with
/// a vocabulary whose longest token is `max_token_bytes`.
///
/// The slack, from the pinned llama.cpp (`server-context.cpp`, `server-task.cpp`):
///
/// - a generation that ends (at `max_tokens`, or by its end-of-generation token) while the text
///   ends in an *incomplete* sequence — a lead byte among its last 3 bytes without all of its
///   continuation bytes (`validate_utf8`) — never lists the tokens held since that sequence
///   began: the token that brought the lead byte (at most `max_token_bytes`, the bytes before
///   the lead byte at most one less) and those after it (at most 2 bytes: the lead byte stays
///   among the last 3). A non-streamed chat answer either drops the incomplete sequence
///   (measured: `" \xD0"` delivered as `" "`) or sends it, JSON (nlohmann's `replace`) writing
///   one U+FFFD per invalid sequence (measured: `"\xF0s"` as `"\u{fffd}s"`). So the tail up
///   to its first U+FFFD (all of it when it has none) is the valid start of a vocabulary token
///   whose next byte is invalid there ([`TokenVocabulary::begins_broken_token`]), and the
///   tail is at most `max_token_bytes + 2` raw bytes (each U+FFFD counted as the one raw byte
///   it stands for at least). At a high temperature a model samples such tokens
///   (`docs/trust.md`, seeded T = 1.0). Not covered: a chain of tokens that each bring a new
///   lead byte before the last one left the last 3 bytes (none in the measured replies);
/// - with stop words: a non-streamed answer that stopped at one drops the last entries, as many
///   as the stop word has tokens (at most `stop_bytes + 1`), each carrying at most one token and
///   the text held before it; one that ended while a partial stop string held text sends that
///   text with empty entries. At most `(stop_bytes + 2) · max_token_bytes + stop_bytes + 3`
///   bytes.
///
/// A chat template that adds its own stop strings (llama.cpp: Laguna, Ling 3) is not covered:
/// none of the catalog's does.
pub fn honest_tail(tail: &[u8], stop_bytes: usize, vocab: &TokenVocabulary) -> bool {
    tail.is_empty()
        || held_incomplete(tail, vocab)
        || stop_word_slack(tail, stop_bytes, vocab.max_token_bytes())
}

/// Whether `tail` is within the slack a request's stop words leave an honest llama.cpp
/// ([`honest_tail`]).
pub(super) fn stop_word_slack(tail: &[u8], stop_bytes: usize, max_token_bytes: usize) -> bool {
    stop_bytes > 0
        && tail.len()
            <= (stop_bytes + 2)
                .saturating_mul(max_token_bytes)
                .saturating_add(stop_bytes + 3)
}

/// Whether a non-empty `tail` may be the tokens an honest llama.cpp held at the end of
/// generation behind an incomplete UTF-8 sequence, as its chat answer delivers them
/// ([`honest_tail`]).
pub(super) fn held_incomplete(tail: &[u8], vocab: &TokenVocabulary) -> bool {
    const REPLACEMENT: &[u8] = "\u{fffd}".as_bytes();
    let Ok(text) = std::str::from_utf8(tail) else {
        return false;
    };
    let first = tail
        .windows(REPLACEMENT.len())
        .position(|w| w == REPLACEMENT);
    if !vocab.begins_broken_token(&tail[..first.unwrap_or(tail.len())]) {
        return false;
    }
    // a U+FFFD stands for at least one raw byte
    let raw: usize = text
        .chars()
        .map(|c| {
            if c == char::REPLACEMENT_CHARACTER {
                1
            } else {
                c.len_utf8()
            }
        })
        .sum();
    raw <= vocab.max_token_bytes().saturating_add(2)
}

/// The longest stop word of a request body's `stop` (a string or an array of strings), bytes;
/// 0 when it has none (or the body is not JSON).
pub fn longest_stop_bytes(request_body: &[u8]) -> usize {
    let Ok(v) = serde_json::from_slice::<Value>(request_body) else {
        return 0;
    };
    match v.get("stop") {
        Some(Value::String(s)) => s.len(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(str::len)
            .max()
            .unwrap_or(0),
        _ => 0,
    }
}
