//! [`ModelTokenizer`]: the model's own tokenizer (the tokenizers crate's byte-level BPE, read
//! from a GGUF header or a `tokenizer.json`) and chat template (minijinja), the
//! [`TokenCounter`] the gateway meters with (feature `tokenizer`, on by default).

use std::path::Path;

use serde_json::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, Tokenizer};

use super::fast::FastCounter;
use super::{
    bill_counted, CompletionCount, CompletionRule, GeneratedText, TokenCounter, TokenizerError,
};
use crate::gguf::GgufMetadata;

/// llama.cpp's token type for control tokens (`LLAMA_TOKEN_TYPE_CONTROL`).
const TOKEN_TYPE_CONTROL: i64 = 3;
/// llama.cpp's token type for user-defined tokens (`LLAMA_TOKEN_TYPE_USER_DEFINED`).
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// One model's tokenizer and chat template.
#[derive(Debug)]
pub struct ModelTokenizer {
    pub(super) tokenizer: Tokenizer,
    /// The same tokenizer without its added (special) tokens: the full-pipeline reference of
    /// [`count_generated_text`](Self::count_generated_text), where special-token strings are
    /// ordinary text.
    plain: Tokenizer,
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
    context_length_tokens: Option<u64>,
    /// The length of the model's embedding vectors from the GGUF (`<arch>.embedding_length`).
    embedding_length: Option<u64>,
    /// The longest token of the vocabulary, UTF-8 bytes of its vocabulary string (for a
    /// byte-level vocabulary an upper bound of the bytes it decodes to), at least 1.
    max_token_bytes: u64,
    /// Token ids of the vocabulary, added tokens included (read once: `tokenizers`'
    /// `get_vocab_size` builds the whole vocabulary map at each call).
    vocab_size: u64,
    /// The counting fast path, for tokenizers built from a GGUF (whose pipeline it reproduces).
    pub(super) fast: Option<FastCounter>,
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
        built.embedding_length = meta
            .get_str("general.architecture")
            .and_then(|arch| meta.get_u64(&format!("{arch}.embedding_length")));
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
        let plain = without_added_tokens(&tokenizer)?;
        let max_token_bytes = tokenizer
            .get_vocab(true)
            .keys()
            .map(|t| t.len() as u64)
            .max()
            .unwrap_or(1)
            .max(1);
        let vocab_size = tokenizer.get_vocab_size(true) as u64;
        Ok(Self {
            tokenizer,
            plain,
            env,
            bos_token,
            eos_token,
            context_length_tokens,
            embedding_length: None,
            max_token_bytes,
            vocab_size,
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

    /// The length of the model's embedding vectors from the GGUF (`<arch>.embedding_length`):
    /// what llama.cpp's `/v1/embeddings` returns per input with pooling (`mean`, `cls`, `last`).
    pub fn embedding_length(&self) -> Option<u64> {
        self.embedding_length
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
    /// llama.cpp's `/apply-template` does: `tools` and `reasoning_effort` passed as llama.cpp
    /// passes them (`reasoning_effort` `none` as `enable_thinking` false, any other value as
    /// `reasoning_effort` and `reasoning_strength`).
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
        // OpenAI's `reasoning_effort`, as llama.cpp passes it to the template
        // (`server-common.cpp`, `caps_apply_reasoning_effort`): `none` turns thinking off,
        // any other value is the template's `reasoning_effort` and `reasoning_strength`
        match body.get("reasoning_effort").and_then(Value::as_str) {
            Some("none") => {
                ctx.insert("enable_thinking".into(), Value::Bool(false));
            }
            Some(effort) if !effort.is_empty() => {
                ctx.insert("reasoning_effort".into(), Value::from(effort));
                ctx.insert("reasoning_strength".into(), Value::from(effort));
            }
            _ => {}
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
        self.count_fast_or_full(text, true)
    }

    /// Tokens of `text` through the tokenizers crate's full pipeline (`encode`, building the
    /// `Encoding`): the reference [`count_text`](Self::count_text) must equal, kept for tests,
    /// fuzzing and benchmarks.
    pub fn count_text_full(&self, text: &str) -> u64 {
        encoded_len(&self.tokenizer, text)
    }

    /// Tokens of text the engine generated and delivered: special-token strings (`<|im_end|>`)
    /// are ordinary text here, tokenized as llama.cpp's `common_tokenize(…, parse_special =
    /// false)` tokenizes them except that user-defined tokens are not split out either (see
    /// [`TokenCounter::count_generated_text`]). llama.cpp renders a control token it samples
    /// as no text, so such a string in its output was spelled with ordinary tokens.
    ///
    /// The fast path when built from a GGUF, else [`count_generated_text_full`](Self::count_generated_text_full)
    /// (which it equals).
    pub fn count_generated_text(&self, text: &str) -> u64 {
        self.count_fast_or_full(text, false)
    }

    /// [`count_generated_text`](Self::count_generated_text) and the fewest tokens of the
    /// vocabulary that spell `text` ([`TokenCounter::count_generated_text_and_fewest`]); the
    /// fewest is searched on the fast path only (built from a GGUF), else it is the count.
    pub fn count_generated_text_and_fewest(&self, text: &str) -> (u64, u64) {
        if text.is_empty() {
            return (0, 0);
        }
        if let Some(fast) = &self.fast {
            if let Some(both) = fast.count_and_fewest(self.tokenizer.get_model(), text, false) {
                return both;
            }
        }
        let count = self.count_generated_text_full(text);
        (count, count)
    }

    /// The fast path ([`FastCounter`]), special tokens parsed or not, else the full pipeline
    /// of the tokenizer with them or without them; 0 for `""`.
    fn count_fast_or_full(&self, text: &str, parse_special: bool) -> u64 {
        if text.is_empty() {
            return 0;
        }
        if let Some(fast) = &self.fast {
            if let Some(n) = fast.count(self.tokenizer.get_model(), text, parse_special) {
                return n;
            }
        }
        if parse_special {
            self.count_text_full(text)
        } else {
            self.count_generated_text_full(text)
        }
    }

    /// [`count_generated_text`](Self::count_generated_text) through the full pipeline of the
    /// tokenizer without its added tokens: the reference, kept for tests and fuzzing.
    pub fn count_generated_text_full(&self, text: &str) -> u64 {
        encoded_len(&self.plain, text)
    }

    /// Completion tokens of one choice: tokens of the delivered `text`
    /// ([`count_generated_text`](Self::count_generated_text)), plus one for the EOS the engine
    /// sampled when `finish_reason` is `"stop"` (llama.cpp's convention).
    pub fn completion_tokens(&self, text: &str, finish_reason: Option<&str>) -> u64 {
        self.count_generated_text(text) + u64::from(finish_reason == Some("stop"))
    }

    /// Tokens of everything a choice generated: `content`, `reasoning_content`, and each tool
    /// call's `name` and `arguments`, each piece tokenized on its own with special-token
    /// strings as ordinary text ([`count_generated_text`](Self::count_generated_text); see
    /// [`GeneratedText`] for what this leaves out).
    pub fn count_generated(&self, generated: &GeneratedText) -> u64 {
        let calls = generated
            .tool_calls
            .values()
            .map(|c| self.count_generated_text(&c.name) + self.count_generated_text(&c.arguments))
            .fold(0u64, u64::saturating_add);
        self.count_generated_text(&generated.content)
            .saturating_add(self.count_generated_text(&generated.reasoning))
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
    /// in `bytes` UTF-8 bytes: the metering rules of [`bill_counted`](super::bill_counted)
    /// (`docs/metering.md`), which need no tokenizer.
    pub fn bill_counted(
        &self,
        text_tokens: u64,
        bytes: u64,
        finish_reason: Option<&str>,
        rule: CompletionRule,
    ) -> CompletionCount {
        bill_counted(text_tokens, bytes, finish_reason, rule)
    }
}

/// The metering layer counts with this tokenizer: [`count_prompt`](ModelTokenizer::count_prompt),
/// [`count_text`](ModelTokenizer::count_text) (the fast path) and
/// [`max_token_bytes`](ModelTokenizer::max_token_bytes); a streamed text is cut where the
/// byte-level split is sure to split whatever follows (only with the GGUF fast path; otherwise
/// never, and the text is counted whole).
impl TokenCounter for ModelTokenizer {
    fn count_prompt(&self, body: &Value) -> Result<u64, TokenizerError> {
        ModelTokenizer::count_prompt(self, body)
    }

    fn count_prompt_within(
        &self,
        body: &Value,
        limit: u64,
    ) -> Result<super::Counted, TokenizerError> {
        if body.get("messages").is_some() {
            let text = self.render_chat(body)?;
            return Ok(super::count_text_within(self, &text, limit));
        }
        match body.get("prompt") {
            Some(Value::String(p)) => Ok(super::count_text_within(self, p, limit)),
            _ => Err(TokenizerError::NoPrompt),
        }
    }

    fn count_text(&self, text: &str) -> u64 {
        ModelTokenizer::count_text(self, text)
    }

    fn count_generated_text(&self, text: &str) -> u64 {
        ModelTokenizer::count_generated_text(self, text)
    }

    fn count_generated_text_and_fewest(&self, text: &str) -> (u64, u64) {
        ModelTokenizer::count_generated_text_and_fewest(self, text)
    }

    fn max_token_bytes(&self) -> u64 {
        self.max_token_bytes
    }

    fn embedding_dimensions(&self) -> Option<u64> {
        self.embedding_length
    }

    fn stable_cut(&self, text: &str, keep_bytes: usize, scanned_through: usize) -> Option<usize> {
        self.fast
            .as_ref()?
            .stable_cut(text, keep_bytes, scanned_through)
    }

    fn is_special_token(&self, id: u32) -> bool {
        self.tokenizer
            .id_to_token(id)
            .is_some_and(|t| self.tokenizer.get_added_vocabulary().is_special_token(&t))
    }

    fn vocab_size(&self) -> Option<u64> {
        Some(self.vocab_size)
    }

    fn token_text(&self, id: u32) -> Option<String> {
        if self.is_special_token(id) {
            return None;
        }
        // the byte-level decoder maps a piece that is not whole UTF-8 to U+FFFD
        let text = self.tokenizer.decode(&[id], false).ok()?;
        (!text.is_empty() && !text.contains('\u{fffd}')).then_some(text)
    }
}

/// `tokenizer` without its added tokens (the `added_tokens` of its JSON form emptied): every
/// special-token string is then split and merged as ordinary text.
fn without_added_tokens(tokenizer: &Tokenizer) -> Result<Tokenizer, TokenizerError> {
    let err = |e: &dyn std::fmt::Display| TokenizerError::Tokenizers(e.to_string());
    let mut json: Value = serde_json::from_str(&tokenizer.to_string(false).map_err(|e| err(&e))?)
        .map_err(|e| err(&e))?;
    if let Some(added) = json.get_mut("added_tokens") {
        *added = Value::Array(Vec::new());
    }
    Tokenizer::from_bytes(json.to_string()).map_err(|e| err(&e))
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

/// Tokens of `text` through `tokenizer`'s full pipeline (`encode`, no BOS/EOS added); input it
/// cannot encode counts as its byte length, an upper bound; 0 for `""`.
fn encoded_len(tokenizer: &Tokenizer, text: &str) -> u64 {
    if text.is_empty() {
        return 0;
    }
    match tokenizer.encode_fast(text, false) {
        Ok(enc) => enc.len() as u64,
        Err(_) => text.len() as u64,
    }
}
