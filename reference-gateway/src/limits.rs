//! Admission limits per API key (single instance): requests per minute (RPM) and tokens per
//! minute (TPM).
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
//! # Several instances (design brief §8)
//!
//! [`RateLimits::with_redis`] keeps both buckets in Redis, so N instances give a key its limit
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

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use governor::clock::Clock;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use serde::{Deserialize, Serialize};
use spine_core::RequestId;
use spine_meter::meter::{Admission, AdmissionRefusal, AdmissionRequest, AdmitFuture};
use spine_meter::Store;

/// Longest wait for one Redis call on a request path; past it the local limiter decides.
const REDIS_TIMEOUT: Duration = Duration::from_millis(100);
/// After a Redis failure, how long requests use the local limiters before Redis is tried again.
const REDIS_RETRY_AFTER: Duration = Duration::from_secs(1);
/// How long an instance trusts a key's limits read from the store.
const KEY_LIMITS_CACHE_TTL: Duration = Duration::from_secs(10);
/// Counter: rate-limit decisions taken locally because Redis failed or timed out.
pub(crate) const RATE_LIMIT_REDIS_FALLBACK: &str = "spine_rate_limit_redis_fallback_total";
/// Gauge: 1 while rate limits are enforced per instance (Redis unreachable), else 0.
pub(crate) const RATE_LIMIT_DEGRADED: &str = "spine_rate_limit_degraded";

/// GCRA for RPM. KEYS[1]: the key's RPM bucket; ARGV[1]: the limit (> 0). Returns 0 when the
/// request passes, else the microseconds until one would.
const RPM_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local period = 60000000 / tonumber(ARGV[1])
local tat = tonumber(redis.call('GET', KEYS[1]))
if tat == nil or tat < now then tat = now end
local new_tat = tat + period
if new_tat - now > 60000000 then
  return math.ceil(new_tat - now - 60000000)
end
redis.call('SET', KEYS[1], string.format('%.0f', new_tat), 'PX', math.ceil((new_tat - now) / 1000) + 1)
return 0
";

/// The TPM bucket. KEYS[1]: the key's TPM bucket; ARGV: capacity (> 0), tokens, `reserve` or
/// `refund`. Returns `{1, 0}` (done), `{0, wait_ms}` (reserve: not yet) or `{0, -1}` (reserve:
/// more than the capacity, never).
const TPM_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local cap = tonumber(ARGV[1])
local n = tonumber(ARGV[2])
local s = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(s[1])
local ts = tonumber(s[2])
if tokens == nil or ts == nil then tokens = cap; ts = now end
if tokens > cap then tokens = cap end
if now > ts then tokens = math.min(cap, tokens + (now - ts) * cap / 60000) end
local result = {1, 0}
if ARGV[3] == 'reserve' then
  if n > cap then return {0, -1} end
  if n <= tokens then
    tokens = tokens - n
  else
    result = {0, math.ceil((n - tokens) * 60000 / cap)}
  end
else
  tokens = math.min(cap, tokens + n)
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'ts', string.format('%.3f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil((cap - tokens) * 60000 / cap) + 1000)
return result
";

/// The Redis side of [`RateLimits::with_redis`].
struct RedisLimits {
    conn: redis::aio::ConnectionManager,
    key_prefix: String,
    rpm_script: redis::Script,
    tpm_script: redis::Script,
    /// Whether the last Redis call failed (decisions are local until it answers again).
    degraded: AtomicBool,
    /// While degraded: when to try Redis again.
    retry_at: Mutex<Option<Instant>>,
    /// Admitted requests whose TPM reservation is in Redis: key, tokens, capacity.
    reservations: Mutex<HashMap<RequestId, (KeyHash, u64, u64)>>,
}

impl RedisLimits {
    /// Whether to ask Redis now (not degraded, or degraded long enough to try again).
    fn usable(&self) -> bool {
        if !self.degraded.load(Ordering::Acquire) {
            return true;
        }
        let retry_at = self.retry_at.lock().unwrap_or_else(|e| e.into_inner());
        retry_at.is_none_or(|at| Instant::now() >= at)
    }

    fn failed(&self, error: &dyn std::fmt::Display) {
        *self.retry_at.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(Instant::now() + REDIS_RETRY_AFTER);
        metrics::counter!(RATE_LIMIT_REDIS_FALLBACK).increment(1);
        if !self.degraded.swap(true, Ordering::AcqRel) {
            metrics::gauge!(RATE_LIMIT_DEGRADED).set(1.0);
            tracing::warn!(
                error = %error,
                "Redis unreachable: rate limits are enforced by this instance alone until it returns (each instance allows the full limit)"
            );
        }
    }

    fn succeeded(&self) {
        if self.degraded.swap(false, Ordering::AcqRel) {
            metrics::gauge!(RATE_LIMIT_DEGRADED).set(0.0);
            tracing::info!("Redis reachable again: rate limits are shared across instances");
        }
    }

    /// Runs `script` with one key and `args`, within [`REDIS_TIMEOUT`]; `None` on any failure
    /// (recorded: the caller decides locally).
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        script: &redis::Script,
        key: &str,
        args: &[String],
    ) -> Option<T> {
        let mut invocation = script.prepare_invoke();
        invocation.key(key);
        for a in args {
            invocation.arg(a.as_str());
        }
        let mut conn = self.conn.clone();
        match tokio::time::timeout(REDIS_TIMEOUT, invocation.invoke_async::<T>(&mut conn)).await {
            Ok(Ok(v)) => {
                self.succeeded();
                Some(v)
            }
            Ok(Err(e)) => {
                self.failed(&e);
                None
            }
            Err(_) => {
                self.failed(&"no answer within 100 ms");
                None
            }
        }
    }

    fn bucket_key(&self, kind: &str, key: &KeyHash) -> String {
        format!("{}rl:{kind}:{}", self.key_prefix, key.0)
    }
}

/// The caller's API key, as the store knows it (SHA-256 hex); put in the request extensions by
/// the handler so the admission hook knows whose bucket to use.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct KeyHash(pub(crate) String);

/// One key's own limits; `None` = the gateway default, `Some(0)` = unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct KeyLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) rpm_limit: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tpm_limit: Option<u64>,
}

/// A refusal, for the 429.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Refused {
    /// Seconds until a retry can pass, rounded up (at least 1); `None`: never as sent.
    pub(crate) retry_after_secs: Option<u64>,
    pub(crate) message: String,
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

/// Per-key RPM and TPM limits. Cheap to share (`Arc`).
pub(crate) struct RateLimits {
    default_rpm: u32,
    default_tpm: u64,
    /// Per-key limits: all of them (no store: in memory only), or those read from `store`
    /// (cache).
    keys: Mutex<HashMap<String, KeyLimits>>,
    /// Where per-key limits live, and when each key's was read.
    store: Option<StoreLimits>,
    rpm: Mutex<HashMap<KeyHash, Arc<DefaultDirectRateLimiter>>>,
    tpm: Mutex<TpmState>,
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
    pub(crate) fn with_store(default_rpm: u32, default_tpm: u64, store: Arc<dyn Store>) -> Self {
        let mut this = Self::in_memory(default_rpm, default_tpm);
        this.store = Some(StoreLimits {
            store,
            fetched: Mutex::new(HashMap::new()),
        });
        this
    }

    /// Limits with the gateway defaults and per-key limits kept in memory only.
    pub(crate) fn in_memory(default_rpm: u32, default_tpm: u64) -> Self {
        Self {
            default_rpm,
            default_tpm,
            keys: Mutex::new(HashMap::new()),
            store: None,
            rpm: Mutex::new(HashMap::new()),
            tpm: Mutex::new(TpmState::default()),
            redis: None,
        }
    }

    /// Limits shared by several gateway instances (module docs, "Several instances"): buckets
    /// in Redis through `conn` (the instance's one shared connection) under `key_prefix`
    /// (e.g. `spine:`), per-key limits in `store`, the gateway defaults otherwise.
    pub(crate) fn with_redis(
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
                rpm_script: redis::Script::new(RPM_LUA),
                tpm_script: redis::Script::new(TPM_LUA),
                degraded: AtomicBool::new(false),
                retry_at: Mutex::new(None),
                reservations: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Whether decisions are local because Redis is unreachable (always false without Redis).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn is_degraded(&self) -> bool {
        self.redis
            .as_ref()
            .is_some_and(|r| r.degraded.load(Ordering::Acquire))
    }

    /// Records a new key's own limits (nothing to record when both are `None`) in the store
    /// (or in memory without one).
    pub(crate) async fn set_key_limits(
        &self,
        key: &KeyHash,
        limits: KeyLimits,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        if limits == KeyLimits::default() {
            return Ok(());
        }
        if let Some(StoreLimits { store, fetched }) = &self.store {
            store
                .set_key_limits(
                    &key.0,
                    spine_meter::KeyLimits {
                        rpm_limit: limits.rpm_limit,
                        tpm_limit: limits.tpm_limit,
                    },
                )
                .await?;
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
                        let own = own.map_or_else(KeyLimits::default, |l| KeyLimits {
                            rpm_limit: l.rpm_limit,
                            tpm_limit: l.tpm_limit,
                        });
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
    /// (0 = unlimited).
    pub(crate) fn effective(&self, key: &KeyHash) -> (u32, u64) {
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
    pub(crate) async fn check_rpm(&self, key: &KeyHash) -> Result<(), Refused> {
        let (rpm, _) = self.effective_now(key).await;
        let Some(rpm) = NonZeroU32::new(rpm) else {
            return Ok(());
        };
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
        let in_redis = self.redis.as_ref().and_then(|r| {
            r.reservations
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(request_id)
                .map(|res| (r, res))
        });
        let Some((redis, (key, reserved, tpm))) = in_redis else {
            self.release_tpm(request_id, used_tokens, Instant::now());
            return;
        };
        let refund = reserved.saturating_sub(used_tokens);
        if refund == 0 {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::debug!("no runtime to refund a TPM reservation; it comes back by refill");
            return;
        };
        let bucket = redis.bucket_key("tpm", &key);
        let script = redis.tpm_script.clone();
        let mut conn = redis.conn.clone();
        runtime.spawn(async move {
            let mut invocation = script.prepare_invoke();
            invocation.key(&bucket).arg(tpm).arg(refund).arg("refund");
            let answer = tokio::time::timeout(
                REDIS_TIMEOUT,
                invocation.invoke_async::<Vec<i64>>(&mut conn),
            )
            .await;
            if !matches!(answer, Ok(Ok(_))) {
                // the bucket refills by itself within a minute
                tracing::debug!("TPM refund to Redis failed");
            }
        });
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
pub(crate) fn tpm_refusal(refused: Refused) -> AdmissionRefusal {
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
/// keys were imported (0 when there is no file).
///
/// # Errors
///
/// The file cannot be read or is not a key limits file, the store fails (nothing is renamed:
/// the next start imports again), or the rename fails.
pub(crate) async fn import_key_limits_file(
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
        store
            .set_key_limits(
                &key_hash,
                spine_meter::KeyLimits {
                    rpm_limit: limits.rpm_limit,
                    tpm_limit: limits.tpm_limit,
                },
            )
            .await?;
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
    Ok(imported)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn limits(rpm: u32, tpm: u64) -> RateLimits {
        RateLimits::in_memory(rpm, tpm)
    }

    #[tokio::test]
    async fn rpm_allows_the_burst_then_refuses_with_retry_after() {
        let l = limits(3, 0);
        let k = KeyHash("k".into());
        for _ in 0..3 {
            assert_eq!(l.check_rpm(&k).await, Ok(()));
        }
        let refused = l.check_rpm(&k).await.unwrap_err();
        // one request comes back every 20 s
        let secs = refused.retry_after_secs.unwrap();
        assert!((19..=20).contains(&secs), "{secs}");
        assert!(refused.message.contains("Limit 3"), "{}", refused.message);
        // another key has its own budget; 0 is unlimited
        assert_eq!(l.check_rpm(&KeyHash("other".into())).await, Ok(()));
        let unlimited = limits(0, 0);
        for _ in 0..1000 {
            assert_eq!(unlimited.check_rpm(&k).await, Ok(()));
        }
    }

    #[tokio::test]
    async fn per_key_limits_override_defaults_and_persist() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("spine.db");
        let store: Arc<dyn Store> = Arc::new(spine_meter::SqliteLedger::open(&db).await.unwrap());
        let l = RateLimits::with_store(10, 1000, store.clone());
        let k = KeyHash("abc".into());
        l.set_key_limits(
            &k,
            KeyLimits {
                rpm_limit: Some(1),
                tpm_limit: None,
            },
        )
        .await
        .unwrap();
        assert_eq!(l.effective(&k), (1, 1000));
        assert_eq!(l.effective(&KeyHash("other".into())), (10, 1000));
        // in the store: a restart (a new process on the same database file) reads them back
        drop(l);
        drop(store);
        let reopened: Arc<dyn Store> =
            Arc::new(spine_meter::SqliteLedger::open(&db).await.unwrap());
        let again = RateLimits::with_store(0, 0, reopened);
        assert_eq!(again.effective(&k), (0, 0), "not read yet");
        assert_eq!(again.effective_now(&k).await, (1, 0));
        assert_eq!(again.effective_now(&KeyHash("other".into())).await, (0, 0));
        assert!(!dir.path().join("key_limits.json").exists());
    }

    #[test]
    fn tpm_reserves_refunds_and_refills() {
        let l = limits(0, 600); // 10 tokens a second
        let k = KeyHash("k".into());
        let t0 = Instant::now();
        let (a, b, c) = (
            RequestId::new("a"),
            RequestId::new("b"),
            RequestId::new("c"),
        );
        assert_eq!(l.reserve_tpm(&k, &a, 500, t0), Ok(()));
        // 100 left: 300 more is 200 short = 20 s
        let refused = l.reserve_tpm(&k, &b, 300, t0).unwrap_err();
        assert_eq!(refused.retry_after_secs, Some(20));
        // a used only 150 of its 500: 350 come back at once
        l.release_tpm(&a, 150, t0);
        l.release_tpm(&a, 0, t0); // idempotent
        assert_eq!(l.reserve_tpm(&k, &b, 450, t0), Ok(()));
        assert_eq!(
            l.reserve_tpm(&k, &c, 10, t0).unwrap_err().retry_after_secs,
            Some(1)
        );
        // 3 s later 30 tokens are back
        let t3 = t0 + Duration::from_secs(3);
        assert_eq!(l.reserve_tpm(&k, &c, 30, t3), Ok(()));
        // more than the whole budget never fits
        let too_big = l
            .reserve_tpm(&k, &RequestId::new("d"), 601, t3)
            .unwrap_err();
        assert_eq!(too_big.retry_after_secs, None);
        assert!(too_big.message.starts_with("Request too large"));
    }
}

/// Against the real Redis (`SPINE_TEST_REDIS_URL`, default `redis://127.0.0.1:6379`), each test
/// under its own key prefix, deleted at the end.
#[cfg(test)]
mod redis_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use std::net::SocketAddr;

    use super::*;

    fn redis_url() -> String {
        std::env::var("SPINE_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
    }

    fn unique_prefix(test: &str) -> String {
        format!(
            "spine-test-{test}-{}-{}:",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        )
    }

    async fn manager(url: &str) -> redis::aio::ConnectionManager {
        redis::Client::open(url)
            .unwrap()
            .get_connection_manager()
            .await
            .unwrap_or_else(|e| panic!("Redis unreachable at {url}: {e}"))
    }

    async fn store() -> Arc<dyn Store> {
        Arc::new(spine_meter::SqliteLedger::in_memory().await.unwrap())
    }

    /// Deletes every key under `prefix`; returns how many there were.
    async fn cleanup(prefix: &str) -> usize {
        let mut conn = manager(&redis_url()).await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query_async(&mut conn)
            .await
            .unwrap();
        if !keys.is_empty() {
            let _: () = redis::cmd("DEL")
                .arg(&keys)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        keys.len()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_instances_sharing_redis_give_the_limit_once() {
        let prefix = unique_prefix("shared");
        let store = store().await;
        let a = RateLimits::with_redis(
            manager(&redis_url()).await,
            prefix.clone(),
            5,
            1_000,
            store.clone(),
        );
        let b = RateLimits::with_redis(
            manager(&redis_url()).await,
            prefix.clone(),
            5,
            1_000,
            store.clone(),
        );
        let k = KeyHash("k1".into());

        // RPM 5: five requests alternating between the instances pass, the sixth is refused on
        // both (not 5 per instance)
        for i in 0..5 {
            let l = if i % 2 == 0 { &a } else { &b };
            assert_eq!(l.check_rpm(&k).await, Ok(()), "request {i}");
        }
        for l in [&a, &b] {
            let refused = l.check_rpm(&k).await.unwrap_err();
            // one comes back every 12 s
            let secs = refused.retry_after_secs.unwrap();
            assert!((11..=12).contains(&secs), "{secs}");
            assert!(refused.message.contains("Limit 5"), "{}", refused.message);
        }
        assert!(!a.is_degraded() && !b.is_degraded());

        // TPM 1000: A reserves 600, B cannot get 500 (400 left) until A's unused 500 come back
        let (r1, r2, r3) = (
            RequestId::new("r1"),
            RequestId::new("r2"),
            RequestId::new("r3"),
        );
        assert_eq!(a.reserve_tpm_shared(&k, &r1, 600).await, Ok(()));
        let refused = b.reserve_tpm_shared(&k, &r2, 500).await.unwrap_err();
        // 100 short at 1000/min: 6 s
        assert_eq!(refused.retry_after_secs, Some(6));
        let too_big = b.reserve_tpm_shared(&k, &r2, 1_001).await.unwrap_err();
        assert_eq!(too_big.retry_after_secs, None);
        a.release_shared(&r1, 100);
        a.release_shared(&r1, 0); // idempotent: nothing more comes back
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match b.reserve_tpm_shared(&k, &r2, 500).await {
                Ok(()) => break,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("refund never arrived: {e:?}"),
            }
        }
        // 1000 − 100 used − 500 = 400 left (plus a little refill): 450 does not fit
        assert!(b.reserve_tpm_shared(&k, &r3, 450).await.is_err());

        // per-key limits set on one instance hold on the other (kept in the store)
        let k2 = KeyHash("k2".into());
        a.set_key_limits(
            &k2,
            KeyLimits {
                rpm_limit: Some(1),
                tpm_limit: Some(0),
            },
        )
        .await
        .unwrap();
        assert_eq!(b.effective_now(&k2).await, (1, 0));
        assert_eq!(b.check_rpm(&k2).await, Ok(()));
        assert!(a.check_rpm(&k2).await.is_err());
        // unlimited TPM for k2: nothing reserved, nothing stored
        assert_eq!(a.reserve_tpm_shared(&k2, &r3, 1_000_000).await, Ok(()));

        // idle keys expire: every bucket key carries a TTL
        let mut conn = manager(&redis_url()).await;
        for kind in ["rpm", "tpm"] {
            let ttl_ms: i64 = redis::cmd("PTTL")
                .arg(format!("{prefix}rl:{kind}:k1"))
                .query_async(&mut conn)
                .await
                .unwrap();
            assert!((1..=61_000).contains(&ttl_ms), "{kind}: {ttl_ms}");
        }
        assert_eq!(cleanup(&prefix).await, 3);
    }

    use spine_test_support::CutProxy;

    fn redis_addr() -> SocketAddr {
        let url = redis_url();
        let hostport = url
            .trim_start_matches("redis://")
            .split(['/', '?'])
            .next()
            .unwrap()
            .rsplit('@')
            .next()
            .unwrap()
            .replace("localhost", "127.0.0.1");
        hostport.parse().unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_cut_falls_back_to_local_limits_without_hanging_then_recovers() {
        let prefix = unique_prefix("cut");
        let proxy = CutProxy::start(redis_addr()).await.unwrap();
        let l = RateLimits::with_redis(
            manager(&format!("redis://{}", proxy.addr())).await,
            prefix.clone(),
            3,
            0,
            store().await,
        );
        let k = KeyHash("k".into());
        assert_eq!(l.check_rpm(&k).await, Ok(()));
        assert!(!l.is_degraded());

        proxy.cut().await;
        // each decision while Redis is gone: local, bounded by the 100 ms Redis timeout
        let mut slowest = Duration::ZERO;
        let mut passed = 0;
        for _ in 0..5 {
            let started = Instant::now();
            if l.check_rpm(&k).await.is_ok() {
                passed += 1;
            }
            slowest = slowest.max(started.elapsed());
        }
        eprintln!(
            "slowest decision with Redis cut: {} ms",
            slowest.as_millis()
        );
        assert!(slowest < Duration::from_millis(500), "{slowest:?}");
        assert!(l.is_degraded());
        // degraded: this instance enforces the full limit by itself
        assert_eq!(passed, 3);

        proxy.restore().unwrap();
        let restored = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let _ = l.check_rpm(&KeyHash("probe".into())).await;
            if !l.is_degraded() {
                break;
            }
            assert!(
                restored.elapsed() < Duration::from_secs(15),
                "never went back to Redis"
            );
        }
        eprintln!(
            "back on Redis {} ms after it returned",
            restored.elapsed().as_millis()
        );
        // the shared bucket still counts the request made before the cut: 2 more, then refused
        assert_eq!(l.check_rpm(&k).await, Ok(()));
        assert_eq!(l.check_rpm(&k).await, Ok(()));
        assert!(l.check_rpm(&k).await.is_err());
        assert_eq!(cleanup(&prefix).await, 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hanging_redis_costs_at_most_the_timeout_per_decision() {
        let prefix = unique_prefix("stall");
        let proxy = CutProxy::start(redis_addr()).await.unwrap();
        let l = RateLimits::with_redis(
            manager(&format!("redis://{}", proxy.addr())).await,
            prefix.clone(),
            2,
            1_000,
            store().await,
        );
        let k = KeyHash("k".into());
        assert_eq!(l.check_rpm(&k).await, Ok(()));
        proxy.stall(true);
        let started = Instant::now();
        // the first decision waits for the 100 ms timeout; the next ones go local at once
        // (Redis is tried again after a second)
        assert_eq!(l.check_rpm(&k).await, Ok(()));
        let first = started.elapsed();
        let again = Instant::now();
        assert_eq!(l.check_rpm(&k).await, Ok(()));
        assert_eq!(
            l.reserve_tpm_shared(&k, &RequestId::new("r"), 10).await,
            Ok(())
        );
        let next = again.elapsed();
        eprintln!(
            "Redis hanging: first decision {} ms, next two {} ms",
            first.as_millis(),
            next.as_millis()
        );
        assert!(l.is_degraded());
        assert!(
            first >= REDIS_TIMEOUT && first < Duration::from_millis(500),
            "{first:?}"
        );
        assert!(next < Duration::from_millis(50), "{next:?}");
        // local limiter: 2 per minute, both used
        assert!(l.check_rpm(&k).await.is_err());
        proxy.stall(false);
        drop(l);
        cleanup(&prefix).await;
    }

    /// Switching a gateway from one instance to several (same database, `redis_url` set) keeps
    /// every key's own limits: those set by this release in single-instance mode (in the store)
    /// and those an earlier release kept in `<data_dir>/key_limits.json` (imported once at
    /// start, the file renamed).
    #[tokio::test]
    async fn single_instance_key_limits_survive_switching_to_multi_instance() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("key_limits.json");
        let db = dir.path().join("spine.db");
        let store: Arc<dyn Store> = Arc::new(spine_meter::SqliteLedger::open(&db).await.unwrap());
        // an earlier release's file: one key with limits, one already in the store (the store
        // wins), one with neither limit
        let (legacy, both, none) = (
            KeyHash("legacy-key".into()),
            KeyHash("both-key".into()),
            KeyHash("none-key".into()),
        );
        store
            .set_key_limits(
                &both.0,
                spine_meter::KeyLimits {
                    rpm_limit: Some(7),
                    tpm_limit: None,
                },
            )
            .await
            .unwrap();
        std::fs::write(
            &file,
            serde_json::to_vec(&serde_json::json!({
                legacy.0.clone(): {"rpm_limit": 3, "tpm_limit": 300},
                both.0.clone(): {"rpm_limit": 9},
                none.0.clone(): {},
            }))
            .unwrap(),
        )
        .unwrap();
        assert_eq!(import_key_limits_file(&file, &*store).await.unwrap(), 1);
        assert!(!file.exists());
        assert!(dir.path().join("key_limits.json.imported").exists());
        // imported once: a second start finds no file
        assert_eq!(import_key_limits_file(&file, &*store).await.unwrap(), 0);

        // this release, single instance: a key created with its own limits
        let single = RateLimits::with_store(0, 0, store.clone());
        let k = KeyHash("limited-key".into());
        single
            .set_key_limits(
                &k,
                KeyLimits {
                    rpm_limit: Some(2),
                    tpm_limit: Some(100),
                },
            )
            .await
            .unwrap();
        assert_eq!(single.effective(&k), (2, 100));
        drop(single);
        // the operator sets redis_url (and the defaults stay 0 = unlimited)
        let prefix = unique_prefix("switch");
        let multi =
            RateLimits::with_redis(manager(&redis_url()).await, prefix.clone(), 0, 0, store);
        assert_eq!(
            multi.effective_now(&k).await,
            (2, 100),
            "the key's own limits were dropped"
        );
        assert_eq!(multi.effective_now(&legacy).await, (3, 300));
        assert_eq!(multi.effective_now(&both).await, (7, 0));
        assert_eq!(multi.effective_now(&none).await, (0, 0));
        // and enforced: the third request of the minute is refused
        assert_eq!(multi.check_rpm(&k).await, Ok(()));
        assert_eq!(multi.check_rpm(&k).await, Ok(()));
        assert!(multi.check_rpm(&k).await.is_err());
        drop(multi);
        cleanup(&prefix).await;
    }
}
