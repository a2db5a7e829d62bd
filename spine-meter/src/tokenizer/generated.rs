//! What one choice generated, as the node delivered it ([`GeneratedText`]).

use super::*;

/// Everything one choice generated, as the node delivered it.
///
/// llama.cpp generates plain text and parses it into `content`, `reasoning_content` (the text
/// between the template's thinking tags) and `tool_calls` (the function name and the arguments
/// text) before sending; its `completion_tokens` counts every generated token. spine counts the
/// parsed pieces, each tokenized on its own. **Known approximation:** the syntax the parser
/// removed (thinking tags, the tool-call wrapper such as `<tool_call>{"name": …,
/// "arguments": …}</tool_call>`) is not counted, so for reasoning and tool-call output the
/// independent count is a few tokens BELOW the engine's; the metering layer widens the
/// discrepancy tolerance by [`GeneratedText::wrapper_allowance_tokens`] for such choices.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GeneratedText {
    pub(super) content: String,
    pub(super) reasoning: String,
    pub(super) tool_calls: BTreeMap<u64, ToolCallText>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct ToolCallText {
    pub(super) name: String,
    pub(super) arguments: String,
}

/// Tokens allowed per tool call for the wrapper syntax the engine's parser removed.
pub(super) const TOOL_CALL_WRAPPER_TOKENS: u64 = 24;
/// Tokens allowed for the thinking tags the engine's parser removed.
pub(super) const REASONING_WRAPPER_TOKENS: u64 = 8;

impl GeneratedText {
    /// Nothing generated yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The `content` text when there is nothing else (no reasoning, no tool calls).
    pub fn plain_content(&self) -> Option<&str> {
        (self.reasoning.is_empty() && self.tool_calls.is_empty()).then_some(self.content.as_str())
    }

    /// Each piece of text with a key of its own (content 0, reasoning 1, then each tool
    /// call's name and arguments): pieces are separate texts, streamed each in its order.
    pub fn for_each_piece(&self, mut f: impl FnMut(u64, &str)) {
        f(0, &self.content);
        f(1, &self.reasoning);
        for (index, call) in &self.tool_calls {
            let key = index.saturating_mul(2).saturating_add(2);
            f(key, &call.name);
            f(key.saturating_add(1), &call.arguments);
        }
    }

    /// Plain `content` text.
    pub fn from_content(content: &str) -> Self {
        Self {
            content: content.to_owned(),
            ..Self::default()
        }
    }

    /// Appends what one choice object carries: its `delta` (a stream chunk) or `message` (a
    /// complete response) — `content`, `reasoning_content` or `reasoning`,
    /// `tool_calls[].function.{name, arguments}` (a tool call's position is its `index`, else
    /// its place in the array) — or its `text` (`/v1/completions`). Values of the wrong type
    /// are ignored.
    pub fn push_choice_json(&mut self, choice: &Value) {
        let Some(part) = choice.get("delta").or_else(|| choice.get("message")) else {
            if let Some(t) = choice.get("text").and_then(Value::as_str) {
                self.content.push_str(t);
            }
            return;
        };
        self.push_message_json(part);
    }

    /// Appends what one `delta` or `message` object carries: `content`, `refusal`,
    /// `reasoning_content` or `reasoning`, `tool_calls[].function.{name, arguments}`. Values of
    /// the wrong type are ignored.
    pub fn push_message_json(&mut self, part: &Value) {
        if let Some(t) = part.get("content").and_then(Value::as_str) {
            self.content.push_str(t);
        }
        // a refusal is generated text too (OpenAI bills it as completion tokens)
        if let Some(t) = part.get("refusal").and_then(Value::as_str) {
            self.content.push_str(t);
        }
        // reasoning: `reasoning_content` (llama.cpp, SGLang, older vLLM) or `reasoning` (vLLM
        // since early 2026, Ollama's OpenAI layer); vLLM sent both, the same text, while it
        // moved from one to the other, so the longer is counted, once
        let reasoning = ["reasoning_content", "reasoning"]
            .iter()
            .filter_map(|field| part.get(*field).and_then(Value::as_str))
            .max_by_key(|t| t.len());
        if let Some(t) = reasoning {
            self.reasoning.push_str(t);
        }
        if let Some(calls) = part.get("tool_calls").and_then(Value::as_array) {
            for (pos, call) in calls.iter().enumerate() {
                let index = call
                    .get("index")
                    .and_then(Value::as_u64)
                    .unwrap_or(pos as u64);
                let function = call.get("function");
                let field = |k: &str| function.and_then(|f| f.get(k)).and_then(Value::as_str);
                self.push_tool_call(index, field("name"), field("arguments"));
            }
        }
    }

    /// Appends `content` text.
    pub fn push_content(&mut self, text: &str) {
        self.content.push_str(text);
    }

    /// Appends `reasoning_content` text.
    pub fn push_reasoning(&mut self, text: &str) {
        self.reasoning.push_str(text);
    }

    /// Appends to tool call `index`: pieces of its function name and arguments text.
    pub fn push_tool_call(&mut self, index: u64, name: Option<&str>, arguments: Option<&str>) {
        let call = self.tool_calls.entry(index).or_default();
        call.name.push_str(name.unwrap_or(""));
        call.arguments.push_str(arguments.unwrap_or(""));
    }

    /// Appends everything `other` holds.
    pub fn append(&mut self, other: &GeneratedText) {
        self.content.push_str(&other.content);
        self.reasoning.push_str(&other.reasoning);
        for (index, call) in &other.tool_calls {
            self.push_tool_call(*index, Some(&call.name), Some(&call.arguments));
        }
    }

    /// The `content` text.
    pub fn content(&self) -> &str {
        &self.content
    }

    /// The `reasoning_content` text.
    pub fn reasoning(&self) -> &str {
        &self.reasoning
    }

    /// How many tool calls.
    pub fn tool_call_count(&self) -> usize {
        self.tool_calls.len()
    }

    /// The tool calls, by position: `(index, function name, arguments)` (in a stream chunk,
    /// the pieces this chunk carries).
    pub fn tool_calls(&self) -> impl Iterator<Item = (u64, &str, &str)> {
        self.tool_calls
            .iter()
            .map(|(i, c)| (*i, c.name.as_str(), c.arguments.as_str()))
    }

    /// Whether nothing was generated.
    pub fn is_empty(&self) -> bool {
        self.len_bytes() == 0 && self.tool_calls.is_empty()
    }

    /// UTF-8 bytes of everything generated.
    pub fn len_bytes(&self) -> u64 {
        let calls: usize = self
            .tool_calls
            .values()
            .map(|c| c.name.len() + c.arguments.len())
            .sum();
        (self.content.len() + self.reasoning.len() + calls) as u64
    }

    /// Tokens the engine may count above [`ModelTokenizer::count_generated`] for syntax its
    /// parser removed: 24 per tool call that has a function name (an engine's parser always
    /// gives one; nameless calls would only widen the discrepancy tolerance for a node that
    /// pads its claim), 8 when there is reasoning text, else 0.
    pub fn wrapper_allowance_tokens(&self) -> u64 {
        let named = self
            .tool_calls
            .values()
            .filter(|c| !c.name.is_empty())
            .count();
        let calls = named as u64 * TOOL_CALL_WRAPPER_TOKENS;
        let reasoning = if self.reasoning.is_empty() {
            0
        } else {
            REASONING_WRAPPER_TOKENS
        };
        calls + reasoning
    }
}
