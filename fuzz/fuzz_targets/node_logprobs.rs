//! The capture of a node's logprobs (design brief §10) over arbitrary bytes: the `logprobs`
//! member of a node's answer (`parse_node_logprobs`, and the bounded capture fed the same JSON
//! as stream chunks), then the alignment of its tokens against a delivered text. Errors or
//! tokens, never a panic; the capture never holds more than its bound; aligned positions are
//! the node's own tokens in order and spell a prefix of the text.
#![no_main]
use libfuzzer_sys::fuzz_target;
use spine_meter::audit::{align, parse_node_logprobs, NodeLogprobs, TokenVocabulary};

fuzz_target!(|bytes: &[u8]| {
    let max = usize::from(bytes.first().copied().unwrap_or(0) % 16);
    let parsed = parse_node_logprobs(bytes, max);
    if let Ok(tokens) = &parsed {
        assert!(tokens.len() <= max);
        assert!(tokens.iter().all(|t| t.logprob.is_finite() && t.logprob <= 0.0));
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
    // a vocabulary of every byte and a few pairs, the text the tokens' own bytes or not
    let vocab_tokens: Vec<String> = (0x21u8..0x7f).map(|b| char::from(b).to_string()).collect();
    let Ok(vocab) = TokenVocabulary::from_tokens("gpt2", &vocab_tokens, None) else {
        return;
    };
    let spelled: Vec<u8> = tokens.iter().flat_map(|t| t.bytes.clone()).collect();
    for text in [&spelled[..], bytes] {
        if let Ok(a) = align(&vocab, &tokens, text, 32) {
            assert_eq!(a.ids.len(), a.logprobs.len());
            assert!(a.ids.len() <= 32 && a.ids.len() <= tokens.len());
            let prefix: Vec<u8> = tokens[..a.ids.len()]
                .iter()
                .flat_map(|t| t.bytes.clone())
                .collect();
            assert!(text.starts_with(&prefix));
        }
    }
});
