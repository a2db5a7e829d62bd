//! Unit tests of the rate limits: in this process, and (feature `redis`) against the real Redis.

/// In this process.
mod local {
    #![allow(clippy::unwrap_used)]
    use super::super::*;

    fn limits(rpm: u32, tpm: u64) -> RateLimits {
        RateLimits::in_memory(rpm, tpm)
    }

    #[test]
    fn console_limits_stay_within_the_defaults() {
        let capped = limits(60, 10_000);
        let asked = |rpm, tpm| KeyLimits {
            rpm_limit: rpm,
            tpm_limit: tpm,
        };
        assert_eq!(capped.defaults(), (60, 10_000));
        assert!(capped.within_defaults(asked(None, None)));
        assert!(capped.within_defaults(asked(Some(1), Some(10_000))));
        assert!(!capped.within_defaults(asked(Some(61), None)));
        assert!(!capped.within_defaults(asked(None, Some(10_001))));
        assert!(!capped.within_defaults(asked(Some(0), None)), "unlimited");
        let open = limits(0, 0);
        assert!(open.within_defaults(asked(Some(0), Some(u64::MAX))));
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
        let store: Arc<dyn Store> = Arc::new(crate::SqliteLedger::open(&db).await.unwrap());
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
        let reopened: Arc<dyn Store> = Arc::new(crate::SqliteLedger::open(&db).await.unwrap());
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
#[cfg(feature = "redis")]
mod redis_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use std::net::SocketAddr;

    use super::super::shared::REDIS_TIMEOUT;
    use super::super::*;

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
        Arc::new(crate::SqliteLedger::in_memory().await.unwrap())
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
        let store: Arc<dyn Store> = Arc::new(crate::SqliteLedger::open(&db).await.unwrap());
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
                crate::KeyLimits {
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
