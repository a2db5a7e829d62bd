//! API keys, enrollment tokens and ids: random generation, hashing, the bearer scheme, and the
//! cache of keys already looked up in the [`Store`](crate::Store).
//!
//! API keys are `sk-spine-` followed by 32 random bytes in base64url; only their SHA-256 (hex) is
//! stored, so a leaked database does not leak usable keys. Enrollment tokens are the same with
//! the prefix `spine-enroll-`, and are stored the same way.

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
/// (RFC 9110 §11.1). `None` for another scheme or an empty token.
pub fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Whether `id` is acceptable as a caller-chosen account or operator id: 1–64 of
/// `[A-Za-z0-9_.-]`.
pub fn valid_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// A fresh API key (`sk-spine-` and 43 base64url characters), shown to its owner once.
///
/// # Panics
///
/// Never; the process aborts when the OS random number generator fails.
pub fn new_api_key() -> String {
    format!(
        "sk-spine-{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(random_bytes::<32>())
    )
}

/// Prefix of enrollment tokens.
pub const ENROLLMENT_TOKEN_PREFIX: &str = "spine-enroll-";

/// A fresh one-time enrollment token (`spine-enroll-` and 43 base64url characters); store its
/// [`hash_api_key`].
pub fn new_enrollment_token() -> String {
    format!(
        "{ENROLLMENT_TOKEN_PREFIX}{}",
        new_api_key().trim_start_matches("sk-spine-")
    )
}

/// SHA-256 of the key (or token), lowercase hex: what the store keeps.
pub fn hash_api_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// SHA-256 (hex) of the bearer token of an `Authorization` header value, if it has one.
pub fn presented_key_hash(authorization: Option<&http::HeaderValue>) -> Option<String> {
    authorization
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .map(hash_api_key)
}

/// A fresh id with a readable prefix: `<prefix>_<24 hex digits>`.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", hex::encode(random_bytes::<12>()))
}

/// A fresh request id: `req_` and 24 hex digits, the first 12 the milliseconds since the Unix
/// epoch (48 bits, big-endian, as in a UUIDv7, RFC 9562 §5.7) and the last 12 random (48 bits).
///
/// Time first, so that ids sort by creation and the ledger's indexes keyed by request id (the
/// holds', the request records', the ledger entries' `ref`) grow at their right edge: a batch of
/// settlements then changes a few shared pages of each index instead of one random page per
/// settlement (SQLite appends every changed page to its WAL at each commit; issue 17,
/// `docs/benchmarks.md`). A request id is a name, not a secret (the caller and the node see
/// it); two ids collide only when made in the same millisecond with the same 48 random bits.
///
/// The random bits come from the thread's CSPRNG (`rand::rng()`, ChaCha seeded and reseeded
/// from the OS), not from a `getrandom` system call per request: that call was one of the five
/// system calls a lone request paid (issue 17, `docs/benchmarks.md`).
pub fn new_request_id() -> RequestId {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    // the low 48 bits: good until the year 10889
    let ms = (ms as u64 & 0xffff_ffff_ffff).to_be_bytes();
    let random: [u8; 6] = rand::Rng::random(&mut rand::rng());
    let mut id = [0u8; 12];
    id[..6].copy_from_slice(&ms[2..]);
    id[6..].copy_from_slice(&random);
    RequestId::new(format!("req_{}", hex::encode(id)))
}

/// Most keys [`KeyCache`] remembers; when full it starts over (it is only a shortcut).
const MAX_CACHED_KEYS: usize = 65_536;

/// How long [`KeyCache::default`] trusts a key it found in the store before it reads the store
/// again: 10 s.
pub const DEFAULT_KEY_CACHE_TTL: std::time::Duration = std::time::Duration::from_secs(10);

/// The accounts of API keys already found in the store, by key hash, so that a request costs
/// no database read to authenticate (measured: a refused request's CPU was mostly the key's
/// lookup). Only keys that exist are remembered: a key created on another instance is found in
/// the store the first time it is used.
///
/// **Revocation.** A key revoked on this instance (the console's
/// `ConsoleStore::revoke_api_key`) must be [removed](KeyCache::remove) here and stops working
/// at once. A key revoked through another instance of a several-instance gateway (sharing one
/// database) stops working here within the cache's time to live: an entry older than `ttl` is
/// not used, and the next request reads the store again (one read per key and `ttl`).
/// At most 65,536 keys; when full it starts over.
#[derive(Debug)]
pub struct KeyCache {
    ttl: std::time::Duration,
    map: std::sync::RwLock<std::collections::HashMap<String, (AccountId, std::time::Instant)>>,
    /// How many keys were [removed](KeyCache::remove) so far (changed under `map`'s write
    /// lock): a lookup that saw another count when it started does not remember its answer,
    /// which the store may have given just before the key was revoked.
    removals: std::sync::atomic::AtomicU64,
}

impl Default for KeyCache {
    /// A cache whose entries live [`DEFAULT_KEY_CACHE_TTL`].
    fn default() -> Self {
        Self::new(DEFAULT_KEY_CACHE_TTL)
    }
}

impl KeyCache {
    /// A cache that trusts a key found in the store for `ttl` (zero: never remembers).
    pub fn new(ttl: std::time::Duration) -> Self {
        Self {
            ttl,
            map: Default::default(),
            removals: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The account remembered for `key_hash`, if it was found in the store less than the
    /// cache's time to live ago.
    pub fn get(&self, key_hash: &str) -> Option<AccountId> {
        self.map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(key_hash)
            .filter(|(_, found_at)| found_at.elapsed() < self.ttl)
            .map(|(account, _)| account.clone())
    }

    /// Forgets `key_hash` (a revoked key): the next use looks it up in the store again, and a
    /// lookup already under way (which may have read the key before it was revoked) is not
    /// remembered.
    pub fn remove(&self, key_hash: &str) {
        let mut map = self
            .map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.remove(key_hash);
        self.removals
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// Remembers that `key_hash` belongs to `account`, as of now.
    pub fn insert(&self, key_hash: String, account: AccountId) {
        let mut map = self
            .map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Self::put(&mut map, key_hash, account);
    }

    fn put(
        map: &mut std::collections::HashMap<String, (AccountId, std::time::Instant)>,
        key_hash: String,
        account: AccountId,
    ) {
        if map.len() >= MAX_CACHED_KEYS {
            map.clear();
        }
        map.insert(key_hash, (account, std::time::Instant::now()));
    }

    /// As [`insert`](Self::insert), unless a key was removed since the count `removals_seen`
    /// (the lookup's answer may predate a revocation).
    fn insert_unless_removed(&self, key_hash: String, account: AccountId, removals_seen: u64) {
        let mut map = self
            .map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.removals.load(std::sync::atomic::Ordering::SeqCst) == removals_seen {
            Self::put(&mut map, key_hash, account);
        }
    }

    /// The account of `key_hash`: remembered, else looked up in `store` (and remembered when
    /// found); `None` for a key the store does not know.
    ///
    /// # Errors
    ///
    /// The store's error when the lookup fails.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropped before the lookup ends, nothing is remembered.
    pub async fn account_for(
        &self,
        store: &dyn crate::Store,
        key_hash: &str,
    ) -> Result<Option<AccountId>, crate::LedgerError> {
        self.account_for_with(key_hash, store.account_for_key_hash(key_hash))
            .await
    }

    /// [`account_for`](Self::account_for) with the store's `lookup` of `key_hash` (a lazy
    /// future, started only on a miss): its answer is remembered only when no key was removed
    /// while it ran, so a key revoked and [removed](Self::remove) during the lookup is not
    /// remembered as live.
    async fn account_for_with(
        &self,
        key_hash: &str,
        lookup: impl std::future::Future<Output = Result<Option<AccountId>, crate::LedgerError>>,
    ) -> Result<Option<AccountId>, crate::LedgerError> {
        if let Some(account) = self.get(key_hash) {
            return Ok(Some(account));
        }
        let removals_seen = self.removals.load(std::sync::atomic::Ordering::SeqCst);
        let found = lookup.await?;
        if let Some(account) = &found {
            self.insert_unless_removed(key_hash.to_owned(), account.clone(), removals_seen);
        }
        Ok(found)
    }

    /// The caller presenting `authorization` (`Bearer <key>`) as an OpenAI-compatible handler
    /// authenticates it (feature `axum`): its account ([`account_for`](Self::account_for)) and
    /// the key's SHA-256 (hex).
    ///
    /// # Errors
    ///
    /// 401 `invalid_api_key` for no key or an unknown one; 503 `ledger_unavailable` when the
    /// store fails (logged).
    ///
    /// # Cancel safety
    ///
    /// As [`account_for`](Self::account_for).
    #[cfg(feature = "axum")]
    pub async fn authenticate(
        &self,
        store: &dyn crate::Store,
        authorization: Option<&http::HeaderValue>,
    ) -> Result<(AccountId, String), crate::openai_error::ApiError> {
        use crate::openai_error::ApiError;
        let key_hash = presented_key_hash(authorization).ok_or_else(ApiError::unauthorized)?;
        match self.account_for(store, &key_hash).await {
            Ok(Some(account)) => Ok((account, key_hash)),
            Ok(None) => Err(ApiError::unauthorized()),
            Err(e) => {
                tracing::error!(error = %e, "key lookup failed");
                Err(ApiError::new(
                    http::StatusCode::SERVICE_UNAVAILABLE,
                    "api_error",
                    "ledger_unavailable",
                    "the account store is unavailable",
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests;
