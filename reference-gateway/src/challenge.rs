//! Audit challenges (design brief §10): a node whose model has had no audit for a while gets a
//! plausible chat on the normal path — metered, billed to the platform's challenge account,
//! routed over its tunnel like any request — and the auditor scores it. Only wiring: the bodies
//! come from `spine_meter::audit::challenge_body`, the decision from `Auditor::is_quiet`, the
//! routing restriction from `spine_router::AvoidNodes`.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt as _;
use spine_core::{AccountId, BoxBody, ModelId, NodeId};
use spine_meter::audit::{challenge_body, AuditAlways, Auditor};
use spine_router::AvoidNodes;

use crate::state::AppState;

/// Longest one challenge may take, head to last byte.
const CHALLENGE_TIMEOUT: Duration = Duration::from_secs(300);

/// Runs forever: every `interval`, challenges each routable (node, audited model) with no audit
/// in the last `interval`, one at a time, billed to `account`.
pub(crate) async fn run(
    state: Arc<AppState>,
    auditor: Auditor,
    account: AccountId,
    audited_models: Vec<ModelId>,
    interval: Duration,
) {
    let mut seed_bytes = [0u8; 8];
    // a failed draw leaves a fixed start: challenges still vary with the counter
    let _ = getrandom::fill(&mut seed_bytes);
    let mut seed = u64::from_le_bytes(seed_bytes);
    loop {
        tokio::time::sleep(interval).await;
        let nodes = state.registry.snapshot();
        for node in &nodes {
            for model in node.descriptor.models.iter().map(|m| &m.id) {
                if !audited_models.contains(model)
                    || !auditor.is_quiet(&node.node_id, model, interval)
                {
                    continue;
                }
                let avoid: Vec<NodeId> = nodes
                    .iter()
                    .filter(|o| o.node_id != node.node_id)
                    .map(|o| o.node_id.clone())
                    .collect();
                seed = seed.wrapping_add(1);
                let ok = challenge(&state, &account, &node.node_id, model, avoid, seed).await;
                metrics::counter!("spine_audit_challenges_total", "result" => if ok { "answered" } else { "failed" })
                    .increment(1);
            }
        }
    }
}

/// Sends one challenge to `node` and reads the whole answer; whether it was answered 2xx.
async fn challenge(
    state: &AppState,
    account: &AccountId,
    node: &NodeId,
    model: &ModelId,
    avoid: Vec<NodeId>,
    seed: u64,
) -> bool {
    let body = challenge_body(model, seed).to_string();
    let Ok(mut req) = http::Request::post(spine_core::RequestKind::ChatCompletions.path())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(BoxBody::new(
            http_body_util::Full::new(bytes::Bytes::from(body)).map_err(|never| match never {}),
        ))
    else {
        return false;
    };
    let request_id = spine_meter::keys::new_request_id();
    req.extensions_mut().insert(request_id.clone());
    req.extensions_mut().insert(account.clone());
    req.extensions_mut().insert(AvoidNodes(avoid));
    req.extensions_mut().insert(AuditAlways);
    let answered = tokio::time::timeout(CHALLENGE_TIMEOUT, async {
        let resp = crate::api::call_stack(state.stack.clone(), req).await?;
        let ok = resp.status().is_success();
        resp.into_body().collect().await?;
        Ok::<_, spine_core::BoxError>(ok)
    })
    .await;
    match answered {
        Ok(Ok(ok)) => {
            tracing::debug!(node = %node, model = %model, request_id = %request_id, ok, "audit challenge answered");
            ok
        }
        Ok(Err(e)) => {
            tracing::warn!(node = %node, model = %model, request_id = %request_id, error = %e, "audit challenge failed");
            false
        }
        Err(_) => {
            tracing::warn!(node = %node, model = %model, request_id = %request_id, "audit challenge timed out");
            false
        }
    }
}
