//! How far a constrained request's tokens may be from the independent count
//! ([`SamplingConstraint`], `docs/metering.md` §4b, "Constrained sampling"): which texts a
//! constraint can pin, read at admission ([`sampling_constraint`]), and their occurrences in
//! what a choice delivered, counted as it streams ([`PinnedCount`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde_json::Value;
use spine_core::RequestPeek;

use crate::tokenizer::GeneratedText;
use crate::TokenCounter;

/// How a request constrains sampling, as far as billing is concerned
/// ([`super::bill::billed_usage`]; `docs/metering.md`, "Constrained sampling").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum SamplingConstraint {
    /// Nothing constrains which tokens spell the text: the independent count is the bill.
    #[default]
    None,
    /// A `logit_bias` on at most [`MAX_PINNED_TEXTS`] normal tokens whose texts are known
    /// ([`Pinned`]), and no grammar. An honest engine's natural answer is at most
    /// [`natural_most`] tokens; each occurrence of a biased token's text it delivered may have
    /// been spelled in up to its bytes + 3 tokens more.
    Pinned(Arc<Pinned>),
    /// A grammar on the text: GBNF `grammar`, `response_format` other than `text` (JSON mode
    /// and every `json_schema`), llama.cpp's `json_schema`, Ollama's `format`, `regex`, `ebnf`,
    /// `guided_*`, `structured_outputs`. A text the grammar pins is spelled in pieces the
    /// model would never choose (measured on llama.cpp: 204 tokens generated for a 272-byte
    /// `const` that counts 62; GBNF `root ::= [ ]+` 100 for a text counting 4), and even a
    /// grammar that pins no text spells JSON's structure in more tokens than its canonical
    /// count (measured 2026-12-04: a schema of an array of 200 booleans, 915 tokens generated
    /// for a 1,402-byte text that `count + count / 8 + 16` bounded at 620; a `json_object`
    /// answer of `null`s, 2,000 generated, bounded at 1,634). So a text can have been up to
    /// one token per byte, as under [`SamplingConstraint::Tokens`]; and llama.cpp's JSON
    /// answer drops what its response-format parser matched around the JSON (up to
    /// [`GRAMMAR_HIDDEN_TOKENS`]).
    Text,
    /// Token-level constraints the meter cannot read: vLLM's `allowed_token_ids`, a
    /// `logit_bias` of more than [`MAX_PINNED_TEXTS`] entries or on a token whose text the
    /// counter does not know. A text can then be spelled in up to one token per byte.
    Tokens,
}

impl SamplingConstraint {
    /// Whether the request constrains sampling at all.
    pub(crate) fn is_constrained(&self) -> bool {
        !matches!(self, SamplingConstraint::None)
    }
}

/// The texts a [`SamplingConstraint::Pinned`] request can pin.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Pinned {
    /// The biased tokens' texts (deduplicated, none empty).
    pub(crate) texts: Box<[Box<str>]>,
}

/// Per choice, the tokens an engine may generate under a grammar beyond the text it delivers:
/// llama.cpp's response-format parser takes white space before the JSON, a `` ```json ``
/// fence and white space after it out of the content (`p.space()` around the schema, each a
/// `space` rule of at most 22 bytes: `"\n"{1,2} [ \t]{0,20}`), at most
/// 22 + 7 + 22 + 22 + 3 = 76 bytes, each at least a byte of a token. Measured: a `pattern`
/// schema delivered `"   "` (5 bytes) for 25 tokens generated, 21 of them trailing white space.
pub(crate) const GRAMMAR_HIDDEN_TOKENS: u64 = 76;

/// Most pinned texts one request may name (`logit_bias` entries): past it
/// the byte bound applies. Keeps the occurrence count bounded (each delivered byte is looked
/// at once per text).
pub(crate) const MAX_PINNED_TEXTS: usize = 256;

/// Most UTF-8 bytes of all pinned texts together; past it the byte bound applies.
pub(crate) const MAX_PINNED_BYTES: usize = 16 * 1024;

/// Tokens beyond its text's bytes an occurrence of a pinned text may have cost: the text
/// spelled one token per byte, plus the canonical tokens on either side split off it.
pub(crate) const PINNED_EXTRA_TOKENS: u64 = 3;

/// The most tokens an honest engine generated for a natural answer that counts `count` under a
/// constraint that pins no text: `count + count / 8 + 16`. Measured on llama.cpp (SmolLM2
/// Q4_1, 20 chat requests per mode at T = 0 and 0.8, `scripts/measure-constrained.py`,
/// 2026-12-03): `json_object` 0–9 tokens over the count (9 on 270), `json_schema` 1–18
/// (18 on 74), moderate `logit_bias` 0–1.
pub(crate) fn natural_most(count: u64) -> u64 {
    count.saturating_add(count / 8).saturating_add(16)
}

/// How the request constrains sampling ([`SamplingConstraint`]), from the peek
/// ([`RequestPeek::tokenization_constrained`]) and the body:
///
/// - a `logit_bias` that only biases special tokens (EOS banned, the usual use) does not
///   count; one on normal tokens pins their texts when the counter knows each
///   ([`TokenCounter::token_text`]) and there are at most [`MAX_PINNED_TEXTS`];
/// - any grammar on the text (JSON mode and schemas included) is [`SamplingConstraint::Text`],
///   whatever else the request sets;
/// - `allowed_token_ids`, or a `logit_bias` the meter cannot read, is
///   [`SamplingConstraint::Tokens`].
pub(crate) fn sampling_constraint(
    peek: &RequestPeek,
    json: &Value,
    counter: &dyn TokenCounter,
) -> SamplingConstraint {
    if !peek.tokenization_constrained {
        return SamplingConstraint::None;
    }
    let mut texts = BTreeSet::new();
    let mut readable = true;
    let mut token_level = false;
    let mut grammar = false;
    for field in spine_core::TOKENIZATION_CONSTRAINT_FIELDS {
        let Some(v) = json.get(field).filter(|v| !v.is_null()) else {
            continue;
        };
        match field {
            "logit_bias" => match super::prompt::logit_biases(json) {
                Some(Ok(biases)) => {
                    for (id, _) in biases
                        .iter()
                        .filter(|(id, _)| !counter.is_special_token(*id))
                    {
                        token_level = true;
                        match counter.token_text(*id) {
                            Some(text) if biases.len() <= MAX_PINNED_TEXTS => {
                                texts.insert(text.into_boxed_str());
                            }
                            _ => readable = false,
                        }
                    }
                }
                // refused before any node (`logit_bias_unreadable`); counted as token-level
                Some(Err(())) => (token_level, readable) = (true, false),
                None => {}
            },
            // a grammar, JSON mode and plain schemas included: see `SamplingConstraint::Text`
            "response_format" if v.get("type").and_then(Value::as_str) == Some("text") => {}
            "allowed_token_ids" => (token_level, readable) = (true, false),
            _ => grammar = true,
        }
    }
    let bytes: usize = texts.iter().map(|t| t.len()).sum();
    readable &= texts.len() <= MAX_PINNED_TEXTS && bytes <= MAX_PINNED_BYTES;
    match (grammar, token_level, readable) {
        (true, _, _) => SamplingConstraint::Text,
        (false, false, _) => SamplingConstraint::None,
        (false, true, true) => SamplingConstraint::Pinned(Arc::new(Pinned {
            texts: texts.into_iter().collect(),
        })),
        (false, true, false) => SamplingConstraint::Tokens,
    }
}

/// The occurrences of a request's pinned texts ([`Pinned::texts`]) in what one choice
/// delivered, counted as it streams without keeping the text: per piece (content,
/// reasoning, each tool call's name and arguments), the last `longest − 1` bytes are kept so
/// that a text across two chunks is found, and the new bytes are looked at when there are at
/// least `max(longest, 256)` of them (at settle, the rest).
#[derive(Debug, Default)]
pub(crate) struct PinnedCount {
    pieces: BTreeMap<u64, PieceScan>,
}

#[derive(Debug, Default)]
struct PieceScan {
    /// The kept tail, then the bytes not looked at yet (from `scanned`).
    text: String,
    scanned: usize,
    /// Bytes dropped before `text`.
    base: u64,
    /// Per pinned text, where its last counted occurrence ends (absolute byte offset).
    last_end: Vec<u64>,
    /// Tokens allowed so far: occurrences × (bytes + [`PINNED_EXTRA_TOKENS`]).
    allowance: u64,
}

impl PinnedCount {
    /// Appends one chunk's text of the choice.
    pub(crate) fn push(&mut self, constraint: &SamplingConstraint, generated: &GeneratedText) {
        let SamplingConstraint::Pinned(pinned) = constraint else {
            return;
        };
        if pinned.texts.is_empty() {
            return;
        }
        let longest = pinned.texts.iter().map(|t| t.len()).max().unwrap_or(1);
        generated.for_each_piece(|key, text| {
            if text.is_empty() {
                return;
            }
            let piece = self.pieces.entry(key).or_default();
            piece.text.push_str(text);
            if piece.text.len() - piece.scanned >= longest.max(256) {
                piece.flush(&pinned.texts, longest);
            }
        });
    }

    /// Tokens the pinned texts the choice delivered may have cost beyond a natural answer:
    /// Σ over the texts of (non-overlapping occurrences) × (bytes + [`PINNED_EXTRA_TOKENS`]).
    pub(crate) fn allowance(&self, constraint: &SamplingConstraint) -> u64 {
        let SamplingConstraint::Pinned(pinned) = constraint else {
            return 0;
        };
        self.pieces
            .values()
            .map(|p| p.allowance.saturating_add(p.scan(&pinned.texts).0))
            .fold(0u64, u64::saturating_add)
    }
}

impl PieceScan {
    /// The allowance of the bytes not looked at yet, and each text's last occurrence end.
    fn scan(&self, texts: &[Box<str>]) -> (u64, Vec<u64>) {
        let mut allowance = 0u64;
        let mut ends = Vec::with_capacity(texts.len());
        for (i, needle) in texts.iter().enumerate() {
            let mut last_end = self.last_end.get(i).copied().unwrap_or(0);
            // an occurrence ending in the new bytes starts at most `len − 1` before them
            let mut from = self.scanned.saturating_sub(needle.len() - 1);
            from = from.max(usize::try_from(last_end.saturating_sub(self.base)).unwrap_or(0));
            while !self.text.is_char_boundary(from) {
                from -= 1;
            }
            for (at, m) in self.text[from..].match_indices(&**needle) {
                let end = from + at + m.len();
                let start_abs = self.base + (from + at) as u64;
                if end > self.scanned && start_abs >= last_end {
                    last_end = self.base + end as u64;
                    let cost = (needle.len() as u64).saturating_add(PINNED_EXTRA_TOKENS);
                    allowance = allowance.saturating_add(cost);
                }
            }
            ends.push(last_end);
        }
        (allowance, ends)
    }

    /// Counts the new bytes for good and keeps only the tail a later occurrence may start in.
    fn flush(&mut self, texts: &[Box<str>], longest: usize) {
        let (allowance, ends) = self.scan(texts);
        self.allowance = self.allowance.saturating_add(allowance);
        self.last_end = ends;
        let mut cut = self.text.len().saturating_sub(longest - 1);
        while !self.text.is_char_boundary(cut) {
            cut -= 1;
        }
        self.text.drain(..cut);
        self.base += cut as u64;
        self.scanned = self.text.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(texts: &[&str], chunks: &[&str]) -> u64 {
        let constraint = SamplingConstraint::Pinned(Arc::new(Pinned {
            texts: texts.iter().map(|t| Box::from(*t)).collect(),
        }));
        let mut c = PinnedCount::default();
        for chunk in chunks {
            c.push(&constraint, &GeneratedText::from_content(chunk));
        }
        c.allowance(&constraint)
    }

    #[test]
    fn occurrences_are_counted_across_chunks_without_overlap() {
        let e = "e".repeat(400);
        assert_eq!(count(&["e"], &[&e]), 400 * 4);
        let pieces: Vec<String> = (0..400).map(|_| "e".to_owned()).collect();
        let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
        assert_eq!(count(&["e"], &pieces), 400 * 4);
        assert_eq!(count(&["aa"], &["aaaaa"]), 2 * 5);
        let text = "Paris is nice. ".repeat(40);
        let split: Vec<&str> = text
            .as_bytes()
            .chunks(7)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        assert_eq!(count(&["Paris is nice."], &split), 40 * 17);
        assert_eq!(count(&["aa"], &["a", "a", "a", "a", "a"]), 2 * 5);
        assert_eq!(count(&["é"], &["éé", "xé"]), 3 * 5);
    }

    /// A counter that knows every id below 1000 as `t<id>`, 1 and 2 as special.
    #[derive(Debug)]
    struct Ids;

    impl TokenCounter for Ids {
        fn count_prompt(&self, _: &Value) -> Result<u64, crate::tokenizer::TokenizerError> {
            Ok(1)
        }
        fn count_text(&self, text: &str) -> u64 {
            text.len() as u64
        }
        fn max_token_bytes(&self) -> u64 {
            8
        }
        fn is_special_token(&self, id: u32) -> bool {
            id == 1 || id == 2
        }
        fn token_text(&self, id: u32) -> Option<String> {
            (id < 1000 && !self.is_special_token(id)).then(|| format!("t{id}"))
        }
    }

    fn of(extra: Value) -> SamplingConstraint {
        let mut body = serde_json::json!({"model":"m","messages":[{"role":"user","content":"x"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let bytes = serde_json::to_vec(&body).unwrap();
        let peek = RequestPeek::from_json(&bytes).unwrap();
        sampling_constraint(&peek, &body, &Ids)
    }

    fn pinned(texts: &[&str]) -> SamplingConstraint {
        SamplingConstraint::Pinned(Arc::new(Pinned {
            texts: texts.iter().map(|t| Box::from(*t)).collect(),
        }))
    }

    #[test]
    fn what_a_constraint_can_pin() {
        use serde_json::json;
        assert_eq!(of(json!({})), SamplingConstraint::None);
        assert_eq!(
            of(json!({"response_format":{"type":"text"}})),
            SamplingConstraint::None
        );
        assert_eq!(
            of(json!({"logit_bias":{"2":-100}})),
            SamplingConstraint::None
        );
        assert_eq!(of(json!({"logit_bias":{"7":-1,"2":-100}})), pinned(&["t7"]));
        // every grammar on the text is `Text`, JSON mode and plain schemas included, with or
        // without a logit_bias beside it
        let schema = json!({"type":"object","properties":{"a":{"type":"array",
            "items":{"type":"boolean"},"minItems":200}},"required":["a"]});
        for grammar in [
            json!({"response_format":{"type":"json_object"}}),
            json!({"response_format":{"type":"json_object"},"logit_bias":{"7":-1}}),
            json!({"format":"json"}),
            json!({"format": schema}),
            json!({"json_schema": schema}),
            json!({"response_format":{"type":"json_schema",
                "json_schema":{"name":"n","strict":true,"schema":schema}}}),
            json!({"json_schema":{"type":"string","pattern":"^a+$"}}),
        ] {
            assert_eq!(of(grammar.clone()), SamplingConstraint::Text, "{grammar}");
        }
        assert_eq!(
            of(json!({"grammar":"root ::= \"a\""})),
            SamplingConstraint::Text
        );
        assert_eq!(
            of(json!({"grammar":"root ::= \"a\"","logit_bias":{"7":-1}})),
            SamplingConstraint::Text
        );
        assert_eq!(
            of(json!({"logit_bias":{"5000":-1}})),
            SamplingConstraint::Tokens
        );
        let many: serde_json::Map<String, Value> =
            (10..400).map(|i| (i.to_string(), json!(-1))).collect();
        assert_eq!(of(json!({"logit_bias": many})), SamplingConstraint::Tokens);
    }
}
