use super::*;

#[tokio::test(start_paused = true)]
async fn entries_expire_after_ttl_since_last_use() {
    let mut t = AffinityTable::new(Duration::from_secs(1_800), 10);
    let now = Instant::now();
    let k = AffinityTable::slot(&ModelId::new("m"), &AffinityKey::Conversation(7));
    assert_eq!(t.get(k, now), None);
    t.insert(k, NodeId::new("a"), now);
    let later = now + Duration::from_secs(1_700);
    assert_eq!(t.get(k, later), Some(NodeId::new("a")));
    // refreshed at `later`: alive 1,799 s after it, gone at 1,800 s
    assert_eq!(
        t.get(k, later + Duration::from_secs(1_799)),
        Some(NodeId::new("a"))
    );
    assert_eq!(t.get(k, later + Duration::from_secs(1_799 + 1_800)), None);
}

#[tokio::test(start_paused = true)]
async fn bounded_and_disabled_at_zero_ttl() {
    let now = Instant::now();
    let mut t = AffinityTable::new(Duration::from_secs(60), 20);
    for i in 0..100u64 {
        t.insert(i, NodeId::new("a"), now + Duration::from_millis(i));
    }
    assert!(t.entries.len() <= 20, "{}", t.entries.len());
    // the newest entry is always kept
    assert_eq!(
        t.get(99, now + Duration::from_millis(99)),
        Some(NodeId::new("a"))
    );
    let mut off = AffinityTable::new(Duration::ZERO, 20);
    off.insert(1, NodeId::new("a"), now);
    assert_eq!(off.get(1, now), None);
}

#[tokio::test(start_paused = true)]
async fn full_table_evicts_the_least_recently_used() {
    let now = Instant::now();
    let mut t = AffinityTable::new(Duration::from_secs(60), 3);
    t.insert(1, NodeId::new("a"), now);
    t.insert(2, NodeId::new("b"), now + Duration::from_millis(1));
    t.insert(3, NodeId::new("b"), now + Duration::from_millis(2));
    // 1 used again: 2 is now the least recently used
    let t3 = now + Duration::from_millis(3);
    assert_eq!(t.get(1, t3), Some(NodeId::new("a")));
    t.insert(4, NodeId::new("c"), t3);
    assert_eq!(t.get(2, t3), None);
    assert_eq!(t.get(1, t3), Some(NodeId::new("a")));
    let counts = t.entries_per_node(t3);
    assert_eq!(counts.get(&NodeId::new("a")), Some(&1));
    assert_eq!(counts.get(&NodeId::new("b")), Some(&1));
    assert_eq!(counts.get(&NodeId::new("c")), Some(&1));
}

#[tokio::test(start_paused = true)]
async fn per_node_counts_follow_overwrites_and_expiry() {
    let now = Instant::now();
    let mut t = AffinityTable::new(Duration::from_secs(60), 100);
    for i in 0..10u64 {
        t.insert(i, NodeId::new("a"), now);
    }
    // moved to another node
    for i in 0..4u64 {
        t.insert(i, NodeId::new("b"), now + Duration::from_secs(30));
    }
    let counts = t.entries_per_node(now + Duration::from_secs(30));
    assert_eq!(counts.get(&NodeId::new("a")), Some(&6));
    assert_eq!(counts.get(&NodeId::new("b")), Some(&4));
    // a's entries expire at 60 s, b's at 90 s
    let counts = t.entries_per_node(now + Duration::from_secs(61));
    assert_eq!(counts.get(&NodeId::new("a")), None);
    assert_eq!(counts.get(&NodeId::new("b")), Some(&4));
    assert_eq!(t.entries.len(), 4);
    assert!(t.entries_per_node(now + Duration::from_secs(91)).is_empty());
    assert!(t.entries.is_empty());
}

#[test]
fn key_precedence() {
    let mut peek = RequestPeek {
        model: ModelId::new("m"),
        stream: false,
        include_usage: false,
        n: 1,
        max_tokens: None,
        prompt_cache_key: Some("pck".into()),
        conversation_key: Some(9),
        tokenization_constrained: false,
    };
    assert_eq!(
        AffinityKey::for_request(&peek, Some("s")),
        Some(AffinityKey::PromptCacheKey("pck".into()))
    );
    peek.prompt_cache_key = None;
    assert_eq!(
        AffinityKey::for_request(&peek, Some("s")),
        Some(AffinityKey::SessionId("s".into()))
    );
    assert_eq!(
        AffinityKey::for_request(&peek, None),
        Some(AffinityKey::Conversation(9))
    );
    peek.conversation_key = None;
    assert_eq!(AffinityKey::for_request(&peek, None), None);
}
