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
    /// A constraint that can pin only known texts ([`Pinned`]): JSON mode, a JSON schema of
    /// keywords that pin no free text, a `logit_bias` on tokens whose texts are known. An
    /// honest engine's natural answer is at most [`natural_most`] tokens; each pinned text
    /// it delivered may have been spelled in up to its bytes + 3 tokens more.
    Pinned(Arc<Pinned>),
    /// A grammar that can pin any text (GBNF `grammar`, a schema with `pattern` or any
    /// keyword off [`SCHEMA_KEYWORDS`], `regex`, `ebnf`, `guided_*`, `structured_outputs`).
    /// A pinned text is spelled in pieces the model would never choose (measured on
    /// llama.cpp: 204 tokens generated for a 272-byte `const` that counts 62; GBNF
    /// `root ::= [ ]+` 100 for a text counting 4), so a text can have been up to one token per
    /// byte, as under [`SamplingConstraint::Tokens`]; and llama.cpp's JSON answer drops what
    /// its response-format parser matched around the JSON (up to [`GRAMMAR_HIDDEN_TOKENS`]).
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
    /// The pinned texts (deduplicated, none empty): property names, string `const` / `enum`
    /// values as they appear in JSON text, biased tokens' texts.
    pub(crate) texts: Box<[Box<str>]>,
    /// A grammar on the text (JSON mode or a schema): a completed answer may also have
    /// generated [`GRAMMAR_HIDDEN_TOKENS`] the response-format parser took out.
    pub(crate) grammar: bool,
}

/// Per choice, the tokens an engine may generate under a grammar beyond the text it delivers:
/// llama.cpp's response-format parser takes white space before the JSON, a `` ```json ``
/// fence and white space after it out of the content (`p.space()` around the schema, each a
/// `space` rule of at most 22 bytes: `"\n"{1,2} [ \t]{0,20}`), at most
/// 22 + 7 + 22 + 22 + 3 = 76 bytes, each at least a byte of a token. Measured: a `pattern`
/// schema delivered `"   "` (5 bytes) for 25 tokens generated, 21 of them trailing white space.
pub(crate) const GRAMMAR_HIDDEN_TOKENS: u64 = 76;

/// Most pinned texts one request may name (`logit_bias` entries, schema literals): past it
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

/// JSON-schema keywords that pin no free text: a schema using only these (and `properties`'
/// names, `const` / `enum` values, which are collected as pinned texts) is
/// [`SamplingConstraint::Pinned`]. Any other keyword (`pattern`, `format`, `minLength`,
/// `minimum`, `anyOf`, `$ref`, `patternProperties`, ...) makes it [`SamplingConstraint::Text`].
pub(crate) const SCHEMA_KEYWORDS: [&str; 12] = [
    "type",
    "properties",
    "required",
    "items",
    "additionalProperties",
    "description",
    "title",
    "enum",
    "const",
    "minItems",
    "maxItems",
    "$schema",
];

/// How the request constrains sampling ([`SamplingConstraint`]), from the peek
/// ([`RequestPeek::tokenization_constrained`]) and the body:
///
/// - a `logit_bias` that only biases special tokens (EOS banned, the usual use) does not
///   count; one on normal tokens pins their texts when the counter knows each
///   ([`TokenCounter::token_text`]) and there are at most [`MAX_PINNED_TEXTS`];
/// - `response_format` `json_object` pins no text; `json_schema` (OpenAI's wrapper with
///   `name`, `strict`, `description`, `schema`), llama.cpp's `json_schema` and Ollama's
///   `format` (`"json"` or a schema) pin the literals of a schema of [`SCHEMA_KEYWORDS`];
/// - anything else the peek marks (`allowed_token_ids`, `grammar`, `regex`, a schema with
///   another keyword) falls back to the byte bound: [`SamplingConstraint::Text`] when a
///   grammar is set, else [`SamplingConstraint::Tokens`].
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
            "response_format" => match v.get("type").and_then(Value::as_str) {
                Some("text") => {}
                _ => {
                    grammar = true;
                    readable &= response_format_texts(v, &mut texts);
                }
            },
            "json_schema" => {
                grammar = true;
                readable &= schema_texts(v, 0, &mut texts);
            }
            "format" => {
                grammar = true;
                readable &= v.as_str() == Some("json") || schema_texts(v, 0, &mut texts);
            }
            "allowed_token_ids" => (token_level, readable) = (true, false),
            _ => (grammar, readable) = (true, false),
        }
    }
    let bytes: usize = texts.iter().map(|t| t.len()).sum();
    readable &= texts.len() <= MAX_PINNED_TEXTS && bytes <= MAX_PINNED_BYTES;
    match (readable, grammar, token_level) {
        (_, false, false) => SamplingConstraint::None,
        (true, grammar, _) => SamplingConstraint::Pinned(Arc::new(Pinned {
            texts: texts.into_iter().collect(),
            grammar,
        })),
        (false, true, _) => SamplingConstraint::Text,
        (false, false, true) => SamplingConstraint::Tokens,
    }
}

/// Collects the texts an OpenAI `response_format` pins; `false` when it may pin others.
fn response_format_texts(v: &Value, texts: &mut BTreeSet<Box<str>>) -> bool {
    let Some(members) = v.as_object() else {
        return false;
    };
    match members.get("type").and_then(Value::as_str) {
        // llama.cpp reads a `schema` beside `json_object` too
        Some("json_object") => members.iter().all(|(k, s)| match k.as_str() {
            "type" => true,
            "schema" => schema_texts(s, 0, texts),
            _ => false,
        }),
        Some("json_schema") => {
            let Some(wrapper) = members
                .iter()
                .all(|(k, _)| matches!(k.as_str(), "type" | "json_schema"))
                .then(|| members.get("json_schema").and_then(Value::as_object))
                .flatten()
            else {
                return false;
            };
            wrapper.contains_key("schema")
                && wrapper.iter().all(|(k, s)| match k.as_str() {
                    "name" | "strict" | "description" => true,
                    "schema" => schema_texts(s, 0, texts),
                    _ => false,
                })
        }
        _ => false,
    }
}

/// Collects the texts a JSON schema pins (property names, `const` and `enum` values, as they
/// appear in JSON text); `false` when it uses a keyword off [`SCHEMA_KEYWORDS`], nests deeper
/// than 32, or pins a value other than a string, number, boolean or `null`.
fn schema_texts(schema: &Value, depth: usize, texts: &mut BTreeSet<Box<str>>) -> bool {
    let Some(members) = schema.as_object() else {
        // `true` / `false` schemas (any value, none)
        return schema.is_boolean();
    };
    if depth > 32 || texts.len() > MAX_PINNED_TEXTS {
        return false;
    }
    members
        .iter()
        .all(|(k, v)| SCHEMA_KEYWORDS.contains(&k.as_str()) && schema_member(k, v, depth, texts))
}

/// A `const` or `enum` value: pinned as its JSON text when a string, number, boolean or
/// `null`; `false` for an object or array.
fn pin_literal(v: &Value, texts: &mut BTreeSet<Box<str>>) -> bool {
    match v {
        Value::String(s) => {
            pin_string(s, texts);
            true
        }
        Value::Number(_) | Value::Bool(_) | Value::Null => {
            texts.insert(v.to_string().into_boxed_str());
            true
        }
        _ => false,
    }
}

/// One member of a schema, its key one of [`SCHEMA_KEYWORDS`] ([`schema_texts`]).
fn schema_member(k: &str, v: &Value, depth: usize, texts: &mut BTreeSet<Box<str>>) -> bool {
    match k {
        "required" => v.is_array(),
        "additionalProperties" => v.is_boolean(),
        "properties" => v.as_object().is_some_and(|props| {
            props.iter().all(|(name, s)| {
                pin_string(name, texts);
                schema_texts(s, depth + 1, texts)
            })
        }),
        "items" => v.is_object() && schema_texts(v, depth + 1, texts),
        "const" => pin_literal(v, texts),
        "enum" => v
            .as_array()
            .is_some_and(|vs| vs.iter().all(|v| pin_literal(v, texts))),
        // `type`, `description`, `title`, `$schema`, `minItems`, `maxItems`
        _ => true,
    }
}

/// A pinned string as the text may show it: JSON-escaped (as in a JSON answer), and as is.
fn pin_string(s: &str, texts: &mut BTreeSet<Box<str>>) {
    let escaped = Value::from(s).to_string();
    let escaped = &escaped[1..escaped.len() - 1];
    for t in [escaped, s] {
        if !t.is_empty() {
            texts.insert(t.into());
        }
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
            grammar: false,
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

    fn pinned(texts: &[&str], grammar: bool) -> SamplingConstraint {
        SamplingConstraint::Pinned(Arc::new(Pinned {
            texts: texts.iter().map(|t| Box::from(*t)).collect(),
            grammar,
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
        assert_eq!(
            of(json!({"response_format":{"type":"json_object"}})),
            pinned(&[], true)
        );
        assert_eq!(of(json!({"format":"json"})), pinned(&[], true));
        assert_eq!(
            of(json!({"logit_bias":{"7":-1,"2":-100}})),
            pinned(&["t7"], false)
        );
        assert_eq!(
            of(json!({"logit_bias":{"7":-1},"response_format":{"type":"json_object"}})),
            pinned(&["t7"], true)
        );
        let schema = json!({"type":"object","properties":{"a\"b":{"enum":["x\ny", 3, null]},
            "c":{"type":"array","items":{"const":true},"minItems":2}},"required":["c"],
            "additionalProperties":false,"title":"T","$schema":"s"});
        let texts = ["3", "a\"b", "a\\\"b", "c", "null", "true", "x\ny", "x\\ny"];
        assert_eq!(
            of(json!({"response_format":{"type":"json_schema",
                "json_schema":{"name":"n","strict":true,"schema":schema}}})),
            pinned(&texts, true)
        );
        assert_eq!(of(json!({"json_schema": schema})), pinned(&texts, true));
        assert_eq!(of(json!({"format": schema})), pinned(&texts, true));
        for schema in [
            json!({"type":"string","pattern":"^a+$"}),
            json!({"type":"object","properties":{"a":{"type":"string","format":"date"}}}),
            json!({"anyOf":[{"const":"a"}]}),
            json!({"type":"object","additionalProperties":{"type":"string"}}),
            json!({"const":{"a":"b"}}),
            json!({"$ref":"#/$defs/a","$defs":{"a":{"type":"string"}}}),
            json!({"type":"string","minLength":3}),
            json!({"enum": (0..300).map(|i| format!("v{i}")).collect::<Vec<_>>()}),
            json!({"const": "x".repeat(17 * 1024)}),
        ] {
            assert_eq!(
                of(json!({"json_schema": schema})),
                SamplingConstraint::Text,
                "{schema}"
            );
        }
        assert_eq!(
            of(json!({"response_format":{"type":"json_schema","json_schema":{"name":"n"}}})),
            SamplingConstraint::Text
        );
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
