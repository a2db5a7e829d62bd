//! What the auditor concludes about a node's model, and how the router learns it (design brief
//! §10, trust rung 1).
//!
//! The auditor (in `spine-meter`) scores nodes' delivered tokens against a trusted reference and
//! keeps one [`AuditVerdict`] per (node, model). The router never imports the meter: it asks a
//! [`ModelTrust`] whether a node may serve a model, and the gateway hands it the auditor.

use serde::{Deserialize, Serialize};

use crate::{ModelId, NodeId};

/// Where a (node, model) stands in the audit (design brief §10).
///
/// `Unverified → Passing → Suspect → Failed`. Only `Failed` stops routing; `Suspect` holds the
/// earnings of what the node serves until the verdict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum AuditVerdict {
    /// Not enough audited tokens for either conclusion yet.
    #[default]
    Unverified,
    /// The test accepted "serves the reference's model" (its lower boundary was reached).
    Passing,
    /// The evidence leans towards a substitute: past half the rejection boundary.
    Suspect,
    /// The test rejected "serves the reference's model": not routed that model until its
    /// operator re-verifies the node.
    Failed,
}

impl AuditVerdict {
    /// The name used in JSON and metrics (`unverified`, `passing`, `suspect`, `failed`).
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Unverified => "unverified",
            Self::Passing => "passing",
            Self::Suspect => "suspect",
            Self::Failed => "failed",
        }
    }

    /// Whether a node with this verdict may be routed the model.
    pub fn routable(&self) -> bool {
        !matches!(self, Self::Failed)
    }
}

/// What the router asks before it routes `model` to `node`.
///
/// Implemented by the auditor; `()` trusts every node. Called on every pick for every candidate:
/// implementations answer from memory, without I/O or blocking locks held for long.
pub trait ModelTrust: Send + Sync + 'static {
    /// Whether `node` may be routed requests for `model`.
    fn routable(&self, node: &NodeId, model: &ModelId) -> bool;
}

impl ModelTrust for () {
    fn routable(&self, _node: &NodeId, _model: &ModelId) -> bool {
        true
    }
}

#[cfg(test)]
mod tests;
