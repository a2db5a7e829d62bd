//! `spine-mock-engine`: the fast mock OpenAI-compatible engine ([`spine_bench::mock`]) as a
//! process. Prints `{"addr":"<ip:port>"}` on stdout once it accepts connections.
#![allow(clippy::print_stdout)]

use std::net::SocketAddr;

use clap::Parser;
use spine_bench::mock::{MockConfig, MockEngine};

/// Serve a mock OpenAI-compatible engine (llama-server shaped).
#[derive(Debug, Parser)]
struct Args {
    /// Address to listen on (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Model id served and echoed.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Prompt tokens claimed in `usage`.
    #[arg(long, default_value_t = 10)]
    prompt_tokens: u64,
    /// Completion tokens per answer (fewer when the request's `max_tokens` asks).
    #[arg(long, default_value_t = 16)]
    completion_tokens: u64,
    /// Time to first token, microseconds.
    #[arg(long, default_value_t = 0)]
    ttft_micros: u64,
    /// Inter-token latency, microseconds.
    #[arg(long, default_value_t = 0)]
    itl_micros: u64,
    /// tokio worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let config = MockConfig {
            model_id: args.model,
            prompt_tokens: args.prompt_tokens,
            completion_tokens: args.completion_tokens,
            ttft_micros: args.ttft_micros,
            itl_micros: args.itl_micros,
            ..MockConfig::default()
        };
        let engine = MockEngine::bind(args.listen, config).await?;
        println!("{}", serde_json::json!({"addr": engine.addr().to_string()}));
        tokio::signal::ctrl_c().await?;
        engine.shutdown();
        Ok(())
    })
}
