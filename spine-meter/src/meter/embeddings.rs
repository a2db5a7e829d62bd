//! Metering a non-streamed `/v1/embeddings` response: input tokens only.

use bytes::Bytes;
use indexmap::IndexMap;
use serde_json::value::RawValue;
use serde_json::Value;
use spine_core::{StreamOutcome, Usage};

use super::settle::SettleCtx;
use super::MeterError;

type JsonMap = IndexMap<String, Box<RawValue>>;

/// Meters a complete 2xx `/v1/embeddings` body and settles.
///
/// A usable answer (a JSON object without a non-null `error`, whose `data` is an array of
/// exactly `inputs` objects each with an `embedding`) settles `completed` with the independent
/// input count and 0 completion tokens, and comes back with `usage` rewritten to
/// `{"prompt_tokens": billed, "total_tokens": billed}` (OpenAI's embeddings usage shape). The
/// node's `usage.prompt_tokens` is kept as its claim. Anything else settles `upstream_failed`
/// (the caller pays nothing) and is a [`MeterError::UpstreamInvalid`].
pub(crate) fn meter_embeddings(
    ctx: SettleCtx,
    body: &[u8],
    inputs: usize,
) -> Result<Bytes, MeterError> {
    let billed = Usage {
        prompt_tokens: ctx.prompt_tokens,
        completion_tokens: 0,
    };
    let fail = |ctx: SettleCtx, claimed: Option<Usage>, why: String| {
        tracing::warn!(request_id = %ctx.request_id, reason = %why, "invalid node response");
        ctx.settle(StreamOutcome::UpstreamFailed, billed, claimed);
        Err(MeterError::UpstreamInvalid(why))
    };
    let Ok(mut map) = serde_json::from_slice::<JsonMap>(body) else {
        return fail(ctx, None, "the body is not a JSON object".to_owned());
    };
    let claimed = map
        .get("usage")
        .and_then(|u| serde_json::from_str::<Value>(u.get()).ok())
        .and_then(|u| u.get("prompt_tokens").and_then(Value::as_u64))
        .map(|prompt_tokens| Usage {
            prompt_tokens,
            completion_tokens: 0,
        });
    if map.get("error").is_some_and(|e| e.get().trim() != "null") {
        return fail(ctx, claimed, "the body carries an error".to_owned());
    }
    let data = map
        .get("data")
        .and_then(|d| serde_json::from_str::<Vec<Value>>(d.get()).ok());
    let usable = data.as_ref().is_some_and(|d| {
        d.len() == inputs
            && d.iter()
                .all(|e| e.get("embedding").is_some_and(|v| !v.is_null()))
    });
    if !usable {
        let got = data.map_or(0, |d| d.len());
        return fail(
            ctx,
            claimed,
            format!("expected {inputs} embeddings in `data`, got {got} usable"),
        );
    }
    let usage = format!(
        "{{\"prompt_tokens\":{0},\"total_tokens\":{0}}}",
        billed.prompt_tokens
    );
    let usage = match RawValue::from_string(usage) {
        Ok(u) => u,
        Err(e) => return fail(ctx, claimed, format!("cannot encode usage: {e}")),
    };
    map.insert("usage".to_owned(), usage);
    let bytes = match serde_json::to_vec(&map) {
        Ok(v) => Bytes::from(v),
        Err(e) => return fail(ctx, claimed, format!("cannot re-encode the body: {e}")),
    };
    ctx.settle(StreamOutcome::Completed, billed, claimed);
    Ok(bytes)
}
