use std::fmt;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};

/// Prefix of the canonical text form of a node public key.
pub const PUBLIC_KEY_PREFIX: &str = "ed25519:";

/// The canonical text form of a node's public key: `ed25519:` followed by the 32 key bytes in
/// base64url without padding (RFC 4648 §5), 51 characters in all.
///
/// This is the form operators register with the gateway and the form the agent sends in its hello.
pub fn public_key_text(key: &VerifyingKey) -> String {
    let mut s = String::with_capacity(PUBLIC_KEY_PREFIX.len() + 43);
    s.push_str(PUBLIC_KEY_PREFIX);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode_string(key.as_bytes(), &mut s);
    s
}

/// Parses the canonical text form written by [`public_key_text`].
///
/// # Errors
///
/// [`IdentityError::MalformedPublicKey`] when the prefix, the encoding, the length or the point
/// itself is wrong.
pub fn parse_public_key_text(text: &str) -> Result<VerifyingKey, IdentityError> {
    let b64 = text
        .strip_prefix(PUBLIC_KEY_PREFIX)
        .ok_or(IdentityError::MalformedPublicKey)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(b64)
        .map_err(|_| IdentityError::MalformedPublicKey)?;
    let bytes: [u8; 32] = bytes
        .try_into()
        .map_err(|_| IdentityError::MalformedPublicKey)?;
    VerifyingKey::from_bytes(&bytes).map_err(|_| IdentityError::MalformedPublicKey)
}

/// Errors of node identities and public keys.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// Reading or writing the identity file failed.
    #[error("identity file {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The identity file does not hold a 32-byte seed in hex.
    #[error("identity file {} does not hold a 32-byte hex ed25519 seed", path.display())]
    MalformedFile {
        /// The file.
        path: PathBuf,
    },
    /// A public key is not in the canonical `ed25519:<base64url>` form.
    #[error("public key is not in the form ed25519:<base64url of 32 bytes>")]
    MalformedPublicKey,
    /// The operating system's random number generator failed.
    #[error("random number generator failed: {0}")]
    Random(getrandom::Error),
}

/// A node's ed25519 key pair: its identity towards the gateway (design brief §4).
///
/// The secret never leaves the node; only [`public_key_text`](Self::public_key_text) is
/// registered with the gateway. `Debug` shows the public key only.
#[derive(Clone)]
pub struct NodeIdentity {
    key: SigningKey,
}

impl NodeIdentity {
    /// Generates a new key pair from the operating system's random number generator.
    ///
    /// # Errors
    ///
    /// [`IdentityError::Random`] when the random number generator fails.
    pub fn generate() -> Result<Self, IdentityError> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(IdentityError::Random)?;
        Ok(Self::from_seed(&seed))
    }

    /// The key pair for a 32-byte ed25519 seed (RFC 8032 §5.1.5 secret key).
    pub fn from_seed(seed: &[u8; 32]) -> Self {
        Self {
            key: SigningKey::from_bytes(seed),
        }
    }

    /// Reads an identity file written by [`save`](Self::save): the 32-byte seed in hex
    /// (surrounding whitespace ignored).
    ///
    /// # Errors
    ///
    /// [`IdentityError::Io`] when the file cannot be read, [`IdentityError::MalformedFile`] when it
    /// does not hold 64 hex digits.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, IdentityError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| IdentityError::Io {
            path: path.to_owned(),
            source,
        })?;
        let malformed = || IdentityError::MalformedFile {
            path: path.to_owned(),
        };
        let bytes = hex::decode(text.trim()).map_err(|_| malformed())?;
        let seed: [u8; 32] = bytes.try_into().map_err(|_| malformed())?;
        Ok(Self::from_seed(&seed))
    }

    /// Writes the seed in hex to a new file, readable by its owner only (mode 0600 on Unix).
    ///
    /// Refuses to overwrite an existing file: losing a registered identity means registering the
    /// node again.
    ///
    /// # Errors
    ///
    /// [`IdentityError::Io`] when the file exists or cannot be written.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), IdentityError> {
        let path = path.as_ref();
        let io_err = |source| IdentityError::Io {
            path: path.to_owned(),
            source,
        };
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt as _;
            options.mode(0o600);
        }
        let mut file = options.open(path).map_err(io_err)?;
        let mut text = hex::encode(self.key.to_bytes());
        text.push('\n');
        file.write_all(text.as_bytes()).map_err(io_err)?;
        file.sync_all().map_err(io_err)
    }

    /// The public half.
    pub fn verifying_key(&self) -> VerifyingKey {
        self.key.verifying_key()
    }

    /// The canonical text form of the public key (see [`public_key_text`]).
    pub fn public_key_text(&self) -> String {
        public_key_text(&self.key.verifying_key())
    }

    /// Signs `message` (ed25519, RFC 8032).
    pub fn sign(&self, message: &[u8]) -> Signature {
        self.key.sign(message)
    }
}

impl fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeIdentity")
            .field("public_key", &self.public_key_text())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
