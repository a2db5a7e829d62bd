//! PostgreSQL's schema migrations: the shared tables ([`schema`]) in PostgreSQL's types, and
//! the parts only several instances need.

use crate::ledger::sql::schema::{self, SchemaTypes};

const TYPES: SchemaTypes = SchemaTypes::POSTGRES;

/// The index of active holds the sweeps read (PostgreSQL's first version).
const HOLDS_HELD: &str =
    "CREATE INDEX holds_held ON holds(created_at_ms, request_id) WHERE state = 'held';\n";

/// Several instances (design brief §8): the instance that placed each hold and the instances'
/// heartbeats, so a stale-hold sweep never touches a live instance's request.
const INSTANCES: &str = r#"
ALTER TABLE holds ADD COLUMN instance_id TEXT;
CREATE INDEX holds_instance ON holds(instance_id) WHERE state = 'held';
CREATE TABLE instances (
    instance_id TEXT PRIMARY KEY,
    started_at_ms BIGINT NOT NULL,
    heartbeat_at_ms BIGINT NOT NULL
);
"#;

/// Platform console users (schema version 9; SQLite rebuilds the table): a `platform` flag,
/// and [`schema::CONSOLE_USER_ONE_OWNER`] in place of version 7's account-or-operator check
/// (PostgreSQL named it `console_users_check`).
fn platform_users() -> String {
    format!(
        "ALTER TABLE console_users ADD COLUMN platform BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE console_users DROP CONSTRAINT console_users_check;
ALTER TABLE console_users ADD CONSTRAINT console_users_one_owner {};
",
        schema::CONSOLE_USER_ONE_OWNER
    )
}

/// Schema migrations `(version, sql)`, applied in order, each once (recorded in
/// `spine_schema_migrations`), all in one transaction under the migration lock.
///
/// Version 1 is SQLite's versions 1 and 2 together (PostgreSQL support started there).
pub(in crate::ledger) fn migrations() -> Vec<(i64, String)> {
    vec![
        (
            1,
            [
                TYPES.put(schema::ACCOUNTS_TO_NODES),
                schema::holds(TYPES, true),
                HOLDS_HELD.to_owned(),
                TYPES.put(schema::REQUESTS_AND_ENTRIES),
            ]
            .concat(),
        ),
        // SQLite's version 3
        (2, TYPES.put(schema::ENROLLMENTS)),
        // instances, and per-key rate limits shared by every instance (SQLite's version 4)
        (3, TYPES.put(&[INSTANCES, schema::KEY_LIMITS].concat())),
        // which process holds an instance id: two live processes under one id are refused
        (4, "ALTER TABLE instances ADD COLUMN nonce TEXT;".to_owned()),
        // SQLite's 5
        (5, TYPES.put(schema::HOLD_NOTES)),
        // SQLite's 6
        (6, TYPES.put(schema::HELD_EARNINGS)),
        // SQLite's 7
        (7, TYPES.put(schema::CONSOLE)),
        // SQLite's 8
        (8, TYPES.put(schema::NODE_EARNINGS)),
        // SQLite's 9
        (
            9,
            [platform_users(), TYPES.put(schema::PLATFORM_INDEXES)].concat(),
        ),
    ]
}
