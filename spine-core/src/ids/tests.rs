use super::*;

#[test]
fn ids_display_and_serialize_as_plain_strings() {
    let id = NodeId::new("node_1");
    assert_eq!(id.to_string(), "node_1");
    assert_eq!(
        serde_json::to_string(&id).ok().as_deref(),
        Some("\"node_1\"")
    );
    assert_eq!(format!("{id:?}"), "NodeId(\"node_1\")");
}
