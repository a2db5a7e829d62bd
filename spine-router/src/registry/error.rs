use std::time::Duration;

use spine_core::{ModelId, RequestKind};

/// Why no node could be picked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouteError {
    /// The request carries no [`RequestPeek`](spine_core::RequestPeek) extension: the metering
    /// layer must run before routing.
    #[error("request has no peeked model; the metering layer must run before routing")]
    MissingPeek,
    /// No routable node serves this model.
    #[error("no node serves model '{0}'")]
    NoNodeForModel(ModelId),
    /// Nodes serve the model but all of them are at their concurrency limit.
    #[error("all nodes serving model '{0}' are at capacity")]
    AtCapacity(ModelId),
    /// The last attempt's node sent nothing the caller could get (no head, or no first content)
    /// within the first-content deadline ([`RouteConfig::first_content_timeout`](crate::RouteConfig)).
    #[error("no first content from the node within {0:?}")]
    FirstContentTimeout(Duration),
    /// A committed response's node sent nothing for this long
    /// ([`RouteConfig::stream_idle_timeout`](crate::RouteConfig)): a body error, after bytes
    /// reached the caller, so never retried.
    #[error("node sent nothing for {} s after the response began", .0.as_secs())]
    StreamIdleTimeout(Duration),
    /// Every node that could serve the request is full and the model's admission queue is at
    /// its depth ([`QueueConfig::max_depth`]), or this request's place went to another account's
    /// (see [`crate::queue`]). `retry_after`: the queue's estimate of when a place frees.
    ///
    /// [`QueueConfig::max_depth`]: crate::QueueConfig::max_depth
    #[error("all nodes serving model '{model}' are at capacity and its queue is full")]
    QueueFull {
        /// The model.
        model: ModelId,
        /// When trying again may succeed (at least 1 s).
        retry_after: Duration,
    },
    /// The request waited [`QueueConfig::max_wait`] in the model's admission queue without a
    /// free slot.
    ///
    /// [`QueueConfig::max_wait`]: crate::QueueConfig::max_wait
    #[error("all nodes serving model '{model}' stayed at capacity for {} s", .waited.as_secs())]
    QueueTimeout {
        /// The model.
        model: ModelId,
        /// How long it waited.
        waited: Duration,
        /// When trying again may succeed (at least 1 s).
        retry_after: Duration,
    },
    /// Nodes serve the model, but none with a context window that holds the prompt
    /// ([`PromptTokens`](spine_core::PromptTokens)); `max_context_tokens` is the largest among
    /// them.
    #[error("prompt of {prompt_tokens} tokens does not fit the context of any node serving model '{model}' (largest: {max_context_tokens} tokens)")]
    ContextLengthExceeded {
        /// The model.
        model: ModelId,
        /// The request's longest prompt.
        prompt_tokens: u64,
        /// The largest context window among the model's nodes.
        max_context_tokens: u64,
    },
    /// Nodes serve the model, but none answers this endpoint (e.g. embeddings turned off on
    /// every engine).
    #[error("no node serving model '{model}' answers {}", .kind.path())]
    Unsupported {
        /// The model.
        model: ModelId,
        /// The endpoint asked for.
        kind: RequestKind,
    },
    /// Nodes serve the model and the endpoint, but none runs an engine that generates several
    /// choices for one request (`n` > 1; Ollama does not).
    #[error("no node serving model '{model}' generates n = {n} choices per request")]
    SeveralChoicesUnsupported {
        /// The model.
        model: ModelId,
        /// The `n` asked for.
        n: u32,
    },
}
