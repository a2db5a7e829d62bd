//! The node directory in Redis: `P node:<id>` → `<owner instance> <descriptor JSON>` with a TTL,
//! indexed in the set `P nodes`; written only by the owner, read by every instance.

use std::collections::{HashMap, HashSet};
use std::sync::LazyLock;

use spine_core::{NodeDescriptor, NodeId};
use tokio::time::Instant;

use super::{lock, Cluster, RedisError, Remote, DIRECTORY_NODES, DIRECTORY_TTL, MAX_SYNC_NODES};
use super::{REMOTE_NODES, REMOTE_TTL};

/// Publishes an entry unconditionally: the node's tunnel is here now (a node that reconnected
/// belongs to the instance it reconnected to).
/// KEYS: entry, index. ARGV: value, ttl ms, node id.
static CLAIM: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
return 1
",
    )
});

/// Refreshes an entry only while this instance owns it (or it expired meanwhile); returns 0
/// when another instance owns it now.
/// KEYS: entry, index. ARGV: owner, value, ttl ms, node id.
static REFRESH: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"
local v = redis.call('GET', KEYS[1])
local mine = ARGV[1] .. ' '
if v == false or string.sub(v, 1, #mine) == mine then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  redis.call('SADD', KEYS[2], ARGV[4])
  return 1
end
return 0
",
    )
});

/// Deletes an entry only if this instance owns it; returns 1 when deleted.
/// KEYS: entry, index. ARGV: owner, node id.
static RELEASE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"
local v = redis.call('GET', KEYS[1])
local mine = ARGV[1] .. ' '
if v and string.sub(v, 1, #mine) == mine then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[2])
  return 1
end
return 0
",
    )
});

/// Reads up to ARGV[2] live entries whose owner's liveness key exists, as flat
/// `[node, owner, owner address, descriptor JSON, …]`; drops index members whose entry expired.
/// KEYS: index. ARGV: key prefix, limit.
static SYNC: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"
local ids = redis.call('SMEMBERS', KEYS[1])
local limit = tonumber(ARGV[2])
local out = {}
local alive = {}
local n = 0
for _, id in ipairs(ids) do
  if n >= limit then break end
  local v = redis.call('GET', ARGV[1] .. 'node:' .. id)
  if v == false then
    redis.call('SREM', KEYS[1], id)
  else
    local sp = string.find(v, ' ', 1, true)
    if sp then
      local owner = string.sub(v, 1, sp - 1)
      local addr = alive[owner]
      if addr == nil then
        addr = redis.call('GET', ARGV[1] .. 'instance:' .. owner)
        alive[owner] = addr
      end
      if addr then
        out[#out + 1] = id
        out[#out + 1] = owner
        out[#out + 1] = addr
        out[#out + 1] = string.sub(v, sp + 1)
        n = n + 1
      end
    end
  end
end
return out
",
    )
});

/// One directory entry read by a sync.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DirEntry {
    pub(crate) node: NodeId,
    pub(crate) owner: String,
    pub(crate) owner_addr: String,
    pub(crate) descriptor: NodeDescriptor,
}

impl Cluster {
    fn entry_key(&self, node: &NodeId) -> String {
        self.key(&format!("node:{}", node.as_str()))
    }

    fn entry_value(&self, descriptor: &NodeDescriptor) -> String {
        let json = serde_json::to_string(descriptor).unwrap_or_else(|_| "{}".to_owned());
        format!("{} {json}", self.inner.instance_id)
    }

    /// Publishes `node` as this instance's (its tunnel just became routable here).
    pub(crate) async fn claim(
        &self,
        node: &NodeId,
        descriptor: &NodeDescriptor,
    ) -> Result<(), RedisError> {
        let mut inv = CLAIM.prepare_invoke();
        inv.key(self.entry_key(node))
            .key(self.key("nodes"))
            .arg(self.entry_value(descriptor))
            .arg(DIRECTORY_TTL.as_millis() as u64)
            .arg(node.as_str());
        self.script::<i64>("directory_claim", &inv)
            .await
            .map(|_| ())
    }

    /// Refreshes `node`'s entry if this instance still owns it; `Ok(false)` when another
    /// instance does.
    pub(crate) async fn refresh(
        &self,
        node: &NodeId,
        descriptor: &NodeDescriptor,
    ) -> Result<bool, RedisError> {
        let mut inv = REFRESH.prepare_invoke();
        inv.key(self.entry_key(node))
            .key(self.key("nodes"))
            .arg(&self.inner.instance_id)
            .arg(self.entry_value(descriptor))
            .arg(DIRECTORY_TTL.as_millis() as u64)
            .arg(node.as_str());
        self.script::<i64>("directory_refresh", &inv)
            .await
            .map(|n| n == 1)
    }

    /// Removes `node`'s entry if this instance owns it; `Ok(true)` when removed.
    pub(crate) async fn release(&self, node: &NodeId) -> Result<bool, RedisError> {
        let mut inv = RELEASE.prepare_invoke();
        inv.key(self.entry_key(node))
            .key(self.key("nodes"))
            .arg(&self.inner.instance_id)
            .arg(node.as_str());
        self.script::<i64>("directory_release", &inv)
            .await
            .map(|n| n == 1)
    }

    /// Refreshes the entries of every node whose tunnel is here.
    pub(super) async fn refresh_local(&self) {
        let local: Vec<(NodeId, NodeDescriptor)> = lock(&self.inner.local)
            .iter()
            .map(|(n, d)| (n.clone(), d.clone()))
            .collect();
        for (node, descriptor) in local {
            match self.refresh(&node, &descriptor).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::info!(node = %node, "directory names another instance for a node with a tunnel here; leaving it there");
                }
                // Redis down: the next tick tries again
                Err(_) => return,
            }
        }
    }

    /// Every live entry whose owner is alive (at most [`MAX_SYNC_NODES`]).
    pub(crate) async fn read_directory(&self) -> Result<Vec<DirEntry>, RedisError> {
        let mut inv = SYNC.prepare_invoke();
        inv.key(self.key("nodes"))
            .arg(&self.inner.prefix)
            .arg(MAX_SYNC_NODES);
        let flat: Vec<String> = self.script("directory_sync", &inv).await?;
        let mut out = Vec::with_capacity(flat.len() / 4);
        for chunk in flat.chunks_exact(4) {
            let [node, owner, addr, json] = chunk else {
                continue;
            };
            match serde_json::from_str::<NodeDescriptor>(json) {
                Ok(descriptor) => out.push(DirEntry {
                    node: NodeId::new(node.as_str()),
                    owner: owner.clone(),
                    owner_addr: addr.clone(),
                    descriptor,
                }),
                Err(e) => tracing::debug!(node, error = %e, "unreadable directory entry"),
            }
        }
        Ok(out)
    }

    /// Reads the directory into the registry: remote nodes appear, change, are confirmed
    /// (heartbeat) or leave. Local tunnels always win; an entry naming this instance is left to
    /// the local bookkeeping. When Redis fails, remote nodes not confirmed for [`REMOTE_TTL`]
    /// leave routing.
    pub(super) async fn sync(&self) {
        let now = Instant::now();
        let entries = self.read_directory().await.ok();
        let registry = &self.inner.registry;
        let mut appeared: Vec<(NodeId, NodeDescriptor)> = Vec::new();
        let mut confirmed: Vec<NodeId> = Vec::new();
        let mut gone: Vec<NodeId> = Vec::new();
        {
            let suspects = {
                let mut s = lock(&self.inner.suspects);
                s.retain(|_, until| *until > now);
                s.keys().cloned().collect::<HashSet<String>>()
            };
            let local = lock(&self.inner.local);
            let mut remote = lock(&self.inner.remote);
            if let Some(entries) = &entries {
                metrics::gauge!(DIRECTORY_NODES).set(entries.len() as f64);
                let mut seen: HashMap<&NodeId, ()> = HashMap::with_capacity(entries.len());
                for e in entries {
                    if e.owner == self.inner.instance_id
                        || local.contains_key(&e.node)
                        || suspects.contains(&e.owner)
                    {
                        continue;
                    }
                    seen.insert(&e.node, ());
                    let mut listed = e.descriptor.clone();
                    listed.models.retain(|m| self.inner.catalog.contains(&m.id));
                    match remote.get_mut(&e.node) {
                        Some(r) if r.owner == e.owner && r.descriptor == listed => {
                            r.confirmed = now;
                            r.owner_addr.clone_from(&e.owner_addr);
                            confirmed.push(e.node.clone());
                        }
                        _ => {
                            remote.insert(
                                e.node.clone(),
                                Remote {
                                    owner: e.owner.clone(),
                                    owner_addr: e.owner_addr.clone(),
                                    descriptor: listed.clone(),
                                    confirmed: now,
                                },
                            );
                            appeared.push((e.node.clone(), listed));
                        }
                    }
                }
                remote.retain(|node, _| {
                    let keep = seen.contains_key(node);
                    if !keep {
                        gone.push(node.clone());
                    }
                    keep
                });
            } else {
                remote.retain(|node, r| {
                    let keep = now.duration_since(r.confirmed) < REMOTE_TTL;
                    if !keep {
                        gone.push(node.clone());
                    }
                    keep
                });
            }
            metrics::gauge!(REMOTE_NODES).set(remote.len() as f64);
        }
        for (node, descriptor) in &appeared {
            if !self.inner.tunnels.contains(node) {
                registry.node_ready(node, descriptor);
            }
        }
        for node in &confirmed {
            registry.heartbeat(node);
            // a node dropped after a failed forward comes back with its entry
            if !registry.contains(node) {
                if let Some(d) = lock(&self.inner.remote)
                    .get(node)
                    .map(|r| r.descriptor.clone())
                {
                    registry.node_ready(node, &d);
                }
            }
        }
        for node in &gone {
            if !self.inner.tunnels.contains(node) && !lock(&self.inner.local).contains_key(node) {
                registry.node_gone(node);
            }
        }
    }
}
