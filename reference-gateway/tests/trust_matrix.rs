//! The audit's measurement (issue 19, `docs/trust.md`): honest llama.cpp configurations and
//! substitutes, each generating replies that are scored on a reference llama-server with the
//! auditor's own parts (`auditable`, `LlamaCppReference`, `observations`, `Sprt`).
//!
//! Ignored (minutes of CPU); run with `scripts/trust-matrix.sh`, which prepares the substitute
//! files and sets:
//! - `SPINE_TRUST_HONEST_RUNS` (per honest configuration, default 1) and
//!   `SPINE_TRUST_HONEST_TOKENS` (audited tokens per honest run, default 2,000);
//! - `SPINE_TRUST_SUBSTITUTE_RUNS` (per substitute, default 10) and
//!   `SPINE_TRUST_SUBSTITUTE_TOKENS` (audited tokens per substitute run, default 300; a run
//!   goes on past `failed` so that every run's dump has the same length);
//! - `SPINE_TRUST_Q8_GGUF`, `SPINE_TRUST_GEMMA_GGUF` (optional substitutes);
//! - `SPINE_TRUST_DUMP` (where the raw scorings go, default
//!   `~/.cache/spine/trust/trust-<unix seconds>.jsonl`).
//!
//! Every audited reply is written to the dump, one JSON object a line (`DumpLine`): the node
//! configuration, run and reply, the request body (its sampling), the delivered text and the
//! reference's forced positions with their top tokens. `trust_replay` scores dumps again with
//! other statistics' settings, without the engines.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    missing_docs
)]

use std::io::Write;
use std::path::PathBuf;

use bytes::Bytes;
use serde_json::{json, Value};
use spine_core::{AuditVerdict, ModelId, RequestKind};
use spine_meter::audit::{
    auditable, observations, LlamaCppReference, Reference, ReferenceQuery, ScoreConfig,
    ScoredToken, Sprt, SprtConfig,
};
use spine_test_support::{Engine, LlamaServer};

/// Prompts in several languages and scripts.
const PROMPTS: &[&str] = &[
    "Write a short story about a lighthouse keeper.",
    "Explain why the sky is blue in simple words.",
    "Escribe un párrafo sobre la historia del pan.",
    "Décris une journée à la plage en quelques phrases.",
    "Schreibe ein kurzes Gedicht über den Herbst.",
    "用几句话介绍一下长城。",
    "日本の四季について短く説明してください。",
    "Расскажи коротко о Москве.",
    "Write a Python function that reverses a list, with a comment.",
    "List five fruits and one fact about each.",
    "What is the water cycle? Answer in three sentences.",
    "Describe a friendly dragon who loves to bake.",
    "Escreva uma frase sobre o mar.",
    "Give me three tips for learning to cook.",
    "Explain how bees make honey.",
    "اكتب جملة عن الشمس.",
];

#[derive(Clone, Debug)]
struct NodeSpec {
    label: &'static str,
    gguf: Option<PathBuf>,
    threads: &'static str,
    parallel: u32,
    flash_attn: &'static str,
    /// Requests in flight at once on the node.
    concurrency: usize,
    cache_prompt: bool,
    /// `None`: greedy; else the temperature (seeded).
    temperature: Option<f64>,
    /// Canned text instead of an engine.
    canned: bool,
}

fn honest(label: &'static str) -> NodeSpec {
    NodeSpec {
        label,
        gguf: None,
        threads: "2",
        parallel: 1,
        flash_attn: "on",
        concurrency: 1,
        cache_prompt: true,
        temperature: None,
        canned: false,
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    // fields 14 and 15 (utime, stime) are at 11 and 12 after the ")"
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

/// One generated reply: the request body as the node got it, and the text.
async fn generate(
    http: &reqwest::Client,
    url: &str,
    spec: &NodeSpec,
    prompt: &str,
    seed: u64,
) -> (Bytes, String) {
    let mut body = json!({
        "model": "smollm2",
        // a run-specific tag: greedy replies differ between runs
        "messages": [{"role": "user", "content": format!("{prompt} (#{seed})")}],
        "max_tokens": 128,
    });
    match spec.temperature {
        None => body["temperature"] = json!(0),
        Some(t) => {
            body["temperature"] = json!(t);
            body["seed"] = json!(seed);
        }
    }
    let bytes = Bytes::from(body.to_string());
    if spec.canned {
        let text = "Thank you for your question! Here is a helpful answer. ".repeat(6);
        return (bytes, text);
    }
    // engine-only field: sent to the node, not part of what the audit reads
    let mut sent = body.clone();
    sent["cache_prompt"] = json!(spec.cache_prompt);
    let v: Value = http
        .post(format!("{url}/v1/chat/completions"))
        .json(&sent)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    (bytes, text)
}

/// One audited reply in the dump (one JSON line).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct DumpLine {
    /// `honest` or `substitute`.
    role: String,
    /// The node configuration's label.
    config: String,
    run: usize,
    /// The reply's index within the run.
    reply: usize,
    /// The request body as the auditor reads it (its sampling).
    body: String,
    /// The delivered text.
    text: String,
    /// The reference's forced positions (each one audited token).
    tokens: Vec<ScoredToken>,
}

/// Where the dump goes: `SPINE_TRUST_DUMP` or `~/.cache/spine/trust/trust-<secs>.jsonl`.
fn dump_file() -> (PathBuf, std::fs::File) {
    let path = std::env::var_os("SPINE_TRUST_DUMP")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_default();
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs();
            PathBuf::from(home).join(format!(".cache/spine/trust/trust-{secs}.jsonl"))
        });
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).unwrap();
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap();
    (path, file)
}

#[derive(Debug, Default)]
struct RunResult {
    audited_tokens: u64,
    observations: u64,
    events: u64,
    verdict: Option<AuditVerdict>,
    tokens_to_pass: Option<u64>,
    tokens_to_fail: Option<u64>,
}

#[allow(clippy::too_many_arguments)]
async fn node_run(
    engine: &Engine,
    reference: &LlamaCppReference,
    spec: &NodeSpec,
    run: usize,
    token_budget: u64,
    role: &str,
    dump: &mut std::fs::File,
    ref_tokens: &mut u64,
) -> RunResult {
    let http = reqwest::Client::new();
    let server = if spec.canned {
        None
    } else {
        let gguf = spec
            .gguf
            .clone()
            .unwrap_or_else(|| engine.model_gguf.clone());
        Some(
            LlamaServer::start_model(
                engine,
                &gguf,
                spec.parallel,
                &["-t", spec.threads, "-fa", spec.flash_attn],
            )
            .await
            .unwrap(),
        )
    };
    let url = server.as_ref().map(|s| s.url.clone()).unwrap_or_default();
    let sprt_config = SprtConfig::default();
    let score_config = ScoreConfig::default();
    let mut sprt = Sprt::default();
    let mut out = RunResult::default();
    let mut i = run * 7;
    let mut reply = 0;
    while out.audited_tokens < token_budget {
        // `concurrency` replies generated at once (load on the node), audited in order
        let batch: Vec<(Bytes, String)> = futures_util::future::join_all(
            (0..spec.concurrency)
                .map(|k| {
                    let prompt = PROMPTS[(i + k) % PROMPTS.len()];
                    generate(&http, &url, spec, prompt, (run * 1000 + i + k) as u64)
                })
                .collect::<Vec<_>>(),
        )
        .await;
        i += spec.concurrency;
        for (body, text) in batch {
            if text.is_empty() {
                continue;
            }
            let req = auditable(RequestKind::ChatCompletions, &body).unwrap();
            let query = ReferenceQuery {
                model: ModelId::new("smollm2"),
                prompt: req.prompt,
                completion: text.clone(),
                max_tokens: 256,
            };
            let scored = reference.score(&query).await.unwrap();
            *ref_tokens += scored.len() as u64;
            let line = DumpLine {
                role: role.to_owned(),
                config: spec.label.to_owned(),
                run,
                reply,
                body: String::from_utf8_lossy(&body).into_owned(),
                text: text.clone(),
                tokens: scored.clone(),
            };
            reply += 1;
            serde_json::to_writer(&mut *dump, &line).unwrap();
            dump.write_all(b"\n").unwrap();
            let obs = observations(&scored, text.as_bytes(), req.mode, &score_config).unwrap();
            // every scored position is an audited token (clear or not); a verdict is reached
            // with the reply whose audit reaches it
            out.audited_tokens += scored.len() as u64;
            for o in obs {
                sprt.observe(&sprt_config, o);
            }
            let v = sprt.verdict(&sprt_config);
            if v == AuditVerdict::Passing && out.tokens_to_pass.is_none() {
                out.tokens_to_pass = Some(out.audited_tokens);
            }
            if v == AuditVerdict::Failed && out.tokens_to_fail.is_none() {
                out.tokens_to_fail = Some(out.audited_tokens);
            }
        }
    }
    dump.flush().unwrap();
    out.observations = sprt.observations;
    out.events = sprt.events;
    out.verdict = Some(sprt.verdict(&sprt_config));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes of CPU; run scripts/trust-matrix.sh"]
async fn trust_matrix() {
    let engine = Engine::discover().unwrap();
    let reference_server = LlamaServer::start_with_args(&engine, 1, &["-t", "1", "-fa", "on"])
        .await
        .unwrap();
    let reference = LlamaCppReference::new(reference_server.url.clone());
    let ref_pid = reference_server.child.id().unwrap();
    let mut ref_tokens = 0u64;
    let ref_cpu_start = cpu_ticks(ref_pid);
    let (dump_path, mut dump) = dump_file();
    println!("raw scorings: {}", dump_path.display());

    let honest_runs = env_usize("SPINE_TRUST_HONEST_RUNS", 1);
    let honest_tokens = env_usize("SPINE_TRUST_HONEST_TOKENS", 2000) as u64;
    let sub_runs = env_usize("SPINE_TRUST_SUBSTITUTE_RUNS", 10);
    let sub_tokens = env_usize("SPINE_TRUST_SUBSTITUTE_TOKENS", 300) as u64;

    let mut honest_specs = vec![
        honest("greedy -t 2 -np 1 fa on"),
        NodeSpec {
            threads: "1",
            ..honest("greedy -t 1 -np 1 fa on")
        },
        NodeSpec {
            flash_attn: "off",
            ..honest("greedy -t 2 -np 1 fa off")
        },
        NodeSpec {
            parallel: 4,
            concurrency: 4,
            ..honest("greedy -t 2 -np 4 fa on, 4 concurrent")
        },
        NodeSpec {
            parallel: 4,
            concurrency: 4,
            flash_attn: "off",
            threads: "1",
            ..honest("greedy -t 1 -np 4 fa off, 4 concurrent")
        },
        NodeSpec {
            cache_prompt: false,
            ..honest("greedy -t 2 -np 1 fa on, no prompt cache")
        },
        NodeSpec {
            temperature: Some(0.7),
            ..honest("seeded T=0.7 -t 2 -np 1 fa on")
        },
        NodeSpec {
            temperature: Some(1.0),
            flash_attn: "off",
            ..honest("seeded T=1.0 -t 2 -np 1 fa off")
        },
        NodeSpec {
            temperature: Some(0.8),
            parallel: 4,
            concurrency: 4,
            threads: "1",
            cache_prompt: false,
            ..honest("seeded T=0.8 -t 1 -np 4 fa on, 4 concurrent, no prompt cache")
        },
    ];
    if let Ok(only) = std::env::var("SPINE_TRUST_ONLY") {
        honest_specs.retain(|s| s.label.contains(only.as_str()));
    }
    println!("| node | run | audited tokens | clear positions | events | verdict | audited tokens to passing | audited tokens to failed |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut honest_failed = 0;
    let mut honest_total = 0;
    for spec in &honest_specs {
        for run in 0..honest_runs {
            let r = node_run(
                &engine,
                &reference,
                spec,
                run,
                honest_tokens,
                "honest",
                &mut dump,
                &mut ref_tokens,
            )
            .await;
            honest_total += 1;
            honest_failed += usize::from(r.verdict == Some(AuditVerdict::Failed));
            println!(
                "| honest: {} | {run} | {} | {} | {} | {:?} | {:?} | {:?} |",
                spec.label,
                r.audited_tokens,
                r.observations,
                r.events,
                r.verdict,
                r.tokens_to_pass,
                r.tokens_to_fail
            );
        }
    }

    let mut subs: Vec<NodeSpec> = vec![NodeSpec {
        gguf: Some(engine.substitute_gguf().unwrap()),
        ..honest("Q2_K requant, greedy")
    }];
    subs.push(NodeSpec {
        gguf: Some(engine.substitute_gguf().unwrap()),
        temperature: Some(0.8),
        ..honest("Q2_K requant, seeded T=0.8")
    });
    if let Some(p) = std::env::var_os("SPINE_TRUST_GEMMA_GGUF") {
        subs.push(NodeSpec {
            gguf: Some(PathBuf::from(&p)),
            ..honest("Gemma 3 270M Q4_K_M, greedy")
        });
        subs.push(NodeSpec {
            gguf: Some(PathBuf::from(p)),
            temperature: Some(0.8),
            ..honest("Gemma 3 270M Q4_K_M, seeded T=0.8")
        });
    }
    if let Some(p) = std::env::var_os("SPINE_TRUST_Q8_GGUF") {
        subs.push(NodeSpec {
            gguf: Some(PathBuf::from(p)),
            ..honest("Q8_0 requant, greedy (no bar)")
        });
    }
    subs.push(NodeSpec {
        canned: true,
        ..honest("canned text, greedy")
    });
    subs.push(NodeSpec {
        canned: true,
        temperature: Some(0.8),
        ..honest("canned text, seeded T=0.8")
    });
    if let Ok(only) = std::env::var("SPINE_TRUST_ONLY") {
        subs.retain(|s| s.label.contains(only.as_str()));
    }
    let mut summary = Vec::new();
    for spec in &subs {
        let mut caught = 0;
        let mut to_fail = Vec::new();
        for run in 0..sub_runs {
            let r = node_run(
                &engine,
                &reference,
                spec,
                run,
                sub_tokens,
                "substitute",
                &mut dump,
                &mut ref_tokens,
            )
            .await;
            if let Some(t) = r.tokens_to_fail {
                // a verdict comes with the reply that reaches it: one may end past the budget
                caught += usize::from(t <= sub_tokens);
                to_fail.push(t);
            }
            println!(
                "| substitute: {} | {run} | {} | {} | {} | {:?} | {:?} | {:?} |",
                spec.label,
                r.audited_tokens,
                r.observations,
                r.events,
                r.verdict,
                r.tokens_to_pass,
                r.tokens_to_fail
            );
        }
        to_fail.sort_unstable();
        summary.push(format!(
            "{}: failed in {caught}/{sub_runs} runs within {sub_tokens} audited tokens, {}/{sub_runs} at all; tokens to failed (sorted): {to_fail:?}",
            spec.label,
            to_fail.len(),
        ));
    }
    let ticks_per_s = 100.0; // Linux USER_HZ
    let ref_cpu_s = (cpu_ticks(ref_pid) - ref_cpu_start) as f64 / ticks_per_s;
    println!();
    println!("honest node-runs: {honest_total}, failed: {honest_failed}");
    for s in summary {
        println!("{s}");
    }
    println!(
        "reference: {ref_tokens} positions scored, {ref_cpu_s:.1} CPU s, {:.2} ms CPU per audited token",
        ref_cpu_s * 1000.0 / ref_tokens.max(1) as f64
    );
    assert_eq!(honest_failed, 0, "an honest node was failed");
}
