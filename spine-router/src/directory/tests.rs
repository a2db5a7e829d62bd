#![allow(clippy::unwrap_used)]

use std::collections::HashMap;

use spine_test_support::UpstreamService;

use super::*;

/// An in-memory directory; `broken` nodes fail the lookup.
#[derive(Debug, Default)]
struct MapDirectory {
    map: HashMap<NodeId, NodeLocation>,
    broken: Vec<NodeId>,
}

#[derive(Debug, thiserror::Error)]
#[error("directory unreachable")]
struct Unreachable;

impl NodeDirectory for MapDirectory {
    fn locate<'a>(&'a self, node: &'a NodeId) -> DirectoryFuture<'a, NodeLocation> {
        Box::pin(async move {
            if self.broken.contains(node) {
                return Err(Unreachable.into());
            }
            Ok(self.map.get(node).cloned().unwrap_or(NodeLocation::Unknown))
        })
    }
}

/// Answers with a body naming who served, and the owner it saw.
fn svc(name: &'static str) -> impl UpstreamService<String> {
    tower::service_fn(move |req: http::Request<String>| async move {
        let owner = req
            .extensions()
            .get::<RemoteOwner>()
            .map(|o| format!(" {}@{}", o.instance, o.address))
            .unwrap_or_default();
        Ok::<_, BoxError>(http::Response::new(format!("{name}{owner}")))
    })
}

fn request(node: Option<&str>) -> http::Request<String> {
    let mut req = http::Request::new(String::new());
    if let Some(node) = node {
        req.extensions_mut().insert(NodeId::new(node));
    }
    req
}

#[tokio::test]
async fn dispatches_by_location() {
    let mut dir = MapDirectory::default();
    dir.map.insert(NodeId::new("here"), NodeLocation::Local);
    dir.map.insert(
        NodeId::new("there"),
        NodeLocation::Remote(RemoteOwner::new("gw-b", "10.0.0.2:9443")),
    );
    dir.broken.push(NodeId::new("broken"));
    let dispatch = DirectoryDispatch::new(Arc::new(dir), svc("local"), svc("remote"));

    let resp = dispatch
        .clone()
        .oneshot(request(Some("here")))
        .await
        .unwrap();
    assert_eq!(resp.body(), "local");
    assert_eq!(
        resp.extensions().get::<NodeId>(),
        Some(&NodeId::new("here"))
    );

    let resp = dispatch
        .clone()
        .oneshot(request(Some("there")))
        .await
        .unwrap();
    assert_eq!(resp.body(), "remote gw-b@10.0.0.2:9443");
    assert_eq!(
        resp.extensions().get::<NodeId>(),
        Some(&NodeId::new("there"))
    );

    let err = dispatch
        .clone()
        .oneshot(request(Some("gone")))
        .await
        .unwrap_err();
    assert!(DirectoryError::not_node_fault(&err));
    assert!(matches!(
        err.downcast_ref::<DirectoryError>(),
        Some(DirectoryError::UnknownNode(n)) if n == &NodeId::new("gone")
    ));

    let err = dispatch.clone().oneshot(request(None)).await.unwrap_err();
    assert!(matches!(
        err.downcast_ref::<DirectoryError>(),
        Some(DirectoryError::MissingNode)
    ));

    // the directory's own error reaches the router unchanged, for its not_node_fault
    let err = dispatch
        .clone()
        .oneshot(request(Some("broken")))
        .await
        .unwrap_err();
    assert!(err.downcast_ref::<Unreachable>().is_some());
    assert!(!DirectoryError::not_node_fault(&err));
}

#[tokio::test]
async fn service_errors_pass_through() {
    let mut dir = MapDirectory::default();
    dir.map.insert(NodeId::new("here"), NodeLocation::Local);
    let failing = tower::service_fn(|_req: http::Request<String>| async {
        Err::<http::Response<String>, _>(Unreachable)
    });
    let dispatch = DirectoryDispatch::new(Arc::new(dir), failing, svc("remote"));
    let err = dispatch.oneshot(request(Some("here"))).await.unwrap_err();
    assert!(err.downcast_ref::<Unreachable>().is_some());
}
