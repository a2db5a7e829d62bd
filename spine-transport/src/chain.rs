//! Error messages for people: an error with its causes, once each, and hints for TLS failures.

/// Displays an error with its chain of sources, `a: b: c`, for logs and fatal messages. A
/// source whose message the text already holds is skipped (many errors repeat their source's
/// message in their own: `reading x: No such file or directory (os error 2)` then
/// `No such file or directory (os error 2)` again). A TLS failure gets a hint at its usual
/// cause ([`tls_hint`]).
#[derive(Debug)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut text = self.0.to_string();
        let mut source = self.0.source();
        while let Some(e) = source {
            let message = e.to_string();
            if !message.is_empty() && !text.contains(&message) {
                text.push_str(": ");
                text.push_str(&message);
            }
            source = e.source();
        }
        if let Some(hint) = tls_hint(&text) {
            text.push_str(" (hint: ");
            text.push_str(hint);
            text.push(')');
        }
        f.write_str(&text)
    }
}

/// The usual cause of a TLS failure named in `message` (rustls' words), if it is one.
pub fn tls_hint(message: &str) -> Option<&'static str> {
    if message.contains("UnknownIssuer") {
        Some(
            "the gateway's tunnel certificate is not trusted: for a gateway's own (self-signed) \
             certificate pass its `tunnel-cert.pem` (in its data dir; its start-up line names it \
             as `tunnel_ca_file`) with `--ca-file`; for a certificate from a public CA, install \
             the system's CA certificates (`ca-certificates`)",
        )
    } else if message.contains("NotValidForName") || message.contains("not valid for name") {
        Some(
            "the tunnel certificate does not name the host in the gateway URL: add the host to \
             the gateway's `tunnel_tls_hosts` (then delete its generated certificate) or dial a \
             name the certificate holds",
        )
    } else if message.contains("BadSignature") {
        Some(
            "the certificate passed with `--ca-file` is not the one the gateway serves (it was \
             regenerated?): copy the gateway's current `tunnel-cert.pem`",
        )
    } else if message.contains("InvalidContentType") || message.contains("corrupt message") {
        Some(
            "the address did not answer TLS: dial the gateway's tunnel listener with `wss://` \
             (not its public or admin port, and not plain `ws://`)",
        )
    } else if message.contains("certificate expired") || message.contains("Expired") {
        Some("the tunnel certificate has expired: renew it on the gateway")
    } else {
        None
    }
}

#[cfg(test)]
mod tests;
