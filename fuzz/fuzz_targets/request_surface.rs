//! The request surface over arbitrary bytes: the peek of each endpoint, and a chat body's
//! `messages` / `tools` check. Nothing panics, and whatever is accepted holds only members of
//! the endpoint's allowlist (issue 13: nothing reaches a node that the meter does not know).
#![no_main]
use libfuzzer_sys::fuzz_target;
use spine_core::{
    validate_chat_messages, RequestKind, RequestPeek, CHAT_COMPLETIONS_MEMBERS,
    COMPLETIONS_MEMBERS, EMBEDDINGS_MEMBERS, NOT_SERVED, SAMPLING_EXTRAS,
    TOKENIZATION_CONSTRAINT_FIELDS,
};

fn allowed(kind: RequestKind, name: &str) -> bool {
    let table: &[&str] = match kind {
        RequestKind::ChatCompletions => &CHAT_COMPLETIONS_MEMBERS,
        RequestKind::Completions => &COMPLETIONS_MEMBERS,
        _ => &EMBEDDINGS_MEMBERS,
    };
    table.contains(&name)
        || NOT_SERVED.contains(&name)
        || (kind != RequestKind::Embeddings
            && (SAMPLING_EXTRAS.contains(&name) || TOKENIZATION_CONSTRAINT_FIELDS.contains(&name)))
}

fuzz_target!(|bytes: &[u8]| {
    let _ = RequestPeek::from_json(bytes);
    let value = serde_json::from_slice::<serde_json::Value>(bytes).ok();
    for kind in [
        RequestKind::ChatCompletions,
        RequestKind::Completions,
        RequestKind::Embeddings,
    ] {
        if RequestPeek::for_endpoint(kind, bytes).is_ok() {
            if let Some(object) = value.as_ref().and_then(|v| v.as_object()) {
                for name in object.keys() {
                    assert!(allowed(kind, name), "{kind:?} accepted {name}");
                }
            }
        }
    }
    if let Some(v) = &value {
        let _ = validate_chat_messages(v);
    }
});
