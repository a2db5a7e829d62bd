//! The web console (`console` feature): server-rendered HTML pages for builders (an account's
//! keys, balance, usage, requests, a playground), GPU operators (an operator's nodes, earnings,
//! enrollment tokens) and the platform's staff (every node, traffic, revenue and fees,
//! discrepancies, credit held), as an [`axum::Router`] an application serves on a listener of
//! its own ([`serve`]) or mounts in its own app ([`router`]); and the admin API's calls that
//! create console users and sign-in links ([`admin_routes`]).
//!
//! Handlers are thin: the store's [`ConsoleStore`] answers every query, scoped to the signed-in
//! user's account or operator (a URL never names the account or operator: it comes from the
//! session, so there is no foreign id to try). Templates are minijinja with auto-escaping,
//! every template and asset is embedded in the binary, and pages work without JavaScript
//! except the playground and the charts. What the pages show of the running gateway (its rate
//! limits, key cache, catalog, live nodes, audits) comes from the application through
//! [`ConsoleHost`]. See `docs/console.md`.
//!
//! ```no_run
//! # async fn run(
//! #     host: std::sync::Arc<dyn spine_meter::console::ConsoleHost>,
//! #     public_api: axum::Router,
//! #     listener: tokio::net::TcpListener,
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! use spine_meter::console::{self, ConsoleConfig, ConsoleState};
//!
//! let console = ConsoleState::new(
//!     host,
//!     public_api,
//!     ConsoleConfig { secure_cookies: true, join_gateway_url: "wss://gw.example:8443".into() },
//! )?;
//! let stop = tokio_util::sync::CancellationToken::new();
//! let limits = spine_transport::ListenerLimits::default();
//! console::serve(listener, std::sync::Arc::new(console), limits, stop).await?;
//! # Ok(())
//! # }
//! ```

mod admin;
mod auth;
pub use auth::{MAX_CONCURRENT_PASSWORD_HASHES, PASSWORD_HASH_WAIT};
mod builder;
mod host;
mod operator;
mod platform;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use axum::extract::State;
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use http::{header, HeaderValue, StatusCode};
use minijinja::Environment;
use serde::Serialize;

use crate::ledger::{ConsoleRole, ConsoleStore, ConsoleUser};

pub use admin::admin_routes;
use auth::SignInLimits;
pub use host::ConsoleHost;

/// How the console is served: what the application's configuration says of it.
#[derive(Debug, Clone, Default)]
pub struct ConsoleConfig {
    /// Add `Secure` to the session cookie: set it when browsers reach the console over HTTPS
    /// (a TLS-terminating proxy in front of its listener).
    pub secure_cookies: bool,
    /// The gateway's tunnel URL as agents dial it (`wss://host:port`), for the
    /// `reference-agent join --gateway …` command an operator copies from the enrollment page.
    pub join_gateway_url: String,
}

/// What the console's handlers share: the application's [`ConsoleHost`], the store's console
/// queries, the embedded templates, the sign-in rate limits. Build one with
/// [`ConsoleState::new`], serve it with [`router`] or [`serve`].
pub struct ConsoleState {
    host: Arc<dyn ConsoleHost>,
    store: Arc<dyn ConsoleStore>,
    templates: Environment<'static>,
    /// The gateway's own public API, called in process by the playground.
    public_api: Router,
    limits: SignInLimits,
    /// Add `Secure` to the session cookie.
    secure_cookies: bool,
    /// The gateway's tunnel URL as agents dial it, for the `join` command the operator copies.
    join_gateway_url: String,
}

impl std::fmt::Debug for ConsoleState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleState")
            .field("secure_cookies", &self.secure_cookies)
            .finish_non_exhaustive()
    }
}

/// The templates, embedded.
const TEMPLATES: &[(&str, &str)] = &[
    ("base.html", include_str!("templates/base.html")),
    ("error.html", include_str!("templates/error.html")),
    ("signin.html", include_str!("templates/signin.html")),
    ("keys.html", include_str!("templates/keys.html")),
    ("balance.html", include_str!("templates/balance.html")),
    ("usage.html", include_str!("templates/usage.html")),
    ("requests.html", include_str!("templates/requests.html")),
    ("playground.html", include_str!("templates/playground.html")),
    ("nodes.html", include_str!("templates/nodes.html")),
    ("earnings.html", include_str!("templates/earnings.html")),
    (
        "enrollments.html",
        include_str!("templates/enrollments.html"),
    ),
    ("charts.html", include_str!("templates/charts.html")),
    ("platform.html", include_str!("templates/platform.html")),
    (
        "discrepancies.html",
        include_str!("templates/discrepancies.html"),
    ),
];

/// The static assets, embedded: `(name, content type, bytes)`.
const ASSETS: &[(&str, &str, &[u8])] = &[
    (
        "console.css",
        "text/css; charset=utf-8",
        include_bytes!("assets/console.css"),
    ),
    (
        "playground.js",
        "text/javascript; charset=utf-8",
        include_bytes!("assets/playground.js"),
    ),
    (
        "chart.js",
        "text/javascript; charset=utf-8",
        include_bytes!("assets/chart.js"),
    ),
    (
        "uPlot.iife.min.js",
        "text/javascript; charset=utf-8",
        include_bytes!("assets/vendor/uPlot.iife.min.js"),
    ),
    (
        "uPlot.min.css",
        "text/css; charset=utf-8",
        include_bytes!("assets/vendor/uPlot.min.css"),
    ),
    (
        "uPlot.LICENSE",
        "text/plain; charset=utf-8",
        include_bytes!("assets/vendor/uPlot.LICENSE"),
    ),
];

/// What a console handler answers: its page, or the page that refused or failed in its place
/// (returned early with `?`). Both are responses; axum sends whichever it is.
type Page = Result<Response, Response>;

/// The signed-in user `found` ([`auth::require_user`], or [`auth::require_post`] for a
/// state-changing request) with the id that `role_id` picks from their role; 403 with
/// `refusal` when it picks none (a user of another role).
// the error is the page to send, as from the async guards that call it (which the lint spares)
#[allow(clippy::result_large_err)]
fn with_role<T>(
    s: &ConsoleState,
    found: (ConsoleUser, String),
    role_id: impl FnOnce(&ConsoleRole) -> Option<T>,
    refusal: &str,
) -> Result<(ConsoleUser, String, T), Response> {
    let (user, token) = found;
    match role_id(&user.role) {
        Some(id) => Ok((user, token, id)),
        None => Err(s.error(StatusCode::FORBIDDEN, refusal)),
    }
}

/// `after=<cursor>`, URL-encoded: the query of a list's next page.
fn after_query(cursor: &crate::ledger::PageCursor) -> String {
    serde_urlencoded::to_string([("after", cursor.encode())]).unwrap_or_default()
}

/// The last `days` (1–90, default 30) UTC days including today: `(since_ms, until_ms, days)`.
fn day_window(days: Option<u32>) -> (i64, i64, u32) {
    let days = days.unwrap_or(30).clamp(1, 90);
    let today = spine_core::unix_time_ms().div_euclid(86_400_000);
    (
        (today - i64::from(days) + 1) * 86_400_000,
        (today + 1) * 86_400_000,
        days,
    )
}

/// A chart as `assets/chart.js` draws it (uPlot): its element's `id`, a title, the x axis
/// (UTC days since the epoch, sent as Unix seconds) and named series of one value per day.
fn chart(id: &str, title: &str, days: &[i64], series: &[(&str, Vec<f64>)]) -> serde_json::Value {
    serde_json::json!({
        "id": id,
        "title": title,
        "days": days.iter().map(|d| d * 86_400).collect::<Vec<_>>(),
        "series": series
            .iter()
            .map(|(label, values)| serde_json::json!({ "label": label, "values": values }))
            .collect::<Vec<_>>(),
    })
}

/// Micros as credits, for a chart's values.
fn as_credits(micros: Vec<f64>) -> Vec<f64> {
    micros.into_iter().map(|m| m / 1e6).collect()
}

/// Micros as credits with six decimals (`1234567` → `1.234567`).
fn credits(micros: u64) -> String {
    format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000)
}

/// Unix milliseconds as UTC `YYYY-MM-DD HH:MM:SS`.
fn utc(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let day = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    format!(
        "{} {:02}:{:02}:{:02}",
        date(day),
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since the Unix epoch as `YYYY-MM-DD` (the proleptic Gregorian calendar; Howard
/// Hinnant's `civil_from_days`).
fn date(days: i64) -> String {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

fn templates() -> Result<Environment<'static>, minijinja::Error> {
    let mut env = Environment::new();
    // `.html` templates are auto-escaped (minijinja's default for the extension); say so
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::Html);
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    env.add_filter("credits", |v: u64| credits(v));
    env.add_filter("utc", |v: i64| utc(v));
    env.add_filter("date", |v: i64| date(v));
    for (name, source) in TEMPLATES {
        env.add_template(name, source)?;
    }
    Ok(env)
}

impl ConsoleState {
    /// The console over `host`'s store and live state. `public_api` is the application's
    /// public API (`POST /v1/chat/completions` with a bearer key), which the playground calls
    /// in process, so its chats are metered and billed like any caller's.
    ///
    /// # Errors
    ///
    /// A template does not parse (a build defect: they are embedded).
    pub fn new(
        host: Arc<dyn ConsoleHost>,
        public_api: Router,
        config: ConsoleConfig,
    ) -> Result<Self, minijinja::Error> {
        Ok(Self {
            store: host.store().clone().console(),
            host,
            public_api,
            templates: templates()?,
            limits: SignInLimits::default(),
            secure_cookies: config.secure_cookies,
            join_gateway_url: config.join_gateway_url,
        })
    }

    /// Renders `name` with `ctx`; an error page (500) when rendering fails.
    fn render<S: Serialize>(&self, name: &str, ctx: S) -> Response {
        match self
            .templates
            .get_template(name)
            .and_then(|t| t.render(ctx))
        {
            Ok(html) => page_headers(Html(html).into_response()),
            Err(e) => {
                tracing::error!(error = %e, template = name, "console template failed");
                self.error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "The page could not be drawn.",
                )
            }
        }
    }

    /// An HTML error page with `status`.
    fn error(&self, status: StatusCode, message: &str) -> Response {
        let html = self
            .templates
            .get_template("error.html")
            .and_then(|t| {
                t.render(minijinja::context! {
                    status => status.as_u16(), message => message, user => None::<()>, csrf => "",
                })
            })
            .unwrap_or_else(|_| "error".to_owned());
        let mut r = page_headers(Html(html).into_response());
        *r.status_mut() = status;
        r
    }

    /// A store failure as an error page (the cause logged, not shown); a caller's text the store
    /// refuses ([`LedgerError::InvalidText`](crate::LedgerError::InvalidText)) is a 400.
    fn store_error(&self, e: &crate::LedgerError) -> Response {
        if matches!(e, crate::LedgerError::InvalidText) {
            // the caller's text (a form field, a filter) holds a NUL: theirs to fix, nothing
            // failed
            return self.error(
                StatusCode::BAD_REQUEST,
                "The request holds a character that cannot be used (NUL).",
            );
        }
        tracing::error!(error = %e, "console store call failed");
        if e.is_unavailable() {
            self.error(
                StatusCode::SERVICE_UNAVAILABLE,
                "The ledger is unavailable; try again.",
            )
        } else {
            self.error(StatusCode::INTERNAL_SERVER_ERROR, "Something went wrong.")
        }
    }

    /// The store's answer `r`, or its error as [`ConsoleState::store_error`]'s page.
    // the error is the page to send, as from the async handlers that call it (see `with_role`)
    #[allow(clippy::result_large_err)]
    fn stored<T>(&self, r: Result<T, crate::LedgerError>) -> Result<T, Response> {
        r.map_err(|e| self.store_error(&e))
    }
}

/// Headers every console page carries: no caching (pages show balances and keys), no framing,
/// no sniffing, and a content security policy that allows only the console's own scripts and
/// styles (no inline script).
fn page_headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
        ),
    );
    r
}

/// What every signed-in page's template gets.
#[derive(Serialize)]
struct PageUser<'a> {
    email: &'a str,
    /// `builder`, `operator` or `platform`.
    role: &'static str,
    /// The account or operator id (empty for the platform).
    owner: &'a str,
}

impl<'a> PageUser<'a> {
    fn of(user: &'a ConsoleUser) -> Self {
        match &user.role {
            ConsoleRole::Builder(a) => Self {
                email: &user.email,
                role: "builder",
                owner: a.as_str(),
            },
            ConsoleRole::Operator(o) => Self {
                email: &user.email,
                role: "operator",
                owner: o.as_str(),
            },
            ConsoleRole::Platform => Self {
                email: &user.email,
                role: "platform",
                owner: "",
            },
        }
    }
}

/// The console's routes: `/` (a redirect), `/console/**` and `/favicon.ico`, every answer an
/// HTML page (errors included) except the assets and the playground's chat stream.
///
/// Each request must carry its peer's address as a [`spine_transport::PeerAddr`] extension
/// (the sign-in rate limit is per client IP; [`serve`] adds it): a sign-in without it is
/// refused. Mount it at the root of a listener of its own, as its session cookie has
/// `Path=/console` and its pages link to absolute `/console/…` paths.
pub fn router(state: Arc<ConsoleState>) -> Router {
    Router::new()
        .route("/", get(|| async { Redirect::to("/console") }))
        .route("/console", get(home))
        .route("/console/signin", get(auth::signin_page).post(auth::signin))
        .route("/console/signin/link/{token}", get(auth::link_page))
        .route("/console/signin/link", post(auth::link_signin))
        .route("/console/signout", post(auth::signout))
        .route("/console/assets/{name}", get(asset))
        // browsers ask for it at the origin's root; there is none
        .route("/favicon.ico", get(|| async { StatusCode::NO_CONTENT }))
        .merge(builder::routes())
        .merge(operator::routes())
        .merge(platform::routes())
        .fallback(|State(s): State<Arc<ConsoleState>>| async move {
            s.error(StatusCode::NOT_FOUND, "No such page.")
        })
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            html_errors,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::refuse_cross_site,
        ))
        .with_state(state)
}

/// Every error the console answers is an HTML page: an extractor's refusal (a form or query
/// that does not parse, a wrong content type) comes from axum as plain text and is replaced.
/// The playground's chat keeps the public API's JSON errors (its script reads them).
async fn html_errors(
    State(s): State<Arc<ConsoleState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let keep = req.uri().path() == "/console/playground/chat";
    let r = next.run(req).await;
    let html = r
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/html"));
    if keep || html || !(r.status().is_client_error() || r.status().is_server_error()) {
        return r;
    }
    s.error(r.status(), "The request was not understood.")
}

/// `GET /console`: the user's first page, or the sign-in page.
async fn home(State(s): State<Arc<ConsoleState>>, headers: http::HeaderMap) -> Response {
    match auth::session_user(&s, &headers).await {
        Ok(Some((user, _))) => match user.role {
            ConsoleRole::Builder(_) => Redirect::to("/console/keys").into_response(),
            ConsoleRole::Operator(_) => Redirect::to("/console/nodes").into_response(),
            ConsoleRole::Platform => Redirect::to("/console/platform").into_response(),
        },
        Ok(None) => Redirect::to("/console/signin").into_response(),
        Err(e) => s.store_error(&e),
    }
}

/// `GET /console/assets/{name}`: an embedded asset.
async fn asset(
    State(s): State<Arc<ConsoleState>>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Response {
    match ASSETS.iter().find(|(n, _, _)| *n == name) {
        Some((_, content_type, bytes)) => (
            [
                (header::CONTENT_TYPE, *content_type),
                (header::CACHE_CONTROL, "public, max-age=3600"),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ],
            *bytes,
        )
            .into_response(),
        None => s.error(StatusCode::NOT_FOUND, "No such asset."),
    }
}

/// Serves the console on `listener` until `shutdown`, under the same connection cap and
/// header, body and idle timeouts as the other listeners; each request carries its peer's
/// address ([`spine_transport::PeerAddr`]: the sign-in rate limit is per client IP).
///
/// # Errors
///
/// The listener fails.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<ConsoleState>,
    limits: spine_transport::ListenerLimits,
    shutdown: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    spine_transport::LimitedServer::new("console", limits)
        .serve(listener, router(state), shutdown.cancelled_owned())
        .await
}
