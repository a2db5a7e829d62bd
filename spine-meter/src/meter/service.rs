use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body_util::{BodyExt, Full, Limited};
use spine_core::{
    AccountId, BoxBody, BoxError, BufferedRequest, NodeId, NodeSlot, PeekError, RequestContext,
    RequestId, RequestKind, RequestPeek, StreamOutcome, Usage,
};
use tower::Service;

use super::admission::{AdmissionEvents, AdmitGuard};
use super::bill::{json_as_stream, meter_json};
use super::body::{MeterBody, StreamSettings};
use super::constraint::sampling_constraint;
use super::embeddings::meter_embeddings;
use super::prompt::{
    affordable_prompt_tokens, biases_unknown_token, count_prompts, developer_to_system,
    grammar_names_tokens, logit_bias_unreadable, raises_control_token, stop_hidden_bytes,
    PromptLimits, GRAMMAR_NAMES_TOKENS, RAISED_CONTROL_TOKEN, UNKNOWN_TOKEN_BIAS,
    UNREADABLE_LOGIT_BIAS,
};
use super::request_body::read_request_body_and_balance;
use super::settle::{AuditCapture, NoRoom, SettleCtx};
use super::{AdmissionRequest, CountedUsage, MeterConfig, MeterError, ResponseFuture};
use crate::{inject_include_usage, LedgerError};

/// The metering middleware. See the [module docs](super).
#[derive(Clone, Debug)]
pub struct Meter<S> {
    inner: S,
    config: MeterConfig,
}

impl<S> Meter<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, config: MeterConfig) -> Self {
        Self { inner, config }
    }

    spine_core::inner_service_accessors!(inner: S);
}

/// Settles the request if dropped armed, before the response head: the caller went away (or
/// the inner service failed) while the request was on its way to, or at, a node.
///
/// - no node picked yet (the [`NodeSlot`] is empty): `rejected`, the hold released, nothing
///   billed;
/// - a node picked: `client_cancelled` with that node, billing the prompt and 0 completion
///   tokens (the node already did the prefill; design brief §6).
struct PendingGuard {
    ctx: Option<SettleCtx>,
    slot: NodeSlot,
}

impl PendingGuard {
    /// Disarms the guard, with the node filled in from the slot when the context has none.
    fn take(&mut self) -> Option<SettleCtx> {
        let mut ctx = self.ctx.take()?;
        if ctx.node.is_none() {
            ctx.node = self.slot.get();
        }
        Some(ctx)
    }
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        if let Some(ctx) = self.take() {
            let outcome = if ctx.node.is_some() {
                StreamOutcome::ClientCancelled
            } else {
                StreamOutcome::Rejected
            };
            ctx.settle_prompt_only(outcome);
        }
    }
}

impl<S> Service<http::Request<BoxBody>> for Meter<S>
where
    S: spine_core::UpstreamService,
{
    type Response = http::Response<BoxBody>;
    type Error = BoxError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<BoxBody>) -> Self::Future {
        // the ready service goes into the future; a fresh clone stays behind (tower's pattern)
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        ResponseFuture {
            inner: Box::pin(call(inner, config, req)),
        }
    }
}

async fn call<S>(
    mut inner: S,
    config: MeterConfig,
    req: http::Request<BoxBody>,
) -> Result<http::Response<BoxBody>, BoxError>
where
    S: Service<http::Request<BoxBody>, Response = http::Response<BoxBody>, Error = BoxError>,
    S::Future: Send + 'static,
{
    // the edge's typed context when it set one; else the separate extensions and the path
    let context = req.extensions().get::<RequestContext>();
    let context_kind = context.map(|c| c.kind);
    let key = context.and_then(|c| c.key.clone());
    let request_id = match context {
        Some(c) => c.request_id.clone(),
        None => req
            .extensions()
            .get::<RequestId>()
            .cloned()
            .ok_or(MeterError::MissingExtension("RequestId"))?,
    };
    let account = match context {
        Some(c) => c.account.clone(),
        None => req
            .extensions()
            .get::<AccountId>()
            .cloned()
            .ok_or(MeterError::MissingExtension("AccountId"))?,
    };
    let (mut parts, body) = req.into_parts();
    let (mut bytes, available_micros) =
        read_request_body_and_balance(&config, &account, body).await?;
    // the endpoint decides the request's allowlist: the edge's context, else the path
    let known_kind = context_kind.or_else(|| RequestKind::from_path(parts.uri.path()));
    let peek = match known_kind {
        Some(kind) => RequestPeek::for_endpoint(kind, &bytes),
        None => RequestPeek::from_json(&bytes),
    }
    .map_err(MeterError::BadRequest)?;
    let entry = config
        .catalog
        .get(&peek.model)
        .ok_or_else(|| MeterError::UnknownModel(peek.model.clone()))?
        .clone();
    let mut json: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| MeterError::BadRequest(spine_core::PeekError::NotJson(e.to_string())))?;
    // as `RequestPeek::from_json` infers it when the path is not an endpoint's
    let kind = known_kind.unwrap_or(if json.get("messages").is_some() {
        RequestKind::ChatCompletions
    } else if json.get("prompt").is_some() {
        RequestKind::Completions
    } else if json.get("input").is_some() {
        RequestKind::Embeddings
    } else {
        RequestKind::ChatCompletions
    });
    if kind == RequestKind::ChatCompletions && developer_to_system(&mut json) {
        // what the node reads is what the meter counted
        bytes = serde_json::to_vec(&json)
            .map_err(|e| MeterError::BadRequest(PeekError::NotJson(e.to_string())))?
            .into();
    }
    if kind != RequestKind::Embeddings && logit_bias_unreadable(&json) {
        return Err(MeterError::BadRequest(PeekError::InvalidField {
            field: "logit_bias",
            expected: UNREADABLE_LOGIT_BIAS,
        })
        .into());
    }
    if kind != RequestKind::Embeddings && biases_unknown_token(&json, &*entry.tokenizer) {
        return Err(MeterError::BadRequest(PeekError::InvalidField {
            field: "logit_bias",
            expected: UNKNOWN_TOKEN_BIAS,
        })
        .into());
    }
    if kind != RequestKind::Embeddings && raises_control_token(&json, &*entry.tokenizer) {
        return Err(MeterError::BadRequest(PeekError::InvalidField {
            field: "logit_bias",
            expected: RAISED_CONTROL_TOKEN,
        })
        .into());
    }
    if kind != RequestKind::Embeddings && grammar_names_tokens(&json) {
        return Err(MeterError::BadRequest(PeekError::InvalidField {
            field: "grammar",
            expected: GRAMMAR_NAMES_TOKENS,
        })
        .into());
    }
    // counting stops as soon as a prompt cannot fit the context, or the prompts cost more than
    // the account's balance (read for large bodies): a caller that cannot pay, or a prompt that
    // cannot be served, costs the tokenizer no more than what fits
    let limits = PromptLimits {
        max_context_tokens: entry.max_context_tokens,
        affordable: available_micros.map(|a| (affordable_prompt_tokens(&entry.price, a), a)),
        price: entry.price,
    };
    let prompts = count_prompts(&*entry.tokenizer, kind, &json, &limits)?;
    // every prompt must leave room for a completion token (embeddings: fit the context)
    let longest = prompts.iter().copied().max().unwrap_or(0);
    if longest >= entry.max_context_tokens {
        return Err(MeterError::ContextLengthExceeded {
            prompt_tokens: longest,
            max_context_tokens: entry.max_context_tokens,
        }
        .into());
    }
    let dimensions = entry.tokenizer.embedding_dimensions();
    if kind == RequestKind::Embeddings {
        let buffer = config.max_response_body_bytes;
        super::embeddings::admit(&json, prompts.len(), dimensions, buffer)?;
    }
    let prompt_tokens = prompts.iter().copied().fold(0u64, u64::saturating_add);
    let prompt_count = u32::try_from(prompts.len()).unwrap_or(u32::MAX);
    // choices: n per prompt (OpenAI; llama.cpp indexes them prompt-major: p·n + j);
    // embeddings: one vector per input, no completion tokens
    let (choices, per_choice) = if kind == RequestKind::Embeddings {
        (prompt_count, 0)
    } else {
        // llama.cpp generates at least one token, even for max_tokens 0; the shortest prompt
        // has the most room, so this caps every choice
        let shortest = prompts.iter().copied().min().unwrap_or(0);
        let room = entry.max_context_tokens - shortest;
        (
            peek.n.saturating_mul(prompt_count),
            peek.max_tokens.map_or(room, |m| m.min(room)).max(1),
        )
    };
    let worst = Usage {
        prompt_tokens,
        completion_tokens: per_choice.saturating_mul(u64::from(choices)),
    };
    let hold_micros = entry.price.cost_micros(&worst);
    let streamed = peek.stream && kind != RequestKind::Embeddings;
    let body = if streamed {
        inject_include_usage(&bytes).map_err(MeterError::Inject)?
    } else {
        bytes
    };
    // design brief §10: a model audited on its nodes' own logprobs has them asked for on every
    // auditable request (the node cannot tell which ones are audited); the caller who did not
    // ask gets the answer without them
    let chat = kind == RequestKind::ChatCompletions;
    let node_logprobs = kind != RequestKind::Embeddings
        && config
            .audit
            .as_ref()
            .is_some_and(|tap| tap.node_logprobs(&peek.model));
    let caller_logprobs = crate::inject::asks_logprobs(chat, &json);
    let inject_logprobs =
        node_logprobs && !caller_logprobs && crate::audit::auditable(kind, &body).is_ok();
    let body = if inject_logprobs {
        crate::inject::inject_logprobs(&body, chat).map_err(MeterError::Inject)?
    } else {
        body
    };
    let mut admitted = AdmitGuard { armed: None };
    let mut events = config.events.clone();
    if let Some(admission) = &config.admission {
        let admission_request = AdmissionRequest {
            request_id: &request_id,
            account: &account,
            model: &peek.model,
            kind,
            reserved_tokens: worst.total_tokens(),
            extensions: &parts.extensions,
        };
        admission
            .admit_async(&admission_request)
            .await
            .map_err(MeterError::AdmissionRefused)?;
        admitted.armed = Some((admission.clone(), request_id.clone()));
        events = Arc::new(AdmissionEvents {
            inner: events,
            admission: admission.clone(),
        });
    }
    let slot = NodeSlot::new();
    let ctx = SettleCtx {
        ledger: config.ledger.clone(),
        events,
        runtime: tokio::runtime::Handle::current(),
        settlements: config.settlements.clone(),
        refused_credit: config.refused_credit.clone(),
        request_id: request_id.clone(),
        account: account.clone(),
        key,
        started: tokio::time::Instant::now(),
        ttft_ms: None,
        model: peek.model.clone(),
        node: None,
        caller_logprobs,
        tokenizer: entry.tokenizer.clone(),
        price: entry.price,
        share_bps: config.operator_share_bps,
        prompt_tokens,
        prompt_tokens_each: (prompts.len() > 1).then(|| prompts.as_slice().into()),
        n_per_prompt: peek.n,
        n: choices,
        max_completion_tokens_per_choice: per_choice,
        shortest_prompt_tokens: prompts.iter().copied().min().unwrap_or(0),
        max_tokens: peek.max_tokens,
        sampling_constraint: sampling_constraint(&peek, &json, &*entry.tokenizer),
        stop_hidden_bytes: stop_hidden_bytes(&json),
        tolerance_tokens: config.discrepancy_tolerance_tokens,
        tolerance_bps: config.discrepancy_tolerance_bps,
        audit: config
            .audit
            .as_ref()
            .filter(|_| kind != RequestKind::Embeddings)
            .map(|tap| {
                let mut capture = AuditCapture::new(tap.clone(), kind, body.clone());
                capture.always = parts
                    .extensions
                    .get::<crate::audit::AuditAlways>()
                    .is_some();
                if inject_logprobs || (node_logprobs && caller_logprobs) {
                    capture.capture_logprobs(tap.max_node_tokens());
                }
                Box::new(capture)
            }),
    };
    let mut guard = hold_owned(&config, ctx, slot.clone(), hold_micros, admitted).await?;
    parts.headers.remove(http::header::CONTENT_LENGTH);
    parts.headers.insert(
        http::header::CONTENT_LENGTH,
        http::HeaderValue::from(body.len()),
    );
    let include_usage = peek.include_usage;
    let stream_requested = peek.stream;
    // the body collected and read once: the router takes these bytes and this peek instead of
    // collecting and reading the request body again (issue 20)
    parts
        .extensions
        .insert(BufferedRequest::new(body.clone(), peek.clone(), longest));
    parts.extensions.insert(peek);
    // issue 15: the router routes only to nodes whose context holds the longest prompt
    parts.extensions.insert(spine_core::PromptTokens(longest));
    // the router records the node it picks here; the guard reads it if the caller leaves first
    parts.extensions.insert(slot);
    let req = http::Request::from_parts(
        parts,
        BoxBody::new(Full::new(body).map_err(|never| match never {})),
    );

    // boxed here, where `S::Future: Send` is known for the concrete body type (works around
    // rustc's higher-ranked lifetime check on `dyn Error` inside async fns)
    let fut: Pin<Box<dyn Future<Output = Result<http::Response<BoxBody>, BoxError>> + Send>> =
        Box::pin(inner.call(req));
    let resp = match fut.await {
        Ok(resp) => resp,
        Err(e) => {
            // a node picked and lost (tunnel failure): upstream_failed; none picked: rejected.
            // Either way the caller pays nothing and the hold is released.
            if let Some(ctx) = guard.take() {
                let outcome = if ctx.node.is_some() {
                    StreamOutcome::UpstreamFailed
                } else {
                    StreamOutcome::Rejected
                };
                ctx.settle_prompt_only(outcome);
            }
            return Err(e);
        }
    };
    if let Some(node) = resp.extensions().get::<NodeId>() {
        if let Some(ctx) = guard.ctx.as_mut() {
            ctx.node = Some(node.clone());
        }
    }
    if let (Some(context), Some(ctx)) = (guard.slot.context_tokens(), guard.ctx.as_mut()) {
        ctx.limit_to_node_context(context);
    }
    if !resp.status().is_success() {
        if let Some(ctx) = guard.take() {
            ctx.settle_prompt_only(StreamOutcome::UpstreamFailed);
        }
        return Ok(resp);
    }
    let streaming = spine_core::is_event_stream_response(resp.headers());
    let (mut parts, body) = resp.into_parts();
    parts.headers.remove(http::header::CONTENT_LENGTH);
    if streaming && !stream_requested {
        // a stream to a caller that asked for one JSON body: its SDK cannot read it (the Python
        // SDK hands back a string), so it is not an answer to bill; the node broke the protocol
        let Some(ctx) = guard.take() else {
            return Err(MeterError::MissingExtension("settlement context").into());
        };
        tracing::warn!(request_id = %ctx.request_id, "node streamed an answer to a request that asked for none");
        guard.slot.report_node_fault();
        ctx.settle_prompt_only(StreamOutcome::UpstreamFailed);
        return Err(MeterError::UpstreamInvalid(
            "the node streamed its answer to a request that asked for no stream".to_owned(),
        )
        .into());
    }
    if streaming && kind != RequestKind::Embeddings {
        let Some(ctx) = guard.take() else {
            return Err(MeterError::MissingExtension("settlement context").into());
        };
        let settings = StreamSettings {
            include_usage,
            kind,
            strip_engine_fields: config.strip_engine_fields,
            max_sse_line_bytes: config.max_sse_line_bytes,
            max_sse_event_bytes: config.max_sse_event_bytes,
            max_stream_duration: config.max_stream_duration,
            stream_stall_timeout: config.stream_stall_timeout,
            drain_deadline: config.drain_deadline.clone(),
            slot: Some(guard.slot.clone()),
        };
        parts.extensions.insert(CountedUsage(Usage {
            prompt_tokens: ctx.prompt_tokens,
            completion_tokens: 0,
        }));
        let body = MeterBody::streaming(body, ctx, settings);
        return Ok(http::Response::from_parts(parts, BoxBody::new(body)));
    }
    // Non-streamed: the whole body is read and checked before the head goes out, so an invalid
    // body becomes an error instead of a 200. Dropped while reading, the guard settles
    // client_cancelled with the node.
    // An answer past what the request can honestly produce (its byte bound) is the node's
    // fault; one within it but past what the gateway buffers is the gateway's limit.
    let bound = guard.ctx.as_ref().map_or(0, |ctx| {
        if kind == RequestKind::Embeddings {
            let base64 = json
                .get("encoding_format")
                .and_then(serde_json::Value::as_str)
                == Some("base64");
            super::embeddings::answer_bytes_bound(prompts.len(), dimensions, base64)
        } else {
            super::bill::stream_bytes_bound(ctx)
        }
    });
    let ceiling = u64::try_from(config.max_response_body_bytes).unwrap_or(u64::MAX);
    let limit = usize::try_from(bound.min(ceiling)).unwrap_or(usize::MAX);
    let read = match within(config.response_body_timeout, collect_response(body, limit)).await {
        Some(read) => read,
        None => Err(ResponseRead::TimedOut(config.response_body_timeout)),
    };
    let Some(ctx) = guard.take() else {
        return Err(MeterError::MissingExtension("settlement context").into());
    };
    let bytes = match read {
        Ok(bytes) => bytes,
        Err(ResponseRead::OverLimit) if bound > ceiling && kind == RequestKind::Embeddings => {
            // nothing delivered, and nothing the caller could do but send fewer inputs: free
            tracing::warn!(request_id = %ctx.request_id, limit, "embeddings answer over the gateway's buffer");
            ctx.settle(StreamOutcome::CutAtBound, Usage::default(), None);
            return Err(MeterError::EmbeddingsTooLarge { limit_bytes: limit }.into());
        }
        Err(ResponseRead::OverLimit) if bound > ceiling => {
            tracing::warn!(request_id = %ctx.request_id, limit, "non-streamed answer over the gateway's buffer");
            ctx.settle_prompt_only(StreamOutcome::CutAtBound);
            return Err(MeterError::AnswerTooLarge { limit_bytes: limit }.into());
        }
        Err(read) => {
            let e = read.into_error(limit);
            tracing::warn!(request_id = %ctx.request_id, error = %e, "node response body unusable");
            guard.slot.report_node_fault();
            ctx.settle_prompt_only(StreamOutcome::UpstreamFailed);
            return Err(e.into());
        }
    };
    let mut bytes = if kind == RequestKind::Embeddings {
        meter_embeddings(ctx, &bytes, prompts.len(), Some(&guard.slot))?
    } else {
        meter_json(
            ctx,
            &bytes,
            kind,
            config.strip_engine_fields,
            Some(&guard.slot),
        )?
    };
    if stream_requested && kind != RequestKind::Embeddings {
        // one JSON body answering a request that asked for a stream: the SDKs read no SSE event
        // from it (the caller would pay for an answer it never gets), so the metered answer
        // goes out as the stream the caller asked for
        bytes = json_as_stream(&bytes, kind, include_usage);
        parts.headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/event-stream"),
        );
    }
    Ok(http::Response::from_parts(
        parts,
        BoxBody::new(Full::new(bytes).map_err(|never| match never {})),
    ))
}

/// Places the request's hold on a task of its own and hands back the guard that owns it.
///
/// # Cancel safety
///
/// The hold is owned from the moment it is requested: when the caller goes away while the hold
/// is being placed (this future dropped at its await), the task still places or refuses it, and
/// a placed hold is released at once by the guard it then drops (settled `rejected`, nothing
/// billed) — never left to a restart's sweep. An admission taken before is released the same
/// way (0 tokens) when the hold is refused or the guard released.
async fn hold_owned(
    config: &MeterConfig,
    ctx: SettleCtx,
    slot: NodeSlot,
    hold_micros: u64,
    mut admitted: AdmitGuard,
) -> Result<PendingGuard, MeterError> {
    // a ledger behind the traffic: wait for it before holding (see `max_unsettled_requests`)
    let limit = config.max_unsettled_requests;
    let in_flight = match config
        .settlements
        .wait_for_room(&ctx.account, limit, config.unsettled_wait)
        .await
    {
        Ok(in_flight) => in_flight,
        Err(NoRoom::Full) => return Err(MeterError::SettlementsBehind { limit }),
        Err(NoRoom::AccountShare(limit)) => {
            return Err(MeterError::AccountSettlementsBehind { limit })
        }
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<Result<PendingGuard, LedgerError>>();
    let ledger = config.ledger.clone();
    let refused = config.refused_credit.clone();
    let settlements = config.settlements.clone();
    let runtime = ctx.runtime.clone();
    settlements.spawn_on(
        async move {
            let placed = ledger
                .hold(
                    ctx.request_id.clone(),
                    ctx.account.clone(),
                    ctx.model.clone(),
                    hold_micros,
                )
                .await;
            drop(in_flight);
            let answer = match placed {
                Ok(()) => {
                    refused.forget(&ctx.account);
                    // from here every ending settles, and the settlement releases the admission
                    admitted.disarm();
                    Ok(PendingGuard {
                        ctx: Some(ctx),
                        slot,
                    })
                }
                Err(e) => {
                    if let LedgerError::InsufficientCredit {
                        available_micros, ..
                    } = &e
                    {
                        refused.record(&ctx.account, *available_micros);
                    }
                    Err(e)
                }
            };
            // the caller gone: the guard comes back here and its drop releases the hold (a
            // guard left unreceived in the channel is dropped with it, the same way)
            drop(tx.send(answer));
        },
        &runtime,
    );
    match rx.await {
        Ok(Ok(guard)) => Ok(guard),
        Ok(Err(LedgerError::InsufficientCredit {
            available_micros,
            needed_micros,
        })) => Err(MeterError::InsufficientCredit {
            available_micros,
            needed_micros,
        }),
        Ok(Err(other)) => Err(MeterError::Ledger(other)),
        Err(_) => Err(MeterError::MissingExtension("hold task")),
    }
}

/// Why a node's non-streamed body could not be read whole.
enum ResponseRead {
    /// Longer than the limit.
    OverLimit,
    /// Reading failed.
    Failed(BoxError),
    /// Not whole within [`MeterConfig::response_body_timeout`] (a trickling body).
    TimedOut(std::time::Duration),
}

impl ResponseRead {
    fn into_error(self, limit: usize) -> MeterError {
        match self {
            Self::OverLimit => {
                MeterError::UpstreamInvalid(format!("the body is larger than {limit} bytes"))
            }
            Self::Failed(e) => MeterError::UpstreamBody(e),
            Self::TimedOut(bound) => MeterError::UpstreamInvalid(format!(
                "the body did not arrive whole within {} s",
                bound.as_secs_f64()
            )),
        }
    }
}

/// Awaits `fut` for at most `bound` (zero: no bound); `None` when the bound passed first.
async fn within<F: Future>(bound: std::time::Duration, fut: F) -> Option<F::Output> {
    if bound.is_zero() {
        return Some(fut.await);
    }
    tokio::time::timeout(bound, fut).await.ok()
}

type ResponseFutureBytes = Pin<Box<dyn Future<Output = Result<bytes::Bytes, ResponseRead>> + Send>>;

/// Buffers a node's non-streamed response body up to `limit` bytes.
fn collect_response(body: BoxBody, limit: usize) -> ResponseFutureBytes {
    let mut collect = Box::pin(Limited::new(body, limit).collect());
    Box::pin(std::future::poll_fn(move |cx| {
        collect.as_mut().poll(cx).map(|r| match r {
            Ok(c) => Ok(c.to_bytes()),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ResponseRead::OverLimit),
            Err(e) => Err(ResponseRead::Failed(e)),
        })
    }))
}
