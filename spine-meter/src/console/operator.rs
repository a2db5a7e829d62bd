//! A GPU operator's pages: nodes (the router's and the tunnel's live view of the operator's
//! own nodes), earnings per day × model, enrollment tokens. Every query is the signed-in
//! user's operator's.

use std::sync::Arc;

use crate::keys;
use crate::ledger::{ConsoleRole, ConsoleUser, PageCursor};
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use spine_core::{NodeId, OperatorId};

use super::auth::{csrf_token, require_post, require_user};
use super::{after_query, with_role, ConsoleState, Page, PageUser};

/// How long a token issued from the console stays valid (as the admin API's default: 24 h).
const ENROLLMENT_TTL_MS: i64 = 24 * 3_600_000;

pub(super) fn routes() -> Router<Arc<ConsoleState>> {
    Router::new()
        .route("/console/nodes", get(nodes_page))
        .route("/console/earnings", get(earnings_page))
        .route(
            "/console/enrollments",
            get(enrollments_page).post(issue_enrollment),
        )
        .route("/console/enrollments/revoke", post(revoke_enrollment))
}

/// The operator of `role`; `None` for another role.
fn operator_id(role: &ConsoleRole) -> Option<OperatorId> {
    match role {
        ConsoleRole::Operator(op) => Some(op.clone()),
        ConsoleRole::Builder(_) | ConsoleRole::Platform => None,
    }
}

/// What a user of another role is told here (403).
const OPERATORS_ONLY: &str = "This page is for GPU operators.";

async fn operator(
    s: &ConsoleState,
    headers: &HeaderMap,
) -> Result<(ConsoleUser, String, OperatorId), Response> {
    let found = require_user(s, headers).await?;
    with_role(s, found, operator_id, OPERATORS_ONLY)
}

async fn operator_post(
    s: &ConsoleState,
    headers: &HeaderMap,
    csrf: Option<&str>,
) -> Result<(ConsoleUser, String, OperatorId), Response> {
    let found = require_post(s, headers, csrf).await?;
    with_role(s, found, operator_id, OPERATORS_ONLY)
}

/// One node as the nodes pages (an operator's, the platform's) show it.
#[derive(Serialize)]
pub(super) struct NodeRow {
    node_id: String,
    name: String,
    /// Its operator (the platform's list only).
    pub(super) operator: Option<String>,
    connected: bool,
    routable: bool,
    models: Vec<String>,
    /// `score (success · latency · uptime · penalty)`, formatted.
    score: Option<String>,
    ttft_ema_ms: Option<String>,
    in_flight: Option<u32>,
    sticky_hits: Option<u64>,
    sticky_misses: Option<u64>,
    discrepancies: Option<u64>,
    last_seen: Option<String>,
    /// Stored: requests served, all time (the operator's page only).
    requests_served: Option<u64>,
    /// Stored: operator credits paid, micros, all time (the operator's page only).
    earned_micros: Option<u64>,
    audits: Vec<AuditRow>,
}

#[derive(Serialize)]
struct AuditRow {
    model: String,
    verdict: String,
    tokens_audited: u64,
}

/// A node's row: what this instance knows live of it (the router's snapshot `live`, the
/// tunnel, the auditor); stored counts and the operator are the caller's to fill in.
pub(super) fn node_row(
    s: &ConsoleState,
    live: &[spine_router::NodeSnapshot],
    node_id: &NodeId,
    name: Option<String>,
) -> NodeRow {
    let snap = live.iter().find(|n| &n.node_id == node_id);
    let tunnel = s.host.tunnels().status(node_id);
    let audits = s
        .host
        .auditor()
        .map(|a| a.statuses_of(node_id))
        .unwrap_or_default()
        .into_iter()
        .map(|a| AuditRow {
            model: a.model.to_string(),
            verdict: serde_json::to_value(a.verdict)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            tokens_audited: a.tokens_audited,
        })
        .collect();
    NodeRow {
        node_id: node_id.to_string(),
        name: name.unwrap_or_default(),
        operator: None,
        connected: s.host.tunnels().contains(node_id),
        routable: snap.is_some(),
        models: match (snap, &tunnel) {
            (Some(n), _) => n
                .descriptor
                .models
                .iter()
                .map(|m| m.id.to_string())
                .collect(),
            (None, Some(t)) => t.models.iter().map(|m| m.model.to_string()).collect(),
            (None, None) => Vec::new(),
        },
        score: snap.map(|n| {
            let p = &n.score;
            format!(
                "{:.3} ({:.2} · {:.2} · {:.2} · {:.2})",
                p.score, p.success_rate_ema, p.latency_score, p.uptime_score, p.failure_penalty
            )
        }),
        ttft_ema_ms: snap
            .and_then(|n| n.score.ttft_ema_ms)
            .map(|t| format!("{t:.0}")),
        in_flight: snap.map(|n| n.in_flight),
        sticky_hits: snap.map(|n| n.sticky_hits),
        sticky_misses: snap.map(|n| n.sticky_misses),
        discrepancies: snap.map(|n| n.discrepancies),
        last_seen: snap.map(|n| format!("{:.0} s ago", n.score.last_seen_secs)),
        requests_served: None,
        earned_micros: None,
        audits,
    }
}

async fn nodes_page(State(s): State<Arc<ConsoleState>>, headers: HeaderMap) -> Page {
    let (user, token, op) = operator(&s, &headers).await?;
    // the operator's own nodes (the store), then what this instance knows live of each
    let records = s.stored(s.host.store().operator_nodes(&op).await)?;
    let live = s.host.registry().snapshot();
    let rows: Vec<NodeRow> = records
        .into_iter()
        .map(|rec| NodeRow {
            requests_served: Some(rec.requests_served),
            earned_micros: Some(rec.earned_micros),
            ..node_row(&s, &live, &rec.node_id, rec.name)
        })
        .collect();
    Ok(s.render(
        "nodes.html",
        minijinja::context! {
            user => PageUser::of(&user), csrf => csrf_token(&token), nodes => rows,
            platform => false, next => None::<String>,
        },
    ))
}

#[derive(Deserialize, Default)]
struct EarningsQuery {
    #[serde(default)]
    days: Option<u32>,
}

async fn earnings_page(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Query(q): Query<EarningsQuery>,
) -> Page {
    let (user, token, op) = operator(&s, &headers).await?;
    let (since, until, days) = super::day_window(q.days);
    let rows = s.stored(
        s.store
            .operator_earnings(&op, since, until, crate::ledger::MAX_PAGE_ROWS)
            .await,
    )?;
    let total = s.stored(s.host.store().operator_earned_micros(&op).await)?;
    let window_micros: u64 = rows.iter().map(|r| r.earned_micros).sum();
    Ok(s.render(
        "earnings.html",
        minijinja::context! {
            user => PageUser::of(&user), csrf => csrf_token(&token), rows => rows, days => days,
            total_micros => total, window_micros => window_micros,
        },
    ))
}

#[derive(Deserialize, Default)]
struct PageQuery {
    #[serde(default)]
    after: Option<String>,
}

async fn render_enrollments(
    s: &ConsoleState,
    user: &ConsoleUser,
    token: &str,
    op: &OperatorId,
    after: Option<&PageCursor>,
    issued: Option<String>,
) -> Page {
    let page = s.stored(s.store.operator_enrollments(op, after, 50).await)?;
    let now = spine_core::unix_time_ms();
    Ok(s.render(
        "enrollments.html",
        minijinja::context! {
            user => PageUser::of(user), csrf => csrf_token(token), now_ms => now,
            tokens => page.rows, next => page.next.map(|c| after_query(&c)),
            issued => issued, gateway_url => &s.join_gateway_url,
        },
    ))
}

async fn enrollments_page(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Page {
    let (user, token, op) = operator(&s, &headers).await?;
    let after = q.after.as_deref().and_then(PageCursor::decode);
    render_enrollments(&s, &user, &token, &op, after.as_ref(), None).await
}

#[derive(Deserialize)]
struct CsrfForm {
    #[serde(default)]
    csrf: Option<String>,
}

/// `POST /console/enrollments`: a one-time enrollment token, shown once with the `join`
/// command.
async fn issue_enrollment(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Form(form): Form<CsrfForm>,
) -> Page {
    let (user, token, op) = operator_post(&s, &headers, form.csrf.as_deref()).await?;
    let enrollment = keys::new_enrollment_token();
    let expires = spine_core::unix_time_ms().saturating_add(ENROLLMENT_TTL_MS);
    s.stored(
        s.host
            .store()
            .create_enrollment(&op, &keys::hash_api_key(&enrollment), expires)
            .await,
    )?;
    tracing::info!(operator = %op, "enrollment token issued from the console");
    render_enrollments(&s, &user, &token, &op, None, Some(enrollment)).await
}

#[derive(Deserialize)]
struct RevokeForm {
    #[serde(default)]
    csrf: Option<String>,
    token_hash: String,
}

async fn revoke_enrollment(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Form(form): Form<RevokeForm>,
) -> Page {
    let (_, _, op) = operator_post(&s, &headers, form.csrf.as_deref()).await?;
    if s.stored(s.store.revoke_enrollment(&op, &form.token_hash).await)? {
        Ok(Redirect::to("/console/enrollments").into_response())
    } else {
        Err(s.error(StatusCode::NOT_FOUND, "No such unused token."))
    }
}
