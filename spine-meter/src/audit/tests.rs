#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use spine_core::{AuditVerdict, ModelId, ModelTrust, NodeId, RequestId, RequestKind};

use super::*;

fn top(pairs: &[(&str, f64)]) -> Vec<TopToken> {
    pairs
        .iter()
        .map(|(t, p)| TopToken {
            bytes: t.as_bytes().to_vec(),
            logprob: p.ln(),
        })
        .collect()
}

fn tok(forced: &str, pairs: &[(&str, f64)]) -> ScoredToken {
    ScoredToken {
        bytes: forced.as_bytes().to_vec(),
        top: top(pairs),
    }
}

#[test]
fn greedy_counts_clear_positions_and_judges_the_text_not_the_token_id() {
    let cfg = ScoreConfig::default();
    let text = "Hola amigo!";
    let tokens = vec![
        // the reference's top-1 is the forced token: agreement
        tok("Hola", &[("Hola", 0.9), ("Hi", 0.05)]),
        // a near-tie: not counted
        tok(" amigo", &[(" amigo", 0.5), (" friend", 0.45)]),
        // the reference prefers a different split of the same text: agreement, not an event
        // (the re-tokenization [16864, 315] of a node's [90, 17476])
        tok("!", &[("!", 0.2), (" ", 0.01)]),
    ];
    // the last position is never scored; extend the text by one position
    let mut tokens2 = tokens.clone();
    tokens2.push(tok("", &[]));
    let obs = observations(&tokens2, text.as_bytes(), SamplingMode::Greedy, &cfg).unwrap();
    assert_eq!(
        obs,
        vec![
            Observation {
                kind: ObservationKind::Greedy,
                event: false
            },
            Observation {
                kind: ObservationKind::Greedy,
                event: false
            },
        ]
    );
    let split = vec![
        tok("Sp", &[("Span", 0.9), ("Sp", 0.05)]),
        tok("anish", &[("ish", 0.9), ("anish", 0.05)]),
        tok(".", &[(".", 0.9)]),
    ];
    let obs = observations(&split, b"Spanish.", SamplingMode::Greedy, &cfg).unwrap();
    // "Span" agrees with the text "Spanish." although the forced token is "Sp"; at "anish." the
    // reference's clear top-1 "ish" does not continue the text: an event
    assert_eq!(
        obs.iter().map(|o| o.event).collect::<Vec<_>>(),
        [false, true]
    );
}

#[test]
fn sampled_events_are_text_outside_the_head_and_unknown_heads_do_not_count() {
    let cfg = ScoreConfig::default(); // tail 0.01
    let tokens = vec![
        // in the head (0.6 + 0.395 ≥ 0.99)
        tok(" b", &[(" a", 0.6), (" b", 0.395), (" z", 0.004)]),
        // outside the head: an event
        tok(" z", &[(" a", 0.6), (" b", 0.395), (" z", 0.004)]),
        // the listed tokens hold 0.9 < 0.99: the head is not known
        tok(" q", &[(" a", 0.5), (" b", 0.4)]),
        tok(".", &[]),
    ];
    let obs = observations(&tokens, b" b z q.", SamplingMode::Sampled, &cfg).unwrap();
    assert_eq!(
        obs.iter().map(|o| o.event).collect::<Vec<_>>(),
        [false, true]
    );
    assert!(obs.iter().all(|o| o.kind == ObservationKind::Sampled));
}

#[test]
fn forced_tokens_that_do_not_spell_the_text_are_refused() {
    let tokens = vec![tok("Hi", &[("Hi", 1.0)]), tok("!", &[])];
    assert_eq!(
        observations(
            &tokens,
            b"Ho!",
            SamplingMode::Greedy,
            &ScoreConfig::default()
        ),
        Err(ScoreError::TextMismatch(0))
    );
}

#[test]
fn wald_boundaries_and_the_floor() {
    let cfg = SprtConfig::default();
    assert!(cfg.is_valid());
    assert!((cfg.fail_threshold() - (0.99f64 / 1e-4).ln()).abs() < 1e-12);
    assert!((cfg.pass_threshold() - (0.01f64 / (1.0 - 1e-4)).ln()).abs() < 1e-12);
    let clear = Observation {
        kind: ObservationKind::Greedy,
        event: false,
    };
    let event = Observation {
        kind: ObservationKind::Greedy,
        event: true,
    };
    let mut honest = Sprt::default();
    assert_eq!(honest.verdict(&cfg), AuditVerdict::Unverified);
    let mut n = 0;
    while honest.verdict(&cfg) == AuditVerdict::Unverified {
        honest.observe(&cfg, clear);
        n += 1;
    }
    assert_eq!(honest.verdict(&cfg), AuditVerdict::Passing);
    // b / ln(0.92/0.99) clear positions
    let expect = (cfg.pass_threshold() / cfg.step(clear)).ceil() as u64;
    assert_eq!(n, expect);
    for _ in 0..10_000 {
        honest.observe(&cfg, clear);
    }
    assert_eq!(honest.llr, cfg.pass_threshold(), "held at the floor");
    // a node that turns: climbs from the floor, suspect on the way, then failed
    let mut seen_suspect = false;
    while honest.verdict(&cfg) != AuditVerdict::Failed {
        honest.observe(&cfg, event);
        seen_suspect |= honest.verdict(&cfg) == AuditVerdict::Suspect;
    }
    assert!(seen_suspect);
    let frozen = honest;
    honest.observe(&cfg, clear);
    assert_eq!(honest, frozen, "failed is absorbing");
}

/// Monte Carlo check of the stated α: an honest node at the design rate p0 (the worst honest
/// case) audited 2,000 tokens per run rarely fails; a substitute at p1 fails within 300 tokens
/// nearly always.
#[test]
fn error_rates_hold_at_the_design_rates() {
    use rand::{Rng, SeedableRng};
    let cfg = SprtConfig::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let run = |rng: &mut rand::rngs::StdRng, p: f64, tokens: usize| {
        let mut t = Sprt::default();
        for _ in 0..tokens {
            let event = rng.random_bool(p);
            t.observe(
                &cfg,
                Observation {
                    kind: ObservationKind::Greedy,
                    event,
                },
            );
        }
        t.rejected
    };
    let runs = 2_000;
    let honest_fails = (0..runs)
        .filter(|_| run(&mut rng, cfg.greedy_p0, 2_000))
        .count();
    // at the bound p0 itself; honest nodes measured far below it (docs/trust.md)
    assert!(
        honest_fails <= 4,
        "{honest_fails} of {runs} honest runs failed"
    );
    let caught = (0..runs).filter(|_| run(&mut rng, 0.17, 300)).count();
    assert!(caught >= runs * 99 / 100, "caught {caught} of {runs}");
}

#[test]
fn which_requests_are_auditable() {
    let chat = RequestKind::ChatCompletions;
    let ok = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0,"max_tokens":9,"stream":true,"stream_options":{"include_usage":true}}"#;
    let r = auditable(chat, ok).unwrap();
    assert_eq!(r.mode, SamplingMode::Greedy);
    assert!(matches!(r.prompt, AuditPrompt::Chat(_)));
    let sampled = br#"{"model":"m","messages":[],"temperature":0.7,"top_p":0.9,"seed":3}"#;
    assert_eq!(
        auditable(chat, sampled).unwrap().mode,
        SamplingMode::Sampled
    );
    let default_t = br#"{"model":"m","messages":[]}"#;
    assert_eq!(
        auditable(chat, default_t).unwrap().mode,
        SamplingMode::Sampled
    );
    for (body, why) in [
        (
            &br#"{"model":"m","messages":[],"tools":[{}]}"#[..],
            NotAuditable::Constrained,
        ),
        (
            br#"{"model":"m","messages":[],"logit_bias":{"1":5}}"#,
            NotAuditable::Constrained,
        ),
        (
            br#"{"model":"m","messages":[],"response_format":{"type":"json_object"}}"#,
            NotAuditable::Constrained,
        ),
        (
            br#"{"model":"m","messages":[],"presence_penalty":0.5}"#,
            NotAuditable::Constrained,
        ),
        (
            br#"{"model":"m","messages":[],"repeat_penalty":1.3}"#,
            NotAuditable::Constrained,
        ),
        (
            br#"{"model":"m","messages":[],"temperature":1.5}"#,
            NotAuditable::HotSampling,
        ),
        (br#"{"model":"m","messages":"hi"}"#, NotAuditable::Shape),
        (br#"[1]"#, NotAuditable::Shape),
    ] {
        assert_eq!(
            auditable(chat, body),
            Err(why),
            "{}",
            String::from_utf8_lossy(body)
        );
    }
    assert_eq!(
        auditable(
            RequestKind::Completions,
            br#"{"model":"m","prompt":"Once","presence_penalty":0}"#
        )
        .unwrap()
        .prompt,
        AuditPrompt::Text("Once".into())
    );
    assert_eq!(
        auditable(RequestKind::Completions, br#"{"model":"m","prompt":[1,2]}"#),
        Err(NotAuditable::Shape)
    );
}

/// A reference that agrees with whatever was delivered (an honest node), disagrees everywhere
/// (the node serves something else), or fails.
struct FakeReference {
    mode: &'static str,
    calls: AtomicUsize,
}

impl Reference for FakeReference {
    fn score<'a>(&'a self, q: &'a ReferenceQuery) -> ScoreFuture<'a> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            match self.mode {
                "down" => Err(ReferenceError::Unavailable("connection refused".into())),
                "garbage" => Ok(vec![tok("nope", &[])]),
                "slow" => {
                    tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
                    Ok(Vec::new())
                }
                mode => Ok(q
                    .completion
                    .split_inclusive(' ')
                    .map(|w| {
                        let top1 = if mode == "agree" { w } else { "\u{1F600}" };
                        tok(w, &[(top1, 0.95), ("?", 0.01)])
                    })
                    .collect()),
            }
        })
    }
}

fn sample(node: &str, completion: &str) -> AuditSample {
    AuditSample {
        request_id: RequestId::new("req"),
        node: NodeId::new(node),
        model: ModelId::new("m"),
        kind: RequestKind::ChatCompletions,
        request_body: bytes::Bytes::from_static(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0}"#,
        ),
        completion: completion.to_owned(),
        always: false,
    }
}

fn words(n: usize) -> String {
    (0..n).map(|i| format!("w{i} ")).collect()
}

#[tokio::test]
async fn an_honest_node_passes_a_substitute_fails_and_is_not_routed() {
    let set = ReferenceSet::new().with(
        ModelId::new("m"),
        Arc::new(FakeReference {
            mode: "agree",
            calls: AtomicUsize::new(0),
        }),
    );
    let honest = Auditor::spawn(AuditConfig::default().with_rate(1.0), Arc::new(set));
    assert_eq!(
        honest.audit_now(sample("a", &words(100))).await,
        Some(AuditVerdict::Passing)
    );
    assert!(honest.routable(&NodeId::new("a"), &ModelId::new("m")));

    let other = Auditor::spawn(
        AuditConfig::default().with_rate(1.0),
        Arc::new(FakeReference {
            mode: "disagree",
            calls: AtomicUsize::new(0),
        }),
    );
    assert_eq!(
        other.audit_now(sample("b", &words(20))).await,
        Some(AuditVerdict::Failed)
    );
    assert!(!other.routable(&NodeId::new("b"), &ModelId::new("m")));
    assert!(other.routable(&NodeId::new("a"), &ModelId::new("m")));
    let s = &other.statuses()[0];
    // the test stops at the rejection boundary: ceil(a / ln(p1/p0)) events
    let cfg = SprtConfig::default();
    let needed = (cfg.fail_threshold() / (cfg.greedy_p1 / cfg.greedy_p0).ln()).ceil() as u64;
    assert_eq!(
        (s.verdict, s.tokens_audited, s.events),
        (AuditVerdict::Failed, needed, needed)
    );
    assert!(s.statistic >= s.fail_threshold);
    // re-verified by its operator: routed again, unverified
    assert!(other.reverify(&NodeId::new("b"), &ModelId::new("m")));
    assert!(other.routable(&NodeId::new("b"), &ModelId::new("m")));
    assert_eq!(
        other.verdict(&NodeId::new("b"), &ModelId::new("m")),
        AuditVerdict::Unverified
    );
}

#[tokio::test(start_paused = true)]
async fn a_reference_down_slow_or_garbage_is_inconclusive_never_a_verdict() {
    for mode in ["down", "garbage", "slow"] {
        let auditor = Auditor::spawn(
            AuditConfig::default().with_rate(1.0),
            Arc::new(FakeReference {
                mode,
                calls: AtomicUsize::new(0),
            }),
        );
        for _ in 0..3 {
            assert_eq!(
                auditor.audit_now(sample("a", &words(50))).await,
                None,
                "{mode}"
            );
        }
        let s = &auditor.statuses()[0];
        assert_eq!(
            (s.verdict, s.inconclusive, s.tokens_audited),
            (AuditVerdict::Unverified, 3, 0),
            "{mode}"
        );
        assert_eq!(auditor.counters().inconclusive, 3);
        assert!(auditor.routable(&NodeId::new("a"), &ModelId::new("m")));
    }
    // no reference for the model: inconclusive too
    let auditor = Auditor::spawn(AuditConfig::default(), Arc::new(ReferenceSet::new()));
    assert_eq!(auditor.audit_now(sample("a", &words(5))).await, None);
    assert_eq!(auditor.counters().inconclusive, 1);
}

#[tokio::test]
async fn offers_are_sampled_by_verdict_queued_and_dropped_when_full() {
    let reference = Arc::new(FakeReference {
        mode: "slow",
        calls: AtomicUsize::new(0),
    });
    let mut config = AuditConfig::default().with_rate(1.0);
    config.queue = 8;
    let auditor = Auditor::spawn(config, reference.clone());
    for _ in 0..10 {
        auditor.offer(sample("a", "x y z"));
    }
    // let the worker take one
    for _ in 0..100 {
        if reference.calls.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let c = auditor.counters();
    assert_eq!((c.offered, c.sampled), (10, 10));
    // the ten offers came before the worker ran (one thread): two queued (the pair's share),
    // the rest dropped
    assert_eq!(c.dropped_queue_full, 8);
    // a flood on node a does not crowd out node b: b has its own share of the queue
    auditor.offer(sample("b", "x y z"));
    assert_eq!(auditor.counters().dropped_queue_full, 8);
    let never = Auditor::spawn(AuditConfig::default().with_rate(0.0), reference);
    never.offer(sample("a", "x"));
    assert_eq!(never.counters().sampled, 0);
}

/// A reference whose answer the test switches: agree or disagree with the delivered text.
struct Switch(std::sync::Mutex<&'static str>);

impl Reference for Switch {
    fn score<'a>(&'a self, q: &'a ReferenceQuery) -> ScoreFuture<'a> {
        let agree = *self.0.lock().unwrap() == "agree";
        Box::pin(async move {
            Ok(q.completion
                .split_inclusive(' ')
                .map(|w| {
                    tok(
                        w,
                        &[(if agree { w } else { "\u{1F600}" }, 0.95), ("?", 0.01)],
                    )
                })
                .collect())
        })
    }
}

#[derive(Default)]
struct Verdicts(std::sync::Mutex<Vec<(AuditVerdict, AuditVerdict)>>);

impl AuditEvents for Verdicts {
    fn on_verdict(&self, _: &NodeId, _: &ModelId, from: AuditVerdict, to: AuditVerdict) {
        self.0.lock().unwrap().push((from, to));
    }
}

#[tokio::test]
async fn a_suspect_nodes_earnings_are_held_and_verdict_changes_are_reported() {
    let reference = Arc::new(Switch(std::sync::Mutex::new("disagree")));
    let events = Arc::new(Verdicts::default());
    let auditor = Auditor::spawn_with(
        AuditConfig::default().with_rate(1.0),
        reference.clone(),
        events.clone(),
    );
    let (node, model) = (NodeId::new("a"), ModelId::new("m"));
    assert!(!auditor.earnings_held(&node, &model), "unverified: paid");
    // three disagreeing positions: past half the rejection boundary, not past it
    assert_eq!(
        auditor.audit_now(sample("a", &words(4))).await,
        Some(AuditVerdict::Suspect)
    );
    assert!(auditor.earnings_held(&node, &model));
    assert!(auditor.routable(&node, &model), "suspect is still routed");
    // honest from now on: back under the boundary, then passing
    *reference.0.lock().unwrap() = "agree";
    let mut verdict = AuditVerdict::Suspect;
    for _ in 0..20 {
        verdict = auditor.audit_now(sample("a", &words(40))).await.unwrap();
        if verdict == AuditVerdict::Passing {
            break;
        }
    }
    assert_eq!(verdict, AuditVerdict::Passing);
    assert!(!auditor.earnings_held(&node, &model));
    let seen = events.0.lock().unwrap().clone();
    assert_eq!(
        seen.first(),
        Some(&(AuditVerdict::Unverified, AuditVerdict::Suspect))
    );
    assert_eq!(seen.last().map(|t| t.1), Some(AuditVerdict::Passing));
}

/// The false-alarm probability of one honest run of `SPINE_SPRT_TOKENS` (default 2,000) clear
/// positions when events occur at each rate of `SPINE_SPRT_P` (comma-separated, default the
/// design p0 of both statistics), by Monte Carlo over `SPINE_SPRT_RUNS` runs (default 100,000),
/// for `docs/trust.md`: `cargo test --workspace --lib -- --ignored --nocapture sprt_false_alarm`.
#[test]
#[ignore = "a measurement for docs/trust.md"]
#[allow(clippy::print_stdout)]
fn sprt_false_alarm_at_rates() {
    use rand::{Rng, SeedableRng};
    let env = |k: &str| std::env::var(k).ok();
    let tokens: usize = env("SPINE_SPRT_TOKENS")
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    let runs: usize = env("SPINE_SPRT_RUNS")
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let rates: Vec<f64> = env("SPINE_SPRT_P")
        .map(|v| v.split(',').filter_map(|p| p.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![0.01]);
    let cfg = SprtConfig::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(19);
    for kind in [ObservationKind::Greedy, ObservationKind::Sampled] {
        for &p in &rates {
            let failed = (0..runs)
                .filter(|_| {
                    let mut t = Sprt::default();
                    for _ in 0..tokens {
                        t.observe(
                            &cfg,
                            Observation {
                                kind,
                                event: rng.random_bool(p),
                            },
                        );
                        if t.rejected {
                            break;
                        }
                    }
                    t.rejected
                })
                .count();
            println!(
                "{kind:?} events at p = {p}: {failed} of {runs} runs of {tokens} clear positions failed ({:.2e})",
                failed as f64 / runs as f64
            );
        }
    }
}
