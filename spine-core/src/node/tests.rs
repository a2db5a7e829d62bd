#![allow(clippy::unwrap_used)]
use super::*;

#[test]
fn a_descriptor_without_endpoints_is_unknown_and_serves_everything() {
    // what an agent before the field sends
    let old = r#"{"id":"m","max_context_tokens":2048}"#;
    let m: ModelDescriptor = serde_json::from_str(old).unwrap();
    assert_eq!(m.endpoints, None);
    assert!(m.serves_kind(RequestKind::Embeddings));
    assert_eq!(serde_json::to_string(&m).unwrap(), old);
    // a later agent's extra endpoint field is ignored; a missing one is false
    let new = r#"{"id":"m","endpoints":{"chat_completions":true,"rerank":true}}"#;
    let m: ModelDescriptor = serde_json::from_str(new).unwrap();
    assert_eq!(
        m.endpoints,
        Some(Endpoints {
            chat_completions: true,
            completions: false,
            embeddings: false
        })
    );
    assert!(m.serves_kind(RequestKind::ChatCompletions));
    assert!(!m.serves_kind(RequestKind::Completions));
    assert!(!m.serves_kind(RequestKind::Embeddings));
}
