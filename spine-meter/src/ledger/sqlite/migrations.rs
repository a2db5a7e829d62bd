//! SQLite's schema migrations: the shared tables ([`schema`]) in SQLite's types.

use crate::ledger::sql::schema::{self, SchemaTypes};

const TYPES: SchemaTypes = SchemaTypes::SQLITE;

/// Platform console users (schema version 9): SQLite cannot change a table's `CHECK`, so
/// `console_users` is rebuilt with a `platform` flag and [`schema::CONSOLE_USER_ONE_OWNER`],
/// and with it the two tables that reference it (sessions and links; copied first, the old
/// ones dropped children first, so no foreign key is ever left dangling and none is turned
/// off). Renaming a table rewrites the references to it, so the copies end up pointing at
/// `console_users` again. PostgreSQL only swaps the constraint. Also the index of active holds
/// the platform page sums (PostgreSQL has had it since its first version).
fn platform_users() -> String {
    format!(
        r#"
CREATE TABLE console_users_v9 (
    user_id TEXT PRIMARY KEY,
    email TEXT NOT NULL UNIQUE,
    password_hash TEXT,
    account_id TEXT REFERENCES accounts(id),
    operator_id TEXT REFERENCES operators(id),
    platform INTEGER NOT NULL DEFAULT FALSE,
    created_at_ms INTEGER NOT NULL,
    CONSTRAINT console_users_one_owner {check}
);
INSERT INTO console_users_v9 (user_id, email, password_hash, account_id, operator_id, created_at_ms)
    SELECT user_id, email, password_hash, account_id, operator_id, created_at_ms FROM console_users;
CREATE TABLE console_sessions_v9 (
    token_hash TEXT PRIMARY KEY,
    user_id TEXT NOT NULL REFERENCES console_users_v9(user_id),
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL,
    revoked_at_ms INTEGER
);
INSERT INTO console_sessions_v9 SELECT token_hash, user_id, created_at_ms, expires_at_ms, revoked_at_ms FROM console_sessions;
CREATE TABLE console_links_v9 (
    token_hash TEXT PRIMARY KEY,
    user_id TEXT NOT NULL REFERENCES console_users_v9(user_id),
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL,
    used_at_ms INTEGER
);
INSERT INTO console_links_v9 SELECT token_hash, user_id, created_at_ms, expires_at_ms, used_at_ms FROM console_links;
DROP TABLE console_sessions;
DROP TABLE console_links;
DROP TABLE console_users;
ALTER TABLE console_users_v9 RENAME TO console_users;
ALTER TABLE console_sessions_v9 RENAME TO console_sessions;
ALTER TABLE console_links_v9 RENAME TO console_links;
CREATE INDEX console_sessions_user ON console_sessions(user_id);
CREATE INDEX holds_held ON holds(created_at_ms, request_id) WHERE state = 'held';
"#,
        check = schema::CONSOLE_USER_ONE_OWNER
    )
}

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
        // PostgreSQL's 9
        (
            9,
            [platform_users(), TYPES.put(schema::PLATFORM_INDEXES)].concat(),
        ),
    ]
}
