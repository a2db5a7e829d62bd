use super::*;

#[test]
fn outcome_names_round_trip() {
    for o in [
        StreamOutcome::Completed,
        StreamOutcome::ClientCancelled,
        StreamOutcome::UpstreamFailed,
        StreamOutcome::Rejected,
        StreamOutcome::CutAtBound,
    ] {
        assert_eq!(StreamOutcome::parse(o.as_str()), Some(o));
        assert_eq!(
            o.is_billed(),
            !matches!(o, StreamOutcome::UpstreamFailed | StreamOutcome::Rejected)
        );
    }
    assert_eq!(StreamOutcome::parse("done"), None);
}

#[test]
fn total_saturates() {
    let u = Usage {
        prompt_tokens: u64::MAX,
        completion_tokens: 3,
    };
    assert_eq!(u.total_tokens(), u64::MAX);
}
