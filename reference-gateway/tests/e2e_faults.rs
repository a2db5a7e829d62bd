//! Faults end to end (issue 14): a real gateway and real agents over real tunnels, in front of
//! fake engines that speak real HTTP and misbehave where a real engine cannot be made to, and
//! real llama.cpp engines stopped with SIGSTOP.
//!
//! - a stream that breaks before its first token, with no other node: the caller gets the
//!   documented 502 `node_failure`, never a 500, and pays nothing;
//! - a hung engine (SIGSTOP) with its slots full leaves routing within the stated bound, and
//!   later requests are served by the other node.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    add_node, full, gateway_with_node, header, post_json, serve_fake_chat_stream, serve_fake_llama,
    sse_data, tenant, Gateway, CREDITS, ROLE_CHUNK,
};
use hyper::body::Frame;
use serde_json::{json, Value};
use spine_test_support::{Engine, LlamaServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_broken_before_its_first_token_is_a_502_not_a_500() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let chats = Arc::new(AtomicU64::new(0));
    // the role chunk, then the connection is cut before any token
    let (url, task) = serve_fake_chat_stream(chats.clone(), Duration::from_millis(100), || {
        vec![
            Ok(Frame::data(Bytes::from_static(ROLE_CHUNK.as_bytes()))),
            Err(std::io::Error::other("engine crashed")),
        ]
    })
    .await;
    let (gw, t, _node, _agent) = gateway_with_node(dir.path(), &engine, &url, "broken").await;
    for stream in [true, false] {
        let resp = gw
            .api_post(
                &t.api_key,
                "/v1/chat/completions",
                &json!({"model":"smollm2","max_tokens":8,"stream":stream,
                        "messages":[{"role":"user","content":"hi"}]}),
            )
            .await;
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap();
        assert_eq!(status, 502, "stream={stream}: {body}");
        assert_eq!(body["error"]["code"], "node_failure", "{body}");
        assert_eq!(body["error"]["type"], "api_error", "{body}");
        assert!(
            !body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("error reading a body"),
            "{body}"
        );
    }
    // one node: each request reached it once (no other node to retry on)
    assert_eq!(chats.load(Ordering::SeqCst), 2);
    // nothing charged, nothing held
    assert_eq!(gw.balance_once_released(&t.account).await, (CREDITS, 0));
    task.abort();
}

/// `kill -<signal> <pid>`.
fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} {pid}");
}

/// A process stopped with SIGSTOP, continued (SIGCONT) when dropped, so a failing test never
/// leaves a stopped engine behind.
struct Stopped(u32);

impl Stopped {
    fn stop(pid: u32) -> Self {
        signal(pid, "STOP");
        Self(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .arg("-CONT")
            .arg(self.0.to_string())
            .status();
    }
}

async fn routable(gw: &Gateway, node: &str) -> bool {
    let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
    nodes["data"]
        .as_array()
        .is_some_and(|a| a.iter().any(|n| n["node_id"] == node))
}

/// A long streamed chat, read up to its first token; the response is
/// returned still streaming.
async fn long_stream(gw: &Gateway, key: &str) -> reqwest::Response {
    let mut resp = gw
        .api_post(
            key,
            "/v1/chat/completions",
            // the end tokens banned: it runs to max_tokens, holding its slot (a model that
            // stopped early freed one and failed the slots-full precondition once)
            &json!({"model":"smollm2","stream":true,"max_tokens":1500,
                    "logit_bias":{"0":-100,"2":-100},
                    "messages":[{"role":"user","content":"Count from 1 to 1000, one number per line."}]}),
        )
        .await;
    if resp.status() != 200 {
        panic!("{}: {}", resp.status(), resp.text().await.unwrap());
    }
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("\"content\":\"") {
        let chunk = tokio::time::timeout(Duration::from_secs(120), resp.chunk())
            .await
            .expect("first token in time")
            .unwrap()
            .expect("stream open");
        seen.extend_from_slice(&chunk);
    }
    resp
}

/// SIGTERM to an agent whose engine hangs mid-stream (issue 16: "the agent stops within 5 s
/// whatever its engine is doing"): the drain waits only while the engine answers, so the agent
/// exits within seconds, not at the 35 s drain bound; the caller's stream ends with the error
/// event and it pays nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_told_to_stop_while_its_engine_hangs_exits_within_seconds() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let (gw, t, _node, mut agent) =
        gateway_with_node(dir.path(), &engine, &llama.url, "hang").await;
    let resp = long_stream(&gw, &t.api_key).await;
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let _hung = Stopped::stop(llama.child.id().unwrap());
    let told = Instant::now();
    signal(agent.id().unwrap(), "TERM");
    // a hang is the 35 s drain bound; asserted well under it, loose for a loaded machine
    let status = agent.wait_exit(Duration::from_secs(25)).await;
    let took = told.elapsed();
    println!("the agent exited {took:.2?} after SIGTERM with its engine hung: {status:?}");
    assert!(status.is_some(), "still running after {took:?}");
    // its last lines may still be in the pipe when the exit is seen: waited for, not read once
    // (CI once found the line missing from an agent that had exited after 4 s)
    agent
        .wait_for_stderr("engine stopped answering", Duration::from_secs(10))
        .await
        .unwrap();
    let rest = tokio::time::timeout(Duration::from_secs(60), resp.bytes())
        .await
        .expect("the caller's stream ended")
        .unwrap_or_default();
    assert!(!String::from_utf8_lossy(&rest).contains("[DONE]"));
    gw.failed_unbilled(&id).await;
}

/// SIGSTOP of a node's engine with its slots full (issue 14): the node leaves routing within the
/// stated bound (`node_stall_timeout_secs` 5 s + 1 s + 5 s probe = 11 s; asserted ≤ 15 s), later
/// requests are served by the other node without waiting, and after SIGCONT the node comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_engine_with_full_slots_leaves_routing_within_15_s() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let llama_a = LlamaServer::start(&engine, 2).await.unwrap();
    let llama_b = LlamaServer::start(&engine, 2).await.unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;
    let t = tenant(&gw).await;
    // node A alone first, so that its two slots (agent --max-concurrency 2) fill with streams
    let (node_a, _agent_a) = add_node(&gw, dir.path(), &t.operator, &llama_a.url, "a").await;
    let stuck_1 = long_stream(&gw, &t.api_key).await;
    let stuck_2 = long_stream(&gw, &t.api_key).await;
    let (node_b, _agent_b) = add_node(&gw, dir.path(), &t.operator, &llama_b.url, "b").await;
    let (_, nodes) = gw.admin_get("/admin/v1/nodes").await;
    let a_in_flight = nodes["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node_id"] == node_a.as_str())
        .map(|n| n["in_flight"].clone());
    assert_eq!(a_in_flight, Some(json!(2)), "{nodes}");

    // the engine hangs mid-generation
    let stopped = Stopped::stop(llama_a.child.id().unwrap());
    let hung_at = Instant::now();
    while routable(&gw, &node_a).await {
        assert!(
            hung_at.elapsed() < Duration::from_secs(60),
            "node A still routable 60 s after its engine hung"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let left_after = hung_at.elapsed();
    println!("hung node left routing after {left_after:?}");
    assert!(left_after <= Duration::from_secs(15), "{left_after:?}");
    assert!(routable(&gw, &node_b).await);

    // later requests go to node B, with no wait for node A
    let mut accepted = Vec::new();
    for _ in 0..3 {
        let started = Instant::now();
        let (status, id) = gw.say_hi(&t.api_key).await;
        assert_eq!(status, 200);
        let took = started.elapsed();
        println!("request served in {took:?}");
        assert!(took < Duration::from_secs(15), "{took:?}");
        let rec = gw.record(&id).await;
        assert_eq!(rec["node"], node_b.as_str(), "{rec}");
        accepted.push(id);
    }

    // the engine resumes: the node comes back once a probe passes (probed every 1 s while out)
    drop(stopped);
    let resumed_at = Instant::now();
    while !routable(&gw, &node_a).await {
        assert!(
            resumed_at.elapsed() < Duration::from_secs(60),
            "node A not back 60 s after SIGCONT"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("node back {:?} after SIGCONT", resumed_at.elapsed());
    for stuck in [&stuck_1, &stuck_2] {
        accepted.push(stuck.headers()["x-request-id"].to_str().unwrap().to_owned());
    }
    drop((stuck_1, stuck_2));
    // nothing stays held once the streams are gone, and the books balance
    let ledger = common::LedgerDb::open(dir.path(), None).await;
    common::audit_ledger(&gw, &ledger, &t, &accepted, "engine stopped").await;
}

/// A streamed chat that generates `max_tokens` tokens (end tokens banned), each chunk carrying
/// 20 top log-probabilities, OpenAI's bound (~1.5 KB a token: 2,400 tokens are ~3.5 MB; 80 gave
/// ~5.8 KB a token, measured on llama.cpp),
/// so that two unread streams of one node outgrow what the kernel's socket buffers and the
/// tunnel's HTTP/2 windows (2 MiB a stream, 5 MiB a tunnel) absorb: without the gateway's
/// read-ahead their generation stalls and the slots stay taken (checked by running this test
/// with `stream_buffer_bytes = 0`: the queued callers were never served).
fn heavy_stream_body(max_tokens: u64) -> Value {
    json!({"model":"smollm2","stream":true,"max_tokens":max_tokens,
        "logit_bias":{"0":-100,"2":-100},"logprobs":true,"top_logprobs":20,
        "messages":[{"role":"user","content":"Count from 1 to 1000, one number per line."}]})
}

/// Sends `body` and reads the answer up to its first bytes; the response is returned unread
/// past them (a caller that stopped reading).
async fn first_bytes_only(
    http: &reqwest::Client,
    public: &str,
    key: &str,
    body: &Value,
) -> (String, reqwest::Response) {
    let mut resp = http
        .post(format!("{public}/v1/chat/completions"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let first = resp.chunk().await.unwrap();
    assert!(first.is_some_and(|c| !c.is_empty()));
    (id, resp)
}

async fn node_in_flight(gw: &Gateway, node: &str) -> u64 {
    gw.node(node).await["in_flight"].as_u64().unwrap()
}

/// 4 slow readers on a node of 2 slots (issue 14): callers that stop reading after their first
/// bytes do not hold the node's slots: the gateway reads each answer at the node's pace into its
/// bounded per-stream buffer, so the slots free when generation ends, the 2 queued callers are
/// served in turn, and a fifth caller is served while all 4 still have not read their answers.
/// (Two slots, not more: each 2,400-token answer takes the engine a while on a 2-core machine,
/// and what is tested — an unread answer outgrowing the socket buffers and the tunnel's window
/// while its slot frees — needs one queued caller per slot, not many.)
/// The gateway's memory grows by less than the stated bound (`stream_buffer_bytes` 4 MiB + the
/// tunnel's 2 MiB stream window, per stream). The books balance once they read to the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_leave_the_node_slots_free_once_generation_ends() {
    const MAX_TOKENS: u64 = 2400;
    const SLOTS: u32 = 2;
    const READERS: u32 = 2 * SLOTS;
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // 2 slots of 2,560 tokens: room for the 2,400-token answers
    let llama = LlamaServer::start_with_args(&engine, SLOTS, &["-c", "5120"])
        .await
        .unwrap();
    let gw = Gateway::start_with(dir.path(), &engine, "queue_max_wait_secs = 1800").await;
    let t = tenant(&gw).await;
    let (node, _agent) =
        common::add_node_with(&gw, dir.path(), &t.operator, &llama.url, "node", SLOTS).await;
    let http = reqwest::Client::new();
    let rss_before = gw.rss_kib();
    let started = Instant::now();
    let body = heavy_stream_body(MAX_TOKENS);
    let readers: Vec<_> = (0..READERS)
        .map(|_| {
            let (http, public, key, body) = (
                http.clone(),
                gw.public.clone(),
                t.api_key.clone(),
                body.clone(),
            );
            tokio::spawn(async move { first_bytes_only(&http, &public, &key, &body).await })
        })
        .collect();
    let mut slow = Vec::new();
    for r in readers {
        // the last ones wait in the queue for slots the first ones' unread answers would hold
        let (id, resp) = tokio::time::timeout(Duration::from_secs(1800), r)
            .await
            .expect("all slow readers served while none of them reads")
            .unwrap();
        slow.push((id, resp));
    }
    let all_started = started.elapsed();
    // generation ends: the node's slots are free with every answer still unread
    let mut freed = None;
    // (up to 30 min: 2,400 tokens on each slot took 10 min on a 2-core machine busy with builds
    // — a queued caller then waited past a 600 s queue bound —; a node that keeps its slots
    // would never pass)
    for _ in 0..18_000 {
        if node_in_flight(&gw, &node).await == 0
            && common::llama_slots_busy(&http, &llama.url).await == 0
        {
            freed = Some(started.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let freed = freed.expect("the node's slots freed once generation ended");
    let rss_peak = gw.rss_kib();
    // one more caller is served while the slow readers still hold their unread answers
    let ninth_at = Instant::now();
    let (status, ninth_id) = gw.say_hi(&t.api_key).await;
    assert_eq!(status, 200);
    let ninth = ninth_at.elapsed();
    let grown_kib = rss_peak.saturating_sub(rss_before);
    println!(
        "{READERS} slow readers on {SLOTS} slots: all started in {all_started:.1?}, slots free \
         after {freed:.1?} with nothing read; next caller served in {ninth:.2?}; gateway RSS \
         {rss_before} → {rss_peak} KiB (+{grown_kib} KiB)"
    );
    // the stated bound: READERS × (4 MiB read-ahead + 2 MiB stream window), plus the allocator's
    // slack
    assert!(
        grown_kib < u64::from(READERS) * 6 * 1024 + 16 * 1024,
        "+{grown_kib} KiB"
    );
    // the slow readers read their answers: every one complete, the books balanced
    let mut accepted = vec![ninth_id];
    for (id, resp) in slow {
        let rest = resp.bytes().await.unwrap();
        let text = String::from_utf8_lossy(&rest);
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "{id}: ...{}\n(the text it delivered: {:?})",
            &text[text.len().saturating_sub(600)..],
            common::text_of(
                &text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: ").map(str::to_owned))
                    .collect::<Vec<_>>()
            )
        );
        let rec = gw.record(&id).await;
        assert_eq!(rec["outcome"], "completed", "{rec}");
        assert_eq!(
            rec["billed"]["completion_tokens"].as_u64(),
            Some(MAX_TOKENS),
            "{rec}"
        );
        accepted.push(id);
    }
    let ledger = common::LedgerDb::open(dir.path(), None).await;
    common::audit_ledger(&gw, &ledger, &t, &accepted, "slow readers").await;
}

/// Runs `kill` while `resp` (a stream under way) is open, then reads what is left of it: the
/// caller's stream must end (within 60 s) without `[DONE]`, and its record must not be
/// `completed`. Returns the request id.
#[allow(clippy::print_stdout)] // reports what it measured
async fn killed_mid_stream(
    gw: &Gateway,
    resp: reqwest::Response,
    kill: impl std::future::Future<Output = ()>,
    case: &str,
) -> String {
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let killed_at = Instant::now();
    kill.await;
    let rest = tokio::time::timeout(Duration::from_secs(60), resp.bytes())
        .await
        .unwrap_or_else(|_| panic!("{case}: the caller's stream did not end within 60 s"));
    // a body cut by the gateway may end without its last chunk; what came is the answer
    let text = String::from_utf8_lossy(&rest.unwrap_or_default()).into_owned();
    let ended = killed_at.elapsed();
    let rec = gw.record(&id).await;
    println!(
        "{case}: the caller's stream ended {ended:.2?} later, outcome {}, billed {}",
        rec["outcome"], rec["billed"]
    );
    assert!(!text.contains("data: [DONE]"), "{case}: {text}");
    // the caller's stream ends with the gateway's error event, and the caller pays nothing
    let last = sse_data(&text);
    let last: Value = serde_json::from_str(last.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_failed", "{case}: {text}");
    assert_eq!(rec["outcome"], "upstream_failed", "{case}: {rec}");
    assert_eq!(rec["debit_micros"].as_u64(), Some(0), "{case}: {rec}");
    id
}

/// The fault matrix (issue 14) on real llama.cpp nodes, with the ledger audit after each case:
/// no hold active, every accepted request recorded, Σ debits = Σ operator credits + fees, the
/// account paid and the operator earned exactly that.
///
/// 0. the agent serving a stream is stopped (SIGSTOP) mid-stream, then continued;
/// 1. the agent serving a stream is killed (SIGKILL) mid-stream;
/// 2. the engine serving a stream is killed (SIGKILL) mid-stream, another node up;
/// 3. a burst of 12 concurrent requests against a balance that covers only a few of them;
/// 4. the gateway stopped (SIGSTOP) mid-stream for 20 s, then continued.
///
/// On SQLite and on PostgreSQL.
#[allow(clippy::print_stdout)] // reports what it measured
async fn fault_matrix(pg: Option<&common::PgDb>) {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut llama_a = LlamaServer::start(&engine, 2).await.unwrap();
    let mut llama_b = LlamaServer::start(&engine, 2).await.unwrap();
    // a caller waits in the queue as long as a slow, loaded machine needs (the burst's requests
    // queue behind each other on four slots): the bound is what a hang would take, not 30 s
    let extra = "queue_max_wait_secs = 600\n".to_owned()
        + &pg.map_or(String::new(), |db| format!("database_url = \"{}\"", db.url));
    let gw = Gateway::start_with(dir.path(), &engine, &extra).await;
    let t = tenant(&gw).await;
    let ledger = common::LedgerDb::open(dir.path(), pg).await;
    let mut accepted = Vec::new();

    // --- 0. agent stopped mid-stream: the tunnel's keepalive declares it dead (≤ 15 s) ------
    let (node_a, mut agent_a) = add_node(&gw, dir.path(), &t.operator, &llama_a.url, "a").await;
    let resp = long_stream(&gw, &t.api_key).await;
    let stopped = Stopped::stop(agent_a.id().unwrap());
    let id = killed_mid_stream(&gw, resp, async {}, "agent stopped mid-stream").await;
    accepted.push(id);
    common::audit_ledger(&gw, &ledger, &t, &accepted, "agent stopped mid-stream").await;
    drop(stopped);
    // continued, it finds its tunnel gone, dials again and is routable once more
    let established = |agent: &spine_test_support::Child| {
        agent
            .stderr_lines()
            .iter()
            .filter(|l| l.contains("tunnel established"))
            .count()
    };
    for _ in 0..600 {
        if established(&agent_a) >= 2 && routable(&gw, &node_a).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        established(&agent_a) >= 2 && routable(&gw, &node_a).await,
        "{}",
        agent_a.stderr_tail(20)
    );

    // --- 1. agent killed mid-stream -------------------------------------------------------
    let resp = long_stream(&gw, &t.api_key).await;
    accepted.push(killed_mid_stream(&gw, resp, agent_a.kill(), "agent killed mid-stream").await);
    common::audit_ledger(&gw, &ledger, &t, &accepted, "agent killed mid-stream").await;

    // --- 2. engine killed mid-stream; the other node serves what follows ---------------------
    // node A's agent again (same identity), and node B
    let agent_a = common::start_agent(&gw, &dir.path().join("a.key"), &llama_a.url, "a");
    let (node_b, _agent_b) = add_node(&gw, dir.path(), &t.operator, &llama_b.url, "b").await;
    for _ in 0..300 {
        if routable(&gw, &node_a).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(routable(&gw, &node_a).await, "{}", agent_a.stderr_tail(20));
    let resp = long_stream(&gw, &t.api_key).await;
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let on_a = node_in_flight(&gw, &node_a).await > 0;
    let (victim, survivor) = if on_a {
        (&mut llama_a, node_b.clone())
    } else {
        (&mut llama_b, node_a.clone())
    };
    let killed = killed_mid_stream(&gw, resp, victim.child.kill(), "engine killed mid-stream");
    assert_eq!(killed.await, id);
    accepted.push(id);
    // what follows is served, by the other node
    for _ in 0..3 {
        let (status, id) = gw.say_hi(&t.api_key).await;
        assert_eq!(status, 200);
        assert_eq!(gw.record(&id).await["node"], survivor.as_str());
        accepted.push(id);
    }
    common::audit_ledger(&gw, &ledger, &t, &accepted, "engine killed mid-stream").await;

    // --- 3. a burst against a small balance ------------------------------------------------
    // 64 tokens at 0.6 micros each ≈ 40 micros a request: 150 micros cover a few
    const SMALL_CREDIT: u64 = 150;
    let (small, small_key) = common::account_with_credit(&gw, SMALL_CREDIT).await;
    let burst: Vec<_> = (0..12)
        .map(|i| {
            let (http, public, key) = (gw.http.clone(), gw.public.clone(), small_key.clone());
            tokio::spawn(async move {
                let resp = post_json(
                    &http,
                    &format!("{public}/v1/chat/completions"),
                    &key,
                    &json!({"model":"smollm2","stream":true,"max_tokens":64,
                        "messages":[{"role":"user","content":format!("Count to twenty, run {i}.")}]}),
                )
                .await;
                let status = resp.status().as_u16();
                let id = header(&resp, "x-request-id");
                let _ = resp.bytes().await;
                (status, id)
            })
        })
        .collect();
    let (mut served, mut refused) = (0, 0);
    for task in burst {
        let (status, id) = task.await.unwrap();
        match status {
            200 => {
                served += 1;
                accepted.push(id.unwrap());
            }
            402 => refused += 1,
            other => panic!("burst against a small balance: status {other}"),
        }
    }
    println!("burst of 12 against {SMALL_CREDIT} micros: {served} served, {refused} refused (402)");
    assert!(
        served >= 1 && refused >= 1,
        "{served} served, {refused} refused"
    );
    common::audit_ledger_of(
        &gw,
        &ledger,
        &[(&t.account, common::CREDITS), (&small, SMALL_CREDIT)],
        &t.operator,
        &accepted,
        "burst against a small balance",
    )
    .await;
    let (balance, _) = gw.balance(&small).await;
    assert!(balance <= SMALL_CREDIT, "{balance}");

    // --- 4. the gateway stopped (SIGSTOP) mid-stream for 20 s, then continued ---------------
    // its agents' keepalive (10 s + 5 s) finds it dead and they dial again; the stream it was
    // serving ends with the error event once it runs again, and settles
    let resp = long_stream(&gw, &t.api_key).await;
    let gateway = Stopped::stop(gw.child.id().unwrap());
    tokio::time::sleep(Duration::from_secs(20)).await;
    drop(gateway);
    let id = killed_mid_stream(&gw, resp, async {}, "gateway stopped for 20 s").await;
    accepted.push(id);
    // and it serves again, once an agent is back
    let mut served = None;
    for _ in 0..60 {
        let (status, id) = gw.say_hi(&t.api_key).await;
        if status == 200 {
            served = Some(id);
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    accepted.push(served.expect("served again after the gateway was continued"));
    let audit = common::audit_ledger_of(
        &gw,
        &ledger,
        &[(&t.account, common::CREDITS), (&small, SMALL_CREDIT)],
        &t.operator,
        &accepted,
        "gateway stopped mid-stream",
    )
    .await;
    println!("fault matrix: {audit:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_matrix_keeps_the_books_on_sqlite() {
    fault_matrix(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_matrix_keeps_the_books_on_postgresql() {
    let db = common::PgDb::create();
    fault_matrix(Some(&db)).await;
}

/// The gateway killed (SIGKILL) with a stream in flight, then started again on the same data
/// (issue 14): the next start settles the stranded hold `upstream_failed` (`swept: restart`), the
/// record names the node that served it, nothing stays held, and the books balance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_stream_settles_its_hold_at_the_next_start() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let (mut gw, t, node, _agent) =
        gateway_with_node(dir.path(), &engine, &llama.url, "node").await;
    let resp = long_stream(&gw, &t.api_key).await;
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    // the node is noted on the hold off the response path, once the answer began
    let ledger = common::LedgerDb::open(dir.path(), None).await;
    let noted = ledger
        .int_once(
            "SELECT COUNT(*) FROM holds WHERE state = 'held' AND node_id IS NOT NULL",
            1,
            100,
            Duration::from_millis(50),
        )
        .await;
    assert_eq!(noted, 1, "the streaming request's hold names its node");
    gw.child.kill().await;
    drop(resp);
    drop(ledger);
    let gw = Gateway::start(dir.path(), &engine).await;
    let rec = gw.record(&id).await;
    println!(
        "gateway killed mid-stream, started again: outcome {}, swept {}, node {}, billed {}",
        rec["outcome"], rec["swept"], rec["node"], rec["billed"]
    );
    assert_eq!(rec["outcome"], "upstream_failed", "{rec}");
    assert_eq!(rec["swept"], "restart", "{rec}");
    assert_eq!(rec["node"], node.as_str(), "{rec}");
    assert_eq!(rec["debit_micros"].as_u64(), Some(0), "{rec}");
    // the usage known when the answer began: the counted prompt
    assert!(
        rec["billed"]["prompt_tokens"].as_u64().unwrap() > 0,
        "{rec}"
    );
    let ledger = common::LedgerDb::open(dir.path(), None).await;
    common::audit_ledger(&gw, &ledger, &t, &[id], "gateway killed mid-stream").await;
}

/// The gateway killed (SIGKILL) in the middle of a run of non-streamed requests (issue 17),
/// then started again on the same data: every settlement committed before the kill is still
/// there with the same debit, every request answered 200 has a record (its own settlement, or
/// the restart's sweep for one answered before its settlement committed), no hold stays active
/// and the books balance. On SQLite and on PostgreSQL.
///
/// By default the load is 16 closed-loop callers until 300 answers — in a debug build on the CI
/// machine, hundreds a second, which is what the test can hold that machine to. With
/// `SPINE_CRASH_RATE=<req/s>` it is an open loop at that rate (request `i` sent at
/// `start + i / rate`, however many are in flight) for `SPINE_CRASH_LOAD_SECS` (default 5)
/// seconds, then the kill while requests are still being sent: the 2,000 req/s needs the
/// release build, `SPINE_CRASH_RATE=2000 cargo test --release -p reference-gateway --test
/// e2e_faults -- --nocapture killed_under_load` (`docs/benchmarks.md` has what it measured).
#[allow(clippy::print_stdout)] // reports what it measured
async fn killed_under_load(pg: Option<&common::PgDb>) {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (url, _engine_task) = serve_fake_llama(|_path, _body| async move {
        let answer = json!({"id":"c","object":"chat.completion","created":1,"model":"smollm2",
            "choices":[{"index":0,"message":{"role":"assistant","content":"Hi there!"},"finish_reason":"stop"}]});
        full(200, "application/json", answer.to_string())
    })
    .await;
    let extra = pg.map_or(String::new(), |db| format!("database_url = \"{}\"", db.url));
    let mut gw = Gateway::start_with(dir.path(), &engine, &extra).await;
    let t = tenant(&gw).await;
    let (_node, _agent) = add_node(&gw, dir.path(), &t.operator, &url, "node").await;
    let caller = Caller {
        http: reqwest::Client::new(),
        url: format!("{}/v1/chat/completions", gw.public),
        key: t.api_key.clone(),
        answered: Arc::new(std::sync::Mutex::new(Vec::new())),
    };
    let rate: Option<f64> = std::env::var("SPINE_CRASH_RATE")
        .ok()
        .map(|v| v.parse().expect("SPINE_CRASH_RATE: requests per second"));
    let started = Instant::now();
    let sent = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = match rate {
        None => {
            let callers: Vec<_> = (0..16)
                .map(|_| {
                    let (caller, sent) = (caller.clone(), sent.clone());
                    tokio::spawn(async move {
                        while {
                            sent.fetch_add(1, Ordering::Relaxed);
                            caller.once().await
                        } {}
                    })
                })
                .collect();
            // until a few hundred answers (or 120 s on a very slow machine)
            while caller.answered.lock().unwrap().len() < 300
                && started.elapsed() < Duration::from_secs(120)
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tokio::spawn(async move {
                for c in callers {
                    c.await.unwrap();
                }
            })
        }
        Some(rate) => {
            let secs: f64 = std::env::var("SPINE_CRASH_LOAD_SECS")
                .ok()
                .map_or(5.0, |v| v.parse().expect("SPINE_CRASH_LOAD_SECS: seconds"));
            let (caller, sent, stop) = (caller.clone(), sent.clone(), stop.clone());
            let schedule = tokio::spawn(async move {
                let mut in_flight = tokio::task::JoinSet::new();
                let start = tokio::time::Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    let i = sent.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate))
                        .await;
                    let caller = caller.clone();
                    in_flight.spawn(async move { caller.once().await });
                    while in_flight.try_join_next().is_some() {}
                }
                while in_flight.join_next().await.is_some() {}
            });
            tokio::time::sleep(Duration::from_secs_f64(secs)).await;
            schedule
        }
    };
    // SIGKILL while the load runs; the callers see the gateway go and stop
    gw.child.kill().await;
    let load_secs = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    let answered = caller.answered.lock().unwrap().clone();
    assert!(!answered.is_empty(), "no request answered before the kill");
    // what the ledger had committed when the process died
    let ledger = common::LedgerDb::open(dir.path(), pg).await;
    let committed = ledger.int("SELECT COUNT(*) FROM requests").await;
    let committed_debits = ledger
        .int("SELECT CAST(COALESCE(SUM(debit_micros), 0) AS BIGINT) FROM requests")
        .await;
    drop(ledger);
    let gw = Gateway::start_with(dir.path(), &engine, &extra).await;
    let ledger = common::LedgerDb::open(dir.path(), pg).await;
    // every settlement committed before the kill is there, unchanged
    let kept = ledger
        .int("SELECT COUNT(*) FROM requests WHERE swept IS NULL")
        .await;
    let kept_debits = ledger
        .int("SELECT CAST(COALESCE(SUM(debit_micros), 0) AS BIGINT) FROM requests WHERE swept IS NULL")
        .await;
    assert_eq!(
        kept, committed,
        "a committed settlement was lost or changed by the restart"
    );
    assert_eq!(
        kept_debits, committed_debits,
        "committed debits changed by the restart"
    );
    // (the stale holds are swept at the start on SQLite, by an instance that sees the dead
    // one's heartbeat lapse on PostgreSQL: the audit waits for both)
    let audit = common::audit_ledger(&gw, &ledger, &t, &answered, "killed under load").await;
    let swept = ledger
        .int("SELECT COUNT(*) FROM requests WHERE swept IS NOT NULL")
        .await;
    assert_eq!(audit.records, committed + swept, "{audit:?}");
    // answered 200 before their own settlement committed: settled by the sweep, unpaid
    let ids = answered
        .iter()
        .map(|id| format!("'{}'", id.replace('\'', "")))
        .collect::<Vec<_>>()
        .join(",");
    let answered_swept = ledger
        .int(&format!(
            "SELECT COUNT(*) FROM requests WHERE swept IS NOT NULL AND request_id IN ({ids})"
        ))
        .await;
    println!(
        "{} sent ({}), {} answered 200 in {load_secs:.1} s ({:.0}/s) before SIGKILL; {committed} \
         settlements committed then, {kept} after the restart; {swept} holds swept, \
         {answered_swept} of them answered 200 before the kill (their tokens went unpaid)",
        sent.load(Ordering::Relaxed),
        rate.map_or("16 closed-loop callers".to_owned(), |r| format!(
            "open loop at {r} req/s"
        )),
        answered.len(),
        answered.len() as f64 / load_secs
    );
}

/// One caller of [`killed_under_load`]: sends a non-streamed chat request and keeps the
/// request id of every 200.
#[derive(Clone)]
struct Caller {
    http: reqwest::Client,
    url: String,
    key: String,
    answered: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Caller {
    /// One request; `false` once the gateway is gone (connection refused or cut).
    async fn once(&self) -> bool {
        let body = json!({"model":"smollm2","max_tokens":8,
            "messages":[{"role":"user","content":"Say hi."}]});
        let Ok(resp) = self
            .http
            .post(&self.url)
            .bearer_auth(&self.key)
            .json(&body)
            .send()
            .await
        else {
            return false;
        };
        let id = resp.headers().get("x-request-id").cloned();
        let ok = resp.status() == 200;
        if resp.bytes().await.is_err() {
            return false;
        }
        if let (true, Some(id)) = (ok, id) {
            let id = id.to_str().unwrap().to_owned();
            self.answered.lock().unwrap().push(id);
        }
        true
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_under_load_keeps_every_committed_settlement() {
    killed_under_load(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_under_load_keeps_every_committed_settlement_on_postgresql() {
    let db = common::PgDb::create();
    killed_under_load(Some(&db)).await;
}

/// The soak of the fault matrix (issue 14): for `SPINE_SOAK_SECS` (default 300) seconds, two
/// real llama.cpp nodes serve a stream of mixed requests from four concurrent callers —
/// streamed and not, chat and completions, 1–64 tokens, a third of them cancelled at a random
/// point — while, halfway, a standby agent with node A's identity is started and the active one
/// killed (a duplicate identity taking over). Then the ledger audit. `#[ignore]`d (minutes);
/// run: `cargo test --workspace --test e2e_faults -- --ignored --nocapture soak`.
#[allow(clippy::print_stdout)] // reports what it measured
async fn soak(pg: Option<&common::PgDb>) {
    let secs: u64 = std::env::var("SPINE_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let llama_a = LlamaServer::start(&engine, 2).await.unwrap();
    let llama_b = LlamaServer::start(&engine, 2).await.unwrap();
    let extra = pg.map_or(String::new(), |db| format!("database_url = \"{}\"", db.url));
    let gw = Gateway::start_with(dir.path(), &engine, &extra).await;
    let t = tenant(&gw).await;
    let (_node_a, mut agent_a) = add_node(&gw, dir.path(), &t.operator, &llama_a.url, "a").await;
    let (_node_b, _agent_b) = add_node(&gw, dir.path(), &t.operator, &llama_b.url, "b").await;
    let ledger = common::LedgerDb::open(dir.path(), pg).await;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let callers: Vec<_> = (0..4u64)
        .map(|c| {
            let (http, public, key) = (gw.http.clone(), gw.public.clone(), t.api_key.clone());
            tokio::spawn(async move {
                let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ (c + 1);
                let mut next = move || {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed
                };
                let (mut sent, mut answered, mut cancelled) = (0u64, Vec::new(), 0u64);
                while Instant::now() < deadline {
                    let r = next();
                    let streamed = r % 2 == 0;
                    let chat = r % 3 != 0;
                    let max_tokens = 1 + (r >> 8) % 64;
                    let body = if chat {
                        json!({"model":"smollm2","stream":streamed,"max_tokens":max_tokens,
                            "messages":[{"role":"user","content":format!("Soak {c}-{sent}: count to ten.")}]})
                    } else {
                        json!({"model":"smollm2","stream":streamed,"max_tokens":max_tokens,
                            "prompt":format!("Soak {c}-{sent}: once upon a time")})
                    };
                    let path = if chat { "chat/completions" } else { "completions" };
                    sent += 1;
                    let send = async {
                        let resp = http
                            .post(format!("{public}/v1/{path}"))
                            .bearer_auth(&key)
                            .json(&body)
                            .send()
                            .await?;
                        let status = resp.status().as_u16();
                        let id = resp
                            .headers()
                            .get("x-request-id")
                            .map(|v| v.to_str().unwrap_or_default().to_owned());
                        resp.bytes().await.map(|_| (status, id))
                    };
                    let cancel_after = (r >> 16) % 3 == 0;
                    let limit = Duration::from_millis(if cancel_after {
                        (r >> 20) % 400
                    } else {
                        120_000
                    });
                    match tokio::time::timeout(limit, send).await {
                        Ok(Ok((200, Some(id)))) => answered.push(id),
                        Ok(Ok((status, _))) => {
                            // a request may meet the takeover: refused or failed, never a 500
                            assert!(
                                matches!(status, 502 | 503),
                                "soak: status {status} for {body}"
                            );
                        }
                        Ok(Err(_)) | Err(_) => cancelled += 1,
                    }
                }
                (sent, answered, cancelled)
            })
        })
        .collect();
    // halfway: a standby with node A's identity, then the active agent killed
    tokio::time::sleep(Duration::from_secs(secs / 2)).await;
    let standby = common::start_agent(&gw, &dir.path().join("a.key"), &llama_a.url, "a2");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let killed_at = Instant::now();
    agent_a.kill().await;
    let mut took_over = None;
    for _ in 0..600 {
        if standby
            .stderr_lines()
            .iter()
            .any(|l| l.contains("tunnel established"))
        {
            took_over = Some(killed_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took_over = took_over.expect("the standby took over");
    let (mut sent, mut answered, mut cancelled) = (0, Vec::new(), 0);
    for c in callers {
        let (s, a, x) = c.await.unwrap();
        sent += s;
        answered.extend(a);
        cancelled += x;
    }
    let audit = common::audit_ledger(&gw, &ledger, &t, &answered, "soak").await;
    println!(
        "soak ({}, {secs} s): {sent} requests, {} answered 200, {cancelled} cancelled by their \
         callers; standby took over {took_over:.1?} after the active agent was killed; {audit:?}",
        if pg.is_some() { "PostgreSQL" } else { "SQLite" },
        answered.len()
    );
    assert!(answered.len() as u64 > sent / 3, "too few answered");
}

#[ignore = "minutes: cargo test --workspace --test e2e_faults -- --ignored --nocapture soak"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_keeps_the_books_on_sqlite() {
    soak(None).await;
}

#[ignore = "minutes: cargo test --workspace --test e2e_faults -- --ignored --nocapture soak"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_keeps_the_books_on_postgresql() {
    let db = common::PgDb::create();
    soak(Some(&db)).await;
}
