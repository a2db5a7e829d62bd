//! Rows read on the writer connection.

use std::sync::Arc;

use rusqlite::types::Value;

use crate::ledger::sql::SqlRow;
use crate::ledger::LedgerError;

/// A row read on the writer connection: its columns by name.
#[derive(Debug)]
pub(in crate::ledger) struct WriterRow {
    /// The statement's column names (shared by its rows).
    pub(super) names: Arc<[String]>,
    /// The values, in column order.
    pub(super) values: Vec<Value>,
}

impl WriterRow {
    /// The value of column `col`.
    fn get(&self, col: &str) -> Result<&Value, LedgerError> {
        self.names
            .iter()
            .position(|n| n == col)
            .and_then(|i| self.values.get(i))
            .ok_or_else(|| LedgerError::Database(sqlx::Error::ColumnNotFound(col.to_owned())))
    }
}

/// A column that does not decode as asked (as sqlx's `ColumnDecode`).
fn decode_error(col: &str, want: &str, got: &Value) -> LedgerError {
    LedgerError::Database(sqlx::Error::ColumnDecode {
        index: col.to_owned(),
        source: format!("expected {want}, found {}", got.data_type()).into(),
    })
}

impl SqlRow for WriterRow {
    fn i64(&self, col: &str) -> Result<i64, LedgerError> {
        match self.get(col)? {
            Value::Integer(v) => Ok(*v),
            other => Err(decode_error(col, "INTEGER", other)),
        }
    }

    fn opt_i64(&self, col: &str) -> Result<Option<i64>, LedgerError> {
        match self.get(col)? {
            Value::Null => Ok(None),
            Value::Integer(v) => Ok(Some(*v)),
            other => Err(decode_error(col, "INTEGER or NULL", other)),
        }
    }

    fn text(&self, col: &str) -> Result<String, LedgerError> {
        match self.get(col)? {
            Value::Text(v) => Ok(v.clone()),
            other => Err(decode_error(col, "TEXT", other)),
        }
    }

    fn opt_text(&self, col: &str) -> Result<Option<String>, LedgerError> {
        match self.get(col)? {
            Value::Null => Ok(None),
            Value::Text(v) => Ok(Some(v.clone())),
            other => Err(decode_error(col, "TEXT or NULL", other)),
        }
    }

    fn bool(&self, col: &str) -> Result<bool, LedgerError> {
        match self.get(col)? {
            Value::Integer(v) => Ok(*v != 0),
            other => Err(decode_error(col, "INTEGER (boolean)", other)),
        }
    }
}
