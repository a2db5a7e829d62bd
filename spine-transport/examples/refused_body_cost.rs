//! What refusing a large request body costs the server, side by side: a handler that reads
//! and drops the body before answering (`drain`) against one that answers at once and leaves
//! the rest to [`LimitedServer`]'s lingering close (`unread`).
//!
//! The server runs on one thread of its own (a current-thread runtime); its CPU time (user +
//! system, `CLOCK_THREAD_CPUTIME_ID`, which includes the kernel's network work done in its
//! context) is read before and after each run. A client on another thread sends `REQUESTS`
//! requests one after another, each on a new connection with a `BODY_BYTES` body, and reads
//! each answer (a 402) to the end.
//!
//! ```sh
//! cargo run --release -p spine-transport --example refused_body_cost
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::{Duration, Instant};

use axum::routing::post;
use http_body_util::BodyExt as _;
use spine_transport::{LimitedServer, ListenerLimits};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const REQUESTS: usize = 300;
const BODY_BYTES: usize = 4 << 20;

fn app() -> axum::Router {
    axum::Router::new()
        .route(
            "/drain",
            post(|req: axum::extract::Request| async move {
                let mut body = req.into_body();
                while let Some(Ok(_)) = body.frame().await {}
                (http::StatusCode::PAYMENT_REQUIRED, "no credit")
            }),
        )
        .route(
            "/unread",
            post(|| async { (http::StatusCode::PAYMENT_REQUIRED, "no credit") }),
        )
}

/// This thread's CPU time, user + system.
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap(),
        u32::try_from(t.tv_nsec).unwrap(),
    )
}

fn main() {
    // the server: one thread, its CPU measured between the client's runs
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (cpu_tx, cpu_rx) =
        tokio::sync::mpsc::unbounded_channel::<std::sync::mpsc::Sender<Duration>>();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            addr_tx.send(listener.local_addr().unwrap()).unwrap();
            tokio::spawn(
                LimitedServer::new("bench", ListenerLimits::default())
                    .http1_only()
                    .serve(listener, app(), std::future::pending()),
            );
            let mut cpu_rx = cpu_rx;
            while let Some(reply) = cpu_rx.recv().await {
                // let lingering sockets finish first
                tokio::time::sleep(Duration::from_millis(200)).await;
                let _ = reply.send(thread_cpu());
            }
        });
    });
    let addr = addr_rx.recv().unwrap();
    let server_cpu = || {
        let (tx, rx) = std::sync::mpsc::channel();
        cpu_tx.send(tx).unwrap();
        rx.recv().unwrap()
    };
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let body = vec![b'x'; BODY_BYTES];
    let run = |path: &'static str| {
        client.block_on(async {
            for _ in 0..REQUESTS {
                let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
                let head = format!(
                    "POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {BODY_BYTES}\r\n\r\n"
                );
                let (mut rd, mut wr) = tcp.split();
                let write = async {
                    wr.write_all(head.as_bytes()).await?;
                    wr.write_all(&body).await
                };
                let mut answer = Vec::new();
                let (written, read) = tokio::join!(write, rd.read_to_end(&mut answer));
                written.unwrap();
                read.unwrap();
                assert!(answer.starts_with(b"HTTP/1.1 402"));
            }
        });
    };
    println!(
        "{REQUESTS} refused requests of {} MiB each, a new connection each, one server thread:",
        BODY_BYTES >> 20
    );
    let mut per = std::collections::HashMap::new();
    for round in 0..3 {
        for path in ["/drain", "/unread"] {
            let before = server_cpu();
            let started = Instant::now();
            run(path);
            let wall = started.elapsed();
            let cpu = server_cpu() - before;
            let us = cpu.as_secs_f64() * 1e6 / REQUESTS as f64;
            per.entry(path).or_insert_with(Vec::new).push(us);
            println!(
                "  round {round} {path:8} server CPU {us:7.1} µs per request ({:.2} s wall)",
                wall.as_secs_f64()
            );
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let drain = median(per.get_mut("/drain").unwrap());
    let unread = median(per.get_mut("/unread").unwrap());
    println!(
        "medians: drain {drain:.1} µs, unread (lingering close) {unread:.1} µs: ratio unread / drain = {:.2}",
        unread / drain
    );
}
