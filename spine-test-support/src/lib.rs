//! Test helpers shared by spine's integration tests (unpublished, dev-dependency only).
//!
//! - [`Engine`]: where the real llama.cpp engine and model are (set up by `scripts/setup.sh`).
//! - [`LlamaServer`]: a real `llama-server` child process on a free port, killed on drop.
//! - [`Child`]: a spine binary as a child process whose stderr is kept for assertions.
//! - [`stdout_of`]: a finished command's stdout, once asserted that it succeeded.
//! - [`GatewayToml`] and [`Ready`]: a test gateway's configuration and its ready line.
//! - [`PgDb`]: a fresh PostgreSQL database per test, dropped on drop.
//! - [`ReplayEngine`]: a fake engine on a real socket replaying recorded bytes in given reads.
//! - [`FakeEngine`]: fakes of vLLM, Ollama and SGLang following their documented API shapes.
//! - [`CutProxy`]: a TCP proxy in front of a real server that a test cuts, stalls and restores.
//! - [`ScriptedBody`], [`body_fn`], [`full`] and [`UpstreamService`] (spine-core's, re-exported):
//!   in-memory bodies, and the shape of a fake node behind the router's and the meter's layers.
//! - [`assert_streams_each`]: a body relays a channel's chunks one by one.
//! - [`node_serving`], [`node_serving_models`] and [`smollm2_node`]: the descriptor of a
//!   llama.cpp test node.
#![allow(clippy::print_stdout)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

mod body;
pub mod fakes;
mod gateway;
mod pg;
mod proxy;
mod replay;
pub use body::{assert_streams_each, body_fn, full, BodyFn, PollFrame, ScriptedBody};
pub use fakes::{FakeEngine, FakeKind, SeenRequest};
pub use gateway::{GatewayToml, Ready};
pub use pg::{pg_server_url, random_hex, with_database, PgDb, DEFAULT_PG_URL};
pub use proxy::CutProxy;
pub use replay::{ReplayEngine, Scripted};
pub use spine_core::UpstreamService;

/// A boxed error for test helpers.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// Paths to the real engine and model, from `SPINE_LLAMA_SERVER`, `SPINE_MODEL_GGUF` and
/// `SPINE_PYTHON` (written to `~/.cache/spine/env.sh` by `scripts/setup.sh`), falling back to the
/// default cache locations.
#[derive(Debug, Clone)]
pub struct Engine {
    /// `llama-server` binary.
    pub llama_server: PathBuf,
    /// SmolLM2-135M-Instruct Q4_1 GGUF.
    pub model_gguf: PathBuf,
    /// Python with the `openai` SDK installed.
    pub python: PathBuf,
}

fn cache_dir() -> PathBuf {
    std::env::var_os("SPINE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/spine")
        })
}

impl Engine {
    /// Finds the engine, model and Python.
    ///
    /// # Errors
    ///
    /// Names the missing file and says to run `scripts/setup.sh`: tests that need the real engine
    /// fail rather than skip.
    pub fn discover() -> Result<Self, Error> {
        let cache = cache_dir();
        let pick = |var: &str, default: PathBuf| -> Result<PathBuf, Error> {
            let path = std::env::var_os(var).map(PathBuf::from).unwrap_or(default);
            if path.exists() {
                Ok(path)
            } else {
                Err(format!(
                    "{} not found (set {var}); run scripts/setup.sh to build the engine and fetch the model",
                    path.display()
                )
                .into())
            }
        };
        Ok(Self {
            llama_server: pick(
                "SPINE_LLAMA_SERVER",
                cache.join("build-llama/bin/llama-server"),
            )?,
            model_gguf: pick(
                "SPINE_MODEL_GGUF",
                cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            )?,
            python: pick("SPINE_PYTHON", cache.join("venv/bin/python"))?,
        })
    }

    /// The `node_modules` directory holding the official OpenAI Node SDK (`SPINE_NODE_SDK`,
    /// installed by `scripts/setup.sh`).
    ///
    /// # Errors
    ///
    /// As [`Engine::discover`], when it is missing.
    pub fn node_sdk(&self) -> Result<PathBuf, Error> {
        let path = std::env::var_os("SPINE_NODE_SDK")
            .map(PathBuf::from)
            .unwrap_or_else(|| cache_dir().join("node-sdk/node_modules"));
        if path.join("openai").exists() {
            Ok(path)
        } else {
            Err(format!(
                "{} holds no `openai` package (set SPINE_NODE_SDK); run scripts/setup.sh",
                path.display()
            )
            .into())
        }
    }

    /// The trust tests' substitute: the model's weights requantized to Q2_K by `scripts/setup.sh`
    /// (`SPINE_SUBSTITUTE_GGUF`).
    ///
    /// # Errors
    ///
    /// As [`Engine::discover`], when the file is missing.
    pub fn substitute_gguf(&self) -> Result<PathBuf, Error> {
        let path = std::env::var_os("SPINE_SUBSTITUTE_GGUF")
            .map(PathBuf::from)
            .unwrap_or_else(|| cache_dir().join("models/SmolLM2-135M-Instruct.requant-Q2_K.gguf"));
        if path.exists() {
            Ok(path)
        } else {
            Err(format!(
                "{} not found (set SPINE_SUBSTITUTE_GGUF); run scripts/setup.sh",
                path.display()
            )
            .into())
        }
    }
}

/// A free TCP port on 127.0.0.1 (bound and released; fine for child processes that cannot bind
/// port 0 and report it).
///
/// # Errors
///
/// When no port can be bound.
pub fn free_port() -> Result<u16, Error> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A child process whose stderr lines are collected; killed on drop.
#[derive(Debug)]
pub struct Child {
    child: tokio::process::Child,
    stderr: Arc<Mutex<Vec<String>>>,
    name: String,
}

impl Child {
    /// Spawns `cmd` with stdout piped (see [`Child::read_json_line`]) and stderr collected.
    ///
    /// # Errors
    ///
    /// When the process cannot be started.
    pub fn spawn(name: &str, mut cmd: Command) -> Result<Self, Error> {
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| format!("starting {name}: {e}"))?;
        let stderr = Arc::new(Mutex::new(Vec::new()));
        if let Some(err) = child.stderr.take() {
            let sink = stderr.clone();
            let echo = std::env::var_os("SPINE_TEST_ECHO").is_some();
            let label = name.to_owned();
            tokio::spawn(async move {
                let mut lines = BufReader::new(err).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if echo {
                        eprintln!("[{label}] {line}");
                    }
                    if let Ok(mut v) = sink.lock() {
                        v.push(line);
                    }
                }
            });
        }
        Ok(Self {
            child,
            stderr,
            name: name.to_owned(),
        })
    }

    /// Reads stdout until a line parses as a JSON object, within `timeout`.
    ///
    /// # Errors
    ///
    /// On timeout or end of output, with the process's stderr tail.
    pub async fn read_json_line(&mut self, timeout: Duration) -> Result<serde_json::Value, Error> {
        let Some(out) = self.child.stdout.take() else {
            return Err(format!("{}: stdout already taken", self.name).into());
        };
        let mut lines = BufReader::new(out).lines();
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, lines.next_line()).await {
                Ok(Ok(Some(line))) => {
                    if let Ok(v @ serde_json::Value::Object(_)) = serde_json::from_str(&line) {
                        // keep draining stdout so the child never blocks on a full pipe
                        tokio::spawn(
                            async move { while let Ok(Some(_)) = lines.next_line().await {} },
                        );
                        return Ok(v);
                    }
                }
                Ok(Ok(None)) | Ok(Err(_)) => {
                    return Err(format!(
                        "{} exited before its ready line; stderr:\n{}",
                        self.name,
                        self.stderr_tail(40)
                    )
                    .into())
                }
                Err(_) => {
                    return Err(format!(
                        "{} printed no ready line within {timeout:?}; stderr:\n{}",
                        self.name,
                        self.stderr_tail(40)
                    )
                    .into())
                }
            }
        }
    }

    /// Every stderr line so far.
    pub fn stderr_lines(&self) -> Vec<String> {
        self.stderr.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The last `n` stderr lines, joined.
    pub fn stderr_tail(&self, n: usize) -> String {
        let lines = self.stderr_lines();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Waits until a stderr line contains `needle`, within `timeout`.
    ///
    /// # Errors
    ///
    /// On timeout, with the stderr tail.
    pub async fn wait_for_stderr(&self, needle: &str, timeout: Duration) -> Result<String, Error> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.stderr_lines().into_iter().find(|l| l.contains(needle)) {
                return Ok(line);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{}: no stderr line with {needle:?} within {timeout:?}; stderr:\n{}",
                    self.name,
                    self.stderr_tail(40)
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills the process and waits for it.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }

    /// The process id, while running.
    pub fn id(&self) -> Option<u32> {
        self.child.id()
    }

    /// Waits up to `timeout` for the process to exit; its exit status, or `None` when it is
    /// still running then.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        tokio::time::timeout(timeout, self.child.wait())
            .await
            .ok()
            .and_then(Result::ok)
    }
}

/// A real llama.cpp `llama-server` on 127.0.0.1, serving the model as `smollm2`.
#[derive(Debug)]
pub struct LlamaServer {
    /// The process.
    pub child: Child,
    /// Its base URL, `http://127.0.0.1:<port>`.
    pub url: String,
}

impl LlamaServer {
    /// Starts `llama-server -m <gguf> --alias smollm2 -c 4096 -np <parallel> -t 1` and waits
    /// until `GET /health` answers 200 (at most 120 s).
    ///
    /// One thread per server (`SPINE_TEST_LLAMA_THREADS` overrides it): a test binary runs two
    /// tests at once and a trust test starts three servers, so on a 2-core machine several
    /// servers share the cores. With more than one thread, every op of every token ends at a
    /// barrier between the server's threads, which spin (`--poll 50`, the default) and then wait
    /// for a sibling the kernel has descheduled: seen in CI as a 135M model's TTFT of 3 s and a
    /// reference that could not score 64 tokens in 120 s. One thread has no barrier.
    ///
    /// # Errors
    ///
    /// When it does not start or become healthy, with its stderr tail.
    pub async fn start(engine: &Engine, parallel: u32) -> Result<Self, Error> {
        Self::start_with_args(engine, parallel, &[]).await
    }

    /// As [`LlamaServer::start`], with `extra` arguments, e.g.
    /// `["--embeddings", "--pooling", "mean"]`: one server then serves chat, completions and
    /// `/v1/embeddings` (llama.cpp refuses embeddings without `--embeddings`, and OpenAI-style
    /// embeddings with the model's default pooling `none`).
    ///
    /// # Errors
    ///
    /// As [`LlamaServer::start`].
    pub async fn start_with_args(
        engine: &Engine,
        parallel: u32,
        extra: &[&str],
    ) -> Result<Self, Error> {
        Self::start_model(engine, &engine.model_gguf, parallel, extra).await
    }

    /// As [`LlamaServer::start_with_args`], serving `gguf` (still as `smollm2`: the trust tests'
    /// substitutes).
    ///
    /// # Errors
    ///
    /// As [`LlamaServer::start`].
    pub async fn start_model(
        engine: &Engine,
        gguf: &Path,
        parallel: u32,
        extra: &[&str],
    ) -> Result<Self, Error> {
        let port = free_port()?;
        let mut cmd = Command::new(&engine.llama_server);
        cmd.arg("-m")
            .arg(gguf)
            .args(["--alias", "smollm2", "--host", "127.0.0.1"])
            .args(["--port", &port.to_string()])
            .args(["-c", "4096", "-np", &parallel.to_string()])
            .args(["-t", &llama_threads(), "--poll", "0"])
            .args(extra);
        let child = Child::spawn("llama-server", cmd)?;
        let url = format!("http://127.0.0.1:{port}");
        wait_http_ok(&format!("{url}/health"), Duration::from_secs(120))
            .await
            .map_err(|e| format!("{e}; llama-server stderr:\n{}", child.stderr_tail(30)))?;
        Ok(Self { child, url })
    }
}

/// The `-t` of the tests' llama-servers: `SPINE_TEST_LLAMA_THREADS`, else 1 (see
/// [`LlamaServer::start`]).
fn llama_threads() -> String {
    std::env::var("SPINE_TEST_LLAMA_THREADS")
        .ok()
        .filter(|t| t.parse::<u16>().is_ok_and(|n| n > 0))
        .unwrap_or_else(|| "1".to_owned())
}

/// Polls `url` until it answers 2xx.
///
/// # Errors
///
/// On timeout.
pub async fn wait_http_ok(url: &str, timeout: Duration) -> Result<(), Error> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(r) = client.get(url).timeout(Duration::from_secs(2)).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        if Instant::now() >= deadline {
            return Err(format!("{url} not healthy within {timeout:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `path` relative to the workspace root.
pub fn workspace_path(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(|p| p.join(path))
        .unwrap_or_else(|| PathBuf::from(path))
}

/// A llama.cpp node serving the one model `model` (no context limit, every endpoint) with
/// `max_concurrency` slots, as the routing tests register it.
pub fn node_serving(model: &str, max_concurrency: u32) -> spine_core::NodeDescriptor {
    spine_core::NodeDescriptor {
        engine: spine_core::EngineKind::LlamaCpp,
        models: vec![spine_core::ModelDescriptor {
            id: spine_core::ModelId::new(model),
            max_context_tokens: None,
            endpoints: None,
        }],
        vram_mib: 1,
        max_concurrency,
        agent_version: "t".into(),
    }
}

/// A llama.cpp node serving each of `models` (no context limit, every endpoint) with
/// `max_concurrency` slots on `vram_mib` MiB of VRAM, agent version `"test"`.
pub fn node_serving_models(
    models: &[&str],
    max_concurrency: u32,
    vram_mib: u64,
) -> spine_core::NodeDescriptor {
    spine_core::NodeDescriptor {
        engine: spine_core::EngineKind::LlamaCpp,
        models: models
            .iter()
            .map(|m| spine_core::ModelDescriptor {
                id: spine_core::ModelId::new(*m),
                max_context_tokens: None,
                endpoints: None,
            })
            .collect(),
        vram_mib,
        max_concurrency,
        agent_version: "test".into(),
    }
}

/// A llama.cpp node serving `smollm2` with a 2048-token context (every endpoint) and 4 slots on
/// 8 GiB, as agent `agent_version`: the node the tunnel suites handshake as.
pub fn smollm2_node(agent_version: &str) -> spine_core::NodeDescriptor {
    spine_core::NodeDescriptor {
        engine: spine_core::EngineKind::LlamaCpp,
        models: vec![spine_core::ModelDescriptor {
            id: spine_core::ModelId::new("smollm2"),
            max_context_tokens: Some(2048),
            endpoints: None,
        }],
        vram_mib: 8192,
        max_concurrency: 4,
        agent_version: agent_version.into(),
    }
}

/// The standard output of a finished command, once asserted that it exited successfully.
///
/// # Panics
///
/// The command failed: the message is `what` followed by its standard error.
pub fn stdout_of(out: std::process::Output, what: &str) -> Vec<u8> {
    assert!(
        out.status.success(),
        "{what}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}
