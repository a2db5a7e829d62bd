//! The capture of a node's logprobs (design brief §10) over arbitrary bytes: the `logprobs`
//! member of a node's answer (`parse_node_logprobs`, and the bounded capture fed the same JSON
//! as stream chunks), then the alignment of its tokens against a delivered text. Errors or
//! tokens, never a panic; the capture never holds more than its bound; aligned tokens are at
//! most the bound, a claim only on whole-character tokens, and the entries they come from spell
//! a prefix of the text (as `covered_bytes` counts it). The auditor's judgment of the capture
//! (`judge_node_list`, a list in another vocabulary read by its bytes included) keeps the same
//! bounds.
#![no_main]
use libfuzzer_sys::fuzz_target;
use spine_meter::audit::node_logprobs::{covered_bytes, honest_tail, AlignedTokens};
use spine_meter::audit::{
    align, judge_node_list, parse_node_logprobs, NodeList, NodeLogprobs, TokenVocabulary,
};

/// What every aligned list keeps: one claim slot per token, at most `max` tokens, a claim only
/// on a whole-character token of the vocabulary.
fn check(vocab: &TokenVocabulary, a: &AlignedTokens, max: usize) {
    assert_eq!(a.tokens.len(), a.logprobs.len());
    assert!(a.tokens.len() <= max);
    for (t, lp) in a.tokens.iter().zip(&a.logprobs) {
        assert_eq!(t.scored, lp.is_some());
        assert!(!(t.scored && t.split));
        assert!(vocab.bytes(t.id).is_some());
    }
}

fuzz_target!(|bytes: &[u8]| {
    let max = usize::from(bytes.first().copied().unwrap_or(0) % 16);
    let parsed = parse_node_logprobs(bytes, max);
    if let Ok(tokens) = &parsed {
        assert!(tokens.len() <= max);
        assert!(tokens
            .iter()
            .all(|t| t.logprob.is_finite() && t.logprob <= 0.0));
    }
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) {
        let mut capture = NodeLogprobs::new(max);
        capture.push(Some(&v));
        capture.push(Some(&v));
        assert!(capture.tokens.len() <= max);
    }
    let Ok(tokens) = parse_node_logprobs(bytes, 64) else {
        return;
    };
    // a vocabulary of every printable ASCII byte and a few pairs, the text the tokens' own
    // bytes or not
    // (GPT-2's alphabet: "ä" is byte E4, "¸" B8, "ä¸" both: the first two bytes of "中")
    let mut vocab_tokens: Vec<String> = (0x21u8..0x7f).map(|b| char::from(b).to_string()).collect();
    vocab_tokens.extend(["ä", "¸", "ä¸", "ab"].map(String::from));
    let Ok(vocab) = TokenVocabulary::from_tokens("gpt2", &vocab_tokens, None) else {
        return;
    };
    let spelled: Vec<u8> = tokens.iter().flat_map(|t| t.bytes.clone()).collect();
    for text in [&spelled[..], bytes] {
        let covered = covered_bytes(&tokens, text);
        if let Ok(c) = covered {
            assert!(c <= text.len());
            let _ = honest_tail(&text[c..], usize::from(text.len() % 4), &vocab);
        }
        let aligned = align(&vocab, &tokens, text, 32);
        // bytes that spell the text fail alignment only through an id that does not read
        assert!(aligned.is_ok() || covered.is_err() || tokens.iter().any(|t| t.id.is_some()));
        if let Ok(a) = &aligned {
            check(&vocab, a, 32);
        }
        let mut capture = NodeLogprobs::new(64);
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) {
            capture.push(Some(&v));
        }
        match judge_node_list(&vocab, &capture, text, bytes, 32) {
            NodeList::Aligned(a) => check(&vocab, &a, 32),
            NodeList::Foreign { by_bytes, .. } => {
                check(&vocab, &by_bytes, 32);
                assert!(by_bytes.scored() > 0);
                assert!(aligned.is_err());
            }
            _ => {}
        }
    }
});
