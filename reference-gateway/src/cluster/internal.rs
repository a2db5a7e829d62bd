//! The internal listener: other instances forward requests for nodes whose tunnel is here.
//!
//! HTTP/2 with prior knowledge over plain TCP (h2c): meant for a private network between the
//! instances. Every request must carry `Authorization: Bearer <cluster_secret>` (compared in
//! constant time; 401 otherwise) and `x-spine-node-id`; a `POST` is relayed into that node's
//! tunnel and the node's answer returned as is, less any `x-spine-*` header (only the owner
//! itself may set `x-spine-refusal`). The owner only relays: metering and the ledger stay on the
//! instance the caller reached. Connections are PINGed every second (a forwarding instance that
//! went silent has its streams, and so the node's work, cancelled within a few seconds) and
//! carry up to [`MAX_CONCURRENT_STREAMS`] streams.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::header::{HeaderValue, AUTHORIZATION};
use http::StatusCode;
use http_body_util::BodyExt;
use spine_core::{BoxBody, BoxError, NodeId};

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;

use super::forward::{
    KEEP_ALIVE_INTERVAL, KEEP_ALIVE_TIMEOUT, MAX_CONCURRENT_STREAMS, X_SPINE_NODE_ID,
    X_SPINE_REFUSAL,
};
use super::{Cluster, RELAYED};
use crate::error::ApiError;

/// The internal listener's router.
pub(crate) fn router(cluster: Cluster) -> axum::Router {
    axum::Router::new()
        .fallback(relay)
        .with_state(Arc::new(cluster))
}

/// Serves [`router`] on `listener` (h2c prior knowledge) until the task is dropped or aborted.
pub(crate) async fn serve(listener: TcpListener, cluster: Cluster) {
    let app = router(cluster);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // out of descriptors and the like: back off instead of spinning
                tracing::warn!(error = %e, "internal listener accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY");
        }
        let app = app.clone();
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    tower::ServiceExt::oneshot(app.clone(), req)
                });
            let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
            builder
                .timer(TokioTimer::new())
                .keep_alive_interval(KEEP_ALIVE_INTERVAL)
                .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
                .max_concurrent_streams(MAX_CONCURRENT_STREAMS);
            if let Err(e) = builder
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(error = %e, "internal connection ended");
            }
        });
    }
}

/// Constant-time equality of two byte strings (the length is not secret).
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn authorized(cluster: &Cluster, headers: &http::HeaderMap) -> bool {
    headers
        .get(AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .is_some_and(|token| ct_eq(token, cluster.secret().as_bytes()))
}

fn refusal(code: &'static str, message: &'static str) -> Response {
    let mut resp =
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "api_error", code, message).into_response();
    resp.headers_mut()
        .insert(X_SPINE_REFUSAL, HeaderValue::from_static(code));
    resp
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

async fn relay(State(cluster): State<Arc<Cluster>>, req: Request) -> Response {
    if !authorized(&cluster, req.headers()) {
        metrics::counter!(RELAYED, "result" => "unauthorized").increment(1);
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_cluster_secret",
            "the internal listener needs the cluster secret",
        )
        .into_response();
    }
    if req.method() != http::Method::POST {
        return ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method_not_allowed",
            "the internal listener relays POST requests only",
        )
        .into_response();
    }
    let Some(node) = req
        .headers()
        .get(X_SPINE_NODE_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .map(NodeId::new)
    else {
        return ApiError::invalid_request("missing_node_id", "x-spine-node-id is required")
            .into_response();
    };
    let tunnels = cluster.tunnels();
    if !tunnels.contains(&node) {
        metrics::counter!(RELAYED, "result" => "node_moved").increment(1);
        return refusal("node_moved", "the node's tunnel is not on this instance");
    }
    let (parts, body) = req.into_parts();
    let mut upstream = http::Request::new(BoxBody::new(body.map_err(BoxError::from)));
    *upstream.method_mut() = parts.method;
    *upstream.uri_mut() = parts.uri;
    for (name, value) in &parts.headers {
        if name != AUTHORIZATION && name != X_SPINE_NODE_ID && name != http::header::HOST {
            upstream.headers_mut().append(name.clone(), value.clone());
        }
    }
    match tunnels.send(&node, upstream).await {
        Ok(resp) => {
            metrics::counter!(RELAYED, "result" => "ok").increment(1);
            let (mut parts, body) = resp.into_parts();
            strip_spine_headers(&mut parts.headers);
            Response::from_parts(parts, Body::new(body))
        }
        Err(e) if e.is_node_full() => {
            metrics::counter!(RELAYED, "result" => "node_full").increment(1);
            refusal("node_full", "the node has no free stream")
        }
        Err(e) if e.is_unknown_node() => {
            metrics::counter!(RELAYED, "result" => "node_moved").increment(1);
            refusal("node_moved", "the node's tunnel is not on this instance")
        }
        Err(e) => {
            metrics::counter!(RELAYED, "result" => "error").increment(1);
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                "api_error",
                "node_failure",
                format!("the node failed before responding: {e}"),
            )
            .into_response()
        }
    }
}
