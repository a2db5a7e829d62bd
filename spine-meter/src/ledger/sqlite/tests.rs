//! SQLite-only tests: upgrading files written by earlier schema versions. Everything else is in
//! the store suite (`ledger/tests.rs`), run against SQLite and PostgreSQL alike.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;

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
        l.pool().close().await;
    }
    let l = SqliteLedger::open(&path).await.unwrap();
    let versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM spine_schema_migrations ORDER BY version")
            .fetch_all(l.pool())
            .await
            .unwrap();
    assert_eq!(versions, vec![1, 2, 3]);
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
