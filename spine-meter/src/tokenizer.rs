//! Independent token counting: the model's own tokenizer and chat template (design brief §6).
//!
//! A [`ModelTokenizer`] counts what the engine counts:
//! - **prompt tokens**: the chat template rendered the way llama.cpp renders it (messages,
//!   `add_generation_prompt = true`, `bos_token`/`eos_token`), then tokenized with special tokens
//!   parsed and no BOS added (measured against `llama-server`, see `fixtures/README.md`);
//! - **completion tokens**: the text the engine generated, as delivered ([`GeneratedText`]:
//!   `content`, `reasoning_content` and each tool call's function `name` and `arguments`),
//!   tokenized the same way, plus one EOS token when the choice's `finish_reason` is `"stop"` or
//!   `"tool_calls"` (llama.cpp counts the EOS it sampled); a `"length"` finish bills exactly
//!   `max_tokens` when the delivered text supports it ([`ModelTokenizer::bill_completion`]).
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

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{PoisonError, RwLock, TryLockError};

use serde_json::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::utils::SysRegex;
use tokenizers::{AddedToken, Model, ModelWrapper, Tokenizer};

use crate::gguf::{GgufError, GgufMetadata};

mod fast;
mod generated;

use fast::*;
pub use generated::GeneratedText;
use generated::*;

/// llama.cpp's token type for control tokens (`LLAMA_TOKEN_TYPE_CONTROL`).
const TOKEN_TYPE_CONTROL: i64 = 3;
/// llama.cpp's token type for user-defined tokens (`LLAMA_TOKEN_TYPE_USER_DEFINED`).
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Why a tokenizer could not be built or a request could not be counted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// The GGUF header could not be read.
    #[error("cannot read gguf metadata")]
    Gguf(#[source] GgufError),
    /// A key the tokenizer needs is missing or has the wrong type.
    #[error("gguf key {0:?} missing or of the wrong type")]
    MissingKey(&'static str),
    /// The GGUF's `tokenizer.ggml.pre` is one this crate does not reproduce.
    #[error("unsupported pre-tokenizer {0:?}")]
    UnsupportedPreTokenizer(String),
    /// The tokenizers crate refused the vocabulary or input.
    #[error("tokenizer error: {0}")]
    Tokenizers(String),
    /// The chat template failed to compile or render.
    #[error("chat template error")]
    Template(#[source] minijinja::Error),
    /// The request body has neither `messages` (array) nor `prompt` (string).
    #[error("request body has neither a messages array nor a prompt string")]
    NoPrompt,
}

/// One model's tokenizer and chat template.
#[derive(Debug)]
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
    context_length_tokens: Option<u64>,
    /// The longest token of the vocabulary, UTF-8 bytes of its vocabulary string (for a
    /// byte-level vocabulary an upper bound of the bytes it decodes to), at least 1.
    max_token_bytes: u64,
    /// The counting fast path, for tokenizers built from a GGUF (whose pipeline it reproduces).
    fast: Option<FastCounter>,
}

const TEMPLATE_NAME: &str = "chat";

impl ModelTokenizer {
    /// Builds the tokenizer and template from a GGUF file's metadata (only the header is read).
    ///
    /// Supports BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) with the `smollm`
    /// pre-tokenizer: `Sequence[Digits(individual_digits), ByteLevel(no prefix space, regex)]`.
    /// Control and user-defined tokens become special tokens, matched before BPE.
    ///
    /// # Errors
    ///
    /// [`TokenizerError`] when the header cannot be read, a needed key is missing, or the
    /// pre-tokenizer is not supported.
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let meta = GgufMetadata::open(path).map_err(TokenizerError::Gguf)?;
        Self::from_gguf_metadata(&meta)
    }

    /// Builds the tokenizer and template from already-read GGUF metadata.
    ///
    /// # Errors
    ///
    /// As [`ModelTokenizer::from_gguf`].
    pub fn from_gguf_metadata(meta: &GgufMetadata) -> Result<Self, TokenizerError> {
        match meta.get_str("tokenizer.ggml.model") {
            Some("gpt2") | None => {}
            Some(other) => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_owned())),
        }
        let pre = meta.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let split_digits = pre == "smollm";
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            "smollm" => Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
            "gpt-2" | "default" => ByteLevel::new(false, true, true).into(),
            other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_owned())),
        };
        let tokens = meta
            .get_strings("tokenizer.ggml.tokens")
            .ok_or(TokenizerError::MissingKey("tokenizer.ggml.tokens"))?;
        let merges = meta
            .get_strings("tokenizer.ggml.merges")
            .ok_or(TokenizerError::MissingKey("tokenizer.ggml.merges"))?;
        let types = meta
            .get_ints("tokenizer.ggml.token_type")
            .ok_or(TokenizerError::MissingKey("tokenizer.ggml.token_type"))?;
        let template = meta
            .get_str("tokenizer.chat_template")
            .ok_or(TokenizerError::MissingKey("tokenizer.chat_template"))?;

        if u32::try_from(tokens.len()).is_err() {
            return Err(TokenizerError::MissingKey("tokenizer.ggml.tokens"));
        }
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(id, tok)| (tok.clone(), id as u32))
            .collect();
        let merges: Vec<(String, String)> = merges
            .iter()
            .filter_map(|m| m.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned())))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| TokenizerError::Tokenizers(e.to_string()))?;
        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
        tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(types.iter())
            .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
            .map(|(tok, _)| AddedToken::from(tok.clone(), true))
            .collect();
        tokenizer.add_special_tokens(&special);
        let fast = FastCounter::new(
            special.iter().map(|t| t.content.clone()).collect(),
            split_digits,
        );

        let token_text = |key: &'static str| -> String {
            meta.get_u64(key)
                .and_then(|id| usize::try_from(id).ok())
                .and_then(|id| tokens.get(id))
                .cloned()
                .unwrap_or_default()
        };
        let mut built = Self::assemble(
            tokenizer,
            template.to_owned(),
            token_text("tokenizer.ggml.bos_token_id"),
            token_text("tokenizer.ggml.eos_token_id"),
            meta.get_str("general.architecture")
                .and_then(|arch| meta.get_u64(&format!("{arch}.context_length"))),
        )?;
        built.fast = fast;
        Ok(built)
    }

    /// Builds from a Hugging Face `tokenizer.json` and a chat template string.
    ///
    /// # Errors
    ///
    /// [`TokenizerError`] when the JSON is not a tokenizer or the template does not compile.
    pub fn from_tokenizer_json(
        tokenizer_json: &[u8],
        chat_template: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Self, TokenizerError> {
        let tokenizer = Tokenizer::from_bytes(tokenizer_json)
            .map_err(|e| TokenizerError::Tokenizers(e.to_string()))?;
        Self::assemble(
            tokenizer,
            chat_template.to_owned(),
            bos_token.to_owned(),
            eos_token.to_owned(),
            None,
        )
    }

    fn assemble(
        tokenizer: Tokenizer,
        template: String,
        bos_token: String,
        eos_token: String,
        context_length_tokens: Option<u64>,
    ) -> Result<Self, TokenizerError> {
        let mut env = minijinja::Environment::new();
        // HF's apply_chat_template and llama.cpp's renderer both trim and lstrip blocks
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, template)
            .map_err(TokenizerError::Template)?;
        let max_token_bytes = tokenizer
            .get_vocab(true)
            .keys()
            .map(|t| t.len() as u64)
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(Self {
            tokenizer,
            env,
            bos_token,
            eos_token,
            context_length_tokens,
            max_token_bytes,
            fast: None,
        })
    }

    /// Replaces the chat template (as llama.cpp's `--chat-template` does), keeping the tokenizer.
    ///
    /// # Errors
    ///
    /// [`TokenizerError::Template`] when the template does not compile.
    pub fn with_chat_template(mut self, template: &str) -> Result<Self, TokenizerError> {
        self.env
            .add_template_owned(TEMPLATE_NAME, template.to_owned())
            .map_err(TokenizerError::Template)?;
        Ok(self)
    }

    /// The longest vocabulary token, bytes (at least 1): a text of `B` bytes is at least
    /// `B / max_token_bytes` tokens, however it is tokenized. Bounds what a choice capped at `L`
    /// tokens may deliver without counting it: `L × max_token_bytes` bytes.
    pub fn max_token_bytes(&self) -> u64 {
        self.max_token_bytes
    }

    /// The model's context window from the GGUF (`<arch>.context_length`), tokens.
    pub fn context_length_tokens(&self) -> Option<u64> {
        self.context_length_tokens
    }

    /// The EOS token's text.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// The BOS token's text.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// Renders the chat template for a request body's `messages` with the generation prompt, as
    /// llama.cpp's `/apply-template` does.
    ///
    /// # Errors
    ///
    /// [`TokenizerError::NoPrompt`] when `messages` is not an array; [`TokenizerError::Template`]
    /// when rendering fails.
    pub fn render_chat(&self, body: &Value) -> Result<String, TokenizerError> {
        let Some(messages) = body.get("messages").and_then(Value::as_array) else {
            return Err(TokenizerError::NoPrompt);
        };
        let messages: Vec<Value> = messages.iter().map(normalize_message).collect();
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(TokenizerError::Template)?;
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), Value::Array(messages));
        ctx.insert("add_generation_prompt".into(), Value::Bool(true));
        ctx.insert("bos_token".into(), Value::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Value::String(self.eos_token.clone()));
        if let Some(tools) = body.get("tools").filter(|t| t.is_array()) {
            ctx.insert("tools".into(), tools.clone());
        }
        tmpl.render(minijinja::Value::from_serialize(&ctx))
            .map_err(TokenizerError::Template)
    }

    /// Prompt tokens of a request body: the rendered chat template for `messages`, or the
    /// `prompt` string of a `/v1/completions` body, tokenized with special tokens parsed and no
    /// BOS added.
    ///
    /// # Errors
    ///
    /// [`TokenizerError::NoPrompt`] when the body has neither; [`TokenizerError::Template`] when
    /// the template fails to render.
    pub fn count_prompt(&self, body: &Value) -> Result<u64, TokenizerError> {
        if body.get("messages").is_some() {
            let text = self.render_chat(body)?;
            return Ok(self.count_text(&text));
        }
        match body.get("prompt") {
            Some(Value::String(p)) => Ok(self.count_text(p)),
            _ => Err(TokenizerError::NoPrompt),
        }
    }

    /// Tokens of `text`, special tokens parsed, no BOS/EOS added. Input the tokenizer cannot
    /// encode (none is known for byte-level BPE) counts as its byte length, an upper bound.
    ///
    /// For a tokenizer built from a GGUF this is the counting fast path ([`FastCounter`]): the
    /// same splits as the full pipeline, each counted once through a bounded word cache,
    /// without building an `Encoding`. It returns exactly what
    /// [`count_text_full`](Self::count_text_full) returns (property-tested and fuzzed against
    /// it); anything it cannot decide falls back to the full pipeline.
    pub fn count_text(&self, text: &str) -> u64 {
        if text.is_empty() {
            return 0;
        }
        if let Some(fast) = &self.fast {
            if let Some(n) = fast.count(self.tokenizer.get_model(), text) {
                return n;
            }
        }
        self.count_text_full(text)
    }

    /// Tokens of `text` through the tokenizers crate's full pipeline (`encode`, building the
    /// `Encoding`): the reference [`count_text`](Self::count_text) must equal, kept for tests,
    /// fuzzing and benchmarks.
    pub fn count_text_full(&self, text: &str) -> u64 {
        if text.is_empty() {
            return 0;
        }
        match self.tokenizer.encode_fast(text, false) {
            Ok(enc) => enc.len() as u64,
            Err(_) => text.len() as u64,
        }
    }

    /// Completion tokens of one choice: tokens of the delivered `text`, plus one for the EOS the
    /// engine sampled when `finish_reason` is `"stop"` (llama.cpp's convention).
    pub fn completion_tokens(&self, text: &str, finish_reason: Option<&str>) -> u64 {
        self.count_text(text) + u64::from(finish_reason == Some("stop"))
    }

    /// Tokens of everything a choice generated: `content`, `reasoning_content`, and each tool
    /// call's `name` and `arguments`, each piece tokenized on its own (see [`GeneratedText`] for
    /// what this leaves out).
    pub fn count_generated(&self, generated: &GeneratedText) -> u64 {
        let calls = generated
            .tool_calls
            .values()
            .map(|c| self.count_text(&c.name) + self.count_text(&c.arguments))
            .fold(0u64, u64::saturating_add);
        self.count_text(&generated.content)
            .saturating_add(self.count_text(&generated.reasoning))
            .saturating_add(calls)
    }

    /// Completion tokens billed for one choice (the metering rules, `docs/metering.md`).
    ///
    /// [`bill_counted`](Self::bill_counted) with `T` = [`count_generated`](Self::count_generated)
    /// and `B` = the generated text's UTF-8 bytes.
    pub fn bill_completion(
        &self,
        generated: &GeneratedText,
        finish_reason: Option<&str>,
        rule: CompletionRule,
    ) -> CompletionCount {
        self.bill_counted(
            self.count_generated(generated),
            generated.len_bytes(),
            finish_reason,
            rule,
        )
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
    ///   fewer bytes than `L − 3`, or more than `L + max(2, L / 50)` tokens;
    /// - anything else (`"length"` without `max_tokens`, where the engine's own context may
    ///   have stopped it, or an unknown reason): `min(T, L)`.
    pub fn bill_counted(
        &self,
        text_tokens: u64,
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
                count.tokens = text_tokens
                    .saturating_add(length_allowance_tokens(cap))
                    .min(cap);
                count.length_unsupported = text_tokens > cap.saturating_add(slack)
                    || cap > bytes.saturating_add(MAX_HELD_BACK_BYTES);
            }
            _ => {}
        }
        count
    }
}

/// The tokens a `length` finish capped at `cap_tokens` may bill above its delivered text's count:
/// `3 + max(2, cap / 50)` ([`ModelTokenizer::bill_counted`]).
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

/// The request's limits, for [`ModelTokenizer::bill_completion`].
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

/// What [`ModelTokenizer::bill_completion`] decided for one choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompletionCount {
    /// Completion tokens billed.
    pub tokens: u64,
    /// Tokens of the generated text alone ([`ModelTokenizer::count_generated`]).
    pub text_tokens: u64,
    /// The choice finished with `"length"` but its text cannot be `max_tokens` tokens (fewer
    /// bytes than that, or more tokens): billed by its text and flagged as a discrepancy.
    pub length_unsupported: bool,
}

/// Bytes kept uncounted at the end of an [`IncrementalText`]: more than the longest special
/// token, so no special token can span a cut.
const INCREMENTAL_KEEP_BYTES: usize = 256;
/// An [`IncrementalText`] looks for a cut once its uncounted tail has grown by this much.
const INCREMENTAL_STEP_BYTES: usize = 2048;

/// A text that arrives in pieces (one choice's `content` in a stream), counted as it flows
/// without keeping all of it: its total is always exactly
/// [`ModelTokenizer::count_text`] of the whole text.
///
/// How: the text is cut where the tokenizer's own pre-tokenization is sure to split whatever
/// follows — between two ASCII characters where a non-space is followed by a space, or the
/// character class (letter, digit, other) changes and the first is not an apostrophe (which
/// may start a contraction such as `'s`), with no special token spanning the cut — so the
/// count of the whole is the sum of the counts of the parts (BPE runs on each split alone).
/// The part before the cut is counted and dropped; at most [`INCREMENTAL_STEP_BYTES`] plus
/// [`INCREMENTAL_KEEP_BYTES`] stay uncounted, unless the text has no such place (a long run
/// of CJK letters, one very long word): then the tail grows until it has one. Cuts are made
/// only for tokenizers with the GGUF fast path (whose pipeline this reasoning is about);
/// otherwise the whole text is kept and counted at the end.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IncrementalText {
    committed_tokens: u64,
    tail: String,
    /// Tail length at which the next cut is tried.
    next_try_bytes: usize,
    /// `(tail length, its tokens)` when the tail was last counted.
    counted_tail: Option<(usize, u64)>,
    total_bytes: u64,
    /// Tail positions up to this one were looked at and are no cut, whatever follows (see
    /// `FastCounter::stable_cut`): each byte is looked at once, however long a text without a
    /// cut (a run of spaces, of CJK letters) grows.
    no_cut_through: usize,
}

impl IncrementalText {
    /// Appends `text`, counting what can be counted for good.
    pub fn push(&mut self, tokenizer: &ModelTokenizer, text: &str) {
        if text.is_empty() {
            return;
        }
        self.tail.push_str(text);
        self.total_bytes = self.total_bytes.saturating_add(text.len() as u64);
        if self.tail.len() < self.next_try_bytes.max(INCREMENTAL_STEP_BYTES) {
            return;
        }
        self.next_try_bytes = self.tail.len() + INCREMENTAL_STEP_BYTES;
        let Some(fast) = &tokenizer.fast else {
            return;
        };
        let found = fast.stable_cut(&self.tail, INCREMENTAL_KEEP_BYTES, self.no_cut_through);
        if found.is_none() {
            self.no_cut_through = self.tail.len().saturating_sub(INCREMENTAL_KEEP_BYTES);
        }
        if let Some(cut) = found {
            self.no_cut_through = 0;
            let head = self.tail.get(..cut).unwrap_or_default();
            self.committed_tokens = self
                .committed_tokens
                .saturating_add(tokenizer.count_text(head));
            self.tail.drain(..cut);
            self.next_try_bytes = self.tail.len() + INCREMENTAL_STEP_BYTES;
            self.counted_tail = None;
        }
    }

    /// UTF-8 bytes pushed so far.
    pub fn len_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Exact tokens of everything pushed ([`ModelTokenizer::count_text`] of the whole text).
    pub fn tokens(&self, tokenizer: &ModelTokenizer) -> u64 {
        let tail = match self.counted_tail {
            Some((len, n)) if len == self.tail.len() => n,
            _ => tokenizer.count_text(&self.tail),
        };
        self.committed_tokens.saturating_add(tail)
    }

    /// At least [`tokens`](Self::tokens), cheaply: the tail's last count plus one token per
    /// byte added since (the tail counted as its bytes when never counted).
    pub fn tokens_upper_bound(&self) -> u64 {
        let tail = match self.counted_tail {
            Some((len, n)) if len <= self.tail.len() => n + (self.tail.len() - len) as u64,
            _ => self.tail.len() as u64,
        };
        self.committed_tokens.saturating_add(tail)
    }

    /// Whether [`tokens_upper_bound`](Self::tokens_upper_bound) is the exact count (the tail was
    /// counted since it last grew, or is empty).
    pub fn bound_is_exact(&self) -> bool {
        self.tail.is_empty()
            || matches!(self.counted_tail, Some((len, _)) if len == self.tail.len())
    }

    /// Counts the tail now when it grew by an eighth (at least 256 bytes) since its last count,
    /// so that [`tokens_upper_bound`](Self::tokens_upper_bound) is close again; amortized, the
    /// tail is counted O(1) times per byte.
    pub fn refresh(&mut self, tokenizer: &ModelTokenizer) {
        let due = match self.counted_tail {
            Some((len, _)) => self.tail.len() >= len + (self.tail.len() / 8).max(256),
            None => true,
        };
        if due {
            self.counted_tail = Some((self.tail.len(), tokenizer.count_text(&self.tail)));
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
    pub fn push(&mut self, tokenizer: &ModelTokenizer, generated: &GeneratedText) {
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

    /// Exact tokens, as [`ModelTokenizer::count_generated`] of everything pushed.
    pub fn tokens(&self, tokenizer: &ModelTokenizer) -> u64 {
        self.pieces()
            .map(|p| p.tokens(tokenizer))
            .fold(0u64, u64::saturating_add)
    }

    /// At least [`tokens`](Self::tokens), cheaply ([`IncrementalText::tokens_upper_bound`]).
    pub fn tokens_upper_bound(&self) -> u64 {
        self.pieces()
            .map(IncrementalText::tokens_upper_bound)
            .fold(0u64, u64::saturating_add)
    }

    /// Whether [`tokens_upper_bound`](Self::tokens_upper_bound) is the exact count.
    pub fn bound_is_exact(&self) -> bool {
        self.pieces().all(IncrementalText::bound_is_exact)
    }

    /// Counts the pieces' tails when due ([`IncrementalText::refresh`]).
    pub fn refresh(&mut self, tokenizer: &ModelTokenizer) {
        self.content.refresh(tokenizer);
        self.reasoning.refresh(tokenizer);
        for (name, arguments) in self.tool_calls.values_mut() {
            name.refresh(tokenizer);
            arguments.refresh(tokenizer);
        }
    }

    /// UTF-8 bytes of everything pushed.
    pub fn len_bytes(&self) -> u64 {
        self.pieces()
            .map(IncrementalText::len_bytes)
            .fold(0u64, u64::saturating_add)
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

/// A message as llama.cpp hands it to a string-content template.
fn normalize_message(msg: &Value) -> Value {
    let Some(obj) = msg.as_object() else {
        return msg.clone();
    };
    let mut out = obj.clone();
    let content = match obj.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                if part.get("type").and_then(Value::as_str) == Some("text") {
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(part.get("text").and_then(Value::as_str).unwrap_or(""));
                }
            }
            text
        }
        _ => String::new(),
    };
    out.insert("content".into(), Value::String(content));
    Value::Object(out)
}

#[cfg(test)]
mod tests;
