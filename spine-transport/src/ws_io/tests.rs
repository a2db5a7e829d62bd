#![allow(clippy::unwrap_used, clippy::expect_used)]
use futures_util::{SinkExt as _, StreamExt as _};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};
use tokio_tungstenite::tungstenite::protocol::Role;

use super::*;

async fn pair(
    buffer_bytes: usize,
) -> (WebSocketStream<DuplexStream>, WebSocketStream<DuplexStream>) {
    let (a, b) = tokio::io::duplex(buffer_bytes);
    let client = WebSocketStream::from_raw_socket(a, Role::Client, None).await;
    let server = WebSocketStream::from_raw_socket(b, Role::Server, None).await;
    (client, server)
}

#[tokio::test]
async fn binary_messages_read_as_one_byte_stream() {
    let (mut peer, ws) = pair(64 * 1024).await;
    let mut io = WsIo::new(ws);
    peer.send(Message::binary(&b"hello "[..])).await.unwrap();
    peer.send(Message::binary(&b"world"[..])).await.unwrap();
    let mut small = [0u8; 4];
    let n = io.read(&mut small).await.unwrap();
    assert_eq!(&small[..n], b"hell");
    let mut rest = vec![0u8; 7];
    io.read_exact(&mut rest).await.unwrap();
    assert_eq!(rest, b"o world");
}

#[tokio::test]
async fn writes_become_binary_messages_capped_in_size() {
    let (mut peer, ws) = pair(64 * 1024).await;
    let mut io = WsIo::new(ws).with_max_write_message_bytes(4);
    io.write_all(b"abcdefghij").await.unwrap();
    io.flush().await.unwrap();
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(peer.next().await.unwrap().unwrap());
    }
    assert_eq!(
        got,
        vec![
            Message::binary(&b"abcd"[..]),
            Message::binary(&b"efgh"[..]),
            Message::binary(&b"ij"[..]),
        ]
    );
}

#[tokio::test]
async fn pings_are_answered_and_skipped() {
    let (mut peer, ws) = pair(64 * 1024).await;
    let mut io = WsIo::new(ws);
    peer.send(Message::Ping(Bytes::from_static(b"p1")))
        .await
        .unwrap();
    peer.send(Message::Pong(Bytes::from_static(b"unsolicited")))
        .await
        .unwrap();
    peer.send(Message::binary(&b"data"[..])).await.unwrap();
    let mut buf = [0u8; 4];
    io.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"data");
    // the pong goes out on the next write-side activity at the latest
    io.flush().await.unwrap();
    assert_eq!(
        peer.next().await.unwrap().unwrap(),
        Message::Pong(Bytes::from_static(b"p1"))
    );
}

#[tokio::test]
async fn close_reads_as_eof() {
    let (mut peer, ws) = pair(64 * 1024).await;
    let mut io = WsIo::new(ws);
    peer.send(Message::binary(&b"last"[..])).await.unwrap();
    peer.close(None).await.unwrap();
    let mut all = Vec::new();
    io.read_to_end(&mut all).await.unwrap();
    assert_eq!(all, b"last");
    // and EOF is sticky
    let mut buf = [0u8; 1];
    assert_eq!(io.read(&mut buf).await.unwrap(), 0);
}

#[tokio::test]
async fn dropped_peer_reads_as_eof_or_error_never_hangs() {
    let (peer, ws) = pair(64 * 1024).await;
    let mut io = WsIo::new(ws);
    drop(peer);
    let mut buf = [0u8; 1];
    match io.read(&mut buf).await {
        Ok(n) => assert_eq!(n, 0),
        Err(e) => assert_ne!(e.kind(), io::ErrorKind::InvalidData),
    }
}

#[tokio::test]
async fn text_after_handshake_is_an_error() {
    let (mut peer, ws) = pair(64 * 1024).await;
    let mut io = WsIo::new(ws);
    peer.send(Message::text("{}")).await.unwrap();
    let mut buf = [0u8; 8];
    let err = io.read(&mut buf).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    assert_eq!(
        err.to_string(),
        "text message on the tunnel after the handshake"
    );
}

#[tokio::test]
async fn shutdown_sends_close() {
    let (mut peer, ws) = pair(64 * 1024).await;
    let mut io = WsIo::new(ws);
    io.shutdown().await.unwrap();
    assert!(matches!(
        peer.next().await.unwrap().unwrap(),
        Message::Close(_)
    ));
}

#[tokio::test(start_paused = true)]
async fn pings_go_out_on_the_interval_while_reading_and_activity_counts() {
    let (mut peer, ws) = pair(64 * 1024).await;
    let activity = Arc::new(AtomicU64::new(0));
    let mut io = WsIo::new(ws)
        .with_ping_interval(Duration::from_secs(20))
        .with_activity(activity.clone());
    let reader = tokio::spawn(async move {
        let mut buf = [0u8; 4];
        io.read_exact(&mut buf).await.unwrap();
        buf
    });
    tokio::time::sleep(Duration::from_secs(21)).await;
    assert_eq!(
        peer.next().await.unwrap().unwrap(),
        Message::Ping(Bytes::new())
    );
    peer.send(Message::binary(&b"data"[..])).await.unwrap();
    assert_eq!(&reader.await.unwrap(), b"data");
    // the pong the peer sent back is not counted (it is still queued); the data message is
    assert!(activity.load(Ordering::Relaxed) >= 1);
}

#[tokio::test]
async fn kill_fails_reads_and_writes() {
    let (_peer, ws) = pair(64 * 1024).await;
    let kill = Arc::new(tokio::sync::Notify::new());
    let mut io = WsIo::new(ws).with_kill({
        let kill = kill.clone();
        async move { kill.notified().await }
    });
    kill.notify_one();
    let mut buf = [0u8; 1];
    let err = io.read(&mut buf).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
    let err = io.write(b"x").await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
}

#[tokio::test(start_paused = true)]
async fn blocked_write_times_out() {
    // The peer never reads; the pipe holds 1 KiB.
    let (_peer, ws) = pair(1024).await;
    let mut io = WsIo::new(ws).with_write_timeout(Duration::from_secs(5));
    let started = tokio::time::Instant::now();
    let payload = vec![7u8; 512 * 1024];
    let res = async {
        io.write_all(&payload).await?;
        io.flush().await
    }
    .await;
    let err = res.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    assert_eq!(started.elapsed(), Duration::from_secs(5));
}

/// Counts its wake-ups.
struct CountingWaker(std::sync::atomic::AtomicUsize);

impl std::task::Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn a_flush_after_writes_is_put_off_once_and_then_writes() {
    let (a, b) = tokio::io::duplex(64 * 1024);
    let config = crate::server::ws_config(1 << 20, 4096, DEFAULT_MAX_WRITE_MESSAGE_BYTES);
    let ws = WebSocketStream::from_raw_socket(a, Role::Client, Some(config)).await;
    let mut peer = WebSocketStream::from_raw_socket(b, Role::Server, None).await;
    let mut io = WsIo::new(ws);
    let counter = Arc::new(CountingWaker(std::sync::atomic::AtomicUsize::new(0)));
    let waker = std::task::Waker::from(counter.clone());
    let mut cx = Context::from_waker(&waker);

    // nothing written: nothing to put off
    assert!(matches!(
        Pin::new(&mut io).poll_flush(&mut cx),
        Poll::Ready(Ok(()))
    ));
    assert_eq!(counter.0.load(Ordering::SeqCst), 0);

    assert!(matches!(
        Pin::new(&mut io).poll_write(&mut cx, b"abc"),
        Poll::Ready(Ok(3))
    ));
    // the first flush wakes its own task and waits one turn; the message stays buffered
    assert!(Pin::new(&mut io).poll_flush(&mut cx).is_pending());
    assert_eq!(counter.0.load(Ordering::SeqCst), 1);
    let early = tokio::time::timeout(Duration::from_millis(50), peer.next()).await;
    assert!(
        early.is_err(),
        "the message left before the flush: {early:?}"
    );
    // the next one writes it
    assert!(matches!(
        Pin::new(&mut io).poll_flush(&mut cx),
        Poll::Ready(Ok(()))
    ));
    assert_eq!(
        peer.next().await.unwrap().unwrap(),
        Message::binary(&b"abc"[..])
    );
    // and the one after that has nothing left to put off
    assert!(matches!(
        Pin::new(&mut io).poll_flush(&mut cx),
        Poll::Ready(Ok(()))
    ));
    assert_eq!(counter.0.load(Ordering::SeqCst), 1);
}
