//! Several gateway instances on one database (design brief §8): heartbeats, the claim on an
//! instance id, and the sweep of holds whose instance stopped heartbeating.

use std::sync::Arc;
use std::time::Duration;

use super::{InstanceUpkeep, PgLedger, DB_NOW_MS};
use crate::ledger::convert::db;
use crate::ledger::sql::money::{settle_hold_rows, HOLD_COLUMNS};
use crate::ledger::sql::{Arg, Backend as _, SqlConn as _};
#[cfg(doc)]
use crate::ledger::Store;
use crate::ledger::{LedgerError, SweepKind};

impl PgLedger {
    /// Records that this instance is alive now (PostgreSQL's clock) in the `instances` table,
    /// under this process's nonce; [`PgLedger::heartbeat_within`] with the default 6 s bound.
    /// Does nothing without an instance id.
    ///
    /// # Errors
    ///
    /// [`LedgerError::InstanceIdLive`] when another process heartbeat the same id within 6 s;
    /// [`LedgerError::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe (one statement, then a read).
    pub async fn heartbeat(&self) -> Result<(), LedgerError> {
        self.heartbeat_within(InstanceUpkeep::default().live_within)
            .await
    }

    /// Records that this instance is alive now, unless another process (another nonce) holds
    /// the id: its heartbeat is less than `live_within` old. Then nothing is written and
    /// [`LedgerError::InstanceIdLive`] is returned. A row with an older heartbeat (a crashed or
    /// stopped process) is taken over. Does nothing without an instance id.
    ///
    /// # Errors
    ///
    /// [`LedgerError::InstanceIdLive`], [`LedgerError::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe (one statement, then a read).
    pub async fn heartbeat_within(&self, live_within: Duration) -> Result<(), LedgerError> {
        let Some(id) = &self.instance_id else {
            return Ok(());
        };
        let live_ms = i64::try_from(live_within.as_millis()).unwrap_or(i64::MAX);
        let sql = format!(
            "INSERT INTO instances (instance_id, started_at_ms, heartbeat_at_ms, nonce) VALUES ($1, {DB_NOW_MS}, {DB_NOW_MS}, $2)
             ON CONFLICT (instance_id) DO UPDATE SET
                 heartbeat_at_ms = EXCLUDED.heartbeat_at_ms,
                 nonce = EXCLUDED.nonce,
                 started_at_ms = CASE WHEN instances.nonce IS NOT DISTINCT FROM EXCLUDED.nonce
                                      THEN instances.started_at_ms ELSE EXCLUDED.started_at_ms END
             WHERE instances.nonce IS NOT DISTINCT FROM EXCLUDED.nonce
                OR instances.heartbeat_at_ms < EXCLUDED.heartbeat_at_ms - $3
             RETURNING 1"
        );
        let written: Option<i32> = sqlx::query_scalar(&sql)
            .bind(id.as_ref())
            .bind(self.nonce.as_ref())
            .bind(live_ms)
            .fetch_optional(&mut *self.acquire().await?)
            .await
            .map_err(db)?;
        if written.is_some() {
            return Ok(());
        }
        let age: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT {DB_NOW_MS} - heartbeat_at_ms FROM instances WHERE instance_id = $1"
        ))
        .bind(id.as_ref())
        .fetch_optional(&mut *self.acquire().await?)
        .await
        .map_err(db)?;
        Err(LedgerError::InstanceIdLive {
            instance_id: id.to_string(),
            heartbeat_age_ms: age.unwrap_or(0),
        })
    }

    /// Takes this instance's id at start: [`PgLedger::heartbeat_within`]`(live_within)`, tried
    /// again every 500 ms while another process holds the id, for up to `live_within` + 1 s (so
    /// a restart under the same id waits for the previous process's last heartbeat to age past
    /// the bound). Call it before [`Store::settle_stale_holds`]: that settles every hold under
    /// this id, which is only right once no other live process uses it.
    ///
    /// # Errors
    ///
    /// [`LedgerError::InstanceIdLive`] when the id is still live after the wait (two
    /// processes configured with one `instance_id`), [`LedgerError::Database`].
    pub async fn claim_instance(&self, live_within: Duration) -> Result<(), LedgerError> {
        let deadline = tokio::time::Instant::now() + live_within + Duration::from_secs(1);
        loop {
            match self.heartbeat_within(live_within).await {
                Err(LedgerError::InstanceIdLive { .. })
                    if tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                other => return other,
            }
        }
    }

    /// Settles, as `upstream_failed`, every active hold placed by another instance whose last
    /// heartbeat is older than `stale_after` (or that never heartbeat), or placed by no recorded
    /// instance at all (a gateway of a release before instance ids) more than `stale_after` ago,
    /// and returns how many it settled. A live
    /// instance's holds (heartbeat within `stale_after`, PostgreSQL's clock) and this
    /// instance's own are never touched. Each hold is settled exactly once however many
    /// instances sweep at the same time (settlement is idempotent by request id), and a late
    /// settlement by the hold's own instance then finds it settled and changes nothing.
    ///
    /// `stale_after` must be well above the heartbeat interval (e.g. 60 s against 2 s).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`], [`LedgerError::Corrupt`]; holds settled before the error stay
    /// settled.
    pub async fn settle_orphaned_holds(&self, stale_after: Duration) -> Result<u64, LedgerError> {
        let stale_ms = i64::try_from(stale_after.as_millis()).unwrap_or(i64::MAX);
        // a hold without an instance id was placed by a gateway of a release before instance
        // ids, which may still be serving it (rolling upgrade): swept only once it is older
        // than `stale_after` (its creation time, the placing gateway's clock)
        let sql = format!(
            "SELECT {HOLD_COLUMNS} FROM holds h
             WHERE state = 'held'
               AND h.instance_id IS DISTINCT FROM $1
               AND CASE WHEN h.instance_id IS NULL
                        THEN h.created_at_ms < {DB_NOW_MS} - $2
                        ELSE NOT EXISTS (
                            SELECT 1 FROM instances i
                            WHERE i.instance_id = h.instance_id
                              AND i.heartbeat_at_ms >= {DB_NOW_MS} - $2)
                   END
             ORDER BY created_at_ms, request_id"
        );
        let rows = self
            .read()
            .await?
            .all(
                &sql,
                &[
                    Arg::OptText(self.instance_id.as_deref()),
                    Arg::I64(stale_ms),
                ],
            )
            .await?;
        settle_hold_rows(self, rows, SweepKind::Orphan).await
    }

    /// Keeps this instance's heartbeat and sweeps orphaned holds until `shutdown` is cancelled:
    /// a heartbeat now and every `config.heartbeat_interval`, and
    /// [`PgLedger::settle_orphaned_holds`]`(config.stale_after)` every `config.sweep_interval`.
    /// Failures are logged and retried at the next tick (PostgreSQL may be down for a while).
    pub fn spawn_instance_upkeep(
        self: Arc<Self>,
        config: InstanceUpkeep,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut heartbeat = tokio::time::interval(config.heartbeat_interval);
            heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut sweep = tokio::time::interval(config.sweep_interval);
            sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = heartbeat.tick() => {
                        if let Err(e) = self.heartbeat_within(config.live_within).await {
                            tracing::warn!(error = %e, "instance heartbeat to PostgreSQL failed");
                        }
                    }
                    _ = sweep.tick() => {
                        match self.settle_orphaned_holds(config.stale_after).await {
                            Ok(0) => {}
                            Ok(n) => tracing::warn!(
                                settled = n,
                                "settled holds of instances that stopped heartbeating as upstream_failed"
                            ),
                            Err(e) => tracing::warn!(error = %e, "orphaned hold sweep failed"),
                        }
                    }
                }
            }
        })
    }
}
