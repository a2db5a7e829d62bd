use spine_core::{ModelId, NodeId, RequestKind};

/// What a request needs from a node besides its model: routing filters from the node's
/// advertised capabilities ([`ModelDescriptor`](spine_core::ModelDescriptor)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// The endpoint; `None`: any node of the model will do.
    pub kind: Option<RequestKind>,
    /// The longest prompt, tokens: only nodes whose context window is larger (or unknown) fit.
    pub prompt_tokens: Option<u64>,
    /// Choices per prompt (`n`); 0 and 1 both mean one. Above one, only nodes whose engine
    /// generates several choices fit ([`EngineKind::generates_several_choices`]).
    ///
    /// [`EngineKind::generates_several_choices`]: spine_core::EngineKind::generates_several_choices
    pub choices: u32,
}

/// One pick asked of the registry: [`NodeRegistry::acquire`](crate::NodeRegistry::acquire).
#[derive(Clone, Copy, Debug)]
pub struct Ask<'a> {
    /// The model.
    pub model: &'a ModelId,
    /// The affinity preference, as for
    /// [`NodeRegistry::pick_preferring`](crate::NodeRegistry::pick_preferring).
    pub preferred: Option<Option<&'a NodeId>>,
    /// Nodes not to pick (tried already).
    pub exclude: &'a [NodeId],
    /// Capability filters.
    pub needs: Needs,
}

/// An [`Ask`] kept while its request waits in the model's admission queue (the model is the
/// queue's).
#[derive(Debug)]
pub(crate) struct QueuedAsk {
    preferred: Option<Option<NodeId>>,
    exclude: Vec<NodeId>,
    needs: Needs,
}

impl QueuedAsk {
    /// A copy of `ask` that outlives it.
    pub(crate) fn of(ask: &Ask<'_>) -> Self {
        Self {
            preferred: ask.preferred.map(|p| p.cloned()),
            exclude: ask.exclude.to_vec(),
            needs: ask.needs,
        }
    }

    /// The ask again, for `model`.
    pub(crate) fn ask<'a>(&'a self, model: &'a ModelId) -> Ask<'a> {
        Ask {
            model,
            preferred: self.preferred.as_ref().map(Option::as_ref),
            exclude: &self.exclude,
            needs: self.needs,
        }
    }
}
