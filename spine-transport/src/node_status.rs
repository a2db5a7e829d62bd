//! A node's signed request for its own status (design brief §7: `GET /v1/node/status` on the
//! tunnel listener), authenticated by the node's ed25519 key rather than an admin token.
//!
//! The node sends three headers: [`X_SPINE_NODE_KEY`] (its public key text, `ed25519:<base64url>`),
//! [`X_SPINE_TIMESTAMP_MS`] (now, Unix ms) and [`X_SPINE_SIGNATURE`] (base64url ed25519 signature
//! over [`status_signing_message`]). The gateway accepts a timestamp within
//! ±[`STATUS_SIGNATURE_WINDOW_MS`] of its clock. The request is read-only, so a replay inside
//! the window discloses only what the node itself may read.
//!
//! [`status_headers`] makes the headers (the agent); [`verify_status_headers`] checks them (the
//! gateway).

use base64::Engine as _;
use http::HeaderMap;

use crate::{parse_public_key_text, public_key_text, NodeIdentity};

/// Header carrying the node's public key text (`ed25519:<base64url>`).
pub const X_SPINE_NODE_KEY: &str = "x-spine-node-key";
/// Header carrying the signing time, Unix milliseconds.
pub const X_SPINE_TIMESTAMP_MS: &str = "x-spine-timestamp-ms";
/// Header carrying the base64url (no padding) ed25519 signature.
pub const X_SPINE_SIGNATURE: &str = "x-spine-signature";
/// How far a status request's timestamp may be from the verifier's clock, ms (either way).
pub const STATUS_SIGNATURE_WINDOW_MS: i64 = 60_000;

/// The bytes a node signs for a status request:
/// `spine-node-status/v1\n<timestamp_ms>\n<public key text>`.
pub fn status_signing_message(timestamp_ms: i64, public_key_text: &str) -> String {
    format!("spine-node-status/v1\n{timestamp_ms}\n{public_key_text}")
}

/// The three headers that authenticate a status request signed by `identity` at
/// `timestamp_ms` (Unix ms): [`X_SPINE_NODE_KEY`], [`X_SPINE_TIMESTAMP_MS`],
/// [`X_SPINE_SIGNATURE`], in that order.
pub fn status_headers(identity: &NodeIdentity, timestamp_ms: i64) -> [(&'static str, String); 3] {
    let key = identity.public_key_text();
    let signature = identity.sign(status_signing_message(timestamp_ms, &key).as_bytes());
    [
        (X_SPINE_NODE_KEY, key),
        (X_SPINE_TIMESTAMP_MS, timestamp_ms.to_string()),
        (
            X_SPINE_SIGNATURE,
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(signature.to_bytes()),
        ),
    ]
}

/// Why a status request's signature headers were refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NodeSignatureError {
    /// A header is missing or not text.
    #[error("send x-spine-node-key, x-spine-timestamp-ms and x-spine-signature")]
    MissingHeader,
    /// The timestamp is not an integer.
    #[error("x-spine-timestamp-ms must be Unix milliseconds")]
    BadTimestamp,
    /// The timestamp is more than [`STATUS_SIGNATURE_WINDOW_MS`] from the verifier's clock.
    #[error(
        "the signed timestamp is more than 60 s from the gateway's clock; check the node's clock"
    )]
    Stale,
    /// The key header does not parse as a public key.
    #[error("x-spine-node-key is not a key")]
    BadKey,
    /// The signature header is not base64url.
    #[error("x-spine-signature is not base64url")]
    BadEncoding,
    /// The signature header does not decode to an ed25519 signature.
    #[error("x-spine-signature is not a signature")]
    BadSignatureBytes,
    /// The signature does not verify for the key and message.
    #[error("the signature does not verify")]
    DoesNotVerify,
}

impl NodeSignatureError {
    /// The error code: `stale_node_signature` for [`NodeSignatureError::Stale`], else
    /// `invalid_node_signature`.
    pub fn code(self) -> &'static str {
        match self {
            NodeSignatureError::Stale => "stale_node_signature",
            _ => "invalid_node_signature",
        }
    }
}

/// The bytes a node signs to enroll with an enrollment token:
/// `spine-enroll/v1\n<public key text>\n<token>` (the token trimmed). The signature proves the
/// enrolling party holds the key's private half, so whoever holds a token cannot register
/// another node's public key under the token's operator (and be credited for that node's work
/// once it connects). The token is single-use, so a signature seen once cannot be reused.
pub fn enrollment_signing_message(public_key_text: &str, token: &str) -> String {
    format!("spine-enroll/v1\n{public_key_text}\n{}", token.trim())
}

/// The enrollment's `proof`: the base64url (no padding) ed25519 signature by `identity` over
/// [`enrollment_signing_message`] for `token`.
pub fn enrollment_proof(identity: &NodeIdentity, token: &str) -> String {
    let message = enrollment_signing_message(&identity.public_key_text(), token);
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(identity.sign(message.as_bytes()).to_bytes())
}

/// Checks an enrollment's `proof` for the public key `key_text` and `token`; returns the key
/// text in its canonical form.
///
/// # Errors
///
/// [`NodeSignatureError`]: the key or the proof malformed, or a proof that does not verify
/// (strict ed25519 verification).
pub fn verify_enrollment_proof(
    key_text: &str,
    token: &str,
    proof: &str,
) -> Result<String, NodeSignatureError> {
    let key = parse_public_key_text(key_text.trim()).map_err(|_| NodeSignatureError::BadKey)?;
    let sig_bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(proof.trim())
        .map_err(|_| NodeSignatureError::BadEncoding)?;
    let sig = ed25519_dalek::Signature::from_slice(&sig_bytes)
        .map_err(|_| NodeSignatureError::BadSignatureBytes)?;
    let text = public_key_text(&key);
    key.verify_strict(enrollment_signing_message(&text, token).as_bytes(), &sig)
        .map_err(|_| NodeSignatureError::DoesNotVerify)?;
    Ok(text)
}

/// Checks a status request's signature headers at `now_ms` (Unix ms); returns the node's
/// public key text in its canonical form.
///
/// # Errors
///
/// [`NodeSignatureError`]: a header missing or malformed, a timestamp outside the window, or a
/// signature that does not verify (strict ed25519 verification).
pub fn verify_status_headers(
    headers: &HeaderMap,
    now_ms: i64,
) -> Result<String, NodeSignatureError> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .ok_or(NodeSignatureError::MissingHeader)
    };
    let key_text = header(X_SPINE_NODE_KEY)?;
    let timestamp_ms: i64 = header(X_SPINE_TIMESTAMP_MS)?
        .parse()
        .map_err(|_| NodeSignatureError::BadTimestamp)?;
    let signature = header(X_SPINE_SIGNATURE)?;
    if now_ms.abs_diff(timestamp_ms) > STATUS_SIGNATURE_WINDOW_MS.unsigned_abs() {
        return Err(NodeSignatureError::Stale);
    }
    let key = parse_public_key_text(key_text).map_err(|_| NodeSignatureError::BadKey)?;
    let sig_bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(signature)
        .map_err(|_| NodeSignatureError::BadEncoding)?;
    let sig = ed25519_dalek::Signature::from_slice(&sig_bytes)
        .map_err(|_| NodeSignatureError::BadSignatureBytes)?;
    let text = public_key_text(&key);
    key.verify_strict(status_signing_message(timestamp_ms, &text).as_bytes(), &sig)
        .map_err(|_| NodeSignatureError::DoesNotVerify)?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn header_map(headers: &[(&'static str, String)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.insert(*name, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn status_headers_sign_the_documented_message() {
        let id = NodeIdentity::generate().unwrap();
        let h = status_headers(&id, 1_700_000_000_123);
        assert_eq!(h[0], ("x-spine-node-key", id.public_key_text()));
        assert_eq!(h[1], ("x-spine-timestamp-ms", "1700000000123".to_owned()));
        let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(&h[2].1)
            .unwrap();
        let sig = ed25519_dalek::Signature::from_slice(&sig).unwrap();
        id.verifying_key()
            .verify_strict(
                format!(
                    "spine-node-status/v1\n1700000000123\n{}",
                    id.public_key_text()
                )
                .as_bytes(),
                &sig,
            )
            .unwrap();
    }

    fn signed(identity: &NodeIdentity, ts: i64) -> HeaderMap {
        header_map(&status_headers(identity, ts))
    }

    #[test]
    fn status_signatures_verify_only_fresh_and_own() {
        let id = NodeIdentity::generate().unwrap();
        let now = 1_800_000_000_000;
        assert_eq!(
            verify_status_headers(&signed(&id, now - 59_000), now).unwrap(),
            id.public_key_text()
        );
        let stale = verify_status_headers(&signed(&id, now - 61_000), now).unwrap_err();
        assert_eq!(
            (stale, stale.code()),
            (NodeSignatureError::Stale, "stale_node_signature")
        );
        let future = verify_status_headers(&signed(&id, now + 61_000), now).unwrap_err();
        assert_eq!(future.code(), "stale_node_signature");
        // another key's signature under this key
        let other = NodeIdentity::generate().unwrap();
        let mut h = signed(&other, now);
        h.insert(X_SPINE_NODE_KEY, id.public_key_text().parse().unwrap());
        assert_eq!(
            verify_status_headers(&h, now),
            Err(NodeSignatureError::DoesNotVerify)
        );
        // a signed timestamp moved
        let mut h = signed(&id, now);
        h.insert(X_SPINE_TIMESTAMP_MS, (now + 1).to_string().parse().unwrap());
        assert_eq!(
            verify_status_headers(&h, now),
            Err(NodeSignatureError::DoesNotVerify)
        );
        for missing in [X_SPINE_NODE_KEY, X_SPINE_TIMESTAMP_MS, X_SPINE_SIGNATURE] {
            let mut h = signed(&id, now);
            h.remove(missing);
            assert_eq!(
                verify_status_headers(&h, now),
                Err(NodeSignatureError::MissingHeader),
                "{missing}"
            );
        }
        let mut h = signed(&id, now);
        h.insert(X_SPINE_TIMESTAMP_MS, "soon".parse().unwrap());
        assert_eq!(
            verify_status_headers(&h, now),
            Err(NodeSignatureError::BadTimestamp)
        );
        let mut h = signed(&id, now);
        h.insert(X_SPINE_NODE_KEY, "ed25519:nope".parse().unwrap());
        assert_eq!(
            verify_status_headers(&h, now),
            Err(NodeSignatureError::BadKey)
        );
        let mut h = signed(&id, now);
        h.insert(X_SPINE_SIGNATURE, "!!".parse().unwrap());
        let err = verify_status_headers(&h, now).unwrap_err();
        assert_eq!(
            (err, err.code()),
            (NodeSignatureError::BadEncoding, "invalid_node_signature")
        );
        let mut h = signed(&id, now);
        h.insert(X_SPINE_SIGNATURE, "AAAA".parse().unwrap());
        assert_eq!(
            verify_status_headers(&h, now),
            Err(NodeSignatureError::BadSignatureBytes)
        );
    }

    proptest::proptest! {
        /// Arbitrary header values are refused, never a panic.
        #[test]
        fn any_status_headers_are_refused_not_panicking(
            key in "[ -~]{0,80}",
            ts in "[ -~]{0,24}",
            sig in "[ -~]{0,120}",
            now in proptest::num::i64::ANY,
        ) {
            let mut h = HeaderMap::new();
            for (name, v) in [(X_SPINE_NODE_KEY, &key), (X_SPINE_TIMESTAMP_MS, &ts), (X_SPINE_SIGNATURE, &sig)] {
                if let Ok(v) = http::HeaderValue::from_str(v) {
                    h.insert(name, v);
                }
            }
            proptest::prop_assert!(verify_status_headers(&h, now).is_err());
        }
    }

    /// A proof verifies for its own key and token only: not for another key (the squatting
    /// it exists to stop), not for another token, and not when altered.
    #[test]
    fn enrollment_proofs_bind_the_key_and_the_token() {
        let own = NodeIdentity::from_seed(&[7; 32]);
        let other = NodeIdentity::from_seed(&[8; 32]);
        let proof = enrollment_proof(&own, " spine-enroll-abc ");
        assert_eq!(
            verify_enrollment_proof(&own.public_key_text(), "spine-enroll-abc", &proof).unwrap(),
            own.public_key_text()
        );
        assert_eq!(
            verify_enrollment_proof(&other.public_key_text(), "spine-enroll-abc", &proof),
            Err(NodeSignatureError::DoesNotVerify)
        );
        assert_eq!(
            verify_enrollment_proof(&own.public_key_text(), "spine-enroll-abd", &proof),
            Err(NodeSignatureError::DoesNotVerify)
        );
        let mut altered = proof.into_bytes();
        altered[3] = if altered[3] == b'A' { b'B' } else { b'A' };
        let altered = String::from_utf8(altered).unwrap();
        assert!(
            verify_enrollment_proof(&own.public_key_text(), "spine-enroll-abc", &altered).is_err()
        );
        assert_eq!(
            verify_enrollment_proof(&own.public_key_text(), "spine-enroll-abc", "!!"),
            Err(NodeSignatureError::BadEncoding)
        );
        assert_eq!(
            verify_enrollment_proof("ed25519:short", "spine-enroll-abc", "AAAA"),
            Err(NodeSignatureError::BadKey)
        );
    }
}
