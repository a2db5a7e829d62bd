//! Admission limits per API key (feature `limits`): requests per minute (RPM) and tokens per
//! minute (TPM), as a [`RateLimits`] the application asks for RPM ([`RateLimits::check_rpm`],
//! in its handler) and gives the metering layer as its [`Admission`] hook
//! ([`MeterLayer::admission`](crate::meter::MeterLayer::admission)) for TPM. The handler puts the
//! caller's [`KeyHash`] into the request's extensions; a request without one is not limited.
//!
//! - **RPM** uses `governor`'s GCRA, one direct limiter per key with `Quota::per_minute(rpm)`:
//!   a burst of `rpm` requests, then one more every `60 / rpm` seconds. Checked in the handler,
//!   before the body is read; every authenticated request counts, whatever its answer.
//! - **TPM** is a token bucket per key (capacity `tpm`, refilled continuously at `tpm / 60`
//!   tokens a second) with reservations: the metering layer's [`Admission`] hook reserves the
//!   request's worst case (prompt + choices × per-choice cap, exactly what the credit hold
//!   covers) before forwarding, and the settlement gives back what was not used. `governor`
//!   does not fit TPM: its GCRA state is a single "theoretical arrival time" that can only move
//!   forward, so a reservation cannot be refunded, and a worst-case reservation never trued up
//!   would throttle callers to a small fraction of their real token rate.
//!
//! Limits are set per key when the key is created (`POST /admin/v1/accounts/{id}/keys`
//! `{"rpm_limit", "tpm_limit"}`) and kept, by the SHA-256 of the key, in the ledger store's
//! `key_limits` table ([`Store::set_key_limits`]; SQLite or PostgreSQL, in both modes, so a
//! gateway switched to several instances keeps them); keys without their own limit get the
//! gateway's `default_rpm_limit` / `default_tpm_limit`. 0 means unlimited. Earlier releases kept
//! single-instance limits in `<data_dir>/key_limits.json`: [`import_key_limits_file`] copies
//! such a file into the store once at start and renames it `key_limits.json.imported`.
//!
//! # Several instances (design brief §8; feature `redis`)
//!
//! `RateLimits::with_redis` keeps both buckets in Redis, so N instances give a key its limit
//! once, not N times:
//!
//! - RPM: the same GCRA (burst `rpm`, one more every `60 / rpm` s) as an atomic Lua script on
//!   `<prefix>rl:rpm:<key hash>`, holding the "theoretical arrival time" in microseconds;
//! - TPM: the same reserving bucket as a Lua script on `<prefix>rl:tpm:<key hash>` (a hash of
//!   `tokens` and `ts`), with the refund as a second operation of the same script.
//!
//! Both scripts take the time from Redis (`TIME`), never from an instance's clock, and set an
//! expiry at the moment the bucket would be full again, so idle keys vanish. Every Redis call has
//! a 100 ms timeout. When Redis fails or times out, the instance falls back to the in-process
//! limiters above (degraded: each instance then enforces the full limit by itself, so N live
//! instances allow up to N×), logs that once, sets `spine_rate_limit_degraded` to 1 and counts
//! `spine_rate_limit_redis_fallback_total`; it tries Redis again a second later and logs the
//! recovery once. A reservation is refunded where it was taken (Redis or local).
//!
//! Per-key limits live in the ledger store (PostgreSQL's `key_limits` table), not in a
//! per-instance file: a key created on one instance must be limited the same on every other, and
//! the store is already the shared, durable, transactional home of the key itself (Redis is a
//! cache that may be flushed or down). Each instance caches a key's limits for 10 s.

#[cfg(feature = "redis")]
mod shared;

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use governor::clock::Clock;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use spine_core::RequestId;

use crate::meter::{Admission, AdmissionRefusal, AdmissionRequest, AdmitFuture};
use crate::{KeyLimits, Store};

#[cfg(feature = "redis")]
use shared::RedisLimits;
#[cfg(feature = "redis")]
pub use shared::{RATE_LIMIT_DEGRADED, RATE_LIMIT_REDIS_FALLBACK};

/// How long an instance trusts a key's limits read from the store.
const KEY_LIMITS_CACHE_TTL: Duration = Duration::from_secs(10);

/// The caller's API key, as the store knows it (SHA-256 hex, [`Store::set_key_limits`]); put
/// into the request's extensions by the handler so the admission hook knows whose bucket to
/// use.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KeyHash(pub String);

/// A request refused by a limit, for the 429.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Refused {
    /// Seconds until a retry can pass, rounded up (at least 1); `None`: never as sent (a
    /// request larger than the whole TPM budget).
    pub retry_after_secs: Option<u64>,
    /// OpenAI's wording of the refusal (`Rate limit reached for requests per min (RPM): …`).
    pub message: String,
}

fn ceil_secs(d: Duration) -> u64 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    secs.max(1)
}

/// A token bucket with reservations (TPM).
#[derive(Debug)]
struct Bucket {
    capacity: f64,
    tokens: f64,
    refilled_at: Instant,
}

impl Bucket {
    fn new(capacity: u64, now: Instant) -> Self {
        Self {
            capacity: capacity as f64,
            tokens: capacity as f64,
            refilled_at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now
            .saturating_duration_since(self.refilled_at)
            .as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.capacity / 60.0).min(self.capacity);
        self.refilled_at = now;
    }

    /// Takes `n` tokens, or says how long until they are there (`None`: never, `n` > capacity).
    fn reserve(&mut self, n: u64, now: Instant) -> Result<(), Option<Duration>> {
        self.refill(now);
        let n = n as f64;
        if n > self.capacity {
            return Err(None);
        }
        if n <= self.tokens {
            self.tokens -= n;
            return Ok(());
        }
        let missing = n - self.tokens;
        Err(Some(Duration::from_secs_f64(
            missing * 60.0 / self.capacity,
        )))
    }

    fn refund(&mut self, n: u64, now: Instant) {
        self.refill(now);
        self.tokens = (self.tokens + n as f64).min(self.capacity);
    }
}

#[derive(Debug, Default)]
struct TpmState {
    buckets: HashMap<KeyHash, Bucket>,
    /// Admitted requests not yet released: key and tokens reserved.
    reservations: HashMap<RequestId, (KeyHash, u64)>,
}

/// Per-key limits kept in the ledger store, and when each key's were read.
struct StoreLimits {
    store: Arc<dyn Store>,
    fetched: Mutex<HashMap<String, Instant>>,
}

/// Per-key RPM and TPM limits. Share it in an `Arc` (the metering layer takes one as its
/// [`Admission`]).
pub struct RateLimits {
    default_rpm: u32,
    default_tpm: u64,
    /// Per-key limits: all of them (no store: in memory only), or those read from `store`
    /// (cache).
    keys: Mutex<HashMap<String, KeyLimits>>,
    /// Where per-key limits live, and when each key's was read.
    store: Option<StoreLimits>,
    rpm: Mutex<HashMap<KeyHash, Arc<DefaultDirectRateLimiter>>>,
    tpm: Mutex<TpmState>,
    #[cfg(feature = "redis")]
    redis: Option<RedisLimits>,
}

impl std::fmt::Debug for RateLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimits")
            .field("default_rpm", &self.default_rpm)
            .field("default_tpm", &self.default_tpm)
            .finish_non_exhaustive()
    }
}

impl RateLimits {
    /// Limits for one instance: buckets in this process, the gateway defaults, and per-key
    /// limits kept in `store`.
    pub fn with_store(default_rpm: u32, default_tpm: u64, store: Arc<dyn Store>) -> Self {
        let mut this = Self::in_memory(default_rpm, default_tpm);
        this.store = Some(StoreLimits {
            store,
            fetched: Mutex::new(HashMap::new()),
        });
        this
    }

    /// Limits with the gateway defaults and per-key limits kept in memory only.
    pub fn in_memory(default_rpm: u32, default_tpm: u64) -> Self {
        Self {
            default_rpm,
            default_tpm,
            keys: Mutex::new(HashMap::new()),
            store: None,
            rpm: Mutex::new(HashMap::new()),
            tpm: Mutex::new(TpmState::default()),
            #[cfg(feature = "redis")]
            redis: None,
        }
    }

    /// Limits shared by several gateway instances (module docs, "Several instances"): buckets
    /// in Redis through `conn` (the instance's one shared connection) under `key_prefix`
    /// (e.g. `spine:`; bucket keys `<key_prefix>rl:rpm:<key hash>` and `…rl:tpm:…`),
    /// per-key limits in `store`, the defaults otherwise. Sets [`RATE_LIMIT_DEGRADED`] to 0.
    #[cfg(feature = "redis")]
    pub fn with_redis(
        conn: redis::aio::ConnectionManager,
        key_prefix: String,
        default_rpm: u32,
        default_tpm: u64,
        store: Arc<dyn Store>,
    ) -> Self {
        metrics::gauge!(RATE_LIMIT_DEGRADED).set(0.0);
        Self {
            default_rpm,
            default_tpm,
            keys: Mutex::new(HashMap::new()),
            store: Some(StoreLimits {
                store,
                fetched: Mutex::new(HashMap::new()),
            }),
            rpm: Mutex::new(HashMap::new()),
            tpm: Mutex::new(TpmState::default()),
            redis: Some(RedisLimits {
                conn,
                key_prefix,
                rpm_script: redis::Script::new(shared::RPM_LUA),
                tpm_script: redis::Script::new(shared::TPM_LUA),
                degraded: std::sync::atomic::AtomicBool::new(false),
                retry_at: Mutex::new(None),
                reservations: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The gateway's defaults `(default_rpm_limit, default_tpm_limit)`: requests and tokens per
    /// minute for a key without its own limits; 0 = unlimited.
    pub fn defaults(&self) -> (u32, u64) {
        (self.default_rpm, self.default_tpm)
    }

    /// Whether a key's own limits stay within the gateway's defaults, the cap a console user
    /// (not the admin API) may set: each given limit in `1..=default` (0, unlimited, only when
    /// the default is unlimited too); `None` takes the default.
    pub fn within_defaults(&self, asked: KeyLimits) -> bool {
        fn ok(asked: Option<u64>, default: u64) -> bool {
            asked.is_none_or(|v| default == 0 || (1..=default).contains(&v))
        }
        ok(asked.rpm_limit.map(u64::from), u64::from(self.default_rpm))
            && ok(asked.tpm_limit, self.default_tpm)
    }

    /// Whether decisions are local because Redis is unreachable (always false without Redis).
    pub fn is_degraded(&self) -> bool {
        #[cfg(feature = "redis")]
        {
            self.redis
                .as_ref()
                .is_some_and(|r| r.degraded.load(std::sync::atomic::Ordering::Acquire))
        }
        #[cfg(not(feature = "redis"))]
        false
    }

    /// Records a new key's own limits (nothing to record when both are `None`) in the store
    /// (or in memory without one).
    ///
    /// # Errors
    ///
    /// The store failed; nothing is recorded.
    ///
    /// # Cancel safety
    ///
    /// Dropped, the limits may or may not be in the store; this instance's copy is not set.
    pub async fn set_key_limits(
        &self,
        key: &KeyHash,
        limits: KeyLimits,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        if limits == KeyLimits::default() {
            return Ok(());
        }
        if let Some(StoreLimits { store, fetched }) = &self.store {
            store.set_key_limits(&key.0, limits).await?;
            self.keys
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key.0.clone(), limits);
            fetched
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key.0.clone(), Instant::now());
            return Ok(());
        }
        self.keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.0.clone(), limits);
        Ok(())
    }

    /// The limits in force for `key`, reading them from the store first when this instance's
    /// copy is missing or older than 10 s. If the store fails, the last
    /// copy (or the defaults) applies for another 10 s; a paid request then fails at its hold
    /// anyway.
    async fn effective_now(&self, key: &KeyHash) -> (u32, u64) {
        if let Some(StoreLimits { store, fetched }) = &self.store {
            let fresh = fetched
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&key.0)
                .is_some_and(|at| at.elapsed() < KEY_LIMITS_CACHE_TTL);
            if !fresh {
                match store.key_limits(&key.0).await {
                    Ok(own) => {
                        let own = own.unwrap_or_default();
                        self.keys
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(key.0.clone(), own);
                        fetched
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(key.0.clone(), Instant::now());
                    }
                    Err(e) => {
                        // keep what is known (or the defaults) for another TTL rather than
                        // ask an unreachable store on every request
                        tracing::warn!(error = %e, "cannot read the key's limits");
                        fetched
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(key.0.clone(), Instant::now());
                    }
                }
            }
        }
        self.effective(key)
    }

    /// The limits in force for `key` as this instance knows them: its own, else the defaults
    /// (0 = unlimited): `(rpm, tpm)`.
    pub fn effective(&self, key: &KeyHash) -> (u32, u64) {
        let own = self
            .keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key.0)
            .copied()
            .unwrap_or_default();
        (
            own.rpm_limit.unwrap_or(self.default_rpm),
            own.tpm_limit.unwrap_or(self.default_tpm),
        )
    }

    /// Counts one request against `key`'s RPM limit: in Redis (shared by every instance) when
    /// configured and reachable, else in this instance.
    ///
    /// # Cancel safety
    ///
    /// Dropped, the request may or may not have been counted.
    ///
    /// # Errors
    ///
    /// [`Refused`] with the wait until one more request passes.
    pub async fn check_rpm(&self, key: &KeyHash) -> Result<(), Refused> {
        let (rpm, _) = self.effective_now(key).await;
        let Some(rpm) = NonZeroU32::new(rpm) else {
            return Ok(());
        };
        #[cfg(feature = "redis")]
        if let Some(redis) = self.redis.as_ref().filter(|r| r.usable()) {
            let bucket = redis.bucket_key("rpm", key);
            if let Some(wait_micros) = redis
                .invoke::<u64>(&redis.rpm_script, &bucket, &[rpm.to_string()])
                .await
            {
                if wait_micros == 0 {
                    return Ok(());
                }
                return Err(rpm_refused(rpm, Duration::from_micros(wait_micros)));
            }
        }
        self.check_rpm_local(key, rpm)
    }

    /// Counts one event against the budget `name` in Redis, shared by every instance: a GCRA
    /// of `per_minute` events a minute with a burst of as many (the RPM bucket's script, under
    /// `<key_prefix>rl:named:<SHA-256 of name>`). For limits beside the API keys' that must
    /// hold across instances (the console's sign-in attempts). `None` without Redis, or when
    /// Redis is degraded or failed: the caller decides in this instance.
    ///
    /// # Cancel safety
    ///
    /// Dropped, the event may or may not have been counted.
    pub async fn check_shared(&self, name: &str, per_minute: NonZeroU32) -> Option<bool> {
        #[cfg(feature = "redis")]
        if let Some(redis) = self.redis.as_ref().filter(|r| r.usable()) {
            use sha2::Digest;
            let name = KeyHash(hex::encode(sha2::Sha256::digest(name.as_bytes())));
            let bucket = redis.bucket_key("named", &name);
            return redis
                .invoke::<u64>(&redis.rpm_script, &bucket, &[per_minute.to_string()])
                .await
                .map(|wait_micros| wait_micros == 0);
        }
        let _ = (name, per_minute);
        None
    }

    fn check_rpm_local(&self, key: &KeyHash, rpm: NonZeroU32) -> Result<(), Refused> {
        let limiter = self
            .rpm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.clone())
            .or_insert_with(|| Arc::new(RateLimiter::direct(Quota::per_minute(rpm))))
            .clone();
        limiter
            .check()
            .map_err(|not_until| rpm_refused(rpm, not_until.wait_time_from(limiter.clock().now())))
    }

    /// Reserves `tokens` of `key`'s TPM budget for `request_id`: in Redis when configured and
    /// reachable, else in this instance.
    async fn reserve_tpm_shared(
        &self,
        key: &KeyHash,
        request_id: &RequestId,
        tokens: u64,
    ) -> Result<(), Refused> {
        let (_, tpm) = self.effective_now(key).await;
        if tpm == 0 {
            return Ok(());
        }
        #[cfg(feature = "redis")]
        if let Some(redis) = self.redis.as_ref().filter(|r| r.usable()) {
            let bucket = redis.bucket_key("tpm", key);
            let args = [tpm.to_string(), tokens.to_string(), "reserve".to_owned()];
            if let Some(answer) = redis
                .invoke::<Vec<i64>>(&redis.tpm_script, &bucket, &args)
                .await
            {
                return match answer.as_slice() {
                    [1, _] => {
                        redis
                            .reservations
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(request_id.clone(), (key.clone(), tokens, tpm));
                        Ok(())
                    }
                    [0, wait_ms] if *wait_ms >= 0 => Err(tpm_refused(
                        tpm,
                        tokens,
                        Some(Duration::from_millis(wait_ms.unsigned_abs())),
                    )),
                    _ => Err(tpm_refused(tpm, tokens, None)),
                };
            }
        }
        self.reserve_tpm(key, request_id, tokens, Instant::now())
    }

    /// Gives back what `request_id` reserved and did not use, where it was reserved (Redis: on
    /// a spawned task, bounded by the Redis timeout). Idempotent.
    fn release_shared(&self, request_id: &RequestId, used_tokens: u64) {
        #[cfg(feature = "redis")]
        if self
            .redis
            .as_ref()
            .is_some_and(|r| r.release(request_id, used_tokens))
        {
            return;
        }
        self.release_tpm(request_id, used_tokens, Instant::now());
    }

    /// Reserves `tokens` of `key`'s TPM budget for `request_id`.
    fn reserve_tpm(
        &self,
        key: &KeyHash,
        request_id: &RequestId,
        tokens: u64,
        now: Instant,
    ) -> Result<(), Refused> {
        let (_, tpm) = self.effective(key);
        if tpm == 0 {
            return Ok(());
        }
        let mut state = self.tpm.lock().unwrap_or_else(|e| e.into_inner());
        let bucket = state
            .buckets
            .entry(key.clone())
            .or_insert_with(|| Bucket::new(tpm, now));
        match bucket.reserve(tokens, now) {
            Ok(()) => {
                state
                    .reservations
                    .insert(request_id.clone(), (key.clone(), tokens));
                Ok(())
            }
            Err(wait) => Err(tpm_refused(tpm, tokens, wait)),
        }
    }

    /// Gives back what `request_id` reserved and did not use. Idempotent.
    fn release_tpm(&self, request_id: &RequestId, used_tokens: u64, now: Instant) {
        let mut state = self.tpm.lock().unwrap_or_else(|e| e.into_inner());
        let Some((key, reserved)) = state.reservations.remove(request_id) else {
            return;
        };
        if let Some(bucket) = state.buckets.get_mut(&key) {
            bucket.refund(reserved.saturating_sub(used_tokens), now);
        }
    }
}

fn rpm_refused(rpm: NonZeroU32, wait: Duration) -> Refused {
    let secs = ceil_secs(wait);
    Refused {
        retry_after_secs: Some(secs),
        message: format!(
            "Rate limit reached for requests per min (RPM): Limit {rpm}. Please try again in {secs}s."
        ),
    }
}

/// A TPM refusal: `wait` until the tokens are there, `None` when they never fit.
fn tpm_refused(tpm: u64, tokens: u64, wait: Option<Duration>) -> Refused {
    match wait {
        None => Refused {
            retry_after_secs: None,
            message: format!(
                "Request too large for tokens per min (TPM): Limit {tpm}, Requested {tokens} (prompt + max_tokens × choices). Lower max_tokens or the prompt."
            ),
        },
        Some(wait) => {
            let secs = ceil_secs(wait);
            Refused {
                retry_after_secs: Some(secs),
                message: format!(
                    "Rate limit reached for tokens per min (TPM): Limit {tpm}, Requested {tokens}. Please try again in {secs}s."
                ),
            }
        }
    }
}

/// The 429 the metering layer's refusal becomes: the reason and `Retry-After`.
fn tpm_refusal(refused: Refused) -> AdmissionRefusal {
    AdmissionRefusal::new(
        refused.retry_after_secs.map(Duration::from_secs),
        refused.message,
    )
}

impl Admission for RateLimits {
    /// The local decision only (this instance's bucket); the metering layer calls
    /// [`Admission::admit_async`], which asks Redis first in multi-instance mode.
    fn admit(&self, request: &AdmissionRequest<'_>) -> Result<(), AdmissionRefusal> {
        let Some(key) = request.extensions.get::<KeyHash>() else {
            return Ok(());
        };
        self.reserve_tpm(
            key,
            request.request_id,
            request.reserved_tokens,
            Instant::now(),
        )
        .map_err(tpm_refusal)
    }

    fn admit_async<'a>(&'a self, request: &'a AdmissionRequest<'a>) -> AdmitFuture<'a> {
        Box::pin(async move {
            let Some(key) = request.extensions.get::<KeyHash>() else {
                return Ok(());
            };
            self.reserve_tpm_shared(key, request.request_id, request.reserved_tokens)
                .await
                .map_err(tpm_refusal)
        })
    }

    fn release(&self, request_id: &RequestId, used_tokens: u64) {
        self.release_shared(request_id, used_tokens);
    }
}

/// Imports per-key limits an earlier release kept in `path` (`<data_dir>/key_limits.json`,
/// single-instance mode) into `store`, then renames the file `key_limits.json.imported` so it is
/// imported once. A key the store already has limits for keeps the store's. Returns how many
/// keys were imported (0 when there is no file), and logs it when there were some.
///
/// # Errors
///
/// The file cannot be read or is not a key limits file, the store fails (nothing is renamed:
/// the next start imports again), or the rename fails.
///
/// # Cancel safety
///
/// Dropped midway, some keys may be imported and the file not renamed; the next call imports
/// the rest (a key already in the store keeps the store's limits).
pub async fn import_key_limits_file(
    path: &Path,
    store: &dyn Store,
) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(format!("{}: {e}", path.display()).into()),
    };
    let keys: HashMap<String, KeyLimits> = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a key limits file: {e}", path.display()))?;
    let mut imported = 0;
    for (key_hash, limits) in keys {
        if limits == KeyLimits::default() || store.key_limits(&key_hash).await?.is_some() {
            continue;
        }
        store.set_key_limits(&key_hash, limits).await?;
        imported += 1;
    }
    let done = path.with_extension("json.imported");
    std::fs::rename(path, &done).map_err(|e| {
        format!(
            "{}: imported, but renaming it to {} failed: {e}",
            path.display(),
            done.display()
        )
    })?;
    if imported > 0 {
        tracing::info!(
            keys = imported,
            "imported per-key limits from {} into the store (renamed to {})",
            path.display(),
            done.display()
        );
    }
    Ok(imported)
}

#[cfg(all(test, feature = "sqlite"))]
mod tests;
