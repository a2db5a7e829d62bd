//! The internal hop's wire, shared by the forwarder that writes it ([`super::forward`]) and the
//! relay that reads it ([`super::internal`]): the `x-spine-*` header names, the HTTP/2 settings
//! both ends use, and the signed head of a forwarded request (see the
//! [`internal`](super::internal) module docs for what the signature covers and why).

use hmac::{Hmac, Mac};
use http::header::{HeaderName, HeaderValue};
use sha2::Sha256;
use std::time::Duration;

/// Header naming the target node on the internal hop.
pub const X_SPINE_NODE_ID: HeaderName = HeaderName::from_static("x-spine-node-id");
/// Header on an internal listener's refusal: `node_moved`, `node_full`, or the code of a refused
/// signature or body ([`super::internal::RelayRefusal::code`]).
pub const X_SPINE_REFUSAL: HeaderName = HeaderName::from_static("x-spine-refusal");
/// HTTP/2 PING interval on the internal hop (both ends), idle or not.
pub const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(1);
/// A PING unanswered for this long closes the connection: every stream on it fails, so an owner
/// that went silent without closing its sockets (stopped, partitioned) is noticed within
/// about [`KEEP_ALIVE_INTERVAL`] + [`KEEP_ALIVE_TIMEOUT`].
pub const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(3);
/// Most concurrent streams on one internal connection (one per peer instance), far above any
/// node's stream limit so forwarded requests never queue behind the connection.
pub const MAX_CONCURRENT_STREAMS: u32 = 4096;
/// HMAC-SHA256 keyed with the cluster secret; the keyed state is cloned for each message.
pub(crate) type ClusterMac = Hmac<Sha256>;

/// The `Authorization` scheme of a forwarded request.
pub const SIGNATURE_SCHEME: &str = "Spine-HMAC-SHA256";
/// First field of every signed message: a signature made for anything else never verifies here.
const SIGNATURE_DOMAIN: &[u8] = b"spine-cluster-forward-v1";
/// [`ClusterMac`] keyed with `secret`.
pub(crate) fn cluster_mac(secret: &[u8]) -> ClusterMac {
    // HMAC takes a key of any length (RFC 2104 §2: longer keys are hashed, shorter padded)
    #[allow(clippy::expect_used)]
    <ClusterMac as Mac>::new_from_slice(secret).expect("HMAC accepts keys of every length")
}

/// Milliseconds since the Unix epoch on this machine's clock (0 before 1970).
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The fields a forwarded request's signature covers (see the module docs).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SignedHead<'a> {
    /// The instance the request is meant for: the owner named by the directory.
    pub(crate) target: &'a str,
    /// When it was signed, milliseconds since the Unix epoch.
    pub(crate) t_unix_ms: u64,
    /// 128 random bits, never reused.
    pub(crate) nonce: [u8; 16],
    pub(crate) method: &'a str,
    pub(crate) path_and_query: &'a str,
    /// The `x-spine-node-id` value.
    pub(crate) node: &'a [u8],
    /// SHA-256 of the whole request body.
    pub(crate) body_sha256: [u8; 32],
}

impl SignedHead<'_> {
    pub(super) fn mac(&self, key: &ClusterMac) -> ClusterMac {
        let mut mac = key.clone();
        let t = self.t_unix_ms.to_be_bytes();
        for field in [
            SIGNATURE_DOMAIN,
            self.target.as_bytes(),
            &t,
            &self.nonce,
            self.method.as_bytes(),
            self.path_and_query.as_bytes(),
            self.node,
            &self.body_sha256,
        ] {
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field);
        }
        mac
    }

    /// The `Authorization` value signing this head with `key`.
    ///
    /// # Errors
    ///
    /// The target instance id holds characters a header value cannot (it comes from Redis).
    pub(crate) fn authorization(
        &self,
        key: &ClusterMac,
    ) -> Result<HeaderValue, http::header::InvalidHeaderValue> {
        let sig = self.mac(key).finalize().into_bytes();
        let mut out = String::with_capacity(
            SIGNATURE_SCHEME.len() + self.target.len() + 2 * (16 + 32 + 32) + 48,
        );
        out.push_str(SIGNATURE_SCHEME);
        out.push_str(" v=1,i=");
        out.push_str(self.target);
        out.push_str(",t=");
        push_decimal(&mut out, self.t_unix_ms);
        out.push_str(",n=");
        push_hex(&mut out, &self.nonce);
        out.push_str(",b=");
        push_hex(&mut out, &self.body_sha256);
        out.push_str(",sig=");
        push_hex(&mut out, &sig);
        HeaderValue::try_from(out)
    }
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
}

fn push_decimal(out: &mut String, n: u64) {
    use std::fmt::Write as _;
    let _ = write!(out, "{n}");
}
