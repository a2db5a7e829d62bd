use serde::{Deserialize, Serialize};

/// Token usage of one request, in tokens.
///
/// Same meaning as OpenAI's `usage.prompt_tokens` / `usage.completion_tokens`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens of the rendered prompt, special tokens included.
    pub prompt_tokens: u64,
    /// Tokens generated, summed over all choices.
    pub completion_tokens: u64,
}

impl Usage {
    /// `prompt_tokens + completion_tokens`, saturating.
    pub fn total_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// Where a usage number came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum UsageSource {
    /// Counted by the gateway itself with the model's tokenizer and chat template (design §6).
    Independent,
    /// Reported by the node in its `usage` object; recorded, never billed alone.
    NodeClaim,
}

impl UsageSource {
    /// The snake_case name used in records and APIs.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Independent => "independent",
            Self::NodeClaim => "node_claim",
        }
    }
}

/// How a request ended (design brief §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum StreamOutcome {
    /// The node finished the response and the caller received all of it.
    Completed,
    /// The caller went away; it pays the prompt plus the tokens delivered.
    ClientCancelled,
    /// Error event, node lost or truncated stream: the caller pays nothing, the operator earns
    /// nothing, the node is penalised.
    UpstreamFailed,
    /// The request never reached a node.
    Rejected,
    /// The gateway ended the stream at one of its own bounds that a caller's request can reach
    /// with an honest node (the total stream duration, the tool calls one choice may carry):
    /// the caller pays the prompt plus the completion tokens delivered to it, as for
    /// [`ClientCancelled`](Self::ClientCancelled), but the operator earns nothing (the platform
    /// keeps it) and the node is not penalised. So neither side gains by aiming at a bound: a
    /// caller does not get the text free, a node (stalling to the duration bound, or padding a
    /// choice with tool calls) is not paid for it.
    CutAtBound,
}

impl StreamOutcome {
    /// The snake_case name used in records and APIs.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::ClientCancelled => "client_cancelled",
            Self::UpstreamFailed => "upstream_failed",
            Self::Rejected => "rejected",
            Self::CutAtBound => "cut_at_bound",
        }
    }

    /// Whether the caller pays for this ending: `completed`, `client_cancelled` and
    /// `cut_at_bound` bill the prompt plus the completion tokens delivered; `upstream_failed` and
    /// `rejected` bill nothing (the node's fault, or no node reached).
    pub fn is_billed(&self) -> bool {
        matches!(
            self,
            Self::Completed | Self::ClientCancelled | Self::CutAtBound
        )
    }

    /// Whether the serving node's operator is credited its share of the debit:
    /// `completed` and `client_cancelled` only (a `cut_at_bound` debit is all fee).
    pub fn pays_operator(&self) -> bool {
        matches!(self, Self::Completed | Self::ClientCancelled)
    }

    /// Parses the snake_case name; `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "completed" => Self::Completed,
            "client_cancelled" => Self::ClientCancelled,
            "upstream_failed" => Self::UpstreamFailed,
            "rejected" => Self::Rejected,
            "cut_at_bound" => Self::CutAtBound,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests;
