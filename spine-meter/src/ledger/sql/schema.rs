//! The tables both stores create, written once: `{int}` stands for the store's 64-bit integer
//! column type, `{bool}` for its boolean type and `{id}` for an auto-numbered primary key
//! ([`SchemaTypes`]). Each store lists its own migrations (their versions differ: PostgreSQL
//! support started at SQLite's version 2) from these parts and its own.

/// A store's column types, put in for the placeholders of this module's statements.
#[derive(Clone, Copy, Debug)]
pub(in crate::ledger) struct SchemaTypes {
    /// 64-bit integer (`{int}`).
    pub(in crate::ledger) int: &'static str,
    /// Boolean (`{bool}`).
    pub(in crate::ledger) bool: &'static str,
    /// Auto-numbered 64-bit primary key (`{id}`).
    pub(in crate::ledger) id: &'static str,
}

impl SchemaTypes {
    /// PostgreSQL's.
    #[cfg(feature = "postgres")]
    pub(in crate::ledger) const POSTGRES: Self = Self {
        int: "BIGINT",
        bool: "BOOLEAN",
        id: "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
    };

    /// SQLite's (`INTEGER PRIMARY KEY` is the rowid).
    #[cfg(feature = "sqlite")]
    pub(in crate::ledger) const SQLITE: Self = Self {
        int: "INTEGER",
        bool: "INTEGER",
        id: "INTEGER PRIMARY KEY AUTOINCREMENT",
    };

    /// `sql` with the placeholders replaced by these types.
    pub(in crate::ledger) fn put(&self, sql: &str) -> String {
        sql.replace("{int}", self.int)
            .replace("{bool}", self.bool)
            .replace("{id}", self.id)
    }
}

/// Accounts, API keys, credits, operators and nodes (first migration).
pub(in crate::ledger) const ACCOUNTS_TO_NODES: &str = r#"
CREATE TABLE accounts (
    id TEXT PRIMARY KEY,
    balance_micros {int} NOT NULL DEFAULT 0 CHECK (balance_micros >= 0),
    held_micros {int} NOT NULL DEFAULT 0 CHECK (held_micros >= 0),
    created_at_ms {int} NOT NULL,
    CHECK (held_micros <= balance_micros)
);
CREATE TABLE api_keys (
    key_hash TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts(id),
    created_at_ms {int} NOT NULL
);
CREATE TABLE credits (
    idempotency_key TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts(id),
    amount_micros {int} NOT NULL CHECK (amount_micros >= 0),
    created_at_ms {int} NOT NULL
);
CREATE TABLE operators (
    id TEXT PRIMARY KEY,
    earned_micros {int} NOT NULL DEFAULT 0 CHECK (earned_micros >= 0),
    created_at_ms {int} NOT NULL
);
CREATE TABLE nodes (
    node_id TEXT PRIMARY KEY,
    operator_id TEXT NOT NULL REFERENCES operators(id),
    public_key_text TEXT NOT NULL UNIQUE,
    created_at_ms {int} NOT NULL
);
"#;

/// Holds as each store's first migration creates them: with the request's model column when
/// `with_model` (PostgreSQL's first version is SQLite's versions 1 and 2; SQLite's version 2
/// adds the column), in `types`.
pub(in crate::ledger) fn holds(types: SchemaTypes, with_model: bool) -> String {
    let model = if with_model { "\n    model TEXT," } else { "" };
    types.put(&format!(
        "
CREATE TABLE holds (
    request_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts(id),{model}
    amount_micros {{int}} NOT NULL CHECK (amount_micros >= 0),
    state TEXT NOT NULL CHECK (state IN ('held', 'released', 'settled')),
    created_at_ms {{int}} NOT NULL
);
"
    ))
}

/// Settled requests and the double-entry ledger entries (first migration).
pub(in crate::ledger) const REQUESTS_AND_ENTRIES: &str = r#"
CREATE TABLE requests (
    request_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    model TEXT NOT NULL,
    outcome TEXT NOT NULL,
    node_id TEXT,
    operator_id TEXT,
    billed_prompt_tokens {int} NOT NULL,
    billed_completion_tokens {int} NOT NULL,
    claimed_prompt_tokens {int},
    claimed_completion_tokens {int},
    usage_source TEXT NOT NULL,
    discrepancy {bool} NOT NULL,
    input_micros_per_mtok {int} NOT NULL,
    output_micros_per_mtok {int} NOT NULL,
    share_bps {int} NOT NULL,
    cost_micros {int} NOT NULL,
    debit_micros {int} NOT NULL,
    operator_credit_micros {int} NOT NULL,
    fee_micros {int} NOT NULL,
    hold_micros {int} NOT NULL,
    created_at_ms {int} NOT NULL
);
CREATE TABLE ledger_entries (
    id {id},
    ref TEXT NOT NULL,
    party_kind TEXT NOT NULL CHECK (party_kind IN ('account', 'operator', 'platform', 'external')),
    party_id TEXT NOT NULL,
    amount_micros {int} NOT NULL,
    created_at_ms {int} NOT NULL
);
CREATE INDEX ledger_entries_ref ON ledger_entries(ref);
"#;

/// One-time enrollment tokens (hash only), node names, and the per-node request counts the
/// operator view reads.
pub(in crate::ledger) const ENROLLMENTS: &str = r#"
ALTER TABLE nodes ADD COLUMN name TEXT;
CREATE TABLE enrollments (
    token_hash TEXT PRIMARY KEY,
    operator_id TEXT NOT NULL REFERENCES operators(id),
    expires_at_ms {int} NOT NULL,
    created_at_ms {int} NOT NULL,
    node_id TEXT REFERENCES nodes(node_id),
    redeemed_at_ms {int}
);
CREATE INDEX requests_node ON requests(node_id);
"#;

/// Per-key rate limits, kept beside the keys.
pub(in crate::ledger) const KEY_LIMITS: &str = r#"
CREATE TABLE key_limits (
    key_hash TEXT PRIMARY KEY,
    rpm_limit {int} CHECK (rpm_limit >= 0),
    tpm_limit {int} CHECK (tpm_limit >= 0),
    updated_at_ms {int} NOT NULL
);
"#;

/// What is known of a request in flight, on its hold (`Ledger::note_hold`), so a sweep's
/// record keeps the node and the usage; which sweep settled a request.
pub(in crate::ledger) const HOLD_NOTES: &str = r#"
ALTER TABLE holds ADD COLUMN node_id TEXT;
ALTER TABLE holds ADD COLUMN prompt_tokens {int};
ALTER TABLE holds ADD COLUMN completion_tokens {int};
ALTER TABLE requests ADD COLUMN swept TEXT;
"#;

/// Operator credits held in escrow while a node's model audit is suspect (design brief §10):
/// NULL = paid, 'held', 'forfeited'.
pub(in crate::ledger) const HELD_EARNINGS: &str = r#"
ALTER TABLE requests ADD COLUMN earnings TEXT;
CREATE INDEX requests_held_earnings ON requests(node_id, model) WHERE earnings = 'held';
"#;

/// The console (issue 18): console users (each of one account or one operator), their sessions
/// and one-time sign-in links (hashes only), key names and revocation, the request's key,
/// duration and TTFT, revocable enrollment tokens, the indexes the console's keyset-paged
/// queries read (newest first, per account or operator), and the daily roll-ups of usage and
/// earnings (filled from the records already there, then kept by each settlement).
pub(in crate::ledger) const CONSOLE: &str = r#"
ALTER TABLE api_keys ADD COLUMN name TEXT;
ALTER TABLE api_keys ADD COLUMN key_hint TEXT;
ALTER TABLE api_keys ADD COLUMN revoked_at_ms {int};
CREATE INDEX api_keys_account ON api_keys(account_id, created_at_ms, key_hash);
ALTER TABLE requests ADD COLUMN key_hash TEXT;
ALTER TABLE requests ADD COLUMN duration_ms {int};
ALTER TABLE requests ADD COLUMN ttft_ms {int};
CREATE INDEX requests_account_time ON requests(account_id, created_at_ms, request_id);
CREATE INDEX requests_operator_time ON requests(operator_id, created_at_ms);
CREATE INDEX credits_account_time ON credits(account_id, created_at_ms, idempotency_key);
ALTER TABLE enrollments ADD COLUMN revoked_at_ms {int};
CREATE INDEX enrollments_operator ON enrollments(operator_id, created_at_ms, token_hash);
CREATE TABLE console_users (
    user_id TEXT PRIMARY KEY,
    email TEXT NOT NULL UNIQUE,
    password_hash TEXT,
    account_id TEXT REFERENCES accounts(id),
    operator_id TEXT REFERENCES operators(id),
    created_at_ms {int} NOT NULL,
    CHECK ((account_id IS NULL) <> (operator_id IS NULL))
);
CREATE TABLE console_sessions (
    token_hash TEXT PRIMARY KEY,
    user_id TEXT NOT NULL REFERENCES console_users(user_id),
    created_at_ms {int} NOT NULL,
    expires_at_ms {int} NOT NULL,
    revoked_at_ms {int}
);
CREATE INDEX console_sessions_user ON console_sessions(user_id);
CREATE TABLE usage_daily (
    account_id TEXT NOT NULL,
    day {int} NOT NULL,
    model TEXT NOT NULL,
    key_hash TEXT NOT NULL,
    requests {int} NOT NULL,
    prompt_tokens {int} NOT NULL,
    completion_tokens {int} NOT NULL,
    debit_micros {int} NOT NULL,
    PRIMARY KEY (account_id, day, model, key_hash)
);
INSERT INTO usage_daily (account_id, day, model, key_hash, requests, prompt_tokens, completion_tokens, debit_micros)
    SELECT account_id, created_at_ms / 86400000, model, '', COUNT(*),
           SUM(billed_prompt_tokens), SUM(billed_completion_tokens), SUM(debit_micros)
    FROM requests GROUP BY account_id, created_at_ms / 86400000, model;
CREATE TABLE earnings_daily (
    operator_id TEXT NOT NULL,
    day {int} NOT NULL,
    model TEXT NOT NULL,
    requests_served {int} NOT NULL,
    completion_tokens {int} NOT NULL,
    earned_micros {int} NOT NULL,
    PRIMARY KEY (operator_id, day, model)
);
INSERT INTO earnings_daily (operator_id, day, model, requests_served, completion_tokens, earned_micros)
    SELECT operator_id, created_at_ms / 86400000, model,
           SUM(CASE WHEN outcome = 'completed' THEN 1 ELSE 0 END), SUM(billed_completion_tokens),
           SUM(CASE WHEN earnings IS NULL OR earnings = 'paid' THEN operator_credit_micros ELSE 0 END)
    FROM requests WHERE operator_id IS NOT NULL GROUP BY operator_id, created_at_ms / 86400000, model;
CREATE TABLE console_links (
    token_hash TEXT PRIMARY KEY,
    user_id TEXT NOT NULL REFERENCES console_users(user_id),
    created_at_ms {int} NOT NULL,
    expires_at_ms {int} NOT NULL,
    used_at_ms {int}
);
"#;

/// The nodes page from a roll-up (issue 18): `earnings_daily` gains the node (operator × UTC
/// day × model × node), so [`Store::operator_nodes`](crate::ledger::Store::operator_nodes)
/// sums a node's rows instead of counting its request records, and a settlement still writes
/// one `earnings_daily` row; and the request log's model filter reads an
/// `(account, model, time)` index instead of every record of the account.
///
/// Changing a primary key needs a new table on SQLite; the roll-up is refilled from the request
/// records (as version 7 filled it: requests served to the end, completion tokens billed, credit
/// paid: neither held in escrow nor forfeited), so the old table is dropped first and the new
/// one keeps its name (and, on PostgreSQL, its primary key's name). A record's node is never
/// NULL when it has an operator (the operator is the node's); `''` stands in if one were.
pub(in crate::ledger) const NODE_EARNINGS: &str = r#"
DROP TABLE earnings_daily;
CREATE TABLE earnings_daily (
    operator_id TEXT NOT NULL,
    day {int} NOT NULL,
    model TEXT NOT NULL,
    node_id TEXT NOT NULL,
    requests_served {int} NOT NULL,
    completion_tokens {int} NOT NULL,
    earned_micros {int} NOT NULL,
    PRIMARY KEY (operator_id, day, model, node_id)
);
INSERT INTO earnings_daily (operator_id, day, model, node_id, requests_served, completion_tokens, earned_micros)
    SELECT operator_id, created_at_ms / 86400000, model, COALESCE(node_id, ''),
           SUM(CASE WHEN outcome = 'completed' THEN 1 ELSE 0 END), SUM(billed_completion_tokens),
           SUM(CASE WHEN earnings IS NULL OR earnings = 'paid' THEN operator_credit_micros ELSE 0 END)
    FROM requests WHERE operator_id IS NOT NULL
    GROUP BY operator_id, created_at_ms / 86400000, model, COALESCE(node_id, '');
CREATE INDEX requests_account_model_time ON requests(account_id, model, created_at_ms, request_id);
"#;

/// Exactly one owner of a console user (schema version 9): an account (a builder), an operator
/// (a GPU operator), or the platform (`platform`: the gateway's own staff).
pub(in crate::ledger) const CONSOLE_USER_ONE_OWNER: &str = "CHECK ((CASE WHEN account_id IS NULL THEN 0 ELSE 1 END) \
     + (CASE WHEN operator_id IS NULL THEN 0 ELSE 1 END) + (CASE WHEN platform THEN 1 ELSE 0 END) = 1)";

/// The platform page's indexes (schema version 9): the roll-ups by day across every account
/// and operator, the records with a usage discrepancy (newest first) and the nodes by time, so
/// each of its queries reads a bounded range.
pub(in crate::ledger) const PLATFORM_INDEXES: &str = r#"
CREATE INDEX usage_daily_day ON usage_daily(day);
CREATE INDEX earnings_daily_day ON earnings_daily(day, operator_id);
CREATE INDEX requests_discrepancy ON requests(created_at_ms, request_id) WHERE discrepancy;
CREATE INDEX nodes_time ON nodes(created_at_ms, node_id);
"#;
