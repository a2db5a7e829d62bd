//! Metering a non-streamed `/v1/embeddings` response: input tokens only.
//!
//! Before any hold ([`admit`]): at most [`MAX_INPUTS`] inputs (OpenAI's limit), `dimensions`
//! only as the model's own vector length, and no more inputs than an honest answer of the
//! model's vectors can fit the gateway's buffer ([`answer_bytes_bound`]). After the node
//! ([`meter_embeddings`]): the answer checked and rebuilt from OpenAI's members only.

use bytes::Bytes;
use indexmap::IndexMap;
use serde_json::value::RawValue;
use serde_json::Value;
use spine_core::{NodeSlot, StreamOutcome, Usage};

use super::settle::SettleCtx;
use super::MeterError;

type JsonMap = IndexMap<String, Box<RawValue>>;

/// OpenAI's limit on the inputs of one embeddings request: more is refused 400 (`param`
/// `input`) before anything is counted.
pub(crate) const MAX_INPUTS: usize = 2048;

/// Most bytes one vector element takes as JSON text, its separator included. llama.cpp writes
/// each `float` widened to a double, shortest round trip (nlohmann::json): at most 17
/// significant digits with a sign, a point and a two-digit exponent or up to three leading
/// zeros (`-1.4012984643248171e-45`, `-0.00012318301945924759`: 23 characters); 24 are
/// allowed. Measured on llama.cpp (SmolLM2-135M, 576 dimensions, 2,048 inputs): 25,304,073
/// bytes, 21.45 bytes an element, the longest number 23 characters; in base64, 6,450,185 bytes
/// (bound 6,823,936).
const NUMBER_BYTES: u64 = 25;
/// Bytes of one `data` item besides its vector (`{"embedding":[],"index":2047,"object":
/// "embedding"},` is 52), with room.
const ITEM_BYTES: u64 = 256;
/// Bytes of the answer besides `data` (`object`, `model`, `usage`), with room.
const ENVELOPE_BYTES: u64 = 4096;

/// The most bytes an honest answer of `inputs` vectors of `dimensions` elements can take
/// (`base64`: `encoding_format: "base64"`, 4 bytes an element in base64). Past it the node is at
/// fault. `dimensions` unknown: 1 MiB plus 256 KiB a vector (8,192 dimensions as JSON numbers
/// are ≈ 170 KB).
pub(super) fn answer_bytes_bound(inputs: usize, dimensions: Option<u64>, base64: bool) -> u64 {
    let inputs = u64::try_from(inputs).unwrap_or(u64::MAX);
    let Some(d) = dimensions else {
        return (1u64 << 20).saturating_add(inputs.saturating_mul(256 * 1024));
    };
    let vector = if base64 {
        // 4 characters per 3 bytes, padded, and the quotes
        d.saturating_mul(4)
            .div_ceil(3)
            .saturating_mul(4)
            .saturating_add(2)
    } else {
        d.saturating_mul(NUMBER_BYTES)
    };
    ENVELOPE_BYTES.saturating_add(inputs.saturating_mul(ITEM_BYTES.saturating_add(vector)))
}

/// Refuses, before anything is held or forwarded, an embeddings request of `inputs` inputs
/// (already at most [`MAX_INPUTS`]) for a model whose vectors have `dimensions` elements (when
/// known) that the gateway cannot honestly answer:
///
/// - `dimensions` (OpenAI: shorten the vectors) other than the model's own length: llama.cpp
///   ignores it and would return full vectors, so only the length it returns anyway is
///   accepted, and none when the length is unknown (400, `param` `dimensions`);
/// - an honest answer ([`answer_bytes_bound`]) larger than `buffer_bytes`, the most the gateway
///   buffers of a non-streamed answer: embeddings cannot be streamed, so such a request could
///   only end in a 502 after the node's work (400, `param` `input`, naming how many inputs fit).
pub(super) fn admit(
    json: &Value,
    inputs: usize,
    dimensions: Option<u64>,
    buffer_bytes: usize,
) -> Result<(), MeterError> {
    let asked = json.get("dimensions").filter(|v| !v.is_null());
    if let Some(asked) = asked {
        if dimensions.is_none() || asked.as_u64() != dimensions {
            let message = match dimensions {
                Some(d) => format!(
                    "This model does not support specifying dimensions: its vectors have {d} \
                     dimensions ('dimensions' may only be {d})."
                ),
                None => "This model does not support specifying dimensions.".to_owned(),
            };
            return Err(MeterError::EmbeddingsRefused {
                param: "dimensions",
                message,
            });
        }
    }
    let base64 = json.get("encoding_format").and_then(Value::as_str) == Some("base64");
    let buffer = u64::try_from(buffer_bytes).unwrap_or(u64::MAX);
    if dimensions.is_some() && answer_bytes_bound(inputs, dimensions, base64) > buffer {
        let fit = (0..=inputs)
            .rev()
            .find(|&n| answer_bytes_bound(n, dimensions, base64) <= buffer)
            .unwrap_or(0);
        return Err(MeterError::EmbeddingsRefused {
            param: "input",
            message: format!(
                "{inputs} inputs can make an answer larger than the {buffer_bytes} bytes this \
                 gateway buffers (embeddings cannot be streamed): send at most {fit} inputs per \
                 request for this model"
            ),
        });
    }
    Ok(())
}

/// Meters a complete 2xx `/v1/embeddings` body and settles.
///
/// A usable answer is OpenAI's shape: a JSON object without a non-null `error`, whose `data` is
/// an array of exactly `inputs` objects, each with an `embedding` that is a non-empty array of
/// JSON numbers (or, for `encoding_format: "base64"`, a base64 string of whole little-endian
/// `f32`s), every vector of the same dimension, and an `index` (when present) that is an
/// integer below `inputs`, each index once. It settles `completed` with the independent input
/// count and 0 completion tokens, and comes back rebuilt from OpenAI's members only:
/// `{"object":"list","data":[{"object":"embedding","index":i,"embedding":…}],"model":…,
/// "usage":{"prompt_tokens":billed,"total_tokens":billed}}` — `model` the catalog id the caller
/// asked for, `index` the node's or the item's position, the vector as the node wrote it; any
/// other member of the node's is dropped. The node's `usage.prompt_tokens` is kept as its
/// claim. Anything else is the node's fault: the fault is reported on `slot` (the router scores
/// it), the request settles `upstream_failed` (the caller pays nothing) and it is a
/// [`MeterError::UpstreamInvalid`] (502).
pub(crate) fn meter_embeddings(
    ctx: SettleCtx,
    body: &[u8],
    inputs: usize,
    slot: Option<&NodeSlot>,
) -> Result<Bytes, MeterError> {
    let billed = Usage {
        prompt_tokens: ctx.prompt_tokens,
        completion_tokens: 0,
    };
    let fail = |ctx: SettleCtx, claimed: Option<Usage>, why: String| {
        tracing::warn!(request_id = %ctx.request_id, reason = %why, "invalid node response");
        if let Some(slot) = slot {
            slot.report_node_fault();
        }
        ctx.settle(StreamOutcome::UpstreamFailed, billed, claimed);
        Err(MeterError::UpstreamInvalid(why))
    };
    let Ok(map) = serde_json::from_slice::<JsonMap>(body) else {
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
    let checked = map
        .get("data")
        .ok_or_else(|| "no `data` member".to_owned())
        .and_then(|data| check_data(data, inputs));
    let vectors = match checked {
        Ok(vectors) => vectors,
        Err(why) => {
            return fail(
                ctx,
                claimed,
                format!("not an embeddings answer for {inputs} inputs: {why}"),
            )
        }
    };
    let model = match serde_json::to_string(ctx.model.as_str()) {
        Ok(m) => m,
        Err(e) => return fail(ctx, claimed, format!("cannot encode the model: {e}")),
    };
    let mut out = String::with_capacity(body.len().min(1 << 30));
    out.push_str("{\"object\":\"list\",\"data\":[");
    for (at, (index, embedding)) in vectors.iter().enumerate() {
        if at > 0 {
            out.push(',');
        }
        out.push_str("{\"object\":\"embedding\",\"index\":");
        out.push_str(&index.to_string());
        out.push_str(",\"embedding\":");
        out.push_str(embedding.get());
        out.push('}');
    }
    out.push_str("],\"model\":");
    out.push_str(&model);
    out.push_str(&format!(
        ",\"usage\":{{\"prompt_tokens\":{0},\"total_tokens\":{0}}}}}",
        billed.prompt_tokens
    ));
    drop(vectors);
    ctx.settle(StreamOutcome::Completed, billed, claimed);
    Ok(Bytes::from(out))
}

/// One item of `data` as read for checking: the vector stays raw until [`vector_len`].
#[derive(serde::Deserialize)]
struct Item<'a> {
    #[serde(borrow)]
    embedding: Option<&'a RawValue>,
    #[serde(borrow)]
    index: Option<&'a RawValue>,
}

/// Checks `data` (see [`meter_embeddings`]): each item's index (the node's, else its position)
/// and vector, in the node's order; the reason when it is not usable.
fn check_data(data: &RawValue, inputs: usize) -> Result<Vec<(usize, &RawValue)>, String> {
    let not_objects = || "`data` is not an array of objects".to_owned();
    let raw: Vec<&RawValue> = serde_json::from_str(data.get()).map_err(|_| not_objects())?;
    let items = raw
        .iter()
        .map(|item| {
            // an object, not a sequence that serde would also read into the struct
            if !item.get().trim_start().starts_with('{') {
                return Err(not_objects());
            }
            serde_json::from_str::<Item<'_>>(item.get()).map_err(|_| not_objects())
        })
        .collect::<Result<Vec<_>, _>>()?;
    if items.len() != inputs {
        return Err(format!("{} vectors in `data`", items.len()));
    }
    let mut dimension = None;
    let mut vectors = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let Some(embedding) = item.embedding else {
            return Err(format!("item {i} has no `embedding`"));
        };
        let len = vector_len(embedding).map_err(|why| format!("item {i}: {why}"))?;
        if len == 0 {
            return Err(format!("item {i} has an empty embedding"));
        }
        match dimension {
            None => dimension = Some(len),
            Some(d) if d != len => {
                return Err(format!(
                    "item {i} has {len} dimensions where the first has {d}"
                ))
            }
            Some(_) => {}
        }
        if let Some(index) = item.index {
            let at = index
                .get()
                .parse::<usize>()
                .ok()
                .filter(|&at| at < inputs)
                .ok_or_else(|| {
                    format!("item {i} has index {} (not below {inputs})", index.get())
                })?;
            vectors.push((at, embedding));
        } else {
            vectors.push((i, embedding));
        }
    }
    // each index once, whether the node's or an index-less item's position
    let mut taken = vec![false; inputs];
    for (at, _) in &vectors {
        if let Some(slot) = taken.get_mut(*at) {
            if std::mem::replace(slot, true) {
                return Err(format!("index {at} appears twice"));
            }
        }
    }
    Ok(vectors)
}

/// The dimension of one `embedding`: an array of JSON numbers (each read as an `f64`, nothing
/// kept), or a base64 string of little-endian `f32`s (`encoding_format: "base64"`).
fn vector_len(raw: &RawValue) -> Result<usize, String> {
    let text = raw.get().trim_start();
    if text.starts_with('"') {
        use base64::Engine as _;
        let s: &str = serde_json::from_str(raw.get())
            .map_err(|_| "`embedding` is not a plain base64 string".to_owned())?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(|_| "`embedding` is a string but not base64".to_owned())?;
        if bytes.len() % 4 != 0 {
            return Err("`embedding` is base64 but not whole f32 values".to_owned());
        }
        return Ok(bytes.len() / 4);
    }
    let Numbers(n) = serde_json::from_str(raw.get())
        .map_err(|_| "`embedding` is not an array of numbers".to_owned())?;
    Ok(n)
}

/// How many numbers a JSON array holds; fails on anything but an array of numbers.
struct Numbers(usize);

impl<'de> serde::Deserialize<'de> for Numbers {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Numbers;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array of numbers")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Numbers, A::Error> {
                let mut n = 0usize;
                while seq.next_element::<f64>()?.is_some() {
                    n += 1;
                }
                Ok(Numbers(n))
            }
        }
        d.deserialize_seq(Visit)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::check_data;
    use serde_json::value::RawValue;

    fn check(data: &str, inputs: usize) -> Result<(), String> {
        check_data(&RawValue::from_string(data.to_owned()).unwrap(), inputs).map(|_| ())
    }

    #[test]
    fn only_openais_shape_with_one_vector_per_input_is_usable() {
        // usable: arrays of numbers, one per input, same dimension, indices once each
        assert_eq!(
            check(
                r#"[{"object":"embedding","index":1,"embedding":[0.5,-1e-3]},{"index":0,"embedding":[1,2]}]"#,
                2
            ),
            Ok(())
        );
        // base64 of two f32s; no index at all
        assert_eq!(check(r#"[{"embedding":"AACAPwAAAEA="}]"#, 1), Ok(()));
        for (data, inputs) in [
            // not an array of objects
            (r#"{"embedding":[1]}"#, 1),
            (r#"[[1,2]]"#, 1),
            (r#"[[[1,2]]]"#, 1),
            (r#"["x"]"#, 1),
            // wrong count
            (r#"[{"embedding":[1]}]"#, 2),
            (r#"[{"embedding":[1]},{"embedding":[2]}]"#, 1),
            (r#"[]"#, 1),
            // not numbers
            (r#"[{"embedding":["1","2"]}]"#, 1),
            (r#"[{"embedding":[1,null]}]"#, 1),
            (r#"[{"embedding":[1,[2]]}]"#, 1),
            (r#"[{"embedding":[true]}]"#, 1),
            (r#"[{"embedding":{"0":1}}]"#, 1),
            (r#"[{"embedding":null}]"#, 1),
            (r#"[{"embedding":1}]"#, 1),
            (r#"[{}]"#, 1),
            // a string that is not base64 of whole f32s
            (r#"[{"embedding":"not base64!"}]"#, 1),
            (r#"[{"embedding":"AAAA"}]"#, 1),
            // empty, or of different dimensions
            (r#"[{"embedding":[]}]"#, 1),
            (r#"[{"embedding":[1,2]},{"embedding":[1]}]"#, 2),
            // indices out of range, repeated, not integers
            (
                r#"[{"index":2,"embedding":[1]},{"index":0,"embedding":[1]}]"#,
                2,
            ),
            (
                r#"[{"index":0,"embedding":[1]},{"index":0,"embedding":[1]}]"#,
                2,
            ),
            (r#"[{"index":-1,"embedding":[1]}]"#, 1),
            (r#"[{"index":"0","embedding":[1]}]"#, 1),
            (r#"[{"index":0.0,"embedding":[1]}]"#, 1),
        ] {
            assert!(check(data, inputs).is_err(), "{data} for {inputs}");
        }
    }
}
