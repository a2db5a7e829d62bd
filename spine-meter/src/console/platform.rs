//! The platform's pages (a console user of the platform, not of an account or an operator):
//! traffic, revenue and fees per UTC day with credit held now (`/console/platform`), every
//! node with this instance's live view (`/console/platform/nodes`), the usage discrepancies
//! (`/console/platform/discrepancies`). Read only: every query reads the daily roll-ups or a
//! bounded, keyset-paged range of an index ([`ConsoleStore`](crate::ledger::ConsoleStore)'s
//! `platform_*`), never all request records. Builders and operators get 403 here; a platform
//! user gets 403 on their pages.

use std::sync::Arc;

use crate::ledger::{ConsoleRole, ConsoleUser, PageCursor, MAX_PAGE_ROWS};
use axum::extract::{Query, State};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};

use super::auth::{csrf_token, require_user};
use super::{after_query, ConsoleState, Page, PageUser};

/// Rows per page of the node and discrepancy lists.
const PAGE_ROWS: u32 = 50;

pub(super) fn routes() -> Router<Arc<ConsoleState>> {
    Router::new()
        .route("/console/platform", get(overview_page))
        .route("/console/platform/nodes", get(nodes_page))
        .route("/console/platform/discrepancies", get(discrepancies_page))
}

/// The signed-in platform user; builders and operators get 403.
async fn platform(
    s: &ConsoleState,
    headers: &HeaderMap,
) -> Result<(ConsoleUser, String), Response> {
    let (user, token) = require_user(s, headers).await?;
    if user.role == ConsoleRole::Platform {
        Ok((user, token))
    } else {
        Err(s.error(
            StatusCode::FORBIDDEN,
            "This page is for the platform's staff.",
        ))
    }
}

#[derive(Deserialize, Default)]
struct PlatformQuery {
    #[serde(default)]
    days: Option<u32>,
    #[serde(default)]
    after: Option<String>,
}

/// One day of the overview: the store's sums and the fee they leave.
#[derive(Serialize)]
struct DayRow {
    day: i64,
    requests: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
    debit_micros: u64,
    operator_credit_micros: u64,
    /// `debit - operator credit paid`: the platform's fee plus credit held in escrow or
    /// forfeited.
    fee_micros: u64,
}

/// `GET /console/platform?days=`: traffic, revenue, operator credits and fees per UTC day for
/// the last 7/30/90 days (two charts and a table), and credit held now.
async fn overview_page(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Query(q): Query<PlatformQuery>,
) -> Page {
    let (user, token) = platform(&s, &headers).await?;
    let (since, until, days) = super::day_window(q.days);
    let stored = s.stored(s.store.platform_days(since, until, MAX_PAGE_ROWS).await)?;
    let held = s.stored(s.store.platform_held().await)?;
    let rows: Vec<DayRow> = stored
        .into_iter()
        .map(|d| DayRow {
            fee_micros: d.debit_micros.saturating_sub(d.operator_credit_micros),
            day: d.day,
            requests: d.requests,
            prompt_tokens: d.prompt_tokens,
            completion_tokens: d.completion_tokens,
            debit_micros: d.debit_micros,
            operator_credit_micros: d.operator_credit_micros,
        })
        .collect();
    // the charts: every day of the window, oldest first
    let axis: Vec<i64> = (since / 86_400_000..until / 86_400_000).collect();
    let column = |f: fn(&DayRow) -> u64| -> Vec<f64> {
        axis.iter()
            .map(|d| {
                rows.iter()
                    .find(|r| r.day == *d)
                    .map_or(0.0, |r| f(r) as f64)
            })
            .collect()
    };
    let charts = [
        super::chart(
            "chart-traffic",
            "Traffic per day (UTC), tokens",
            &axis,
            &[
                ("prompt tokens", column(|r| r.prompt_tokens)),
                ("completion tokens", column(|r| r.completion_tokens)),
            ],
        ),
        super::chart(
            "chart-money",
            "Revenue, operator credits and fees per day (UTC), credits",
            &axis,
            &[
                ("revenue", super::as_credits(column(|r| r.debit_micros))),
                (
                    "operator credits",
                    super::as_credits(column(|r| r.operator_credit_micros)),
                ),
                ("fees", super::as_credits(column(|r| r.fee_micros))),
            ],
        ),
    ];
    let sum = |f: fn(&DayRow) -> u64| rows.iter().map(f).sum::<u64>();
    let totals = DayRow {
        day: 0,
        requests: sum(|r| r.requests),
        prompt_tokens: sum(|r| r.prompt_tokens),
        completion_tokens: sum(|r| r.completion_tokens),
        debit_micros: sum(|r| r.debit_micros),
        operator_credit_micros: sum(|r| r.operator_credit_micros),
        fee_micros: sum(|r| r.fee_micros),
    };
    Ok(s.render(
        "platform.html",
        minijinja::context! {
            user => PageUser::of(&user), csrf => csrf_token(&token), days => days, rows => rows,
            totals => totals, held => held, charts => charts,
        },
    ))
}

/// `GET /console/platform/nodes`: every operator's nodes (50 a page) with what this instance
/// knows live of each, and each operator's requests served and credits paid in the last
/// `days` (the earnings roll-up).
async fn nodes_page(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Query(q): Query<PlatformQuery>,
) -> Page {
    let (user, token) = platform(&s, &headers).await?;
    let after = q.after.as_deref().and_then(PageCursor::decode);
    let page = s.stored(s.store.platform_nodes(after.as_ref(), PAGE_ROWS).await)?;
    let (since, until, days) = super::day_window(q.days);
    let operators = s.stored(
        s.store
            .platform_operators(since, until, MAX_PAGE_ROWS)
            .await,
    )?;
    let live = s.host.registry().snapshot();
    let nodes: Vec<super::operator::NodeRow> = page
        .rows
        .into_iter()
        .map(|n| {
            let mut row = super::operator::node_row(&s, &live, &n.node_id, n.name);
            row.operator = Some(n.operator.to_string());
            row
        })
        .collect();
    Ok(s.render(
        "nodes.html",
        minijinja::context! {
            user => PageUser::of(&user), csrf => csrf_token(&token), nodes => nodes,
            platform => true, next => page.next.map(|c| after_query(&c)),
            operators => operators, days => days,
        },
    ))
}

/// `GET /console/platform/discrepancies`: the requests whose node's usage claim disagreed
/// with the gateway's count, newest first, 50 a page (numbers only, never text).
async fn discrepancies_page(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Query(q): Query<PlatformQuery>,
) -> Page {
    let (user, token) = platform(&s, &headers).await?;
    let after = q.after.as_deref().and_then(PageCursor::decode);
    let page = s.stored(
        s.store
            .platform_discrepancies(after.as_ref(), PAGE_ROWS)
            .await,
    )?;
    Ok(s.render(
        "discrepancies.html",
        minijinja::context! {
            user => PageUser::of(&user), csrf => csrf_token(&token), rows => page.rows,
            next => page.next.map(|c| after_query(&c)),
        },
    ))
}
