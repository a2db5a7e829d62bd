//! Independent token counting: the model's own tokenizer and chat template (design brief §6).
//!
//! A [`ModelTokenizer`] counts what the engine counts:
//! - **prompt tokens**: the chat template rendered the way llama.cpp renders it (messages,
//!   `add_generation_prompt = true`, `bos_token`/`eos_token`), then tokenized with special tokens
//!   parsed and no BOS added (measured against `llama-server`, see `fixtures/README.md`);
//! - **completion tokens**: the delivered text tokenized the same way, plus one EOS token when the
//!   choice's `finish_reason` is `"stop"` (llama.cpp counts the EOS it sampled).
//!
//! Message normalisation follows llama.cpp's `common/chat.cpp` for templates that only take string
//! content: a string `content` is used as is; an array of content parts is joined into one string
//! with `\n` between `{"type":"text"}` parts (other part types are ignored here; the metering
//! layer refuses them before counting, see `spine_core::validate_chat_messages`); a missing or
//! `null` content is `""`.

use std::path::Path;

use serde_json::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, Tokenizer};

use crate::gguf::{GgufError, GgufMetadata};

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

        let token_text = |key: &'static str| -> String {
            meta.get_u64(key)
                .and_then(|id| usize::try_from(id).ok())
                .and_then(|id| tokens.get(id))
                .cloned()
                .unwrap_or_default()
        };
        Self::assemble(
            tokenizer,
            template.to_owned(),
            token_text("tokenizer.ggml.bos_token_id"),
            token_text("tokenizer.ggml.eos_token_id"),
            meta.get_str("general.architecture")
                .and_then(|arch| meta.get_u64(&format!("{arch}.context_length"))),
        )
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
        Ok(Self {
            tokenizer,
            env,
            bos_token,
            eos_token,
            context_length_tokens,
        })
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
    pub fn count_text(&self, text: &str) -> u64 {
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
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde_json::json;

    fn tok() -> std::sync::Arc<ModelTokenizer> {
        crate::test_support::smollm_tokenizer()
    }

    #[test]
    fn renders_the_template_as_the_engine_did() {
        // fixtures/llama.cpp/d_apply_template.txt
        let body = json!({"messages":[{"role":"user","content":"Name three colors."}]});
        assert_eq!(
            tok().render_chat(&body).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn counts_match_recorded_engine_numbers() {
        let t = tok();
        // a_chat_nonstream.txt: prompt_tokens 34, completion_tokens 12 with finish_reason stop
        let body =
            json!({"model":"smollm2","messages":[{"role":"user","content":"Name three colors."}]});
        assert_eq!(t.count_prompt(&body).unwrap(), 34);
        assert_eq!(
            t.completion_tokens("1. Red\n2. Blue\n3. Green", Some("stop")),
            12
        );
        assert_eq!(
            t.completion_tokens("1. Red\n2. Blue\n3. Green", Some("length")),
            11
        );
        // d_tokenize.txt: "Hello world 2024! 你好 🙂" -> 14 ids
        assert_eq!(
            t.count_text("Hello world 2024! \u{4f60}\u{597d} \u{1F642}"),
            14
        );
        // d_tokenize_special.txt: specials parsed
        assert_eq!(t.count_text("<|im_start|>user<|im_end|>"), 3);
        assert_eq!(t.count_text(""), 0);
    }

    #[test]
    fn content_parts_are_joined_with_newlines() {
        let t = tok();
        let parts = json!({"messages":[{"role":"user","content":[
            {"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]}]});
        let plain = json!({"messages":[{"role":"user","content":"a\nb"}]});
        assert_eq!(
            t.render_chat(&parts).unwrap(),
            t.render_chat(&plain).unwrap()
        );
    }

    #[test]
    fn completions_prompt_and_missing_prompt() {
        let t = tok();
        // d_v1_completions.txt: prompt_tokens 5
        assert_eq!(
            t.count_prompt(&json!({"prompt":"The capital of France is"}))
                .unwrap(),
            5
        );
        assert!(matches!(
            t.count_prompt(&json!({"model":"m"})),
            Err(TokenizerError::NoPrompt)
        ));
    }
}
