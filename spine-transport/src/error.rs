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
    Stalled,
    StreamRefused,
}

/// Whether `err` (hyper's HTTP/2 error) comes from the connection itself going away: an I/O
/// error of the transport (broken pipe, reset, EOF when a tunnel dies; h2 hands it to every
/// stream in flight) or a GOAWAY. hyper reports these as plain HTTP/2 errors, not `is_closed`.
fn connection_gone(err: &hyper::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            if h2.is_go_away() {
                return true;
            }
            if let Some(io) = h2.get_io() {
                return io_closed(io);
            }
        } else if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return io_closed(io);
        }
        source = e.source();
    }
    false
}

/// Whether the node refused the stream with `RST_STREAM(REFUSED_STREAM)`: by RFC 9113 §8.7 it
/// did no processing of the request, which is safe to send again. An agent does so when the
/// gateway opens a stream the moment an earlier one ended, before the agent released it from its
/// `SETTINGS_MAX_CONCURRENT_STREAMS` count.
fn stream_refused(err: &hyper::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return h2.is_reset()
                && h2.is_remote()
                && h2.reason() == Some(h2::Reason::REFUSED_STREAM);
        }
        source = e.source();
    }
    false
}

/// I/O error kinds that mean the transport under the connection is gone.
fn io_closed(err: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(
        err.kind(),
        K::BrokenPipe
            | K::ConnectionReset
            | K::ConnectionAborted
            | K::NotConnected
            | K::UnexpectedEof
    )
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

    pub(crate) fn stalled() -> Self {
        Self::new(Kind::Stalled)
    }

    /// Classifies an error of hyper's HTTP/2 client or server connection.
    pub(crate) fn from_hyper(err: hyper::Error) -> Self {
        let kind = if err.is_timeout() {
            Kind::Timeout
        } else if stream_refused(&err) {
            Kind::StreamRefused
        } else if err.is_closed()
            || err.is_canceled()
            || err.is_incomplete_message()
            || connection_gone(&err)
        {
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

    /// The node already has as many streams open as it advertised (its `max_concurrency`): the
    /// request was refused before any byte went down the tunnel, so another node may serve it,
    /// or this one a moment later (a gateway answers 503 when none can). The gateway's own count:
    /// never the node's fault.
    pub fn is_node_full(&self) -> bool {
        self.kind == Kind::NodeFull
    }

    /// The node refused the request's stream with `RST_STREAM(REFUSED_STREAM)`: by RFC 9113
    /// §8.7 it did no processing, so the request may be sent again. Usually the moment between
    /// a stream's end on the gateway's side and on the agent's; a node that keeps refusing
    /// while it has room is at fault.
    pub fn is_stream_refused(&self) -> bool {
        self.kind == Kind::StreamRefused
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

    /// The node was found stalled (nothing received on any of its streams while its health
    /// probe timed out) before this request received anything: nothing reached the caller, so
    /// another node may serve it. The node has left routing.
    pub fn is_stalled(&self) -> bool {
        self.kind == Kind::Stalled
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
            Kind::Stalled => {
                "node stalled: no progress on its streams and its health probe timed out"
            }
            Kind::StreamRefused => "node refused the stream (REFUSED_STREAM: not processed)",
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
mod tests;

#[cfg(test)]
mod hyper_error_tests;
