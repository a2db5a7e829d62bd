use std::fmt;

/// Why the gateway refused a tunnel handshake (design brief §4).
///
/// The gateway closes the WebSocket with close code [`close_code`](Self::close_code) (`4000 + n`,
/// in the private-use range of RFC 6455 §7.4.2) and a close reason equal to
/// [`as_str`](Self::as_str), a stable snake_case code agents and operators can match on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RefusalReason {
    /// The public key is not registered with the gateway. Close code 4001, `unknown_key`.
    UnknownKey,
    /// The signature does not verify against the public key. Close code 4002, `bad_signature`.
    BadSignature,
    /// The hello arrived after the challenge's maximum age. Close code 4003, `stale_challenge`.
    StaleChallenge,
    /// The agent speaks a protocol version the gateway does not. Close code 4004,
    /// `unsupported_protocol`.
    UnsupportedProtocol,
    /// The hello is not a well-formed handshake message. Close code 4005, `malformed_handshake`.
    MalformedHandshake,
    /// No hello arrived within the handshake timeout. Close code 4006, `handshake_timeout`.
    HandshakeTimeout,
    /// The node already has a live tunnel on this gateway. Close code 4007, `duplicate_session`.
    DuplicateSession,
    /// The gateway could not decide (for example its node store failed). Close code 4008,
    /// `internal_error`. Worth retrying after the backoff.
    Internal,
    /// The hello was signed for a gateway name this gateway does not answer to (the agent
    /// dialled another host, or a relay sits between them). Close code 4009, `wrong_gateway`.
    WrongGateway,
}

impl RefusalReason {
    /// Every reason, in close-code order.
    pub const ALL: [Self; 9] = [
        Self::UnknownKey,
        Self::BadSignature,
        Self::StaleChallenge,
        Self::UnsupportedProtocol,
        Self::MalformedHandshake,
        Self::HandshakeTimeout,
        Self::DuplicateSession,
        Self::Internal,
        Self::WrongGateway,
    ];

    /// The stable snake_case reason code, sent as the WebSocket close reason.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::UnknownKey => "unknown_key",
            Self::BadSignature => "bad_signature",
            Self::StaleChallenge => "stale_challenge",
            Self::UnsupportedProtocol => "unsupported_protocol",
            Self::MalformedHandshake => "malformed_handshake",
            Self::HandshakeTimeout => "handshake_timeout",
            Self::DuplicateSession => "duplicate_session",
            Self::Internal => "internal_error",
            Self::WrongGateway => "wrong_gateway",
        }
    }

    /// The WebSocket close code, `4000 + n` (4001 ..= 4009).
    pub fn close_code(&self) -> u16 {
        match self {
            Self::UnknownKey => 4001,
            Self::BadSignature => 4002,
            Self::StaleChallenge => 4003,
            Self::UnsupportedProtocol => 4004,
            Self::MalformedHandshake => 4005,
            Self::HandshakeTimeout => 4006,
            Self::DuplicateSession => 4007,
            Self::Internal => 4008,
            Self::WrongGateway => 4009,
        }
    }

    /// The reason for a close code; `None` for codes that are not refusals.
    pub fn from_close_code(code: u16) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.close_code() == code)
    }

    /// Parses a reason code (`unknown_key`, …); `None` for anything else.
    pub fn parse(code: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == code)
    }
}

impl fmt::Display for RefusalReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests;
