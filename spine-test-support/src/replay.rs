//! [`ReplayEngine`]: a fake inference engine on a real socket that replays recorded bytes.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::Error;

/// One scripted answer to `POST /v1/chat/completions`.
#[derive(Debug, Clone)]
pub struct Scripted {
    /// HTTP status.
    pub status: u16,
    /// `Content-Type` header value.
    pub content_type: String,
    /// The body, as the reads the client should see: each one is written (as one HTTP/1.1
    /// chunk) and flushed on its own, [`Scripted::delay`] apart.
    pub reads: Vec<Vec<u8>>,
    /// Pause before each read after the first.
    pub delay: Duration,
    /// Pause before the response head (a long prefill).
    pub head_delay: Duration,
}

impl Scripted {
    /// A streamed (`text/event-stream`) 200 answer with these reads, 5 ms apart.
    pub fn sse(reads: Vec<Vec<u8>>) -> Self {
        Self {
            status: 200,
            content_type: "text/event-stream".to_owned(),
            reads,
            delay: Duration::from_millis(5),
            head_delay: Duration::ZERO,
        }
    }
}

#[derive(Debug, Default)]
struct Shared {
    script: VecDeque<Scripted>,
    requests: Vec<Vec<u8>>,
}

/// A fake llama.cpp-shaped engine: a real HTTP/1.1 server on `127.0.0.1:0` that answers
/// `GET /health`, `GET /v1/models` (one model, `smollm2`, `n_ctx` 8192) and, for each
/// `POST /v1/chat/completions`, the next [`Scripted`] answer's exact bytes in its configured
/// reads (404 when none is queued). Request bodies are recorded. Stops when dropped.
#[derive(Debug)]
pub struct ReplayEngine {
    /// Base URL, `http://127.0.0.1:<port>`.
    pub url: String,
    shared: Arc<Mutex<Shared>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ReplayEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

const MODELS: &str = r#"{"object":"list","data":[{"id":"smollm2","object":"model","owned_by":"llamacpp","meta":{"n_ctx":8192}}]}"#;

impl ReplayEngine {
    /// Binds `127.0.0.1:0` and serves on a spawned task.
    ///
    /// # Errors
    ///
    /// When the socket cannot be bound.
    pub async fn start() -> Result<Self, Error> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let shared = Arc::new(Mutex::new(Shared::default()));
        let state = shared.clone();
        let task = tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let _ = sock.set_nodelay(true);
                tokio::spawn(serve(sock, state.clone()));
            }
        });
        Ok(Self { url, shared, task })
    }

    /// Queues the answer to the next chat completion request.
    pub fn push(&self, answer: Scripted) {
        if let Ok(mut s) = self.shared.lock() {
            s.script.push_back(answer);
        }
    }

    /// Every chat completion request body received so far, in order.
    pub fn requests(&self) -> Vec<Vec<u8>> {
        self.shared
            .lock()
            .map(|s| s.requests.clone())
            .unwrap_or_default()
    }
}

async fn serve(mut sock: TcpStream, shared: Arc<Mutex<Shared>>) {
    let mut buf = Vec::new();
    loop {
        // the head
        let head_end = loop {
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            let mut chunk = [0u8; 4096];
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let mut lines = head.split("\r\n");
        let mut request_line = lines.next().unwrap_or("").split(' ');
        let method = request_line.next().unwrap_or("").to_owned();
        let path = request_line.next().unwrap_or("").to_owned();
        let length = lines
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 4096];
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body = buf[head_end..head_end + length].to_vec();
        buf.drain(..head_end + length);

        let ok = match (method.as_str(), path.as_str()) {
            ("GET", "/health") => simple(&mut sock, 200, r#"{"status":"ok"}"#).await,
            ("GET", "/v1/models") => simple(&mut sock, 200, MODELS).await,
            ("POST", "/v1/chat/completions") => {
                let next = shared.lock().ok().and_then(|mut s| {
                    s.requests.push(body);
                    s.script.pop_front()
                });
                match next {
                    Some(answer) => scripted(&mut sock, answer).await,
                    None => {
                        simple(
                            &mut sock,
                            404,
                            r#"{"error":{"message":"no scripted answer","code":404}}"#,
                        )
                        .await
                    }
                }
            }
            _ => simple(&mut sock, 404, r#"{"error":{"message":"not found"}}"#).await,
        };
        if ok.is_err() {
            return;
        }
    }
}

async fn simple(sock: &mut TcpStream, status: u16, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    sock.write_all(head.as_bytes()).await?;
    sock.write_all(body.as_bytes()).await?;
    sock.flush().await
}

async fn scripted(sock: &mut TcpStream, answer: Scripted) -> std::io::Result<()> {
    tokio::time::sleep(answer.head_delay).await;
    let head = format!(
        "HTTP/1.1 {} X\r\nContent-Type: {}\r\nTransfer-Encoding: chunked\r\n\r\n",
        answer.status, answer.content_type
    );
    sock.write_all(head.as_bytes()).await?;
    sock.flush().await?;
    for (i, read) in answer.reads.iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(answer.delay).await;
        }
        if read.is_empty() {
            continue;
        }
        sock.write_all(format!("{:x}\r\n", read.len()).as_bytes())
            .await?;
        sock.write_all(read).await?;
        sock.write_all(b"\r\n").await?;
        sock.flush().await?;
    }
    sock.write_all(b"0\r\n\r\n").await?;
    sock.flush().await
}
