//! The tunnel alone, without a gateway or metering: the server side mounted in a plain axum app
//! beside an ordinary route, and the client side serving a local tower service.
//!
//! ```text
//! cargo run -p spine-transport --example axum_mount
//! ```
//!
//! The axum app serves `GET /v1/tunnel` (the tunnel upgrade) and `GET /via-tunnel`, which sends
//! a request down the one node's tunnel. The node, in the same program for brevity (it only
//! needs the gateway's URL, CA and its key), answers with a `service_fn`. Prints the answer
//! that came back through the tunnel and exits.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use spine_core::{BoxBody, EngineKind, NodeDescriptor, NodeId};
use spine_transport::{
    NodeIdentity, StaticAuthenticator, TunnelClient, TunnelClientConfig, TunnelServer,
    TunnelServerConfig, Tunnels, TUNNEL_PATH,
};

async fn via_tunnel(tunnels: Tunnels) -> Result<String, String> {
    let req = http::Request::get("/hello")
        .body(
            Full::new(Bytes::new())
                .map_err(|e| match e {})
                .boxed_unsync(),
        )
        .map_err(|e| e.to_string())?;
    let resp = tunnels
        .send(&NodeId::new("node_1"), req)
        .await
        .map_err(|e| e.to_string())?;
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&body.to_bytes()).into_owned())
}

#[tokio::main]
async fn main() {
    // --- the server side, in a plain axum app ---
    let node_key = NodeIdentity::generate().unwrap();
    let auth =
        StaticAuthenticator::new().with_key(node_key.public_key_text(), NodeId::new("node_1"));
    let server = TunnelServer::new(TunnelServerConfig::default(), Arc::new(auth), Arc::new(()));
    let tunnels = server.tunnels();
    let app = axum::Router::new()
        .route_service(TUNNEL_PATH, server.upgrade_service())
        .route(
            "/via-tunnel",
            get(move || {
                let tunnels = tunnels.clone();
                async move {
                    via_tunnel(tunnels)
                        .await
                        .unwrap_or_else(|e| format!("error: {e}"))
                }
            }),
        );
    let (cert, key) = spine_transport::self_signed_cert(&["localhost".into()]).unwrap();
    let tls = spine_transport::server_config_from_pem(&cert, &key).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(spine_transport::serve_listener(
        listener,
        Some(tls),
        spine_transport::ListenerLimits::default(),
        app,
    ));

    // --- the client side: a node serving a local tower service ---
    let descriptor = NodeDescriptor {
        engine: EngineKind::LlamaCpp,
        models: vec![],
        vram_mib: 0,
        max_concurrency: 8,
        agent_version: "axum-mount-example".into(),
    };
    let mut config = TunnelClientConfig::new(
        format!("wss://localhost:{port}/v1/tunnel"),
        node_key,
        descriptor,
    );
    config.tls = Some(spine_transport::client_config_with_ca(&cert).unwrap());
    let local = tower::service_fn(|req: http::Request<hyper::body::Incoming>| async move {
        let text = format!("hello from the node: {} {}", req.method(), req.uri().path());
        let body: BoxBody = Full::new(Bytes::from(text))
            .map_err(|e| match e {})
            .boxed_unsync();
        Ok::<_, Infallible>(http::Response::new(body))
    });
    tokio::spawn(TunnelClient::new(config).unwrap().run(local));

    // --- a caller of the axum app ---
    let client_tls = spine_transport::client_config_with_ca(&cert).unwrap();
    for _ in 0..100 {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
        let tls = tokio_rustls::TlsConnector::from(client_tls.clone())
            .connect(name, tcp)
            .await
            .unwrap();
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
                .await
                .unwrap();
        tokio::spawn(conn);
        let req = http::Request::get("/via-tunnel")
            .header(http::header::HOST, "localhost")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&body).into_owned();
        if text.starts_with("hello") {
            println!("{text}");
            return;
        }
        // the node is still connecting or warming up
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("the node never answered through the tunnel");
    std::process::exit(1);
}
