//! The exactness study: `N` varied chat requests sent straight to a real `llama-server`, the
//! engine's `usage` compared with spine's independent count under the billing rules. Prints one
//! row per request and the totals (`docs/metering.md` records a run).
//!
//! ```sh
//! scripts/exactness.sh            # 200 requests; or: scripts/exactness.sh 40
//! scripts/exactness.sh 200 --responses   # the same cases as Responses API requests, translated
//! ```
//!
//! Starts `llama-server -m $SPINE_MODEL_GGUF --alias smollm2 -c 4096 -np 2 -t 2` on a free
//! port (`SPINE_LLAMA_SERVER`, `SPINE_MODEL_GGUF`; `source ~/.cache/spine/env.sh`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]

#[path = "../tests/support/exactness.rs"]
mod exactness;

use std::time::Instant;

fn main() {
    let count: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("the number of requests"))
        .unwrap_or(200);
    let bin = std::env::var("SPINE_LLAMA_SERVER")
        .expect("SPINE_LLAMA_SERVER (source ~/.cache/spine/env.sh)");
    let gguf = std::env::var("SPINE_MODEL_GGUF").expect("SPINE_MODEL_GGUF");
    let tok = spine_meter::ModelTokenizer::from_gguf(&gguf).unwrap();
    let engine = exactness::start_engine(bin.as_ref(), gguf.as_ref());
    let port = engine.port;
    let started = Instant::now();
    let cases = if std::env::args().any(|a| a == "--responses") {
        exactness::responses_cases(count)
    } else {
        exactness::cases(count)
    };
    let results = exactness::run_all(port, &tok, &cases, 2);
    println!("{}", exactness::table(&results));
    println!("wall time {:.0} s", started.elapsed().as_secs_f64());
}
