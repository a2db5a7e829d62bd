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
//! `{"rpm_limit", "tpm_limit"}`) and kept, by the SHA-256 of the key, in
//! `<data_dir>/key_limits.json`; keys without their own limit get the gateway's
//! `default_rpm_limit` / `default_tpm_limit`. 0 means unlimited. (The ledger store does not hold
//! them yet: it is being reworked; they move there with a migration afterwards.)

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use governor::clock::Clock;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use serde::{Deserialize, Serialize};
use spine_core::RequestId;
use spine_meter::meter::{Admission, AdmissionRefusal, AdmissionRequest};

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

/// Per-key RPM and TPM limits. Cheap to share (`Arc`).
pub(crate) struct RateLimits {
    default_rpm: u32,
    default_tpm: u64,
    file: Option<PathBuf>,
    keys: Mutex<HashMap<String, KeyLimits>>,
    rpm: Mutex<HashMap<KeyHash, Arc<DefaultDirectRateLimiter>>>,
    tpm: Mutex<TpmState>,
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
    /// Limits with the gateway defaults and the per-key limits kept in `file` (created on the
    /// first key with its own limits; `None`: in memory only).
    pub(crate) fn load(
        default_rpm: u32,
        default_tpm: u64,
        file: Option<PathBuf>,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let keys = match &file {
            Some(path) if path.exists() => {
                let text = std::fs::read_to_string(path)?;
                serde_json::from_str(&text)
                    .map_err(|e| format!("{}: not a key limits file: {e}", path.display()))?
            }
            _ => HashMap::new(),
        };
        Ok(Self {
            default_rpm,
            default_tpm,
            file,
            keys: Mutex::new(keys),
            rpm: Mutex::new(HashMap::new()),
            tpm: Mutex::new(TpmState::default()),
        })
    }

    /// Records a new key's own limits (nothing to record when both are `None`).
    pub(crate) fn set_key_limits(
        &self,
        key: &KeyHash,
        limits: KeyLimits,
    ) -> Result<(), std::io::Error> {
        if limits == KeyLimits::default() {
            return Ok(());
        }
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        keys.insert(key.0.clone(), limits);
        if let Some(path) = &self.file {
            write_atomically(path, &serde_json::to_vec_pretty(&*keys)?)?;
        }
        Ok(())
    }

    /// The limits in force for `key`: its own, else the defaults (0 = unlimited).
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

    /// Counts one request against `key`'s RPM limit.
    pub(crate) fn check_rpm(&self, key: &KeyHash) -> Result<(), Refused> {
        let (rpm, _) = self.effective(key);
        let Some(rpm) = NonZeroU32::new(rpm) else {
            return Ok(());
        };
        let limiter = self
            .rpm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.clone())
            .or_insert_with(|| Arc::new(RateLimiter::direct(Quota::per_minute(rpm))))
            .clone();
        limiter.check().map_err(|not_until| {
            let wait = not_until.wait_time_from(limiter.clock().now());
            let secs = ceil_secs(wait);
            Refused {
                retry_after_secs: Some(secs),
                message: format!(
                    "Rate limit reached for requests per min (RPM): Limit {rpm}. Please try again in {secs}s."
                ),
            }
        })
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
            Err(None) => Err(Refused {
                retry_after_secs: None,
                message: format!(
                    "Request too large for tokens per min (TPM): Limit {tpm}, Requested {tokens} (prompt + max_tokens × choices). Lower max_tokens or the prompt."
                ),
            }),
            Err(Some(wait)) => {
                let secs = ceil_secs(wait);
                Err(Refused {
                    retry_after_secs: Some(secs),
                    message: format!(
                        "Rate limit reached for tokens per min (TPM): Limit {tpm}, Requested {tokens}. Please try again in {secs}s."
                    ),
                })
            }
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

/// The 429 the metering layer's refusal becomes: the reason and `Retry-After`.
pub(crate) fn tpm_refusal(refused: Refused) -> AdmissionRefusal {
    AdmissionRefusal::new(
        refused.retry_after_secs.map(Duration::from_secs),
        refused.message,
    )
}

impl Admission for RateLimits {
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

    fn release(&self, request_id: &RequestId, used_tokens: u64) {
        self.release_tpm(request_id, used_tokens, Instant::now());
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn limits(rpm: u32, tpm: u64) -> RateLimits {
        RateLimits::load(rpm, tpm, None).unwrap()
    }

    #[test]
    fn rpm_allows_the_burst_then_refuses_with_retry_after() {
        let l = limits(3, 0);
        let k = KeyHash("k".into());
        for _ in 0..3 {
            assert_eq!(l.check_rpm(&k), Ok(()));
        }
        let refused = l.check_rpm(&k).unwrap_err();
        // one request comes back every 20 s
        let secs = refused.retry_after_secs.unwrap();
        assert!((19..=20).contains(&secs), "{secs}");
        assert!(refused.message.contains("Limit 3"), "{}", refused.message);
        // another key has its own budget; 0 is unlimited
        assert_eq!(l.check_rpm(&KeyHash("other".into())), Ok(()));
        let unlimited = limits(0, 0);
        for _ in 0..1000 {
            assert_eq!(unlimited.check_rpm(&k), Ok(()));
        }
    }

    #[test]
    fn per_key_limits_override_defaults_and_persist() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("key_limits.json");
        let l = RateLimits::load(10, 1000, Some(file.clone())).unwrap();
        let k = KeyHash("abc".into());
        l.set_key_limits(
            &k,
            KeyLimits {
                rpm_limit: Some(1),
                tpm_limit: None,
            },
        )
        .unwrap();
        assert_eq!(l.effective(&k), (1, 1000));
        assert_eq!(l.effective(&KeyHash("other".into())), (10, 1000));
        let again = RateLimits::load(0, 0, Some(file)).unwrap();
        assert_eq!(again.effective(&k), (1, 0));
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
