//! Compose spine's layers into your own service (the README's embedding example, compiled by CI).
//!
//! `cargo run -p reference-gateway --example embed -- <model.gguf>` builds the stack and exits.
#![allow(clippy::print_stdout, missing_docs)]
use std::sync::Arc;

use spine_core::{NodeDescriptor, NodeId};
use spine_meter::meter::{Catalog, CatalogEntry, MeterLayer};
use spine_meter::{ModelTokenizer, Price, SqliteLedger};
use spine_router::{NodeRegistry, RouteLayer};
use spine_transport::{
    StaticAuthenticator, TunnelEvents, TunnelServer, TunnelServerConfig, TunnelService,
};

/// Tunnel lifecycle → router registry (the router and the transport don't know each other).
struct Registry(NodeRegistry);
impl TunnelEvents for Registry {
    fn node_ready(&self, node: &NodeId, d: &NodeDescriptor) {
        self.0.node_ready(node, d)
    }
    fn node_gone(&self, node: &NodeId) {
        self.0.node_gone(node)
    }
    fn node_heartbeat(&self, node: &NodeId) {
        self.0.heartbeat(node)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let gguf = std::env::args().nth(1).ok_or("usage: embed <model.gguf>")?;
    let ledger = Arc::new(SqliteLedger::in_memory().await?);
    let mut catalog = Catalog::new();
    catalog.insert(
        "smollm2".into(),
        CatalogEntry {
            tokenizer: Arc::new(ModelTokenizer::from_gguf(&gguf)?),
            price: Price {
                input_micros_per_mtok: 150_000,
                output_micros_per_mtok: 600_000,
            },
            max_context_tokens: 8192,
        },
    );
    let registry = NodeRegistry::new();
    let auth = StaticAuthenticator::new().with_key("ed25519:…", NodeId::new("node_1"));
    let server = TunnelServer::new(
        TunnelServerConfig::default(),
        Arc::new(auth),
        Arc::new(Registry(registry.clone())),
    );
    // server.serve(listener, Some(tls)) accepts agents; this stack serves callers:
    let stack = tower::ServiceBuilder::new()
        .layer(MeterLayer::new(ledger, catalog).operator_share_bps(8_000))
        // SseClassify: lets the router tell an error event from the first token (retries before it)
        .layer(RouteLayer::new(registry).classify(Arc::new(spine_meter::classify::SseClassify)))
        .service(TunnelService::new(server.tunnels()));
    // Call it with an http::Request<spine_core::BoxBody> that carries RequestId and AccountId.
    let _ = stack;
    println!("stack built");
    Ok(())
}
