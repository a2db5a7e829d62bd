//! SQLite's schema migrations: the shared tables ([`schema`]) in SQLite's types.

use crate::ledger::sql::schema::{self, SchemaTypes};

const TYPES: SchemaTypes = SchemaTypes::SQLITE;

/// Schema migrations `(version, sql)`, applied in order, each once (recorded in
/// `spine_schema_migrations`).
pub(in crate::ledger) fn migrations() -> Vec<(i64, String)> {
    vec![
        (
            1,
            [
                TYPES.put(schema::ACCOUNTS_TO_NODES),
                schema::holds(TYPES, false),
                TYPES.put(schema::REQUESTS_AND_ENTRIES),
            ]
            .concat(),
        ),
        // the model of a hold, so a hold left active by a crash can be settled with a full
        // request record (`Store::settle_stale_holds`); NULL for holds placed before
        (2, "ALTER TABLE holds ADD COLUMN model TEXT;".to_owned()),
        (3, TYPES.put(schema::ENROLLMENTS)),
        // PostgreSQL's version 3 has the same table
        (4, TYPES.put(schema::KEY_LIMITS)),
        // PostgreSQL's 5
        (5, TYPES.put(schema::HOLD_NOTES)),
        // PostgreSQL's 6
        (6, TYPES.put(schema::HELD_EARNINGS)),
        // PostgreSQL's 7
        (7, TYPES.put(schema::CONSOLE)),
        // PostgreSQL's 8
        (8, TYPES.put(schema::NODE_EARNINGS)),
    ]
}
