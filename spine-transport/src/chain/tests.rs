use super::*;

#[derive(Debug)]
struct Outer(std::io::Error);
impl std::fmt::Display for Outer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "reading model.gguf: {}", self.0)
    }
}
impl std::error::Error for Outer {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

#[test]
fn a_chain_names_each_cause_once() {
    let e = Outer(std::io::Error::from(std::io::ErrorKind::NotFound));
    let text = ErrorChain(&e).to_string();
    assert_eq!(text.matches("not found").count(), 1, "{text}");
    let plain = std::io::Error::other("invalid peer certificate: UnknownIssuer");
    assert!(ErrorChain(&plain).to_string().contains("--ca-file"));
    assert!(tls_hint("received corrupt message of type InvalidContentType").is_some());
    assert!(tls_hint("connection refused").is_none());
    // rustls 0.23's own words for the other two
    assert!(tls_hint("invalid peer certificate: certificate not valid for name \"x\"; certificate is only valid for [\"localhost\"]").is_some());
    assert!(tls_hint("invalid peer certificate: certificate expired: verification time 1 (UNIX), but certificate is not valid after 0").is_some());
}
