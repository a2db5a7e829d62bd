//! SQLite-only tests: upgrading files written by earlier schema versions, the writer/reader
//! split, background checkpoints and what an abrupt stop leaves. Everything else is in
//! the store suite (`ledger/tests.rs`), run against SQLite and PostgreSQL alike.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use spine_core::{AccountId, ModelId, RequestId, StreamOutcome, Usage, UsageSource};

use super::*;
use crate::ledger::sql::{SqlRow as _, TxEnd};
use crate::ledger::{Ledger, Settlement};
use crate::price::Price;

#[tokio::test]
async fn migration_2_upgrades_a_version_1_file_and_old_holds_settle_as_unknown_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    {
        // a file as version 1 left it: no `holds.model`, one hold active
        let l = SqliteLedger::open(&path).await.unwrap();
        let acct = AccountId::from("a");
        l.create_account(&acct).await.unwrap();
        l.add_credits(&acct, 1_000, "k").await.unwrap();
        l.hold(RequestId::from("old"), acct, ModelId::from("m"), 400)
            .await
            .unwrap();
        sqlx::raw_sql(
            "ALTER TABLE holds DROP COLUMN model; DELETE FROM spine_schema_migrations WHERE version = 2;",
        )
        .execute(l.pool())
        .await
        .unwrap();
        l.close().await;
    }
    let l = SqliteLedger::open(&path).await.unwrap();
    let versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM spine_schema_migrations ORDER BY version")
            .fetch_all(l.pool())
            .await
            .unwrap();
    assert_eq!(versions, vec![1, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert_eq!(l.settle_stale_holds().await.unwrap(), 1);
    let rec = l
        .request_record(RequestId::from("old"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (rec.model, rec.outcome, rec.debit_micros, rec.hold_micros),
        (
            ModelId::from("unknown"),
            StreamOutcome::UpstreamFailed,
            0,
            400
        )
    );
    let b = l.account(&AccountId::from("a")).await.unwrap();
    assert_eq!((b.balance_micros, b.held_micros), (1_000, 0));
}

#[tokio::test]
async fn a_file_store_writes_through_one_connection_and_reads_through_query_only_ones() {
    let dir = tempfile::tempdir().unwrap();
    let l = SqliteLedger::open(dir.path().join("ledger.db"))
        .await
        .unwrap();
    assert_eq!(l.pool().options().get_max_connections(), 1);
    let journal: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(l.reader_pool())
        .await
        .unwrap();
    assert_eq!(journal, "wal");
    let e = sqlx::query("INSERT INTO operators (id, created_at_ms) VALUES ('x', 0)")
        .execute(l.reader_pool())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("readonly"), "{e}");
    // many concurrent writers: all queue on the one connection, none fails on a busy database
    let acct = AccountId::from("a");
    l.create_account(&acct).await.unwrap();
    l.add_credits(&acct, 1_000_000, "k").await.unwrap();
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let l = l.clone();
            let acct = acct.clone();
            tokio::spawn(async move {
                let id = RequestId::from(format!("r{i}"));
                l.hold(id.clone(), acct, ModelId::from("m"), 10).await?;
                l.release(id).await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let b = l.account(&acct).await.unwrap();
    assert_eq!((b.balance_micros, b.held_micros), (1_000_000, 0));
    l.close().await;
}

#[tokio::test]
async fn the_background_task_checkpoints_the_wal_into_the_database_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let l = SqliteLedger::open(&path).await.unwrap();
    l.create_account(&AccountId::from("a")).await.unwrap();
    // the writer's own automatic checkpoint is far away (16,384 pages): the schema and the
    // account reach the database file only through the background checkpoint
    let page: u64 = sqlx::query_scalar::<_, i64>("PRAGMA page_size")
        .fetch_one(l.reader_pool())
        .await
        .unwrap()
        .try_into()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if std::fs::metadata(&path).unwrap().len() >= 8 * page {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never checkpointed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    l.close().await;
}

/// The WAL header's checkpoint sequence number (bytes 12..16, big-endian), which SQLite
/// increments each time a write starts the WAL over.
fn wal_restarts(path: &std::path::Path) -> u32 {
    let wal = std::fs::read(path.with_extension("db-wal")).unwrap();
    u32::from_be_bytes(wal[12..16].try_into().unwrap())
}

/// Under writes that never pause, the background checkpoint never finds the WAL idle, so the
/// WAL would only grow: once the background has seen it reach the threshold, the writer
/// checkpoints after its next commit and the write after that starts the WAL over.
#[tokio::test]
async fn the_writer_starts_the_wal_over_once_the_background_saw_it_reach_the_threshold() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let mut l = SqliteLedger::open(&path).await.unwrap();
    // no background checkpoint: nothing copies the WAL back unless the writer does; and a
    // writer whose WAL size the test sets
    l.checkpointer.take();
    tokio::time::sleep(Duration::from_millis(300)).await;
    l.direct.take().unwrap().close().await;
    let wal = WalSize::new(1_000);
    let writer = Writer::open(
        &path,
        BUSY_TIMEOUT,
        WRITER_AUTOCHECKPOINT_PAGES,
        wal.clone(),
    );
    l.direct = Some(writer.unwrap());
    let acct = AccountId::from("a");
    l.create_account(&acct).await.unwrap();
    let before = wal_restarts(&path);
    // below the threshold: the WAL goes on growing
    wal.record(999);
    l.add_credits(&acct, 1, "k1").await.unwrap();
    l.add_credits(&acct, 1, "k2").await.unwrap();
    assert_eq!(wal_restarts(&path), before);
    // at it: the next commit is followed by the writer's checkpoint, the write after by a
    // WAL started over
    wal.record(1_000);
    l.add_credits(&acct, 1, "k3").await.unwrap();
    assert!(!wal.take_restart(), "the writer took the restart");
    l.add_credits(&acct, 1, "k4").await.unwrap();
    assert_eq!(wal_restarts(&path), before + 1);
    // and every write is there
    assert_eq!(l.account(&acct).await.unwrap().balance_micros, 4);
    l.close().await;
}

/// What an application crash leaves is what the files hold while the store is open: a copy of
/// them then must have every committed settlement (the WAL is replayed on open).
#[tokio::test]
async fn a_copy_of_the_files_of_an_open_store_has_every_committed_settlement() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let l = SqliteLedger::open(&path).await.unwrap();
    // no checkpoint from now on: the settlement stays in the WAL only
    l.checkpointer.as_ref().unwrap().0.abort();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let acct = AccountId::from("a");
    l.create_account(&acct).await.unwrap();
    l.add_credits(&acct, 1_000_000, "k").await.unwrap();
    let id = RequestId::from("r1");
    l.hold(id.clone(), acct.clone(), ModelId::from("m"), 500_000)
        .await
        .unwrap();
    let settled = l
        .settle(Settlement {
            request_id: id.clone(),
            account: acct.clone(),
            node: None,
            model: ModelId::from("m"),
            outcome: StreamOutcome::Completed,
            billed: Usage {
                prompt_tokens: 1_000,
                completion_tokens: 1_000,
            },
            claimed: None,
            usage_source: UsageSource::Independent,
            discrepancy: false,
            price: Price {
                input_micros_per_mtok: 150_000,
                output_micros_per_mtok: 600_000,
            },
            share_bps: 0,
            earnings_held: false,
            key: None,
            ttft_ms: None,
        })
        .await
        .unwrap();
    assert_eq!(settled.debit_micros, 750);
    let copy = tempfile::tempdir().unwrap();
    for name in ["ledger.db", "ledger.db-wal"] {
        std::fs::copy(dir.path().join(name), copy.path().join(name)).unwrap();
    }
    let c = SqliteLedger::open(copy.path().join("ledger.db"))
        .await
        .unwrap();
    let rec = c.request_record(id).await.unwrap().unwrap();
    assert_eq!(rec.debit_micros, 750);
    let b = c.account(&acct).await.unwrap();
    assert_eq!((b.balance_micros, b.held_micros), (1_000_000 - 750, 0));
    assert_eq!(c.entries_sum_micros().await.unwrap(), 0);
    c.close().await;
    l.close().await;
}

#[cfg(unix)]
#[tokio::test]
async fn database_wal_and_shm_files_are_owner_only() {
    use std::os::unix::fs::PermissionsExt as _;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let wal = dir.path().join("ledger.db-wal");
    let shm = dir.path().join("ledger.db-shm");
    let l = SqliteLedger::open(&path).await.unwrap();
    l.create_account(&AccountId::from("a")).await.unwrap();
    // the file, and the WAL and shared-memory files SQLite made beside it
    assert_eq!(mode(&path), 0o600);
    assert_eq!(mode(&wal), 0o600);
    assert_eq!(mode(&shm), 0o600);
    l.close().await;

    // files an earlier release left readable by others are tightened at the next open
    for p in [&path, &wal, &shm] {
        if p.exists() {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
    }
    let l = SqliteLedger::open(&path).await.unwrap();
    l.create_account(&AccountId::from("b")).await.unwrap();
    assert_eq!(mode(&path), 0o600);
    assert_eq!(mode(&wal), 0o600);
    assert_eq!(mode(&shm), 0o600);
    l.close().await;
}

/// Schema version 9 rebuilds `console_users` (and the sessions and links that reference it) on a
/// file written at version 7: users, sessions and links keep their roles, the foreign keys point
/// at the new table and hold, the one-owner check holds, and a platform user can be created.
#[tokio::test]
async fn migration_9_keeps_the_console_users_sessions_and_links_of_a_version_7_file() {
    use crate::ledger::{ConsoleRole, ConsoleUser, Store};
    use spine_core::OperatorId;
    use std::sync::Arc;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    {
        let opts = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true);
        let pool = sqlx::SqlitePool::connect_with(opts).await.unwrap();
        sqlx::raw_sql(
            "CREATE TABLE spine_schema_migrations (version INTEGER PRIMARY KEY, applied_at_ms INTEGER NOT NULL)",
        )
        .execute(&pool)
        .await
        .unwrap();
        for (v, sql) in super::migrations::migrations() {
            if v <= 7 {
                sqlx::raw_sql(&sql).execute(&pool).await.unwrap();
                sqlx::query("INSERT INTO spine_schema_migrations VALUES (?, 0)")
                    .bind(v)
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }
        sqlx::raw_sql(
            "INSERT INTO accounts (id, created_at_ms) VALUES ('a', 0);
             INSERT INTO operators (id, created_at_ms) VALUES ('o', 0);
             INSERT INTO console_users (user_id, email, account_id, created_at_ms) VALUES ('cu_b', 'b@x', 'a', 0);
             INSERT INTO console_users (user_id, email, operator_id, created_at_ms) VALUES ('cu_o', 'o@x', 'o', 0);
             INSERT INTO console_sessions (token_hash, user_id, created_at_ms, expires_at_ms) VALUES ('s', 'cu_b', 0, 9000000000000);
             INSERT INTO console_links (token_hash, user_id, created_at_ms, expires_at_ms) VALUES ('l', 'cu_o', 0, 9000000000000);",
        )
        .execute(&pool)
        .await
        .unwrap();
        pool.close().await;
    }
    let l = Arc::new(SqliteLedger::open(&path).await.unwrap());
    let c = l.clone().console();
    let now = spine_core::unix_time_ms();
    assert_eq!(
        c.console_session("s", now).await.unwrap().unwrap().role,
        ConsoleRole::Builder(AccountId::from("a"))
    );
    assert_eq!(
        c.redeem_console_link("l", now).await.unwrap().unwrap().role,
        ConsoleRole::Operator(OperatorId::from("o"))
    );
    c.create_console_user(&ConsoleUser {
        user_id: "cu_p".into(),
        email: "p@x".into(),
        role: ConsoleRole::Platform,
        password_hash: None,
        created_at_ms: 0,
    })
    .await
    .unwrap();
    c.create_console_session("sp", "cu_p", now + 60_000)
        .await
        .unwrap();
    assert_eq!(
        c.console_session("sp", now).await.unwrap().unwrap().role,
        ConsoleRole::Platform
    );
    let dangling = sqlx::query("PRAGMA foreign_key_check")
        .fetch_all(l.pool())
        .await
        .unwrap();
    assert!(dangling.is_empty());
    assert!(
        c.create_console_session("sx", "nobody", now + 60_000)
            .await
            .is_err(),
        "the sessions' foreign key holds"
    );
    assert!(
        sqlx::query(
            "INSERT INTO console_users (user_id, email, account_id, operator_id, created_at_ms) VALUES ('x', 'x@x', 'a', 'o', 0)",
        )
        .execute(l.pool())
        .await
        .is_err(),
        "one owner"
    );
}

/// A file store and its path, in a temp dir kept alive with it.
async fn file_store() -> (tempfile::TempDir, std::path::PathBuf, SqliteLedger) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let l = SqliteLedger::open(&path).await.unwrap();
    (dir, path, l)
}

/// How many `operators` rows a reader sees.
async fn operators(l: &SqliteLedger) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM operators")
        .fetch_one(l.reader_pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn the_writer_rolls_back_a_transaction_dropped_unfinished_and_goes_on() {
    let (_dir, _path, l) = file_store().await;
    let insert = "INSERT INTO operators (id, created_at_ms) VALUES ($1, 0)";
    {
        let mut tx = l.begin().await.unwrap();
        assert!(
            matches!(tx, StoreTx::Writer(_)),
            "a file store writes on its writer"
        );
        assert_eq!(tx.exec(insert, &[Arg::Text("dropped")]).await.unwrap(), 1);
        // dropped here: as a caller that went away mid-transaction
    }
    let mut tx = l.begin().await.unwrap();
    assert_eq!(tx.exec(insert, &[Arg::Text("rolled")]).await.unwrap(), 1);
    tx.rollback().await.unwrap();
    assert_eq!(operators(&l).await, 0, "neither write is kept");
    // the connection is usable (not left inside a transaction) and commits are seen by readers
    let mut tx = l.begin().await.unwrap();
    tx.exec(insert, &[Arg::Text("kept")]).await.unwrap();
    tx.commit().await.unwrap();
    l.create_operator(&spine_core::OperatorId::from("o2"))
        .await
        .unwrap();
    assert_eq!(operators(&l).await, 2);
    l.close().await;
}

#[tokio::test]
async fn the_writer_reports_errors_as_the_sqlx_driver_does() {
    let (_dir, _path, l) = file_store().await;
    let op = spine_core::OperatorId::from("o");
    l.create_operator(&op).await.unwrap();
    assert!(matches!(
        l.create_operator(&op).await,
        Err(LedgerError::Duplicate { what: "operator" })
    ));
    let acct = AccountId::from("a");
    l.create_account(&acct).await.unwrap();
    l.add_credits(&acct, 1_000, "k").await.unwrap();
    l.hold(RequestId::from("r"), acct.clone(), ModelId::from("m"), 10)
        .await
        .unwrap();
    assert!(matches!(
        l.hold(RequestId::from("r"), acct.clone(), ModelId::from("m"), 10)
            .await,
        Err(LedgerError::Duplicate { what: "hold" })
    ));
    let mut c = l.write().await.unwrap();
    // a node of an operator that does not exist: the foreign key, code 787
    let e = c
        .exec(
            "INSERT INTO nodes (node_id, operator_id, public_key_text, created_at_ms) VALUES ('n', 'nobody', 'pk', 0)",
            &[],
        )
        .await
        .unwrap_err();
    match &e {
        LedgerError::Database(sqlx::Error::Database(d)) => {
            assert!(d.is_foreign_key_violation(), "{e:?}");
            assert_eq!(d.code().as_deref(), Some("787"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    // a placeholder with no argument is an error, never a silent NULL
    let e = c
        .exec(
            "UPDATE accounts SET held_micros = $2 WHERE id = $1",
            &[Arg::Text("a")],
        )
        .await
        .unwrap_err();
    assert!(matches!(e, LedgerError::Database(_)), "{e:?}");
    // a column of another type does not decode
    let row = c
        .optional("SELECT id FROM accounts WHERE id = $1", &[Arg::Text("a")])
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.text("id").unwrap(), "a");
    assert!(row.i64("id").is_err());
    assert!(row.text("missing").is_err());
    drop(c);
    let b = l.account(&acct).await.unwrap();
    assert_eq!((b.balance_micros, b.held_micros), (1_000, 10));
    l.close().await;
    let e = l.create_account(&AccountId::from("b")).await.unwrap_err();
    assert!(
        e.is_unavailable(),
        "a closed store's writes fail unavailable: {e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_waits_for_another_process_that_holds_the_write_lock() {
    let (_dir, path, l) = file_store().await;
    let acct = AccountId::from("a");
    l.create_account(&acct).await.unwrap();
    // another process's connection takes the write lock and keeps it for a while
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let other = std::thread::spawn(move || {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch("BEGIN IMMEDIATE; UPDATE accounts SET balance_micros = 7 WHERE id = 'a';")
            .unwrap();
        locked_tx.send(()).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        c.execute_batch("COMMIT").unwrap();
    });
    locked_rx.recv().unwrap();
    // waits in SQLite's busy handler (5 s at most) instead of failing busy
    l.add_credits(&acct, 1_000, "k").await.unwrap();
    other.join().unwrap();
    assert_eq!(l.account(&acct).await.unwrap().balance_micros, 1_007);
    l.close().await;
}

/// The file store's writer transaction of `tx`.
fn writer_tx(tx: StoreTx) -> super::writer::WriterTx {
    match tx {
        StoreTx::Writer(t) => t,
        StoreTx::Pool(_) => panic!("a file store writes on its writer"),
    }
}

/// Commits the file store's batches so far.
async fn commits(l: &SqliteLedger) -> u64 {
    l.direct.as_ref().unwrap().commits().await
}

#[tokio::test]
async fn writes_released_before_a_commit_are_committed_together_and_a_failed_one_alone_is_not() {
    let (_dir, _path, l) = file_store().await;
    let insert = "INSERT INTO operators (id, created_at_ms) VALUES ($1, 0)";
    let before = commits(&l).await;
    let mut a = writer_tx(l.begin().await.unwrap());
    a.exec(insert, &[Arg::Text("a")]).await.unwrap();
    // released into the batch at the call: the connection is free for the next write
    let a = TxEnd::commit(a);
    assert_eq!(
        operators(&l).await,
        0,
        "nothing is visible before the batch commits"
    );
    let mut b = writer_tx(l.begin().await.unwrap());
    b.exec(insert, &[Arg::Text("b")]).await.unwrap();
    let b = TxEnd::commit(b);
    // a write of the same batch that fails (a duplicate of `a`, which it sees) and is dropped
    let mut c = writer_tx(l.begin().await.unwrap());
    c.exec(insert, &[Arg::Text("c")]).await.unwrap();
    match c.exec(insert, &[Arg::Text("a")]).await {
        Err(LedgerError::Database(sqlx::Error::Database(d))) => {
            assert!(d.is_unique_violation(), "{d}");
        }
        other => panic!("a duplicate of `a`: {other:?}"),
    }
    drop(c);
    // a write of the same batch that rolls back
    let mut d = writer_tx(l.begin().await.unwrap());
    d.exec(insert, &[Arg::Text("d")]).await.unwrap();
    TxEnd::rollback(d).await.unwrap();
    let (ra, rb) = tokio::join!(a, b);
    ra.unwrap();
    rb.unwrap();
    assert_eq!(commits(&l).await - before, 1, "one COMMIT for both");
    let ids: Vec<String> = sqlx::query_scalar("SELECT id FROM operators ORDER BY id")
        .fetch_all(l.reader_pool())
        .await
        .unwrap();
    assert_eq!(ids, ["a", "b"]);
    // a lone write (one statement) commits on its own, and no transaction is left open
    l.create_operator(&spine_core::OperatorId::from("e"))
        .await
        .unwrap();
    assert_eq!(commits(&l).await - before, 2);
    assert_eq!(operators(&l).await, 3);
    l.close().await;
}

#[tokio::test]
async fn concurrent_ledger_writes_share_commits_and_every_one_is_kept() {
    let (_dir, _path, l) = file_store().await;
    let acct = AccountId::from("a");
    l.create_account(&acct).await.unwrap();
    l.add_credits(&acct, 1_000_000, "k").await.unwrap();
    let before = commits(&l).await;
    let mut holds = tokio::task::JoinSet::new();
    for i in 0..64 {
        let (l, acct) = (l.clone(), acct.clone());
        holds.spawn(async move {
            l.hold(
                RequestId::from(format!("r{i}").as_str()),
                acct,
                ModelId::from("m"),
                10,
            )
            .await
        });
    }
    while let Some(r) = holds.join_next().await {
        r.unwrap().unwrap();
    }
    let used = commits(&l).await - before;
    assert!(used < 64, "64 holds ready together took {used} commits");
    let b = l.account(&acct).await.unwrap();
    assert_eq!((b.balance_micros, b.held_micros), (1_000_000, 640));
    l.close().await;
}

#[tokio::test]
async fn a_batch_that_sqlite_rolled_back_fails_every_write_it_held() {
    let (_dir, _path, l) = file_store().await;
    let insert = "INSERT INTO operators (id, created_at_ms) VALUES ($1, 0)";
    let mut a = writer_tx(l.begin().await.unwrap());
    a.exec(insert, &[Arg::Text("a")]).await.unwrap();
    let a = TxEnd::commit(a);
    // the next write of the batch meets a transaction rolled back under it (as SQLite does
    // on an I/O error or a full disk): neither it nor `a` may be reported committed
    let mut b = writer_tx(l.begin().await.unwrap());
    b.exec(insert, &[Arg::Text("b")]).await.unwrap();
    b.batch("ROLLBACK").await.unwrap();
    assert!(TxEnd::commit(b).await.is_err(), "`b`'s savepoint is gone");
    match a.await {
        Err(sqlx::Error::Protocol(m)) => assert!(m.contains("rolled back by SQLite"), "{m}"),
        other => panic!("`a` was rolled back with its batch: {other:?}"),
    }
    assert_eq!(operators(&l).await, 0);
    // the writer goes on with a new batch
    l.create_operator(&spine_core::OperatorId::from("c"))
        .await
        .unwrap();
    assert_eq!(operators(&l).await, 1);
    l.close().await;
}

#[tokio::test]
async fn a_released_write_whose_caller_went_away_is_still_committed() {
    let (_dir, _path, l) = file_store().await;
    let insert = "INSERT INTO operators (id, created_at_ms) VALUES ($1, 0)";
    let mut a = writer_tx(l.begin().await.unwrap());
    a.exec(insert, &[Arg::Text("a")]).await.unwrap();
    let mut a = Box::pin(TxEnd::commit(a));
    // polled once (it yields), then dropped: as a caller cancelled after the release
    let first = std::future::poll_fn(|cx| {
        std::task::Poll::Ready(std::future::Future::poll(a.as_mut(), cx))
    })
    .await;
    assert!(first.is_pending());
    drop(a);
    // the batch is finished by a task of its own, with no other write to do it
    for _ in 0..1_000 {
        if operators(&l).await == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(operators(&l).await, 1);
    l.close().await;
}

/// `POST /v1/enroll` is open to anyone: a token that was never issued is refused on a read,
/// at once, even while the write lock is held (here by another process): it neither queues
/// for the writer that holds and settlements share nor takes it. An issued token still
/// redeems through the write transaction, once the lock is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_enrollment_token_is_refused_without_the_writer() {
    let (_dir, path, l) = file_store().await;
    let op = spine_core::OperatorId::from("op");
    l.create_operator(&op).await.unwrap();
    l.create_enrollment(&op, "tok-issued", i64::MAX)
        .await
        .unwrap();
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let other = std::thread::spawn(move || {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch("BEGIN IMMEDIATE; UPDATE operators SET earned_micros = 0 WHERE id = 'op';")
            .unwrap();
        locked_tx.send(()).unwrap();
        std::thread::sleep(Duration::from_millis(3_000));
        c.execute_batch("COMMIT").unwrap();
    });
    locked_rx.recv().unwrap();
    let started = std::time::Instant::now();
    let refused = l
        .redeem_enrollment("tok-never-issued", "ed25519:NEW1", None)
        .await;
    let took = started.elapsed();
    assert!(
        matches!(refused, Err(LedgerError::UnknownEnrollment)),
        "{refused:?}"
    );
    assert!(
        took < Duration::from_millis(1_500),
        "an unknown token waited {took:?} for the writer"
    );
    // the issued token waits for the lock, then redeems
    let enrolled = l
        .redeem_enrollment("tok-issued", "ed25519:NEW1", None)
        .await
        .unwrap();
    assert_eq!(enrolled.operator, op);
    other.join().unwrap();
    l.close().await;
}
