use super::*;

#[test]
fn settings_are_checked_into_a_config() {
    let settings: AuditSettings =
        serde_json::from_str(r#"{"rate_passing": 0.5, "max_tokens": 1, "timeout_secs": 0}"#)
            .unwrap_or_else(|e| unreachable!("{e}"));
    let c = settings
        .audit_config()
        .unwrap_or_else(|e| unreachable!("{e}"));
    assert_eq!(c.rate_passing, 0.5);
    assert_eq!(c.max_tokens, 2);
    assert_eq!(c.timeout, std::time::Duration::from_secs(1));
    assert_eq!(AuditSettings::default().challenge_interval_secs, 600);

    let bad = AuditSettings {
        rate_suspect: 1.5,
        ..AuditSettings::default()
    };
    assert_eq!(
        bad.audit_config().map(|_| ()),
        Err(AuditSettingsError(
            "audit.rate_suspect must be between 0 and 1 (got 1.5)".into()
        ))
    );
    let bad = AuditSettings {
        alpha: 0.5,
        ..AuditSettings::default()
    };
    let err = bad
        .audit_config()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.starts_with("audit.alpha and audit.beta"), "{err}");
    assert!(serde_json::from_str::<AuditSettings>(r#"{"rate": 1}"#).is_err());
}
