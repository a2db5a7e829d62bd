//! The exactness study: `N` varied chat requests sent straight to a real `llama-server`, the
//! engine's `usage` compared with spine's independent count under the billing rules. Prints one
//! row per request and the totals (`docs/metering.md` records a run).
//!
//! ```sh
//! scripts/exactness.sh            # 200 requests; or: scripts/exactness.sh 40
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

use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() {
    let count: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("the number of requests"))
        .unwrap_or(200);
    let bin = std::env::var("SPINE_LLAMA_SERVER")
        .expect("SPINE_LLAMA_SERVER (source ~/.cache/spine/env.sh)");
    let gguf = std::env::var("SPINE_MODEL_GGUF").expect("SPINE_MODEL_GGUF");
    let tok = spine_meter::ModelTokenizer::from_gguf(&gguf).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _engine = Kill(
        Command::new(&bin)
            .args(["-m", &gguf, "--alias", "smollm2", "--host", "127.0.0.1"])
            .args([
                "--port",
                &port.to_string(),
                "-c",
                "4096",
                "-np",
                "2",
                "-t",
                "2",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin}: {e}")),
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    while TcpStream::connect(("127.0.0.1", port)).is_err()
        || exactness::http(port, "GET", "/health", None).0 != 200
    {
        assert!(
            Instant::now() < deadline,
            "llama-server did not become healthy"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let started = Instant::now();
    let cases = exactness::cases(count);
    let results = exactness::run_all(port, &tok, &cases, 2);
    println!("{}", exactness::table(&results));
    println!("wall time {:.0} s", started.elapsed().as_secs_f64());
}
