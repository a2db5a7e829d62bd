//! Independent token counting: the fast path (`ModelTokenizer::count_text`, per-split word
//! cache) returns exactly what the tokenizers crate's full pipeline returns
//! (`ModelTokenizer::count_text_full`, `encode(..).len()`) on arbitrary UTF-8 — a billing
//! invariant. Invalid UTF-8 input is counted after lossy decoding (still arbitrary UTF-8, with
//! U+FFFD). Counting twice checks the warm-cache path too. The same holds for generated text
//! (`count_generated_text`, special-token strings as ordinary text, against
//! `count_generated_text_full`), and the text fed in pieces to the streaming counter
//! (`tokenizer::IncrementalText`, cut at the first byte's multiples, which counts generated
//! text) totals exactly that. The fewest tokens that spell generated text
//! (`count_generated_text_and_fewest`, what a choice's cap is judged on) are at most its count
//! and add up across the same pieces.
//!
//! Needs the SmolLM2 GGUF: `SPINE_MODEL_GGUF`, default
//! `~/.cache/spine/models/SmolLM2-135M-Instruct.Q4_1.gguf` (`scripts/setup.sh`). Seed it with the
//! fixture texts:
//! `cargo fuzz run token_count fuzz/corpus/token_count fixtures/llama.cpp`.
#![no_main]
mod common;

use libfuzzer_sys::fuzz_target;
use spine_meter::tokenizer::IncrementalText;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let tok = common::tokenizer();
    let t = &*tok;
    let full = t.count_text_full(&text);
    assert_eq!(t.count_text(&text), full, "{text:?}");
    assert_eq!(t.count_text(&text), full, "{text:?} (warm cache)");
    let generated = t.count_generated_text_full(&text);
    assert_eq!(
        t.count_generated_text(&text),
        generated,
        "{text:?} (generated)"
    );
    let step = usize::from(data.first().copied().unwrap_or(1)).max(1);
    let mut inc = IncrementalText::default();
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + step).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        inc.push(t, &text[start..end]);
        start = end;
    }
    assert_eq!(inc.tokens(t), generated, "{text:?} in pieces of {step}");
    // the fewest spelling (what the cap is judged on): with the count, at most the count, and
    // additive across the streaming counter's cuts
    let (count, fewest) = t.count_generated_text_and_fewest(&text);
    assert_eq!(count, generated, "{text:?} (count beside the fewest)");
    assert!(fewest <= count, "{text:?}: fewest {fewest} > count {count}");
    assert_eq!(inc.fewest(t), fewest, "{text:?} fewest in pieces of {step}");
});
