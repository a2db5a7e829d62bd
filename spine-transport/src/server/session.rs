use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use spine_core::{BoxBody, NodeDescriptor, NodeId};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};
use tokio_tungstenite::WebSocketStream;
use tracing::{debug, info, warn};

use super::health::{maintain, probe_alive};
use super::state::{Session, SessionShared, Shared};
use super::{now_ms, TunnelState};
use crate::handshake::{decode_hello, Accepted, Challenge, GatewayMessage};
use crate::{metric, RefusalReason, WsIo};

/// Closes `ws` with the refusal's code and reason, then drains it briefly so the close
/// handshake completes.
async fn refuse<S>(ws: &mut WebSocketStream<S>, reason: RefusalReason)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    info!(reason = reason.as_str(), "tunnel refused");
    metric::rejected(reason.as_str());
    let frame = CloseFrame {
        code: CloseCode::from(reason.close_code()),
        reason: Utf8Bytes::from_static(reason.as_str()),
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        if ws.close(Some(frame)).await.is_ok() {
            while let Some(Ok(_)) = ws.next().await {}
        }
    })
    .await;
}

enum HelloWait {
    Text(Utf8Bytes),
    Refuse(RefusalReason),
    Gone,
}

async fn next_text<S>(ws: &mut WebSocketStream<S>) -> HelloWait
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    loop {
        match ws.next().await {
            Some(Ok(Message::Text(text))) => return HelloWait::Text(text),
            Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
            Some(Ok(Message::Binary(_))) => {
                return HelloWait::Refuse(RefusalReason::MalformedHandshake)
            }
            Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return HelloWait::Gone,
        }
    }
}

/// What a new session found in the table for its node.
enum Slot {
    /// Reserved for the new session.
    Reserved(Arc<SessionShared>),
    /// Another session is still setting up: refuse.
    Busy,
    /// A live-looking session to probe first.
    Probe {
        id: u64,
        sender: SendRequest<BoxBody>,
        old: Arc<SessionShared>,
    },
}

/// The tunnel after the upgrade: handshake, then the HTTP/2 session.
pub(super) async fn run_session<S>(shared: Arc<Shared>, mut ws: WebSocketStream<S>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let config = &shared.config;
    let challenge = match Challenge::generate(&config.gateway_id, now_ms()) {
        Ok(c) => c,
        Err(e) => {
            warn!(error = %e, "cannot generate challenge");
            refuse(&mut ws, RefusalReason::Internal).await;
            return;
        }
    };
    let challenge_json = match serde_json::to_string(&GatewayMessage::Challenge(challenge.clone()))
    {
        Ok(json) => json,
        Err(e) => {
            warn!(error = %e, "cannot encode challenge");
            return;
        }
    };
    if let Err(e) = futures_util::SinkExt::send(&mut ws, Message::text(challenge_json)).await {
        debug!(error = %e, "sending challenge failed");
        return;
    }
    let sent_at = Instant::now();

    let text = match tokio::time::timeout(config.handshake_timeout, next_text(&mut ws)).await {
        Err(_) => return refuse(&mut ws, RefusalReason::HandshakeTimeout).await,
        Ok(HelloWait::Gone) => {
            debug!("agent left during the handshake");
            return;
        }
        Ok(HelloWait::Refuse(reason)) => return refuse(&mut ws, reason).await,
        Ok(HelloWait::Text(text)) => text,
    };
    let hello = match decode_hello(text.as_bytes()) {
        Ok(hello) => hello,
        Err(reason) => return refuse(&mut ws, reason).await,
    };
    if sent_at.elapsed() > config.challenge_max_age {
        return refuse(&mut ws, RefusalReason::StaleChallenge).await;
    }
    if let Err(reason) = hello.verify(&challenge) {
        return refuse(&mut ws, reason).await;
    }
    if !config
        .public_names
        .iter()
        .any(|n| crate::handshake::gateway_name(n) == hello.gateway_name)
    {
        let name: String = hello.gateway_name.chars().take(100).collect();
        info!(gateway_name = %name, "hello signed for another gateway name");
        return refuse(&mut ws, RefusalReason::WrongGateway).await;
    }
    let node = match shared.auth.authenticate(&hello.public_key).await {
        Ok(node) => node,
        Err(reason) => return refuse(&mut ws, reason).await,
    };
    tracing::Span::current().record("node", tracing::field::display(&node));

    // One session per node (design brief §4, reconnection race). When the node already has a
    // session, probe it: if it answers (or anything arrives on it) within the takeover probe
    // timeout it is live and this one is refused; otherwise it is closed and this one takes over.
    let session_id = shared.next_session_id.fetch_add(1, Ordering::Relaxed);
    let max_streams = hello
        .descriptor
        .max_concurrency
        .clamp(1, config.max_streams_per_node.max(1));
    // The router admits up to the descriptor's max_concurrency: hand it (events, `connected`)
    // the limit the tunnel enforces, not the one the node advertised.
    let mut descriptor = hello.descriptor.clone();
    descriptor.max_concurrency = max_streams;
    let session_shared = loop {
        match reserve(&shared, &node, session_id, &descriptor, max_streams) {
            Slot::Reserved(s) => break s,
            Slot::Busy => return refuse(&mut ws, RefusalReason::DuplicateSession).await,
            Slot::Probe { id, sender, old } => {
                if probe_alive(sender, &old, config.takeover_probe_timeout).await {
                    info!(%node, "node already has a live tunnel; refusing the new one");
                    return refuse(&mut ws, RefusalReason::DuplicateSession).await;
                }
                let replaced = {
                    let mut sessions = shared.sessions();
                    match sessions.get(&node) {
                        Some(s) if s.id == id => {
                            let old = sessions.remove(&node);
                            if let Some(old) = old {
                                metrics::gauge!(metric::TUNNELS_CONNECTED).decrement(1.0);
                                if old.routable {
                                    metrics::gauge!(metric::NODES_ROUTABLE).decrement(1.0);
                                    shared.events.node_gone(&node);
                                }
                                old.shared.kill.notify_one();
                            }
                            true
                        }
                        _ => false,
                    }
                };
                if replaced {
                    metrics::counter!(metric::TAKEOVERS).increment(1);
                    info!(%node, "old tunnel did not answer its probe; the new one takes over");
                }
                // loop: reserve again (another racer may have taken the slot meanwhile)
            }
        }
    };

    let session = SessionGuard {
        shared: shared.clone(),
        node: node.clone(),
        id: session_id,
    };
    let accepted = GatewayMessage::Accepted(Accepted {
        node_id: node.clone(),
    });
    let sent = match serde_json::to_string(&accepted) {
        Ok(json) => futures_util::SinkExt::send(&mut ws, Message::text(json))
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = sent {
        debug!(error = %e, "sending acceptance failed");
        return session.end();
    }
    metrics::counter!(metric::HANDSHAKES_ACCEPTED).increment(1);
    info!(
        %node,
        engine = hello.descriptor.engine.as_str(),
        models = hello.descriptor.models.len(),
        max_concurrency = hello.descriptor.max_concurrency,
        max_streams,
        "tunnel accepted"
    );

    let io = WsIo::new(ws)
        .with_write_timeout(config.write_timeout)
        .with_max_write_message_bytes(config.max_write_message_bytes)
        .with_ping_interval(config.ws_ping_interval)
        .with_activity(session_shared.activity.clone())
        .with_kill({
            let session_shared = session_shared.clone();
            async move { session_shared.kill.notified().await }
        });
    let mut builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(config.keepalive_interval)
        .keep_alive_timeout(config.keepalive_timeout)
        .keep_alive_while_idle(true)
        .max_header_list_size(config.max_header_list_bytes)
        // bounded per-stream send buffering towards a slow node
        .max_send_buf_size(256 * 1024);
    let (sender, conn) = match builder.handshake::<_, BoxBody>(TokioIo::new(io)).await {
        Ok(pair) => pair,
        Err(e) => {
            warn!(error = %e, "http/2 handshake over the tunnel failed");
            return session.end();
        }
    };
    let mut conn = tokio::spawn(conn);
    {
        let mut sessions = shared.sessions();
        if let Some(s) = sessions.get_mut(&node).filter(|s| s.id == session_id) {
            s.sender = Some(sender.clone());
        }
    }

    tokio::select! {
        res = &mut conn => match res {
            Ok(Ok(())) => info!(%node, "tunnel closed"),
            Ok(Err(e)) => info!(%node, error = %e, "tunnel ended"),
            Err(e) => warn!(%node, error = %e, "tunnel task failed"),
        },
        () = maintain(&shared, &node, session_id, &session_shared, sender) => {
            // replaced by a new session: the killed stream fails the requests in flight and
            // ends the connection
            info!(%node, "tunnel replaced by a new session");
            if tokio::time::timeout(Duration::from_secs(1), &mut conn).await.is_err() {
                conn.abort();
            }
        }
    }
    session.end();
}

/// Reserves `node`'s slot in the table for a new session, or says what is in the way.
fn reserve(
    shared: &Shared,
    node: &NodeId,
    session_id: u64,
    descriptor: &NodeDescriptor,
    max_streams: u32,
) -> Slot {
    let mut sessions = shared.sessions();
    match sessions.get(node) {
        Some(s) => match &s.sender {
            None => Slot::Busy,
            Some(sender) => Slot::Probe {
                id: s.id,
                sender: sender.clone(),
                old: s.shared.clone(),
            },
        },
        None => {
            let session_shared = Arc::new(SessionShared {
                streams_open: AtomicU32::new(0),
                max_streams,
                activity: Arc::new(AtomicU64::new(0)),
                progress: AtomicU64::new(0),
                last_progress_ms: AtomicU64::new(0),
                epoch: Instant::now(),
                stall: tokio::sync::watch::Sender::new(0),
                last_heartbeat_ms: AtomicU64::new(0),
                kill: Notify::new(),
            });
            sessions.insert(
                node.clone(),
                Session {
                    id: session_id,
                    descriptor: descriptor.clone(),
                    sender: None,
                    routable: false,
                    state: TunnelState::Warming,
                    connected_at_unix_ms: now_ms(),
                    last_probe_ok_unix_ms: None,
                    consecutive_probe_failures: 0,
                    models_running: vec![false; descriptor.models.len()],
                    shared: session_shared.clone(),
                },
            );
            metrics::gauge!(metric::TUNNELS_CONNECTED).increment(1.0);
            Slot::Reserved(session_shared)
        }
    }
}

/// Removes a session from the table (only if it is still this one) when the session ends, and
/// reports `node_gone` if it was routable.
struct SessionGuard {
    shared: Arc<Shared>,
    node: NodeId,
    id: u64,
}

impl SessionGuard {
    fn end(self) {
        // the work happens in Drop, so a panicking or cancelled session task cleans up too
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        let mut sessions = self.shared.sessions();
        let removed = match sessions.get(&self.node) {
            Some(s) if s.id == self.id => sessions.remove(&self.node),
            _ => None,
        };
        if let Some(s) = removed {
            metrics::gauge!(metric::TUNNELS_CONNECTED).decrement(1.0);
            if s.routable {
                metrics::gauge!(metric::NODES_ROUTABLE).decrement(1.0);
                info!(node = %self.node, "node gone");
                self.shared.events.node_gone(&self.node);
            }
        }
    }
}
