//! The Redis side of [`RateLimits::with_redis`] (feature `redis`): the GCRA and the reserving
//! token bucket as Lua scripts, and the fallback bookkeeping (module docs of
//! [`limits`](super), "Several instances").

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use spine_core::RequestId;

use super::KeyHash;

/// Longest wait for one Redis call on a request path; past it the local limiter decides.
pub(super) const REDIS_TIMEOUT: Duration = Duration::from_millis(100);
/// After a Redis failure, how long requests use the local limiters before Redis is tried again.
const REDIS_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Counter: rate-limit decisions taken locally because Redis failed or timed out.
pub const RATE_LIMIT_REDIS_FALLBACK: &str = "spine_rate_limit_redis_fallback_total";
/// Gauge: 1 while rate limits are enforced per instance (Redis unreachable), else 0.
pub const RATE_LIMIT_DEGRADED: &str = "spine_rate_limit_degraded";

/// GCRA for RPM. KEYS[1]: the key's RPM bucket; ARGV[1]: the limit (> 0). Returns 0 when the
/// request passes, else the microseconds until one would.
pub(super) const RPM_LUA: &str = r"
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
pub(super) const TPM_LUA: &str = r"
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

/// The Redis side of [`RateLimits::with_redis`](super::RateLimits::with_redis).
pub(super) struct RedisLimits {
    pub(super) conn: redis::aio::ConnectionManager,
    pub(super) key_prefix: String,
    pub(super) rpm_script: redis::Script,
    pub(super) tpm_script: redis::Script,
    /// Whether the last Redis call failed (decisions are local until it answers again).
    pub(super) degraded: AtomicBool,
    /// While degraded: when to try Redis again.
    pub(super) retry_at: Mutex<Option<Instant>>,
    /// Admitted requests whose TPM reservation is in Redis: key, tokens, capacity.
    pub(super) reservations: Mutex<HashMap<RequestId, (KeyHash, u64, u64)>>,
}

impl RedisLimits {
    /// Whether to ask Redis now (not degraded, or degraded long enough to try again).
    pub(super) fn usable(&self) -> bool {
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
    pub(super) async fn invoke<T: redis::FromRedisValue>(
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

    pub(super) fn bucket_key(&self, kind: &str, key: &KeyHash) -> String {
        format!("{}rl:{kind}:{}", self.key_prefix, key.0)
    }
}

impl RedisLimits {
    /// Gives back what `request_id` reserved in Redis and did not use, on a spawned task
    /// bounded by [`REDIS_TIMEOUT`]. `false` when its reservation is not in Redis (it was taken
    /// locally, or already released).
    pub(super) fn release(&self, request_id: &RequestId, used_tokens: u64) -> bool {
        let Some((key, reserved, tpm)) = self
            .reservations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(request_id)
        else {
            return false;
        };
        let refund = reserved.saturating_sub(used_tokens);
        if refund == 0 {
            return true;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::debug!("no runtime to refund a TPM reservation; it comes back by refill");
            return true;
        };
        let bucket = self.bucket_key("tpm", &key);
        let script = self.tpm_script.clone();
        let mut conn = self.conn.clone();
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
        true
    }
}
