//! The innermost service of the route stack in multi-instance mode: a node's tunnel when it is
//! here, else the owning instance's internal listener over HTTP/2.
//!
//! The dispatch itself is [`spine_router::DirectoryDispatch`]: [`Cluster`] is its
//! [`NodeDirectory`] (the owner's liveness check is part of `locate`), the local service is the
//! tunnels' [`TunnelService`], and [`Forwarder`] is the remote service.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::{
    DirectoryDispatch, DirectoryError, DirectoryFuture, IdleTimer, NodeDirectory, NodeLocation,
    RemoteOwner,
};
use http::header::{HeaderValue, AUTHORIZATION};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use sha2::{Digest, Sha256};
use spine_core::{BoxBody, BoxError, NodeId};
use spine_transport::TunnelService;

use super::wire::{
    unix_ms, SignedHead, KEEP_ALIVE_INTERVAL, KEEP_ALIVE_TIMEOUT, MAX_CONCURRENT_STREAMS,
    X_SPINE_NODE_ID, X_SPINE_REFUSAL,
};
use super::{Cluster, FORWARDED, FORWARD_SECONDS};

/// Connect timeout of the internal hop.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(200);
/// Bound on waiting for the owner's response head: a backstop behind the keep-alive, for an
/// owner that answers PINGs but never the stream. Long, because a node answers a non-streamed
/// request's head only once generation is done (streamed requests are bounded sooner by the
/// router's first-content timeout).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(600);
/// Bound on the silence between two frames of a relayed response body (a backstop likewise,
/// above any sensible first-content timeout); a body silent for longer fails mid-stream, and
/// the meter ends the caller's stream with an error event.
pub const BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// Why a request for a remote node was not forwarded; all of them happen before any byte of
/// the request reached a node, so the router retries another node, and none is scored against
/// the node (it did nothing wrong) — except [`ClusterError::Request`] and
/// [`ClusterError::Body`], which are the request's (see [`ClusterError::not_node_fault`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// Neither a local tunnel nor a directory entry names the node.
    #[error("node is not known to this instance")]
    UnknownNode,
    /// The owner's liveness key is gone.
    #[error("the instance holding the node's tunnel is not alive")]
    OwnerDead,
    /// The owner's internal listener did not take the connection, or it broke before the
    /// response head.
    #[error("the instance holding the node's tunnel is unreachable")]
    OwnerUnreachable(#[source] hyper_util::client::legacy::Error),
    /// The owner sent no response head within [`HEAD_TIMEOUT`].
    #[error("the instance holding the node's tunnel did not answer within {0:?}")]
    OwnerTimeout(Duration),
    /// The owner no longer holds the node's tunnel.
    #[error("the node's tunnel moved to another instance")]
    NodeMoved,
    /// The owner refused: the node's streams are all in use.
    #[error("node has no free stream (max concurrency reached)")]
    NodeFull,
    /// The owner refused the signature or the body (HTTP status, `x-spine-refusal` code):
    /// `cluster_secret`, clocks or body limits differ between the instances, or the address in
    /// the owner's liveness key is another instance's.
    #[error("the instance holding the node's tunnel refused the forwarded request ({0}, {1})")]
    Refused(http::StatusCode, String),
    /// Redis did not answer the liveness check.
    #[error("liveness check failed")]
    Redis(#[source] super::RedisError),
    /// The forwarded request could not be built.
    #[error("bad forwarded request")]
    Request(#[source] http::Error),
    /// The request body could not be read.
    #[error("the forwarded request body could not be read")]
    Body(#[source] BoxError),
    /// No nonce: the OS random source failed.
    #[error("no random nonce for the forwarded request")]
    Nonce(#[source] getrandom::Error),
}

impl ClusterError {
    /// Whether the router should retry elsewhere without scoring the node: every case (and a
    /// node the directory does not know, [`DirectoryError`]).
    /// For [`RouteLayer::not_node_fault`](crate::RouteLayer::not_node_fault).
    pub fn not_node_fault(err: &BoxError) -> bool {
        err.downcast_ref::<ClusterError>()
            .is_some_and(|e| !matches!(e, ClusterError::Request(_) | ClusterError::Body(_)))
            || DirectoryError::not_node_fault(err)
    }

    /// Whether `err` says the owner found the node momentarily full (`node_full`): the router
    /// may pick the node again a moment later. For
    /// [`RouteLayer::node_full`](crate::RouteLayer::node_full).
    pub fn is_node_full(err: &BoxError) -> bool {
        matches!(
            err.downcast_ref::<ClusterError>(),
            Some(ClusterError::NodeFull)
        )
    }

    /// The `result` label of [`FORWARDED`].
    fn label(&self) -> &'static str {
        match self {
            ClusterError::OwnerDead => "owner_dead",
            ClusterError::OwnerUnreachable(_) => "unreachable",
            ClusterError::OwnerTimeout(_) => "timeout",
            ClusterError::NodeMoved | ClusterError::UnknownNode => "node_moved",
            ClusterError::NodeFull => "node_full",
            ClusterError::Refused(..) => "refused",
            ClusterError::Redis(_) => "redis_error",
            ClusterError::Request(_) | ClusterError::Body(_) | ClusterError::Nonce(_) => "error",
        }
    }
}

type HttpClient = Client<HttpConnector, BoxBody>;

/// The route stack's inner service in multi-instance mode: a local node's tunnel, else the
/// owning instance's internal listener (after checking its liveness key; one Redis round trip).
pub type ClusterService = DirectoryDispatch<TunnelService, Forwarder>;

/// The [`ClusterService`] of `cluster`: its tunnels' service for local nodes, a [`Forwarder`]
/// for remote ones.
pub fn cluster_service(cluster: &Cluster) -> ClusterService {
    DirectoryDispatch::new(
        Arc::new(cluster.clone()),
        cluster.tunnels().service(),
        Forwarder::new(cluster.clone()),
    )
}

impl NodeDirectory for Cluster {
    /// Local when the tunnel is here; remote when the directory names an owner whose liveness
    /// key is present (its address taken from the key); unknown otherwise (the node leaves
    /// routing until the directory names it again). A dead owner fails with
    /// [`ClusterError::OwnerDead`] and is suspected; a failed liveness check with no address
    /// from the last sync fails with [`ClusterError::Redis`]. Both count in [`FORWARDED`].
    fn locate<'a>(&'a self, node: &'a NodeId) -> DirectoryFuture<'a, NodeLocation> {
        Box::pin(async move {
            if self.tunnels().contains(node) {
                return Ok(NodeLocation::Local);
            }
            let Some((owner, synced_addr)) = self.owner_of(node) else {
                self.forget(node);
                return Ok(NodeLocation::Unknown);
            };
            match self.owner_addr(&owner, &synced_addr).await {
                Ok(addr) => Ok(NodeLocation::Remote(RemoteOwner::new(owner, addr))),
                Err(e) => {
                    metrics::counter!(FORWARDED, "result" => e.label()).increment(1);
                    if matches!(e, ClusterError::OwnerDead) {
                        self.suspect(&owner);
                    }
                    tracing::debug!(node = %node, owner, error = %e, "not forwarded");
                    Err(e.into())
                }
            }
        })
    }
}

impl Cluster {
    /// The internal address of live `owner`: from its liveness key, or `synced_addr` (its
    /// address at the last directory sync) while Redis is down (the node then leaves routing
    /// within [`super::REMOTE_TTL`]; a dead owner still fails within the connect timeout).
    async fn owner_addr(&self, owner: &str, synced_addr: &str) -> Result<String, ClusterError> {
        // liveness first: a dead owner fails at once instead of at a timeout
        if self.redis_down() {
            // no request waits on a Redis known to be down; the background loop notices it back
            return Ok(synced_addr.to_owned());
        }
        let live: Result<Option<String>, _> = self
            .redis(
                "liveness_check",
                redis::cmd("GET").arg(self.key(&format!("instance:{owner}"))),
            )
            .await;
        match live {
            Ok(Some(addr)) => Ok(addr),
            Ok(None) => Err(ClusterError::OwnerDead),
            Err(e) if synced_addr.is_empty() => Err(ClusterError::Redis(e)),
            Err(_) => Ok(synced_addr.to_owned()),
        }
    }
}

/// The remote service of [`ClusterService`]: forwards each request to the node named in its
/// extensions, at the owning instance named by its [`RemoteOwner`] extension, over HTTP/2 (h2c,
/// one pooled connection per peer). Response bodies stream frame by frame; dropping one resets
/// the forwarded stream, which cancels the request on the node.
#[derive(Clone, Debug)]
pub struct Forwarder {
    cluster: Cluster,
    client: HttpClient,
}

impl Forwarder {
    /// A forwarder signing with `cluster`'s secret, which suspects owners that fail and
    /// forgets nodes that moved. Connect timeout [`CONNECT_TIMEOUT`]; HTTP/2 PING every
    /// [`KEEP_ALIVE_INTERVAL`], dead after [`KEEP_ALIVE_TIMEOUT`].
    pub fn new(cluster: Cluster) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        connector.enforce_http(true);
        // h2 prior knowledge: one multiplexed connection per peer, PINGed so that a silent
        // owner fails its streams instead of hanging them
        let client = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .timer(TokioTimer::new())
            .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
            .http2_keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
            .http2_keep_alive_while_idle(true)
            // before the owner's SETTINGS arrive (they then set the limit: MAX_CONCURRENT_STREAMS)
            .http2_initial_max_send_streams(MAX_CONCURRENT_STREAMS as usize)
            .build(connector);
        Self { cluster, client }
    }
}

impl tower::Service<http::Request<BoxBody>> for Forwarder {
    type Response = http::Response<BoxBody>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<BoxBody>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<BoxBody>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { this.dispatch(req).await })
    }
}

impl Forwarder {
    async fn dispatch(
        self,
        req: http::Request<BoxBody>,
    ) -> Result<http::Response<BoxBody>, BoxError> {
        let (Some(node), Some(owner)) = (
            req.extensions().get::<NodeId>().cloned(),
            req.extensions().get::<RemoteOwner>().cloned(),
        ) else {
            // DirectoryDispatch always names both
            return Err(ClusterError::UnknownNode.into());
        };
        let result = self.forward(&node, &owner, req).await;
        let label = match &result {
            Ok(_) => "ok",
            Err(e) => e.label(),
        };
        metrics::counter!(FORWARDED, "result" => label).increment(1);
        match result {
            Ok(mut resp) => {
                resp.extensions_mut().insert(node);
                Ok(resp)
            }
            Err(e) => {
                match &e {
                    ClusterError::OwnerDead
                    | ClusterError::OwnerUnreachable(_)
                    | ClusterError::OwnerTimeout(_) => {
                        self.cluster.suspect(&owner.instance);
                    }
                    ClusterError::NodeMoved => self.cluster.forget(&node),
                    // another secret or clock, or another instance at the address: skip it
                    ClusterError::Refused(status, code)
                        if *status != http::StatusCode::PAYLOAD_TOO_LARGE =>
                    {
                        tracing::warn!(
                            owner = owner.instance,
                            code,
                            "the instance holding the node's tunnel refused a forwarded request; \
                             check that cluster_secret is the same and clocks agree within 30 s"
                        );
                        self.cluster.suspect(&owner.instance);
                    }
                    _ => {}
                }
                tracing::debug!(node = %node, owner = owner.instance, error = %e, "not forwarded");
                Err(e.into())
            }
        }
    }

    /// Forwards `req` for `node` to `owner`'s internal listener, signed for `owner` (see
    /// [`super::internal`]). The body is read whole first: the meter has buffered it already,
    /// so this takes its one `Full` frame.
    async fn forward(
        &self,
        node: &NodeId,
        owner: &RemoteOwner,
        req: http::Request<BoxBody>,
    ) -> Result<http::Response<BoxBody>, ClusterError> {
        let (parts, body) = req.into_parts();
        let body = body.collect().await.map_err(ClusterError::Body)?.to_bytes();
        let node_value =
            HeaderValue::from_str(node.as_str()).map_err(|e| ClusterError::Request(e.into()))?;
        let path_and_query = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce).map_err(ClusterError::Nonce)?;
        let authorization = SignedHead {
            target: &owner.instance,
            t_unix_ms: unix_ms(),
            nonce,
            method: parts.method.as_str(),
            path_and_query,
            node: node_value.as_bytes(),
            body_sha256: Sha256::digest(&body).into(),
        }
        .authorization(self.cluster.mac())
        .map_err(|e| ClusterError::Request(e.into()))?;
        let uri = format!("http://{}{path_and_query}", owner.address);
        let mut builder = http::Request::builder()
            .method(parts.method)
            .uri(uri)
            .version(http::Version::HTTP_2);
        if let Some(headers) = builder.headers_mut() {
            for (name, value) in &parts.headers {
                if name != AUTHORIZATION && name != X_SPINE_NODE_ID && name != http::header::HOST {
                    headers.append(name.clone(), value.clone());
                }
            }
            headers.insert(AUTHORIZATION, authorization);
            headers.insert(X_SPINE_NODE_ID, node_value);
        }
        let out = builder
            .body(BoxBody::new(
                Full::new(body).map_err(|never| match never {}),
            ))
            .map_err(ClusterError::Request)?;
        let started = std::time::Instant::now();
        let resp = match tokio::time::timeout(HEAD_TIMEOUT, self.client.request(out)).await {
            Ok(Ok(resp)) => resp,
            // refused, or the connection broke (or missed its PINGs) before a head arrived
            Ok(Err(e)) => return Err(ClusterError::OwnerUnreachable(e)),
            Err(_) => return Err(ClusterError::OwnerTimeout(HEAD_TIMEOUT)),
        };
        metrics::histogram!(FORWARD_SECONDS).record(started.elapsed().as_secs_f64());
        if let Some(refusal) = resp.headers().get(X_SPINE_REFUSAL) {
            return Err(match refusal.as_bytes() {
                b"node_full" => ClusterError::NodeFull,
                b"node_moved" => ClusterError::NodeMoved,
                other => ClusterError::Refused(
                    resp.status(),
                    String::from_utf8_lossy(other).into_owned(),
                ),
            });
        }
        Ok(resp.map(|b| {
            BoxBody::new(IdleTimeout::new(
                b.map_err(BoxError::from),
                BODY_IDLE_TIMEOUT,
            ))
        }))
    }
}

/// The owner's response body went silent for [`BODY_IDLE_TIMEOUT`].
#[derive(Debug, thiserror::Error)]
#[error("the relayed response body was silent for {0:?}")]
pub struct BodyIdle(Duration);

pin_project_lite::pin_project! {
    /// A body that fails with [`BodyIdle`] when no frame arrives for `idle`
    /// ([`BODY_IDLE_TIMEOUT`] on the internal hop; zero disables the bound).
    struct IdleTimeout<B> {
        #[pin]
        inner: B,
        timer: Option<IdleTimer>,
    }
}

impl<B> IdleTimeout<B> {
    fn new(inner: B, idle: Duration) -> Self {
        Self {
            inner,
            timer: IdleTimer::new(idle),
        }
    }
}

impl<B> hyper::body::Body for IdleTimeout<B>
where
    B: hyper::body::Body<Error = BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        match this.inner.poll_frame(cx) {
            Poll::Ready(frame) => {
                if let Some(timer) = this.timer.as_mut() {
                    timer.frame();
                }
                Poll::Ready(frame)
            }
            Poll::Pending => {
                let Some(timer) = this.timer.as_mut() else {
                    return Poll::Pending;
                };
                if !timer.poll_expired(cx) {
                    return Poll::Pending;
                }
                let idle = timer.timeout();
                *this.timer = None;
                Poll::Ready(Some(Err(BodyIdle(idle).into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    //! `Cluster` as a `NodeDirectory` and the dispatch over it, against the real Redis on
    //! 127.0.0.1:6379 (own key prefix, deleted at the end). The directory entries of a peer
    //! ("ghost") are written directly, and the instance's background loop is stopped, so each
    //! sync happens exactly where the test calls it.
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use bytes::Bytes;
    use http_body_util::Empty;
    use spine_core::ModelId;
    use spine_transport::{StaticAuthenticator, TunnelServer, TunnelServerConfig};
    use tokio_util::sync::CancellationToken;
    use tower::ServiceExt;

    use super::super::tests::{desc, raw, REDIS};
    use super::super::{connect_redis, ClusterConfig};
    use super::*;
    use crate::NodeRegistry;

    async fn cmd(conn: &mut redis::aio::MultiplexedConnection, c: &mut redis::Cmd) {
        let _: redis::Value = c.query_async(conn).await.unwrap();
    }

    /// Publishes `node` as owned by `owner`, alive at `addr`, as the owner itself would.
    async fn ghost_entry(
        conn: &mut redis::aio::MultiplexedConnection,
        p: &str,
        node: &str,
        owner: &str,
        addr: &str,
    ) {
        let descriptor = desc(&["m"]);
        let value = format!("{owner} {}", serde_json::to_string(&descriptor).unwrap());
        cmd(
            conn,
            redis::cmd("SET")
                .arg(format!("{p}node:{node}"))
                .arg(value)
                .arg("EX")
                .arg(60),
        )
        .await;
        cmd(conn, redis::cmd("SADD").arg(format!("{p}nodes")).arg(node)).await;
        cmd(
            conn,
            redis::cmd("SET")
                .arg(format!("{p}instance:{owner}"))
                .arg(addr)
                .arg("EX")
                .arg(60),
        )
        .await;
    }

    fn request(node: &str) -> http::Request<BoxBody> {
        let mut req = http::Request::post("/v1/chat/completions")
            .body(BoxBody::new(
                Empty::<Bytes>::new().map_err(|never| match never {}),
            ))
            .unwrap();
        req.extensions_mut().insert(NodeId::new(node));
        req
    }

    /// A relayed body that goes silent fails with [`BodyIdle`] after the frames it did send;
    /// one that keeps sending within the bound is untouched.
    #[tokio::test]
    async fn a_silent_relayed_body_fails_after_its_idle_bound() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<hyper::body::Frame<Bytes>, BoxError>>(4);
        let stream =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|f| (f, rx)) },
            );
        let mut body = Box::pin(IdleTimeout::new(
            http_body_util::StreamBody::new(stream),
            Duration::from_millis(300),
        ));
        for chunk in ["a", "b", "c"] {
            tx.send(Ok(hyper::body::Frame::data(Bytes::from(chunk))))
                .await
                .unwrap();
            let frame = body.frame().await.unwrap().unwrap();
            assert_eq!(frame.into_data().unwrap(), chunk);
            // under the bound between frames: no error
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // then silence, the sender still open: a mid-stream failure, not a hang or a clean end
        let err = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .expect("the idle bound fires")
            .unwrap()
            .unwrap_err();
        assert!(err.downcast_ref::<BodyIdle>().is_some(), "{err}");
        drop(tx);
    }

    #[tokio::test]
    async fn locate_checks_liveness_and_dispatch_follows() {
        let p = format!("spinetest:locate:{}:", std::process::id());
        let server = TunnelServer::new(
            TunnelServerConfig::default(),
            Arc::new(StaticAuthenticator::new()),
            Arc::new(()),
        );
        let stop = CancellationToken::new();
        stop.cancel();
        let mut config = ClusterConfig::new(REDIS, "0123456789abcdef-secret");
        config.instance_id = "b".into();
        config.key_prefix.clone_from(&p);
        let b = Cluster::start(
            &config,
            connect_redis(REDIS).unwrap(),
            "127.0.0.1:9".into(),
            NodeRegistry::new(),
            vec![ModelId::new("m")],
            server.tunnels(),
            stop,
        )
        .await;
        // the loop saw the cancelled token; from here on only the test syncs
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut conn = raw().await;
        // an address nobody listens on: a port just freed
        let refused = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        ghost_entry(&mut conn, &p, "n1", "ghost", "127.0.0.1:1").await;
        ghost_entry(&mut conn, &p, "n2", "ghost2", &refused).await;
        b.sync().await;
        assert_eq!(
            b.owner_of(&NodeId::new("n1")),
            Some(("ghost".to_owned(), "127.0.0.1:1".to_owned()))
        );

        let n1 = NodeId::new("n1");
        assert_eq!(
            b.locate(&n1).await.unwrap(),
            NodeLocation::Remote(RemoteOwner::new("ghost", "127.0.0.1:1"))
        );
        // the liveness key, read on each locate, is what names the address
        cmd(
            &mut conn,
            redis::cmd("SET")
                .arg(format!("{p}instance:ghost"))
                .arg("127.0.0.1:2"),
        )
        .await;
        assert_eq!(
            b.locate(&n1).await.unwrap(),
            NodeLocation::Remote(RemoteOwner::new("ghost", "127.0.0.1:2"))
        );
        assert_eq!(
            b.locate(&NodeId::new("nobody")).await.unwrap(),
            NodeLocation::Unknown
        );

        // the owner's liveness key is gone: refused before any byte, not the node's fault, and
        // the owner's nodes leave routing
        cmd(
            &mut conn,
            redis::cmd("DEL").arg(format!("{p}instance:ghost")),
        )
        .await;
        let err = b.locate(&n1).await.unwrap_err();
        assert!(matches!(
            err.downcast_ref::<ClusterError>(),
            Some(ClusterError::OwnerDead)
        ));
        assert!(ClusterError::not_node_fault(&err));
        assert_eq!(b.owner_of(&n1), None);
        assert_eq!(b.locate(&n1).await.unwrap(), NodeLocation::Unknown);

        // the whole dispatch: an unknown node, then an owner that refuses connections
        let svc = cluster_service(&b);
        let err = svc.clone().oneshot(request("n1")).await.unwrap_err();
        assert!(matches!(
            err.downcast_ref::<DirectoryError>(),
            Some(DirectoryError::UnknownNode(n)) if n == &n1
        ));
        assert!(ClusterError::not_node_fault(&err));
        let err = svc.oneshot(request("n2")).await.unwrap_err();
        assert!(
            matches!(
                err.downcast_ref::<ClusterError>(),
                Some(ClusterError::OwnerUnreachable(_))
            ),
            "{err:?}"
        );
        assert!(ClusterError::not_node_fault(&err));
        assert_eq!(b.owner_of(&NodeId::new("n2")), None, "owner suspected");

        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{p}*"))
            .query_async(&mut conn)
            .await
            .unwrap();
        if !keys.is_empty() {
            cmd(&mut conn, redis::cmd("DEL").arg(&keys)).await;
        }
    }
}
