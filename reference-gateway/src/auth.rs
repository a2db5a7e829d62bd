//! API keys and ids: random generation, hashing, and the cache of keys already looked up.
//!
//! API keys are `sk-spine-` followed by 32 random bytes in base64url; only their SHA-256 (hex) is
//! stored, so a leaked database does not leak usable keys.

use base64::Engine as _;
use sha2::{Digest, Sha256};
use spine_core::{AccountId, RequestId};

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut buf = [0u8; N];
    // The OS RNG failing is unrecoverable for a server that mints keys; fall back to nothing.
    if let Err(e) = getrandom::fill(&mut buf) {
        tracing::error!(error = %e, "OS random number generator failed");
        std::process::abort();
    }
    buf
}

/// The token of an `Authorization: Bearer <token>` header value; the scheme is case-insensitive
/// (RFC 9110 §11.1).
pub(crate) fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Whether `id` is acceptable as a caller-chosen account or operator id: 1–64 of
/// `[A-Za-z0-9_.-]`.
pub(crate) fn valid_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// A fresh API key, shown to its owner once.
pub(crate) fn new_api_key() -> String {
    format!(
        "sk-spine-{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(random_bytes::<32>())
    )
}

/// SHA-256 of the key, lowercase hex: what the store keeps.
pub(crate) fn hash_api_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Most keys [`KeyCache`] remembers; when full it starts over (it is only a shortcut).
const MAX_CACHED_KEYS: usize = 65_536;

/// The accounts of API keys already found in the store, by key hash, so that a request costs
/// no database read to authenticate (measured: a refused request's CPU was mostly the key's
/// lookup). Only keys that exist are remembered: a key created on another instance is found in
/// the store the first time it is used. A key's account never changes and keys are not revoked
/// (no admin call does either); one that does must clear this cache.
#[derive(Debug, Default)]
pub(crate) struct KeyCache(std::sync::RwLock<std::collections::HashMap<String, AccountId>>);

impl KeyCache {
    /// The account remembered for `key_hash`.
    pub(crate) fn get(&self, key_hash: &str) -> Option<AccountId> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(key_hash)
            .cloned()
    }

    /// Remembers that `key_hash` belongs to `account`.
    pub(crate) fn insert(&self, key_hash: String, account: AccountId) {
        let mut map = self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if map.len() >= MAX_CACHED_KEYS {
            map.clear();
        }
        map.insert(key_hash, account);
    }
}

/// A fresh id with a readable prefix: `<prefix>_<24 hex digits>`.
pub(crate) fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", hex::encode(random_bytes::<12>()))
}

/// A fresh request id (`req_…`).
pub(crate) fn new_request_id() -> RequestId {
    RequestId::new(new_id("req"))
}

#[cfg(test)]
mod tests {
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
    fn bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer  abc "), Some("abc"));
        assert_eq!(bearer_token("BEARER abc"), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("Bearer"), None);
    }

    #[test]
    fn ids_are_restricted() {
        assert!(valid_id("acct_1.a-B"));
        assert!(!valid_id(""));
        assert!(!valid_id("../../x y"));
        assert!(!valid_id(&"a".repeat(65)));
    }
}
