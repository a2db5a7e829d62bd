use std::fmt;

use spine_core::BoxError;

use crate::RefusalReason;

/// An error of the tunnel: sending a request to a node, or dialling and handshaking as an agent.
///
/// Opaque, in hyper's habit: ask what happened with the `is_*` methods and [`refusal`]; the
/// underlying cause, when there is one, is kept as the [`source`](std::error::Error::source).
///
/// [`refusal`]: TunnelError::refusal
pub struct TunnelError {
    kind: Kind,
    detail: Option<String>,
    source: Option<BoxError>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    UnknownNode,
    NodeFull,
    MissingTarget,
    Closed,
    Timeout,
    Refused(RefusalReason),
    Connect,
    Protocol,
    Config,
    Request,
}

impl TunnelError {
    fn new(kind: Kind) -> Self {
        Self {
            kind,
            detail: None,
            source: None,
        }
    }

    pub(crate) fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    pub(crate) fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    pub(crate) fn unknown_node() -> Self {
        Self::new(Kind::UnknownNode)
    }

    pub(crate) fn node_full() -> Self {
        Self::new(Kind::NodeFull)
    }

    pub(crate) fn missing_target() -> Self {
        Self::new(Kind::MissingTarget)
    }

    pub(crate) fn closed() -> Self {
        Self::new(Kind::Closed)
    }

    pub(crate) fn timeout() -> Self {
        Self::new(Kind::Timeout)
    }

    pub(crate) fn refused(reason: RefusalReason) -> Self {
        Self::new(Kind::Refused(reason))
    }

    pub(crate) fn connect() -> Self {
        Self::new(Kind::Connect)
    }

    pub(crate) fn protocol() -> Self {
        Self::new(Kind::Protocol)
    }

    pub(crate) fn config() -> Self {
        Self::new(Kind::Config)
    }

    /// Classifies an error of hyper's HTTP/2 client or server connection.
    pub(crate) fn from_hyper(err: hyper::Error) -> Self {
        let kind = if err.is_timeout() {
            Kind::Timeout
        } else if err.is_closed() || err.is_canceled() || err.is_incomplete_message() {
            Kind::Closed
        } else {
            Kind::Request
        };
        Self::new(kind).with_source(err)
    }

    /// The request named a node that has no live tunnel on this gateway.
    pub fn is_unknown_node(&self) -> bool {
        self.kind == Kind::UnknownNode
    }

    /// The node already has as many streams open as it advertised (its `max_concurrency`); the
    /// request was refused before any byte went down the tunnel, so another node may serve it
    /// (a gateway answers 503 when none can).
    pub fn is_node_full(&self) -> bool {
        self.kind == Kind::NodeFull
    }

    /// The request carried no target [`NodeId`](spine_core::NodeId) in its extensions.
    pub fn is_missing_target(&self) -> bool {
        self.kind == Kind::MissingTarget
    }

    /// The tunnel closed (cleanly or not) before the exchange finished; in-flight requests on a
    /// closed tunnel fail with this.
    pub fn is_closed(&self) -> bool {
        self.kind == Kind::Closed
    }

    /// A deadline passed: dial, TLS or WebSocket handshake, tunnel handshake, or keepalive.
    pub fn is_timeout(&self) -> bool {
        self.kind == Kind::Timeout
    }

    /// The gateway refused the tunnel handshake; [`refusal`](Self::refusal) says why.
    pub fn is_refused(&self) -> bool {
        matches!(self.kind, Kind::Refused(_))
    }

    /// The reason the gateway gave for refusing the handshake, when it did.
    pub fn refusal(&self) -> Option<RefusalReason> {
        match self.kind {
            Kind::Refused(r) => Some(r),
            _ => None,
        }
    }

    /// Dialling the gateway failed: TCP, TLS or the WebSocket upgrade.
    pub fn is_connect(&self) -> bool {
        self.kind == Kind::Connect
    }

    /// The peer broke the tunnel protocol (unexpected or malformed handshake message).
    pub fn is_protocol(&self) -> bool {
        self.kind == Kind::Protocol
    }

    /// The configuration cannot work (bad gateway URL, plaintext without the insecure flag, …).
    pub fn is_config(&self) -> bool {
        self.kind == Kind::Config
    }

    fn description(&self) -> &'static str {
        match self.kind {
            Kind::UnknownNode => "no live tunnel for node",
            Kind::NodeFull => "node has no free stream (max concurrency reached)",
            Kind::MissingTarget => "request has no target node",
            Kind::Closed => "tunnel closed",
            Kind::Timeout => "tunnel timed out",
            Kind::Refused(_) => "tunnel handshake refused",
            Kind::Connect => "failed to connect tunnel",
            Kind::Protocol => "tunnel protocol error",
            Kind::Config => "invalid tunnel configuration",
            Kind::Request => "tunnel request failed",
        }
    }
}

impl fmt::Debug for TunnelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("TunnelError");
        d.field("kind", &self.kind);
        if let Some(detail) = &self.detail {
            d.field("detail", detail);
        }
        if let Some(source) = &self.source {
            d.field("source", source);
        }
        d.finish()
    }
}

impl fmt::Display for TunnelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.description())?;
        if let Kind::Refused(reason) = self.kind {
            write!(f, ": {reason}")?;
        }
        if let Some(detail) = &self.detail {
            write!(f, ": {detail}")?;
        }
        Ok(())
    }
}

impl std::error::Error for TunnelError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| &**e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn display_is_lowercase_and_names_the_refusal() {
        let e = TunnelError::refused(RefusalReason::UnknownKey);
        assert_eq!(e.to_string(), "tunnel handshake refused: unknown_key");
        assert!(e.is_refused());
        assert_eq!(e.refusal(), Some(RefusalReason::UnknownKey));
        assert!(!e.is_closed());

        let e = TunnelError::unknown_node().with_detail("node_1");
        assert_eq!(e.to_string(), "no live tunnel for node: node_1");
        assert!(e.is_unknown_node());
        assert_eq!(e.refusal(), None);
    }

    #[test]
    fn source_is_kept() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = TunnelError::connect().with_source(io);
        assert!(e.is_connect());
        assert_eq!(
            e.source().map(|s| s.to_string()).as_deref(),
            Some("refused")
        );
    }
}
