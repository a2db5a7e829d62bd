//! The internal listener: other instances forward requests for nodes whose tunnel is here.
//!
//! HTTP/2 with prior knowledge over plain TCP (h2c): meant for a private network between the
//! instances. Every request must carry `Authorization: Bearer <cluster_secret>` (compared in
//! constant time; 401 otherwise) and `x-spine-node-id`; a `POST` is relayed into that node's
//! tunnel and the node's answer returned as is. The owner only relays: metering and the ledger
//! stay on the instance the caller reached.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::header::{HeaderValue, AUTHORIZATION};
use http::StatusCode;
use http_body_util::BodyExt;
use spine_core::{BoxBody, BoxError, NodeId};

use super::forward::{X_SPINE_NODE_ID, X_SPINE_REFUSAL};
use super::{Cluster, RELAYED};
use crate::error::ApiError;

/// The internal listener's router.
pub(crate) fn router(cluster: Cluster) -> axum::Router {
    axum::Router::new()
        .fallback(relay)
        .with_state(Arc::new(cluster))
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
            let (parts, body) = resp.into_parts();
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
