//! Conversation affinity in Redis: `P aff:<model>:<key digest>` → node id, TTL
//! `affinity_ttl_secs` from the last use, shared by every instance. The digest is the first 128
//! bits of SHA-256 over the key's kind and value, hex: the same on every instance whatever its
//! build (a `std` hasher's output may change between Rust releases), and not steerable by a
//! caller choosing a `prompt_cache_key` that collides with another conversation's.

use crate::{AffinityFuture, AffinityKey, AffinityStore};
use spine_core::{ModelId, NodeId};

use super::Cluster;

/// An [`AffinityStore`] over the instance's shared Redis connection; each call is bounded by
/// [`super::REDIS_TIMEOUT`] and a failure makes the router use its in-memory table. Give it to
/// [`RouteLayer::affinity_store`](crate::RouteLayer::affinity_store).
#[derive(Debug, Clone)]
pub struct RedisAffinity {
    cluster: Cluster,
    ttl_secs: u64,
}

impl RedisAffinity {
    /// Affinity entries under `cluster`'s key prefix, each kept `ttl_secs` (at least 1) from
    /// its last use.
    pub fn new(cluster: Cluster, ttl_secs: u64) -> Self {
        Self { cluster, ttl_secs }
    }

    fn key(&self, model: &ModelId, key: &AffinityKey) -> String {
        self.cluster
            .key(&format!("aff:{}:{}", model.as_str(), stable_digest(key)))
    }
}

/// SHA-256 of `<kind>\0<value>`, first 16 bytes as hex.
fn stable_digest(key: &AffinityKey) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    match key {
        AffinityKey::PromptCacheKey(k) => {
            h.update(b"prompt_cache_key\0");
            h.update(k.as_bytes());
        }
        AffinityKey::SessionId(k) => {
            h.update(b"session_id\0");
            h.update(k.as_bytes());
        }
        AffinityKey::Conversation(k) => {
            h.update(b"conversation\0");
            h.update(k.to_le_bytes());
        }
    }
    hex::encode(&h.finalize()[..16])
}

impl AffinityStore for RedisAffinity {
    fn get<'a>(
        &'a self,
        model: &'a ModelId,
        key: &'a AffinityKey,
    ) -> AffinityFuture<'a, Option<NodeId>> {
        Box::pin(async move {
            if self.cluster.redis_down() {
                // no request waits on a Redis known to be down: the local table answers
                return Err("redis is down".into());
            }
            let node: Option<String> = self
                .cluster
                .redis("affinity_get", redis::cmd("GET").arg(self.key(model, key)))
                .await?;
            Ok(node.map(NodeId::new))
        })
    }

    fn set<'a>(
        &'a self,
        model: &'a ModelId,
        key: &'a AffinityKey,
        node: &'a NodeId,
    ) -> AffinityFuture<'a, ()> {
        Box::pin(async move {
            if self.cluster.redis_down() {
                return Err("redis is down".into());
            }
            self.cluster
                .redis::<()>(
                    "affinity_set",
                    redis::cmd("SET")
                        .arg(self.key(model, key))
                        .arg(node.as_str())
                        .arg("EX")
                        .arg(self.ttl_secs.max(1)),
                )
                .await?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_sha256_of_kind_and_value() {
        // python3: hashlib.sha256(b"prompt_cache_key\0abc").hexdigest()[:32]
        let k = AffinityKey::PromptCacheKey("abc".into());
        assert_eq!(stable_digest(&k), PROMPT_ABC);
        let s = AffinityKey::SessionId("abc".into());
        assert_eq!(stable_digest(&s), SESSION_ABC);
        assert_ne!(
            stable_digest(&AffinityKey::Conversation(1)),
            stable_digest(&AffinityKey::Conversation(2))
        );
    }

    const PROMPT_ABC: &str = "b48c27fb2e82985501c80d0b0da94491";
    const SESSION_ABC: &str = "b5db767d787418120b382a78e3d51ffc";
}
