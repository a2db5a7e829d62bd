//! What a console for builders and GPU operators reads and writes (issue 18): console users
//! (each belongs to exactly one account or one operator), their sessions and one-time sign-in
//! links, named and revocable API keys, and the pages' queries.
//!
//! Only hashes of secrets are stored (session tokens, sign-in links, API keys, enrollment
//! tokens); passwords arrive already hashed (the gateway uses argon2id). Every list is bounded
//! by a `limit` the caller gives (at most [`MAX_PAGE_ROWS`]) and paged by keyset
//! ([`PageCursor`]: the last row's time and id, newest first), so a page never reads the rows
//! before it; the aggregates are bounded by a time window and a row limit. Every query is
//! scoped by the account or operator it is asked for: a row of another one is never returned,
//! and a revocation of another one's key or token changes nothing.
//!
//! No query returns prompt or completion text: the store never had it.

use serde::{Deserialize, Serialize};
use spine_core::{AccountId, ModelId, NodeId, OperatorId, StreamOutcome, Usage};

use super::{KeyLimits, LedgerFuture};

/// The most rows one page or aggregate returns, whatever `limit` asks.
pub const MAX_PAGE_ROWS: u32 = 500;

/// The most of an account's request records one request-log page reads when it filters by
/// key or outcome (newest first, below the cursor, in the window): a page with fewer rows than
/// asked and a next cursor searched this many records and found no more matches there; its
/// cursor is the last record read, so the next page searches the older ones.
pub const MAX_SCANNED_PER_PAGE: u32 = 10_000;

/// Whose console user this is: a builder's (an account's) or a GPU operator's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConsoleRole {
    /// A builder: sees one account's keys, balance, usage and requests.
    Builder(AccountId),
    /// A GPU owner: sees one operator's nodes, earnings and enrollment tokens.
    Operator(OperatorId),
    /// The platform's own staff: sees every node, the traffic, revenue and fees per day,
    /// usage discrepancies and credit held (schema version 9).
    Platform,
}

/// A console user.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleUser {
    /// Its id (`cu_…`).
    pub user_id: String,
    /// The e-mail address it signs in with (unique).
    pub email: String,
    /// Whose it is.
    pub role: ConsoleRole,
    /// The password's hash (PHC string), `None` for a user that signs in by link only.
    #[serde(skip)]
    pub password_hash: Option<String>,
    /// When it was created, Unix milliseconds.
    pub created_at_ms: i64,
}

/// Where a page starts: after the row with this time and id (rows are newest first).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageCursor {
    /// The last row's time, Unix milliseconds.
    pub at_ms: i64,
    /// The last row's id (request id, key hash, …).
    pub id: String,
}

impl PageCursor {
    /// The cursor as one URL-safe token (`<at_ms>.<id>`).
    #[must_use]
    pub fn encode(&self) -> String {
        format!("{}.{}", self.at_ms, self.id)
    }

    /// The cursor from [`PageCursor::encode`]'s token; `None` when it is not one.
    #[must_use]
    pub fn decode(token: &str) -> Option<Self> {
        let (at, id) = token.split_once('.')?;
        let at_ms = at.parse().ok()?;
        (!id.is_empty() && id.len() <= 128).then(|| Self {
            at_ms,
            id: id.to_owned(),
        })
    }
}

/// One page of rows, newest first, and where the next one starts (`None`: this was the last).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Page<T> {
    /// The rows.
    pub rows: Vec<T>,
    /// The cursor of the next page.
    pub next: Option<PageCursor>,
}

/// An API key as its account's console lists it (never the key: only its hash and a hint).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiKeyInfo {
    /// The key's hash (its id in URLs and in request records).
    pub key_hash: String,
    /// The name given at creation, if any.
    pub name: Option<String>,
    /// The key's last four characters, when it was created with a hint.
    pub key_hint: Option<String>,
    /// When it was created, Unix milliseconds.
    pub created_at_ms: i64,
    /// When it was revoked, if it was.
    pub revoked_at_ms: Option<i64>,
    /// Its own rate limits (`None` fields: the gateway's defaults).
    pub limits: KeyLimits,
}

/// Which of an account's requests a request-log page shows (every field optional: `None`
/// matches all).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestFilter {
    /// Requests made with this key (its hash).
    pub key_hash: Option<String>,
    /// Requests for this model.
    pub model: Option<String>,
    /// Requests that ended so (`completed`, `client_cancelled`, …).
    pub outcome: Option<String>,
    /// Settled at or after, Unix milliseconds.
    pub since_ms: Option<i64>,
    /// Settled before, Unix milliseconds.
    pub until_ms: Option<i64>,
}

/// One request as the request log shows it: numbers only, never prompt or completion text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestSummary {
    /// The request.
    pub request_id: String,
    /// When it was settled, Unix milliseconds.
    pub created_at_ms: i64,
    /// The key it was made with (hash), when recorded.
    pub key_hash: Option<String>,
    /// The model requested.
    pub model: ModelId,
    /// How it ended.
    pub outcome: StreamOutcome,
    /// The usage billed (the gateway's count).
    pub billed: Usage,
    /// The node's claim.
    pub claimed: Option<Usage>,
    /// Whether claim and count disagreed beyond the tolerance.
    pub discrepancy: bool,
    /// Hold to settlement, milliseconds (the request's time in the gateway), when recorded.
    pub duration_ms: Option<i64>,
    /// Time to the first generated content of a streamed answer, milliseconds
    /// ([`Settlement::ttft_ms`](super::Settlement::ttft_ms)).
    pub ttft_ms: Option<i64>,
    /// Taken from the account, micros.
    pub debit_micros: u64,
    /// The node that served it.
    pub node: Option<NodeId>,
}

/// Usage of one day, model and key (an account's usage page).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageDay {
    /// Days since the Unix epoch (UTC).
    pub day: i64,
    /// The model.
    pub model: ModelId,
    /// The key (hash), `None` for requests recorded without one.
    pub key_hash: Option<String>,
    /// Requests settled.
    pub requests: u64,
    /// Prompt tokens billed.
    pub prompt_tokens: u64,
    /// Completion tokens billed.
    pub completion_tokens: u64,
    /// Taken from the account, micros.
    pub debit_micros: u64,
}

/// One credit added to an account.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreditEntry {
    /// Its idempotency key.
    pub idempotency_key: String,
    /// The amount, micros.
    pub amount_micros: u64,
    /// When, Unix milliseconds.
    pub created_at_ms: i64,
}

/// An operator's requests served and earnings of one day and model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EarningsDay {
    /// Days since the Unix epoch (UTC).
    pub day: i64,
    /// The model.
    pub model: ModelId,
    /// Requests its nodes served to the end (outcome `completed`).
    pub requests_served: u64,
    /// Completion tokens billed for them (every outcome).
    pub completion_tokens: u64,
    /// Operator credits paid (not held in escrow, not forfeited), micros.
    pub earned_micros: u64,
}

/// An enrollment token as its operator's console lists it (only its hash).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnrollmentInfo {
    /// The token's hash (its id in URLs).
    pub token_hash: String,
    /// When it was issued, Unix milliseconds.
    pub created_at_ms: i64,
    /// Until when it can be redeemed.
    pub expires_at_ms: i64,
    /// The node it registered, once redeemed.
    pub node: Option<NodeId>,
    /// When it was revoked, if it was.
    pub revoked_at_ms: Option<i64>,
}

/// The whole platform's traffic and money of one UTC day (the platform page), summed from the
/// daily roll-ups over every account and operator.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlatformDay {
    /// Days since the Unix epoch (UTC).
    pub day: i64,
    /// Requests settled.
    pub requests: u64,
    /// Prompt tokens billed.
    pub prompt_tokens: u64,
    /// Completion tokens billed.
    pub completion_tokens: u64,
    /// Revenue: taken from callers (Σ debits), micros.
    pub debit_micros: u64,
    /// Operator credits paid for that day's requests (escrow counts once paid), micros.
    /// `debit_micros - operator_credit_micros` is the platform's fee plus credit still held in
    /// escrow or forfeited.
    pub operator_credit_micros: u64,
}

/// One operator's requests served and credits paid in a window (the platform's node list).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorWindow {
    /// The operator.
    pub operator: OperatorId,
    /// Requests its nodes served to the end.
    pub requests_served: u64,
    /// Operator credits paid, micros.
    pub earned_micros: u64,
}

/// A node as the platform lists it (every operator's).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// The node.
    pub node_id: NodeId,
    /// Its operator.
    pub operator: OperatorId,
    /// The name it enrolled with, if any.
    pub name: Option<String>,
    /// When it was registered, Unix milliseconds.
    pub created_at_ms: i64,
}

/// A request whose node's usage claim disagreed with the gateway's count (numbers only).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiscrepancyRecord {
    /// The request.
    pub request_id: String,
    /// When it was settled, Unix milliseconds.
    pub created_at_ms: i64,
    /// The caller's account.
    pub account: AccountId,
    /// The node that served it and its operator.
    pub node: Option<NodeId>,
    /// The node's operator.
    pub operator: Option<OperatorId>,
    /// The model.
    pub model: ModelId,
    /// The usage billed (the gateway's count).
    pub billed: Usage,
    /// The node's claim.
    pub claimed: Option<Usage>,
}

/// Credit held now: by holds of requests in flight (callers' credit reserved) and in escrow
/// (operator credit withheld while a node's audit is suspect).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldCredit {
    /// Active holds.
    pub holds: u64,
    /// Credit they hold, micros.
    pub hold_micros: u64,
    /// When the oldest was placed, Unix milliseconds.
    pub oldest_hold_at_ms: Option<i64>,
    /// Requests whose operator credit is held in escrow.
    pub escrow_requests: u64,
    /// That credit, micros.
    pub escrow_micros: u64,
}

/// What the console needs from the store. Object safe; [`Store::console`](super::Store::console)
/// hands it out. Implemented by both SQL stores with the same SQL.
pub trait ConsoleStore: Send + Sync + std::fmt::Debug + 'static {
    /// Creates a console user of `role`, with an optional password hash.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Duplicate`](super::LedgerError::Duplicate) (`what = "console user"`) when
    /// the id or e-mail exists; [`LedgerError::UnknownAccount`](super::LedgerError::UnknownAccount)
    /// or [`LedgerError::UnknownOperator`](super::LedgerError::UnknownOperator).
    fn create_console_user<'a>(&'a self, user: &'a ConsoleUser) -> LedgerFuture<'a, ()>;

    /// The user with this e-mail address.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError), [`LedgerError::Corrupt`](super::LedgerError::Corrupt).
    fn console_user_by_email<'a>(&'a self, email: &'a str)
        -> LedgerFuture<'a, Option<ConsoleUser>>;

    /// Stores a session (its token's hash) for `user_id`, valid until `expires_at_ms`.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError).
    fn create_console_session<'a>(
        &'a self,
        token_hash: &'a str,
        user_id: &'a str,
        expires_at_ms: i64,
    ) -> LedgerFuture<'a, ()>;

    /// The user of a live session (not revoked, not expired at `now_ms`).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError), [`LedgerError::Corrupt`](super::LedgerError::Corrupt).
    fn console_session<'a>(
        &'a self,
        token_hash: &'a str,
        now_ms: i64,
    ) -> LedgerFuture<'a, Option<ConsoleUser>>;

    /// Revokes one session (sign-out); idempotent.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError).
    fn revoke_console_session<'a>(&'a self, token_hash: &'a str) -> LedgerFuture<'a, ()>;

    /// Revokes every live session of a user; returns how many.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError).
    fn revoke_console_sessions<'a>(&'a self, user_id: &'a str) -> LedgerFuture<'a, u64>;

    /// Stores a one-time sign-in link (its token's hash) for `user_id`.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError); [`LedgerError::Duplicate`](super::LedgerError::Duplicate).
    fn create_console_link<'a>(
        &'a self,
        token_hash: &'a str,
        user_id: &'a str,
        expires_at_ms: i64,
    ) -> LedgerFuture<'a, ()>;

    /// Uses a sign-in link: once, before it expires (at `now_ms`); its user, else `None`.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError).
    fn redeem_console_link<'a>(
        &'a self,
        token_hash: &'a str,
        now_ms: i64,
    ) -> LedgerFuture<'a, Option<ConsoleUser>>;

    /// Creates an API key for `account` with a name and a hint (its last characters).
    ///
    /// # Errors
    ///
    /// As [`Store::create_api_key`](super::Store::create_api_key).
    fn create_named_api_key<'a>(
        &'a self,
        account: &'a AccountId,
        key_hash: &'a str,
        name: &'a str,
        key_hint: &'a str,
    ) -> LedgerFuture<'a, ()>;

    /// A page of an account's keys, newest first (revoked ones too).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError), [`LedgerError::Corrupt`](super::LedgerError::Corrupt).
    fn account_keys<'a>(
        &'a self,
        account: &'a AccountId,
        after: Option<&'a PageCursor>,
        limit: u32,
    ) -> LedgerFuture<'a, Page<ApiKeyInfo>>;

    /// Revokes `account`'s key `key_hash`; `false` when the account has no such live key.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError).
    fn revoke_api_key<'a>(
        &'a self,
        account: &'a AccountId,
        key_hash: &'a str,
    ) -> LedgerFuture<'a, bool>;

    /// A page of an account's settled requests matching `filter`, newest first.
    ///
    /// A key or outcome filter searches at most [`MAX_SCANNED_PER_PAGE`] of the account's
    /// records (of the model's, with a model filter) below `after`: when those hold fewer than
    /// `limit` matches, the page has the matches found and, unless no older record is left,
    /// a next cursor at the last record searched (fewer rows than `limit` with a next cursor:
    /// "no more matches in the records searched"). Paging never skips or repeats a record.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError), [`LedgerError::Corrupt`](super::LedgerError::Corrupt).
    fn account_requests<'a>(
        &'a self,
        account: &'a AccountId,
        filter: &'a RequestFilter,
        after: Option<&'a PageCursor>,
        limit: u32,
    ) -> LedgerFuture<'a, Page<RequestSummary>>;

    /// An account's usage per day × model × key for the UTC days that start in
    /// `[since_ms, until_ms)`, newest day first, at most `limit` rows (read from a daily
    /// roll-up kept at settlement).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError), [`LedgerError::Corrupt`](super::LedgerError::Corrupt).
    fn account_usage<'a>(
        &'a self,
        account: &'a AccountId,
        since_ms: i64,
        until_ms: i64,
        limit: u32,
    ) -> LedgerFuture<'a, Vec<UsageDay>>;

    /// A page of the credits added to an account, newest first.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError), [`LedgerError::Corrupt`](super::LedgerError::Corrupt).
    fn account_credits<'a>(
        &'a self,
        account: &'a AccountId,
        after: Option<&'a PageCursor>,
        limit: u32,
    ) -> LedgerFuture<'a, Page<CreditEntry>>;

    /// An operator's requests served and earnings per day × model for the UTC days that start
    /// in `[since_ms, until_ms)`, newest day first, at most `limit` rows (read from a daily
    /// roll-up kept at settlement; escrowed credit counts once paid).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError), [`LedgerError::Corrupt`](super::LedgerError::Corrupt).
    fn operator_earnings<'a>(
        &'a self,
        operator: &'a OperatorId,
        since_ms: i64,
        until_ms: i64,
        limit: u32,
    ) -> LedgerFuture<'a, Vec<EarningsDay>>;

    /// A page of an operator's enrollment tokens, newest first.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError).
    fn operator_enrollments<'a>(
        &'a self,
        operator: &'a OperatorId,
        after: Option<&'a PageCursor>,
        limit: u32,
    ) -> LedgerFuture<'a, Page<EnrollmentInfo>>;

    /// Revokes `operator`'s unredeemed enrollment token (it expires now); `false` when the
    /// operator has no such unredeemed, unrevoked token.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError).
    fn revoke_enrollment<'a>(
        &'a self,
        operator: &'a OperatorId,
        token_hash: &'a str,
    ) -> LedgerFuture<'a, bool>;

    /// The platform's traffic and money per UTC day for the days that start in
    /// `[since_ms, until_ms)`, newest first, at most `limit` days (summed from the daily
    /// roll-ups' rows of those days, never from the request records).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError), [`LedgerError::Corrupt`](super::LedgerError::Corrupt).
    fn platform_days(
        &self,
        since_ms: i64,
        until_ms: i64,
        limit: u32,
    ) -> LedgerFuture<'_, Vec<PlatformDay>>;

    /// Each operator's requests served and credits paid for the days that start in
    /// `[since_ms, until_ms)` (the earnings roll-up), most earned first, at most `limit`.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError), [`LedgerError::Corrupt`](super::LedgerError::Corrupt).
    fn platform_operators(
        &self,
        since_ms: i64,
        until_ms: i64,
        limit: u32,
    ) -> LedgerFuture<'_, Vec<OperatorWindow>>;

    /// A page of every operator's nodes, newest first.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError).
    fn platform_nodes<'a>(
        &'a self,
        after: Option<&'a PageCursor>,
        limit: u32,
    ) -> LedgerFuture<'a, Page<NodeInfo>>;

    /// A page of the requests with a usage discrepancy, newest first (a partial index of
    /// those records only).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError), [`LedgerError::Corrupt`](super::LedgerError::Corrupt).
    fn platform_discrepancies<'a>(
        &'a self,
        after: Option<&'a PageCursor>,
        limit: u32,
    ) -> LedgerFuture<'a, Page<DiscrepancyRecord>>;

    /// Credit held now by active holds and in escrow (partial indexes of active holds and
    /// escrowed records: bounded by what is in flight or held, not by all records).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`](super::LedgerError), [`LedgerError::Corrupt`](super::LedgerError::Corrupt).
    fn platform_held(&self) -> LedgerFuture<'_, HeldCredit>;
}
