//! The internal listener: other instances forward requests for nodes whose tunnel is here.
//!
//! HTTP/2 with prior knowledge over plain TCP (h2c): meant for a private network between the
//! instances. Every request carries `x-spine-node-id` and a signature made by the forwarding
//! instance; the cluster secret itself never travels:
//!
//! ```text
//! Authorization: Spine-HMAC-SHA256 v=1,i=<target instance id>,t=<unix ms>,n=<nonce, 32 hex>,b=<SHA-256 of the body, 64 hex>,sig=<64 hex>
//! ```
//!
//! `sig` is HMAC-SHA256, keyed with `cluster_secret`, over (each field preceded by its length,
//! 8 bytes big-endian) the domain string `spine-cluster-forward-v1`, the target instance id, `t`
//! (8 bytes big-endian), the nonce (16 bytes), the method, the path and query, the
//! `x-spine-node-id` value and the body's SHA-256 (32 bytes). Other headers are not signed. The
//! listener refuses ([`RelayError::Refused`], 401 as the application renders it, with
//! `x-spine-refusal: <code>`):
//! no header (`missing_cluster_signature`), an unparsable header or a MAC that does not verify
//! (`invalid_cluster_signature`, compared in constant time), a target that is not this instance
//! (`wrong_cluster_target`: a signature made for instance B is useless at C), `t` more than
//! [`MAX_CLOCK_SKEW_MS`] from its clock or earlier than this process's start
//! (`stale_cluster_signature`: a new process does not know its predecessor's nonces), a nonce seen within that
//! window (`replayed_cluster_signature`), a body whose SHA-256 is not `b`
//! (`cluster_body_mismatch`). A body over the gateway's `max_request_body_bytes` (plus
//! [`FORWARDED_BODY_SLACK_BYTES`]) is refused with 413 `request_too_large`. The head is checked
//! before any byte of the body is read; the body is read whole (bounded) and relayed as one.
//!
//! So a captured forwarded request cannot be altered, replayed or redirected to another
//! instance, even across a restart of the owner. Seen nonces live in a [`ReplayCache`] of at
//! most [`REPLAY_CACHE_CAP`] entries, pruned in order of expiry;
//! when it is full of unexpired nonces the listener refuses (503 `replay_cache_full`) rather
//! than grow or forget a nonce.
//!
//! A `POST` is relayed into that node's tunnel and the node's answer returned as is, less any
//! `x-spine-*` header (only the owner itself may set `x-spine-refusal`). The owner only relays:
//! metering and the ledger stay on the instance the caller reached. Connections are PINGed
//! every second (a forwarding instance that went silent has its streams, and so the node's work,
//! cancelled within a few seconds) and carry up to [`MAX_CONCURRENT_STREAMS`] streams.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::convert::Infallible;

use bytes::Bytes;
use hmac::Mac;
use http::header::{HeaderValue, AUTHORIZATION};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use sha2::{Digest, Sha256};
use spine_core::{BoxBody, BoxError, NodeId};

use tokio::net::TcpListener;

use super::wire::{
    unix_ms, ClusterMac, SignedHead, KEEP_ALIVE_INTERVAL, KEEP_ALIVE_TIMEOUT,
    MAX_CONCURRENT_STREAMS, SIGNATURE_SCHEME, X_SPINE_NODE_ID, X_SPINE_REFUSAL,
};
use super::{Cluster, RELAYED};

/// The internal listener's service: relays each request with [`Cluster`]'s tunnels and answers
/// each [`RelayError`] with `render(&error)`, plus `x-spine-refusal: <code>` when the error
/// has a [`RelayError::refusal_code`] (so that the forwarding instance never takes a refusal
/// for the node's answer). `render` chooses the status and body (the reference gateway: the
/// error's status in OpenAI's error shape).
pub fn internal_router<B, F>(
    cluster: Cluster,
    render: F,
) -> impl tower::Service<
    http::Request<B>,
    Response = http::Response<BoxBody>,
    Error = Infallible,
    Future = impl std::future::Future<Output = Result<http::Response<BoxBody>, Infallible>> + Send,
> + Clone
       + Send
       + 'static
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    F: Fn(&RelayError) -> http::Response<BoxBody> + Clone + Send + Sync + 'static,
{
    tower::service_fn(move |req: http::Request<B>| {
        let cluster = cluster.clone();
        let render = render.clone();
        async move {
            Ok(match relay(&cluster, req).await {
                Ok(resp) => resp,
                Err(e) => {
                    let mut resp = render(&e);
                    if let Some(code) = e.refusal_code() {
                        resp.headers_mut()
                            .insert(X_SPINE_REFUSAL, HeaderValue::from_static(code));
                    }
                    resp
                }
            })
        }
    })
}

/// Serves [`internal_router`] on `listener` (h2c prior knowledge) under `limits` (connection
/// cap, header, body and idle timeouts: [`spine_transport::LimitedServer`]) until the task is
/// dropped or aborted. Connections are PINGed every [`KEEP_ALIVE_INTERVAL`] and carry up to
/// [`MAX_CONCURRENT_STREAMS`] streams.
///
/// # Cancel safety
///
/// Dropping the future stops accepting and drops the connections being served.
pub async fn serve_internal<F>(
    listener: TcpListener,
    cluster: Cluster,
    limits: spine_transport::ListenerLimits,
    render: F,
) where
    F: Fn(&RelayError) -> http::Response<BoxBody> + Clone + Send + Sync + 'static,
{
    let mut server = spine_transport::LimitedServer::new("internal", limits).http2_only();
    server
        .http_mut()
        .http2()
        .keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS);
    let _ = server
        .serve(
            listener,
            internal_router(cluster, render),
            std::future::pending(),
        )
        .await;
}

/// Most milliseconds a forwarded request's timestamp may be from the owner's clock, either way.
pub const MAX_CLOCK_SKEW_MS: u64 = 30_000;
/// Most nonces the replay cache holds (about 16 bytes of key and 8 of expiry each, twice: map
/// and queue), enough for ~17,000 forwarded requests a second into one instance.
pub const REPLAY_CACHE_CAP: usize = 1 << 19;
/// Bytes a forwarded body may exceed `max_request_body_bytes` by: the entry instance's meter
/// may add to the body it buffered (`stream_options.include_usage`).
pub const FORWARDED_BODY_SLACK_BYTES: usize = 64 * 1024;

/// Why the internal listener refused a forwarded request's signature or body, before its
/// tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RelayRefusal {
    /// No `Authorization` header.
    #[error("the forwarded request carries no signature")]
    Missing,
    /// The header does not parse, or its MAC does not verify (another secret, a field altered).
    #[error("the forwarded request's signature does not verify")]
    BadSignature,
    /// Signed for another instance.
    #[error("the forwarded request was signed for another instance")]
    WrongTarget,
    /// The timestamp is more than [`MAX_CLOCK_SKEW_MS`] from this instance's clock.
    #[error("the forwarded request's timestamp is more than 30 s from this instance's clock")]
    Stale,
    /// The nonce was relayed before.
    #[error("the forwarded request's nonce was seen before")]
    Replayed,
    /// The replay cache holds [`REPLAY_CACHE_CAP`] unexpired nonces.
    #[error("too many forwarded requests within the signature window")]
    ReplayCacheFull,
    /// The body is over the bound.
    #[error("the forwarded request body is over the gateway's request body limit")]
    TooLarge,
    /// Reading the body failed.
    #[error("the forwarded request body could not be read")]
    BodyError,
    /// The body's SHA-256 is not the signed one.
    #[error("the forwarded request body is not the one signed")]
    BodyMismatch,
}

impl RelayRefusal {
    /// The error `code` (and `x-spine-refusal` value) of the refusal.
    pub fn code(self) -> &'static str {
        match self {
            RelayRefusal::Missing => "missing_cluster_signature",
            RelayRefusal::BadSignature => "invalid_cluster_signature",
            RelayRefusal::WrongTarget => "wrong_cluster_target",
            RelayRefusal::Stale => "stale_cluster_signature",
            RelayRefusal::Replayed => "replayed_cluster_signature",
            RelayRefusal::ReplayCacheFull => "replay_cache_full",
            RelayRefusal::TooLarge => "request_too_large",
            RelayRefusal::BodyError => "invalid_forwarded_body",
            RelayRefusal::BodyMismatch => "cluster_body_mismatch",
        }
    }

    /// The `result` label of [`RELAYED`].
    fn label(self) -> &'static str {
        match self {
            RelayRefusal::Missing => "missing_signature",
            RelayRefusal::BadSignature => "bad_signature",
            RelayRefusal::WrongTarget => "wrong_target",
            RelayRefusal::Stale => "stale",
            RelayRefusal::Replayed => "replayed",
            RelayRefusal::ReplayCacheFull => "replay_cache_full",
            RelayRefusal::TooLarge => "too_large",
            RelayRefusal::BodyError => "body_error",
            RelayRefusal::BodyMismatch => "body_mismatch",
        }
    }
}

/// Why the internal listener answered a forwarded request itself rather than with the node's
/// answer. The application renders it ([`internal_router`]'s `render`); a status that fits each
/// case is stated on it, and the forwarding instance relies on 413 for
/// [`RelayRefusal::TooLarge`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The signature or the body was refused ([`RelayRefusal::code`]): 401, except
    /// [`RelayRefusal::ReplayCacheFull`] 503, [`RelayRefusal::TooLarge`] 413 and
    /// [`RelayRefusal::BodyError`] 400.
    #[error(transparent)]
    Refused(#[from] RelayRefusal),
    /// A signed request with another method than `POST`: 405.
    #[error("the internal listener relays POST requests only")]
    MethodNotAllowed,
    /// A signed request without `x-spine-node-id`: 400.
    #[error("x-spine-node-id is required")]
    MissingNodeId,
    /// The node's tunnel is not on this instance (`node_moved`): 503.
    #[error("the node's tunnel is not on this instance")]
    NodeMoved,
    /// The node has no free stream (`node_full`): 503.
    #[error("the node has no free stream")]
    NodeFull,
    /// The node failed before its response head (`node_failure`): 502.
    #[error("the node failed before responding")]
    NodeFailure(#[source] spine_transport::TunnelError),
}

impl RelayError {
    /// The error `code`: [`RelayRefusal::code`], `method_not_allowed`, `missing_node_id`,
    /// `node_moved`, `node_full` or `node_failure`.
    pub fn code(&self) -> &'static str {
        match self {
            RelayError::Refused(r) => r.code(),
            RelayError::MethodNotAllowed => "method_not_allowed",
            RelayError::MissingNodeId => "missing_node_id",
            RelayError::NodeMoved => "node_moved",
            RelayError::NodeFull => "node_full",
            RelayError::NodeFailure(_) => "node_failure",
        }
    }

    /// The HTTP status the internal listener answers with, part of the instances' protocol (the
    /// forwarder reads 413 as "the body is over the owner's limit"): 401 for a refused
    /// signature, 503 for [`RelayRefusal::ReplayCacheFull`], `node_moved` and `node_full`, 413
    /// for [`RelayRefusal::TooLarge`], 400 for [`RelayRefusal::BodyError`] and a missing node
    /// id, 405 for another method than `POST`, 502 for `node_failure`.
    pub fn status(&self) -> http::StatusCode {
        use http::StatusCode;
        match self {
            RelayError::Refused(RelayRefusal::ReplayCacheFull)
            | RelayError::NodeMoved
            | RelayError::NodeFull => StatusCode::SERVICE_UNAVAILABLE,
            RelayError::Refused(RelayRefusal::TooLarge) => StatusCode::PAYLOAD_TOO_LARGE,
            RelayError::Refused(RelayRefusal::BodyError) | RelayError::MissingNodeId => {
                StatusCode::BAD_REQUEST
            }
            RelayError::Refused(_) => StatusCode::UNAUTHORIZED,
            RelayError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            RelayError::NodeFailure(_) => StatusCode::BAD_GATEWAY,
        }
    }

    /// The `x-spine-refusal` value the answer carries: the code of a refusal, `node_moved` or
    /// `node_full`; `None` for the others.
    pub fn refusal_code(&self) -> Option<&'static str> {
        match self {
            RelayError::Refused(_) | RelayError::NodeMoved | RelayError::NodeFull => {
                Some(self.code())
            }
            _ => None,
        }
    }

    /// The `result` label of [`RELAYED`]; `None` for a request not counted there.
    fn label(&self) -> Option<&'static str> {
        match self {
            RelayError::Refused(r) => Some(r.label()),
            RelayError::NodeMoved => Some("node_moved"),
            RelayError::NodeFull => Some("node_full"),
            RelayError::NodeFailure(_) => Some("error"),
            RelayError::MethodNotAllowed | RelayError::MissingNodeId => None,
        }
    }
}

/// A parsed, verified signature header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Verified {
    /// When it was signed, milliseconds since the Unix epoch.
    pub(crate) t_unix_ms: u64,
    pub(crate) nonce: [u8; 16],
    /// The SHA-256 the body must have.
    pub(crate) body_sha256: [u8; 32],
}

/// Checks a forwarded request's head (everything but the body's hash and the nonce's novelty)
/// as instance `own_id` at `now_unix_ms`.
///
/// # Errors
///
/// [`RelayRefusal::Missing`], [`RelayRefusal::BadSignature`], [`RelayRefusal::WrongTarget`],
/// [`RelayRefusal::Stale`].
pub(crate) fn verify_head(
    key: &ClusterMac,
    own_id: &str,
    now_unix_ms: u64,
    method: &str,
    path_and_query: &str,
    node: &[u8],
    authorization: Option<&HeaderValue>,
) -> Result<Verified, RelayRefusal> {
    let value = authorization.ok_or(RelayRefusal::Missing)?;
    let (target, verified, sig) = parse_authorization(value).ok_or(RelayRefusal::BadSignature)?;
    if target != own_id {
        return Err(RelayRefusal::WrongTarget);
    }
    if verified.t_unix_ms.abs_diff(now_unix_ms) > MAX_CLOCK_SKEW_MS {
        return Err(RelayRefusal::Stale);
    }
    let head = SignedHead {
        target,
        t_unix_ms: verified.t_unix_ms,
        nonce: verified.nonce,
        method,
        path_and_query,
        node,
        body_sha256: verified.body_sha256,
    };
    head.mac(key)
        .verify_slice(&sig)
        .map_err(|_| RelayRefusal::BadSignature)?;
    Ok(verified)
}

/// `Spine-HMAC-SHA256 v=1,i=…,t=…,n=…,b=…,sig=…` (fields in that order) → target, fields, MAC.
fn parse_authorization(value: &HeaderValue) -> Option<(&str, Verified, [u8; 32])> {
    let rest = value
        .to_str()
        .ok()?
        .strip_prefix(SIGNATURE_SCHEME)?
        .strip_prefix(' ')?;
    let mut fields = rest.split(',');
    let mut field = |name: &str| {
        fields
            .next()
            .and_then(|f| f.strip_prefix(name))
            .and_then(|f| f.strip_prefix('='))
    };
    if field("v")? != "1" {
        return None;
    }
    let target = field("i")?;
    let t = field("t")?;
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let t_unix_ms = t.parse().ok()?;
    let mut nonce = [0u8; 16];
    hex::decode_to_slice(field("n")?, &mut nonce).ok()?;
    let mut body_sha256 = [0u8; 32];
    hex::decode_to_slice(field("b")?, &mut body_sha256).ok()?;
    let mut sig = [0u8; 32];
    hex::decode_to_slice(field("sig")?, &mut sig).ok()?;
    if fields.next().is_some() {
        return None;
    }
    Some((
        target,
        Verified {
            t_unix_ms,
            nonce,
            body_sha256,
        },
        sig,
    ))
}

/// The nonces relayed within their validity window: a map for the lookup and a queue in arrival
/// order for pruning, both pruned of expired nonces on each [`ReplayCache::record`]. Bounded:
/// at `cap` unexpired nonces a new one is refused (the oldest is never evicted early, which
/// would let it be replayed).
#[derive(Debug)]
pub(crate) struct ReplayCache {
    expiry_by_nonce: HashMap<[u8; 16], u64>,
    /// Min-heap on expiry: pruning finds every expired nonce whatever the order of arrival
    /// (a peer whose clock runs ahead sends nonces that expire later than those behind them).
    by_expiry: BinaryHeap<Reverse<(u64, [u8; 16])>>,
    cap: usize,
}

impl ReplayCache {
    /// An empty cache holding at most `cap` nonces.
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            expiry_by_nonce: HashMap::new(),
            by_expiry: BinaryHeap::new(),
            cap,
        }
    }

    /// Records `nonce`, to be refused as a replay until `expires_unix_ms`.
    ///
    /// # Errors
    ///
    /// [`RelayRefusal::Replayed`]: it is recorded and unexpired; [`RelayRefusal::ReplayCacheFull`]:
    /// `cap` unexpired nonces are recorded.
    pub(crate) fn record(
        &mut self,
        nonce: &[u8; 16],
        expires_unix_ms: u64,
        now_unix_ms: u64,
    ) -> Result<(), RelayRefusal> {
        while let Some(&Reverse((expiry, old))) = self.by_expiry.peek() {
            // kept through `expires_unix_ms` itself, the last instant its timestamp passes
            if expiry >= now_unix_ms {
                break;
            }
            self.by_expiry.pop();
            self.expiry_by_nonce.remove(&old);
        }
        if self.expiry_by_nonce.contains_key(nonce) {
            return Err(RelayRefusal::Replayed);
        }
        if self.expiry_by_nonce.len() >= self.cap {
            return Err(RelayRefusal::ReplayCacheFull);
        }
        self.expiry_by_nonce.insert(*nonce, expires_unix_ms);
        self.by_expiry.push(Reverse((expires_unix_ms, *nonce)));
        Ok(())
    }

    /// Nonces recorded and not yet pruned.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.expiry_by_nonce.len()
    }
}

/// Removes every `x-spine-*` header from a node's response head.
fn strip_spine_headers(headers: &mut http::HeaderMap) {
    let names: Vec<_> = headers
        .keys()
        .filter(|n| n.as_str().starts_with("x-spine-"))
        .cloned()
        .collect();
    for name in names {
        headers.remove(name);
    }
}

/// Relays one forwarded request into its node's tunnel, counting it in [`RELAYED`].
async fn relay<B>(
    cluster: &Cluster,
    req: http::Request<B>,
) -> Result<http::Response<BoxBody>, RelayError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let result = relay_uncounted(cluster, req).await;
    let label = match &result {
        Ok(_) => Some("ok"),
        Err(e) => e.label(),
    };
    if let Some(label) = label {
        metrics::counter!(RELAYED, "result" => label).increment(1);
    }
    result
}

async fn relay_uncounted<B>(
    cluster: &Cluster,
    req: http::Request<B>,
) -> Result<http::Response<BoxBody>, RelayError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let now_unix_ms = unix_ms();
    let (parts, body) = req.into_parts();
    let verified = verify_head(
        cluster.mac(),
        cluster.instance_id(),
        now_unix_ms,
        parts.method.as_str(),
        parts.uri.path_and_query().map_or("/", |pq| pq.as_str()),
        parts
            .headers
            .get(X_SPINE_NODE_ID)
            .map_or(&b""[..], HeaderValue::as_bytes),
        parts.headers.get(AUTHORIZATION),
    )?;
    // only a request signed with the secret gets here: nobody else can fill the cache
    cluster.record_nonce(&verified.nonce, verified.t_unix_ms, now_unix_ms)?;
    if parts.method != http::Method::POST {
        return Err(RelayError::MethodNotAllowed);
    }
    let Some(node) = parts
        .headers
        .get(X_SPINE_NODE_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .map(NodeId::new)
    else {
        return Err(RelayError::MissingNodeId);
    };
    let tunnels = cluster.tunnels();
    if !tunnels.contains(&node) {
        return Err(RelayError::NodeMoved);
    }
    let body = match Limited::new(body, cluster.max_forwarded_body_bytes())
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return Err(RelayRefusal::TooLarge.into())
        }
        Err(e) => {
            tracing::debug!(error = %e, "forwarded body");
            return Err(RelayRefusal::BodyError.into());
        }
    };
    if Sha256::digest(&body)[..] != verified.body_sha256[..] {
        return Err(RelayRefusal::BodyMismatch.into());
    }
    let mut upstream = http::Request::new(BoxBody::new(
        Full::new(body).map_err(|never| match never {}),
    ));
    *upstream.method_mut() = parts.method;
    *upstream.uri_mut() = parts.uri;
    for (name, value) in &parts.headers {
        if name != AUTHORIZATION && name != X_SPINE_NODE_ID && name != http::header::HOST {
            upstream.headers_mut().append(name.clone(), value.clone());
        }
    }
    match tunnels.send(&node, upstream).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            strip_spine_headers(&mut parts.headers);
            Ok(http::Response::from_parts(parts, body))
        }
        Err(e) if e.is_node_full() => Err(RelayError::NodeFull),
        Err(e) if e.is_unknown_node() => Err(RelayError::NodeMoved),
        Err(e) => Err(RelayError::NodeFailure(e)),
    }
}
