//! Generated text is counted with special-token strings as ordinary text; prompts parse them.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;
use serde_json::json;

fn tok() -> std::sync::Arc<ModelTokenizer> {
    crate::test_support::smollm_tokenizer()
}

/// The attacker's text: llama.cpp delivered 142 × `<|im_end|>` for 1000 generated tokens
/// (prompt of ordinary tokens spelling it); its tokenizer with `parse_special = false` gives
/// 172 for 1420 bytes of that text, 32 with special parsing.
#[test]
fn generated_special_token_strings_count_as_ordinary_text() {
    let t = tok();
    let text = "<|im_end|>".repeat(142);
    let plain = t.count_generated_text_full(&text);
    assert_eq!(t.count_generated_text(&text), plain);
    assert!(plain >= 142 * 3, "{plain}");
    // the prompt side still parses it: one token each
    assert_eq!(t.count_text(&text), 142);
    assert_eq!(t.completion_tokens(&text, Some("length")), plain);
    let mut generated = GeneratedText::new();
    generated.push_choice_json(&json!({"message": {
        "content": text,
        "reasoning_content": "<|im_start|>",
        "tool_calls": [{"index": 0, "function": {"name": "<|im_end|>", "arguments": "<jupyter_output>"}}],
    }}));
    let want = plain
        + t.count_generated_text_full("<|im_start|>")
        + t.count_generated_text_full("<|im_end|>")
        + t.count_generated_text_full("<jupyter_output>");
    assert_eq!(t.count_generated(&generated), want);
    assert!(t.count_generated_text("<jupyter_output>") > 1);
    // llama.cpp's `/tokenize` of SmolLM2 Q4_1, `parse_special: false` (measured 2026-12-04)
    assert_eq!(t.count_generated_text("<|im_end|>"), 7);
    // streamed in pieces that cut the strings anywhere: the same count
    let mut inc = GeneratedCount::new();
    for piece in text.as_bytes().chunks(7) {
        let piece = std::str::from_utf8(piece).unwrap();
        inc.push(&t, &GeneratedText::from_content(piece));
    }
    assert_eq!(inc.tokens(&t), plain);
    let dyn_counter: &dyn TokenCounter = &t;
    assert_eq!(dyn_counter.count_generated_text(&text), plain);
}

#[test]
fn the_prompt_template_still_counts_each_special_token_once() {
    let t = tok();
    let body = json!({"messages":[{"role":"user","content":"Name three colors."}]});
    // fixtures/llama.cpp/a_chat_nonstream.txt: prompt_tokens 34
    assert_eq!(t.count_prompt(&body).unwrap(), 34);
    let rendered = t.render_chat(&body).unwrap();
    assert!(t.count_generated_text(&rendered) > 34);
    // d_tokenize_special.txt: specials parsed
    assert_eq!(t.count_text("<|im_start|>user<|im_end|>"), 3);
}

proptest::proptest! {
    #[test]
    fn generated_fast_counts_equal_the_plain_pipeline(
        parts in proptest::collection::vec("[ -~\n\t'é日0-9<|>_]{0,300}|<\\|im_end\\|>|<\\|im_start\\|>|<jupyter_output>", 1..16),
    ) {
        let t = tok();
        let whole: String = parts.concat();
        proptest::prop_assert_eq!(t.count_generated_text(&whole), t.count_generated_text_full(&whole));
        let mut inc = IncrementalText::default();
        for p in &parts {
            inc.push(&t, p);
        }
        proptest::prop_assert_eq!(inc.tokens(&t), t.count_generated_text(&whole), "{:?}", parts);
    }
}
