#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;

fn vocab() -> TokenVocabulary {
    let tokens: Vec<String> = ["Hello", "Ġworld", "!", "<|im_end|>", "Ċ", "é"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    TokenVocabulary::from_tokens("gpt2", &tokens, Some(&[1, 1, 1, 3, 1, 1])).unwrap()
}

#[test]
fn gpt2_alphabet_decodes_space_newline_and_high_bytes() {
    assert_eq!(gpt2_bytes("Ġworld").unwrap(), b" world");
    assert_eq!(gpt2_bytes("Ċ").unwrap(), b"\n");
    // "é" is U+00E9, printable in the alphabet: byte 0xE9
    assert_eq!(gpt2_bytes("é").unwrap(), vec![0xe9]);
    assert_eq!(gpt2_bytes("Ã©").unwrap(), "é".as_bytes());
    assert_eq!(spm_bytes("▁the").unwrap(), b" the");
    assert_eq!(spm_bytes("<0x0A>").unwrap(), b"\n");
}

#[test]
fn vocabulary_keeps_normal_tokens_only() {
    let v = vocab();
    assert_eq!(v.id(b"Hello"), Some(0));
    assert_eq!(v.id(b" world"), Some(1));
    assert_eq!(v.id(b"<|im_end|>"), None);
    assert_eq!(v.id(b"\n"), Some(4));
}

#[test]
fn parses_chat_and_legacy_shapes() {
    let chat = br#"{"content":[{"id":0,"token":"Hello","bytes":[72,101,108,108,111],"logprob":-0.5,"top_logprobs":[]},{"token":" world","logprob":0.0001}]}"#;
    let t = parse_node_logprobs(chat, 10).unwrap();
    assert_eq!(t.len(), 2);
    assert_eq!(t[0].bytes, b"Hello");
    assert_eq!(t[0].id, Some(0));
    assert_eq!(t[1].logprob, 0.0);
    assert_eq!(parse_node_logprobs(chat, 1).unwrap().len(), 1);
    let legacy = br#"{"tokens":["Hello"," world"],"token_logprobs":[-1.0,-2.0]}"#;
    let t = parse_node_logprobs(legacy, 10).unwrap();
    assert_eq!(t[1].bytes, b" world");
    assert_eq!(t[1].logprob, -2.0);
    assert_eq!(parse_node_logprobs(b"null", 10).unwrap(), vec![]);
    for bad in [
        &br#"{"content":[{"token":"a","logprob":0.5}]}"#[..],
        br#"{"content":[{"token":"a"}]}"#,
        br#"{"content":[{"logprob":-1}]}"#,
        br#"{"content":[{"token":"a","bytes":[256],"logprob":-1}]}"#,
        br#"{"tokens":["a"],"token_logprobs":[]}"#,
        br#"[1]"#,
        b"{",
    ] {
        assert!(parse_node_logprobs(bad, 10).is_err(), "{:?}", bad);
    }
}

fn tok(s: &str, lp: f64) -> NodeToken {
    NodeToken {
        bytes: s.as_bytes().to_vec(),
        logprob: lp,
        id: None,
    }
}

fn ids(a: &AlignedTokens) -> Vec<u32> {
    a.tokens.iter().map(|t| t.id).collect()
}

#[test]
fn align_maps_and_stops_at_unmappable_or_cut_tokens() {
    let v = vocab();
    let toks = [tok("Hello", -0.1), tok(" world", -0.2), tok("!\n", -0.3)];
    let a = align(&v, &toks, b"Hello world!\n", 10).unwrap();
    assert_eq!(ids(&a), vec![0, 1]);
    assert_eq!(a.logprobs, vec![Some(-0.1), Some(-0.2)]);
    assert!(a.tokens.iter().all(|t| t.scored && !t.split));
    // cut by the capture cap
    let a = align(&v, &toks, b"Hello wor", 10).unwrap();
    assert_eq!(ids(&a), vec![0]);
    // an empty entry without an id (legacy shape) stops
    let a = align(&v, &[tok("", -1.0), tok("Hello", -0.1)], b"Hello", 10).unwrap();
    assert!(a.tokens.is_empty());
    // a claimed id whose bytes are not the entry's: the last entry stops
    let mut t = tok("Hello", -0.1);
    t.id = Some(1);
    assert!(align(&v, &[t], b"Hello", 10).unwrap().tokens.is_empty());
    assert_eq!(align(&v, &toks, b"Hello there", 10), Err(Misaligned(5)));
    assert_eq!(
        ids(&align(&v, &toks, b"Hello world!\n", 1).unwrap()),
        vec![0]
    );
}

/// GPT-2's alphabet text of `bytes` (the inverse of [`gpt2_bytes`]).
fn gpt2_text(bytes: &[u8]) -> String {
    let printable = |b: u8| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    bytes
        .iter()
        .map(|&b| {
            if printable(b) {
                char::from(b)
            } else {
                let n = (0u8..=255).filter(|x| !printable(*x)).position(|x| x == b);
                char::from_u32(256 + u32::try_from(n.unwrap()).unwrap()).unwrap()
            }
        })
        .collect()
}

/// Ids: 0 "Hello", 1 " world", 2 "!", 3 `<|im_end|>` (control), 4 [E4 B8], 5 [AD],
/// 6 [E4], 7 [B8], 8 [F0 9F], 9 [98], 10 [F0], 11 [9F 98], 12 [80], 13 "中" (E4 B8 AD),
/// 14 " a", 15 "a" (and a second "a": 16, shared).
fn split_vocab() -> TokenVocabulary {
    let bytes: [&[u8]; 17] = [
        b"Hello",
        b" world",
        b"!",
        b"<|im_end|>",
        &[0xe4, 0xb8],
        &[0xad],
        &[0xe4],
        &[0xb8],
        &[0xf0, 0x9f],
        &[0x98],
        &[0xf0],
        &[0x9f, 0x98],
        &[0x80],
        "中".as_bytes(),
        b" a",
        b"a",
        b"a",
    ];
    let tokens: Vec<String> = bytes.iter().map(|b| gpt2_text(b)).collect();
    let mut types = vec![1i64; tokens.len()];
    types[3] = 3;
    TokenVocabulary::from_tokens("gpt2", &tokens, Some(&types)).unwrap()
}

fn entry(bytes: &[u8], id: u64, lp: f64) -> NodeToken {
    NodeToken {
        bytes: bytes.to_vec(),
        logprob: lp,
        id: Some(id),
    }
}

#[test]
fn vocabulary_knows_each_ids_bytes() {
    let v = split_vocab();
    assert_eq!(v.bytes(4), Some(&[0xe4, 0xb8][..]));
    assert_eq!(v.bytes(3), None); // control
    assert_eq!(v.bytes(17), None); // out of range
    assert_eq!(v.max_token_bytes(), 6); // " world": the control token is not kept
    assert_eq!(v.id(b"a"), Some(15));
}

#[test]
fn align_goes_on_past_a_character_split_across_tokens() {
    let v = split_vocab();
    let text = "Hello中 world!".as_bytes();
    // llama.cpp: [E4 B8] held back, [AD] listed with the bytes of both
    let toks = [
        entry(b"Hello", 0, -0.1),
        entry("中".as_bytes(), 5, -0.7),
        entry(b" world", 1, -0.2),
        entry(b"!", 2, -0.3),
    ];
    let a = align(&v, &toks, text, 10).unwrap();
    // the fewest-token split of the prefix [E4 B8] is the one token 4, not 6 + 7
    assert_eq!(ids(&a), vec![0, 4, 5, 1, 2]);
    assert_eq!(
        a.logprobs,
        vec![Some(-0.1), None, None, Some(-0.2), Some(-0.3)]
    );
    assert_eq!(a.scored(), 3);
    let split: Vec<bool> = a.tokens.iter().map(|t| t.split).collect();
    assert_eq!(split, vec![false, true, true, false, false]);
    // the positions bound counts the held token too: the entry is not taken in part
    assert_eq!(ids(&align(&v, &toks, text, 2).unwrap()), vec![0]);
    // the character as one token: scored
    let toks = [entry(b"Hello", 0, -0.1), entry("中".as_bytes(), 13, -0.7)];
    let a = align(&v, &toks, "Hello中".as_bytes(), 10).unwrap();
    assert_eq!(a.logprobs, vec![Some(-0.1), Some(-0.7)]);
    // without the token [E4 B8], the prefix's one split is two byte tokens
    let toks = [entry("中".as_bytes(), 5, -0.7), entry(b"!", 2, -0.3)];
    let mut v2 = split_vocab();
    v2.by_bytes.remove(&vec![0xe4, 0xb8]);
    let a = align(&v2, &toks, "中!".as_bytes(), 10).unwrap();
    assert_eq!(ids(&a), vec![6, 7, 5, 2]);
    assert_eq!(a.scored(), 1);
}

#[test]
fn align_stops_where_the_held_tokens_are_not_known() {
    let v = split_vocab();
    let text = "😀 world".as_bytes(); // F0 9F 98 80
                                      // [F0 9F] + [98] or [F0] + [9F 98]: two splits of two tokens, none of one: stop
    let toks = [entry("😀".as_bytes(), 12, -0.5), entry(b" world", 1, -0.2)];
    assert!(align(&v, &toks, text, 10).unwrap().tokens.is_empty());
    // a prefix that is no token
    let text = "x中!".as_bytes();
    let toks = [entry("x中".as_bytes(), 5, -0.5), entry(b"!", 2, -0.2)];
    assert!(align(&v, &toks, text, 10).unwrap().tokens.is_empty());
    // a prefix ending at a character boundary: llama.cpp would have listed it, so before the
    // last entry it is not what llama.cpp sends; as the last, alignment stops there
    let toks = [entry(b"Hello world", 1, -0.5), entry(b"!", 2, -0.1)];
    assert_eq!(align(&v, &toks, b"Hello world!", 10), Err(Misaligned(0)));
    let toks = [entry(b"!", 2, -0.1), entry(b"Hello world", 1, -0.5)];
    assert_eq!(
        ids(&align(&v, &toks, b"!Hello world", 10).unwrap()),
        vec![2]
    );
    // an id whose bytes do not end the entry, an id out of range, a control token: the
    // last entry stops alignment (a stop word's token, the end of generation), an earlier
    // one is not what llama.cpp sends
    for id in [2, 99, 3, u64::MAX] {
        let toks = [entry(b"Hello", 0, -0.1), entry(b" world", id, -0.5)];
        let a = align(&v, &toks, b"Hello world", 10).unwrap();
        assert_eq!(ids(&a), vec![0], "id {id}");
        let toks = [entry(b"Hello", id, -0.1), entry(b" world", 1, -0.5)];
        assert_eq!(
            align(&v, &toks, b"Hello world", 10),
            Err(Misaligned(0)),
            "id {id}"
        );
    }
    // a byte string two ids share, without the node's id: stop
    let a = align(&v, &[tok("a", -0.1)], b"a", 10).unwrap();
    assert!(a.tokens.is_empty());
    // with its id: that id
    let a = align(&v, &[entry(b"a", 16, -0.1)], b"a", 10).unwrap();
    assert_eq!(ids(&a), vec![16]);
}

#[test]
fn align_scores_tokens_a_partial_stop_string_held() {
    let v = split_vocab();
    // "Hello" held (an empty entry: " wo…" could start a stop word), then " world" with both
    let toks = [
        entry(b"", 0, -0.1),
        entry(b"Hello world", 1, -0.2),
        entry(b"", 3, -0.01), // end of generation: stops
    ];
    let a = align(&v, &toks, b"Hello world", 10).unwrap();
    assert_eq!(ids(&a), vec![0, 1]);
    assert_eq!(a.logprobs, vec![Some(-0.1), Some(-0.2)]);
    // the held token's bytes are not the prefix: stop
    let toks = [entry(b"", 2, -0.1), entry(b"Hello world", 1, -0.2)];
    assert!(align(&v, &toks, b"Hello world", 10)
        .unwrap()
        .tokens
        .is_empty());
    // an empty entry of a control token or an unknown id: the last one ends alignment
    // (the end of generation), an earlier one is not what llama.cpp sends
    for id in [3, 99] {
        let toks = [entry(b"Hello", 0, -0.2), entry(b"", id, -0.1)];
        assert_eq!(ids(&align(&v, &toks, b"Hello", 10).unwrap()), vec![0]);
        let toks = [entry(b"", id, -0.1), entry(b"Hello", 0, -0.2)];
        assert_eq!(align(&v, &toks, b"Hello", 10), Err(Misaligned(0)));
    }
}

#[test]
fn coverage_counts_what_the_list_spells() {
    let toks = [tok("Hello", -0.1), tok(" world", -0.2)];
    assert_eq!(covered_bytes(&toks, b"Hello world!"), Ok(11));
    assert_eq!(covered_bytes(&toks[..1], b"Hello world!"), Ok(5)); // stops early
    assert_eq!(covered_bytes(&[], b"Hello"), Ok(0)); // empty list
    assert_eq!(covered_bytes(&toks, b"Hello wo"), Ok(8)); // spells more: the cap cut
    assert_eq!(covered_bytes(&toks, b"Hello there"), Err(Misaligned(5)));
    let empty = [tok("", -0.1), tok("Hello", -0.1)];
    assert_eq!(covered_bytes(&empty, b"Hello"), Ok(5));
    // a stray continuation byte, delivered as U+FFFD
    let stray = [tok("Hello", -0.1), entry(&[0xad], 5, -3.0), tok("!", -0.1)];
    let text = "Hello\u{fffd}!".as_bytes();
    assert_eq!(covered_bytes(&stray, text), Ok(text.len()));
    assert_eq!(covered_bytes(&stray, b"Hello!"), Err(Misaligned(5)));
    let v = split_vocab();
    let a = align(&v, &stray, text, 10).unwrap();
    assert_eq!(ids(&a), vec![0, 5, 2]);
    assert_eq!(a.logprobs, vec![Some(-0.1), None, Some(-0.1)]);
}

#[test]
fn an_honest_tail_is_a_token_held_behind_an_incomplete_character_or_within_the_stop_words_slack() {
    // tokens that end in a byte beginning no whole character: "\xF0", " \xD0", "abcdefghi\xC3"
    let tokens: Vec<String> = [
        "ð",
        "ĠÐ",
        "abcdefghiÃ",
        "s",
        "Hello",
        "Ġworld",
        "0123456789",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let v = TokenVocabulary::from_tokens("gpt2", &tokens, None).unwrap();
    assert_eq!(v.max_token_bytes(), 10);
    assert!(v.begins_broken_token(b"") && v.begins_broken_token(b" "));
    assert!(v.begins_broken_token(b"abcdefghi") && !v.begins_broken_token(b"Hello"));
    let honest = |tail: &str| honest_tail(tail.as_bytes(), 0, &v);
    assert!(honest(""));
    assert!(honest("\u{fffd}"));
    assert!(honest("\u{fffd}\u{fffd}\u{fffd}"));
    // a lone lead byte sampled, then a token or two while it stays among the last 3 bytes:
    // "\xF0ab" is incomplete for llama.cpp (`validate_utf8`), JSON delivers "\u{fffd}ab"
    assert!(honest("\u{fffd}ab"));
    assert!(honest("\u{fffd}é"));
    assert!(honest(" \u{fffd}x"));
    // the held tokens: one of at most 10 raw bytes and 2 bytes more (a U+FFFD counted as one)
    assert!(honest(&"\u{fffd}".repeat(12)));
    assert!(!honest(&"\u{fffd}".repeat(13)));
    assert!(honest("abcdefghi\u{fffd}xy"));
    assert!(!honest("abcdefghi\u{fffd}xyz"));
    // text before the U+FFFD that no token begins with before a broken byte
    assert!(!honest("xyz\u{fffd}"));
    // the chat answer dropped the incomplete sequence (" \xD0" delivered as " "): what is left
    // is the held token's bytes before it
    assert!(honest(" "));
    assert!(honest("abcdefghi"));
    assert!(!honest(" world"));
    assert!(!honest("x"));
    assert!(!honest_tail(&[0xf0, b'a'], 0, &v));
    // a stop word of 2 bytes, tokens of at most 10: (2 + 2) * 10 + 2 + 3 = 45 bytes
    assert!(honest_tail(&[b'x'; 45], 2, &v));
    assert!(!honest_tail(&[b'x'; 46], 2, &v));
    assert_eq!(longest_stop_bytes(br#"{"stop":"\n\n"}"#), 2);
    assert_eq!(longest_stop_bytes(br#"{"stop":["a","END"]}"#), 3);
    assert_eq!(longest_stop_bytes(br#"{"stop":null}"#), 0);
    assert_eq!(longest_stop_bytes(b"{"), 0);
    let mut c = NodeLogprobs::new(1);
    assert!(!c.is_full());
    c.push(Some(
        &serde_json::json!({"content": [{"token": "a", "logprob": -1}]}),
    ));
    assert!(c.is_full());
}

#[test]
fn observations_fire_past_the_event_threshold() {
    let o = logprob_observations(
        &[Some(-0.1), Some(-0.2), Some(-5.0), None],
        &[Some(-0.3), None, Some(-1.0), Some(-1.0)],
        1.0,
    );
    assert_eq!(o.len(), 2);
    assert!(!o[0].is_event());
    assert!(o[1].is_event());
    assert!(missing_observation().is_event());
}

#[test]
fn capture_is_bounded_and_records_malformed_lists() {
    let mut c = NodeLogprobs::new(2);
    let v: Value = serde_json::from_str(
        r#"{"content":[{"token":"a","logprob":-1},{"token":"b","logprob":-1},{"token":"c","logprob":-1}]}"#,
    )
    .unwrap();
    c.push(Some(&v));
    c.push(Some(&v));
    assert_eq!(c.tokens.len(), 2);
    assert!(c.is_usable());
    let mut c = NodeLogprobs::new(8);
    c.push(Some(&Value::Null));
    assert!(!c.seen);
    c.push(Some(&serde_json::json!({"content": 3})));
    assert_eq!(c.error, Some(NodeLogprobsError::Shape));
    assert!(!c.is_usable());
}

#[test]
fn a_list_in_another_vocabulary_is_read_by_its_bytes() {
    let v = vocab();
    let body = br#"{"messages":[]}"#;
    let list = |ids: [u64; 3]| {
        let json = serde_json::json!({"content": [
            {"id": ids[0], "token": "Hello", "logprob": -0.1},
            {"id": ids[1], "token": " world", "logprob": -0.2},
            {"id": ids[2], "token": "!", "logprob": -0.3},
        ]});
        let mut c = NodeLogprobs::new(16);
        c.push(Some(&json));
        c
    };
    // the catalog's own ids: aligned
    let own = judge_node_list(&v, &list([0, 1, 2]), b"Hello world!", body, 16);
    assert!(
        matches!(own, NodeList::Aligned(ref a) if ids(a) == vec![0, 1, 2]),
        "{own:?}"
    );
    // another vocabulary's ids over the same bytes: foreign, the bytes aligned
    let foreign = judge_node_list(&v, &list([7000, 81, 9]), b"Hello world!", body, 16);
    let NodeList::Foreign { at, by_bytes } = foreign else {
        panic!("{foreign:?}")
    };
    assert_eq!(at, Misaligned(0));
    assert_eq!(ids(&by_bytes), vec![0, 1, 2]);
    assert_eq!(by_bytes.logprobs, vec![Some(-0.1), Some(-0.2), Some(-0.3)]);
    // an entry that is no single vocabulary token is split by longest match and fed as
    // context; the entries after it are scored
    let json = serde_json::json!({"content": [
        {"id": 7000, "token": "Hello world", "logprob": -0.1},
        {"id": 7001, "token": "!", "logprob": -0.3},
    ]});
    let mut c = NodeLogprobs::new(16);
    c.push(Some(&json));
    let NodeList::Foreign { by_bytes, .. } = judge_node_list(&v, &c, b"Hello world!", body, 16)
    else {
        panic!()
    };
    assert_eq!(ids(&by_bytes), vec![0, 1, 2]);
    assert_eq!(by_bytes.logprobs, vec![None, None, Some(-0.3)]);
    // bytes no token spells: nothing scored, misaligned
    let json = serde_json::json!({"content": [
        {"id": 7000, "token": "Hxy", "logprob": -0.1},
        {"id": 7001, "token": "!", "logprob": -0.1},
    ]});
    let mut c = NodeLogprobs::new(16);
    c.push(Some(&json));
    let judged = judge_node_list(&v, &c, b"Hxy!", body, 16);
    assert!(matches!(judged, NodeList::Misaligned(_)), "{judged:?}");
}

/// What the pinned llama-server answered (non-streamed, `max_tokens` 2, a `logit_bias` that
/// made it sample the lone byte 0xF0 and then "s"): content "\u{fffd}s" and no `logprobs` —
/// the text "\xF0s" still ended in an incomplete sequence for `validate_utf8`, so both tokens
/// were held when the limit came. Neither that nor, after listed tokens, the same tail is an
/// event; a list that spells nothing of such a text is short (llama.cpp sends none).
#[test]
fn tokens_held_behind_a_lone_lead_byte_at_the_end_are_not_short() {
    let v = vocab();
    let body = br#"{"messages":[]}"#;
    let none = NodeLogprobs::new(16);
    let judged = judge_node_list(&v, &none, "\u{fffd}s".as_bytes(), body, 16);
    assert!(
        matches!(judged, NodeList::Aligned(ref a) if a.scored() == 0),
        "{judged:?}"
    );
    let judged = judge_node_list(&v, &none, "Hello world".as_bytes(), body, 16);
    assert_eq!(judged, NodeList::Unusable);
    // every entry dropped with a stop word's (a reply of one word and the stop word): no event
    let stop = br#"{"messages":[],"stop":["\n"]}"#;
    let judged = judge_node_list(&v, &none, "Hello".as_bytes(), stop, 16);
    assert!(matches!(judged, NodeList::Aligned(_)), "{judged:?}");
    let json = serde_json::json!({"content": [{"id": 3, "token": "", "logprob": -0.1}]});
    let mut empty_entry = NodeLogprobs::new(16);
    empty_entry.push(Some(&json));
    let judged = judge_node_list(&v, &empty_entry, "Hello world\u{fffd}".as_bytes(), body, 16);
    assert!(matches!(judged, NodeList::Short { .. }), "{judged:?}");
    let json = serde_json::json!({"content": [
        {"id": 0, "token": "Hello", "logprob": -0.1, "bytes": b"Hello".to_vec()},
        {"id": 1, "token": " world", "logprob": -0.2, "bytes": b" world".to_vec()},
    ]});
    let mut c = NodeLogprobs::new(16);
    c.push(Some(&json));
    let text = "Hello world\u{fffd}s";
    let judged = judge_node_list(&v, &c, text.as_bytes(), body, 16);
    assert!(
        matches!(judged, NodeList::Aligned(ref a) if a.scored() == 2),
        "{judged:?}"
    );
    // more than a token and two bytes: the list had to go on
    let text = "Hello world\u{fffd}sion sion sion sion";
    let judged = judge_node_list(&v, &c, text.as_bytes(), body, 16);
    assert!(matches!(judged, NodeList::Short { .. }), "{judged:?}");
}

/// What the pinned llama-server listed after a lone lead byte mid-text (the byte token 0xF0,
/// then "s" and "ion"): one entry, bytes `F0 73 69 6F 6E`, the id of "ion"; the answer
/// delivered "\u{fffd}sion". The held tokens are fed as context and the list goes on.
#[test]
fn tokens_held_behind_a_lone_lead_byte_mid_text_are_context_and_the_list_goes_on() {
    let tokens: Vec<String> = ["ð", "s", "ion", "Hello", "Ģ", "Hi", "i"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    let v = TokenVocabulary::from_tokens("gpt2", &tokens, None).unwrap();
    let json = serde_json::json!({"content": [
        {"id": 3, "token": "Hello", "logprob": -0.1, "bytes": b"Hello".to_vec()},
        {"id": 2, "token": "", "logprob": -0.2, "bytes": [0xf0, b's', b'i', b'o', b'n']},
        {"id": 3, "token": "Hello", "logprob": -0.3, "bytes": b"Hello".to_vec()},
    ]});
    let mut c = NodeLogprobs::new(16);
    c.push(Some(&json));
    let text = "Hello\u{fffd}sionHello";
    let a = align(&v, &c.tokens, text.as_bytes(), 16).unwrap();
    let ids: Vec<u32> = a.tokens.iter().map(|t| t.id).collect();
    assert_eq!(ids, vec![3, 0, 1, 2, 3]);
    assert_eq!(
        a.logprobs,
        vec![Some(-0.1), None, None, Some(-0.2), Some(-0.3)]
    );
    // the lone byte is fed as context, never forced (the grammar cannot force it)
    assert!(a.tokens[1].split && !a.tokens[1].scored);
    // an entry that is its own stray continuation byte: context, as before
    let json = serde_json::json!({"content": [
        {"id": 4, "token": "", "logprob": -0.2, "bytes": [0x80]},
        {"id": 3, "token": "Hello", "logprob": -0.3, "bytes": b"Hello".to_vec()},
    ]});
    let mut c = NodeLogprobs::new(16);
    c.push(Some(&json));
    let a = align(&v, &c.tokens, "\u{fffd}Hello".as_bytes(), 16).unwrap();
    assert_eq!(a.logprobs, vec![None, Some(-0.3)]);
    // what llama.cpp never lists, before its last entry: an entry that ends in an incomplete
    // sequence (it holds such a token), held bytes that do not end incomplete (it held
    // nothing then) — valid text or not
    let not_held = |entries: serde_json::Value, text: &str| {
        let mut c = NodeLogprobs::new(16);
        c.push(Some(&serde_json::json!({ "content": entries })));
        align(&v, &c.tokens, text.as_bytes(), 16)
    };
    let hello = serde_json::json!({"id": 3, "token": "Hello", "logprob": -0.3});
    let lone = serde_json::json!({"id": 0, "token": "", "logprob": -0.2, "bytes": [0xf0]});
    assert_eq!(
        not_held(serde_json::json!([lone, hello]), "\u{fffd}Hello"),
        Err(Misaligned(0))
    );
    let hidden = serde_json::json!({"id": 0, "token": "", "logprob": -0.2,
        "bytes": [b'H', b'e', b'l', b'l', b'o', 0xf0]});
    assert_eq!(
        not_held(
            serde_json::json!([hello, hidden, hello]),
            "HelloHello\u{fffd}Hello"
        ),
        Err(Misaligned(5))
    );
    let hi = serde_json::json!({"id": 6, "token": "Hi", "logprob": -0.2, "bytes": b"Hi".to_vec()});
    assert_eq!(
        not_held(serde_json::json!([hi, hello]), "HiHello"),
        Err(Misaligned(0))
    );
    // as the last entry (a stop word's token is cut): alignment stops, no event
    let a = not_held(serde_json::json!([hello, lone]), "Hello\u{fffd}").unwrap();
    assert_eq!(a.logprobs, vec![Some(-0.3)]);
    // held bytes that no unique split spells: alignment stops there, no event
    let json = serde_json::json!({"content": [
        {"id": 2, "token": "", "logprob": -0.2, "bytes": [0xf0, b'x', b'i', b'o', b'n']},
    ]});
    let mut c = NodeLogprobs::new(16);
    c.push(Some(&json));
    let a = align(&v, &c.tokens, "\u{fffd}xion".as_bytes(), 16).unwrap();
    assert_eq!(a.scored(), 0);
}

/// A streamed llama.cpp answer to a request with stop words sends no entry for a token a
/// partial stop string held: the next entry carries its text (measured: `" as the"` with the id
/// of `" the"`, stop words `"\n"` and `"s,"`). Not an event with stop words; without them
/// llama.cpp holds nothing so, and the list is not its text.
#[test]
fn held_text_of_a_streamed_partial_stop_string_is_no_event() {
    let v = vocab();
    let json = serde_json::json!({"content": [
        {"id": 0, "token": "Hello", "logprob": -0.1},
        {"id": 2, "token": " world!", "logprob": -0.2},
        {"id": 0, "token": "Hello", "logprob": -0.3},
    ]});
    let mut c = NodeLogprobs::new(16);
    c.push(Some(&json));
    let text = b"Hello world!Hello";
    let with_stop = br#"{"messages":[],"stream":true,"stop":[" wor"]}"#;
    let judged = judge_node_list(&v, &c, text, with_stop, 16);
    assert!(
        matches!(judged, NodeList::Aligned(ref a) if a.scored() == 1),
        "{judged:?}"
    );
    let judged = judge_node_list(&v, &c, text, br#"{"messages":[]}"#, 16);
    assert!(matches!(judged, NodeList::Foreign { .. }), "{judged:?}");
}
