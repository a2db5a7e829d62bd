use super::*;

#[test]
fn first_bytes_commits_on_the_first_byte_and_fails_an_empty_body() {
    let mut c = FirstBytes::default().classifier(Some("application/json"));
    assert_eq!(c.feed(b""), BodySignal::Pending);
    assert_eq!(c.feed(b"{"), BodySignal::Content);
    assert_eq!(c.feed(b""), BodySignal::Content);
    assert_eq!(c.finish(), BodySignal::Content);
    let mut empty = FirstBytes::default();
    assert_eq!(empty.feed(b""), BodySignal::Pending);
    assert_eq!(empty.finish(), BodySignal::Failed);
}

#[test]
fn an_event_stream_is_its_media_type_in_any_case_with_or_without_parameters() {
    for (value, stream) in [
        ("text/event-stream", true),
        ("Text/Event-Stream", true),
        ("text/event-stream; charset=utf-8", true),
        ("text/event-stream;charset=utf-8", true),
        (" text/event-stream", true),
        ("text/event-stream x", true),
        ("text/event-streamx", false),
        ("text/event", false),
        ("application/json", false),
        ("", false),
    ] {
        assert_eq!(is_event_stream(value.as_bytes()), stream, "{value:?}");
    }
    // bytes that are no valid `str` after the type: still the type
    assert!(is_event_stream(b"text/event-stream; charset=\"\xff\""));
    let mut headers = http::HeaderMap::new();
    assert!(!is_event_stream_response(&headers));
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream"),
    );
    assert!(is_event_stream_response(&headers));
}
