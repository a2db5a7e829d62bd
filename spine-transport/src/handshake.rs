//! The tunnel handshake's messages and their signature (design brief §4).
//!
//! After the WebSocket upgrade, three JSON text messages:
//!
//! ```text
//! gateway → agent  {"type":"challenge","nonce":"<64 hex>","gateway_id":"gw-1","issued_at_ms":1700000000000,"protocol_version":2}
//! agent → gateway  {"type":"hello","public_key":"ed25519:…","signature":"<base64>","gateway_name":"gw.example.com","protocol_version":2,"descriptor":{…}}
//! gateway → agent  {"type":"accepted","node_id":"node_1"}
//! ```
//!
//! or, instead of `accepted`, a WebSocket close with code `4000 + n` and a snake_case reason
//! ([`RefusalReason`]). The agent signs [`signing_bytes`]; nothing secret crosses the wire, and
//! because the gateway verifies against the nonce it generated itself for this connection, a
//! recorded hello cannot be replayed on another connection.
//!
//! The signature also covers `gateway_name`, the host the agent dialled (its gateway URL's host,
//! lowercase, without port or brackets; the TLS server name for `wss://`). A gateway accepts
//! only names it answers to (its configured public names) and refuses any other with
//! `wrong_gateway`: a rogue gateway that relays the real gateway's challenge to an agent that
//! dialled the rogue gets a hello signed for the rogue's name, useless at the real gateway.
//! Version 1 hellos (no name) are refused `unsupported_protocol`.

use base64::Engine as _;
use ed25519_dalek::{Signature, VerifyingKey};
use serde::{Deserialize, Serialize};
use spine_core::{NodeDescriptor, NodeId};

use crate::identity::parse_public_key_text;
use crate::{NodeIdentity, RefusalReason, PROTOCOL_VERSION};

/// Domain-separation tag at the start of every signed handshake byte string.
pub const SIGNATURE_CONTEXT: &[u8] = b"spine-tunnel-v2";

/// Bytes of random nonce in a challenge (sent as 64 lowercase hex digits).
pub const NONCE_BYTES: usize = 32;

/// The gateway's challenge, first message after the upgrade.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Challenge {
    /// [`NONCE_BYTES`] random bytes, lowercase hex.
    pub nonce: String,
    /// The gateway (instance) that issued the challenge.
    pub gateway_id: String,
    /// When it was issued, milliseconds since the Unix epoch (informative; the gateway judges
    /// staleness on its own monotonic clock).
    pub issued_at_ms: u64,
    /// The gateway's protocol version ([`PROTOCOL_VERSION`]).
    pub protocol_version: u32,
}

impl Challenge {
    /// A fresh challenge with a random nonce from the operating system.
    ///
    /// # Errors
    ///
    /// When the random number generator fails.
    pub fn generate(gateway_id: &str, issued_at_ms: u64) -> Result<Self, getrandom::Error> {
        let mut nonce = [0u8; NONCE_BYTES];
        getrandom::fill(&mut nonce)?;
        Ok(Self {
            nonce: hex::encode(nonce),
            gateway_id: gateway_id.to_owned(),
            issued_at_ms,
            protocol_version: PROTOCOL_VERSION,
        })
    }
}

/// The agent's answer to a [`Challenge`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Hello {
    /// The node's public key in canonical text form ([`crate::public_key_text`]).
    pub public_key: String,
    /// Standard base64 (with padding) of the 64-byte ed25519 signature over
    /// [`signing_bytes`]`(challenge, gateway_name, protocol_version)`.
    pub signature: String,
    /// The gateway host the agent dialled ([`gateway_name`]), covered by the signature.
    pub gateway_name: String,
    /// The protocol version the agent speaks.
    pub protocol_version: u32,
    /// What the node says about itself; untrusted.
    pub descriptor: NodeDescriptor,
}

impl Hello {
    /// Answers `challenge` as `identity`, for the gateway the agent dialled as `gateway_host`
    /// (normalised by [`gateway_name`]), speaking [`PROTOCOL_VERSION`].
    pub fn sign(
        identity: &NodeIdentity,
        challenge: &Challenge,
        gateway_host: &str,
        descriptor: NodeDescriptor,
    ) -> Self {
        let name = gateway_name(gateway_host);
        let signature = identity.sign(&signing_bytes(challenge, &name, PROTOCOL_VERSION));
        Self {
            public_key: identity.public_key_text(),
            signature: base64::engine::general_purpose::STANDARD.encode(signature.to_bytes()),
            gateway_name: name,
            protocol_version: PROTOCOL_VERSION,
            descriptor,
        }
    }

    /// Checks the signature against `challenge` (the one the gateway itself sent) and returns the
    /// verified public key.
    ///
    /// # Errors
    ///
    /// [`RefusalReason::UnsupportedProtocol`] for a version other than [`PROTOCOL_VERSION`],
    /// [`RefusalReason::MalformedHandshake`] when the key or the signature is not well-formed,
    /// [`RefusalReason::BadSignature`] when the signature does not verify (strict RFC 8032
    /// verification, rejecting malleable signatures and weak keys).
    pub fn verify(&self, challenge: &Challenge) -> Result<VerifyingKey, RefusalReason> {
        if self.protocol_version != PROTOCOL_VERSION {
            return Err(RefusalReason::UnsupportedProtocol);
        }
        let key = parse_public_key_text(&self.public_key)
            .map_err(|_| RefusalReason::MalformedHandshake)?;
        let sig = base64::engine::general_purpose::STANDARD
            .decode(&self.signature)
            .map_err(|_| RefusalReason::MalformedHandshake)?;
        let sig = Signature::from_slice(&sig).map_err(|_| RefusalReason::MalformedHandshake)?;
        key.verify_strict(
            &signing_bytes(challenge, &self.gateway_name, self.protocol_version),
            &sig,
        )
        .map_err(|_| RefusalReason::BadSignature)?;
        Ok(key)
    }
}

/// The gateway's acceptance, last handshake message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Accepted {
    /// The node id the gateway knows this key as.
    pub node_id: NodeId,
}

/// A handshake message from the gateway.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum GatewayMessage {
    /// The challenge.
    Challenge(Challenge),
    /// The acceptance.
    Accepted(Accepted),
}

/// A handshake message from the agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum AgentMessage {
    /// The hello.
    Hello(Hello),
}

/// The canonical form of a gateway host for [`Hello::gateway_name`]: ASCII lowercase, IPv6
/// brackets and any trailing dot removed (`[::1]` → `::1`, `GW.Example.com.` → `gw.example.com`).
pub fn gateway_name(host: &str) -> String {
    let host = host.trim();
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// The canonical byte string the agent signs.
///
/// ```text
/// "spine-tunnel-v2" 0x00
/// u32 BE length ‖ nonce (the hex text, as sent)
/// u32 BE length ‖ gateway_id (UTF-8)
/// u32 BE length ‖ gateway_name (UTF-8, as in the hello)
/// u64 BE issued_at_ms
/// u32 BE protocol_version (the agent's, as in its hello)
/// ```
///
/// Length prefixes make the encoding unambiguous whatever the fields contain.
pub fn signing_bytes(challenge: &Challenge, gateway_name: &str, protocol_version: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        SIGNATURE_CONTEXT.len()
            + 1
            + 4
            + challenge.nonce.len()
            + 4
            + challenge.gateway_id.len()
            + 4
            + gateway_name.len()
            + 12,
    );
    out.extend_from_slice(SIGNATURE_CONTEXT);
    out.push(0);
    for field in [
        challenge.nonce.as_bytes(),
        challenge.gateway_id.as_bytes(),
        gateway_name.as_bytes(),
    ] {
        // Fields longer than 4 GiB cannot arrive in a bounded WebSocket message.
        let len = u32::try_from(field.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(field);
    }
    out.extend_from_slice(&challenge.issued_at_ms.to_be_bytes());
    out.extend_from_slice(&protocol_version.to_be_bytes());
    out
}

#[derive(Deserialize)]
struct Envelope {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    protocol_version: Option<u32>,
}

/// Decodes the agent's hello from the bytes of a WebSocket text message.
///
/// The protocol version is read first, so a future agent whose hello no longer parses as
/// version 1 is told `unsupported_protocol`, not `malformed_handshake`. Never panics on any
/// input (fuzz target).
///
/// # Errors
///
/// [`RefusalReason::MalformedHandshake`] when the bytes are not a JSON `hello` object with the
/// fields of [`Hello`]; [`RefusalReason::UnsupportedProtocol`] when `protocol_version` is not
/// [`PROTOCOL_VERSION`].
pub fn decode_hello(bytes: &[u8]) -> Result<Hello, RefusalReason> {
    let envelope: Envelope =
        serde_json::from_slice(bytes).map_err(|_| RefusalReason::MalformedHandshake)?;
    if envelope.kind != "hello" {
        return Err(RefusalReason::MalformedHandshake);
    }
    match envelope.protocol_version {
        Some(PROTOCOL_VERSION) => {}
        Some(_) => return Err(RefusalReason::UnsupportedProtocol),
        None => return Err(RefusalReason::MalformedHandshake),
    }
    match serde_json::from_slice(bytes) {
        Ok(AgentMessage::Hello(hello)) => Ok(hello),
        Err(_) => Err(RefusalReason::MalformedHandshake),
    }
}

/// Decodes a gateway handshake message from the bytes of a WebSocket text message.
///
/// # Errors
///
/// When the bytes are not a JSON `challenge` or `accepted` message.
pub fn decode_gateway_message(bytes: &[u8]) -> Result<GatewayMessage, serde_json::Error> {
    serde_json::from_slice(bytes)
}

#[cfg(test)]
mod tests;
