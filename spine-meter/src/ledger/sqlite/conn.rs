//! The SQLite store's connections, transactions and rows: sqlx's (the readers, and every
//! connection of an in-memory or caller's-pool store) or the file store's direct writer
//! ([`super::writer`]).

use sqlx::pool::PoolConnection;
use sqlx::sqlite::SqliteRow;
use sqlx::{Sqlite, Transaction};

use super::writer::{WriterAuto, WriterRow, WriterTx};
use crate::ledger::sql::{Arg, SqlConn, SqlRow, TxEnd};
use crate::ledger::{LedgerError, LedgerFuture};

/// A connection of the SQLite store.
#[derive(Debug)]
pub(in crate::ledger) enum StoreConn {
    /// One of sqlx's pools.
    Pool(PoolConnection<Sqlite>),
    /// The file store's writer, one write transaction per statement.
    Writer(WriterAuto),
}

/// A write transaction of the SQLite store (`BEGIN IMMEDIATE`).
#[derive(Debug)]
pub(in crate::ledger) enum StoreTx {
    /// On sqlx's writer pool.
    Pool(Transaction<'static, Sqlite>),
    /// On the file store's writer.
    Writer(WriterTx),
}

/// A row of the SQLite store.
pub(in crate::ledger) enum StoreRow {
    /// Read through sqlx.
    Pool(SqliteRow),
    /// Read on the file store's writer.
    Writer(WriterRow),
}

/// Implements [`SqlConn`] for an enum whose `Pool` variant's rows are sqlx's and whose
/// `Writer` variant's rows are [`WriterRow`]s.
macro_rules! store_conn {
    ($ty:ty) => {
        impl SqlConn for $ty {
            type Row = StoreRow;

            fn exec<'a>(&'a mut self, sql: &'a str, args: &'a [Arg<'a>]) -> LedgerFuture<'a, u64> {
                match self {
                    Self::Pool(c) => c.exec(sql, args),
                    Self::Writer(c) => c.exec(sql, args),
                }
            }

            fn optional<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [Arg<'a>],
            ) -> LedgerFuture<'a, Option<StoreRow>> {
                match self {
                    Self::Pool(c) => {
                        let f = c.optional(sql, args);
                        Box::pin(async move { Ok(f.await?.map(StoreRow::Pool)) })
                    }
                    Self::Writer(c) => {
                        let f = c.optional(sql, args);
                        Box::pin(async move { Ok(f.await?.map(StoreRow::Writer)) })
                    }
                }
            }

            fn all<'a>(
                &'a mut self,
                sql: &'a str,
                args: &'a [Arg<'a>],
            ) -> LedgerFuture<'a, Vec<StoreRow>> {
                match self {
                    Self::Pool(c) => {
                        let f = c.all(sql, args);
                        Box::pin(
                            async move { Ok(f.await?.into_iter().map(StoreRow::Pool).collect()) },
                        )
                    }
                    Self::Writer(c) => {
                        let f = c.all(sql, args);
                        Box::pin(
                            async move { Ok(f.await?.into_iter().map(StoreRow::Writer).collect()) },
                        )
                    }
                }
            }

            fn batch<'a>(&'a mut self, sql: &'a str) -> LedgerFuture<'a, ()> {
                match self {
                    Self::Pool(c) => c.batch(sql),
                    Self::Writer(c) => c.batch(sql),
                }
            }
        }
    };
}

store_conn!(StoreConn);
store_conn!(StoreTx);

impl TxEnd for StoreTx {
    async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            Self::Pool(tx) => tx.commit().await,
            Self::Writer(tx) => TxEnd::commit(tx).await,
        }
    }

    async fn rollback(self) -> Result<(), sqlx::Error> {
        match self {
            Self::Pool(tx) => tx.rollback().await,
            Self::Writer(tx) => TxEnd::rollback(tx).await,
        }
    }
}

impl SqlRow for StoreRow {
    fn i64(&self, col: &str) -> Result<i64, LedgerError> {
        match self {
            Self::Pool(r) => r.i64(col),
            Self::Writer(r) => r.i64(col),
        }
    }

    fn opt_i64(&self, col: &str) -> Result<Option<i64>, LedgerError> {
        match self {
            Self::Pool(r) => r.opt_i64(col),
            Self::Writer(r) => r.opt_i64(col),
        }
    }

    fn text(&self, col: &str) -> Result<String, LedgerError> {
        match self {
            Self::Pool(r) => r.text(col),
            Self::Writer(r) => r.text(col),
        }
    }

    fn opt_text(&self, col: &str) -> Result<Option<String>, LedgerError> {
        match self {
            Self::Pool(r) => r.opt_text(col),
            Self::Writer(r) => r.opt_text(col),
        }
    }

    fn bool(&self, col: &str) -> Result<bool, LedgerError> {
        match self {
            Self::Pool(r) => r.bool(col),
            Self::Writer(r) => r.bool(col),
        }
    }
}
