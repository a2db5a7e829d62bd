//! What the chat template is given besides `messages`: `reasoning_effort` as llama.cpp gives it.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;
use serde_json::json;

#[test]
fn reasoning_effort_reaches_the_template_as_llama_cpp_passes_it() {
    let meta = crate::gguf::GgufMetadata::open(crate::test_support::model_gguf()).unwrap();
    let t = ModelTokenizer::from_gguf_metadata(&meta)
        .unwrap()
        .with_chat_template(
            "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}/{{ reasoning_strength }};{% endif %}\
{% if enable_thinking is defined and not enable_thinking %}nothink;{% endif %}\
{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}",
        )
        .unwrap();
    let body = |effort: serde_json::Value| json!({"messages":[{"role":"user","content":"hi"}],"reasoning_effort":effort});
    assert_eq!(
        t.render_chat(&body(json!("high"))).unwrap(),
        "effort=high/high;user:hi;"
    );
    assert_eq!(
        t.render_chat(&body(json!("none"))).unwrap(),
        "nothink;user:hi;"
    );
    assert_eq!(t.render_chat(&body(json!(null))).unwrap(), "user:hi;");
    assert_eq!(
        t.render_chat(&json!({"messages":[{"role":"user","content":"hi"}]}))
            .unwrap(),
        "user:hi;"
    );
}
