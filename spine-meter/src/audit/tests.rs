#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

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
            Observation::Greedy { event: false },
            Observation::Greedy { event: false },
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
        obs.iter().map(Observation::is_event).collect::<Vec<_>>(),
        [false, true]
    );
}

#[test]
fn sampled_surprisal_is_the_best_agreeing_tokens_and_the_bound_the_clipped_entropy() {
    let cfg = ScoreConfig::default();
    let full = [(" a", 0.6), (" b", 0.3), (" z", 0.1)];
    let entropy: f64 = full.iter().map(|(_, p)| -p * f64::ln(*p)).sum();
    let tokens = vec![
        // the listed tokens hold all the mass: the bound at T = 1 is the entropy
        tok(" b", &full),
        // " zz" is continued by " z" (another split of the same text): its surprisal
        tok(" zz", &full),
        // no listed token continues the text: the cap, here −ln of the least listed (0.01)
        tok(" q", &[(" a", 0.5), (" b", 0.4), (" c", 0.01)]),
        // no top tokens (a token that splits a character): not scored
        tok("!", &[]),
        tok(".", &[]),
    ];
    let text = b" b zz q!.";
    let at = |t: f64| {
        observations(
            &tokens,
            text,
            SamplingMode::Sampled { temperature: t },
            &cfg,
        )
        .unwrap()
    };
    let obs = at(1.0);
    assert_eq!(obs.len(), 3);
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    let Observation::Sampled {
        surprisal,
        bound,
        cap,
    } = obs[0]
    else {
        panic!("{obs:?}")
    };
    assert!(close(surprisal, -0.3f64.ln()) && close(bound, entropy) && close(cap, -0.1f64.ln()));
    assert!(obs[0].is_event(), "1.20 nats above the bound 0.90");
    let Observation::Sampled { surprisal, .. } = obs[1] else {
        panic!()
    };
    assert!(close(surprisal, -0.1f64.ln()));
    // third: 9 % unlisted, each at most 0.01; the cap is the default 3 nats (< −ln 0.01)
    let Observation::Sampled {
        surprisal,
        bound,
        cap,
    } = obs[2]
    else {
        panic!()
    };
    let c = cfg.surprisal_cap;
    assert!(close(c, 3.0));
    let expect = 0.5 * -0.5f64.ln() + 0.4 * -0.4f64.ln() + 0.01 * c + 0.09 * c;
    assert!(close(cap, c) && close(surprisal, c) && close(bound, expect));
    assert!(obs[2].is_event());
    // colder requests have lower bounds; the observed surprisal does not move
    let cold = at(0.5);
    for (hot, cold) in obs.iter().zip(&cold) {
        let (
            Observation::Sampled {
                surprisal: s1,
                bound: b1,
                ..
            },
            Observation::Sampled {
                surprisal: s2,
                bound: b2,
                ..
            },
        ) = (hot, cold)
        else {
            panic!()
        };
        assert!(close(*s1, *s2) && b2 < b1, "{b2} < {b1}");
    }
    assert!(obs.iter().all(|o| o.kind() == ObservationKind::Sampled));
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
fn boundaries_and_the_floor() {
    let cfg = SprtConfig::default();
    assert!(cfg.is_valid());
    assert!((cfg.fail_threshold() - 1e5f64.ln()).abs() < 1e-12);
    assert!((cfg.pass_threshold() - 0.01f64.ln()).abs() < 1e-12);
    assert!((cfg.false_fail_bound(2_000) - 1e-5 * 21.0).abs() < 1e-15);
    let clear = Observation::Greedy { event: false };
    let event = Observation::Greedy { event: true };
    let mut honest = Sprt::default();
    assert_eq!(honest.verdict(&cfg), AuditVerdict::Unverified);
    let mut n = 0;
    while honest.verdict(&cfg) == AuditVerdict::Unverified {
        honest.observe(&cfg, clear);
        n += 1;
    }
    assert_eq!(honest.verdict(&cfg), AuditVerdict::Passing);
    // b / ln(0.92/0.998) clear positions
    let expect = (cfg.pass_threshold() / cfg.greedy_step(false)).ceil() as u64;
    assert_eq!(n, expect);
    for _ in 0..10_000 {
        honest.observe(&cfg, clear);
    }
    assert_eq!(honest.llr, cfg.pass_threshold(), "held at the floor");
    assert_eq!(honest.log_wealth, [cfg.pass_threshold(); BETS]);
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

/// Monte Carlo check of the stated bound on greedy positions: an honest node at the design rate
/// p0 (the worst honest case) audited 2,000 tokens per run fails in at most `α·(1 + 2,000·β)`
/// of runs; a substitute at 0.17 (the spike's Q2_K rate) fails within 300 tokens nearly always.
#[test]
fn error_rates_hold_at_the_design_rates() {
    use rand::{Rng, SeedableRng};
    let cfg = SprtConfig::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let run = |rng: &mut rand::rngs::StdRng, p: f64, tokens: usize| {
        let mut t = Sprt::default();
        for _ in 0..tokens {
            let event = rng.random_bool(p);
            t.observe(&cfg, Observation::Greedy { event });
        }
        t.rejected
    };
    let runs = 2_000;
    let honest_fails = (0..runs)
        .filter(|_| run(&mut rng, cfg.greedy_p0, 2_000))
        .count();
    // at the bound p0 itself; honest nodes measured far below it (docs/trust.md)
    assert!(
        honest_fails as f64 <= runs as f64 * cfg.false_fail_bound(2_000),
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
        SamplingMode::Sampled { temperature: 0.7 }
    );
    // no temperature: the highest an audited request may use
    let default_t = br#"{"model":"m","messages":[]}"#;
    assert_eq!(
        auditable(chat, default_t).unwrap().mode,
        SamplingMode::Sampled { temperature: 1.0 }
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
        node_logprobs: None,
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
    let needed = (cfg.fail_threshold() / cfg.greedy_step(true)).ceil() as u64;
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
    // two disagreeing positions (2 ln 40 = 7.4): past half the rejection boundary, not past it
    assert_eq!(
        auditor.audit_now(sample("a", &words(3))).await,
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
/// greedy positions when events occur at each rate of `SPINE_SPRT_P` (comma-separated, default
/// the design p0), by Monte Carlo over `SPINE_SPRT_RUNS` runs (default 100,000), for
/// `docs/trust.md`: `cargo test -p spine-meter --lib -- --ignored --nocapture sprt_false_alarm`.
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
    let cfg = SprtConfig::default();
    // SPINE_SPRT_MODE=logprob: node-logprob positions (an event: |Δ| over the threshold)
    let logprob = env("SPINE_SPRT_MODE").is_some_and(|m| m == "logprob");
    let rates: Vec<f64> = env("SPINE_SPRT_P")
        .map(|v| v.split(',').filter_map(|p| p.trim().parse().ok()).collect())
        .unwrap_or_else(|| {
            vec![if logprob {
                cfg.logprob_p0
            } else {
                cfg.greedy_p0
            }]
        });
    let mut rng = rand::rngs::StdRng::seed_from_u64(19);
    for &p in &rates {
        let failed = (0..runs)
            .filter(|_| {
                let mut t = Sprt::default();
                for _ in 0..tokens {
                    let event = rng.random_bool(p);
                    let o = if logprob {
                        Observation::Logprob {
                            delta: if event { 3.0 } else { 0.0 },
                            event,
                        }
                    } else {
                        Observation::Greedy { event }
                    };
                    t.observe(&cfg, o);
                    if t.rejected {
                        break;
                    }
                }
                t.rejected
            })
            .count();
        println!(
            "{} events at p = {p}: {failed} of {runs} runs of {tokens} positions failed ({:.2e}; bound at p ≤ p0: {:.2e})",
            if logprob { "node-logprob" } else { "greedy" },
            failed as f64 / runs as f64,
            cfg.false_fail_bound(tokens as u64)
        );
    }
}

/// A simulated vocabulary: token `i` is spelled `<i>` (no token is a prefix of another).
mod sim {
    use super::*;
    use rand::{Rng, SeedableRng};

    pub(super) const VOCAB: usize = 120;

    pub(super) fn rng(seed: u64) -> rand::rngs::StdRng {
        rand::rngs::StdRng::seed_from_u64(seed)
    }

    /// Raw probabilities from normal logits of standard deviation `scale` (Box–Muller).
    pub(super) fn distribution(rng: &mut impl Rng, scale: f64) -> Vec<f64> {
        let logits: Vec<f64> = (0..VOCAB)
            .map(|_| {
                let (u, v): (f64, f64) = (rng.random::<f64>().max(1e-300), rng.random());
                scale * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
            })
            .collect();
        softmax(&logits, 1.0)
    }

    pub(super) fn softmax(logits: &[f64], temperature: f64) -> Vec<f64> {
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = logits
            .iter()
            .map(|l| ((l - max) / temperature).exp())
            .collect();
        let z: f64 = w.iter().sum();
        w.iter().map(|x| x / z).collect()
    }

    /// How an engine truncates.
    #[derive(Clone, Copy, Debug)]
    pub(super) enum Trunc {
        None,
        TopK(usize),
        TopP(f64),
        MinP(f64),
        /// llama.cpp's defaults: top-k 40, top-p 0.95, min-p 0.05.
        LlamaCpp,
    }

    fn truncate(p: &[f64], trunc: Trunc) -> Vec<f64> {
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        let mut keep = vec![false; p.len()];
        let (k, top_p, min_p) = match trunc {
            Trunc::None => (p.len(), 1.0, 0.0),
            Trunc::TopK(k) => (k, 1.0, 0.0),
            Trunc::TopP(x) => (p.len(), x, 0.0),
            Trunc::MinP(x) => (p.len(), 1.0, x),
            Trunc::LlamaCpp => (40, 0.95, 0.05),
        };
        let total: f64 = p.iter().sum();
        let mut mass = 0.0;
        for (rank, &i) in order.iter().enumerate() {
            if rank >= k || p[i] < min_p * p[order[0]] || (rank > 0 && mass >= top_p * total) {
                break;
            }
            keep[i] = true;
            mass += p[i];
        }
        let z: f64 = (0..p.len()).filter(|&i| keep[i]).map(|i| p[i]).sum();
        (0..p.len())
            .map(|i| if keep[i] { p[i] / z } else { 0.0 })
            .collect()
    }

    /// The node's sampling distribution: truncation of the raw probabilities then temperature
    /// (llama.cpp's order), or temperature then truncation (vLLM's).
    pub(super) fn node(p: &[f64], temperature: f64, trunc: Trunc, temp_first: bool) -> Vec<f64> {
        let temper = |q: &[f64]| {
            let logits: Vec<f64> = q
                .iter()
                .map(|x| if *x > 0.0 { x.ln() } else { f64::NEG_INFINITY })
                .collect();
            softmax(&logits, temperature)
        };
        if temp_first {
            truncate(&temper(p), trunc)
        } else {
            temper(&truncate(p, trunc))
        }
    }

    /// The reference's answer at a position whose delivered token is `x`: the 40 most probable
    /// tokens of `p`, then a last position (never scored).
    pub(super) fn scored(p: &[f64], x: usize) -> (Vec<ScoredToken>, Vec<u8>) {
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        let top = order[..40]
            .iter()
            .map(|&i| TopToken {
                bytes: format!("<{i}>").into_bytes(),
                logprob: p[i].ln(),
            })
            .collect();
        let text = format!("<{x}>.").into_bytes();
        let tokens = vec![
            ScoredToken {
                bytes: format!("<{x}>").into_bytes(),
                top,
            },
            ScoredToken {
                bytes: b".".to_vec(),
                top: Vec::new(),
            },
        ];
        (tokens, text)
    }

    pub(super) fn observe(p: &[f64], x: usize, temperature: f64) -> Option<Observation> {
        let (tokens, text) = scored(p, x);
        let mode = SamplingMode::Sampled { temperature };
        observations(&tokens, &text, mode, &ScoreConfig::default())
            .unwrap()
            .pop()
    }

    pub(super) fn draw(rng: &mut impl Rng, q: &[f64]) -> usize {
        let mut u: f64 = rng.random();
        for (i, x) in q.iter().enumerate() {
            u -= x;
            if u < 0.0 {
                return i;
            }
        }
        q.iter().rposition(|x| *x > 0.0).unwrap_or(0)
    }
}

/// The theorem behind the sampled statistic (`score` module docs), checked exactly: for
/// distributions of every spread, an honest node at any temperature up to the request's and any
/// truncation has an expected observed surprisal at most the bound the reference computes from
/// its 40 listed tokens.
#[test]
fn honest_expected_surprisal_is_at_most_the_bound() {
    use sim::*;
    let mut rng = rng(1);
    let truncs = [
        Trunc::None,
        Trunc::TopK(40),
        Trunc::TopK(3),
        Trunc::TopP(0.95),
        Trunc::TopP(0.5),
        Trunc::MinP(0.05),
        Trunc::MinP(0.3),
        Trunc::LlamaCpp,
    ];
    let mut checked = 0;
    let mut tightest = f64::INFINITY;
    for scale in [0.3, 1.0, 2.0, 3.0, 5.0] {
        for _ in 0..8 {
            let p = distribution(&mut rng, scale);
            for requested in [0.5, 0.7, 1.0] {
                // the node may sample colder than asked, never hotter
                for used in [requested, requested * 0.6] {
                    for trunc in truncs {
                        for temp_first in [false, true] {
                            let q = node(&p, used, trunc, temp_first);
                            let mut mean = 0.0;
                            let mut bound = None;
                            for (x, qx) in q.iter().enumerate().filter(|(_, q)| **q > 0.0) {
                                let Some(Observation::Sampled {
                                    surprisal,
                                    bound: b,
                                    ..
                                }) = observe(&p, x, requested)
                                else {
                                    panic!("a sampled observation")
                                };
                                mean += qx * surprisal;
                                bound = Some(b);
                            }
                            let bound = bound.unwrap();
                            assert!(
                                mean <= bound + 1e-9,
                                "scale {scale} T {requested} (used {used}) {trunc:?}: E[s] = {mean} > {bound}"
                            );
                            if used == requested && matches!(trunc, Trunc::None) {
                                tightest = tightest.min(bound - mean);
                            }
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert_eq!(checked, 5 * 8 * 3 * 2 * 8 * 2);
    // untruncated at the requested temperature the bound is nearly attained (only the clipping
    // and the unlisted tokens' allowance separate them)
    assert!(tightest < 0.05, "{tightest}");
}

/// Honest nodes sampled from known distributions at T ∈ {0.5, 0.7, 1.0}, with and without
/// truncation, are failed in no more runs than the bound allows, and the statistic drifts down
/// for them; a node sampling from another distribution (the reference's logits plus noise, the
/// shape of another model) is failed.
#[test]
fn honest_sampling_is_not_failed_and_a_shifted_distribution_is() {
    use rand::Rng;
    use sim::*;
    let mut rng = rng(2);
    let cfg = SprtConfig::default();
    let positions = 300;
    let runs = 40;
    let mut honest_failed = 0;
    let mut honest_final = Vec::new();
    for &(temperature, trunc) in &[
        (1.0, Trunc::None),
        (0.7, Trunc::None),
        (0.5, Trunc::None),
        (1.0, Trunc::LlamaCpp),
        (0.7, Trunc::TopP(0.9)),
    ] {
        for _ in 0..runs {
            let mut t = Sprt::default();
            for _ in 0..positions {
                let p = distribution(&mut rng, 2.5);
                let x = draw(&mut rng, &node(&p, temperature, trunc, false));
                t.observe(&cfg, observe(&p, x, temperature).unwrap());
            }
            honest_failed += usize::from(t.rejected);
            honest_final.push(t.llr);
        }
    }
    let honest_runs = 5 * runs;
    assert!(
        honest_failed as f64 <= honest_runs as f64 * cfg.false_fail_bound(positions as u64),
        "{honest_failed} of {honest_runs}"
    );
    assert_eq!(honest_failed, 0);
    // a supermartingale: E[Λ] ≤ ln E[M] ≤ 0 (Jensen), for every configuration
    for (i, finals) in honest_final.chunks(runs).enumerate() {
        let mean = finals.iter().sum::<f64>() / runs as f64;
        assert!(mean < 0.0, "configuration {i}: mean Λ {mean}");
    }
    // another model: the reference's logits plus independent noise of sd 1.5, sampled at T = 1
    let mut caught = 0;
    let mut to_fail = Vec::new();
    let runs = 100;
    for _ in 0..runs {
        let mut t = Sprt::default();
        for n in 1..=1_000 {
            let p = distribution(&mut rng, 2.5);
            let noisy: Vec<f64> = p
                .iter()
                .map(|x| x.ln() + 1.5 * (rng.random::<f64>() - 0.5) * 12f64.sqrt())
                .collect();
            let x = draw(&mut rng, &softmax(&noisy, 1.0));
            t.observe(&cfg, observe(&p, x, 1.0).unwrap());
            if t.rejected {
                to_fail.push(n);
                break;
            }
        }
        caught += usize::from(t.rejected);
    }
    to_fail.sort_unstable();
    assert!(
        caught * 100 >= runs * 99,
        "caught {caught} of {runs}: {to_fail:?}"
    );
}

/// A reference that forces ids and answers each one's logprob: `-0.5` (what the node below
/// claims: an honest node) or `-4.0` (a substitute's claims are off by 3.5 nats).
struct ForcingReference(f64);

impl Reference for ForcingReference {
    fn score<'a>(&'a self, _q: &'a ReferenceQuery) -> ScoreFuture<'a> {
        Box::pin(async { Err(ReferenceError::Garbage("score not used".into())) })
    }

    fn force<'a>(&'a self, q: &'a ForceQuery) -> ForceFuture<'a> {
        let lp = self.0;
        Box::pin(async move {
            Ok(q.tokens
                .iter()
                .map(|t| Some(lp).filter(|_| t.scored && !t.split))
                .collect())
        })
    }
}

fn node_logprobs_auditor(reference_logprob: f64) -> Auditor {
    // the words, and a byte token as every byte-level vocabulary has (0xF0, id 40)
    let mut tokens: Vec<String> = (0..40).map(|i| format!("Ġw{i}")).collect();
    tokens.push("ð".to_owned());
    let vocab = TokenVocabulary::from_tokens("gpt2", &tokens, None).unwrap();
    let vocabularies = std::collections::HashMap::from([(ModelId::new("m"), Arc::new(vocab))]);
    Auditor::spawn_with_node_logprobs(
        AuditConfig::default().with_rate(1.0),
        Arc::new(ForcingReference(reference_logprob)),
        Arc::new(()),
        vocabularies,
    )
}

/// A sample of `n` tokens " w0", " w1", … whose node claims logprob −0.5 for each.
fn logprob_sample(node: &str, n: usize) -> AuditSample {
    listed_sample(node, n, |_| None)
}

/// As [`logprob_sample`], the node naming token `i` with the id `id(i)` (`None`: no `id`).
fn listed_sample(node: &str, n: usize, id: impl Fn(usize) -> Option<usize>) -> AuditSample {
    let text: String = (0..n).map(|i| format!(" w{i}")).collect();
    let json = serde_json::json!({
        "content": (0..n)
            .map(|i| {
                let mut entry = serde_json::json!({"token": format!(" w{i}"), "logprob": -0.5});
                if let Some(id) = id(i) {
                    entry["id"] = serde_json::json!(id);
                }
                entry
            })
            .collect::<Vec<_>>()
    });
    let mut capture = NodeLogprobs::new(256);
    capture.push(Some(&json));
    AuditSample {
        node_logprobs: Some(capture),
        ..sample(node, &text)
    }
}

#[tokio::test]
async fn node_logprobs_score_the_nodes_claims_against_the_reference() {
    let honest = node_logprobs_auditor(-0.5);
    let (node, model) = (NodeId::new("a"), ModelId::new("m"));
    assert!(honest.node_logprobs(&model));
    assert!(!honest.node_logprobs(&ModelId::new("other")));
    assert_eq!(honest.max_node_tokens(), 256);
    for _ in 0..2 {
        honest.audit_now(logprob_sample("a", 40)).await;
    }
    let s = &honest.statuses_of(&node)[0];
    assert_eq!((s.tokens_audited, s.events), (80, 0));
    assert_eq!(s.verdict, AuditVerdict::Passing);
    assert_eq!(honest.counters().node_logprobs_audits, 2);

    // claims 3.5 nats off the reference's: every position an event, failed within one audit
    // (ln(1e5) / ln(0.10 / 0.001) = 2.5 events: the third)
    let substitute = node_logprobs_auditor(-4.0);
    let v = substitute.audit_now(logprob_sample("b", 10)).await;
    assert_eq!(v, Some(AuditVerdict::Failed));
    let s = &substitute.statuses_of(&NodeId::new("b"))[0];
    assert_eq!((s.tokens_audited, s.events), (3, 3));
    assert_eq!(model, s.model);
}

#[tokio::test]
async fn a_node_that_sends_no_logprobs_or_a_list_that_is_not_its_text_gets_one_event() {
    let a = node_logprobs_auditor(-0.5);
    let missing = AuditSample {
        node_logprobs: Some(NodeLogprobs::new(256)),
        ..sample("a", " w1 w2")
    };
    a.audit_now(missing).await;
    let mut wrong = logprob_sample("a", 3);
    wrong.completion = " w0 w9 w2".to_owned();
    a.audit_now(wrong).await;
    let s = &a.statuses_of(&NodeId::new("a"))[0];
    assert_eq!((s.tokens_audited, s.events), (2, 2));
    assert!((s.statistic - 2.0 * (0.10f64 / 0.001).ln()).abs() < 1e-9);
    assert_eq!(a.counters().node_logprobs_missing, 2);
    // no capture (the tap was not asked): the text statistic, here inconclusive
    a.audit_now(sample("c", " w1")).await;
    assert_eq!(a.counters().inconclusive, 1);
}

/// A sample of `n` tokens " w0", " w1", … whose node names each with an `id` of another
/// vocabulary (`1000 + i`) and claims logprob −0.5.
fn foreign_sample(node: &str, n: usize) -> AuditSample {
    listed_sample(node, n, |i| Some(1000 + i))
}

#[tokio::test]
async fn a_list_in_another_vocabulary_is_one_event_and_is_scored_by_its_bytes() {
    // the claims agree with the reference: one event (the ids), then 8 clean positions
    let a = node_logprobs_auditor(-0.5);
    a.audit_now(foreign_sample("a", 8)).await;
    let s = &a.statuses_of(&NodeId::new("a"))[0];
    assert_eq!((s.tokens_audited, s.events), (9, 1));
    assert_eq!(a.counters().node_logprobs_missing, 1);
    assert_eq!(a.counters().node_logprobs_audits, 1);

    // claims 3.5 nats off: every position an event as well, failed in the first audit
    let a = node_logprobs_auditor(-4.0);
    let v = a.audit_now(foreign_sample("b", 8)).await;
    assert_eq!(v, Some(AuditVerdict::Failed));
    // the ids' event and two positions: 3 × ln 100 ≥ ln(1e5), the test stops there
    let s = &a.statuses_of(&NodeId::new("b"))[0];
    assert_eq!((s.tokens_audited, s.events), (3, 3));

    // the same list with the catalog's own ids (0..n) is aligned as is: no event
    let a = node_logprobs_auditor(-0.5);
    a.audit_now(listed_sample("c", 8, Some)).await;
    let s = &a.statuses_of(&NodeId::new("c"))[0];
    assert_eq!((s.tokens_audited, s.events), (8, 0));
    assert_eq!(a.counters().node_logprobs_missing, 0);
}

/// A sample whose node lists the first `listed` of `n` words, for a request `body`, captured
/// with a bound of `bound` entries.
fn short_sample(
    node: &str,
    n: usize,
    listed: usize,
    bound: usize,
    body: &'static [u8],
) -> AuditSample {
    let full = logprob_sample(node, n);
    let json = serde_json::json!({
        "content": (0..listed)
            .map(|i| serde_json::json!({"token": format!(" w{i}"), "logprob": -0.5}))
            .collect::<Vec<_>>()
    });
    let mut capture = NodeLogprobs::new(bound);
    capture.push(Some(&json));
    AuditSample {
        node_logprobs: Some(capture),
        request_body: bytes::Bytes::from_static(body),
        ..full
    }
}

const CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0}"#;
const CHAT_STOP: &[u8] =
    br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0,"stop":["\n\n"]}"#;

#[tokio::test]
async fn a_list_that_stops_short_of_the_text_gets_one_event() {
    // 3 of 10 words listed, no stop word: short, one event (not its 3 positions)
    let a = node_logprobs_auditor(-0.5);
    a.audit_now(short_sample("a", 10, 3, 256, CHAT)).await;
    let s = &a.statuses_of(&NodeId::new("a"))[0];
    assert_eq!((s.tokens_audited, s.events), (1, 1));
    let c = a.counters();
    assert_eq!((c.node_logprobs_short, c.node_logprobs_missing), (1, 0));

    // the capture kept all it may (3): not judged short, its 3 positions scored
    let a = node_logprobs_auditor(-0.5);
    a.audit_now(short_sample("a", 10, 3, 3, CHAT)).await;
    let s = &a.statuses_of(&NodeId::new("a"))[0];
    assert_eq!((s.tokens_audited, s.events), (3, 0));
    assert_eq!(a.counters().node_logprobs_short, 0);

    // a stop word: a non-streamed llama.cpp drops the stop word's entries; the last word
    // (4 bytes) is within the slack ((2 + 2) · 4 + 2 + 3 = 21 bytes of tokens of 4 bytes)
    let a = node_logprobs_auditor(-0.5);
    a.audit_now(short_sample("a", 10, 9, 256, CHAT_STOP)).await;
    let s = &a.statuses_of(&NodeId::new("a"))[0];
    assert_eq!((s.tokens_audited, s.events), (9, 0));
    // but not 9 words (29 bytes)
    a.audit_now(short_sample("b", 12, 3, 256, CHAT_STOP)).await;
    let s = &a.statuses_of(&NodeId::new("b"))[0];
    assert_eq!((s.tokens_audited, s.events), (1, 1));
    assert_eq!(a.counters().node_logprobs_short, 1);

    // a character cut at max_tokens: its bytes arrive as U+FFFD, never listed (a token that
    // begins with a byte that is no whole character: the byte token 0xF0)
    let a = node_logprobs_auditor(-0.5);
    let mut cut = short_sample("a", 4, 4, 256, CHAT);
    cut.completion.push('\u{fffd}');
    a.audit_now(cut).await;
    let s = &a.statuses_of(&NodeId::new("a"))[0];
    assert_eq!((s.tokens_audited, s.events), (4, 0));

    // a list spelling more than was delivered (the text capture cut): not short
    let mut more = short_sample("c", 10, 10, 256, CHAT);
    more.completion.truncate(10);
    a.audit_now(more).await;
    let s = &a.statuses_of(&NodeId::new("c"))[0];
    assert_eq!(s.events, 0);
    assert_eq!(a.counters().node_logprobs_short, 0);
}
