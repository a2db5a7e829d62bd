//! [`ClusterConfig`]: one instance's multi-instance settings.

use std::net::SocketAddr;

use serde::Deserialize;

/// Multi-instance settings of one gateway instance (design brief §8).
///
/// Deserializes from a table with the field names below (every key optional: the missing ones
/// take the [`Default`] values). Build it with [`ClusterConfig::new`] and set the public
/// fields.
///
/// `Debug` leaves out `redis_url` (it may carry a password) and `secret`.
#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct ClusterConfig {
    /// Redis URL (`redis://host:port[/db]`); default `redis://127.0.0.1:6379`.
    pub redis_url: String,
    /// This instance's name in Redis; default [`ClusterConfig::generated_instance_id`].
    /// Letters, digits, `.`, `_` and `-` only, 1 to 64 of them (the application checks).
    pub instance_id: String,
    /// Every Redis key this instance reads or writes starts with it; default `spine:`.
    pub key_prefix: String,
    /// The internal HTTP/2 listener other instances forward requests to; default
    /// `127.0.0.1:0`. The application binds it.
    pub internal_listen: SocketAddr,
    /// `host:port` other instances dial for the internal listener; default (`None`) its bound
    /// address.
    pub internal_advertise: Option<String>,
    /// Shared secret that authenticates forwarding between instances (keys the HMAC-SHA256 of
    /// every forwarded request; it never travels). Every instance must have the same one; at
    /// least 16 bytes is advisable. Default empty: set it.
    pub secret: String,
}

impl ClusterConfig {
    /// The settings with `redis_url` and `secret`, the rest [`Default`].
    pub fn new(redis_url: impl Into<String>, secret: impl Into<String>) -> Self {
        Self {
            redis_url: redis_url.into(),
            secret: secret.into(),
            ..Self::default()
        }
    }

    /// A fresh instance id: `gw-` and 8 random hex digits (time-derived on an OS without a
    /// random source; it only names the instance).
    pub fn generated_instance_id() -> String {
        let mut bytes = [0u8; 4];
        if getrandom::fill(&mut bytes).is_err() {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or_default();
            bytes = nanos.to_le_bytes();
        }
        format!("gw-{}", hex::encode(bytes))
    }

    /// Checks what an instance cannot run with: a `secret` of at least 16 bytes, an
    /// `instance_id` of 1 to 64 letters, digits, `.`, `_` or `-`, and an advertised internal
    /// address (`internal_advertise`, else `internal_listen`) that is not unspecified
    /// (`0.0.0.0` or `::`: peers would dial themselves).
    ///
    /// # Errors
    ///
    /// [`ClusterConfigError`] naming the setting (in a gateway's configuration terms).
    pub fn validate(&self) -> Result<(), ClusterConfigError> {
        if self.secret.len() < 16 {
            return Err(ClusterConfigError(
                "redis_url is set (multi-instance mode): cluster_secret must be set, at \
                 least 16 bytes",
            ));
        }
        let id_ok = !self.instance_id.is_empty()
            && self.instance_id.len() <= 64
            && self
                .instance_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !id_ok {
            return Err(ClusterConfigError(
                "instance_id: 1 to 64 letters, digits, '.', '_' or '-'",
            ));
        }
        // peers dial the advertised address: 0.0.0.0 / :: would make them dial themselves
        let advertised_ip = match &self.internal_advertise {
            Some(a) => a.parse::<SocketAddr>().ok().map(|a| a.ip()),
            None => Some(self.internal_listen.ip()),
        };
        if advertised_ip.is_some_and(|ip| ip.is_unspecified()) {
            return Err(ClusterConfigError(
                "internal_advertise: other instances cannot dial an unspecified address                  (0.0.0.0 or ::); with internal_listen on one, set internal_advertise to this                  instance's reachable host:port",
            ));
        }
        Ok(())
    }
}

/// Settings an instance cannot run with ([`ClusterConfig::validate`]); the message names the
/// setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ClusterConfigError(&'static str);

impl Default for ClusterConfig {
    /// Redis at `redis://127.0.0.1:6379`, a generated instance id, prefix `spine:`, internal
    /// listener on `127.0.0.1:0` advertised at its bound address, and an empty secret.
    fn default() -> Self {
        Self {
            redis_url: "redis://127.0.0.1:6379".to_owned(),
            instance_id: Self::generated_instance_id(),
            key_prefix: "spine:".to_owned(),
            internal_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            internal_advertise: None,
            secret: String::new(),
        }
    }
}

impl std::fmt::Debug for ClusterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // the URL may carry a password, the secret is one
        f.debug_struct("ClusterConfig")
            .field("instance_id", &self.instance_id)
            .field("key_prefix", &self.key_prefix)
            .field("internal_listen", &self.internal_listen)
            .field("internal_advertise", &self.internal_advertise)
            .finish_non_exhaustive()
    }
}
