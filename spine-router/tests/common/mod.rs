//! What the `Route` suites (`route.rs`, `readahead.rs`) share: nodes serving the model `m`, and
//! a chat request as the metering layer hands it on (its `RequestPeek` and `NodeSlot` set).

use spine_core::{BoxBody, ModelId, NodeId, NodeSlot, RequestPeek};
use spine_router::NodeRegistry;

/// A registry where each of `nodes` is ready, serving `m` with 4 slots.
pub(crate) fn registry(nodes: &[&str]) -> NodeRegistry {
    let r = NodeRegistry::new();
    for n in nodes {
        r.node_ready(&NodeId::new(*n), &spine_test_support::node_serving("m", 4));
    }
    r
}

/// `POST /v1/chat/completions` with the body `{"model":"m"}`, its peek (`stream`, the
/// `prompt_cache_key` `key`) and an empty node slot, which comes back too.
pub(crate) fn request_streamed(
    key: Option<&str>,
    stream: bool,
) -> (http::Request<BoxBody>, NodeSlot) {
    let mut req = http::Request::post("/v1/chat/completions")
        .body(spine_test_support::full(r#"{"model":"m"}"#))
        .unwrap();
    req.extensions_mut().insert(RequestPeek {
        model: ModelId::new("m"),
        stream,
        include_usage: false,
        n: 1,
        max_tokens: None,
        prompt_cache_key: key.map(str::to_owned),
        conversation_key: None,
        tokenization_constrained: false,
    });
    let slot = NodeSlot::new();
    req.extensions_mut().insert(slot.clone());
    (req, slot)
}
