use super::*;

#[test]
fn only_failed_stops_routing_and_names_are_snake_case() {
    for (v, name, routable) in [
        (AuditVerdict::Unverified, "unverified", true),
        (AuditVerdict::Passing, "passing", true),
        (AuditVerdict::Suspect, "suspect", true),
        (AuditVerdict::Failed, "failed", false),
    ] {
        assert_eq!(v.as_str(), name);
        assert_eq!(v.routable(), routable);
        assert_eq!(serde_json::to_string(&v).ok(), Some(format!("\"{name}\"")));
    }
    assert!(().routable(&NodeId::new("n"), &ModelId::new("m")));
}
