//! The challenge loop (design brief §10): a node whose model has had no audit for a while gets a
//! plausible chat ([`challenge_body`]) on the normal path — metered, billed to the platform's
//! challenge account, routed to that node like any request — and the auditor scores it.
//!
//! [`Challenges`] keeps the bookkeeping: which (node, model) pairs are due
//! ([`Auditor::is_quiet`]), the seed of each body, the request's extensions, the time bound and
//! the outcome. The application brings what this crate does not know: the routable nodes and
//! how a request is sent through its stack to one node only.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use http_body_util::BodyExt as _;
use spine_core::{AccountId, BoxBody, BoxError, ModelId, NodeId};

use super::{challenge_body, AuditAlways, Auditor};

/// Longest one challenge may take, head to last byte.
pub const CHALLENGE_TIMEOUT: Duration = Duration::from_secs(300);

/// What sending one challenge returns: the stack's answer (its body is read to the end).
pub type ChallengeFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<BoxBody>, BoxError>> + Send>>;

/// Audit challenges for nodes with little traffic: every `interval`, each routable (node,
/// audited model) with no audit in the last `interval` is sent one chat, one at a time, billed
/// to the challenge account.
#[derive(Clone)]
pub struct Challenges {
    auditor: Auditor,
    account: AccountId,
    models: Vec<ModelId>,
    interval: Duration,
}

impl std::fmt::Debug for Challenges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Challenges")
            .field("account", &self.account)
            .field("models", &self.models)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

impl Challenges {
    /// Challenges of `models` (the audited ones) scored by `auditor`, billed to `account`,
    /// every `interval`.
    pub fn new(
        auditor: Auditor,
        account: AccountId,
        models: Vec<ModelId>,
        interval: Duration,
    ) -> Self {
        Self {
            auditor,
            account,
            models,
            interval,
        }
    }

    /// Runs forever (spawn it; dropping the future stops it): every `interval`, asks `routable`
    /// for the routable nodes and the models each is routed for, and for each due (node,
    /// model) calls `send` with a `POST /v1/chat/completions` request (its [`RequestId`]
    /// (spine_core::RequestId), the account's [`AccountId`] and [`AuditAlways`] in the
    /// extensions) and every *other* routable node, which the application's router must avoid
    /// (spine-router: `AvoidNodes`). Each challenge is bounded by [`CHALLENGE_TIMEOUT`]; the
    /// outcome is logged and, with feature `metrics`, counted in
    /// `spine_audit_challenges_total{result="answered"|"failed"}`.
    pub async fn run<R, S>(self, routable: R, send: S)
    where
        R: Fn() -> Vec<(NodeId, Vec<ModelId>)> + Send + Sync,
        S: Fn(http::Request<BoxBody>, Vec<NodeId>) -> ChallengeFuture + Send + Sync,
    {
        let mut seed_bytes = [0u8; 8];
        // a failed draw leaves a fixed start: challenges still vary with the counter
        let _ = getrandom::fill(&mut seed_bytes);
        let mut seed = u64::from_le_bytes(seed_bytes);
        loop {
            tokio::time::sleep(self.interval).await;
            let nodes = routable();
            for (node, models) in &nodes {
                for model in models {
                    if !self.models.contains(model)
                        || !self.auditor.is_quiet(node, model, self.interval)
                    {
                        continue;
                    }
                    let avoid: Vec<NodeId> = nodes
                        .iter()
                        .filter(|(o, _)| o != node)
                        .map(|(o, _)| o.clone())
                        .collect();
                    seed = seed.wrapping_add(1);
                    let ok = self.challenge(node, model, avoid, seed, &send).await;
                    #[cfg(feature = "metrics")]
                    ::metrics::counter!("spine_audit_challenges_total", "result" => if ok { "answered" } else { "failed" })
                        .increment(1);
                    #[cfg(not(feature = "metrics"))]
                    let _ = ok;
                }
            }
        }
    }

    /// Sends one challenge to `node` and reads the whole answer; whether it was answered 2xx.
    async fn challenge<S>(
        &self,
        node: &NodeId,
        model: &ModelId,
        avoid: Vec<NodeId>,
        seed: u64,
        send: &S,
    ) -> bool
    where
        S: Fn(http::Request<BoxBody>, Vec<NodeId>) -> ChallengeFuture,
    {
        let body = challenge_body(model, seed).to_string();
        let Ok(mut req) = http::Request::post(spine_core::RequestKind::ChatCompletions.path())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(BoxBody::new(
                http_body_util::Full::new(bytes::Bytes::from(body)).map_err(|never| match never {}),
            ))
        else {
            return false;
        };
        let request_id = crate::keys::new_request_id();
        req.extensions_mut().insert(request_id.clone());
        req.extensions_mut().insert(self.account.clone());
        req.extensions_mut().insert(AuditAlways);
        let answered = tokio::time::timeout(CHALLENGE_TIMEOUT, async {
            let resp = send(req, avoid).await?;
            let ok = resp.status().is_success();
            resp.into_body().collect().await?;
            Ok::<_, BoxError>(ok)
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
}
