use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use http::{Request, Response, Uri};
use http_body_util::BodyExt as _;
use spine_core::{BoxBody, NodeDescriptor, NodeId};
use tokio::time::Instant;

use super::body::{StreamBody, StreamGuard};
use super::state::Shared;
use super::{ModelStatus, TunnelService, TunnelStatus, TUNNEL_AUTHORITY};
use crate::{metric, TunnelError};

/// The send half of a [`TunnelServer`]: the live tunnels, by node.
///
/// [`TunnelServer`]: super::TunnelServer
#[derive(Clone)]
pub struct Tunnels {
    pub(super) shared: Arc<Shared>,
}

impl fmt::Debug for Tunnels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tunnels")
            .field("sessions", &self.shared.sessions().len())
            .finish()
    }
}

impl Tunnels {
    /// The nodes that are routable (reported by [`TunnelEvents::node_ready`] and not gone
    /// since) with the descriptor each sent in its handshake, sorted by node id. As in
    /// `node_ready`, the descriptor's `max_concurrency` is the limit the tunnel enforces:
    /// `min(advertised, max_streams_per_node)`, at least 1.
    ///
    /// [`TunnelEvents::node_ready`]: super::TunnelEvents::node_ready
    pub fn connected(&self) -> Vec<(NodeId, NodeDescriptor)> {
        let mut nodes: Vec<_> = self
            .shared
            .sessions()
            .iter()
            .filter(|(_, s)| s.routable)
            .map(|(n, s)| (n.clone(), s.descriptor.clone()))
            .collect();
        nodes.sort_by(|a, b| a.0.cmp(&b.0));
        nodes
    }

    /// Whether `node` has a live tunnel (warming, ready or unhealthy).
    pub fn contains(&self, node: &NodeId) -> bool {
        self.shared.sessions().contains_key(node)
    }

    /// How many tunnels are up (past the handshake).
    pub fn len(&self) -> usize {
        self.shared.sessions().len()
    }

    /// Whether no tunnel is up.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `node`'s tunnel state, stream counts and per-model running status; `None` when it has no
    /// tunnel.
    pub fn status(&self, node: &NodeId) -> Option<TunnelStatus> {
        let sessions = self.shared.sessions();
        let s = sessions.get(node)?;
        Some(TunnelStatus {
            state: s.state,
            connected_at_unix_ms: s.connected_at_unix_ms,
            last_probe_ok_unix_ms: s.last_probe_ok_unix_ms,
            consecutive_probe_failures: s.consecutive_probe_failures,
            streams_open: s.shared.streams_open.load(Ordering::Relaxed),
            max_streams: s.shared.max_streams,
            models: s
                .descriptor
                .models
                .iter()
                .zip(s.models_running.iter())
                .map(|(m, running)| ModelStatus {
                    model: m.id.clone(),
                    running: *running,
                })
                .collect(),
        })
    }

    /// Sends `req` down `node`'s tunnel as a new HTTP/2 stream and returns the node's response,
    /// whose body streams as the node sends it.
    ///
    /// The request's URI is rewritten to `http://spine-node/<path and query>`; hyper strips
    /// connection-specific headers, which HTTP/2 forbids. The gateway enforces the node's stream
    /// limit itself (`min(max_concurrency, max_streams_per_node)`): a request for a full node is
    /// refused at once, before any byte goes down the tunnel.
    ///
    /// # Errors
    ///
    /// [`TunnelError::is_unknown_node`] when the node has no live tunnel;
    /// [`TunnelError::is_node_full`] when its streams are all in use;
    /// [`TunnelError::is_closed`] when the tunnel closes before the response head arrives;
    /// [`TunnelError::is_timeout`] when keepalive declares the tunnel dead. Errors after the head
    /// arrive as body errors (a boxed [`hyper::Error`]).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future (or, later, the response body) resets the HTTP/2 stream, which
    /// cancels the request on the node.
    pub async fn send(
        &self,
        node: &NodeId,
        mut req: Request<BoxBody>,
    ) -> Result<Response<BoxBody>, TunnelError> {
        let found = {
            let sessions = self.shared.sessions();
            sessions
                .get(node)
                .and_then(|s| Some((s.sender.clone()?, s.shared.clone())))
        };
        let Some((mut sender, session)) = found else {
            metrics::counter!(metric::REQUESTS_FAILED, "reason" => "unknown_node").increment(1);
            return Err(TunnelError::unknown_node().with_detail(node.as_str()));
        };
        let Some(stream) = StreamGuard::acquire(session.clone()) else {
            metrics::counter!(metric::REQUESTS_FAILED, "reason" => "node_full").increment(1);
            return Err(TunnelError::node_full().with_detail(node.as_str()));
        };
        let path_and_query = req
            .uri()
            .path_and_query()
            .map_or("/", |pq| pq.as_str())
            .to_owned();
        *req.uri_mut() = Uri::builder()
            .scheme("http")
            .authority(TUNNEL_AUTHORITY)
            .path_and_query(path_and_query)
            .build()
            .map_err(|e| TunnelError::protocol().with_source(e))?;
        let started = Instant::now();
        let mut stall = stream.stall_signal();
        let res = tokio::select! {
            res = async {
                sender.ready().await?;
                sender.send_request(req).await
            } => res,
            () = &mut stall => {
                metrics::counter!(metric::REQUESTS_FAILED, "reason" => "stalled").increment(1);
                return Err(TunnelError::stalled().with_detail(node.as_str()));
            }
        };
        let resp = match res {
            Ok(resp) => resp,
            Err(e) => {
                let err = TunnelError::from_hyper(e);
                let reason = if err.is_closed() {
                    "closed"
                } else if err.is_timeout() {
                    "timeout"
                } else {
                    "error"
                };
                metrics::counter!(metric::REQUESTS_FAILED, "reason" => reason).increment(1);
                return Err(err);
            }
        };
        metrics::histogram!(metric::FORWARD_SECONDS).record(started.elapsed().as_secs_f64());
        metrics::counter!(metric::REQUESTS_FORWARDED).increment(1);
        session.progressed();
        self.shared.heartbeat(node, &session);
        Ok(resp.map(|body| {
            StreamBody {
                inner: body,
                stall: Some(stall),
                stream,
            }
            .boxed_unsync()
        }))
    }

    /// A tower [`Service`](tower::Service) over these tunnels.
    pub fn service(&self) -> TunnelService {
        TunnelService {
            tunnels: self.clone(),
        }
    }
}
