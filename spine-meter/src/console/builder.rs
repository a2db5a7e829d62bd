//! A builder's pages: API keys, balance and credit history, usage (table, chart, CSV), the
//! request log, the playground. Every query is the signed-in user's account's.

use std::collections::HashMap;
use std::sync::Arc;

use crate::keys;
use crate::ledger::{
    ApiKeyInfo, ConsoleRole, ConsoleUser, PageCursor, RequestFilter, MAX_SCANNED_PER_PAGE,
};
use crate::limits::KeyHash;
use crate::KeyLimits;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use http::{header, HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use spine_core::AccountId;
use tower::ServiceExt;

use super::auth::{csrf_token, require_post, require_user};
use super::{with_role, ConsoleState, Page, PageUser};

/// Rows per page of the request log and the credit history.
const PAGE_ROWS: u32 = 50;
/// Keys listed (and named in the request log); an account with more sees the newest.
const KEYS_LISTED: u32 = 200;
/// The longest key name kept, characters.
const MAX_KEY_NAME_CHARS: usize = 64;

pub(super) fn routes() -> Router<Arc<ConsoleState>> {
    Router::new()
        .route("/console/keys", get(keys_page).post(create_key))
        .route("/console/keys/revoke", post(revoke_key))
        .route("/console/keys/limits", post(set_key_limits))
        .route("/console/balance", get(balance_page))
        .route("/console/usage", get(usage_page))
        .route("/console/usage.csv", get(usage_csv))
        .route("/console/requests", get(requests_page))
        .route("/console/playground", get(playground_page))
        .route("/console/playground/chat", post(playground_chat))
}

/// The builder's account of `role`; `None` for another role.
fn builder_account(role: &ConsoleRole) -> Option<AccountId> {
    match role {
        ConsoleRole::Builder(account) => Some(account.clone()),
        ConsoleRole::Operator(_) | ConsoleRole::Platform => None,
    }
}

/// What a user of another role is told here (403).
const BUILDERS_ONLY: &str = "This page is for builders.";

/// The signed-in builder's account; operators get 403.
async fn builder(
    s: &ConsoleState,
    headers: &HeaderMap,
) -> Result<(ConsoleUser, String, AccountId), Response> {
    let found = require_user(s, headers).await?;
    with_role(s, found, builder_account, BUILDERS_ONLY)
}

/// As [`builder`], for a state-changing request (CSRF checked).
async fn builder_post(
    s: &ConsoleState,
    headers: &HeaderMap,
    csrf: Option<&str>,
) -> Result<(ConsoleUser, String, AccountId), Response> {
    let found = require_post(s, headers, csrf).await?;
    with_role(s, found, builder_account, BUILDERS_ONLY)
}

/// A key as the keys page shows it.
#[derive(Serialize)]
struct KeyRow {
    key_hash: String,
    name: String,
    hint: String,
    created_at_ms: i64,
    revoked: bool,
    /// The key's RPM limit in force (0 = unlimited).
    rpm_limit: u32,
    /// The key's TPM limit in force (0 = unlimited).
    tpm_limit: u64,
}

fn key_rows(s: &ConsoleState, keys: Vec<ApiKeyInfo>) -> Vec<KeyRow> {
    keys.into_iter()
        .map(|k| {
            let (rpm_limit, tpm_limit) =
                s.host.rate_limits().effective(&KeyHash(k.key_hash.clone()));
            KeyRow {
                name: k.name.unwrap_or_default(),
                hint: k.key_hint.map(|h| format!("…{h}")).unwrap_or_default(),
                created_at_ms: k.created_at_ms,
                revoked: k.revoked_at_ms.is_some(),
                rpm_limit,
                tpm_limit,
                key_hash: k.key_hash,
            }
        })
        .collect()
}

/// The keys page, with `new_key` shown when one was just created (the only time it is).
async fn render_keys(
    s: &ConsoleState,
    user: &ConsoleUser,
    token: &str,
    account: &AccountId,
    new_key: Option<(String, String)>,
) -> Page {
    let page = s.stored(s.store.account_keys(account, None, KEYS_LISTED).await)?;
    let (default_rpm, default_tpm) = s.host.rate_limits().defaults();
    Ok(s.render(
        "keys.html",
        minijinja::context! {
            user => PageUser::of(user), csrf => csrf_token(token),
            default_rpm => default_rpm, default_tpm => default_tpm,
            keys => key_rows(s, page.rows), new_key => new_key.as_ref().map(|(k, _)| k),
            new_key_name => new_key.as_ref().map(|(_, n)| n),
        },
    ))
}

async fn keys_page(State(s): State<Arc<ConsoleState>>, headers: HeaderMap) -> Page {
    let (user, token, account) = builder(&s, &headers).await?;
    render_keys(&s, &user, &token, &account, None).await
}

#[derive(Deserialize)]
struct CreateKeyForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    name: String,
    /// Requests per minute; empty: the gateway's default.
    #[serde(default)]
    rpm: String,
    /// Tokens per minute; empty: the gateway's default.
    #[serde(default)]
    tpm: String,
}

/// The RPM/TPM limits a key form asks for (`rpm`, `tpm`: whole numbers; empty = the gateway's
/// default), within the gateway's defaults ([`RateLimits::within_defaults`]); else what is
/// allowed, for the 400 page.
///
/// [`RateLimits::within_defaults`]: crate::limits::RateLimits::within_defaults
fn asked_limits(s: &ConsoleState, rpm: &str, tpm: &str) -> Result<KeyLimits, String> {
    fn parse(v: &str) -> Result<Option<u64>, ()> {
        match v.trim() {
            "" => Ok(None),
            v => match v.parse::<u64>() {
                // the store keeps a signed 64-bit integer
                Ok(n) if i64::try_from(n).is_ok() => Ok(Some(n)),
                _ => Err(()),
            },
        }
    }
    let asked = match (parse(rpm), parse(tpm)) {
        (Ok(r), Ok(tpm_limit)) => {
            r.map(u32::try_from)
                .transpose()
                .ok()
                .map(|rpm_limit| KeyLimits {
                    rpm_limit,
                    tpm_limit,
                })
        }
        _ => None,
    };
    match asked {
        Some(l) if s.host.rate_limits().within_defaults(l) => Ok(l),
        _ => {
            let (rpm, tpm) = s.host.rate_limits().defaults();
            let allowed = |d: u64| match d {
                0 => "a whole number (0: unlimited)".to_owned(),
                d => format!("a whole number from 1 to {d}"),
            };
            Err(format!(
                "The RPM limit must be {}, the TPM limit {}.",
                allowed(rpm.into()),
                allowed(tpm)
            ))
        }
    }
}

/// `POST /console/keys`: a new key for the account, shown once in this answer.
async fn create_key(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Form(form): Form<CreateKeyForm>,
) -> Page {
    let (user, token, account) = builder_post(&s, &headers, form.csrf.as_deref()).await?;
    let limits = asked_limits(&s, &form.rpm, &form.tpm)
        .map_err(|allowed| s.error(StatusCode::BAD_REQUEST, &allowed))?;
    let name: String = form.name.trim().chars().take(MAX_KEY_NAME_CHARS).collect();
    let key = keys::new_api_key();
    let hint: String = key
        .chars()
        .rev()
        .take(4)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let key_hash = keys::hash_api_key(&key);
    s.stored(
        s.store
            .create_named_api_key(&account, &key_hash, &name, &hint)
            .await,
    )?;
    save_key_limits(
        &s,
        key_hash,
        limits,
        StatusCode::INTERNAL_SERVER_ERROR,
        "The key was created but its limits could not be saved; revoke it and try again.",
    )
    .await?;
    tracing::info!(account = %account, "console key created");
    render_keys(&s, &user, &token, &account, Some((key, name))).await
}

#[derive(Deserialize)]
struct RevokeKeyForm {
    #[serde(default)]
    csrf: Option<String>,
    key_hash: String,
}

/// `POST /console/keys/revoke`: revokes one of the account's keys (another account's key hash
/// changes nothing: 404).
async fn revoke_key(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Form(form): Form<RevokeKeyForm>,
) -> Page {
    let (_, _, account) = builder_post(&s, &headers, form.csrf.as_deref()).await?;
    if !s.stored(s.store.revoke_api_key(&account, &form.key_hash).await)? {
        return Err(s.error(StatusCode::NOT_FOUND, "No such key."));
    }
    s.host.forget_key(&form.key_hash);
    Ok(Redirect::to("/console/keys").into_response())
}

#[derive(Deserialize)]
struct KeyLimitsForm {
    #[serde(default)]
    csrf: Option<String>,
    key_hash: String,
    #[serde(default)]
    rpm: String,
    #[serde(default)]
    tpm: String,
}

/// `POST /console/keys/limits`: new RPM and TPM limits for one of the account's live keys
/// (both given, within the gateway's defaults; another account's key: 404). Other instances
/// see them within their 10 s cache of a key's limits.
async fn set_key_limits(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Form(form): Form<KeyLimitsForm>,
) -> Page {
    let (_, _, account) = builder_post(&s, &headers, form.csrf.as_deref()).await?;
    let limits = match asked_limits(&s, &form.rpm, &form.tpm) {
        Ok(l) if l.rpm_limit.is_some() && l.tpm_limit.is_some() => l,
        Ok(_) => return Err(s.error(StatusCode::BAD_REQUEST, "Give both limits.")),
        Err(allowed) => return Err(s.error(StatusCode::BAD_REQUEST, &allowed)),
    };
    owns_live_key(
        &s,
        &account,
        &form.key_hash,
        StatusCode::NOT_FOUND,
        "No such live key.",
    )
    .await?;
    save_key_limits(
        &s,
        form.key_hash,
        limits,
        StatusCode::SERVICE_UNAVAILABLE,
        "The limits could not be saved; try again.",
    )
    .await?;
    Ok(Redirect::to("/console/keys").into_response())
}

/// Nothing when `key_hash` is a live key of `account`; else the `status` page with `refusal`
/// (another account's key, a revoked or unknown one), or the store's error page.
async fn owns_live_key(
    s: &ConsoleState,
    account: &AccountId,
    key_hash: &str,
    status: StatusCode,
    refusal: &str,
) -> Result<(), Response> {
    match s.stored(s.host.store().account_for_key_hash(key_hash).await)? {
        Some(owner) if owner == *account => Ok(()),
        _ => Err(s.error(status, refusal)),
    }
}

/// Saves `limits` for the key `key_hash` (every instance's limiter reads them); when they
/// cannot be saved, logs why and answers the `status` page with `message`.
async fn save_key_limits(
    s: &ConsoleState,
    key_hash: String,
    limits: KeyLimits,
    status: StatusCode,
    message: &str,
) -> Result<(), Response> {
    s.host
        .rate_limits()
        .set_key_limits(&KeyHash(key_hash), limits)
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "cannot save a console key's limits");
            s.error(status, message)
        })
}

#[derive(Deserialize, Default)]
struct PageQuery {
    #[serde(default)]
    after: Option<String>,
}

async fn balance_page(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Page {
    let (user, token, account) = builder(&s, &headers).await?;
    let after = q.after.as_deref().and_then(PageCursor::decode);
    let balance = s.stored(s.host.store().account(&account).await)?;
    let credits = s.stored(
        s.store
            .account_credits(&account, after.as_ref(), PAGE_ROWS)
            .await,
    )?;
    Ok(s.render(
        "balance.html",
        minijinja::context! {
            user => PageUser::of(&user), csrf => csrf_token(&token), balance => balance,
            credits => credits.rows, next => credits.next.map(|c| super::after_query(&c)),
        },
    ))
}

#[derive(Deserialize, Default)]
struct UsageQuery {
    #[serde(default)]
    days: Option<u32>,
}

/// Key names by hash, for the account's keys listed.
async fn key_names(s: &ConsoleState, account: &AccountId) -> HashMap<String, String> {
    match s.store.account_keys(account, None, KEYS_LISTED).await {
        Ok(p) => p
            .rows
            .into_iter()
            .map(|k| {
                let label = match (k.name.filter(|n| !n.is_empty()), k.key_hint) {
                    (Some(n), Some(h)) => format!("{n} (…{h})"),
                    (Some(n), None) => n,
                    (None, Some(h)) => format!("…{h}"),
                    (None, None) => k.key_hash.chars().take(8).collect(),
                };
                (k.key_hash, label)
            })
            .collect(),
        Err(_) => HashMap::new(),
    }
}

#[derive(Serialize)]
struct UsageRow {
    day: i64,
    model: String,
    key: String,
    requests: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
    debit_micros: u64,
}

async fn usage_rows(
    s: &ConsoleState,
    account: &AccountId,
    days: Option<u32>,
) -> Result<(Vec<UsageRow>, u32), Response> {
    let (since, until, days) = super::day_window(days);
    let names = key_names(s, account).await;
    let rows = s.stored(
        s.store
            .account_usage(account, since, until, crate::ledger::MAX_PAGE_ROWS)
            .await,
    )?;
    Ok((
        rows.into_iter()
            .map(|u| UsageRow {
                day: u.day,
                model: u.model.to_string(),
                key: u
                    .key_hash
                    .map(|h| {
                        names
                            .get(&h)
                            .cloned()
                            .unwrap_or_else(|| h.chars().take(8).collect())
                    })
                    .unwrap_or_else(|| "(admin API)".to_owned()),
                requests: u.requests,
                prompt_tokens: u.prompt_tokens,
                completion_tokens: u.completion_tokens,
                debit_micros: u.debit_micros,
            })
            .collect(),
        days,
    ))
}

async fn usage_page(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Query(q): Query<UsageQuery>,
) -> Page {
    let (user, token, account) = builder(&s, &headers).await?;
    let (rows, days) = usage_rows(&s, &account, q.days).await?;
    // the charts' series: tokens and spend per day (all models and keys), every day of the
    // window
    let (since, until, _) = super::day_window(Some(days));
    let mut per_day: std::collections::BTreeMap<i64, [u64; 3]> = (since / 86_400_000
        ..until / 86_400_000)
        .map(|d| (d, [0; 3]))
        .collect();
    for r in &rows {
        let e = per_day.entry(r.day).or_default();
        e[0] += r.prompt_tokens;
        e[1] += r.completion_tokens;
        e[2] += r.debit_micros;
    }
    let days_axis: Vec<i64> = per_day.keys().copied().collect();
    let column = |i: usize| per_day.values().map(|v| v[i] as f64).collect::<Vec<_>>();
    let charts = [
        super::chart(
            "chart",
            "Tokens per day (UTC)",
            &days_axis,
            &[
                ("prompt tokens", column(0)),
                ("completion tokens", column(1)),
            ],
        ),
        super::chart(
            "chart-spend",
            "Spend per day (UTC), credits",
            &days_axis,
            &[("spend", super::as_credits(column(2)))],
        ),
    ];
    Ok(s.render(
        "usage.html",
        minijinja::context! {
            user => PageUser::of(&user), csrf => csrf_token(&token), rows => rows, days => days,
            charts => charts,
        },
    ))
}

/// A CSV field: quoted, quotes doubled, and a leading `=`, `+`, `-` or `@` defused (a
/// spreadsheet would run it as a formula).
fn csv_field(v: &str) -> String {
    let v = if v.starts_with(['=', '+', '-', '@']) {
        format!("'{v}")
    } else {
        v.to_owned()
    };
    format!("\"{}\"", v.replace('"', "\"\""))
}

async fn usage_csv(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Query(q): Query<UsageQuery>,
) -> Page {
    let (_, _, account) = builder(&s, &headers).await?;
    let (rows, _) = usage_rows(&s, &account, q.days).await?;
    let mut csv =
        String::from("date,model,key,requests,prompt_tokens,completion_tokens,cost_credits\n");
    for r in rows {
        csv.push_str(&format!(
            "{},{},{},{},{},{},{}\n",
            super::date(r.day),
            csv_field(&r.model),
            csv_field(&r.key),
            r.requests,
            r.prompt_tokens,
            r.completion_tokens,
            super::credits(r.debit_micros)
        ));
    }
    Ok((
        [
            (header::CONTENT_TYPE, "text/csv; charset=utf-8"),
            (
                header::CONTENT_DISPOSITION,
                "attachment; filename=\"usage.csv\"",
            ),
            (header::CACHE_CONTROL, "no-store"),
        ],
        csv,
    )
        .into_response())
}

#[derive(Deserialize, Default)]
struct RequestsQuery {
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    outcome: Option<String>,
    /// `YYYY-MM-DD`: requests on this UTC day.
    #[serde(default)]
    day: Option<String>,
    #[serde(default)]
    after: Option<String>,
}

/// `YYYY-MM-DD` as days since the Unix epoch.
fn parse_day(s: &str) -> Option<i64> {
    let mut it = s.splitn(3, '-');
    let y: i64 = it.next()?.parse().ok()?;
    let m: i64 = it.next()?.parse().ok()?;
    let d: i64 = it.next()?.parse().ok()?;
    if !(1970..=9999).contains(&y) || !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    // Howard Hinnant's days_from_civil
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    Some(era * 146_097 + doe - 719_468)
}

/// `n` with a comma between each three digits (`10,000`).
fn with_thousands(n: u32) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A filter value: trimmed, empty = none, at most 128 characters.
fn filter_value(v: Option<String>) -> Option<String> {
    v.map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty() && v.len() <= 128)
}

#[derive(Serialize)]
struct RequestRow {
    request_id: String,
    created_at_ms: i64,
    key: String,
    model: String,
    outcome: &'static str,
    billed_prompt_tokens: u64,
    billed_completion_tokens: u64,
    claimed_prompt_tokens: Option<u64>,
    claimed_completion_tokens: Option<u64>,
    discrepancy: bool,
    duration_ms: Option<i64>,
    ttft_ms: Option<i64>,
    debit_micros: u64,
    node: Option<String>,
}

async fn requests_page(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Query(q): Query<RequestsQuery>,
) -> Page {
    let (user, token, account) = builder(&s, &headers).await?;
    let day = q.day.as_deref().and_then(parse_day);
    let filter = RequestFilter {
        key_hash: filter_value(q.key.clone()),
        model: filter_value(q.model.clone()),
        outcome: filter_value(q.outcome.clone()),
        since_ms: day.map(|d| d * 86_400_000),
        until_ms: day.map(|d| (d + 1) * 86_400_000),
    };
    let after = q.after.as_deref().and_then(PageCursor::decode);
    let page = s.stored(
        s.store
            .account_requests(&account, &filter, after.as_ref(), PAGE_ROWS)
            .await,
    )?;
    // fewer rows than a page and a next cursor: the store searched its bound of records and
    // found no more matches there; the next page searches the older ones
    let searched = (page.next.is_some() && page.rows.len() < PAGE_ROWS as usize)
        .then(|| with_thousands(MAX_SCANNED_PER_PAGE));
    let names = key_names(&s, &account).await;
    let rows: Vec<RequestRow> = page
        .rows
        .into_iter()
        .map(|r| RequestRow {
            key: r
                .key_hash
                .map(|h| {
                    names
                        .get(&h)
                        .cloned()
                        .unwrap_or_else(|| h.chars().take(8).collect())
                })
                .unwrap_or_else(|| "(admin API)".to_owned()),
            request_id: r.request_id,
            created_at_ms: r.created_at_ms,
            model: r.model.to_string(),
            outcome: r.outcome.as_str(),
            billed_prompt_tokens: r.billed.prompt_tokens,
            billed_completion_tokens: r.billed.completion_tokens,
            claimed_prompt_tokens: r.claimed.map(|c| c.prompt_tokens),
            claimed_completion_tokens: r.claimed.map(|c| c.completion_tokens),
            discrepancy: r.discrepancy,
            duration_ms: r.duration_ms,
            ttft_ms: r.ttft_ms,
            debit_micros: r.debit_micros,
            node: r.node.map(|n| n.to_string()),
        })
        .collect();
    let mut key_options: Vec<(String, String)> = names.into_iter().collect();
    key_options.sort_by(|a, b| a.1.cmp(&b.1));
    // the next page keeps the filters: a query string built here, escaped by the template
    let next = page.next.map(|c| {
        let mut qs = vec![("after", c.encode())];
        for (k, v) in [
            ("key", &filter.key_hash),
            ("model", &filter.model),
            ("outcome", &filter.outcome),
        ] {
            if let Some(v) = v {
                qs.push((k, v.clone()));
            }
        }
        if let Some(d) = &q.day {
            qs.push(("day", d.clone()));
        }
        serde_urlencoded::to_string(qs).unwrap_or_default()
    });
    Ok(s.render(
        "requests.html",
        minijinja::context! {
            user => PageUser::of(&user), csrf => csrf_token(&token), rows => rows, next => next,
            searched => searched, keys => key_options, filter => filter, day => q.day,
            outcomes => ["completed", "client_cancelled", "upstream_failed", "rejected", "cut_at_bound"],
            models => s.host.models().iter().map(ToString::to_string).collect::<Vec<_>>(),
        },
    ))
}

async fn playground_page(State(s): State<Arc<ConsoleState>>, headers: HeaderMap) -> Page {
    let (user, token, _) = builder(&s, &headers).await?;
    Ok(s.render(
        "playground.html",
        minijinja::context! {
            user => PageUser::of(&user), csrf => csrf_token(&token),
            models => s.host.models().iter().map(ToString::to_string).collect::<Vec<_>>(),
        },
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatForm {
    key: String,
    model: String,
    prompt: String,
    #[serde(default)]
    max_tokens: Option<u32>,
}

/// `POST /console/playground/chat` (JSON; CSRF token in `x-csrf-token`): streams a chat
/// through the gateway's own public API, called in process, with the key the builder pasted
/// (one of the account's keys; the request is metered and billed to it like any other).
async fn playground_chat(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Page {
    let csrf = headers.get("x-csrf-token").and_then(|v| v.to_str().ok());
    let (_, _, account) = builder_post(&s, &headers, csrf).await?;
    let Ok(form) = serde_json::from_slice::<ChatForm>(&body) else {
        return Err(s.error(
            StatusCode::BAD_REQUEST,
            "Expected {key, model, prompt, max_tokens}.",
        ));
    };
    owns_live_key(
        &s,
        &account,
        &keys::hash_api_key(form.key.trim()),
        StatusCode::FORBIDDEN,
        "That is not a live key of this account.",
    )
    .await?;
    let chat = serde_json::json!({
        "model": form.model,
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": form.max_tokens.unwrap_or(64).clamp(1, 1024),
        "messages": [{"role": "user", "content": form.prompt}],
    });
    let Ok(req) = http::Request::post("/v1/chat/completions")
        .header(header::AUTHORIZATION, format!("Bearer {}", form.key.trim()))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(chat.to_string()))
    else {
        return Err(s.error(
            StatusCode::BAD_REQUEST,
            "The key is not a valid header value.",
        ));
    };
    match s.public_api.clone().oneshot(req).await {
        Ok(mut r) => {
            r.headers_mut().insert(
                header::CACHE_CONTROL,
                http::HeaderValue::from_static("no-store"),
            );
            Ok(r)
        }
        Err(never) => match never {},
    }
}

#[cfg(test)]
mod tests;
