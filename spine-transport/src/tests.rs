use super::is_payload_logging_target;

#[test]
fn payload_logging_targets_match_the_crate_and_its_modules_only() {
    assert!(is_payload_logging_target("tokenizers"));
    assert!(is_payload_logging_target(
        "tokenizers::tokenizer::normalizer"
    ));
    assert!(is_payload_logging_target("minijinja::vm"));
    assert!(is_payload_logging_target("h2::codec::framed_read"));
    assert!(is_payload_logging_target("hyper_util::client"));
    assert!(!is_payload_logging_target("h2o"));
    assert!(!is_payload_logging_target("spine_transport::server"));
    assert!(!is_payload_logging_target("reference_gateway"));
}
