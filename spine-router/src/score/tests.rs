use super::*;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn curves_have_the_documented_values() {
    let c = ScoreConfig::default();
    assert!(close(c.latency_score(None), 1.0));
    assert!(close(c.latency_score(Some(0.0)), 1.0));
    assert!(close(c.latency_score(Some(1_000.0)), 0.5));
    assert!(close(c.latency_score(Some(4_000.0)), 0.2));
    assert!(close(c.uptime_score(Duration::from_secs(30)), 1.0));
    assert!(close(c.uptime_score(Duration::from_secs(60)), 0.5));
    assert!(close(c.uptime_score(Duration::from_secs(90)), 0.0));
    assert!(close(c.uptime_score(Duration::from_secs(900)), 0.0));
    assert!(close(weight(0, 1.0), 1.0));
    assert!(close(weight(8_192, 0.0), 8_192.0 * 0.2));
    assert!(close(weight(8_192, 0.5), 8_192.0 * 0.6));
}

#[tokio::test(start_paused = true)]
async fn score_formula_and_ema() {
    let c = ScoreConfig::default();
    let t0 = Instant::now();
    let mut s = ScoreState::new(t0);
    // new node: optimistic prior
    assert!(close(s.parts(&c, t0).score, 1.0));
    s.failure(&c, t0);
    assert!(close(s.parts(&c, t0).success_rate_ema, 0.8));
    assert!(close(s.parts(&c, t0).failure_penalty, 0.8));
    s.success(&c, t0);
    assert!(close(s.parts(&c, t0).success_rate_ema, 0.84));
    // a success gives back 5 % of the missing penalty
    assert!(close(s.parts(&c, t0).failure_penalty, 0.8 + 0.2 * 0.05));
    s.ttft(&c, Duration::from_millis(1_000));
    s.ttft(&c, Duration::from_millis(2_000));
    assert!(close(s.parts(&c, t0).ttft_ema_ms.unwrap_or(0.0), 1_200.0));
    let base = 0.5 * 0.84 + 0.3 * (1_000.0 / 2_200.0) + 0.2;
    assert!(close(s.parts(&c, t0).score, base * 0.81));
    // 60 s later: uptime 0.5, and the penalty's missing part halved
    let later = t0 + Duration::from_secs(60);
    let base_later = 0.5 * 0.84 + 0.3 * (1_000.0 / 2_200.0) + 0.2 * 0.5;
    assert!(close(s.parts(&c, later).failure_penalty, 1.0 - 0.19 / 2.0));
    assert!(close(
        s.parts(&c, later).score,
        base_later * (1.0 - 0.19 / 2.0)
    ));
}

#[tokio::test(start_paused = true)]
async fn disconnect_halves_with_floor_and_recovers() {
    let c = ScoreConfig::default();
    let t0 = Instant::now();
    let mut s = ScoreState::new(t0);
    s.disconnect(&c, t0);
    // success 0.8 → base 0.9, halved
    assert!(close(s.parts(&c, t0).score, 0.45));
    for _ in 0..10 {
        s.disconnect(&c, t0);
    }
    assert!(close(s.parts(&c, t0).score, DISCONNECT_SCORE_FLOOR));
    // one half-life later the missing part of the penalty is halved
    let p0 = s.parts(&c, t0).failure_penalty;
    let p1 = s.parts(&c, t0 + Duration::from_secs(60)).failure_penalty;
    assert!(close(1.0 - p1, (1.0 - p0) / 2.0));
    assert!(s.parts(&c, t0 + Duration::from_secs(600)).failure_penalty > 0.99);
}

/// The penalty where a steady failure rate balances, as the module docs state them: run a
/// repeating pattern of attempts (no time passing) until it settles, return the penalty after a
/// whole number of patterns.
fn settled_penalty(pattern: &[char]) -> f64 {
    let c = ScoreConfig::default();
    let t0 = Instant::now();
    let mut s = ScoreState::new(t0);
    for _ in 0..500 {
        for a in pattern {
            match a {
                's' => s.success(&c, t0),
                'f' => s.failure(&c, t0),
                _ => s.disconnect(&c, t0),
            }
        }
    }
    s.parts(&c, t0).failure_penalty
}

#[tokio::test(start_paused = true)]
async fn penalty_settles_by_failure_rate() {
    let one_in_20: Vec<char> = std::iter::once('f')
        .chain(std::iter::repeat_n('s', 19))
        .collect();
    let p = settled_penalty(&one_in_20);
    assert!((0.85..0.95).contains(&p), "1 in 20: {p}");
    let p = settled_penalty(&['f', 's', 's', 's', 's']);
    assert!((0.45..0.6).contains(&p), "1 in 5: {p}");
    let p = settled_penalty(&['f', 's']);
    assert!((0.15..0.25).contains(&p), "1 in 2: {p}");
    let p = settled_penalty(&['d', 's']);
    assert!((0.05..0.15).contains(&p), "1 in 2 disconnects: {p}");
    // the score of a node failing half its attempts before the first byte (EMA ≈ 0.5):
    // weight factor (0.2 + 0.8·0.7·p) against a healthy (0.2 + 0.8) — under 4 % of 10 nodes
    let factor = 0.2 + 0.8 * 0.7 * settled_penalty(&['f', 's']);
    assert!(factor / (factor + 9.0) < 0.04, "{factor}");
    assert!(settled_penalty(&['s']) >= 1.0);
}
