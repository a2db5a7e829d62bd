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
