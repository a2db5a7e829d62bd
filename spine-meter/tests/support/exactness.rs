//! The exactness study shared by `tests/exactness.rs` (a fixed subset, in CI) and
//! `examples/exactness.rs` (the full study, `scripts/exactness.sh`): requests sent straight to a
//! real `llama-server`, the engine's `usage` compared with spine's independent count under the
//! billing rules (`ModelTokenizer::count_prompt`, `ModelTokenizer::bill_completion`).
// included by a test and an example, each using part of it
#![allow(dead_code, unreachable_pub)]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use spine_meter::tokenizer::{CompletionRule, GeneratedText};
use spine_meter::ModelTokenizer;

/// One request of the study.
#[derive(Debug, Clone)]
pub struct Case {
    /// Short label: prompt kind, sampling, max_tokens, stream, n.
    pub name: String,
    /// The request body sent to `/v1/chat/completions`.
    pub body: Value,
}

/// What one request measured.
#[derive(Debug, Clone)]
pub struct Measured {
    pub name: String,
    pub engine_prompt: u64,
    pub engine_completion: u64,
    pub our_prompt: u64,
    /// What the engine's `usage.completion_tokens` should be: the billed count, except with
    /// `n > 1`, where llama.cpp reports the first choice's count alone.
    pub our_completion: u64,
    /// Completion tokens billed, all choices.
    pub billed_completion: u64,
    /// Tokens of the generated text alone, summed over choices.
    pub text_tokens: u64,
    /// UTF-8 bytes of the generated text, summed over choices.
    pub text_bytes: u64,
    pub finish: Vec<String>,
    pub length_unsupported: bool,
    /// The first choice's text (for explaining misses).
    pub text: String,
}

impl Measured {
    pub fn exact(&self) -> bool {
        self.engine_prompt == self.our_prompt && self.engine_completion == self.our_completion
    }
}

const PROMPTS: &[(&str, &str)] = &[
    ("en", "Name three colors."),
    ("en", "Write a short poem about the sea."),
    ("en", "Explain photosynthesis to a child."),
    (
        "en",
        "What is the capital of Japan? Answer in one sentence.",
    ),
    ("en", "List five fruits, one per line."),
    ("en", "Tell me a story about a dragon who learns to cook."),
    ("code", "Write a Python function that reverses a string."),
    (
        "code",
        "```rust\nfn main() { println!(\"hi\"); }\n```\nExplain this code.",
    ),
    (
        "code",
        "Write a SQL query selecting all users older than 30.",
    ),
    (
        "code",
        "Write a bash one-liner that counts lines in all .rs files.",
    ),
    (
        "emoji",
        "Reply using only emoji: how do you feel today? 🙂🎉",
    ),
    ("emoji", "Describe a party with lots of emoji 🎈🎂🥳🎶"),
    ("emoji", "👨‍👩‍👧 family, 🏳️‍🌈 flag, ❤️ heart: what do these mean?"),
    ("cjk", "请用中文介绍一下你自己。"),
    ("cjk", "日本の首都はどこですか？"),
    ("cjk", "한국어로 인사해 주세요."),
    ("cjk", "Translate to Chinese: good morning, how are you?"),
    (
        "mixed",
        "Ünïcödé ünd émojis 👨‍👩‍👧 and 2024-01-01T00:00:00Z — naïve café",
    ),
    (
        "mixed",
        "literal <|im_start|>assistant tokens <|im_end|> inside",
    ),
    ("mixed", "  leading and trailing spaces \n\n with\ttabs  "),
    ("math", "What is 12345 * 678? Show your steps."),
    ("math", "Count from 1 to 30 separated by commas."),
];

const SAMPLED_TEMPS: &[f64] = &[0.7, 0.8, 0.9, 1.0];
const MAX_TOKENS: &[u64] = &[4, 8, 12, 16, 24, 32, 48, 64];

fn messages(i: usize) -> (String, Value) {
    let (kind, prompt) = PROMPTS[i % PROMPTS.len()];
    let variant = (i / PROMPTS.len()) % 4;
    match variant {
        // plain user message
        0 => (
            kind.to_owned(),
            json!([{"role": "user", "content": prompt}]),
        ),
        // system + user
        1 => (
            format!("{kind}+sys"),
            json!([{"role": "system", "content": "You are a terse assistant."},
                   {"role": "user", "content": prompt}]),
        ),
        // multi-turn
        2 => (
            format!("{kind}+turns"),
            json!([{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello! How can I help you today?"},
                   {"role": "user", "content": prompt}]),
        ),
        // content parts
        _ => (
            format!("{kind}+parts"),
            json!([{"role": "user", "content": [{"type": "text", "text": "Please help."},
                                                {"type": "text", "text": prompt}]}]),
        ),
    }
}

/// The study's requests, in a fixed order: case `i` always has the same body.
///
/// Every third request is greedy (`temperature: 0`), the others sampled (temperature 0.7–1.0,
/// seed `1000 + i`); every other request streams (with `include_usage`); every 13th non-streamed
/// request asks for `n: 2`; every 17th carries a `tools` array (SmolLM2's template ignores it,
/// and so does the engine); `max_tokens` cycles through 4–64, so both `stop` and `length`
/// finishes occur.
pub fn cases(count: usize) -> Vec<Case> {
    (0..count)
        .map(|i| {
            let (kind, messages) = messages(i);
            let max_tokens = MAX_TOKENS[(i * 7 + i / 8) % MAX_TOKENS.len()];
            let greedy = i % 3 == 0;
            let stream = i % 2 == 1;
            let mut body =
                json!({"model": "smollm2", "messages": messages, "max_tokens": max_tokens});
            let mut name = format!("{i:03} {kind}");
            if greedy {
                body["temperature"] = json!(0);
                name.push_str(" greedy");
            } else {
                let t = SAMPLED_TEMPS[i % SAMPLED_TEMPS.len()];
                body["temperature"] = json!(t);
                body["seed"] = json!(1000 + i);
                name.push_str(&format!(" t={t}"));
            }
            name.push_str(&format!(" max={max_tokens}"));
            if stream {
                body["stream"] = json!(true);
                body["stream_options"] = json!({"include_usage": true});
                name.push_str(" stream");
            } else if i % 13 == 0 {
                body["n"] = json!(2);
                name.push_str(" n=2");
            }
            if i % 17 == 5 {
                body["tools"] = json!([{"type": "function", "function": {
                    "name": "get_weather", "description": "Get the weather for a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]}}}]);
                name.push_str(" tools");
            }
            Case { name, body }
        })
        .collect()
}

/// The study's requests as the Responses API would carry them (`POST /v1/responses`): each case of
/// [`cases`] without `n: 2` written as a Responses request (`input` items, `max_output_tokens`,
/// `temperature`, `stream`, flattened function `tools`; no `seed`, which the Responses API does
/// not have) and translated by [`spine_meter::responses::chat_request`], the body the gateway
/// sends to a node. So the study measures the translation's requests against the engine.
pub fn responses_cases(count: usize) -> Vec<Case> {
    cases(count)
        .into_iter()
        .filter(|c| c.body.get("n").is_none())
        .map(|c| {
            let chat = &c.body;
            let mut req = json!({
                "model": chat["model"],
                "input": chat["messages"],
                "max_output_tokens": chat["max_tokens"],
                "temperature": chat["temperature"],
            });
            if chat.get("stream").is_some() {
                req["stream"] = json!(true);
            }
            if let Some(tools) = chat.get("tools").and_then(Value::as_array) {
                let flat: Vec<Value> = tools
                    .iter()
                    .map(|t| {
                        let mut f = t["function"].clone();
                        f["type"] = json!("function");
                        f
                    })
                    .collect();
                req["tools"] = json!(flat);
            }
            let translated = spine_meter::responses::chat_request(req.to_string().as_bytes())
                .unwrap_or_else(|e| panic!("{}: {e}", c.name));
            let body: Value = serde_json::from_slice(&translated.chat_body).unwrap();
            let name = c.name.split(" seed").next().unwrap_or(&c.name).to_owned() + " responses";
            Case { name, body }
        })
        .collect()
}

/// A real `llama-server` child process (`--alias smollm2 -c 4096 -np 2 -t 2`) on a free port;
/// killed on drop.
pub struct Engine {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `bin` serving `gguf` and waits (at most 120 s) until `/health` answers 200.
pub fn start_engine(bin: &Path, gguf: &Path) -> Engine {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(bin)
        .arg("-m")
        .arg(gguf)
        .args(["--alias", "smollm2", "--host", "127.0.0.1"])
        .args([
            "--port",
            &port.to_string(),
            "-c",
            "4096",
            "-np",
            "2",
            // one thread, no polling: two tests' servers share 2 cores without barrier stalls
            // (see spine_test_support::LlamaServer::start)
            "-t",
            "1",
            "--poll",
            "0",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let engine = Engine { child, port };
    let deadline = Instant::now() + Duration::from_secs(120);
    while TcpStream::connect(("127.0.0.1", port)).is_err()
        || http(port, "GET", "/health", None).0 != 200
    {
        assert!(
            Instant::now() < deadline,
            "llama-server did not become healthy"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    engine
}

/// A blocking HTTP/1.1 request to `127.0.0.1:port`; the response body, de-chunked.
pub fn http(port: u16, method: &str, path: &str, body: Option<&Value>) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    let body = body
        .map(|b| serde_json::to_vec(b).unwrap())
        .unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(&body).unwrap();
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).unwrap();
    let split = resp.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let head = String::from_utf8_lossy(&resp[..split]).to_ascii_lowercase();
    let status: u16 = String::from_utf8_lossy(&resp[9..12]).parse().unwrap();
    let mut body = resp[split..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    (status, body)
}

fn dechunk(mut input: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = input.windows(2).position(|w| w == b"\r\n") {
        let size_text = String::from_utf8_lossy(&input[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        input = &input[eol + 2..];
        if size == 0 {
            break;
        }
        out.extend_from_slice(&input[..size]);
        input = &input[size + 2..];
    }
    out
}

/// Sends one case to the engine and applies the billing rules to what came back.
pub fn run_case(port: u16, tok: &ModelTokenizer, case: &Case) -> Measured {
    let (status, body) = http(port, "POST", "/v1/chat/completions", Some(&case.body));
    assert_eq!(
        status,
        200,
        "{}: {}",
        case.name,
        String::from_utf8_lossy(&body)
    );
    let n = case.body["n"].as_u64().unwrap_or(1);
    let mut choices: Vec<(GeneratedText, Option<String>)> = vec![Default::default(); n as usize];
    let usage: Value;
    if case.body["stream"] == json!(true) {
        let text = String::from_utf8(body).unwrap();
        let mut last_usage = Value::Null;
        for data in text
            .split("\n\n")
            .filter_map(|ev| ev.strip_prefix("data: "))
        {
            if data == "[DONE]" {
                break;
            }
            let chunk: Value = serde_json::from_str(data).unwrap();
            if !chunk["usage"].is_null() {
                last_usage = chunk["usage"].clone();
            }
            for c in chunk["choices"].as_array().into_iter().flatten() {
                let i = c["index"].as_u64().unwrap_or(0) as usize;
                choices[i].0.push_choice_json(c);
                if let Some(f) = c["finish_reason"].as_str() {
                    choices[i].1 = Some(f.to_owned());
                }
            }
        }
        usage = last_usage;
    } else {
        let v: Value = serde_json::from_slice(&body).unwrap();
        for c in v["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap_or(0) as usize;
            choices[i].0.push_choice_json(c);
            choices[i].1 = c["finish_reason"].as_str().map(str::to_owned);
        }
        usage = v["usage"].clone();
    }
    let our_prompt = tok.count_prompt(&case.body).unwrap();
    let max_tokens = case.body["max_tokens"].as_u64();
    let context = tok.context_length_tokens().unwrap_or(8192);
    let room = context - our_prompt;
    let cap = max_tokens.map_or(room, |m| m.min(room)).max(1);
    let mut m = Measured {
        name: case.name.clone(),
        engine_prompt: usage["prompt_tokens"].as_u64().unwrap(),
        engine_completion: usage["completion_tokens"].as_u64().unwrap(),
        our_prompt,
        our_completion: 0,
        billed_completion: 0,
        text_tokens: 0,
        text_bytes: 0,
        finish: Vec::new(),
        length_unsupported: false,
        text: choices[0].0.content().to_owned(),
    };
    for (i, (generated, finish)) in choices.iter().enumerate() {
        let count = tok.bill_completion(
            generated,
            finish.as_deref(),
            CompletionRule {
                max_tokens,
                cap_tokens: cap,
                completed: true,
            },
        );
        m.billed_completion += count.tokens;
        if i == 0 {
            m.our_completion = count.tokens;
        }
        m.text_tokens += count.text_tokens;
        m.text_bytes += generated.len_bytes();
        m.length_unsupported |= count.length_unsupported;
        m.finish.push(finish.clone().unwrap_or_default());
    }
    m
}

/// Runs `cases` against the engine on `port` with `parallel` requests at a time (the engine's
/// `-np`), in case order.
pub fn run_all(port: u16, tok: &ModelTokenizer, cases: &[Case], parallel: usize) -> Vec<Measured> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(vec![None; cases.len()]);
    std::thread::scope(|s| {
        for _ in 0..parallel.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Some(case) = cases.get(i) else { break };
                let m = run_case(port, tok, case);
                eprintln!("{} {}", if m.exact() { "exact" } else { "MISS " }, row(&m));
                results.lock().unwrap()[i] = Some(m);
            });
        }
    });
    results
        .into_inner()
        .unwrap()
        .into_iter()
        .flatten()
        .collect()
}

/// One table row.
pub fn row(m: &Measured) -> String {
    format!(
        "{:<44} prompt {:>4}/{:<4} completion {:>4}/{:<4} billed {:>4} text_tokens {:>4} bytes {:>4} finish {:<14}{}",
        m.name,
        m.our_prompt,
        m.engine_prompt,
        m.our_completion,
        m.engine_completion,
        m.billed_completion,
        m.text_tokens,
        m.text_bytes,
        m.finish.join(","),
        if m.length_unsupported { " length_unsupported" } else { "" }
    )
}

/// The table and the totals.
pub fn table(results: &[Measured]) -> String {
    let mut out = String::from(
        "case                                         prompt ours/engine  completion ours/engine\n",
    );
    for m in results {
        out.push_str(if m.exact() { "  " } else { "✗ " });
        out.push_str(&row(m));
        out.push('\n');
    }
    let n = results.len();
    let exact = results.iter().filter(|m| m.exact()).count();
    let prompt = results
        .iter()
        .filter(|m| m.engine_prompt == m.our_prompt)
        .count();
    let completion = results
        .iter()
        .filter(|m| m.engine_completion == m.our_completion)
        .count();
    let by_finish = |f: &str| {
        let of: Vec<&Measured> = results
            .iter()
            .filter(|m| m.finish.iter().all(|x| x == f))
            .collect();
        format!(
            "{f}: {}/{}",
            of.iter().filter(|m| m.exact()).count(),
            of.len()
        )
    };
    out.push_str(&format!(
        "requests {n}; exact (prompt and completion) {exact}/{n} ({:.1} %); prompt exact {prompt}/{n}; completion exact {completion}/{n}; by finish: {}, {}\n",
        100.0 * exact as f64 / n.max(1) as f64,
        by_finish("stop"),
        by_finish("length"),
    ));
    out
}
