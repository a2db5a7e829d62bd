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
//!   ends at `failed`, or with `SPINE_TRUST_FULL_SUBSTITUTE_RUNS=1` goes on so that every
//!   run's dump has the same length);
//! - `SPINE_TRUST_REFERENCE_SLOTS` (default 8): the reference's slots, and how many replies it
//!   scores at once while the node generates the next ones (the judge takes them in order);
//! - `SPINE_TRUST_FIRST_RUN` (the first run's index, default 0: runs `first..first + runs`
//!   have their own prompts and seeds, so several invocations add runs, not repeats);
//! - `SPINE_TRUST_Q8_GGUF`, `SPINE_TRUST_GEMMA_GGUF` (optional substitutes);
//! - `SPINE_TRUST_NODE_LOGPROBS=1`: score the nodes' own logprobs (`[audit] node_logprobs`):
//!   each node is asked for them, the reference forces the node's tokens
//!   (`LlamaCppReference::force`) and each position is `|claimed − reference|` against 1 nat;
//!   the canned node claims −0.5 for each token of its text (the vocabulary's longest match);
//! - `SPINE_TRUST_DUMP` (where the raw scorings go, default
//!   `~/.cache/spine/trust/trust-<unix seconds>.jsonl`).
//!
//! Every audited reply is written to the dump, one JSON object a line (`DumpLine`): the node
//! configuration, run and reply, the request body (its sampling), the delivered text and the
//! reference's forced positions with their top tokens. `trust_replay` scores dumps again with
//! other statistics' settings, without the engines.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::path::PathBuf;

use bytes::Bytes;
use serde_json::{json, Value};
use spine_core::{AuditVerdict, ModelId, RequestKind};
use spine_meter::audit::node_logprobs::{
    logprob_observations, missing_observation, AlignedTokens, NodeToken,
};
use spine_meter::audit::{
    auditable, judge_node_list, observations, ForceQuery, LlamaCppReference, NodeList,
    NodeLogprobs, Observation, Reference, ReferenceQuery, ScoreConfig, ScoredToken, Sprt,
    SprtConfig, TokenVocabulary,
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
    /// Streamed replies (`stream: true`), read as the meter reads them.
    stream: bool,
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
        stream: false,
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

/// Posts a chat to the node, sent again (at most twice) when the connection failed before any
/// answer: llama-server may close a keep-alive connection as the next request goes out (the
/// agent resends in the same case, `spine_core::closed_before_answer`).
async fn send(http: &reqwest::Client, url: &str, body: &Value) -> reqwest::Response {
    let mut tries = 0;
    loop {
        match http
            .post(format!("{url}/v1/chat/completions"))
            .json(body)
            .send()
            .await
        {
            Ok(r) => return r,
            Err(e) if tries < 2 => {
                eprintln!("resending after: {e:?}");
                tries += 1;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
}

/// One generated reply: the request body as the node got it, and the text.
async fn generate(
    http: &reqwest::Client,
    url: &str,
    spec: &NodeSpec,
    prompt: &str,
    seed: u64,
    vocab: Option<&TokenVocabulary>,
) -> (Bytes, String, Option<NodeLogprobs>) {
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
    if vocab.is_some() {
        // as the meter asks (spine_meter::inject::inject_logprobs)
        body["logprobs"] = json!(true);
        body["top_logprobs"] = json!(1);
    }
    let bytes = Bytes::from(body.to_string());
    if spec.canned {
        let text = "Thank you for your question! Here is a helpful answer. ".repeat(6);
        let claims = vocab.map(|v| canned_claims(v, &text));
        return (bytes, text, claims);
    }
    // engine-only field: sent to the node, not part of what the audit reads
    let mut sent = body.clone();
    sent["cache_prompt"] = json!(spec.cache_prompt);
    if spec.stream {
        sent["stream"] = json!(true);
        let sse = send(http, url, &sent).await.text().await.unwrap();
        // the content deltas in order, and each chunk's logprobs as the meter's capture takes
        // them (one `push` per chunk)
        let mut text = String::new();
        let mut claims = vocab.map(|_| NodeLogprobs::new(256));
        for data in sse.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if data == "[DONE]" {
                break;
            }
            let chunk: Value = serde_json::from_str(data).unwrap();
            let choice = &chunk["choices"][0];
            if let Some(t) = choice["delta"]["content"].as_str() {
                text.push_str(t);
            }
            if let Some(c) = claims.as_mut() {
                c.push(choice.get("logprobs"));
            }
        }
        return (bytes, text, claims);
    }
    let v: Value = send(http, url, &sent).await.json().await.unwrap();
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let claims = vocab.map(|_| {
        let mut c = NodeLogprobs::new(256);
        c.push(v["choices"][0].get("logprobs"));
        c
    });
    (bytes, text, claims)
}

/// The positions the alignment before issue 19's change scored: the leading entries that are
/// exactly one vocabulary token (whole UTF-8, the id the node sent), at most 256 (a measure to
/// compare coverage in one run).
fn positions_before_split(vocab: &TokenVocabulary, claims: &NodeLogprobs, text: &[u8]) -> u64 {
    if !claims.is_usable() {
        return 0;
    }
    let mut offset = 0;
    let mut n = 0;
    for t in claims.tokens.iter().take(256) {
        let ok = !t.bytes.is_empty()
            && text[offset..].starts_with(&t.bytes)
            && std::str::from_utf8(&t.bytes).is_ok()
            && vocab
                .id(&t.bytes)
                .is_some_and(|id| t.id.is_none_or(|c| c == u64::from(id)));
        if !ok {
            break;
        }
        offset += t.bytes.len();
        n += 1;
    }
    n
}

/// A canned node's made-up claims: its text split at the vocabulary's longest matches, each
/// token claimed at −0.5 nats.
fn canned_claims(vocab: &TokenVocabulary, text: &str) -> NodeLogprobs {
    let b = text.as_bytes();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let len = (1..=16.min(b.len() - i))
            .rev()
            .find(|l| vocab.id(&b[i..i + l]).is_some())
            .unwrap_or(1);
        tokens.push(serde_json::json!({
            "token": String::from_utf8_lossy(&b[i..i + len]),
            "logprob": -0.5,
        }));
        i += len;
    }
    let mut c = NodeLogprobs::new(256);
    c.push(Some(&serde_json::json!({ "content": tokens })));
    c
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
    /// Node-logprob mode: the node's claims of its aligned tokens (`null`: not scored), and
    /// the reference's logprobs of the same forced tokens.
    #[serde(default)]
    node_claims: Vec<Option<f64>>,
    #[serde(default)]
    reference_logprobs: Vec<Option<f64>>,
    /// Node-logprob mode: the one event the list itself got (`short`, `missing`, `foreign`),
    /// and then the node's list as captured, to be read again (`None`: an aligned list).
    #[serde(default)]
    lead: Option<String>,
    #[serde(default)]
    node_list: Vec<DumpEntry>,
}

/// One entry of a node's list as captured ([`spine_meter::audit::node_logprobs::NodeToken`]).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct DumpEntry {
    bytes: Vec<u8>,
    logprob: f64,
    id: Option<u64>,
}

impl DumpLine {
    /// Reply `reply` of run `run` of the `role` node configured as `spec`: the request `body`
    /// and the delivered `text`, nothing scored yet.
    fn new(role: &str, spec: &NodeSpec, run: usize, reply: usize, body: &[u8], text: &str) -> Self {
        Self {
            role: role.to_owned(),
            config: spec.label.to_owned(),
            run,
            reply,
            body: String::from_utf8_lossy(body).into_owned(),
            text: text.to_owned(),
            tokens: Vec::new(),
            node_claims: Vec::new(),
            reference_logprobs: Vec::new(),
            lead: None,
            node_list: Vec::new(),
        }
    }

    /// Appends the line to `dump`.
    fn write(&self, dump: &mut std::fs::File) {
        serde_json::to_writer(&mut *dump, self).unwrap();
        dump.write_all(b"\n").unwrap();
    }
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
    /// Λ at the end.
    statistic: f64,
    /// Largest |claimed − reference| seen (node-logprob mode), nats.
    max_delta: f64,
    /// Node-logprob mode: replies audited; of which with no scored position, judged short,
    /// judged missing (no usable list, or not the text).
    replies: u64,
    unscored_replies: u64,
    /// What alignment scored before it went on past split characters (issue 19): positions,
    /// and replies with none.
    positions_before_split: u64,
    unscored_before_split: u64,
    short_replies: u64,
    missing_replies: u64,
    /// Node-logprob mode: replies whose list was in another vocabulary ([`NodeList::Foreign`]).
    foreign_replies: u64,
    /// Tokens the node delivered in the audited replies (node-logprob mode: its list's
    /// entries), and that count at the end of the reply that reached `failed`.
    delivered_tokens: u64,
    delivered_to_fail: Option<u64>,
}

/// The auditor's statistic and test over one node-run's replies, in order.
struct Judge {
    score: ScoreConfig,
    sprt_config: SprtConfig,
    sprt: Sprt,
    out: RunResult,
}

impl Judge {
    fn new(score: ScoreConfig, sprt_config: SprtConfig) -> Self {
        Self {
            score,
            sprt_config,
            sprt: Sprt::default(),
            out: RunResult::default(),
        }
    }

    /// One audited reply: `body` the request, `scored` the reference's positions over `text`.
    fn reply(&mut self, body: &[u8], text: &str, scored: &[ScoredToken]) {
        let req = auditable(RequestKind::ChatCompletions, body).unwrap();
        let obs = observations(scored, text.as_bytes(), req.mode, &self.score).unwrap();
        // every scored position is an audited token (clear or not); a verdict is reached with
        // the reply whose audit reaches it
        self.out.audited_tokens += scored.len() as u64;
        for o in obs {
            self.sprt.observe(&self.sprt_config, o);
        }
        let v = self.sprt.verdict(&self.sprt_config);
        if v == AuditVerdict::Passing && self.out.tokens_to_pass.is_none() {
            self.out.tokens_to_pass = Some(self.out.audited_tokens);
        }
        if v == AuditVerdict::Failed && self.out.tokens_to_fail.is_none() {
            self.out.tokens_to_fail = Some(self.out.audited_tokens);
        }
    }

    /// One audited reply in node-logprob mode: its observations, `positions` audited tokens,
    /// `delivered` tokens the node delivered.
    fn reply_obs(&mut self, obs: &[Observation], positions: u64, delivered: u64) {
        self.out.audited_tokens += positions;
        self.out.delivered_tokens += delivered;
        for o in obs {
            if let Observation::Logprob { delta, .. } = o {
                self.out.max_delta = self.out.max_delta.max(*delta);
            }
            self.sprt.observe(&self.sprt_config, *o);
        }
        let v = self.sprt.verdict(&self.sprt_config);
        if v == AuditVerdict::Passing && self.out.tokens_to_pass.is_none() {
            self.out.tokens_to_pass = Some(self.out.audited_tokens);
        }
        if v == AuditVerdict::Failed && self.out.tokens_to_fail.is_none() {
            self.out.tokens_to_fail = Some(self.out.audited_tokens);
            self.out.delivered_to_fail = Some(self.out.delivered_tokens);
        }
    }

    fn finish(mut self) -> RunResult {
        self.out.observations = self.sprt.observations;
        self.out.events = self.sprt.events;
        self.out.verdict = Some(self.sprt.verdict(&self.sprt_config));
        self.out.statistic = self.sprt.llr;
        self.out
    }
}

/// What the reference's scoring of one reply gives the judge.
enum Scoring {
    /// Node-logprob mode: the observations and the dump's per-position claims and reference
    /// logprobs.
    Logprobs {
        obs: Vec<Observation>,
        node_claims: Vec<Option<f64>>,
        reference_logprobs: Vec<Option<f64>>,
        /// The list's own event and the list ([`DumpLine::lead`]).
        lead: Option<&'static str>,
        node_list: Vec<DumpEntry>,
        /// The reference's forced positions (for its CPU per position).
        forced: u64,
    },
    /// Text mode: the reference's forced positions over the delivered text.
    Text(Vec<ScoredToken>),
}

/// One reply on its way to the judge: its place in the run and the scoring under way.
struct Pending {
    body: Bytes,
    text: String,
    /// Tokens the node delivered in the reply.
    delivered: u64,
    scoring: tokio::task::JoinHandle<Scoring>,
}

/// The run's settings: how many replies the reference scores at once, whether the run ends at
/// `failed` (substitutes: the tokens to `failed` are what is measured).
#[derive(Clone, Copy, Debug)]
struct RunSettings {
    scoring_concurrency: usize,
    stop_at_failed: bool,
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
    vocab: Option<&TokenVocabulary>,
    settings: RunSettings,
) -> RunResult {
    // llama-server closes a connection idle for 5 s (cpp-httplib's keep-alive): never reuse one
    // that old, the node may be closing it as the next request goes out
    let http = reqwest::Client::builder()
        .pool_idle_timeout(std::time::Duration::from_secs(2))
        .build()
        .unwrap();
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
    let mut judge = Judge::new(ScoreConfig::default(), SprtConfig::default());
    let mut i = run * 7;
    let mut reply = 0;
    // audited tokens of the replies generated so far, before their scoring is back (node
    // logprobs: the aligned positions; text: a byte estimate): generation stops at the budget
    let mut generated = 0u64;
    let mut pending: std::collections::VecDeque<Pending> = std::collections::VecDeque::new();
    let done = |judge: &Judge| settings.stop_at_failed && judge.out.tokens_to_fail.is_some();
    while generated < token_budget && !done(&judge) {
        // `concurrency` replies generated at once (load on the node), scored while the next
        // ones are generated, judged in order
        let batch: Vec<(Bytes, String, Option<NodeLogprobs>)> = futures_util::future::join_all(
            (0..spec.concurrency)
                .map(|k| {
                    let prompt = PROMPTS[(i + k) % PROMPTS.len()];
                    generate(
                        &http,
                        &url,
                        spec,
                        prompt,
                        (run * 1000 + i + k) as u64,
                        vocab,
                    )
                })
                .collect::<Vec<_>>(),
        )
        .await;
        i += spec.concurrency;
        for (body, text, claims) in batch {
            if text.is_empty() {
                continue;
            }
            let req = auditable(RequestKind::ChatCompletions, &body).unwrap();
            let reference = reference.clone();
            // tokens delivered: the node's list's entries (node logprobs), else about four
            // bytes a token
            let delivered = claims.as_ref().map_or(text.len() / 4, |c| c.tokens.len()) as u64;
            let scoring = if let (Some(vocab), Some(claims)) = (vocab, claims) {
                // the auditor's own judgment of the list (`judge_node_list`)
                let judged = judge_node_list(vocab, &claims, text.as_bytes(), &body, 256);
                judge.out.replies += 1;
                let before = positions_before_split(vocab, &claims, text.as_bytes());
                judge.out.positions_before_split += before;
                judge.out.unscored_before_split += u64::from(before == 0);
                // the events without the reference (a list missing, short, or in another
                // vocabulary) and the positions to force
                let (lead, aligned) = match judged {
                    NodeList::Aligned(a) => (None, a),
                    NodeList::Foreign { by_bytes, .. } => {
                        judge.out.foreign_replies += 1;
                        (Some("foreign"), by_bytes)
                    }
                    NodeList::Short { .. } => {
                        judge.out.short_replies += 1;
                        (Some("short"), AlignedTokens::default())
                    }
                    _ => {
                        judge.out.missing_replies += 1;
                        (Some("missing"), AlignedTokens::default())
                    }
                };
                let node_list = if lead.is_some() {
                    claims
                        .tokens
                        .iter()
                        .map(|t| DumpEntry {
                            bytes: t.bytes.clone(),
                            logprob: t.logprob,
                            id: t.id,
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                if lead.is_none() && aligned.scored() == 0 {
                    judge.out.unscored_replies += 1;
                }
                // the budget counts what the node delivered when nothing is scored
                generated += (aligned.scored() as u64).max(delivered * u64::from(lead.is_some()));
                let query = ForceQuery {
                    model: ModelId::new("smollm2"),
                    prompt: req.prompt,
                    tokens: aligned.tokens,
                };
                tokio::spawn(async move {
                    let mut obs: Vec<Observation> =
                        lead.iter().map(|_| missing_observation()).collect();
                    let r = if aligned.logprobs.iter().any(Option::is_some) {
                        reference.force(&query).await.unwrap()
                    } else {
                        Vec::new()
                    };
                    obs.extend(logprob_observations(&aligned.logprobs, &r, 1.0));
                    Scoring::Logprobs {
                        obs,
                        node_claims: aligned.logprobs,
                        forced: r.len() as u64,
                        reference_logprobs: r,
                        lead,
                        node_list,
                    }
                })
            } else {
                generated += delivered;
                let query = ReferenceQuery {
                    model: ModelId::new("smollm2"),
                    prompt: req.prompt,
                    completion: text.clone(),
                    max_tokens: 256,
                };
                tokio::spawn(async move { Scoring::Text(reference.score(&query).await.unwrap()) })
            };
            pending.push_back(Pending {
                body,
                text,
                delivered,
                scoring,
            });
        }
        while pending.len() >= settings.scoring_concurrency.max(1) {
            let p = pending.pop_front().unwrap();
            judge_reply(&mut judge, p, role, spec, run, &mut reply, dump, ref_tokens).await;
        }
    }
    while let Some(p) = pending.pop_front() {
        judge_reply(&mut judge, p, role, spec, run, &mut reply, dump, ref_tokens).await;
    }
    dump.flush().unwrap();
    judge.finish()
}

/// Waits for `p`'s scoring, writes its dump line and gives it to the judge.
#[allow(clippy::too_many_arguments)]
async fn judge_reply(
    judge: &mut Judge,
    p: Pending,
    role: &str,
    spec: &NodeSpec,
    run: usize,
    reply: &mut usize,
    dump: &mut std::fs::File,
    ref_tokens: &mut u64,
) {
    let line = DumpLine::new(role, spec, run, *reply, &p.body, &p.text);
    *reply += 1;
    match p.scoring.await.unwrap() {
        Scoring::Logprobs {
            obs,
            node_claims,
            reference_logprobs,
            lead,
            node_list,
            forced,
        } => {
            *ref_tokens += forced;
            DumpLine {
                node_claims,
                reference_logprobs,
                lead: lead.map(str::to_owned),
                node_list,
                ..line
            }
            .write(dump);
            judge.reply_obs(&obs, obs.len() as u64, p.delivered);
        }
        Scoring::Text(scored) => {
            *ref_tokens += scored.len() as u64;
            judge.reply(&p.body, &p.text, &scored);
            DumpLine {
                tokens: scored,
                ..line
            }
            .write(dump);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes of CPU; run scripts/trust-matrix.sh"]
async fn trust_matrix() {
    let engine = Engine::discover().unwrap();
    // the reference scores `reference_slots` replies at once (one batch per decode step: about
    // 1.7x less CPU per position at 8 than one at a time, measured on this machine)
    let reference_slots = env_usize("SPINE_TRUST_REFERENCE_SLOTS", 8).max(1);
    let context = (1024 * reference_slots).to_string();
    let reference_server = LlamaServer::start_with_args(
        &engine,
        u32::try_from(reference_slots).unwrap(),
        &["-t", "1", "-fa", "on", "-c", &context],
    )
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
    let first_run = env_usize("SPINE_TRUST_FIRST_RUN", 0);
    let vocab = (env_usize("SPINE_TRUST_NODE_LOGPROBS", 0) == 1)
        .then(|| TokenVocabulary::from_gguf(&engine.model_gguf).unwrap());
    let vocab = vocab.as_ref();
    println!("node logprobs: {}", vocab.is_some());
    let honest_settings = RunSettings {
        scoring_concurrency: reference_slots,
        stop_at_failed: false,
    };
    // a substitute run ends at `failed` unless every run's dump should have the same length
    // (`SPINE_TRUST_FULL_SUBSTITUTE_RUNS=1`, for replays of one node's joined traffic)
    let full_substitute_runs = env_usize("SPINE_TRUST_FULL_SUBSTITUTE_RUNS", 0) == 1;
    let substitute_settings = RunSettings {
        stop_at_failed: !full_substitute_runs,
        // a run that ends at `failed` should not generate far past it
        scoring_concurrency: if full_substitute_runs {
            reference_slots
        } else {
            2
        },
    };

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
        NodeSpec {
            threads: "1",
            flash_attn: "off",
            stream: true,
            ..honest("greedy -t 1 -np 1 fa off, streamed")
        },
        NodeSpec {
            temperature: Some(0.9),
            parallel: 4,
            concurrency: 4,
            flash_attn: "off",
            stream: true,
            ..honest("seeded T=0.9 -t 2 -np 4 fa off, 4 concurrent, streamed")
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
        for run in first_run..first_run + honest_runs {
            let r = node_run(
                &engine,
                &reference,
                spec,
                run,
                honest_tokens,
                "honest",
                &mut dump,
                &mut ref_tokens,
                vocab,
                honest_settings,
            )
            .await;
            honest_total += 1;
            honest_failed += usize::from(r.verdict == Some(AuditVerdict::Failed));
            println!(
                "| honest: {} | {run} | {} | {} | {} | {:?} | {:?} | {:?} | max |Δ| {:.3} | replies {}, unscored {}, short {}, missing {}; before going past split characters: {} positions, {} replies unscored |",
                spec.label,
                r.audited_tokens,
                r.observations,
                r.events,
                r.verdict,
                r.tokens_to_pass,
                r.tokens_to_fail,
                r.max_delta,
                r.replies,
                r.unscored_replies,
                r.short_replies,
                r.missing_replies,
                r.positions_before_split,
                r.unscored_before_split
            );
        }
    }

    // substitutes run one thread: the weights are what is tested, and a two-thread engine on
    // a shared two-core machine spends its time waiting for its other thread
    let honest = |label| NodeSpec {
        threads: "1",
        ..honest(label)
    };
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
        let (mut delivered_within, mut delivered_to_fail) = (0, Vec::new());
        for run in first_run..first_run + sub_runs {
            let r = node_run(
                &engine,
                &reference,
                spec,
                run,
                sub_tokens,
                "substitute",
                &mut dump,
                &mut ref_tokens,
                vocab,
                substitute_settings,
            )
            .await;
            if let Some(t) = r.tokens_to_fail {
                // a verdict comes with the reply that reaches it: one may end past the budget
                caught += usize::from(t <= sub_tokens);
                to_fail.push(t);
            }
            if let Some(t) = r.delivered_to_fail {
                delivered_within += usize::from(t <= sub_tokens);
                delivered_to_fail.push(t);
            }
            println!(
                "| substitute: {} | {run} | {} | {} | {} | {:?} | {:?} | {:?} | delivered {} tokens, {:?} to failed; replies {}, missing {}, short {}, foreign {} |",
                spec.label,
                r.audited_tokens,
                r.observations,
                r.events,
                r.verdict,
                r.tokens_to_pass,
                r.tokens_to_fail,
                r.delivered_tokens,
                r.delivered_to_fail,
                r.replies,
                r.missing_replies,
                r.short_replies,
                r.foreign_replies,
            );
        }
        to_fail.sort_unstable();
        delivered_to_fail.sort_unstable();
        summary.push(format!(
            "{}: failed in {caught}/{sub_runs} runs within {sub_tokens} audited tokens, {}/{sub_runs} at all; tokens to failed (sorted): {to_fail:?}; node logprobs: within {sub_tokens} delivered tokens {delivered_within}/{sub_runs}, delivered tokens to failed (sorted): {delivered_to_fail:?}",
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

/// Whether a dump line's list, judged short when it was dumped, is short by today's rule (its
/// positions were not scored then: a list no longer short adds no observation in a replay).
fn still_short(vocab: &TokenVocabulary, d: &DumpLine) -> bool {
    let mut capture = NodeLogprobs::new(256);
    capture.seen = true;
    capture.tokens = d
        .node_list
        .iter()
        .map(|e| NodeToken {
            bytes: e.bytes.clone(),
            logprob: e.logprob,
            id: e.id,
        })
        .collect();
    matches!(
        judge_node_list(vocab, &capture, d.text.as_bytes(), d.body.as_bytes(), 256),
        NodeList::Short { .. }
    )
}

/// (role, configuration) of a dump line.
type RoleConfig = (String, String);

/// (role, configuration, run) of a dump line.
type RunKey = (String, String, usize);

fn env_f64(name: &str) -> Option<f64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Scores trust-matrix dumps again with the auditor's statistic and test, without engines:
/// `SPINE_TRUST_REPLAY=<dump.jsonl>[,<dump.jsonl>…]`. Settings (defaults: the auditor's):
/// `SPINE_REPLAY_ALPHA`, `SPINE_REPLAY_BETA`, `SPINE_REPLAY_P0`, `SPINE_REPLAY_P1` (greedy
/// positions of the text statistic), `SPINE_REPLAY_LOGPROB_P0`, `SPINE_REPLAY_LOGPROB_P1`
/// (node-logprob positions), `SPINE_REPLAY_EVENT_NATS` (a node-logprob event's |Δ|),
/// `SPINE_REPLAY_BETS` (four, comma-separated), `SPINE_REPLAY_CAP` (nats),
/// `SPINE_REPLAY_MARGIN`; `SPINE_REPLAY_STREAM=1` joins each configuration's runs into one
/// node's traffic (tokens to `failed` over many replies), once from each run on (the runs in
/// order, wrapping around: as many streams as runs); `SPINE_REPLAY_BUDGET` (audited tokens of
/// the "within" column, default 300). With `SPINE_MODEL_GGUF` set, a list the dump judged short
/// is judged again with today's rule.
#[test]
#[ignore = "reads a trust-matrix dump; see the docs"]
fn trust_replay() {
    let paths = std::env::var("SPINE_TRUST_REPLAY").expect("SPINE_TRUST_REPLAY=<dump.jsonl>");
    let mut score = ScoreConfig::default();
    let mut sprt = SprtConfig::default();
    if let Some(v) = env_f64("SPINE_REPLAY_CAP") {
        score.surprisal_cap = v;
    }
    if let Some(v) = env_f64("SPINE_REPLAY_MARGIN") {
        score.greedy_margin = v;
    }
    if let Some(v) = env_f64("SPINE_REPLAY_EVENT_NATS") {
        score.logprob_event_nats = v;
    }
    sprt = sprt.with_error_rates(
        env_f64("SPINE_REPLAY_ALPHA").unwrap_or(sprt.alpha),
        env_f64("SPINE_REPLAY_BETA").unwrap_or(sprt.beta),
    );
    if let Some(v) = env_f64("SPINE_REPLAY_P0") {
        sprt.greedy_p0 = v;
    }
    if let Some(v) = env_f64("SPINE_REPLAY_P1") {
        sprt.greedy_p1 = v;
    }
    if let Some(v) = env_f64("SPINE_REPLAY_LOGPROB_P0") {
        sprt.logprob_p0 = v;
    }
    if let Some(v) = env_f64("SPINE_REPLAY_LOGPROB_P1") {
        sprt.logprob_p1 = v;
    }
    if let Ok(v) = std::env::var("SPINE_REPLAY_BETS") {
        let bets: Vec<f64> = v.split(',').map(|x| x.trim().parse().unwrap()).collect();
        sprt.sampled_bets = bets.try_into().expect("four bets");
    }
    assert!(sprt.is_valid(), "{sprt:?}");
    let stream = std::env::var("SPINE_REPLAY_STREAM").is_ok_and(|v| v == "1");
    // the catalog's vocabulary: a list judged short is judged again with today's rule
    let vocab = std::env::var("SPINE_MODEL_GGUF")
        .ok()
        .map(|p| TokenVocabulary::from_gguf(p).unwrap());
    let budget = env_usize("SPINE_REPLAY_BUDGET", 300) as u64;
    println!("score: {score:?}\nsprt: {sprt:?}\nstream: {stream}");
    // (role, config, run) → replies, in the dump's order
    let mut order: Vec<RunKey> = Vec::new();
    let mut replies: std::collections::HashMap<RunKey, Vec<DumpLine>> =
        std::collections::HashMap::new();
    for path in paths.split(',') {
        let text = std::fs::read_to_string(path).unwrap();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let d: DumpLine = serde_json::from_str(line).unwrap();
            let key = (
                d.role.clone(),
                d.config.clone(),
                if stream { 0 } else { d.run },
            );
            let list = replies.entry(key.clone()).or_default();
            if list.is_empty() {
                order.push(key);
            }
            list.push(d);
        }
    }
    println!("| node | run | audited tokens | positions | events | verdict | Λ | audited tokens to passing | audited tokens to failed |");
    println!("|---|---|---|---|---|---|---|---|---|");
    // per (role, config): runs, failed within budget, failed, tokens to failed, tokens,
    // positions, events
    let mut summary: Vec<((String, String), Vec<RunResult>)> = Vec::new();
    // (key, replies in order): one per run, or in stream mode one per starting run
    let mut jobs: Vec<(RunKey, Vec<&DumpLine>)> = Vec::new();
    for key in &order {
        let mut list: Vec<&DumpLine> = replies[key].iter().collect();
        if stream {
            list.sort_by_key(|d| (d.run, d.reply));
            let mut runs: Vec<usize> = list.iter().map(|d| d.run).collect();
            runs.dedup();
            for (i, first) in runs.iter().enumerate() {
                let start = list.iter().position(|d| d.run == *first).unwrap();
                let rotated = list[start..]
                    .iter()
                    .chain(&list[..start])
                    .copied()
                    .collect();
                jobs.push(((key.0.clone(), key.1.clone(), i), rotated));
            }
        } else {
            jobs.push((key.clone(), list));
        }
    }
    for (key, list) in &jobs {
        let mut judge = Judge::new(score, sprt);
        for d in list {
            if let Some(obs) = logprob_line(d, vocab.as_ref(), &score) {
                judge.reply_obs(&obs, obs.len() as u64, d.node_claims.len() as u64);
            } else {
                judge.reply(d.body.as_bytes(), &d.text, &d.tokens);
            }
            if judge.sprt.rejected && key.0 == "substitute" {
                break;
            }
        }
        let r = judge.finish();
        println!(
            "| {}: {} | {} | {} | {} | {} | {:?} | {:.1} | {:?} | {:?} |",
            key.0,
            key.1,
            key.2,
            r.audited_tokens,
            r.observations,
            r.events,
            r.verdict,
            r.statistic,
            r.tokens_to_pass,
            r.tokens_to_fail
        );
        let group = (key.0.clone(), key.1.clone());
        match summary.iter_mut().find(|(g, _)| *g == group) {
            Some((_, v)) => v.push(r),
            None => summary.push((group, vec![r])),
        }
    }
    println!();
    let mut honest_failed = 0;
    for ((role, config), rs) in &summary {
        let mut to_fail: Vec<u64> = rs.iter().filter_map(|r| r.tokens_to_fail).collect();
        to_fail.sort_unstable();
        let within = to_fail.iter().filter(|t| **t <= budget).count();
        let passing = rs
            .iter()
            .filter(|r| r.verdict == Some(AuditVerdict::Passing))
            .count();
        if role == "honest" {
            honest_failed += to_fail.len();
        }
        println!(
            "{role}: {config}: {} runs, {} audited tokens, {} positions, {} events; failed within {budget}: {within}, at all: {}, passing at the end: {passing}; tokens to failed (sorted): {to_fail:?}",
            rs.len(),
            rs.iter().map(|r| r.audited_tokens).sum::<u64>(),
            rs.iter().map(|r| r.observations).sum::<u64>(),
            rs.iter().map(|r| r.events).sum::<u64>(),
            to_fail.len(),
        );
    }
    println!("honest runs failed: {honest_failed}");
    if let Some(n) = std::env::var("SPINE_REPLAY_BOOTSTRAP")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        bootstrap(&order, &replies, vocab.as_ref(), &score, &sprt, n, budget);
    }
}

/// A node-logprob dump line's observations: the list's own event (a list dumped as short
/// that today's rule does not judge short has none), then the claims against the reference;
/// `None` for a text-statistic line.
fn logprob_line(
    d: &DumpLine,
    vocab: Option<&TokenVocabulary>,
    score: &ScoreConfig,
) -> Option<Vec<Observation>> {
    if d.lead.is_none() && d.node_claims.is_empty() {
        return None;
    }
    let lead = d
        .lead
        .as_deref()
        .filter(|l| *l != "short" || vocab.is_none_or(|v| still_short(v, d)));
    let mut obs: Vec<Observation> = lead.iter().map(|_| missing_observation()).collect();
    obs.extend(logprob_observations(
        &d.node_claims,
        &d.reference_logprobs,
        score.logprob_event_nats,
    ));
    Some(obs)
}

/// `SPINE_REPLAY_BOOTSTRAP=<n>`: per configuration, `n` runs of node-logprob replies drawn at
/// random (with replacement) from all of its replies in the dumps, each judged by a fresh test
/// until `failed` or past `budget` audited tokens; prints the share failed within the budget.
/// An estimate of the detection rate over reply orders the dump's runs did not happen to have
/// (replies taken as independent; a run's replies share a node and a prompt style).
#[allow(clippy::print_stdout)] // a measurement's output
fn bootstrap(
    order: &[RunKey],
    replies: &std::collections::HashMap<RunKey, Vec<DumpLine>>,
    vocab: Option<&TokenVocabulary>,
    score: &ScoreConfig,
    sprt: &SprtConfig,
    n: usize,
    budget: u64,
) {
    // (role, configuration) → every reply's observations
    let mut groups: Vec<(RoleConfig, Vec<Vec<Observation>>)> = Vec::new();
    for key in order {
        let group = (key.0.clone(), key.1.clone());
        let obs = replies[key]
            .iter()
            .filter_map(|d| logprob_line(d, vocab, score));
        match groups.iter_mut().find(|(g, _)| *g == group) {
            Some((_, v)) => v.extend(obs),
            None => groups.push((group, obs.collect())),
        }
    }
    // xorshift64*: a fixed seed, the same draws on every machine
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = |bound: usize| {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % bound
    };
    // a pool of replies with no position would never reach the budget
    for ((role, config), pool) in groups
        .iter()
        .filter(|(_, p)| p.iter().any(|o| !o.is_empty()))
    {
        let mut within = 0usize;
        for _ in 0..n {
            let mut test = Sprt::default();
            let mut audited = 0u64;
            while audited <= budget && !test.rejected {
                let obs = &pool[next(pool.len())];
                audited += obs.len() as u64;
                for o in obs {
                    test.observe(sprt, *o);
                }
            }
            within += usize::from(test.rejected && audited <= budget);
        }
        println!(
            "bootstrap: {role}: {config}: {} replies; {within} of {n} runs failed within {budget} audited tokens ({:.2} %)",
            pool.len(),
            100.0 * within as f64 / n as f64
        );
    }
}
