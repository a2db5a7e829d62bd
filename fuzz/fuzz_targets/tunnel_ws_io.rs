//! The WebSocket ↔ byte-stream adapter (`WsIo`) over arbitrary bytes from the peer: the first
//! byte picks the role (gateway or agent end), the rest is the raw socket input. Reading ends in
//! EOF or an error, never a panic or a hang; writing afterwards errors or succeeds.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::WebSocketStream;

fuzz_target!(|bytes: &[u8]| {
    let Some((&role, input)) = bytes.split_first() else {
        return;
    };
    let role = if role & 1 == 0 {
        Role::Server
    } else {
        Role::Client
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let (mut peer, ours) = tokio::io::duplex(input.len() + 1024);
        peer.write_all(input).await.unwrap();
        // the peer is gone after sending: reads drain the input then end, writes fail
        drop(peer);
        let config = WebSocketConfig::default()
            .max_message_size(Some(64 * 1024))
            .max_frame_size(Some(64 * 1024));
        let ws = WebSocketStream::from_raw_socket(ours, role, Some(config)).await;
        let mut io = spine_transport::WsIo::new(ws).with_max_write_message_bytes(16);
        let mut out = Vec::new();
        let _ = io.read_to_end(&mut out).await;
        assert!(out.len() <= input.len());
        let _ = io.write_all(b"after").await;
        let _ = io.flush().await;
    });
});
