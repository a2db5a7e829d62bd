#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use http_body_util::BodyExt;
use spine_core::{BoxBody, BoxError, ModelId, NodeId, RequestPeek};
use spine_test_support::{full, UpstreamService};
use tower::{Layer, ServiceExt};

use crate::affinity::{AffinityKey, AffinityStore};
use crate::{AffinityFuture, NodeRegistry, Route, RouteLayer, StickyOutcome};

/// A shared store: a map, or a store that always fails.
#[derive(Debug, Default)]
struct MapStore {
    failing: bool,
    map: Mutex<HashMap<u64, NodeId>>,
    gets: Mutex<u32>,
}

impl AffinityStore for MapStore {
    fn get<'a>(
        &'a self,
        model: &'a ModelId,
        key: &'a AffinityKey,
    ) -> AffinityFuture<'a, Option<NodeId>> {
        Box::pin(async move {
            *self.gets.lock().unwrap() += 1;
            if self.failing {
                return Err("store down".into());
            }
            Ok(self.map.lock().unwrap().get(&key.digest(model)).cloned())
        })
    }
    fn set<'a>(
        &'a self,
        model: &'a ModelId,
        key: &'a AffinityKey,
        node: &'a NodeId,
    ) -> AffinityFuture<'a, ()> {
        Box::pin(async move {
            if self.failing {
                return Err("store down".into());
            }
            self.map
                .lock()
                .unwrap()
                .insert(key.digest(model), node.clone());
            Ok(())
        })
    }
}

fn registry() -> NodeRegistry {
    let r = NodeRegistry::new();
    for n in ["a", "b", "c", "d"] {
        r.node_ready(&NodeId::new(n), &spine_test_support::node_serving("m", 64));
    }
    r
}

fn request() -> http::Request<BoxBody> {
    let mut req = http::Request::post("/v1/completions")
        .body(full("{}"))
        .unwrap();
    req.extensions_mut().insert(RequestPeek {
        model: ModelId::new("m"),
        stream: false,
        include_usage: false,
        n: 1,
        max_tokens: None,
        prompt_cache_key: Some("chat-1".into()),
        conversation_key: None,
        tokenization_constrained: false,
    });
    req
}

/// Answers 200 and says which node it was.
fn upstream() -> impl UpstreamService {
    tower::service_fn(|req: http::Request<BoxBody>| async move {
        let node = req.extensions().get::<NodeId>().cloned().unwrap();
        Ok::<_, BoxError>(http::Response::new(full(node.as_str().to_owned())))
    })
}

async fn served(svc: &Route<impl UpstreamService>) -> String {
    let resp = svc.clone().oneshot(request()).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}

#[tokio::test]
async fn the_shared_store_names_the_sticky_node() {
    let r = registry();
    let store = Arc::new(MapStore::default());
    let key = AffinityKey::PromptCacheKey("chat-1".into());
    // another instance served the conversation on "c"
    store
        .map
        .lock()
        .unwrap()
        .insert(key.digest(&ModelId::new("m")), NodeId::new("c"));
    let svc = RouteLayer::new(r.clone())
        .affinity_store(store.clone())
        .layer(upstream());
    for _ in 0..10 {
        assert_eq!(served(&svc).await, "c");
    }
    assert_eq!(*store.gets.lock().unwrap(), 10);
    let hits: u64 = r.snapshot().iter().map(|s| s.sticky_hits).sum();
    assert_eq!(hits, 10);
    // the store's answer wins over the local table
    assert_eq!(
        r.pick_preferring(&ModelId::new("m"), Some(Some(&NodeId::new("b"))), &[])
            .map(|p| (p.lease.node().clone(), p.sticky))
            .unwrap(),
        (NodeId::new("b"), StickyOutcome::Hit)
    );
}

#[tokio::test]
async fn a_failing_store_falls_back_to_the_local_table() {
    let r = registry();
    let store = Arc::new(MapStore {
        failing: true,
        ..MapStore::default()
    });
    let svc = RouteLayer::new(r.clone())
        .affinity_store(store.clone())
        .layer(upstream());
    let first = served(&svc).await;
    for _ in 0..10 {
        assert_eq!(served(&svc).await, first);
    }
    assert_eq!(*store.gets.lock().unwrap(), 11);
}

#[tokio::test]
async fn a_served_conversation_is_written_to_the_store() {
    let r = registry();
    let store = Arc::new(MapStore::default());
    let svc = RouteLayer::new(r)
        .affinity_store(store.clone())
        .layer(upstream());
    let node = served(&svc).await;
    let key = AffinityKey::PromptCacheKey("chat-1".into()).digest(&ModelId::new("m"));
    // written off the response path
    for _ in 0..100 {
        if store.map.lock().unwrap().contains_key(&key) {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(
        store.map.lock().unwrap().get(&key),
        Some(&NodeId::new(node.as_str()))
    );
}
