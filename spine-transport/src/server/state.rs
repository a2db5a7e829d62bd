use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use hyper::client::conn::http2::SendRequest;
use spine_core::{BoxBody, NodeDescriptor, NodeId};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{now_ms, NodeAuthenticator, TunnelEvents, TunnelServerConfig, TunnelState};

/// Per-session state shared between the session task, the table, and requests in flight.
pub(super) struct SessionShared {
    pub(super) streams_open: AtomicU32,
    pub(super) max_streams: u32,
    /// Incremented for every WebSocket message received.
    pub(super) activity: Arc<AtomicU64>,
    /// Response heads and body frames received on this session's request streams (not its
    /// probes): the engine's progress.
    pub(super) progress: AtomicU64,
    /// When progress was last seen (or the node went from idle to busy), milliseconds since
    /// `epoch`.
    pub(super) last_progress_ms: AtomicU64,
    pub(super) epoch: Instant,
    /// Bumped each time the node is found stalled; streams that have received nothing yet fail
    /// when it changes.
    pub(super) stall: tokio::sync::watch::Sender<u64>,
    pub(super) last_heartbeat_ms: AtomicU64,
    /// Fired to end the session (it was taken over).
    pub(super) kill: Notify,
}

impl SessionShared {
    pub(super) fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A response head or body frame arrived on a request stream.
    pub(super) fn progressed(&self) {
        self.progress.fetch_add(1, Ordering::Relaxed);
        self.last_progress_ms
            .store(self.now_ms(), Ordering::Relaxed);
    }

    /// How long the node has had streams open with nothing received; zero when idle.
    pub(super) fn quiet_for(&self) -> Duration {
        if self.streams_open.load(Ordering::Acquire) == 0 {
            return Duration::ZERO;
        }
        let last = self.last_progress_ms.load(Ordering::Relaxed);
        Duration::from_millis(self.now_ms().saturating_sub(last))
    }
}

pub(super) struct Session {
    pub(super) id: u64,
    pub(super) descriptor: NodeDescriptor,
    /// `None` while the session is reserved (accepted, HTTP/2 not yet set up).
    pub(super) sender: Option<SendRequest<BoxBody>>,
    /// Reported with `node_ready` and not yet `node_gone`.
    pub(super) routable: bool,
    pub(super) state: TunnelState,
    pub(super) connected_at_unix_ms: u64,
    pub(super) last_probe_ok_unix_ms: Option<u64>,
    pub(super) consecutive_probe_failures: u32,
    pub(super) models_running: Vec<bool>,
    pub(super) shared: Arc<SessionShared>,
}

pub(super) struct Shared {
    pub(super) config: TunnelServerConfig,
    pub(super) auth: Arc<dyn NodeAuthenticator>,
    pub(super) events: Arc<dyn TunnelEvents>,
    pub(super) sessions: Mutex<HashMap<NodeId, Session>>,
    pub(super) next_session_id: AtomicU64,
}

impl Shared {
    pub(super) fn sessions(&self) -> MutexGuard<'_, HashMap<NodeId, Session>> {
        // A panic while holding this lock cannot leave the map inconsistent (single inserts and
        // removes), so a poisoned lock is still usable.
        self.sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Emits `node_heartbeat`, at most once per second per session.
    pub(super) fn heartbeat(&self, node: &NodeId, session: &SessionShared) {
        let now = now_ms();
        let last = session.last_heartbeat_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 1000
            && session
                .last_heartbeat_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.events.node_heartbeat(node);
        }
    }
}
