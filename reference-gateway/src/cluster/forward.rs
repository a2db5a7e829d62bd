//! The innermost service of the route stack in multi-instance mode: a node's tunnel when it is
//! here, else the owning instance's internal listener over HTTP/2.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{HeaderName, HeaderValue, AUTHORIZATION};
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use spine_core::{BoxBody, BoxError, NodeId};

use super::{Cluster, FORWARDED, FORWARD_SECONDS};

/// Header naming the target node on the internal hop.
pub(crate) const X_SPINE_NODE_ID: HeaderName = HeaderName::from_static("x-spine-node-id");
/// Header on an internal listener's refusal: `node_moved` or `node_full`.
pub(crate) const X_SPINE_REFUSAL: HeaderName = HeaderName::from_static("x-spine-refusal");
/// Connect timeout of the internal hop.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_millis(200);

/// Why a request for a remote node was not forwarded; all of them happen before any byte of
/// the request reached a node, so the router retries another node, and none is scored against
/// the node (it did nothing wrong).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum ClusterError {
    /// Neither a local tunnel nor a directory entry names the node.
    #[error("node is not known to this instance")]
    UnknownNode,
    /// The owner's liveness key is gone.
    #[error("the instance holding the node's tunnel is not alive")]
    OwnerDead,
    /// The owner's internal listener did not take the connection.
    #[error("the instance holding the node's tunnel is unreachable")]
    OwnerUnreachable(#[source] hyper_util::client::legacy::Error),
    /// The owner no longer holds the node's tunnel.
    #[error("the node's tunnel moved to another instance")]
    NodeMoved,
    /// The owner refused: the node's streams are all in use.
    #[error("node has no free stream (max concurrency reached)")]
    NodeFull,
    /// Redis did not answer the liveness check.
    #[error("liveness check failed")]
    Redis(#[source] super::RedisError),
    /// The forwarded request could not be built.
    #[error("bad forwarded request")]
    Request(#[source] http::Error),
}

impl ClusterError {
    /// Whether the router should retry elsewhere without scoring the node: every case.
    pub(crate) fn not_node_fault(err: &BoxError) -> bool {
        err.downcast_ref::<ClusterError>()
            .is_some_and(|e| !matches!(e, ClusterError::Request(_)))
    }
}

type HttpClient = Client<HttpConnector, BoxBody>;

/// Sends each request to the node named in its extensions: down the local tunnel, or to the
/// owning instance's internal listener (after checking its liveness key; one Redis round trip).
/// Response bodies stream frame by frame; dropping one resets the forwarded stream, which
/// cancels the request on the node.
#[derive(Clone, Debug)]
pub(crate) struct ClusterService {
    cluster: Cluster,
    client: HttpClient,
}

impl ClusterService {
    pub(crate) fn new(cluster: Cluster) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        connector.enforce_http(true);
        // h2 prior knowledge: one multiplexed connection per peer
        let client = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build(connector);
        Self { cluster, client }
    }
}

impl tower::Service<http::Request<BoxBody>> for ClusterService {
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

impl ClusterService {
    async fn dispatch(
        self,
        req: http::Request<BoxBody>,
    ) -> Result<http::Response<BoxBody>, BoxError> {
        let Some(node) = req.extensions().get::<NodeId>().cloned() else {
            // the router always names the node
            return Err(ClusterError::UnknownNode.into());
        };
        let tunnels = self.cluster.tunnels();
        if tunnels.contains(&node) {
            let mut resp = tunnels.send(&node, req).await?;
            resp.extensions_mut().insert(node);
            return Ok(resp);
        }
        let Some((owner, synced_addr)) = self.cluster.owner_of(&node) else {
            self.cluster.forget(&node);
            return Err(ClusterError::UnknownNode.into());
        };
        let result = self.forward(&node, &owner, &synced_addr, req).await;
        let label = match &result {
            Ok(_) => "ok",
            Err(ClusterError::OwnerDead) => "owner_dead",
            Err(ClusterError::OwnerUnreachable(_)) => "unreachable",
            Err(ClusterError::NodeMoved | ClusterError::UnknownNode) => "node_moved",
            Err(ClusterError::NodeFull) => "node_full",
            Err(ClusterError::Redis(_)) => "redis_error",
            Err(ClusterError::Request(_)) => "error",
        };
        metrics::counter!(FORWARDED, "result" => label).increment(1);
        match result {
            Ok(mut resp) => {
                resp.extensions_mut().insert(node);
                Ok(resp)
            }
            Err(e) => {
                match &e {
                    ClusterError::OwnerDead | ClusterError::OwnerUnreachable(_) => {
                        self.cluster.suspect(&owner);
                    }
                    ClusterError::NodeMoved => self.cluster.forget(&node),
                    _ => {}
                }
                tracing::debug!(node = %node, owner, error = %e, "not forwarded");
                Err(e.into())
            }
        }
    }

    /// Forwards `req` to `owner`. `synced_addr` is the owner's address at the last directory
    /// sync: used only while Redis is down (the node then leaves routing within
    /// [`super::REMOTE_TTL`]; a dead owner still fails within the connect timeout).
    async fn forward(
        &self,
        node: &NodeId,
        owner: &str,
        synced_addr: &str,
        req: http::Request<BoxBody>,
    ) -> Result<http::Response<BoxBody>, ClusterError> {
        // liveness first: a dead owner fails at once instead of at a timeout
        let addr = if self.cluster.redis_down() {
            // no request waits on a Redis known to be down; the background loop notices it back
            synced_addr.to_owned()
        } else {
            let live: Result<Option<String>, _> = self
                .cluster
                .redis(
                    "liveness_check",
                    redis::cmd("GET").arg(self.cluster.key(&format!("instance:{owner}"))),
                )
                .await;
            match live {
                Ok(Some(addr)) => addr,
                Ok(None) => return Err(ClusterError::OwnerDead),
                Err(e) if synced_addr.is_empty() => return Err(ClusterError::Redis(e)),
                Err(_) => synced_addr.to_owned(),
            }
        };
        let (parts, body) = req.into_parts();
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |pq| pq.as_str())
            .to_owned();
        let uri = format!("http://{addr}{path}");
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
            if let Ok(v) = HeaderValue::from_str(&format!("Bearer {}", self.cluster.secret())) {
                headers.insert(AUTHORIZATION, v);
            }
            if let Ok(v) = HeaderValue::from_str(node.as_str()) {
                headers.insert(X_SPINE_NODE_ID, v);
            }
        }
        let out = builder.body(body).map_err(ClusterError::Request)?;
        let started = std::time::Instant::now();
        let resp = match self.client.request(out).await {
            Ok(resp) => resp,
            Err(e) if e.is_connect() => return Err(ClusterError::OwnerUnreachable(e)),
            // the connection broke before a head arrived: the owner went away
            Err(e) => return Err(ClusterError::OwnerUnreachable(e)),
        };
        metrics::histogram!(FORWARD_SECONDS).record(started.elapsed().as_secs_f64());
        if let Some(refusal) = resp.headers().get(X_SPINE_REFUSAL) {
            return Err(match refusal.as_bytes() {
                b"node_full" => ClusterError::NodeFull,
                _ => ClusterError::NodeMoved,
            });
        }
        Ok(resp.map(|b| BoxBody::new(b.map_err(BoxError::from))))
    }
}
