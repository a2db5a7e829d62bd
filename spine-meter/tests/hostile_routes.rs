//! The library's HTTP surfaces under hostile input: the admin API's console calls
//! (`console::admin_routes`), the enrollment handlers (`enroll`), the tunnel listener's router
//! (`NodeEnrollment::tunnel_router`) and the console's sign-in, over SQLite and PostgreSQL.
//!
//! Every error a caller can provoke is in OpenAI's shape with the right status (a path that is
//! not UTF-8, a body past the limit, a wrong method or URL), and a text holding a NUL (which
//! PostgreSQL cannot store) is the caller's 400, never a 5xx that says "retry".
#![cfg(all(feature = "console", feature = "enroll", feature = "postgres"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::sync::Arc;

use axum::body::Body;
use axum::routing::{get, post};
use axum::Router;
use http::{Request, StatusCode};
use serde_json::{json, Value};
use spine_core::{ModelId, NodeId};
use spine_meter::console::{self, ConsoleConfig, ConsoleHost, ConsoleState};
use spine_meter::enroll::{self, LiveNode, LiveNodes, NodeEnrollment};
use spine_meter::limits::RateLimits;
use spine_meter::{PgLedger, SqliteLedger, Store};
use tower::ServiceExt as _;

struct Host {
    store: Arc<dyn Store>,
    limits: RateLimits,
    models: Vec<ModelId>,
    registry: spine_router::NodeRegistry,
    tunnels: spine_transport::Tunnels,
}

impl ConsoleHost for Host {
    fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }
    fn rate_limits(&self) -> &RateLimits {
        &self.limits
    }
    fn forget_key(&self, _key_hash: &str) {}
    fn models(&self) -> &[ModelId] {
        &self.models
    }
    fn registry(&self) -> &spine_router::NodeRegistry {
        &self.registry
    }
    fn tunnels(&self) -> &spine_transport::Tunnels {
        &self.tunnels
    }
    fn auditor(&self) -> Option<&spine_meter::audit::Auditor> {
        None
    }
}

struct NoneLive;

impl LiveNodes for NoneLive {
    fn live(&self, nodes: &[NodeId]) -> Vec<LiveNode> {
        vec![LiveNode::default(); nodes.len()]
    }
}

fn host(store: Arc<dyn Store>) -> Arc<Host> {
    let tunnels = spine_transport::TunnelServer::new(
        spine_transport::TunnelServerConfig::default(),
        Arc::new(spine_meter::ledger::StoreAuthenticator(store.clone())),
        Arc::new(()),
    )
    .tunnels();
    Arc::new(Host {
        store,
        limits: RateLimits::in_memory(0, 0),
        models: vec![ModelId::new("m")],
        registry: spine_router::NodeRegistry::new(),
        tunnels,
    })
}

fn enrollment(store: &Arc<dyn Store>) -> NodeEnrollment {
    NodeEnrollment::new(
        store.clone(),
        vec![ModelId::new("m")],
        Arc::new(NoneLive),
        None,
    )
}

/// The admin routes the library serves, as the reference gateway mounts them (behind its
/// admin check, which is not under test here).
fn admin(store: &Arc<dyn Store>) -> Router {
    let e = enrollment(store);
    Router::new()
        .route(
            "/admin/v1/operators/{id}",
            get(enroll::operator).with_state(e.clone()),
        )
        .route(
            "/admin/v1/operators/{id}/enrollments",
            post(enroll::create_enrollment).with_state(e.clone()),
        )
        .route("/admin/v1/nodes", post(enroll::register_node).with_state(e))
        .merge(console::admin_routes::<Host>().with_state(host(store.clone())))
}

async fn call(app: &Router, method: &str, uri: &str, body: impl Into<Body>) -> (StatusCode, Value) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(body.into())
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let content_type = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned());
    let bytes = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    let json: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
        panic!(
            "{method} {uri}: {status} {content_type:?} is not JSON ({e}): {:?}",
            String::from_utf8_lossy(&bytes)
        )
    });
    (status, json)
}

/// OpenAI's error shape, exactly: `{"error": {"message", "type", "param", "code"}}`.
fn assert_openai_error(json: &Value, kind: &str, code: &str, context: &str) {
    let e = &json["error"];
    assert_eq!(e["type"], kind, "{context}: {json}");
    assert_eq!(e["code"], code, "{context}: {json}");
    assert!(e["message"].is_string(), "{context}: {json}");
    assert!(e.get("param").is_some(), "{context}: {json}");
    assert_eq!(e.as_object().unwrap().len(), 4, "{context}: {json}");
    assert_eq!(json.as_object().unwrap().len(), 1, "{context}: {json}");
}

/// Creates a platform console user with `email` through the admin API: the status and answer.
async fn create_console_user(app: &Router, email: &str) -> (StatusCode, Value) {
    call(
        app,
        "POST",
        "/admin/v1/console/users",
        json!({"email": email, "platform": true, "password": "correct horse battery"}).to_string(),
    )
    .await
}

async fn sqlite() -> Arc<dyn Store> {
    Arc::new(SqliteLedger::in_memory().await.unwrap())
}

/// A path parameter that is not UTF-8 once percent-decoded (`%FF`): axum refuses it with a
/// plain-text 400; every admin and enrollment route answers OpenAI's 400 `invalid_path`.
#[tokio::test]
async fn a_path_that_is_not_utf8_is_an_openai_400() {
    let store = sqlite().await;
    let app = admin(&store);
    for (method, uri) in [
        ("GET", "/admin/v1/operators/%FF"),
        ("POST", "/admin/v1/operators/%FF/enrollments"),
        ("POST", "/admin/v1/console/users/%FF/sign-in-link"),
        ("POST", "/admin/v1/console/users/%FF/revoke-sessions"),
    ] {
        let (status, json) = call(&app, method, uri, "").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{method} {uri}: {json}");
        assert_openai_error(&json, "invalid_request_error", "invalid_path", uri);
    }
}

/// A body past axum's default limit (2 MB) on the admin routes that read one: OpenAI's 413
/// `request_too_large`, not axum's plain text.
#[tokio::test]
async fn an_admin_body_past_the_limit_is_an_openai_413() {
    let store = sqlite().await;
    store
        .create_operator(&spine_core::OperatorId::new("op"))
        .await
        .unwrap();
    let app = admin(&store);
    let huge = vec![b' '; 3 << 20];
    for uri in [
        "/admin/v1/console/users",
        "/admin/v1/nodes",
        "/admin/v1/operators/op/enrollments",
    ] {
        let (status, json) = call(&app, "POST", uri, huge.clone()).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{uri}: {json}");
        assert_openai_error(&json, "invalid_request_error", "request_too_large", uri);
    }
}

/// The tunnel listener takes requests from anyone: a wrong method or an unknown URL is in
/// OpenAI's shape too (axum's defaults are empty bodies), and the enrollment still works.
#[tokio::test]
async fn the_tunnel_listeners_wrong_urls_and_methods_are_openai_errors() {
    let store = sqlite().await;
    let app = enrollment(&store).tunnel_router();
    let (status, json) = call(&app, "GET", "/v1/enroll", "").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{json}");
    assert_openai_error(&json, "invalid_request_error", "method_not_allowed", "GET");
    assert_eq!(json["error"]["message"], "GET is not allowed on /v1/enroll");
    let (status, json) = call(&app, "POST", "/v1/node/status", "").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{json}");
    assert_openai_error(&json, "invalid_request_error", "method_not_allowed", "POST");
    let (status, json) = call(&app, "GET", "/v1/nope", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{json}");
    assert_openai_error(&json, "invalid_request_error", "not_found", "/v1/nope");
    assert_eq!(json["error"]["message"], "Unknown URL: GET /v1/nope");
    // the honest path is unchanged: an unknown token is a 401
    let (status, json) = call(
        &app,
        "POST",
        "/v1/enroll",
        {
            let node = spine_transport::NodeIdentity::from_seed(&[3; 32]);
            json!({"token": "spine-enroll-nope", "public_key": node.public_key_text(),
                   "proof": spine_transport::node_status::enrollment_proof(&node, "spine-enroll-nope")})
            .to_string()
        },
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{json}");
    assert_openai_error(
        &json,
        "invalid_request_error",
        "invalid_enrollment_token",
        "enroll",
    );
}

/// A NUL in a caller's text: PostgreSQL refuses it with an error that read as the database
/// failing (503 `ledger_unavailable`, `Retry-After: 1`: SDKs retry it), SQLite stored what
/// PostgreSQL cannot. Both stores now refuse it up front; the admin API answers 400
/// `invalid_text`.
async fn nul_texts_are_the_callers_400(store: Arc<dyn Store>) {
    let app = admin(&store);
    let (status, json) = create_console_user(&app, "a\u{0}@x.example").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{json}");
    assert_openai_error(
        &json,
        "invalid_request_error",
        "invalid_text",
        "create user",
    );
    for (method, uri) in [
        ("GET", "/admin/v1/operators/op%00x"),
        ("POST", "/admin/v1/operators/op%00x/enrollments"),
        ("POST", "/admin/v1/console/users/cu%00x/revoke-sessions"),
    ] {
        let (status, json) = call(&app, method, uri, "").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{method} {uri}: {json}");
        assert_openai_error(&json, "invalid_request_error", "invalid_text", uri);
    }
    assert!(matches!(
        store
            .console()
            .console_user_by_email("a\u{0}@x.example")
            .await,
        Err(spine_meter::LedgerError::InvalidText)
    ));
    // honest texts are unchanged
    let (status, json) = create_console_user(&app, "a@x.example").await;
    assert_eq!(status, StatusCode::CREATED, "{json}");
    assert_eq!(json["email"], "a@x.example");
    let (status, json) = call(&app, "GET", "/admin/v1/operators/nobody", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{json}");
    assert_openai_error(&json, "invalid_request_error", "not_found", "nobody");
}

#[tokio::test]
async fn nul_texts_are_the_callers_400_sqlite() {
    nul_texts_are_the_callers_400(sqlite().await).await;
}

#[tokio::test]
async fn nul_texts_are_the_callers_400_postgres() {
    let db = spine_test_support::PgDb::create();
    let store: Arc<dyn Store> = Arc::new(PgLedger::connect(&db.url).await.unwrap());
    nul_texts_are_the_callers_400(store).await;
}

/// An anonymous sign-in whose e-mail holds a NUL: on PostgreSQL the lookup failed and the
/// console answered 500 ("Something went wrong", logged as an error); now a 400 page.
#[tokio::test]
async fn a_nul_in_the_sign_in_address_is_a_400_page_postgres() {
    let db = spine_test_support::PgDb::create();
    let store: Arc<dyn Store> = Arc::new(PgLedger::connect(&db.url).await.unwrap());
    let state = ConsoleState::new(host(store), Router::new(), ConsoleConfig::default()).unwrap();
    let app = console::router(Arc::new(state));
    let signin = |body: &'static str| {
        let mut req = Request::post("/console/signin")
            .header("content-type", "application/x-www-form-urlencoded")
            .body(Body::from(body))
            .unwrap();
        req.extensions_mut()
            .insert(spine_transport::PeerAddr("192.0.2.1:1234".parse().unwrap()));
        req
    };
    let resp = app
        .clone()
        .oneshot(signin(
            "email=a%00%40x.example&password=correct+horse+battery",
        ))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    // an honest unknown address is still the same refusal as a wrong password
    let resp = app
        .oneshot(signin("email=a%40x.example&password=correct+horse+battery"))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
}

/// Login CSRF: a page on another site posts its author's e-mail and password to the console's
/// sign-in form; the visitor's browser would keep the session cookie it answers with, and the
/// visitor would go on as the attacker (an operator enrolling a GPU under the attacker's
/// operator). A POST the browser marks `Sec-Fetch-Site: cross-site` (or `same-site`) is
/// refused 403 before the handler, without a session; the console's own forms
/// (`same-origin`) and clients that send no such header sign in as before.
#[tokio::test]
async fn a_sign_in_posted_from_another_site_is_refused() {
    let store = sqlite().await;
    let (status, json) = create_console_user(&admin(&store), "p@x.example").await;
    assert_eq!(status, StatusCode::CREATED, "{json}");
    let state = ConsoleState::new(host(store), Router::new(), ConsoleConfig::default()).unwrap();
    let app = console::router(Arc::new(state));
    let request = |method: &str, uri: &str, site: Option<&str>| {
        let mut b = Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/x-www-form-urlencoded");
        if let Some(site) = site {
            b = b.header("sec-fetch-site", site);
        }
        let body = if method == "POST" {
            "email=p%40x.example&password=correct+horse+battery"
        } else {
            ""
        };
        let mut req = b.body(Body::from(body)).unwrap();
        req.extensions_mut()
            .insert(spine_transport::PeerAddr("192.0.2.1:1234".parse().unwrap()));
        req
    };
    for (site, link) in [
        ("cross-site", "/console/signin"),
        ("same-site", "/console/signin"),
        ("cross-site", "/console/signin/link"),
    ] {
        let resp = app
            .clone()
            .oneshot(request("POST", link, Some(site)))
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::FORBIDDEN, "{site} {link}");
        assert!(resp.headers().get("set-cookie").is_none(), "{site} {link}");
        assert!(resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html"));
    }
    // a link from elsewhere still opens the sign-in page (a GET changes nothing)
    let resp = app
        .clone()
        .oneshot(request("GET", "/console/signin", Some("cross-site")))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    for site in [Some("same-origin"), None] {
        let resp = app
            .clone()
            .oneshot(request("POST", "/console/signin", site))
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::SEE_OTHER, "{site:?}");
        assert_eq!(resp.headers()["location"], "/console", "{site:?}");
        assert!(resp.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .starts_with("spine_console="));
    }
}

/// `POST /admin/v1/console/users/{id}/sign-in-link` answered every store failure as 404 "no
/// such console user": an admin script told a user does not exist while the ledger is down.
/// An unknown user is still 404; a store that cannot be reached is 503 `ledger_unavailable`.
#[tokio::test]
async fn a_sign_in_link_during_an_outage_is_a_503_not_a_404() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Arc::new(
        SqliteLedger::open(dir.path().join("ledger.db"))
            .await
            .unwrap(),
    );
    let store: Arc<dyn Store> = ledger.clone();
    let app = admin(&store);
    let (status, json) = create_console_user(&app, "p@x.example").await;
    assert_eq!(status, StatusCode::CREATED, "{json}");
    let user = json["user_id"].as_str().unwrap().to_owned();
    let link = format!("/admin/v1/console/users/{user}/sign-in-link");
    let (status, json) = call(&app, "POST", &link, "").await;
    assert_eq!(status, StatusCode::CREATED, "{json}");
    assert!(json["sign_in_path"]
        .as_str()
        .unwrap()
        .starts_with("/console/signin/link/"));
    let (status, json) = call(
        &app,
        "POST",
        "/admin/v1/console/users/cu_nobody/sign-in-link",
        "",
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{json}");
    assert_openai_error(&json, "invalid_request_error", "not_found", "unknown user");
    ledger.close().await;
    let (status, json) = call(&app, "POST", &link, "").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{json}");
    assert_openai_error(&json, "api_error", "ledger_unavailable", "outage");
}
