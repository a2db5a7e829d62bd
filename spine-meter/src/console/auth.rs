//! Sign-in, sessions and CSRF.
//!
//! - Passwords: argon2id (the `argon2` crate's defaults, RFC 9106's second recommended set:
//!   19 MiB, 2 passes), PHC strings in the store.
//! - Sessions: a random 256-bit token in the `spine_console` cookie (`HttpOnly; SameSite=Strict;
//!   Path=/console`, `Secure` with [`ConsoleConfig::secure_cookies`](super::ConsoleConfig)); the
//!   store keeps only its SHA-256, with an expiry ([`SESSION_TTL_MS`]); sign-out and the admin
//!   API revoke it.
//! - CSRF: every state-changing form carries `csrf`, the SHA-256 of a fixed label and the session
//!   token (a value only a page of this session can know; it is never stored); a POST without
//!   the right one is refused 403 before anything else is done. A state-changing request a
//!   browser marks as sent by another site (`Sec-Fetch-Site`) is refused 403 before any handler
//!   ([`refuse_cross_site`]): the sign-in forms too, which have no session to tie a token to.
//! - Sign-in attempts are rate limited per client IP (an IPv6 client: its /64) and per e-mail
//!   address (a GCRA: in Redis, shared by every instance, when the gateway has one; else
//!   governor's, per instance): [`SignInLimits`].

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Arc;

use crate::ledger::ConsoleUser;
use crate::limits::RateLimits;
use crate::LedgerError;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Extension;
use axum::Form;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use http::{header, HeaderMap, HeaderValue, StatusCode};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use spine_transport::PeerAddr;

use super::{ConsoleState, Page};

/// The session cookie's name.
pub(super) const COOKIE: &str = "spine_console";

/// How long a session lasts, milliseconds (12 h).
pub(crate) const SESSION_TTL_MS: i64 = 12 * 3_600_000;

/// Sign-in attempts allowed per client IP: a burst of 10, then one every 6 s.
const PER_IP_PER_MINUTE: u32 = 10;
/// Sign-in attempts allowed per e-mail address: a burst of 5, then one every 12 s.
const PER_USER_PER_MINUTE: u32 = 5;

/// The sign-in rate limits: per client IP and per e-mail address.
pub(crate) struct SignInLimits {
    per_ip: DefaultKeyedRateLimiter<IpAddr>,
    per_user: DefaultKeyedRateLimiter<String>,
}

impl Default for SignInLimits {
    fn default() -> Self {
        let quota = |n: u32| Quota::per_minute(NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN));
        Self {
            per_ip: RateLimiter::keyed(quota(PER_IP_PER_MINUTE)),
            per_user: RateLimiter::keyed(quota(PER_USER_PER_MINUTE)),
        }
    }
}

impl SignInLimits {
    /// Whether one more attempt from `ip` (for `email`, when one is named) is allowed now (each
    /// check takes one). With Redis (several instances) the budgets are shared by every
    /// instance ([`RateLimits::check_shared`]); without it, or while Redis fails, each
    /// instance counts its own.
    async fn allow(&self, shared: &RateLimits, ip: IpAddr, email: Option<&str>) -> bool {
        let ip = client_of(ip);
        // keep the maps bounded: drop keys whose limit has fully recovered
        if self.per_ip.len() > 10_000 {
            self.per_ip.retain_recent();
        }
        if self.per_user.len() > 10_000 {
            self.per_user.retain_recent();
        }
        let per_minute = |n: u32| NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN);
        let ip_ok = match shared
            .check_shared(&format!("signin:ip:{ip}"), per_minute(PER_IP_PER_MINUTE))
            .await
        {
            Some(ok) => ok,
            None => self.per_ip.check_key(&ip).is_ok(),
        };
        let Some(email) = email else {
            return ip_ok;
        };
        let user_ok = match shared
            .check_shared(
                &format!("signin:user:{email}"),
                per_minute(PER_USER_PER_MINUTE),
            )
            .await
        {
            Some(ok) => ok,
            None => self.per_user.check_key(&email.to_owned()).is_ok(),
        };
        ip_ok && user_ok
    }
}

/// The client an address counts as for the per-IP limit: an IPv4 address (also written as
/// an IPv4-mapped IPv6 one); for IPv6, its /64 prefix, the smallest block a host is given
/// (every address of an ISP customer's or a cloud VM's /64 is one client: counted per
/// address, one machine would have 2^64 budgets, and argon2's 19 MiB and tens of
/// milliseconds per attempt unbounded).
fn client_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(
                u128::from(v6) & !((1u128 << 64) - 1),
            )),
        },
    }
}

/// A new random token (256 bits, hex).
pub(crate) fn new_token() -> Option<String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).ok()?;
    Some(hex::encode(bytes))
}

/// SHA-256 of `token`, hex: what the store keeps of a session or a sign-in link.
pub(crate) fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// The CSRF token of the session whose cookie holds `session_token`.
pub(super) fn csrf_token(session_token: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"spine-console-csrf\0");
    h.update(session_token.as_bytes());
    hex::encode(h.finalize())
}

/// Whether `presented` is the session's CSRF token (digests compared, so the time taken does
/// not depend on how much of it matched).
pub(super) fn csrf_ok(session_token: &str, presented: &str) -> bool {
    Sha256::digest(presented.as_bytes()) == Sha256::digest(csrf_token(session_token).as_bytes())
}

/// An argon2id hash (PHC string) of `password`.
///
/// # Errors
///
/// No randomness for the salt, or argon2 refused the input.
pub(crate) fn hash_password(password: &str) -> Result<String, argon2::password_hash::Error> {
    let mut salt = [0u8; 16];
    getrandom::fill(&mut salt).map_err(|_| argon2::password_hash::Error::Crypto)?;
    let salt = SaltString::encode_b64(&salt)?;
    Ok(Argon2::default()
        .hash_password(password.as_bytes(), &salt)?
        .to_string())
}

/// At most this many argon2 hashes or verifications run at once in this process (each takes
/// 19 MiB and tens of milliseconds of CPU): sign-ins spread over many addresses, each within its
/// own rate limit, queue here instead of taking 19 MiB each on up to 512 blocking threads.
pub const MAX_CONCURRENT_PASSWORD_HASHES: usize = 4;

/// How long a password hash waits for one of the [`MAX_CONCURRENT_PASSWORD_HASHES`] turns
/// before the request is answered 503 (the console is busy) instead.
pub const PASSWORD_HASH_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The console's password hashing is busy: no turn came within the wait.
#[derive(Debug)]
pub(crate) struct PasswordHashingBusy;

/// Runs `work` (an argon2 hash or verification) on a blocking thread, holding one of `turns`'
/// permits until the work has finished; `Err` when no turn came within `wait`, or the work
/// panicked. The process-wide turns are [`password_turns`].
///
/// # Cancel safety
///
/// Dropping the future while it waits gives nothing up. Once the work has started, its turn is
/// held by the work itself until it finishes on its thread: a caller that vanishes mid-request
/// does not free a turn while its hash still runs (which would let disconnecting clients run
/// any number at once).
pub(crate) async fn hash_in_turn<T: Send + 'static>(
    turns: &Arc<tokio::sync::Semaphore>,
    wait: std::time::Duration,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, PasswordHashingBusy> {
    let permit = tokio::time::timeout(wait, turns.clone().acquire_owned())
        .await
        .map_err(|_| PasswordHashingBusy)?
        .map_err(|_| PasswordHashingBusy)?;
    tokio::task::spawn_blocking(move || {
        let out = work();
        drop(permit);
        out
    })
    .await
    .map_err(|_| PasswordHashingBusy)
}

/// The process's turns for password hashing ([`MAX_CONCURRENT_PASSWORD_HASHES`]).
pub(crate) fn password_turns() -> &'static Arc<tokio::sync::Semaphore> {
    static TURNS: std::sync::LazyLock<Arc<tokio::sync::Semaphore>> =
        std::sync::LazyLock::new(|| {
            Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_PASSWORD_HASHES))
        });
    &TURNS
}

/// Whether `password` matches the stored PHC hash.
fn password_ok(hash: &str, password: &str) -> bool {
    PasswordHash::new(hash).is_ok_and(|h| {
        Argon2::default()
            .verify_password(password.as_bytes(), &h)
            .is_ok()
    })
}

/// A hash to verify against when the e-mail is unknown, so an unknown address takes as long
/// as a wrong password.
fn dummy_hash() -> &'static str {
    static DUMMY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DUMMY.get_or_init(|| hash_password("spine-console-dummy").unwrap_or_default())
}

/// The session token in the request's cookie, if any (a well-formed one: 64 hex digits).
fn session_token(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_owned())
        .filter(|v| v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The signed-in user and the session token, or `None` without a live session.
///
/// # Errors
///
/// The store failed.
pub(super) async fn session_user(
    s: &ConsoleState,
    headers: &HeaderMap,
) -> Result<Option<(ConsoleUser, String)>, LedgerError> {
    let Some(token) = session_token(headers) else {
        return Ok(None);
    };
    let user = s
        .store
        .console_session(&token_hash(&token), spine_core::unix_time_ms())
        .await?;
    Ok(user.map(|u| (u, token)))
}

/// The signed-in user of a page: else the response to send instead (a redirect to sign in, an
/// error page).
pub(super) async fn require_user(
    s: &ConsoleState,
    headers: &HeaderMap,
) -> Result<(ConsoleUser, String), Response> {
    match session_user(s, headers).await {
        Ok(Some(found)) => Ok(found),
        Ok(None) => Err(Redirect::to("/console/signin").into_response()),
        Err(e) => Err(s.store_error(&e)),
    }
}

/// For a state-changing request: the signed-in user, after the CSRF token `presented` was
/// checked (403 without a session or with a missing or wrong token).
pub(super) async fn require_post(
    s: &ConsoleState,
    headers: &HeaderMap,
    presented: Option<&str>,
) -> Result<(ConsoleUser, String), Response> {
    let forbidden = || {
        s.error(
            StatusCode::FORBIDDEN,
            "Missing or wrong form token; reload the page.",
        )
    };
    let Some(token) = session_token(headers) else {
        return Err(forbidden());
    };
    if !presented.is_some_and(|p| csrf_ok(&token, p)) {
        return Err(forbidden());
    }
    match s
        .store
        .console_session(&token_hash(&token), spine_core::unix_time_ms())
        .await
    {
        Ok(Some(user)) => Ok((user, token)),
        Ok(None) => Err(forbidden()),
        Err(e) => Err(s.store_error(&e)),
    }
}

/// Refuses (403) a state-changing request a browser says another site sent
/// (`Sec-Fetch-Site` other than `same-origin`, or `none` for one the user made), before any
/// handler. The session cookie is `SameSite=Strict` and every form carries its CSRF token, but
/// the sign-in forms have no session yet: without this, a page elsewhere could post its
/// author's e-mail and password and leave the visitor signed in as them (an operator who then
/// issues an enrollment token and enrolls a GPU gives it to that operator). Clients that send
/// no `Sec-Fetch-Site` (not a browser, or one too old to) are not refused.
pub(super) async fn refuse_cross_site(
    State(s): State<Arc<ConsoleState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let safe = matches!(
        *req.method(),
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
    );
    let site = req
        .headers()
        .get("sec-fetch-site")
        .map(|v| v.to_str().unwrap_or("?").to_ascii_lowercase());
    match site.as_deref() {
        Some(site) if !safe && site != "same-origin" && site != "none" => {
            tracing::warn!(
                site,
                path = req.uri().path(),
                "console: cross-site request refused"
            );
            s.error(
                StatusCode::FORBIDDEN,
                "This form was sent from another site; open the console and try again.",
            )
        }
        _ => next.run(req).await,
    }
}

/// The `Set-Cookie` value of a session (`max_age_secs` 0 clears it).
fn cookie(s: &ConsoleState, token: &str, max_age_secs: i64) -> Option<HeaderValue> {
    let secure = if s.secure_cookies { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{COOKIE}={token}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={max_age_secs}{secure}"
    ))
    .ok()
}

/// Starts a session for `user` and redirects to the console's first page.
async fn start_session(s: &ConsoleState, user: &ConsoleUser) -> Response {
    let Some(token) = new_token() else {
        return s.error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "No randomness available.",
        );
    };
    let expires = spine_core::unix_time_ms().saturating_add(SESSION_TTL_MS);
    if let Err(e) = s
        .store
        .create_console_session(&token_hash(&token), &user.user_id, expires)
        .await
    {
        return s.store_error(&e);
    }
    tracing::info!(user = %user.user_id, "console sign-in");
    let mut r = Redirect::to("/console").into_response();
    if let Some(c) = cookie(s, &token, SESSION_TTL_MS / 1000) {
        r.headers_mut().insert(header::SET_COOKIE, c);
    }
    r
}

/// `GET /console/signin`.
pub(super) async fn signin_page(State(s): State<Arc<ConsoleState>>) -> Response {
    s.render(
        "signin.html",
        minijinja::context! { user => None::<()>, csrf => "", message => None::<&str>, link => None::<&str> },
    )
}

#[derive(Deserialize)]
pub(super) struct SignInForm {
    email: String,
    password: String,
}

/// `POST /console/signin`: e-mail and password. The same answer for an unknown address and a
/// wrong password; 429 past the rate limits.
pub(super) async fn signin(
    State(s): State<Arc<ConsoleState>>,
    Extension(PeerAddr(peer)): Extension<PeerAddr>,
    Form(form): Form<SignInForm>,
) -> Response {
    let email = form.email.trim();
    if email.len() > 254 || form.password.len() > 1024 {
        return s.error(StatusCode::BAD_REQUEST, "E-mail or password too long.");
    }
    if !s
        .limits
        .allow(s.host.rate_limits(), peer.ip(), Some(email))
        .await
    {
        tracing::warn!(ip = %peer.ip(), "console sign-in rate limited");
        let mut r = s.render(
            "signin.html",
            minijinja::context! { user => None::<()>, csrf => "", link => None::<&str>,
            message => Some("Too many sign-in attempts; wait a minute.") },
        );
        *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        return r;
    }
    let user = match s.store.console_user_by_email(email).await {
        Ok(u) => u,
        Err(e) => return s.store_error(&e),
    };
    let password = form.password;
    let hash = user
        .as_ref()
        .and_then(|u| u.password_hash.clone())
        .unwrap_or_else(|| dummy_hash().to_owned());
    // argon2 takes tens of milliseconds of CPU and 19 MiB: off the async workers, a few at once
    let Ok(matches) = hash_in_turn(password_turns(), PASSWORD_HASH_WAIT, move || {
        password_ok(&hash, &password)
    })
    .await
    else {
        tracing::warn!("console sign-in: password hashing busy");
        return s.error(
            StatusCode::SERVICE_UNAVAILABLE,
            "The console is busy; try again in a moment.",
        );
    };
    match user {
        Some(user) if matches && user.password_hash.is_some() => start_session(&s, &user).await,
        _ => {
            let mut r = s.render(
                "signin.html",
                minijinja::context! { user => None::<()>, csrf => "", link => None::<&str>,
                message => Some("Wrong e-mail or password.") },
            );
            *r.status_mut() = StatusCode::UNAUTHORIZED;
            r
        }
    }
}

/// `GET /console/signin/link/{token}`: a page with one button that uses the link (a GET must
/// not sign in: link scanners and previews fetch URLs).
pub(super) async fn link_page(
    State(s): State<Arc<ConsoleState>>,
    Path(token): Path<String>,
) -> Response {
    if token.len() != 64 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
        return s.error(StatusCode::NOT_FOUND, "This sign-in link is not valid.");
    }
    s.render(
        "signin.html",
        minijinja::context! { user => None::<()>, csrf => "", message => None::<&str>, link => Some(token) },
    )
}

#[derive(Deserialize)]
pub(super) struct LinkForm {
    token: String,
}

/// `POST /console/signin/link`: uses a one-time sign-in link (rate limited per IP as a
/// sign-in).
pub(super) async fn link_signin(
    State(s): State<Arc<ConsoleState>>,
    Extension(PeerAddr(peer)): Extension<PeerAddr>,
    Form(form): Form<LinkForm>,
) -> Response {
    if !s.limits.allow(s.host.rate_limits(), peer.ip(), None).await {
        return s.error(
            StatusCode::TOO_MANY_REQUESTS,
            "Too many sign-in attempts; wait a minute.",
        );
    }
    match s
        .store
        .redeem_console_link(&token_hash(&form.token), spine_core::unix_time_ms())
        .await
    {
        Ok(Some(user)) => start_session(&s, &user).await,
        Ok(None) => s.error(
            StatusCode::FORBIDDEN,
            "This sign-in link was used already or has expired.",
        ),
        Err(e) => s.store_error(&e),
    }
}

#[derive(Deserialize)]
pub(super) struct CsrfForm {
    #[serde(default)]
    csrf: Option<String>,
}

/// `POST /console/signout`: revokes the session and clears the cookie.
pub(super) async fn signout(
    State(s): State<Arc<ConsoleState>>,
    headers: HeaderMap,
    Form(form): Form<CsrfForm>,
) -> Page {
    let (_, token) = require_post(&s, &headers, form.csrf.as_deref()).await?;
    s.stored(s.store.revoke_console_session(&token_hash(&token)).await)?;
    let mut r = Redirect::to("/console/signin").into_response();
    if let Some(c) = cookie(&s, "", 0) {
        r.headers_mut().insert(header::SET_COOKIE, c);
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::{client_of, csrf_ok, csrf_token, hash_password, password_ok, SignInLimits};
    use crate::limits::RateLimits;
    use std::net::IpAddr;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))
    }

    /// One IPv6 host holds a /64: counted per address it had 2^64 sign-in budgets (each
    /// attempt an argon2 hash, 19 MiB). Its whole /64 shares the per-IP limit (a burst of 10);
    /// another /64 and IPv4 clients keep their own; an IPv4-mapped address is its IPv4 client.
    #[tokio::test]
    async fn an_ipv6_host_cannot_dodge_the_sign_in_limit_by_changing_address() {
        let limits = SignInLimits::default();
        let shared = RateLimits::in_memory(0, 0);
        for i in 0..10 {
            let addr = ip(&format!("2001:db8:1:2:{i:x}::{:x}", i * 7 + 1));
            assert!(limits.allow(&shared, addr, None).await, "attempt {i}");
        }
        assert!(
            !limits
                .allow(&shared, ip("2001:db8:1:2:ffff::1"), None)
                .await,
            "the 11th attempt from the same /64"
        );
        assert!(limits.allow(&shared, ip("2001:db8:1:3::1"), None).await);
        assert!(limits.allow(&shared, ip("192.0.2.7"), None).await);
        assert_eq!(client_of(ip("::ffff:192.0.2.7")), ip("192.0.2.7"));
        assert_eq!(client_of(ip("2001:db8:1:2:a:b:c:d")), ip("2001:db8:1:2::"));
        assert_eq!(client_of(ip("192.0.2.7")), ip("192.0.2.7"));
    }

    #[test]
    fn csrf_tokens_belong_to_one_session() {
        let t = csrf_token("a");
        assert!(csrf_ok("a", &t));
        assert!(!csrf_ok("b", &t));
        assert!(!csrf_ok("a", ""));
    }

    #[test]
    fn passwords_verify_only_themselves() -> Result<(), argon2::password_hash::Error> {
        let h = hash_password("correct horse")?;
        assert!(h.starts_with("$argon2id$"));
        assert!(password_ok(&h, "correct horse"));
        assert!(!password_ok(&h, "correct hors"));
        assert!(!password_ok("not a hash", "x"));
        Ok(())
    }

    /// No more than the turns run at once, whatever the number of callers; a caller that finds
    /// no turn within its wait is told busy, and gets one once a turn is free.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn password_hashing_runs_a_few_at_a_time() {
        use super::hash_in_turn;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let turns = std::sync::Arc::new(tokio::sync::Semaphore::new(2));
        let running = std::sync::Arc::new(AtomicUsize::new(0));
        let most = std::sync::Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                let (turns, running, most) = (turns.clone(), running.clone(), most.clone());
                tokio::spawn(async move {
                    hash_in_turn(&turns, std::time::Duration::from_secs(3600), move || {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        // stay until another runs beside this one (or 5 s: the last may be alone)
                        let since = std::time::Instant::now();
                        while running.load(Ordering::SeqCst) < 2
                            && since.elapsed() < std::time::Duration::from_secs(5)
                        {
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                        std::thread::sleep(std::time::Duration::from_millis(2));
                        running.fetch_sub(1, Ordering::SeqCst);
                        7
                    })
                    .await
                })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap(), 7);
        }
        assert_eq!(
            most.load(Ordering::SeqCst),
            2,
            "at most two at once, and two did run"
        );
        // every turn taken: the next caller is told busy once its wait is over
        let held = turns.clone().acquire_many_owned(2).await.unwrap();
        let busy = hash_in_turn(&turns, std::time::Duration::from_millis(10), || 1).await;
        assert!(busy.is_err());
        drop(held);
        let ok = hash_in_turn(&turns, std::time::Duration::from_millis(10), || 1).await;
        assert_eq!(ok.unwrap(), 1);
        // a caller that vanishes once its hash has started does not free the turn: the work
        // holds it until it finishes
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (finish_tx, finish_rx) = std::sync::mpsc::channel::<()>();
        let caller = {
            let turns = turns.clone();
            tokio::spawn(async move {
                hash_in_turn(&turns, std::time::Duration::from_secs(3600), move || {
                    started_tx.send(()).unwrap();
                    finish_rx.recv().unwrap();
                })
                .await
            })
        };
        tokio::task::spawn_blocking(move || started_rx.recv().unwrap())
            .await
            .unwrap();
        caller.abort();
        assert!(caller.await.unwrap_err().is_cancelled());
        assert_eq!(
            turns.available_permits(),
            1,
            "the running hash keeps its turn"
        );
        finish_tx.send(()).unwrap();
        let _all = tokio::time::timeout(std::time::Duration::from_secs(600), turns.acquire_many(2))
            .await
            .expect("the turn comes back once the hash ends")
            .unwrap();
    }
}
