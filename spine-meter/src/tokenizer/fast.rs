//! The fast path of token counting for the pipeline a GGUF's tokenizer builds: special tokens,
//! digits, the byte-level split and BPE per split, with a word cache ([`FastCounter`]).

use std::collections::HashMap;
use std::sync::{PoisonError, RwLock, TryLockError};

use tokenizers::utils::SysRegex;
use tokenizers::{Model, ModelWrapper};

#[cfg(doc)]
use super::ModelTokenizer;

/// The split pattern of tokenizers' `ByteLevel` pre-tokenizer with `use_regex` (GPT-2's),
/// compiled with the same engine (`tokenizers::utils::SysRegex`).
pub(super) const BYTE_LEVEL_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Most words the count cache holds (per model; with [`WORD_CACHE_MAX_BYTES`], about 6 MB at
/// most). When full, room for new words is made by evicting arbitrary entries (a `HashMap`'s
/// iteration order), at most [`WORD_CACHE_INSERTS_PER_COUNT`] per count, so one text with many
/// new words cannot flush the whole cache.
pub(super) const WORD_CACHE_ENTRIES: usize = 1 << 16;
/// Most new words one count adds to the cache.
pub(super) const WORD_CACHE_INSERTS_PER_COUNT: usize = WORD_CACHE_ENTRIES / 16;
/// Longest word (UTF-8 bytes) the count cache keeps.
pub(super) const WORD_CACHE_MAX_BYTES: usize = 48;
/// A cached word's fewest spelling not searched yet (counted for a prompt).
pub(super) const FEWEST_UNKNOWN: u32 = u32::MAX;
/// Longest split (byte-level characters) whose fewest spelling is searched exactly
/// ([`FastCounter::fewest_tokens`]); a longer one gets a weaker lower bound.
pub(super) const FEWEST_SEARCH_MAX_CHARS: usize = 1024;

/// Counts tokens without the tokenizers crate's per-call pipeline, for the pipeline
/// [`ModelTokenizer::from_gguf_metadata`] builds: no normalizer; special tokens (not
/// normalized, not `single_word`/`lstrip`/`rstrip`) split out first, leftmost-longest; then
/// `Digits(individual_digits)` when the GGUF's pre-tokenizer is `smollm`; then `ByteLevel`'s
/// regex split (no prefix space); then byte-level BPE on each split.
///
/// Measured (`docs/benchmarks.md`, "counting"): the full `encode` spends most of its time
/// allocating (`NormalizedString` alignments per byte, one `String` per token, the
/// `Encoding`'s vectors), not in BPE merges (the model caches words). Here a text is scanned
/// once: special tokens count 1 each, every other split is looked up in a bounded word→count
/// cache and, on a miss, counted by the same BPE model on its byte-level form. BPE runs on each
/// split on its own, so summing per-split counts is exactly `encode(text).len()`.
pub(super) struct FastCounter {
    /// Special tokens' texts, longest first (so the first match at a position is the longest).
    pub(super) specials: Vec<String>,
    /// Whether a byte starts some special token.
    pub(super) special_first: [bool; 256],
    /// `Digits(individual_digits = true)` before the byte-level split.
    pub(super) split_digits: bool,
    pub(super) regex: SysRegex,
    /// GPT-2's byte → character map (tokenizers' `bytes_char`).
    pub(super) byte_chars: [char; 256],
    /// Word → (BPE tokens, fewest tokens of the vocabulary that spell it).
    pub(super) cache: RwLock<HashMap<Box<str>, (u32, u32)>>,
    /// The longest token of the vocabulary, in byte-level characters (set on first use).
    pub(super) longest_token_chars: std::sync::OnceLock<usize>,
}

impl std::fmt::Debug for FastCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastCounter")
            .field("specials", &self.specials.len())
            .field("split_digits", &self.split_digits)
            .finish_non_exhaustive()
    }
}

/// GPT-2's byte → character map: printable bytes stand for themselves, the others for
/// `U+0100 + n` in byte order (tokenizers' `pre_tokenizers::byte_level::bytes_char`).
pub(super) fn byte_level_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        out[usize::from(b)] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).unwrap_or(char::REPLACEMENT_CHARACTER);
            n += 1;
            c
        };
    }
    out
}

impl FastCounter {
    /// `None` when the regex does not compile (never expected): counting then takes the full
    /// pipeline.
    pub(super) fn new(mut specials: Vec<String>, split_digits: bool) -> Option<Self> {
        let regex = SysRegex::new(BYTE_LEVEL_PATTERN).ok()?;
        specials.retain(|s| !s.is_empty());
        specials.sort_by_key(|s| std::cmp::Reverse(s.len()));
        specials.dedup();
        let mut special_first = [false; 256];
        for s in &specials {
            if let Some(&b) = s.as_bytes().first() {
                special_first[usize::from(b)] = true;
            }
        }
        Some(Self {
            specials,
            special_first,
            split_digits,
            regex,
            byte_chars: byte_level_chars(),
            cache: RwLock::new(HashMap::new()),
            longest_token_chars: std::sync::OnceLock::new(),
        })
    }

    /// The last place in `text` after `floor` and at least `keep` bytes before its end, where
    /// the whole text's count is the sum of the counts of both sides whatever is appended later
    /// (see [`IncrementalText`]); `None` when there is none. Whether a place is one depends only
    /// on the bytes within the longest special token of it (less than `keep`), so a place found
    /// not to be one stays so as text is appended: a caller passes as `floor` the last place it
    /// has already looked at, and a text that grows by steps is scanned once in all.
    pub(super) fn stable_cut(&self, text: &str, keep: usize, floor: usize) -> Option<usize> {
        // the reasoning needs every special token shorter than `keep` (longest first)
        if self.specials.first().is_some_and(|s| s.len() >= keep) {
            return None;
        }
        let bytes = text.as_bytes();
        let last = bytes.len().checked_sub(keep)?;
        let mut c = last;
        while c > floor {
            let (a, b) = (bytes[c - 1], bytes[c]);
            if a.is_ascii()
                && b.is_ascii()
                && self.splits_between(a, b)
                && !self.special_spans(text, c)
            {
                return Some(c);
            }
            c -= 1;
        }
        None
    }

    /// Whether the pre-tokenization always splits between ASCII bytes `a` and `b`.
    pub(super) fn splits_between(&self, a: u8, b: u8) -> bool {
        let (ca, cb) = (ascii_class(a), ascii_class(b));
        if ca == AsciiClass::Space {
            // a space may start the next word (` ?\p{L}+`), or a run of spaces may split
            // differently once more text comes
            return false;
        }
        if cb == AsciiClass::Space {
            // no match but a whitespace one contains whitespace after its first character
            return true;
        }
        // a class change; after an apostrophe, `'s`, `'t`, `'re`, … may match across it
        ca != cb && a != b'\''
    }

    /// Whether an occurrence of a special token in `text` contains both bytes `cut − 1` and `cut`.
    pub(super) fn special_spans(&self, text: &str, cut: usize) -> bool {
        let bytes = text.as_bytes();
        self.specials.iter().any(|s| {
            let s = s.as_bytes();
            if s.len() < 2 {
                return false;
            }
            let from = cut.saturating_sub(s.len() - 1);
            let to = (cut + s.len() - 1).min(bytes.len());
            bytes
                .get(from..to)
                .is_some_and(|w| w.windows(s.len()).any(|x| x == s))
        })
    }

    /// Tokens of `text` (non-empty), special-token strings split out as one token each when
    /// `parse_special`, else counted as the ordinary text they spell (llama.cpp's
    /// `parse_special = false`); `None` when the model refuses a word (the caller then takes
    /// the full pipeline, which reports the same way).
    pub(super) fn count(
        &self,
        model: &ModelWrapper,
        text: &str,
        parse_special: bool,
    ) -> Option<u64> {
        self.scan(model, text, parse_special, false).map(|(n, _)| n)
    }

    /// [`count`](Self::count), and the fewest tokens of the vocabulary that spell `text` (the
    /// sum over its splits of [`fewest_tokens`](Self::fewest_tokens); special tokens 1 each when
    /// `parse_special`): `(count, fewest)`, `fewest <= count`. One scan; the word cache keeps
    /// both numbers.
    pub(super) fn count_and_fewest(
        &self,
        model: &ModelWrapper,
        text: &str,
        parse_special: bool,
    ) -> Option<(u64, u64)> {
        self.scan(model, text, parse_special, true)
    }

    /// The count, and the fewest spelling when `want_fewest` (else the count again: a prompt
    /// never pays for the search, whose cost a caller's text could otherwise choose).
    fn scan<'t>(
        &self,
        model: &ModelWrapper,
        text: &'t str,
        parse_special: bool,
        want_fewest: bool,
    ) -> Option<(u64, u64)> {
        let mut total = 0u64;
        let mut fewest = 0u64;
        let mut special_tokens = 0u64;
        // words this count has seen that the shared cache has not: counted once each (a text
        // repeating a new word runs BPE on it once), added to the cache afterwards
        let mut misses: HashMap<&'t str, (u32, u32)> = HashMap::new();
        {
            let cache = self.cache.read().unwrap_or_else(PoisonError::into_inner);
            let mut word = |w: &'t str| -> Option<()> {
                let known = cache.get(w).or_else(|| misses.get(w)).copied();
                let (n, f, learned) = match known {
                    Some((n, f)) if f != FEWEST_UNKNOWN || !want_fewest => {
                        (u64::from(n), u64::from(f), false)
                    }
                    // counted for a prompt before: search its fewest spelling now
                    Some((n, _)) => {
                        let n = u64::from(n);
                        (n, self.fewest_tokens(model, &self.byte_level(w), n), true)
                    }
                    None => {
                        let (n, f) = self.bpe_count_and_fewest(model, w, want_fewest)?;
                        (n, f, true)
                    }
                };
                total += n;
                fewest += if f == u64::from(FEWEST_UNKNOWN) { n } else { f };
                if learned && w.len() <= WORD_CACHE_MAX_BYTES {
                    if let (Ok(n), Ok(f)) = (u32::try_from(n), u32::try_from(f)) {
                        misses.insert(w, (n, f));
                    }
                }
                Some(())
            };
            let bytes = text.as_bytes();
            let (mut start, mut i) = (0usize, 0usize);
            while i < bytes.len() {
                if parse_special && self.special_first[usize::from(bytes[i])] {
                    let rest = &bytes[i..];
                    if let Some(s) = self
                        .specials
                        .iter()
                        .find(|s| rest.starts_with(s.as_bytes()))
                    {
                        // a special token starts with a UTF-8 leading byte and ends a valid
                        // string, so both cuts are character boundaries
                        self.segment(text.get(start..i)?, &mut word)?;
                        special_tokens += 1;
                        i += s.len();
                        start = i;
                        continue;
                    }
                }
                i += 1;
            }
            self.segment(text.get(start..)?, &mut word)?;
        }
        let total = total.saturating_add(special_tokens);
        let fewest = fewest.saturating_add(special_tokens);
        if !misses.is_empty() {
            let mut cache = match self.cache.try_write() {
                Ok(c) => c,
                Err(TryLockError::Poisoned(e)) => e.into_inner(),
                // another count holds the lock: skip caching this time (speed only; counts are
                // exact either way)
                Err(TryLockError::WouldBlock) => return Some((total, fewest)),
            };
            let adding = misses.len().min(WORD_CACHE_INSERTS_PER_COUNT);
            let over = (cache.len() + adding).saturating_sub(WORD_CACHE_ENTRIES);
            if over > 0 {
                let evict: Vec<Box<str>> = cache.keys().take(over).cloned().collect();
                for w in evict {
                    cache.remove(&w);
                }
            }
            for (w, n) in misses.into_iter().take(adding) {
                cache.insert(w.into(), n);
            }
        }
        Some((total, fewest))
    }

    /// Text between special tokens: `Digits` (each numeric character on its own) then the
    /// byte-level regex split, each split handed to `word`.
    pub(super) fn segment<'t>(
        &self,
        seg: &'t str,
        word: &mut impl FnMut(&'t str) -> Option<()>,
    ) -> Option<()> {
        if !self.split_digits {
            return self.regex_split(seg, word);
        }
        let mut start = 0;
        for (i, c) in seg.char_indices() {
            if c.is_numeric() {
                if start < i {
                    self.regex_split(seg.get(start..i)?, word)?;
                }
                let end = i + c.len_utf8();
                // a one-character piece is one split whatever the regex says
                word(seg.get(i..end)?)?;
                start = end;
            }
        }
        if start < seg.len() {
            self.regex_split(seg.get(start..)?, word)?;
        }
        Some(())
    }

    /// The regex's matches and the gaps between them (`SplitDelimiterBehavior::Isolated`),
    /// empty pieces dropped. An ASCII piece is split by [`ascii_match_end`], which matches
    /// what the regex matches on ASCII; any other piece goes through the regex engine.
    pub(super) fn regex_split<'t>(
        &self,
        piece: &'t str,
        word: &mut impl FnMut(&'t str) -> Option<()>,
    ) -> Option<()> {
        if piece.is_ascii() {
            let bytes = piece.as_bytes();
            let mut p = 0;
            while p < bytes.len() {
                let e = ascii_match_end(bytes, p);
                word(piece.get(p..e)?)?;
                p = e;
            }
            return Some(());
        }
        let mut prev = 0;
        for (s, e) in self.regex.find_iter(piece) {
            if prev < s {
                word(piece.get(prev..s)?)?;
            }
            if s < e {
                word(piece.get(s..e)?)?;
            }
            prev = prev.max(e);
        }
        if prev < piece.len() {
            word(piece.get(prev..)?)?;
        }
        Some(())
    }

    /// BPE tokens of one split (the model on its byte-level form), and the fewest tokens of
    /// the vocabulary that spell it ([`fewest_tokens`](Self::fewest_tokens)).
    /// Without `want_fewest` the fewest is [`FEWEST_UNKNOWN`].
    pub(super) fn bpe_count_and_fewest(
        &self,
        model: &ModelWrapper,
        w: &str,
        want_fewest: bool,
    ) -> Option<(u64, u64)> {
        let mapped = self.byte_level(w);
        let count = model.tokenize(&mapped).ok()?.len() as u64;
        let fewest = if want_fewest {
            self.fewest_tokens(model, &mapped, count)
        } else {
            u64::from(FEWEST_UNKNOWN)
        };
        Some((count, fewest))
    }

    /// `w`'s byte-level form (each byte its GPT-2 character).
    fn byte_level(&self, w: &str) -> String {
        let mut mapped = String::with_capacity(w.len() * 2);
        for &b in w.as_bytes() {
            mapped.push(self.byte_chars[usize::from(b)]);
        }
        mapped
    }

    /// The fewest tokens of the vocabulary whose concatenation is `mapped` (a split in its
    /// byte-level form) that BPE counts `count`: a lower bound on how many tokens any engine
    /// sampled to write it, whose sampled spelling need not be BPE's (BPE's is one spelling,
    /// so the result is at most `count`; e.g. `"ell"` repeated is about 1.5 BPE tokens per
    /// `ell` and 1 at the fewest). The vocabulary was learned within the pre-tokenizer's
    /// splits, so no token spans two of them and the fewest of a text is the sum over its
    /// splits.
    ///
    /// 1 when `mapped` is a token; `count` when `count <= 2`; else a shortest path over the
    /// split's characters (each step a vocabulary token), `O(chars × longest token)` lookups,
    /// for splits of at most [`FEWEST_SEARCH_MAX_CHARS`] characters; a longer split gets the
    /// weaker bound `⌈chars / longest token⌉`.
    pub(super) fn fewest_tokens(&self, model: &ModelWrapper, mapped: &str, count: u64) -> u64 {
        if count <= 1 {
            return count;
        }
        if model.token_to_id(mapped).is_some() {
            return 1;
        }
        if count == 2 {
            return 2;
        }
        let longest = *self.longest_token_chars.get_or_init(|| {
            model
                .get_vocab()
                .keys()
                .map(|t| t.chars().count())
                .max()
                .unwrap_or(1)
                .max(1)
        });
        let at: Vec<usize> = mapped
            .char_indices()
            .map(|(i, _)| i)
            .chain(std::iter::once(mapped.len()))
            .collect();
        let chars = at.len() - 1;
        if chars > FEWEST_SEARCH_MAX_CHARS {
            return (chars.div_ceil(longest) as u64).clamp(1, count);
        }
        let mut best = vec![u64::MAX; chars + 1];
        best[0] = 0;
        for i in 0..chars {
            if best[i] == u64::MAX {
                continue;
            }
            for k in 1..=longest.min(chars - i) {
                if model.token_to_id(&mapped[at[i]..at[i + k]]).is_some() {
                    best[i + k] = best[i + k].min(best[i] + 1);
                }
            }
        }
        best[chars].min(count)
    }
}

/// What the byte-level pattern's classes say of an ASCII byte.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum AsciiClass {
    /// `\p{L}`: `A-Z`, `a-z`.
    Letter,
    /// `\p{N}`: `0-9`.
    Number,
    /// `\s`: tab, line feed, vertical tab, form feed, carriage return, space.
    Space,
    /// Everything else (`[^\s\p{L}\p{N}]`): punctuation, symbols, other control bytes.
    Other,
}

pub(super) fn ascii_class(b: u8) -> AsciiClass {
    match b {
        b'A'..=b'Z' | b'a'..=b'z' => AsciiClass::Letter,
        b'0'..=b'9' => AsciiClass::Number,
        0x09..=0x0D | b' ' => AsciiClass::Space,
        _ => AsciiClass::Other,
    }
}

/// End of the [`BYTE_LEVEL_PATTERN`] match that starts at `p` (`p < bytes.len()`) in an ASCII
/// piece; on ASCII every position starts a match, so the matches tile the piece. The
/// alternatives, in the pattern's order: a contraction (`'s 't 're 've 'm 'll 'd`, case
/// sensitive); an optional space then a run of letters, of numbers, or of other bytes;
/// whitespace not followed by a non-space (`\s+(?!\S)`: the whole run at the end of the
/// piece, else the run less its last byte when that leaves one); else the whole whitespace run.
pub(super) fn ascii_match_end(bytes: &[u8], p: usize) -> usize {
    let n = bytes.len();
    let at = |i: usize| bytes.get(i).copied();
    if at(p) == Some(b'\'') {
        match (at(p + 1), at(p + 2)) {
            (Some(b's' | b't' | b'm' | b'd'), _) => return p + 2,
            (Some(b'r' | b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => return p + 3,
            _ => {}
        }
    }
    let q = if at(p) == Some(b' ') && p + 1 < n {
        p + 1
    } else {
        p
    };
    let class = at(q).map_or(AsciiClass::Space, ascii_class);
    if class != AsciiClass::Space {
        let mut e = q + 1;
        while at(e).is_some_and(|b| ascii_class(b) == class) {
            e += 1;
        }
        return e;
    }
    let mut r = p + 1;
    while at(r).is_some_and(|b| ascii_class(b) == AsciiClass::Space) {
        r += 1;
    }
    if r >= n || r - p < 2 {
        r.min(n)
    } else {
        r - 1
    }
}
