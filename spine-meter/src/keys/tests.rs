use super::*;

#[test]
fn keys_are_random_and_hash_is_sha256_hex() {
    let a = new_api_key();
    let b = new_api_key();
    assert_ne!(a, b);
    assert!(a.starts_with("sk-spine-"));
    assert_eq!(a.len(), "sk-spine-".len() + 43);
    assert_eq!(
        hash_api_key("abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    assert_eq!(new_id("acct").len(), "acct_".len() + 24);
    assert!(valid_id(&new_id("acct")));
    let token = new_enrollment_token();
    assert!(token.starts_with("spine-enroll-"));
    assert_eq!(token.len(), "spine-enroll-".len() + 43);
}

#[test]
fn the_key_cache_remembers_and_starts_over_when_full() {
    let cache = KeyCache::default();
    assert_eq!(cache.get("h1"), None);
    cache.insert("h1".into(), AccountId::new("a1"));
    assert_eq!(cache.get("h1"), Some(AccountId::new("a1")));
    for i in 0..MAX_CACHED_KEYS {
        cache.insert(format!("k{i}"), AccountId::new("a"));
    }
    // full at the 65,536th: the memory started over, and holds only what came since
    assert_eq!(cache.get("h1"), None);
    assert_eq!(
        cache.get(&format!("k{}", MAX_CACHED_KEYS - 1)),
        Some(AccountId::new("a"))
    );
}

#[test]
fn a_cached_key_is_read_again_after_the_time_to_live() {
    // a key revoked through another instance must stop working here: past the TTL the cache
    // does not answer, so the store is read again
    let kept = KeyCache::new(std::time::Duration::from_secs(3600));
    kept.insert("h1".into(), AccountId::new("a1"));
    assert_eq!(kept.get("h1"), Some(AccountId::new("a1")));
    let cache = KeyCache::new(std::time::Duration::from_millis(20));
    cache.insert("h1".into(), AccountId::new("a1"));
    std::thread::sleep(std::time::Duration::from_millis(30));
    assert_eq!(cache.get("h1"), None);
    // a zero TTL never answers from memory
    let never = KeyCache::new(std::time::Duration::ZERO);
    never.insert("h2".into(), AccountId::new("a2"));
    assert_eq!(never.get("h2"), None);
}

#[test]
fn bearer_scheme_is_case_insensitive() {
    assert_eq!(bearer_token("Bearer abc"), Some("abc"));
    assert_eq!(bearer_token("bearer  abc "), Some("abc"));
    assert_eq!(bearer_token("BEARER abc"), Some("abc"));
    assert_eq!(bearer_token("Basic abc"), None);
    assert_eq!(bearer_token("Bearer "), None);
    assert_eq!(bearer_token("Bearer"), None);
    let header = http::HeaderValue::from_static("Bearer abc");
    assert_eq!(
        presented_key_hash(Some(&header)).as_deref(),
        Some("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    );
    assert_eq!(presented_key_hash(None), None);
}

#[test]
fn ids_are_restricted() {
    assert!(valid_id("acct_1.a-B"));
    assert!(!valid_id(""));
    assert!(!valid_id("../../x y"));
    assert!(!valid_id(&"a".repeat(65)));
}

/// A key revoked (and [`KeyCache::remove`]d, as the console does) while a request's lookup of
/// it is under way: the lookup read it live, just before the revocation, so that request
/// goes on; but its answer must not be remembered, else the revoked key would keep working on
/// this instance for the cache's whole time to live.
#[tokio::test]
async fn a_key_revoked_during_its_lookup_is_not_remembered() -> Result<(), crate::LedgerError> {
    let cache = KeyCache::new(std::time::Duration::from_secs(3600));
    let found = cache
        .account_for_with("h1", async {
            // the store's answer is on its way; the key is revoked and forgotten meanwhile
            cache.remove("h1");
            Ok(Some(AccountId::new("a1")))
        })
        .await?;
    assert_eq!(found, Some(AccountId::new("a1")));
    assert_eq!(cache.get("h1"), None);
    // with no removal during the lookup, the answer is remembered as before
    let found = cache
        .account_for_with("h2", async { Ok(Some(AccountId::new("a2"))) })
        .await?;
    assert_eq!(found, Some(AccountId::new("a2")));
    assert_eq!(cache.get("h2"), Some(AccountId::new("a2")));
    // an unknown key is never remembered
    let found = cache.account_for_with("h3", async { Ok(None) }).await?;
    assert_eq!(found, None);
    assert_eq!(cache.get("h3"), None);
    Ok(())
}

#[test]
fn request_ids_start_with_their_millisecond_and_sort_by_creation() {
    let before_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let a = new_request_id();
    std::thread::sleep(std::time::Duration::from_millis(2));
    let b = new_request_id();
    for id in [&a, &b] {
        assert!(valid_id(id.as_str()), "{id}");
        assert_eq!(id.as_str().len(), "req_".len() + 24);
    }
    let ms_of = |id: &RequestId| u64::from_str_radix(&id.as_str()[4..16], 16).unwrap();
    assert!(
        ms_of(&a) >= before_ms && ms_of(&a) <= before_ms + 60_000,
        "{a}"
    );
    assert!(ms_of(&b) > ms_of(&a));
    assert!(b.as_str() > a.as_str(), "{a} {b}");
    // the random half differs between ids of the same millisecond
    let same_ms: std::collections::HashSet<String> = (0..1_000)
        .map(|_| new_request_id().as_str().to_owned())
        .collect();
    assert_eq!(same_ms.len(), 1_000);
}
