//! A minimal gateway for trying the tunnel by hand: every HTTP request on `--http` goes down the
//! tunnel of the one registered node.
//!
//! ```text
//! cargo run -p spine-transport --example mini_gateway -- \
//!     <node public key> 127.0.0.1:19000 127.0.0.1:18080 /tmp/spine-gw-cert.pem
//! reference-agent run --gateway wss://localhost:19000/v1/tunnel --ca-file /tmp/spine-gw-cert.pem …
//! curl -N http://127.0.0.1:18080/v1/chat/completions -d '{"model":"smollm2",…}'
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::convert::Infallible;
use std::sync::Arc;

use http_body_util::BodyExt as _;
use hyper_util::rt::TokioIo;
use spine_core::{BoxError, NodeDescriptor, NodeId};
use spine_transport::{StaticAuthenticator, TunnelEvents, TunnelServer, TunnelServerConfig};
use tokio::net::TcpListener;

struct Print;

impl TunnelEvents for Print {
    fn node_ready(&self, node: &NodeId, descriptor: &NodeDescriptor) {
        println!("node_ready {node} {descriptor:?}");
    }
    fn node_gone(&self, node: &NodeId) {
        println!("node_gone {node}");
    }
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args: Vec<String> = std::env::args().collect();
    let [_, key, tunnel_addr, http_addr, cert_out] = &args[..] else {
        eprintln!("usage: mini_gateway <public key> <tunnel addr> <http addr> <cert pem out>");
        std::process::exit(2);
    };
    let (cert, pem_key) =
        spine_transport::self_signed_cert(&["localhost".into(), "127.0.0.1".into()]).unwrap();
    std::fs::write(cert_out, &cert).unwrap();
    let tls = spine_transport::server_config_from_pem(&cert, &pem_key).unwrap();
    let node = NodeId::new("node_1");
    let auth = StaticAuthenticator::new().with_key(key.clone(), node.clone());
    let server = TunnelServer::new(
        TunnelServerConfig::default(),
        Arc::new(auth),
        Arc::new(Print),
    );
    let tunnels = server.tunnels();
    tokio::spawn(server.serve(TcpListener::bind(tunnel_addr).await.unwrap(), Some(tls)));

    let http = TcpListener::bind(http_addr).await.unwrap();
    loop {
        let (tcp, _) = http.accept().await.unwrap();
        let tunnels = tunnels.clone();
        let node = node.clone();
        let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let tunnels = tunnels.clone();
            let node = node.clone();
            async move {
                let req = req.map(|b| b.map_err(BoxError::from).boxed_unsync());
                let resp = match tunnels.send(&node, req).await {
                    Ok(resp) => resp,
                    Err(e) => {
                        let mut r = http::Response::new(
                            http_body_util::Full::new(bytes::Bytes::from(format!("{e}\n")))
                                .map_err(|e| match e {})
                                .boxed_unsync(),
                        );
                        *r.status_mut() = http::StatusCode::BAD_GATEWAY;
                        r
                    }
                };
                Ok::<_, Infallible>(resp)
            }
        });
        tokio::spawn(
            hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tcp), svc),
        );
    }
}
