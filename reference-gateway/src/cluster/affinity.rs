//! Conversation affinity in Redis: `P aff:<model>:<key digest>` → node id, TTL
//! `affinity_ttl_secs` from the last use, shared by every instance.

use spine_core::{ModelId, NodeId};
use spine_router::{AffinityFuture, AffinityKey, AffinityStore};

use super::Cluster;

/// An [`AffinityStore`] over the instance's shared Redis connection; each call is bounded by
/// [`super::REDIS_TIMEOUT`] and a failure makes the router use its in-memory table.
#[derive(Debug, Clone)]
pub(crate) struct RedisAffinity {
    cluster: Cluster,
    ttl_secs: u64,
}

impl RedisAffinity {
    pub(crate) fn new(cluster: Cluster, ttl_secs: u64) -> Self {
        Self { cluster, ttl_secs }
    }

    fn key(&self, model: &ModelId, key: &AffinityKey) -> String {
        self.cluster.key(&format!(
            "aff:{}:{:016x}",
            model.as_str(),
            key.digest(model)
        ))
    }
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
