//! `RouteLayer` on its own, over plain HTTP upstreams: two local HTTP servers stand for two
//! nodes (one answers 503, one streams an answer); a `service_fn` sends each request to the
//! address of the `NodeId` the router put in its extensions. The request is retried on the
//! healthy node before any byte reaches the caller, and the registry shows both attempts.
//!
//! Run: `cargo run -p spine-router --example route_alone`
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use spine_core::{
    BoxBody, BoxError, EngineKind, ModelDescriptor, ModelId, NodeDescriptor, NodeId, RequestPeek,
};
use spine_router::{NodeRegistry, RouteLayer};
use tower::{Layer, ServiceExt};

/// A one-route HTTP server: `status` and `body` for every request.
async fn upstream(status: u16, body: &'static str) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req| async move {
                    Ok::<_, Infallible>(
                        hyper::Response::builder()
                            .status(status)
                            .header("content-type", "text/event-stream")
                            .body(Full::new(Bytes::from_static(body.as_bytes())))
                            .unwrap(),
                    )
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    addr
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let busy = upstream(503, "node busy").await;
    let good = upstream(
        200,
        "data: {\"choices\":[{\"text\":\"hi\"}]}\n\ndata: [DONE]\n\n",
    )
    .await;
    let addrs: Arc<HashMap<NodeId, SocketAddr>> = Arc::new(
        [(NodeId::new("busy"), busy), (NodeId::new("good"), good)]
            .into_iter()
            .collect(),
    );

    let registry = NodeRegistry::new();
    for node in addrs.keys() {
        registry.node_ready(
            node,
            &NodeDescriptor {
                engine: EngineKind::LlamaCpp,
                models: vec![ModelDescriptor {
                    id: ModelId::new("smollm2"),
                    max_context_tokens: None,
                    endpoints: None,
                }],
                vram_mib: 8_192,
                max_concurrency: 4,
                agent_version: "example".into(),
            },
        );
    }

    // the "transport": any tower service that reads the NodeId extension
    let client: Client<_, BoxBody> = Client::builder(TokioExecutor::new()).build_http();
    let transport = tower::service_fn(move |mut req: http::Request<BoxBody>| {
        let client = client.clone();
        let addrs = addrs.clone();
        async move {
            let node = req.extensions().get::<NodeId>().cloned().ok_or("no node")?;
            let addr = addrs.get(&node).ok_or("unknown node")?;
            *req.uri_mut() = format!("http://{addr}{}", req.uri().path()).parse()?;
            let resp = client.request(req).await?;
            Ok::<_, BoxError>(resp.map(|b| BoxBody::new(b.map_err(BoxError::from))))
        }
    });
    let router = RouteLayer::new(registry.clone()).layer(transport);

    let body = br#"{"model":"smollm2","prompt":"hi","stream":true}"#;
    for _ in 0..3 {
        let mut req = http::Request::post("/v1/completions").body(BoxBody::new(
            Full::new(Bytes::from_static(body)).map_err(|never| match never {}),
        ))?;
        // normally the metering layer puts the peek here
        req.extensions_mut().insert(RequestPeek::from_json(body)?);
        let resp = router.clone().oneshot(req).await?;
        let node = resp.extensions().get::<NodeId>().cloned();
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        println!(
            "{status} from {node:?}: {}",
            String::from_utf8_lossy(&bytes).trim_end()
        );
    }
    for s in registry.snapshot() {
        println!(
            "{}: attempts {}, failures {}, score {:.3}, weight {:.0}",
            s.node_id, s.attempts, s.failures, s.score.score, s.weight
        );
    }
    Ok(())
}
