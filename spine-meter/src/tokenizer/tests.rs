#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::fast::*;
use super::*;
use serde_json::json;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::utils::SysRegex;
use tokenizers::Tokenizer;

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

fn rule(max_tokens: Option<u64>, cap_tokens: u64) -> CompletionRule {
    CompletionRule {
        max_tokens,
        cap_tokens,
        completed: true,
    }
}

#[test]
fn tool_calls_and_reasoning_are_generated_text() {
    let t = tok();
    // a non-streamed message with reasoning and one tool call
    let mut g = GeneratedText::new();
    g.push_choice_json(&json!({"index":0,"finish_reason":"tool_calls","message":{
        "role":"assistant","content":null,"reasoning_content":"The user wants weather.",
        "tool_calls":[{"id":"c1","type":"function","function":{
            "name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]}}));
    let want = t.count_text("The user wants weather.")
        + t.count_text("get_weather")
        + t.count_text("{\"city\":\"Paris\"}");
    assert!(want > 10, "{want}");
    assert_eq!(t.count_generated(&g), want);
    assert_eq!(g.tool_call_count(), 1);
    assert_eq!(g.wrapper_allowance_tokens(), 24 + 8);
    // tool_calls finishes like stop: + EOS
    assert_eq!(
        t.bill_completion(&g, Some("tool_calls"), rule(Some(200), 200))
            .tokens,
        want + 1
    );

    // the same call streamed in pieces (name first, arguments split) counts the same
    let mut s = GeneratedText::new();
    for delta in [
        json!({"tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"get_weather","arguments":""}}]}),
        json!({"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]}),
        json!({"tool_calls":[{"index":0,"function":{"arguments":"\"Paris\"}"}}]}),
        json!({"reasoning_content":"The user "}),
        json!({"reasoning_content":"wants weather."}),
    ] {
        s.push_choice_json(&json!({"index":0,"delta":delta}));
    }
    assert_eq!(t.count_generated(&s), want);
    assert_eq!(s.len_bytes(), g.len_bytes());

    // two calls in one array without index: positions
    let mut two = GeneratedText::new();
    two.push_choice_json(&json!({"message":{"tool_calls":[
        {"function":{"name":"a","arguments":"{}"}},{"function":{"name":"b","arguments":"{}"}}]}}));
    assert_eq!(two.tool_call_count(), 2);
    // /v1/completions text
    let mut c = GeneratedText::new();
    c.push_choice_json(&json!({"index":0,"text":"Paris."}));
    assert_eq!(c.content(), "Paris.");
}

#[test]
fn the_length_rule_bills_the_delivered_text_plus_a_small_allowance() {
    let t = tok();
    let text = GeneratedText::from_content("1. Red\n2. Blue\n3. Green"); // 11 tokens, 23 bytes
    assert_eq!((t.count_generated(&text), text.len_bytes()), (11, 23));
    let bill = |finish: &str, r: CompletionRule| t.bill_completion(&text, Some(finish), r);
    // allowance 3 + max(2, L / 50): L up to 16 is billed L, never more than T + 5
    assert_eq!(length_allowance_tokens(16), 5);
    assert_eq!(length_allowance_tokens(1000), 23);
    for (l, billed) in [(11u64, 11u64), (12, 12), (16, 16), (20, 16), (26, 16)] {
        assert_eq!(
            bill("length", rule(Some(l), l)),
            CompletionCount {
                tokens: billed,
                text_tokens: 11,
                length_unsupported: false
            },
            "{l}"
        );
    }
    // more than the bytes (plus a held-back tail) could hold: flagged, and the text's count
    // alone (no allowance for a finish the text cannot support)
    assert_eq!(
        bill("length", rule(Some(27), 27)),
        CompletionCount {
            tokens: 11,
            text_tokens: 11,
            length_unsupported: true
        }
    );
    // a little fewer than the text's tokens (generated non-canonically): L
    assert_eq!(
        bill("length", rule(Some(9), 9)),
        CompletionCount {
            tokens: 9,
            text_tokens: 11,
            length_unsupported: false
        }
    );
    // far fewer (a node that ignored max_tokens): capped at L, flagged
    assert_eq!(
        bill("length", rule(Some(5), 5)),
        CompletionCount {
            tokens: 5,
            text_tokens: 11,
            length_unsupported: true
        }
    );
    // no max_tokens (the engine's own context may have stopped it): the text's count
    assert_eq!(bill("length", rule(None, 8000)).tokens, 11);
    // stop: + EOS under the cap, never over it
    assert_eq!(bill("stop", rule(Some(64), 64)).tokens, 12);
    assert_eq!(bill("stop", rule(Some(11), 11)).tokens, 11);
    // not completed: neither EOS nor the length rule
    let cut = CompletionRule {
        completed: false,
        ..rule(Some(20), 20)
    };
    assert_eq!(bill("length", cut).tokens, 11);
    assert_eq!(bill("stop", cut).tokens, 11);
    // a held-back tail: 3 bytes of text can stand for up to 6 tokens
    let short = GeneratedText::from_content("abc");
    assert!(
        !t.bill_completion(&short, Some("length"), rule(Some(6), 6))
            .length_unsupported
    );
    assert!(
        t.bill_completion(&short, Some("length"), rule(Some(7), 7))
            .length_unsupported
    );
}

#[test]
fn a_node_padding_a_length_finish_is_paid_for_the_text_not_max_tokens() {
    // issue 13: 1,000 × "x" with finish_reason length and max_tokens 1,000
    let t = tok();
    let padded = GeneratedText::from_content(&"x".repeat(1000));
    let text_tokens = t.count_generated(&padded);
    assert!(text_tokens < 300, "{text_tokens}");
    let bill = t.bill_completion(&padded, Some("length"), rule(Some(1000), 1000));
    assert_eq!(bill.tokens, text_tokens + length_allowance_tokens(1000));
    assert!(bill.tokens < 1000);
}

/// Feeds `text` to an [`IncrementalText`] in pieces cut at `cuts` (byte offsets, snapped to
/// character boundaries).
fn incremental(t: &ModelTokenizer, text: &str, cuts: &[usize]) -> IncrementalText {
    let mut inc = IncrementalText::default();
    let mut points: Vec<usize> = cuts
        .iter()
        .map(|&c| {
            let mut c = c % (text.len() + 1);
            while !text.is_char_boundary(c) {
                c -= 1;
            }
            c
        })
        .collect();
    points.push(0);
    points.push(text.len());
    points.sort_unstable();
    for w in points.windows(2) {
        inc.push(t, &text[w[0]..w[1]]);
        assert!(inc.tokens_upper_bound() >= inc.tokens(t));
    }
    inc
}

#[test]
fn incremental_counts_equal_the_whole_count_on_long_texts() {
    let t = tok();
    let mut texts = vec![
        "The quick brown fox jumps over the lazy dog. ".repeat(400),
        "fn main() {\n    println!(\"{}\", x[0]);\n}\n".repeat(300),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n".repeat(200),
        "it's don't we're I'll 12345 67.89 ".repeat(300),
        "日本語のテキスト、句読点。English mix 123 ".repeat(200),
        "x".repeat(20_000),
        "   \n\n\t  ".repeat(2000),
    ];
    // specials cut anywhere
    texts.push(format!(
        "{}<|im_end|>{}",
        "a".repeat(2040),
        "b".repeat(3000)
    ));
    for text in &texts {
        let whole = t.count_generated_text(text);
        for step in [1usize, 7, 100, 1500, 5000] {
            let cuts: Vec<usize> = (step..text.len()).step_by(step).collect();
            let inc = incremental(&t, text, &cuts);
            assert_eq!(inc.tokens(&t), whole, "step {step} on {:?}", &text[..40]);
            assert_eq!(
                inc.fewest(&t),
                t.count_generated_text_and_fewest(text).1,
                "step {step} on {:?}",
                &text[..40]
            );
            assert_eq!(inc.len_bytes(), text.len() as u64);
        }
    }
    // the uncounted tail stays bounded on text with cut points
    let mut inc = IncrementalText::default();
    for _ in 0..10_000 {
        inc.push(&t, "word, word. ");
    }
    assert!(inc.tail.len() <= INCREMENTAL_STEP_BYTES + INCREMENTAL_KEEP_BYTES + 12);
}

#[test]
fn tools_reach_the_template_and_count_when_it_uses_them() {
    let base = json!({"messages":[{"role":"user","content":"Weather in Paris?"}]});
    let mut with_tools = base.clone();
    with_tools["tools"] = json!([{"type":"function","function":{"name":"get_weather",
        "parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]);
    // SmolLM2's template ignores tools, and so does the engine (measured: same prompt_tokens)
    let t = tok();
    assert_eq!(
        t.count_prompt(&with_tools).unwrap(),
        t.count_prompt(&base).unwrap()
    );
    // a template that describes tools counts them
    let meta = crate::gguf::GgufMetadata::open(crate::test_support::model_gguf()).unwrap();
    let tooled = ModelTokenizer::from_gguf_metadata(&meta)
        .unwrap()
        .with_chat_template(
            "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}\
{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        )
        .unwrap();
    let rendered = tooled.render_chat(&with_tools).unwrap();
    assert!(rendered.contains("get_weather"), "{rendered}");
    let plain = tooled.count_prompt(&base).unwrap();
    assert_eq!(
        tooled.count_prompt(&with_tools).unwrap(),
        tooled.count_text(&rendered)
    );
    assert!(tooled.count_prompt(&with_tools).unwrap() > plain + 10);
}

/// The fast path against the full pipeline, twice (a cold and a warm cache).
fn assert_exact(t: &ModelTokenizer, text: &str) {
    let full = t.count_text_full(text);
    assert_eq!(t.count_text(text), full, "{text:?}");
    assert_eq!(t.count_text(text), full, "{text:?} (cached)");
}

#[test]
fn the_fast_path_is_taken_and_matches_the_byte_level_alphabet() {
    let t = tok();
    assert!(t.fast.is_some());
    let ours: std::collections::HashSet<char> = byte_level_chars().into_iter().collect();
    assert_eq!(ours, ByteLevel::alphabet().into_iter().collect());
    assert_eq!(byte_level_chars()[usize::from(b' ')], '\u{120}');
    assert_eq!(byte_level_chars()[usize::from(b'\n')], '\u{10a}');
    assert_eq!(byte_level_chars()[usize::from(b'a')], 'a');
}

#[test]
fn fast_counts_equal_encode_on_hand_picked_edges() {
    let t = tok();
    for text in [
        "Hello world 2024! \u{4f60}\u{597d} \u{1F642}",
        "<|im_start|>user<|im_end|>",
        "<|im_start|><|im_start|>x<|im_end",
        "<|im_",
        "a<|endoftext|>b",
        "It's, they're; we've I'm you'll he'd 'S 'RE ''s",
        "   leading and trailing   ",
        "tabs\t\tand\nnew\r\nlines\n\n\n",
        "\u{b}\u{c}\u{85}\u{a0}\u{2028}\u{3000} mixed spaces  \u{a0}x",
        "digits 12345 \u{663}\u{664} \u{bd} \u{216b} x2y 3.14",
        "\0\u{1f}\u{7f} controls",
        "e\u{301}cole \u{fb01}ne stra\u{df}e",
        "```rust\nfn main() { println!(\"{}\", 1 + 2); }\n```",
        " ",
        "\n",
        "a",
        "\u{1F642}\u{1F642}\u{1F642}",
    ] {
        assert_exact(&t, text);
    }
}

/// Every string inside a JSON value.
fn json_strings(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Array(a) => a.iter().for_each(|v| json_strings(v, out)),
        Value::Object(o) => o.iter().for_each(|(k, v)| {
            out.push(k.clone());
            json_strings(v, out);
        }),
        _ => {}
    }
}

fn fixture_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            fixture_files(&path, out);
        } else {
            out.push(path);
        }
    }
}

#[test]
fn fast_counts_equal_encode_on_every_fixture_text() {
    let t = tok();
    let mut files = Vec::new();
    fixture_files(&crate::test_support::fixtures_dir(), &mut files);
    fixture_files(std::path::Path::new("/work/shared/fixtures"), &mut files);
    assert!(files.len() >= 20, "{files:?}");
    let mut texts = 0usize;
    for path in files {
        let bytes = std::fs::read(&path).unwrap();
        let whole = String::from_utf8_lossy(&bytes).into_owned();
        let mut strings = vec![whole.clone()];
        strings.extend(whole.lines().map(str::to_owned));
        // the JSON bodies and SSE events: their string values (the texts metered)
        for line in whole.lines() {
            let data = line.strip_prefix("data: ").unwrap_or(line);
            if let Ok(v) = serde_json::from_str::<Value>(data) {
                json_strings(&v, &mut strings);
            }
        }
        if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
            json_strings(&v, &mut strings);
        }
        for s in &strings {
            assert_exact(&t, s);
        }
        texts += strings.len();
    }
    assert!(texts > 500, "{texts}");
}

#[test]
fn fast_counts_stay_exact_when_the_word_cache_starts_over() {
    let t = tok();
    // more distinct cacheable words than the cache holds, in one text and then again
    let words: Vec<String> = (0..WORD_CACHE_ENTRIES as u32 + 1000)
        .map(|mut i| {
            let mut w = String::from(" q");
            while i > 0 {
                w.push(char::from(b'a' + (i % 26) as u8));
                i /= 26;
            }
            w
        })
        .collect();
    let text = words.concat();
    assert_exact(&t, &text);
    assert!(t.fast.as_ref().unwrap().cache.read().unwrap().len() <= WORD_CACHE_ENTRIES);
    assert_exact(&t, &words[..500].concat());
}

/// Pieces that exercise every branch of the split: special tokens and their prefixes, all
/// kinds of whitespace, contractions, numerics of every script, letters, marks, emoji,
/// punctuation and control characters.
const PIECES: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_",
    "<",
    "|>",
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\u{b}",
    "\u{c}",
    "\u{85}",
    "\u{a0}",
    "\u{2028}",
    "\u{3000}",
    "\u{1c}",
    "'s",
    "'S",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'",
    "0",
    "42",
    "\u{663}",
    "\u{bd}",
    "\u{216b}",
    "\u{2460}",
    "a",
    "Hello",
    " world",
    "\u{e9}",
    "e\u{301}",
    "\u{4f60}\u{597d}",
    "\u{df}",
    "\u{1F642}",
    "!",
    "...",
    "\u{2014}",
    "{\"",
    "\0",
    "\u{7f}",
    "\u{fffd}",
    "_",
];

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

    #[test]
    fn fast_counts_equal_encode_on_arbitrary_strings(text in proptest::prelude::any::<String>()) {
        let t = tok();
        let full = t.count_text_full(&text);
        proptest::prop_assert_eq!(t.count_text(&text), full);
        proptest::prop_assert_eq!(t.count_text(&text), full);
    }

    #[test]
    fn incremental_counts_equal_the_whole_count(
        parts in proptest::collection::vec("[ -~\n\t'é日0-9<|>_]{0,600}", 1..12),
    ) {
        let t = tok();
        let whole: String = parts.concat();
        let mut inc = IncrementalText::default();
        for p in &parts {
            inc.push(&t, p);
        }
        proptest::prop_assert_eq!(inc.tokens(&t), t.count_generated_text(&whole), "{:?}", parts);
        // the fewest spelling is additive at the same cuts, and at most the count
        let (count, fewest) = t.count_generated_text_and_fewest(&whole);
        proptest::prop_assert_eq!(count, t.count_generated_text(&whole));
        proptest::prop_assert!(fewest <= count);
        proptest::prop_assert_eq!(inc.fewest(&t), fewest, "{:?}", parts);
        proptest::prop_assert!(inc.fewest_upper_bound() >= fewest);
    }

    #[test]
    fn the_ascii_split_is_the_regex_split(text in "[\\x00-\\x7f]{0,64}") {
        let regex = SysRegex::new(BYTE_LEVEL_PATTERN).unwrap();
        let want: Vec<(usize, usize)> = regex.find_iter(&text).collect();
        let mut got = Vec::new();
        let mut p = 0;
        while p < text.len() {
            let e = ascii_match_end(text.as_bytes(), p);
            got.push((p, e));
            p = e;
        }
        proptest::prop_assert_eq!(got, want);
    }

    #[test]
    fn fast_counts_equal_encode_on_ascii(text in "[\\x00-\\x7f]{0,200}") {
        let t = tok();
        let full = t.count_text_full(&text);
        proptest::prop_assert_eq!(t.count_text(&text), full);
        proptest::prop_assert_eq!(t.count_text(&text), full);
    }

    /// The `gpt-2` pre-tokenizer (no `Digits` split): the same vocabulary with `ByteLevel`
    /// alone, against a fast counter without the digit split.
    #[test]
    fn fast_counts_equal_encode_without_the_digit_split(
        picks in proptest::collection::vec(0..PIECES.len(), 0..48),
        tail in "[ -~\\n]{0,24}",
    ) {
        static GPT2: std::sync::OnceLock<(Tokenizer, FastCounter)> = std::sync::OnceLock::new();
        let (tokenizer, fast) = GPT2.get_or_init(|| {
            let t = tok();
            let mut tokenizer = t.tokenizer.clone();
            tokenizer.with_pre_tokenizer(Some(PreTokenizerWrapper::from(
                ByteLevel::new(false, true, true),
            )));
            let specials = t.fast.as_ref().unwrap().specials.clone();
            assert!(specials.iter().any(|s| s == "<|im_start|>"));
            assert!(matches!(
                tokenizer.get_pre_tokenizer(),
                Some(PreTokenizerWrapper::ByteLevel(_))
            ));
            (tokenizer, FastCounter::new(specials, false).unwrap())
        });
        let text = picks.iter().map(|&i| PIECES[i]).collect::<String>() + &tail;
        let full = tokenizer.encode_fast(text.as_str(), false).unwrap().len() as u64;
        let got = if text.is_empty() { 0 } else { fast.count(tokenizer.get_model(), &text, true).unwrap() };
        proptest::prop_assert_eq!(got, full);
    }

    #[test]
    fn fast_counts_equal_encode_on_tricky_concatenations(
        picks in proptest::collection::vec(0..PIECES.len(), 0..48)
    ) {
        let t = tok();
        let text: String = picks.iter().map(|&i| PIECES[i]).collect();
        let full = t.count_text_full(&text);
        proptest::prop_assert_eq!(t.count_text(&text), full);
        proptest::prop_assert_eq!(t.count_text(&text), full);
    }
}

/// REVIEW: characters of every class the split cares about, drawn from the whole of Unicode.
fn unicode_class_alphabet() -> &'static Vec<String> {
    static A: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    A.get_or_init(|| {
        let mut out: Vec<String> = Vec::new();
        for cp in 0u32..=0x10FFFF {
            let Some(c) = char::from_u32(cp) else {
                continue;
            };
            if c.is_numeric() || c.is_whitespace() || c.is_control() && cp < 0x100 {
                out.push(c.to_string());
            }
        }
        for c in [
            'a',
            'Z',
            'é',
            'ß',
            'ǅ',
            'ﬁ',
            '한',
            '中',
            'ا',
            'ש',
            '\'',
            '’',
            '"',
            '-',
            '—',
            '…',
            '\u{200d}',
            '\u{200c}',
            '\u{feff}',
            '\u{ad}',
            '\u{fffd}',
            '\u{fe0f}',
            '\u{e000}',
            '\u{ffff}',
            '\u{10ffff}',
            '\u{301}',
            '\u{0345}',
            '\u{1F469}',
            '\u{1F3FD}',
            's',
            't',
            'r',
            'e',
            'v',
            'l',
            'm',
            'd',
            'S',
            '<',
            '|',
            '>',
            '_',
            '\u{16EE}',
            '\u{2160}',
            '\u{3007}',
            '\u{1D7CE}',
            '\u{FF10}',
            '\u{0E50}',
        ] {
            out.push(c.to_string());
        }
        for s in [
            "<|im_start|>",
            "<|im_end|>",
            "<|endoftext|>",
            "<|im_",
            "<|",
            "|>",
            "<|im_start",
            "'s",
            "'ll",
            "'re",
            "  ",
            "\r\n",
            " \n",
            "\n\n",
        ] {
            out.push(s.to_owned());
        }
        out
    })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(
        1_000))]

    #[test]
    fn fast_equals_full_on_every_unicode_class(
        picks in proptest::collection::vec(proptest::prelude::any::<proptest::sample::Index>(), 0..80)
    ) {
        let a = unicode_class_alphabet();
        let text: String = picks.iter().map(|i| a[i.index(a.len())].as_str()).collect();
        let t = tok();
        let full = t.count_text_full(&text);
        proptest::prop_assert_eq!(t.count_text(&text), full, "{:?}", text);
        proptest::prop_assert_eq!(t.count_text(&text), full, "{:?}", text);
    }
}

#[test]
fn fast_equals_full_on_long_runs() {
    let t = tok();
    let mut texts: Vec<String> = vec![
        " ".repeat(300_000),
        "\n".repeat(100_000) + "x",
        "x".to_owned() + &" \t".repeat(100_000),
        "7".repeat(200_000),
        "a".repeat(200_000),
        "\u{663}".repeat(50_000),
        "\u{3000}".repeat(50_000) + "a",
        "<|im_start|>".repeat(20_000),
        "<|im_".repeat(40_000),
        "'s".repeat(50_000),
        "\u{1F642}".repeat(50_000),
        "e\u{301}".repeat(50_000),
    ];
    let mut mixed = String::new();
    for i in 0..30_000u32 {
        mixed.push_str(&format!(
            " w{i}x{}\u{a0}{}",
            i % 7,
            char::from_u32(0x4e00 + i % 5000).unwrap()
        ));
    }
    texts.push(mixed);
    for text in &texts {
        let started = std::time::Instant::now();
        let fast = t.count_text(text);
        let fast_took = started.elapsed();
        let started = std::time::Instant::now();
        let full = t.count_text_full(text);
        let full_took = started.elapsed();
        eprintln!(
            "len {} fast {fast} ({fast_took:?}) full {full} ({full_took:?})",
            text.len()
        );
        assert_eq!(fast, full, "{:?}", &text[..text.len().min(40)]);
    }
}

#[test]
fn concurrent_counts_stay_exact() {
    let t = tok();
    let texts: Vec<String> = (0..8)
        .map(|k| {
            (0..20_000u32)
                .map(|i| {
                    let mut n = i * 7919 % 100_003 + k;
                    let mut w = String::from(" t");
                    while n > 0 {
                        w.push(char::from(b'a' + (n % 26) as u8));
                        n /= 26;
                    }
                    w
                })
                .collect()
        })
        .collect();
    let want: Vec<u64> = texts.iter().map(|s| t.count_text_full(s)).collect();
    std::thread::scope(|scope| {
        for (s, w) in texts.iter().zip(&want) {
            let t = t.clone();
            scope.spawn(move || {
                for _ in 0..3 {
                    assert_eq!(t.count_text(s), *w);
                }
            });
        }
    });
}

#[test]
fn one_text_cannot_flush_the_word_cache() {
    let t = ModelTokenizer::from_gguf(crate::test_support::model_gguf()).unwrap();
    let fast = t.fast.as_ref().unwrap();
    t.count_text(
        &(0..20_000u32)
            .map(|mut i| {
                let mut w = String::from(" q");
                while i > 0 {
                    w.push(char::from(b'a' + (i % 26) as u8));
                    i /= 26;
                }
                w
            })
            .collect::<String>(),
    );
    let before = fast.cache.read().unwrap().len();
    t.count_text(&" zyxwq".repeat(70_000));
    let after = fast.cache.read().unwrap().len();
    assert!(
        after >= before,
        "one request emptied the shared cache: {before} -> {after}"
    );
    // a text of many new words adds at most its share, evicting no more than that
    t.count_text(
        &(0..100_000u32)
            .map(|i| format!(" z{i}q"))
            .collect::<String>(),
    );
    let later = fast.cache.read().unwrap().len();
    assert!(later >= before, "{before} -> {later}");
    assert!(later <= WORD_CACHE_ENTRIES);
}

#[test]
fn counting_within_a_limit_is_exact_when_whole_and_stops_early_past_it() {
    let t = tok();
    // texts of several shapes and sizes: words, code-like text, CJK, one long word
    let texts = [
        "The quick brown fox jumps over the lazy dog. ".repeat(6000),
        "fn main() { let x = 42; println!(\"{x}\"); }\n".repeat(5000),
        "日本語のテキスト、".repeat(20_000),
        "x".repeat(300_000),
        "short".to_owned(),
    ];
    for text in &texts {
        let exact = t.count_text(text);
        // a limit at or above the count: the whole is counted, exactly
        assert_eq!(count_text_within(&*t, text, exact), Counted::Exact(exact));
        assert_eq!(
            count_text_within(&*t, text, u64::MAX),
            Counted::Exact(exact)
        );
        // a limit below: stops with a lower bound above the limit (or the exact count)
        for limit in [0, 10, exact / 3, exact.saturating_sub(1)] {
            if limit >= exact {
                continue;
            }
            match count_text_within(&*t, text, limit) {
                Counted::AtLeast(n) => assert!(n > limit && n <= exact, "{n} {limit} {exact}"),
                Counted::Exact(n) => assert_eq!(n, exact),
            }
        }
    }
}

#[test]
fn a_prompt_far_over_the_limit_is_refused_after_one_piece_at_most() {
    // a counter that counts how many bytes it tokenized
    #[derive(Debug)]
    struct Spy(
        std::sync::Arc<ModelTokenizer>,
        std::sync::atomic::AtomicUsize,
    );
    impl TokenCounter for Spy {
        fn count_prompt(&self, body: &serde_json::Value) -> Result<u64, TokenizerError> {
            self.0.count_prompt(body)
        }
        fn count_text(&self, text: &str) -> u64 {
            self.1
                .fetch_add(text.len(), std::sync::atomic::Ordering::Relaxed);
            self.0.count_text(text)
        }
        fn max_token_bytes(&self) -> u64 {
            self.0.max_token_bytes()
        }
        fn stable_cut(&self, text: &str, keep: usize, scanned: usize) -> Option<usize> {
            self.0.stable_cut(text, keep, scanned)
        }
    }
    let spy = Spy(tok(), std::sync::atomic::AtomicUsize::new(0));
    let text = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. ".repeat(73_000); // ~4 MiB
    let got = count_text_within(&spy, &text, 8192);
    assert!(matches!(got, Counted::AtLeast(n) if n > 8192), "{got:?}");
    let tokenized = spy.1.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        tokenized <= 2 * COUNT_PIECE_BYTES,
        "tokenized {tokenized} bytes of {}",
        text.len()
    );
}

/// A token's text is what it decodes to alone (a leading space included); a special token or
/// a byte-fallback piece that is not whole UTF-8 has none (the meter then keeps the byte bound
/// for a `logit_bias` on it).
#[test]
fn a_token_text_is_its_decoded_piece() {
    let t = tok();
    let ids = t
        .tokenizer
        .encode(" the", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(
        TokenCounter::token_text(&*t, ids[0]).as_deref(),
        Some(" the")
    );
    let end = t.tokenizer.token_to_id("<|im_end|>").unwrap();
    assert_eq!(TokenCounter::token_text(&*t, end), None);
    let half = t
        .tokenizer
        .encode("\u{1d11e}", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert!(half.len() > 1, "{half:?}");
    assert_eq!(TokenCounter::token_text(&*t, half[0]), None, "{half:?}");
    assert_eq!(TokenCounter::token_text(&*t, u32::MAX), None);
}

/// An engine samples tokens, not BPE's spelling: `"ell"` (token 478) repeated is what a
/// caller's `logit_bias {"478": 13}` makes llama.cpp write (the attacker's case), one token per
/// `ell` generated, about 1.5 per `ell` counted. The fewest spelling finds the engine's count
/// (at most), so the meter can tell such text from a node that generated past its cap.
#[test]
fn the_fewest_spelling_is_at_most_what_the_engine_generated() {
    let t = tok();
    assert_eq!(t.tokenizer.token_to_id("ell"), Some(478));
    let text = "ell".repeat(200);
    let (count, fewest) = t.count_generated_text_and_fewest(&text);
    assert!(count >= 280, "{count}");
    assert!(fewest <= 200, "{fewest}");
    // BPE's spelling of ordinary text is already the fewest, or nearly
    let prose = "The quick brown fox jumps over the lazy dog, and it's 12 o'clock. ".repeat(20);
    let (count, fewest) = t.count_generated_text_and_fewest(&prose);
    assert!(
        fewest <= count && fewest * 100 >= count * 95,
        "{count} {fewest}"
    );
    // a split longer than the exact search gets the weaker bound: still at most the count
    let long = "ell".repeat(2000);
    let (count, fewest) = t.count_generated_text_and_fewest(&long);
    assert!((1..=2000).contains(&fewest), "{count} {fewest}");
    // the streamed count agrees, whatever the pieces
    let inc = incremental(&t, &text, &(1..text.len()).step_by(5).collect::<Vec<_>>());
    assert_eq!(inc.fewest(&t), t.count_generated_text_and_fewest(&text).1);
}
