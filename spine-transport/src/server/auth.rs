use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;

use spine_core::NodeId;

use crate::RefusalReason;

/// Decides whether a public key belongs to a registered node (the gateway's node store).
pub trait NodeAuthenticator: Send + Sync + 'static {
    /// The node registered under `public_key_text` (canonical form, [`crate::public_key_text`]).
    ///
    /// Called only after the hello's signature verified, so a caller cannot probe which keys are
    /// registered without holding the secret key.
    ///
    /// # Errors
    ///
    /// The refusal to send: [`RefusalReason::UnknownKey`] for an unregistered or revoked key,
    /// [`RefusalReason::Internal`] when the store cannot answer.
    fn authenticate<'a>(
        &'a self,
        public_key_text: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<NodeId, RefusalReason>> + Send + 'a>>;
}

/// A fixed set of registered keys, for tests and small deployments.
#[derive(Clone, Debug, Default)]
pub struct StaticAuthenticator {
    keys: HashMap<String, NodeId>,
}

impl StaticAuthenticator {
    /// An authenticator that knows no key.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `public_key_text` as `node`.
    pub fn with_key(mut self, public_key_text: impl Into<String>, node: NodeId) -> Self {
        self.keys.insert(public_key_text.into(), node);
        self
    }
}

impl NodeAuthenticator for StaticAuthenticator {
    fn authenticate<'a>(
        &'a self,
        public_key_text: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<NodeId, RefusalReason>> + Send + 'a>> {
        let res = self
            .keys
            .get(public_key_text)
            .cloned()
            .ok_or(RefusalReason::UnknownKey);
        Box::pin(std::future::ready(res))
    }
}
