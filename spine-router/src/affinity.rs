//! Conversation affinity (design brief §5): a conversation key maps to the node that last served
//! it, for a TTL.

use std::collections::HashMap;
use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::pin::Pin;
use std::time::Duration;

use hashlink::LinkedHashMap;
use spine_core::{AccountId, BoxError, ModelId, NodeId, RequestPeek};
use tokio::time::Instant;

/// Where a request's conversation key came from, in the order the router looks for one.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AffinityKey {
    /// The body's `prompt_cache_key` (OpenAI's own conversation/cache key).
    PromptCacheKey(String),
    /// The caller's `X-Session-Id` header (see [`SessionId`]).
    SessionId(String),
    /// The automatic key: a hash of the conversation's opening
    /// ([`spine_core::conversation_key`]).
    Conversation(u64),
}

impl AffinityKey {
    /// The key of a request: `prompt_cache_key`, else `session` (the `X-Session-Id` header),
    /// else the automatic conversation key; `None` when there is none of them (a completions or
    /// embeddings body without `prompt_cache_key` or session).
    pub fn for_request(peek: &RequestPeek, session: Option<&str>) -> Option<Self> {
        if let Some(key) = &peek.prompt_cache_key {
            return Some(Self::PromptCacheKey(key.clone()));
        }
        if let Some(session) = session {
            return Some(Self::SessionId(session.to_owned()));
        }
        peek.conversation_key.map(Self::Conversation)
    }

    /// This key within `account`'s own key space: two accounts never share an affinity entry,
    /// so one account's requests cannot land on (and time) the node that caches another
    /// account's conversation, and a caller cannot aim at another account's key.
    #[must_use]
    pub fn scoped_to(self, account: &AccountId) -> Self {
        match self {
            Self::PromptCacheKey(k) => {
                Self::PromptCacheKey(format!("{}\u{1f}{k}", account.as_str()))
            }
            Self::SessionId(k) => Self::SessionId(format!("{}\u{1f}{k}", account.as_str())),
            Self::Conversation(h) => {
                let mut hasher = DefaultHasher::new();
                account.as_str().hash(&mut hasher);
                h.hash(&mut hasher);
                Self::Conversation(hasher.finish())
            }
        }
    }

    /// A 64-bit digest of this key within `model`: SipHash with fixed keys, the same in every
    /// process of one build, so instances sharing an external [`AffinityStore`] agree on it. A
    /// collision only costs a sticky miss.
    pub fn digest(&self, model: &ModelId) -> u64 {
        AffinityTable::slot(model, self)
    }

    /// The label metrics use for this kind of key: `prompt_cache_key`, `session_id`,
    /// `conversation`.
    pub fn source(&self) -> &'static str {
        match self {
            Self::PromptCacheKey(_) => "prompt_cache_key",
            Self::SessionId(_) => "session_id",
            Self::Conversation(_) => "conversation",
        }
    }
}

/// The caller's `X-Session-Id`, carried as a request extension.
///
/// [`Route`](crate::Route) reads this extension, else the `x-session-id` request header. An
/// application that builds a fresh upstream request (as the reference gateway does, so that no
/// caller header reaches a node) puts the caller's header value here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionId(pub String);

/// A boxed future returned by [`AffinityStore`].
pub type AffinityFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send + 'a>>;

/// Conversation affinity kept outside this process, shared by several gateway instances (design
/// brief §8), e.g. in Redis.
///
/// Without one, [`Route`](crate::Route) uses the registry's own in-memory table (the default, and
/// the single-instance behaviour). With one, `Route` asks [`AffinityStore::get`] before the
/// first pick and calls [`AffinityStore::set`] (in a spawned task, off the response path) after
/// an attempt commits; the in-memory table is written too and is what `Route` falls back to
/// when the store fails. A failing store never fails a request: a miss is a slower turn.
pub trait AffinityStore: Send + Sync + std::fmt::Debug {
    /// The node that last served `key` of `model`, if the entry is alive.
    ///
    /// # Errors
    ///
    /// The store is unreachable or slow; `Route` then uses the in-memory table. Implementations
    /// bound their own latency (the reference gateway uses 100 ms).
    ///
    /// # Cancel safety
    ///
    /// `Route` drops the future unfinished when its caller goes away; a read must leave the
    /// store as it was.
    fn get<'a>(
        &'a self,
        model: &'a ModelId,
        key: &'a AffinityKey,
    ) -> AffinityFuture<'a, Option<NodeId>>;

    /// Records that `node` served `key` of `model`, for the store's TTL from now.
    ///
    /// # Errors
    ///
    /// The store is unreachable or slow; the entry then lives only in the in-memory table.
    ///
    /// # Cancel safety
    ///
    /// `Route` runs it in a spawned task, which the runtime may drop at shutdown: a write
    /// dropped part-way may or may not have landed, and either is a valid entry (a lost write
    /// is a later sticky miss).
    fn set<'a>(
        &'a self,
        model: &'a ModelId,
        key: &'a AffinityKey,
        node: &'a NodeId,
    ) -> AffinityFuture<'a, ()>;
}

/// What the affinity table said about one pick.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum StickyOutcome {
    /// The request had no affinity key (or affinity is disabled).
    NoKey,
    /// The key had no live entry: a normal pick (the first turn of a conversation).
    New,
    /// The key's node was routable, served the model and had a free slot: picked.
    Hit,
    /// The key's node was gone, lacked the model, was full or had failed this request: a normal
    /// pick instead, and the entry is overwritten when the new node answers.
    Miss,
}

impl StickyOutcome {
    /// `no_key`, `new`, `hit`, `miss` (the `result` label of `spine_router_sticky_total`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoKey => "no_key",
            Self::New => "new",
            Self::Hit => "hit",
            Self::Miss => "miss",
        }
    }
}

#[derive(Debug)]
struct Entry {
    node: NodeId,
    expires: Instant,
}

/// Expired entries removed per insert, besides the one evicted when full: keeps each insert's
/// work under the mutex bounded while the table drains itself.
const SWEEP_PER_INSERT: usize = 16;

/// Key → node, each entry living `ttl` after its last use. Bounded at `max_entries`.
///
/// Entries are kept in order of last use (a linked hash map: every use moves its entry to the
/// back). With one `ttl` for all, that is also the order of expiry, so expired entries are swept
/// from the front and, when the table is full, the least recently used entry (the one that
/// expires soonest) is evicted: O(1) per operation, never a scan. Live entries per node are
/// counted as entries come and go, so [`AffinityTable::entries_per_node`] needs no scan either.
#[derive(Debug)]
pub(crate) struct AffinityTable {
    ttl: Duration,
    max_entries: usize,
    entries: LinkedHashMap<u64, Entry>,
    per_node: HashMap<NodeId, u64>,
}

impl AffinityTable {
    pub(crate) fn new(ttl: Duration, max_entries: usize) -> Self {
        Self {
            ttl,
            max_entries: max_entries.max(1),
            entries: LinkedHashMap::new(),
            per_node: HashMap::new(),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        !self.ttl.is_zero()
    }

    /// The table's key: the affinity key within one model. SipHash with fixed keys; a collision
    /// only costs a cache miss.
    pub(crate) fn slot(model: &ModelId, key: &AffinityKey) -> u64 {
        let mut h = DefaultHasher::new();
        model.as_str().hash(&mut h);
        key.hash(&mut h);
        h.finish()
    }

    /// The live node for `slot`, refreshing its TTL.
    pub(crate) fn get(&mut self, slot: u64, now: Instant) -> Option<NodeId> {
        let ttl = self.ttl;
        let live = self.entries.get(&slot).map(|e| e.expires > now)?;
        if live {
            let e = self.entries.to_back(&slot)?;
            e.expires = now + ttl;
            Some(e.node.clone())
        } else {
            self.remove(slot);
            None
        }
    }

    pub(crate) fn insert(&mut self, slot: u64, node: NodeId, now: Instant) {
        if !self.enabled() {
            return;
        }
        self.remove(slot);
        self.sweep(now, SWEEP_PER_INSERT);
        if self.entries.len() >= self.max_entries {
            if let Some((_, e)) = self.entries.pop_front() {
                self.uncount(&e.node);
            }
        }
        *self.per_node.entry(node.clone()).or_default() += 1;
        self.entries.insert(
            slot,
            Entry {
                node,
                expires: now + self.ttl,
            },
        );
    }

    /// Live entries per node. Sweeps the expired entries first (each entry is swept once in its
    /// life, so this costs O(nodes) plus the entries that expired since the last sweep).
    pub(crate) fn entries_per_node(&mut self, now: Instant) -> HashMap<NodeId, u64> {
        self.sweep(now, usize::MAX);
        self.per_node.clone()
    }

    fn remove(&mut self, slot: u64) {
        if let Some(e) = self.entries.remove(&slot) {
            self.uncount(&e.node);
        }
    }

    /// Removes up to `budget` expired entries from the front (the least recently used).
    fn sweep(&mut self, now: Instant, budget: usize) {
        for _ in 0..budget {
            match self.entries.front() {
                Some((_, e)) if e.expires <= now => {
                    if let Some((_, e)) = self.entries.pop_front() {
                        self.uncount(&e.node);
                    }
                }
                _ => break,
            }
        }
    }

    fn uncount(&mut self, node: &NodeId) {
        if let Some(n) = self.per_node.get_mut(node) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_node.remove(node);
            }
        }
    }
}

#[cfg(test)]
mod tests;
