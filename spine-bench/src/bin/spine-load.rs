//! `spine-load`: the load generator ([`spine_bench::load`]) and the table printer
//! ([`spine_bench::table`]).
//!
//! - `spine-load run …` runs one measurement and prints its [`Report`] as one JSON line;
//! - `spine-load table FILE` reads such lines and prints the side-by-side markdown tables.
#![allow(clippy::print_stdout)]

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use spine_bench::load::{self, Mode, Report, RunConfig, Target};

/// Load generator for OpenAI-compatible endpoints.
#[derive(Debug, Parser)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// One measurement; prints one JSON line.
    Run(Box<RunArgs>),
    /// Markdown tables from a file of `run` lines.
    Table {
        /// File with one JSON report per line.
        file: PathBuf,
    },
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Target name in the report (`direct`, `spine`, `litellm`).
    #[arg(long)]
    name: String,
    /// Completion endpoint URL, e.g. http://127.0.0.1:8080/v1/chat/completions.
    #[arg(long)]
    url: String,
    /// Bearer API key.
    #[arg(long)]
    api_key: Option<String>,
    /// Model id in the request body.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Scenario label in the report.
    #[arg(long)]
    scenario: String,
    /// Open loop at this many requests per second (else closed loop).
    #[arg(long)]
    rate: Option<f64>,
    /// Closed loop: concurrent connections.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Seconds of load.
    #[arg(long, default_value_t = 5.0)]
    duration_secs: f64,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 10.0)]
    timeout_secs: f64,
    /// Open loop: most requests outstanding (above it scheduled requests are dropped).
    #[arg(long, default_value_t = 2048)]
    max_in_flight: usize,
    /// Stream the responses.
    #[arg(long)]
    stream: bool,
    /// `max_tokens` in the request.
    #[arg(long, default_value_t = 16)]
    max_tokens: u64,
    /// Processes whose CPU time to report (the system under test); repeatable.
    #[arg(long = "cpu-pid")]
    cpu_pids: Vec<u32>,
    /// tokio worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Seconds of unrecorded warm-up at the same load first.
    #[arg(long, default_value_t = 0.0)]
    warmup_secs: f64,
    /// Open loop: list each request at least this slow (µs) with its scheduled time in the
    /// report's `slow_requests`, and each streamed event delayed at least this much, with its
    /// index in its stream, in `slow_events`.
    #[arg(long)]
    slow_micros: Option<u64>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    match Args::parse().command {
        Command::Table { file } => {
            let text = std::fs::read_to_string(file)?;
            let reports: Vec<Report> = text
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(serde_json::from_str)
                .collect::<Result<_, _>>()?;
            print!("{}", spine_bench::table::render(&reports));
            Ok(())
        }
        Command::Run(a) => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(a.threads.max(1))
                .enable_all()
                .build()?;
            let target = Target {
                name: a.name.clone(),
                url: a.url.parse()?,
                api_key: a.api_key.clone(),
            };
            let mode = match a.rate {
                Some(rate_per_sec) => Mode::Open { rate_per_sec },
                None => Mode::Closed {
                    concurrency: a.concurrency,
                },
            };
            let cfg = RunConfig {
                mode,
                duration: Duration::from_secs_f64(a.duration_secs),
                timeout: Duration::from_secs_f64(a.timeout_secs),
                max_in_flight: a.max_in_flight,
                body: load::chat_body(&a.model, a.stream, a.max_tokens),
                stream: a.stream,
                slow_micros: a.slow_micros,
            };
            let report = rt.block_on(async {
                let client = load::client(a.concurrency.max(64));
                if a.warmup_secs > 0.0 {
                    let warm = RunConfig {
                        duration: Duration::from_secs_f64(a.warmup_secs),
                        slow_micros: None,
                        ..cfg.clone()
                    };
                    load::run(&client, &target, "warmup", &warm, &[]).await?;
                }
                load::run(&client, &target, &a.scenario, &cfg, &a.cpu_pids).await
            })?;
            eprintln!("[spine-load] {}", report.summary());
            println!("{}", serde_json::to_string(&report)?);
            Ok(())
        }
    }
}
