//! The store in an application's life: the store a `database_url` names opened at start (stale
//! holds settled, the PostgreSQL instance claimed and heartbeat), the serving node noted on a
//! streamed request's hold, the holds left at shutdown settled, and tunnel logins checked
//! against the registered node keys.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use spine_core::{NodeId, RequestId};

use super::{HoldNote, Store};

/// Where the ledger lives (`database_url`).
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Database {
    /// An SQLite file (`SqliteLedger`; one instance).
    Sqlite(PathBuf),
    /// A PostgreSQL URL (`PgLedger`; any number of instances); may hold a password, so its
    /// `Debug` leaves it out.
    Postgres(String),
}

/// A `database_url` that names no store this crate knows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("database_url: expected sqlite://<path> or postgres://user@host:port/database")]
#[non_exhaustive]
pub struct DatabaseUrlError;

impl Database {
    /// The store `url` names: `sqlite://<path>`, `postgres://…` or `postgresql://…`; with no
    /// URL, the SQLite file `<data_dir>/spine.db`.
    ///
    /// # Errors
    ///
    /// [`DatabaseUrlError`] for any other scheme (the message never repeats the URL).
    pub fn from_url(url: Option<&str>, data_dir: &Path) -> Result<Self, DatabaseUrlError> {
        match url {
            None => Ok(Self::Sqlite(data_dir.join("spine.db"))),
            Some(url) => {
                if let Some(path) = url.strip_prefix("sqlite://") {
                    Ok(Self::Sqlite(PathBuf::from(path)))
                } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
                    Ok(Self::Postgres(url.to_owned()))
                } else {
                    Err(DatabaseUrlError)
                }
            }
        }
    }
}

impl std::fmt::Debug for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Sqlite(path) => f.debug_tuple("Sqlite").field(path).finish(),
            Self::Postgres(_) => f.write_str("Postgres(..)"),
        }
    }
}

/// Opens the store `database` names, ready to serve.
///
/// - SQLite (one instance): no request of a previous run is in flight, so the holds it left
///   are settled `upstream_failed` now.
/// - PostgreSQL (shared by any number of instances): holds carry `instance_id`; the id is
///   claimed (refused while another live process heartbeats it; a restart under the same id
///   waits up to 6 s for the previous process's heartbeat to lapse), then only this instance's
///   own leftovers are settled, and an upkeep task heartbeats the `instances` row and settles
///   the holds of instances whose heartbeat lapsed, until `upkeep_stop` is cancelled.
///
/// # Errors
///
/// The store's error when it cannot be opened, claimed or swept.
///
/// # Cancel safety
///
/// Not cancel safe: dropped after the PostgreSQL claim, the id stays claimed until its
/// heartbeat lapses.
#[cfg(all(feature = "sqlite", feature = "postgres"))]
pub async fn open_store(
    database: &Database,
    instance_id: &str,
    upkeep_stop: tokio_util::sync::CancellationToken,
) -> Result<Arc<dyn Store>, super::LedgerError> {
    match database {
        Database::Sqlite(path) => {
            let store = Arc::new(super::SqliteLedger::open(path).await?);
            let stale_holds = store.settle_stale_holds().await?;
            if stale_holds > 0 {
                tracing::warn!(
                    stale_holds,
                    "settled holds left active by the previous run as upstream_failed"
                );
            }
            Ok(store)
        }
        Database::Postgres(url) => {
            let upkeep = super::InstanceUpkeep::default();
            let store = Arc::new(
                super::PgLedger::connect(url)
                    .await?
                    .with_instance_id(instance_id),
            );
            store.claim_instance(upkeep.live_within).await?;
            let stale_holds = store.settle_stale_holds().await?;
            if stale_holds > 0 {
                tracing::warn!(
                    stale_holds,
                    "settled holds this instance left active in a previous run as upstream_failed"
                );
            }
            let _upkeep = store.clone().spawn_instance_upkeep(upkeep, upkeep_stop);
            tracing::info!(instance_id, "ledger on PostgreSQL");
            Ok(store)
        }
    }
}

/// A streamed answer has begun: records its node and the counted prompt on the request's hold
/// (`Store::note_hold`) on a spawned task, off the response path, so that if this process dies
/// before the stream settles, the sweep's record names the node that served it and the prompt it
/// read. One small write per streamed 2xx request with a node (`NodeId` in the response
/// extensions); a non-streamed answer is settled as it is returned, so it needs none.
///
/// # Panics
///
/// Outside a tokio runtime (it spawns), when it has something to note.
pub fn note_serving_node<B>(
    store: &Arc<dyn Store>,
    request_id: Option<RequestId>,
    resp: &http::Response<B>,
) {
    let streamed = spine_core::is_event_stream_response(resp.headers());
    let node = resp.extensions().get::<NodeId>().cloned();
    let known = resp
        .extensions()
        .get::<crate::meter::CountedUsage>()
        .map(|c| c.0);
    let (Some(request_id), Some(node), true) =
        (request_id, node, streamed && resp.status().is_success())
    else {
        return;
    };
    let store = store.clone();
    tokio::spawn(async move {
        let note = HoldNote {
            node: Some(node),
            known,
        };
        if let Err(e) = store.note_hold(request_id, note).await {
            tracing::debug!(error = %e, "noting the serving node on the hold failed");
        }
    });
}

/// At shutdown, once every stream has ended (or was cut): waits up to `grace` for the
/// settlements in flight to commit; then, when they all did, settles the holds no request owns
/// any more (`Store::settle_holds_at_shutdown`, recorded as `shutdown`). When they did not, the
/// pending request ids are logged: their holds stay in the ledger and are settled
/// `upstream_failed` at the next start (SQLite, or PostgreSQL under the same instance id) or by
/// another instance's sweep once this one's heartbeat has stopped for 60 s. Whether every
/// settlement committed.
///
/// # Cancel safety
///
/// Cancel safe: the settlements run on their own tasks.
pub async fn drain_at_shutdown(
    store: &dyn Store,
    settlements: &crate::meter::Settlements,
    grace: std::time::Duration,
) -> bool {
    let drained = tokio::time::timeout(grace, settlements.drain())
        .await
        .is_ok();
    if drained {
        match store.settle_holds_at_shutdown().await {
            Ok(0) => {}
            Ok(n) => tracing::warn!(
                holds = n,
                "settled holds no request owned at shutdown as upstream_failed (swept: shutdown)"
            ),
            Err(e) => tracing::warn!(error = %e, "shutdown sweep of holds failed"),
        }
    } else {
        tracing::error!(
            pending = settlements.pending(),
            request_ids = ?settlements.pending_request_ids(),
            "settlements still pending; their holds are settled upstream_failed at the next start under this instance_id, or by another instance's sweep 60 s after this one stops"
        );
    }
    drained
}

/// A tunnel's [`NodeAuthenticator`](spine_transport::NodeAuthenticator) over the store: only
/// registered public keys are let in (`Store::node_for_public_key`); an unknown key is refused
/// `unknown_key`, a failed lookup `internal` (logged).
#[cfg(feature = "tunnel")]
#[derive(Clone)]
pub struct StoreAuthenticator(pub Arc<dyn Store>);

#[cfg(feature = "tunnel")]
impl std::fmt::Debug for StoreAuthenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("StoreAuthenticator").finish_non_exhaustive()
    }
}

#[cfg(feature = "tunnel")]
impl spine_transport::NodeAuthenticator for StoreAuthenticator {
    fn authenticate<'a>(
        &'a self,
        public_key_text: &'a str,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<NodeId, spine_transport::RefusalReason>>
                + Send
                + 'a,
        >,
    > {
        use spine_transport::RefusalReason;
        Box::pin(async move {
            match self.0.node_for_public_key(public_key_text).await {
                Ok(Some(node)) => Ok(node),
                Ok(None) => Err(RefusalReason::UnknownKey),
                Err(e) => {
                    tracing::error!(error = %e, "node lookup failed");
                    Err(RefusalReason::Internal)
                }
            }
        })
    }
}

#[cfg(test)]
mod tests;
