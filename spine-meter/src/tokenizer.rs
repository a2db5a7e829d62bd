//! Independent token counting (design brief §6): the [`TokenCounter`] the metering layer
//! counts with, the billing rules over its counts ([`bill_counted`], [`IncrementalText`],
//! [`GeneratedCount`]) and, with feature `tokenizer` (on by default), the model's own tokenizer
//! and chat template.
//!
//! A [`ModelTokenizer`] counts what the engine counts:
//! - **prompt tokens**: the chat template rendered the way llama.cpp renders it (messages,
//!   `add_generation_prompt = true`, `bos_token`/`eos_token`), then tokenized with special tokens
//!   parsed and no BOS added (measured against `llama-server`, see `fixtures/README.md`);
//! - **completion tokens**: the text the engine generated, as delivered ([`GeneratedText`]:
//!   `content`, `reasoning_content` and each tool call's function `name` and `arguments`),
//!   tokenized WITHOUT parsing special tokens (a `<|im_end|>` in delivered text is ordinary
//!   text: llama.cpp renders a sampled control token as no text; `docs/metering.md`, "Special
//!   tokens in generated text"), plus one EOS token when the choice's `finish_reason` is `"stop"` or
//!   `"tool_calls"` (llama.cpp counts the EOS it sampled); a `"length"` finish bills exactly
//!   `max_tokens` when the delivered text supports it ([`bill_counted`]).
//!
//! **Tools.** A request's `tools` array is handed to the chat template, as llama.cpp does with
//! `--jinja` (its default): a template that describes tools counts them; a template that ignores
//! them (SmolLM2's) does not, and neither does the engine (measured: the same prompt count with
//! and without `tools`). Prompt counts for tool requests follow the template.
//!
//! Message normalisation follows llama.cpp's `common/chat.cpp` for templates that only take string
//! content: a string `content` is used as is; an array of content parts is joined into one string
//! with `\n` between `{"type":"text"}` parts (other part types are ignored here; the metering
//! layer refuses them before counting, see `spine_core::validate_chat_messages`); a missing or
//! `null` content is `""`.
//!
//! [`ModelTokenizer`]: crate::ModelTokenizer

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;

#[cfg(feature = "tokenizer")]
mod fast;
mod generated;
#[cfg(feature = "tokenizer")]
mod model;

pub use generated::GeneratedText;
use generated::*;
#[cfg(feature = "tokenizer")]
pub use model::ModelTokenizer;

/// Why a tokenizer could not be built or a request could not be counted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// The GGUF header could not be read (feature `tokenizer`).
    #[cfg(feature = "tokenizer")]
    #[error("cannot read gguf metadata")]
    Gguf(#[source] crate::gguf::GgufError),
    /// A key the tokenizer needs is missing or has the wrong type.
    #[error("gguf key {0:?} missing or of the wrong type")]
    MissingKey(&'static str),
    /// The GGUF's `tokenizer.ggml.pre` is one this crate does not reproduce.
    #[error("unsupported pre-tokenizer {0:?}")]
    UnsupportedPreTokenizer(String),
    /// The tokenizers crate refused the vocabulary or input.
    #[error("tokenizer error: {0}")]
    Tokenizers(String),
    /// The chat template failed to compile or render (feature `tokenizer`).
    #[cfg(feature = "tokenizer")]
    #[error("chat template error")]
    Template(#[source] minijinja::Error),
    /// A [`TokenCounter`] of the application's own could not count the prompt.
    #[error("token counter error")]
    Counter(#[source] spine_core::BoxError),
    /// The request body has neither `messages` (array) nor `prompt` (string).
    #[error("request body has neither a messages array nor a prompt string")]
    NoPrompt,
}

/// Counts tokens the way a model's engine does: all the metering layer asks of a model's
/// tokenizer (design brief §6). Held as `Arc<dyn TokenCounter>` in each
/// [`CatalogEntry`](crate::meter::CatalogEntry).
///
/// [`ModelTokenizer`](crate::ModelTokenizer) (feature `tokenizer`, on by default) is the one
/// the gateway uses: the model's own tokenizer and chat template, measured against
/// llama.cpp. Without the feature the metering layer compiles without the tokenizers crate,
/// minijinja or onig and meters with any counter an application brings (one that calls its
/// engine's `/tokenize`, or an estimate); the bill is then only as exact as that counter.
///
/// Every call is synchronous and runs on the request's task: a counter must be quick (the
/// meter counts each streamed chunk's text as it passes) and must not block.
pub trait TokenCounter: fmt::Debug + Send + Sync {
    /// Prompt tokens of a request body: for a chat body (`messages`, already checked by
    /// `spine_core::validate_chat_messages`; `tools` when present) the chat template rendered
    /// with the generation prompt and tokenized; for a `/v1/completions` body with a `prompt`
    /// string, that string tokenized. The meter calls it for chat completions only; completions
    /// and embeddings prompts go through [`count_text`](Self::count_text) segment by segment.
    ///
    /// # Errors
    ///
    /// [`TokenizerError::NoPrompt`] when the body has neither; a template failure
    /// (`TokenizerError::Template`) or the counter's own ([`TokenizerError::Counter`]). The
    /// meter refuses the request with 400 ([`MeterError::Prompt`](crate::meter::MeterError::Prompt)).
    fn count_prompt(&self, body: &Value) -> Result<u64, TokenizerError>;

    /// [`count_prompt`](Self::count_prompt), allowed to stop as soon as the count passes
    /// `limit` tokens: [`Counted::Exact`], or [`Counted::AtLeast`] a number above `limit` when
    /// it stopped early. Lets the meter refuse a prompt over the context or over what the
    /// caller can pay without tokenizing all of it.
    ///
    /// The default counts the whole prompt ([`count_prompt`](Self::count_prompt)). A counter
    /// that renders a chat template first should render, then count the text with
    /// [`count_text_within`] (as [`ModelTokenizer`](crate::ModelTokenizer) does).
    ///
    /// # Errors
    ///
    /// As [`count_prompt`](Self::count_prompt).
    fn count_prompt_within(&self, body: &Value, limit: u64) -> Result<Counted, TokenizerError> {
        let _ = limit;
        self.count_prompt(body).map(Counted::Exact)
    }

    /// Tokens of `text`, special tokens parsed, no BOS or EOS added (0 for `""`). Infallible:
    /// text a counter cannot encode should count as an upper bound (e.g. its bytes). The meter
    /// counts PROMPT text with it (a rendered chat template, a completions or embeddings
    /// prompt), where a special-token string is the special token.
    fn count_text(&self, text: &str) -> u64;

    /// Tokens of text a node GENERATED and delivered (content, reasoning, refusal, tool-call
    /// names and arguments, completions text), special-token strings counted as the ordinary
    /// text they spell, no BOS or EOS added (0 for `""`). llama.cpp renders a control token it
    /// samples as no text (unless started with `--special`, or the token is a tool-call
    /// grammar's preserved token), so a `<|im_end|>` in its output was spelled with ordinary
    /// tokens and parsing it as one token would undercount (`docs/metering.md`, "Special
    /// tokens in generated text"). Every count of delivered text goes through this method
    /// ([`IncrementalText`], [`GeneratedCount`]); [`stable_cut`](Self::stable_cut) must hold
    /// for it as for [`count_text`](Self::count_text).
    ///
    /// The default is [`count_text`](Self::count_text): right for a counter that parses no
    /// special tokens; one that does should override it.
    fn count_generated_text(&self, text: &str) -> u64 {
        self.count_text(text)
    }

    /// [`count_generated_text`](Self::count_generated_text) of `text` and the fewest tokens of
    /// the vocabulary that spell it: `(count, fewest)`, `fewest <= count`. An engine samples
    /// tokens, not the tokenizer's spelling, so text it generated in `N` tokens can count more
    /// than `N` (measured on SmolLM2: `"ell"` repeated, which a caller's `logit_bias` can ask
    /// for, counts about 1.5 tokens per `ell`; 1,085 of its tokens count 1.3× or more
    /// repeated), never fewer than `fewest`. The meter BILLS `count` and judges whether a
    /// choice went past its cap on `fewest` (the node's fault only when no spelling fits).
    /// [`stable_cut`](Self::stable_cut) must hold for `fewest` as for `count`.
    ///
    /// The default is `(count, count)`: right for a counter that knows no other spelling
    /// (its judgment of a cap is then the count's).
    fn count_generated_text_and_fewest(&self, text: &str) -> (u64, u64) {
        let count = self.count_generated_text(text);
        (count, count)
    }

    /// The longest token of the vocabulary, UTF-8 bytes, at least 1: a text of `B` bytes is at
    /// least `B / max_token_bytes` tokens, however it is tokenized. Bounds what a choice capped
    /// at `L` tokens may deliver before it is cut off: `L × max_token_bytes` bytes (a larger
    /// value only loosens that bound).
    fn max_token_bytes(&self) -> u64;

    /// The length of the model's embedding vectors, when the counter knows it
    /// ([`ModelTokenizer`](crate::ModelTokenizer): the GGUF's `<arch>.embedding_length`). Bounds
    /// an honest `/v1/embeddings` answer's size before any node is asked (a request whose answer
    /// cannot fit the gateway's buffer is refused 400) and checks `dimensions`. The default
    /// knows none: the answer then keeps the per-vector byte bound and `dimensions` is refused.
    fn embedding_dimensions(&self) -> Option<u64> {
        None
    }

    /// A byte index `cut` of `text`, at most `text.len() − keep_bytes` and above
    /// `scanned_through`, such that for ANY text `rest` appended later
    /// `count_text(text[..cut]) + count_text(text[cut..] + rest) == count_text(text + rest)`,
    /// and the same of [`count_generated_text`](Self::count_generated_text);
    /// `None` when there is none. Lets [`IncrementalText`] count a streamed text and drop the
    /// counted part. Positions up to `scanned_through` were already looked at with no cut found
    /// (a counter may skip them); `keep_bytes` stay uncounted, more than any special token.
    ///
    /// The default names no cut: the whole text is kept and counted at the end (exact, with
    /// memory bounded by the meter's per-choice delivery limit).
    fn stable_cut(&self, text: &str, keep_bytes: usize, scanned_through: usize) -> Option<usize> {
        let _ = (text, keep_bytes, scanned_through);
        None
    }

    /// Whether token `id` is a special token (EOS, BOS, a chat-template marker): one that is
    /// never a piece of generated text, so biasing it cannot make the engine spell a text in
    /// other tokens. The default is `false` for every id (every `logit_bias` then constrains
    /// tokenization: the bill follows the engine's claim within the byte bound).
    fn is_special_token(&self, id: u32) -> bool {
        let _ = id;
        false
    }

    /// How many token ids the model's vocabulary has (ids `0..vocab_size`), when the counter
    /// knows: a `logit_bias` on an id past it is refused (400), as OpenAI refuses one, where
    /// llama.cpp would ignore it and the meter, reading it as a token it cannot spell, would
    /// bill the node's claim within the loosest bound. The default knows none. Asked once per
    /// request that has a `logit_bias`: keep it a stored number, not a computation.
    fn vocab_size(&self) -> Option<u64> {
        None
    }

    /// The text token `id` stands for when generated alone (a leading space included), when
    /// the counter knows it and it is whole UTF-8 (`None` for a byte-fallback piece, an
    /// unknown id, or a special token). The meter bounds what a `logit_bias` can make an
    /// engine spell otherwise by the occurrences of the biased tokens' texts
    /// (`docs/metering.md`, "Constrained sampling"). The default knows no token: every
    /// `logit_bias` on a normal token then keeps the byte bound.
    fn token_text(&self, id: u32) -> Option<String> {
        let _ = id;
        None
    }
}

/// A shared counter counts as the counter it shares (so `&Arc<ModelTokenizer>` is a
/// `&dyn TokenCounter`).
impl<T: TokenCounter + ?Sized> TokenCounter for std::sync::Arc<T> {
    fn count_prompt(&self, body: &Value) -> Result<u64, TokenizerError> {
        (**self).count_prompt(body)
    }

    fn count_prompt_within(&self, body: &Value, limit: u64) -> Result<Counted, TokenizerError> {
        (**self).count_prompt_within(body, limit)
    }

    fn count_text(&self, text: &str) -> u64 {
        (**self).count_text(text)
    }

    fn count_generated_text(&self, text: &str) -> u64 {
        (**self).count_generated_text(text)
    }

    fn count_generated_text_and_fewest(&self, text: &str) -> (u64, u64) {
        (**self).count_generated_text_and_fewest(text)
    }

    fn max_token_bytes(&self) -> u64 {
        (**self).max_token_bytes()
    }

    fn embedding_dimensions(&self) -> Option<u64> {
        (**self).embedding_dimensions()
    }

    fn stable_cut(&self, text: &str, keep_bytes: usize, scanned_through: usize) -> Option<usize> {
        (**self).stable_cut(text, keep_bytes, scanned_through)
    }

    fn is_special_token(&self, id: u32) -> bool {
        (**self).is_special_token(id)
    }

    fn vocab_size(&self) -> Option<u64> {
        (**self).vocab_size()
    }

    fn token_text(&self, id: u32) -> Option<String> {
        (**self).token_text(id)
    }
}

/// Completion tokens billed for one choice whose delivered text counts `text_tokens` tokens
/// in `bytes` UTF-8 bytes (the metering rules, `docs/metering.md`). With `T` =
/// `text_tokens`, `B` = `bytes` and `L` = [`CompletionRule::cap_tokens`]:
/// - not completed (the caller left, the node failed): `min(T, L)`, no EOS;
/// - `"stop"` or `"tool_calls"`: `T + 1` (the EOS the engine sampled and counts), unless
///   `T >= L`; at most `L`;
/// - `"length"` with an explicit `max_tokens`: `min(L, T + A)` with the allowance
///   `A = 3 + max(2, L / 50)` ([`length_allowance_tokens`]): the bill follows the DELIVERED
///   text, never `L` on the node's word (a node that pads a `length` finish with cheap text
///   is paid for the text's tokens). `A` covers what an honest engine generates but the
///   text does not show: an incomplete UTF-8 tail llama.cpp holds back and never sends (at
///   most 3 bytes, each at least one token) and a generation a little longer than the
///   text's canonical tokenization (measured: 61–63 text tokens for 64 generated,
///   `fixtures/llama.cpp/tokcheck_sampled.txt`). The finish is flagged
///   [`CompletionCount::length_unsupported`] when the text cannot be `L` tokens at all:
///   fewer bytes than `L − 3`, or more than `L + max(2, L / 50)` tokens; such a finish bills
///   `min(T, L)`, without the allowance (a node that ends one-token texts with `length` is
///   paid for one token each, not `1 + A`);
/// - anything else (`"length"` without `max_tokens`, where the engine's own context may
///   have stopped it, or an unknown reason): `min(T, L)`.
///
/// The rules need no tokenizer: `T` comes from whichever [`TokenCounter`] metered the text.
/// Whether the text supports a `length` finish is judged here on `T` itself; see
/// [`bill_counted_spelled`] to judge it on the fewest tokens that spell the text.
pub fn bill_counted(
    text_tokens: u64,
    bytes: u64,
    finish_reason: Option<&str>,
    rule: CompletionRule,
) -> CompletionCount {
    bill_counted_spelled(text_tokens, text_tokens, bytes, finish_reason, rule)
}

/// [`bill_counted`], with whether the text could be `L` tokens judged on `fewest_tokens`, the
/// fewest tokens that spell it ([`TokenCounter::count_generated_text_and_fewest`]; at most
/// `text_tokens`) instead of its count: an honest engine that generated `L` tokens may have
/// written text that counts more (a caller's `logit_bias` can ask for it), and that is no
/// reason to flag the node. What is billed still follows `text_tokens`.
pub fn bill_counted_spelled(
    text_tokens: u64,
    fewest_tokens: u64,
    bytes: u64,
    finish_reason: Option<&str>,
    rule: CompletionRule,
) -> CompletionCount {
    let cap = rule.cap_tokens;
    let plain = text_tokens.min(cap);
    let mut count = CompletionCount {
        tokens: plain,
        text_tokens,
        length_unsupported: false,
    };
    if !rule.completed {
        return count;
    }
    match finish_reason {
        Some("stop" | "tool_calls") if text_tokens < cap => count.tokens = text_tokens + 1,
        Some("length") if rule.max_tokens.is_some() => {
            let slack = LENGTH_SLACK_TOKENS.max(cap / 50);
            count.length_unsupported = fewest_tokens.min(text_tokens) > cap.saturating_add(slack)
                || cap > bytes.saturating_add(MAX_HELD_BACK_BYTES);
            // a finish the text cannot support earns no allowance: the node is paid for the
            // tokens it delivered, not for a `length` it claims
            if !count.length_unsupported {
                count.tokens = text_tokens
                    .saturating_add(length_allowance_tokens(cap))
                    .min(cap);
            }
        }
        _ => {}
    }
    count
}

/// The tokens a `length` finish capped at `cap_tokens` may bill above its delivered text's count:
/// `3 + max(2, cap / 50)` ([`bill_counted`]).
pub fn length_allowance_tokens(cap_tokens: u64) -> u64 {
    MAX_HELD_BACK_BYTES + LENGTH_SLACK_TOKENS.max(cap_tokens / 50)
}

/// Most bytes of an incomplete UTF-8 character llama.cpp holds back (a 4-byte character less
/// one): when generation stops on a limit they are never sent, though their tokens count.
pub const MAX_HELD_BACK_BYTES: u64 = 3;

/// How many tokens the delivered text of a `length` finish may count above `max_tokens`
/// (at least; 2 % of `max_tokens` when that is more) and still support it: the model may
/// generate a text as fewer tokens than its canonical tokenization.
pub const LENGTH_SLACK_TOKENS: u64 = 2;

/// The request's limits, for [`bill_counted`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompletionRule {
    /// The request's `max_tokens` / `max_completion_tokens`, when it set one.
    pub max_tokens: Option<u64>,
    /// Most completion tokens billable for one choice: `max(1, min(max_tokens, context −
    /// prompt))`, the per-choice part of the hold.
    pub cap_tokens: u64,
    /// Whether the response completed (every requested choice finished, no error); otherwise no
    /// EOS and no `length` rule apply.
    pub completed: bool,
}

/// What [`bill_counted`] decided for one choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompletionCount {
    /// Completion tokens billed.
    pub tokens: u64,
    /// Tokens of the generated text alone (the counter's [`TokenCounter::count_generated_text`] of each
    /// piece).
    pub text_tokens: u64,
    /// The choice finished with `"length"` but its text cannot be `max_tokens` tokens (fewer
    /// bytes than that, or more tokens): billed by its text and flagged as a discrepancy.
    pub length_unsupported: bool,
}

/// Bytes of text [`count_text_within`] tokenizes at a time: 64 KiB.
pub const COUNT_PIECE_BYTES: usize = 64 * 1024;

/// A token count that may have stopped early ([`count_text_within`],
/// [`TokenCounter::count_prompt_within`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counted {
    /// The whole text counted: its exact count.
    Exact(u64),
    /// Counting stopped once past the limit: the exact count is at least this (which is above
    /// the limit).
    AtLeast(u64),
}

impl Counted {
    /// The count (exact, or the lower bound).
    pub fn tokens(self) -> u64 {
        match self {
            Self::Exact(n) | Self::AtLeast(n) => n,
        }
    }

    /// `self` plus `more` tokens counted after it (at least, when either is at least).
    pub fn plus(self, more: Counted) -> Counted {
        let n = self.tokens().saturating_add(more.tokens());
        match (self, more) {
            (Self::Exact(_), Self::Exact(_)) => Self::Exact(n),
            _ => Self::AtLeast(n),
        }
    }
}

/// Tokens of `text` as `counter`'s [`TokenCounter::count_text`] counts the whole, counted in
/// pieces of about [`COUNT_PIECE_BYTES`] cut where the count of the whole is the sum of the
/// counts of the parts ([`TokenCounter::stable_cut`], as [`IncrementalText`] does), stopping as
/// soon as the count passes `limit`: [`Counted::Exact`] when the whole text was counted
/// (whatever its count), else [`Counted::AtLeast`] a number above `limit`. Before each piece,
/// what is left counts at least its bytes over [`TokenCounter::max_token_bytes`]: a text that
/// cannot fit is refused before any more of it is tokenized.
///
/// Work: O(bytes counted before the stop). A counter that names no cut (the trait's default)
/// is counted whole, once, unless the byte bound already passes `limit`.
pub fn count_text_within(counter: &dyn TokenCounter, text: &str, limit: u64) -> Counted {
    let per_token = counter.max_token_bytes().max(1);
    let mut counted = 0u64;
    let mut rest = text;
    // positions of `rest` already looked at with no cut found
    let mut scanned = 0usize;
    let mut window = COUNT_PIECE_BYTES;
    loop {
        let at_least = counted.saturating_add(rest.len() as u64 / per_token);
        if at_least > limit {
            return Counted::AtLeast(at_least);
        }
        if rest.len() <= window.saturating_add(INCREMENTAL_KEEP_BYTES) {
            return Counted::Exact(counted.saturating_add(counter.count_text(rest)));
        }
        let mut end = window.saturating_add(INCREMENTAL_KEEP_BYTES);
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        let piece = rest.get(..end).unwrap_or(rest);
        match counter.stable_cut(piece, INCREMENTAL_KEEP_BYTES, scanned) {
            Some(cut) if cut > 0 && rest.is_char_boundary(cut) => {
                let head = rest.get(..cut).unwrap_or_default();
                counted = counted.saturating_add(counter.count_text(head));
                rest = rest.get(cut..).unwrap_or_default();
                scanned = 0;
                window = COUNT_PIECE_BYTES;
                if counted > limit {
                    return if rest.is_empty() {
                        Counted::Exact(counted)
                    } else {
                        Counted::AtLeast(counted)
                    };
                }
            }
            _ => {
                // no cut in this piece (a long word, a run of CJK letters): look further
                scanned = end.saturating_sub(INCREMENTAL_KEEP_BYTES);
                window = window.saturating_add(COUNT_PIECE_BYTES);
            }
        }
    }
}

/// Bytes kept uncounted at the end of an [`IncrementalText`]: more than the longest special
/// token, so no special token can span a cut.
const INCREMENTAL_KEEP_BYTES: usize = 256;
/// An [`IncrementalText`] looks for a cut once its uncounted tail has grown by this much.
const INCREMENTAL_STEP_BYTES: usize = 2048;

/// A text that arrives in pieces (one choice's `content` in a stream), counted as it flows
/// without keeping all of it: its total is always exactly
/// [`TokenCounter::count_generated_text`] of the whole text (special-token strings counted as
/// ordinary text: it counts what a node generated).
///
/// How: the text is cut where the counter says the count of the whole is the sum of the counts
/// of the parts ([`TokenCounter::stable_cut`]). For [`ModelTokenizer`](crate::ModelTokenizer)'s
/// GGUF fast path that is where the tokenizer's own pre-tokenization is sure to split whatever
/// follows — between two ASCII characters where a non-space is followed by a space, or the
/// character class (letter, digit, other) changes and the first is not an apostrophe (which
/// may start a contraction such as `'s`), with no special token spanning the cut — so the
/// count of the whole is the sum of the counts of the parts (BPE runs on each split alone).
/// The part before the cut is counted and dropped; at most [`INCREMENTAL_STEP_BYTES`] plus
/// [`INCREMENTAL_KEEP_BYTES`] stay uncounted, unless the text has no such place (a long run
/// of CJK letters, one very long word): then the tail grows until it has one. A counter that
/// names no cut (the trait's default) keeps the whole text and counts it at the end.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IncrementalText {
    committed_tokens: u64,
    /// The fewest tokens that spell the counted part
    /// ([`TokenCounter::count_generated_text_and_fewest`]).
    committed_fewest: u64,
    tail: String,
    /// Tail length at which the next cut is tried.
    next_try_bytes: usize,
    /// `(tail length, its tokens, the fewest that spell it)` when the tail was last counted.
    counted_tail: Option<(usize, u64, u64)>,
    total_bytes: u64,
    /// Tail positions up to this one were looked at and are no cut, whatever follows (see
    /// [`TokenCounter::stable_cut`]): each byte is looked at once, however long a text without a
    /// cut (a run of spaces, of CJK letters) grows.
    no_cut_through: usize,
}

impl IncrementalText {
    /// Appends `text`, counting what can be counted for good.
    pub fn push(&mut self, tokenizer: &dyn TokenCounter, text: &str) {
        if text.is_empty() {
            return;
        }
        self.tail.push_str(text);
        self.total_bytes = self.total_bytes.saturating_add(text.len() as u64);
        if self.tail.len() < self.next_try_bytes.max(INCREMENTAL_STEP_BYTES) {
            return;
        }
        self.next_try_bytes = self.tail.len() + INCREMENTAL_STEP_BYTES;
        let found = tokenizer.stable_cut(&self.tail, INCREMENTAL_KEEP_BYTES, self.no_cut_through);
        if found.is_none() {
            self.no_cut_through = self.tail.len().saturating_sub(INCREMENTAL_KEEP_BYTES);
        }
        if let Some(cut) = found {
            self.no_cut_through = 0;
            let head = self.tail.get(..cut).unwrap_or_default();
            let (tokens, fewest) = tokenizer.count_generated_text_and_fewest(head);
            self.committed_tokens = self.committed_tokens.saturating_add(tokens);
            self.committed_fewest = self.committed_fewest.saturating_add(fewest);
            self.tail.drain(..cut);
            self.next_try_bytes = self.tail.len() + INCREMENTAL_STEP_BYTES;
            self.counted_tail = None;
        }
    }

    /// UTF-8 bytes pushed so far.
    pub fn len_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Exact tokens of everything pushed ([`TokenCounter::count_generated_text`] of the whole text).
    pub fn tokens(&self, tokenizer: &dyn TokenCounter) -> u64 {
        let tail = match self.counted_tail {
            Some((len, n, _)) if len == self.tail.len() => n,
            _ => tokenizer.count_generated_text(&self.tail),
        };
        self.committed_tokens.saturating_add(tail)
    }

    /// The fewest tokens that spell everything pushed (at most [`tokens`](Self::tokens)): a
    /// lower bound on what the engine generated to write it.
    pub fn fewest(&self, tokenizer: &dyn TokenCounter) -> u64 {
        let tail = match self.counted_tail {
            Some((len, _, f)) if len == self.tail.len() => f,
            _ => tokenizer.count_generated_text_and_fewest(&self.tail).1,
        };
        self.committed_fewest.saturating_add(tail)
    }

    /// At least [`fewest`](Self::fewest), cheaply, as [`tokens_upper_bound`](Self::tokens_upper_bound).
    pub fn fewest_upper_bound(&self) -> u64 {
        let tail = match self.counted_tail {
            Some((len, _, f)) if len <= self.tail.len() => f + (self.tail.len() - len) as u64,
            _ => self.tail.len() as u64,
        };
        self.committed_fewest.saturating_add(tail)
    }

    /// At least [`tokens`](Self::tokens), cheaply: the tail's last count plus one token per
    /// byte added since (the tail counted as its bytes when never counted).
    pub fn tokens_upper_bound(&self) -> u64 {
        let tail = match self.counted_tail {
            Some((len, n, _)) if len <= self.tail.len() => n + (self.tail.len() - len) as u64,
            _ => self.tail.len() as u64,
        };
        self.committed_tokens.saturating_add(tail)
    }

    /// Whether [`tokens_upper_bound`](Self::tokens_upper_bound) is the exact count (the tail was
    /// counted since it last grew, or is empty).
    pub fn bound_is_exact(&self) -> bool {
        self.tail.is_empty()
            || matches!(self.counted_tail, Some((len, ..)) if len == self.tail.len())
    }

    /// Counts the tail now when it grew by an eighth (at least 256 bytes) since its last count,
    /// so that [`tokens_upper_bound`](Self::tokens_upper_bound) is close again; amortized, the
    /// tail is counted O(1) times per byte.
    pub fn refresh(&mut self, tokenizer: &dyn TokenCounter) {
        let due = match self.counted_tail {
            Some((len, ..)) => self.tail.len() >= len + (self.tail.len() / 8).max(256),
            None => true,
        };
        if due {
            let (tokens, fewest) = tokenizer.count_generated_text_and_fewest(&self.tail);
            self.counted_tail = Some((self.tail.len(), tokens, fewest));
        }
    }
}

/// What one choice generated, counted as it streams ([`IncrementalText`] per piece): the
/// streaming counterpart of [`GeneratedText`], with the same pieces and the same count.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GeneratedCount {
    content: IncrementalText,
    reasoning: IncrementalText,
    tool_calls: BTreeMap<u64, (IncrementalText, IncrementalText)>,
}

impl GeneratedCount {
    /// Nothing generated yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends what `generated` holds (one chunk's delta of this choice).
    pub fn push(&mut self, tokenizer: &dyn TokenCounter, generated: &GeneratedText) {
        self.content.push(tokenizer, &generated.content);
        self.reasoning.push(tokenizer, &generated.reasoning);
        for (index, call) in &generated.tool_calls {
            let (name, arguments) = self.tool_calls.entry(*index).or_default();
            name.push(tokenizer, &call.name);
            arguments.push(tokenizer, &call.arguments);
        }
    }

    fn pieces(&self) -> impl Iterator<Item = &IncrementalText> {
        [&self.content, &self.reasoning]
            .into_iter()
            .chain(self.tool_calls.values().flat_map(|(n, a)| [n, a]))
    }

    /// `of` each piece, summed (saturating).
    fn sum(&self, of: impl Fn(&IncrementalText) -> u64) -> u64 {
        self.pieces().map(of).fold(0u64, u64::saturating_add)
    }

    /// Exact tokens of everything pushed: the counter's [`TokenCounter::count_generated_text`] of each
    /// piece, summed.
    pub fn tokens(&self, tokenizer: &dyn TokenCounter) -> u64 {
        self.sum(|p| p.tokens(tokenizer))
    }

    /// At least [`tokens`](Self::tokens), cheaply ([`IncrementalText::tokens_upper_bound`]).
    pub fn tokens_upper_bound(&self) -> u64 {
        self.sum(IncrementalText::tokens_upper_bound)
    }

    /// The fewest tokens that spell everything pushed, each piece on its own
    /// ([`IncrementalText::fewest`]): what the node generated at the least.
    pub fn fewest(&self, tokenizer: &dyn TokenCounter) -> u64 {
        self.sum(|p| p.fewest(tokenizer))
    }

    /// At least [`fewest`](Self::fewest), cheaply ([`IncrementalText::fewest_upper_bound`]).
    pub fn fewest_upper_bound(&self) -> u64 {
        self.sum(IncrementalText::fewest_upper_bound)
    }

    /// Whether [`tokens_upper_bound`](Self::tokens_upper_bound) is the exact count.
    pub fn bound_is_exact(&self) -> bool {
        self.pieces().all(IncrementalText::bound_is_exact)
    }

    /// Counts the pieces' tails when due ([`IncrementalText::refresh`]).
    pub fn refresh(&mut self, tokenizer: &dyn TokenCounter) {
        self.content.refresh(tokenizer);
        self.reasoning.refresh(tokenizer);
        for (name, arguments) in self.tool_calls.values_mut() {
            name.refresh(tokenizer);
            arguments.refresh(tokenizer);
        }
    }

    /// UTF-8 bytes of everything pushed.
    pub fn len_bytes(&self) -> u64 {
        self.sum(IncrementalText::len_bytes)
    }

    /// How many tool calls.
    pub fn tool_call_count(&self) -> usize {
        self.tool_calls.len()
    }

    /// As [`GeneratedText::wrapper_allowance_tokens`].
    pub fn wrapper_allowance_tokens(&self) -> u64 {
        let named = self
            .tool_calls
            .values()
            .filter(|(name, _)| name.len_bytes() > 0)
            .count();
        let calls = named as u64 * TOOL_CALL_WRAPPER_TOKENS;
        let reasoning = if self.reasoning.len_bytes() == 0 {
            0
        } else {
            REASONING_WRAPPER_TOKENS
        };
        calls + reasoning
    }
}

#[cfg(all(test, feature = "tokenizer"))]
mod tests;
#[cfg(all(test, feature = "tokenizer"))]
mod tests_generated;
#[cfg(all(test, feature = "tokenizer"))]
mod tests_template;
