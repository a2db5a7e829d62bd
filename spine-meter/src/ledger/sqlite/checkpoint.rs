//! WAL checkpoints of a file store, and how the WAL is kept from growing without bound while
//! writes never stop.
//!
//! A background task copies the WAL into the database file every [`CHECKPOINT_INTERVAL`] on a
//! connection of its own (`PRAGMA wal_checkpoint(PASSIVE)`: it never blocks the writer, and
//! its two fsyncs happen off the request path). That alone does not bound the WAL: SQLite
//! starts writing the WAL from its beginning again only when a write transaction begins while
//! every frame has been copied back, and under continuous writes the writer has always
//! appended frames since the background pass began (measured: 68 MB of WAL within 3 s at
//! 2,000 req/s, `docs/benchmarks.md`). SQLite's answer is the writer's automatic checkpoint,
//! which runs inside the `COMMIT` that crosses its threshold, so on the runtime thread that
//! commits (a stall of every task on it, fsyncs included).
//!
//! Here the background task publishes the WAL's size at each pass ([`WalSize`]); once it is
//! its threshold ([`RESTART_AFTER_FRAMES`]) or more, the writer, right after its next `COMMIT`, runs
//! one passive checkpoint itself **on a blocking thread, holding its connection**: only the
//! frames since the background's last pass are left to copy, writes wait for the connection
//! asynchronously meanwhile, and no transaction is open on the writer, so the checkpoint
//! copies every frame and the writer's next transaction starts the WAL over. (A reader in the
//! middle of a statement can make SQLite skip that restart; the background's next pass then
//! asks again.) The writer's own automatic checkpoint stays as a safety net far above,
//! reached only if the background task stops publishing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::SqliteConnection;

/// How often the background task checkpoints the WAL.
pub(super) const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(250);

/// WAL frames (pages) from which the writer checkpoints after a commit so that the WAL starts
/// over: 64 MiB of 4 KiB pages.
pub(super) const RESTART_AFTER_FRAMES: u64 = 16_384;

/// The writer connection's `wal_autocheckpoint` (pages): the safety net, 4× the restart
/// threshold (SQLite's default is 1,000).
pub(super) const WRITER_AUTOCHECKPOINT_PAGES: u32 = 65_536;

/// The WAL's size in frames as the background task last saw it, shared with the writer.
#[derive(Clone, Debug)]
pub(in crate::ledger) struct WalSize {
    /// Frames in the WAL at the background's last pass; 0 once the writer has taken a restart.
    frames: Arc<AtomicU64>,
    /// From how many frames the writer takes a restart.
    restart_after_frames: u64,
}

impl WalSize {
    /// A WAL that the writer starts over once it holds `restart_after_frames` frames.
    pub(super) fn new(restart_after_frames: u64) -> Self {
        Self {
            frames: Arc::default(),
            restart_after_frames: restart_after_frames.max(1),
        }
    }

    /// Records the background's count of frames in the WAL.
    pub(super) fn record(&self, frames: u64) {
        self.frames.store(frames, Ordering::Relaxed);
    }

    /// Whether the WAL has reached the threshold since the last restart the writer took; if
    /// so, the writer now takes it (the next call is `false` until the background records the
    /// threshold again).
    pub(super) fn take_restart(&self) -> bool {
        self.frames.load(Ordering::Relaxed) >= self.restart_after_frames
            && self.frames.swap(0, Ordering::Relaxed) >= self.restart_after_frames
    }
}

/// Aborts a task when dropped.
#[derive(Debug)]
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Checkpoints the WAL every [`CHECKPOINT_INTERVAL`] on its own connection until aborted, and
/// records the WAL's size in `wal` after each pass.
pub(super) fn spawn_checkpointer(mut conn: SqliteConnection, wal: WalSize) -> AbortOnDrop {
    let task = async move {
        let mut tick = tokio::time::interval(CHECKPOINT_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            // one row: (1 if it could not finish, frames in the WAL, frames copied back)
            match sqlx::query_as::<_, (i64, i64, i64)>("PRAGMA wal_checkpoint(PASSIVE)")
                .fetch_one(&mut conn)
                .await
            {
                Ok((_, frames, _)) => wal.record(u64::try_from(frames).unwrap_or(0)),
                Err(e) => {
                    tracing::debug!(error = %e, "ledger WAL checkpoint failed; retried next tick");
                }
            }
        }
    };
    AbortOnDrop(tokio::spawn(task))
}

/// The writer's checkpoint after a commit (see the module docs): passive, on `conn` with no
/// transaction open. Blocking: call it on a blocking thread.
pub(super) fn checkpoint_to_restart(conn: &rusqlite::Connection) {
    match conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
        Ok(()) => {}
        // the background checkpoint is running (one at a time): its next pass asks again
        Err(e) if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy) => {
            tracing::debug!(error = %e, "the ledger writer's WAL checkpoint was busy");
        }
        Err(e) => tracing::warn!(error = %e, "the ledger writer's WAL checkpoint failed"),
    }
}
