//! The console's security (issue 18), against a real gateway process over real sockets (on the
//! SQLite ledger, and again on PostgreSQL) with a real agent and llama.cpp node: no session → the sign-in page; a missing or
//! wrong CSRF token → 403; a builder never sees another account's keys, requests or usage,
//! an operator never another operator's nodes or tokens (every id-bearing URL tried with a
//! foreign id); names with `<script>` escaped; the full API key shown exactly once; no prompt
//! or completion text on any page; sign-in links single use; sessions revocable; the sign-in
//! rate limit answers 429. The platform's pages: signed out → sign in, builders and operators
//! 403 there and a platform user 403 on theirs, its e-mail (`<script>…`) escaped, no request
//! text, hostile cursors harmless; key RPM/TPM set within the gateway's cap, hostile values a
//! clear 400 page, another account's key 404.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod common;

use common::console::{csrf_in, value_of, Session};
use common::*;
use serde_json::{json, Value};
use spine_test_support::{stdout_of, Engine, LlamaServer};

async fn create_user(gw: &Gateway, body: Value) -> Value {
    let (s, v) = gw.admin_post("/admin/v1/console/users", body).await;
    assert_eq!(s, 201, "{v}");
    v
}

const BUILDER_PAGES: &[&str] = &[
    "/console/keys",
    "/console/balance",
    "/console/usage",
    "/console/usage.csv",
    "/console/requests",
    "/console/playground",
];
const OPERATOR_PAGES: &[&str] = &[
    "/console/nodes",
    "/console/earnings",
    "/console/enrollments",
];
const PLATFORM_PAGES: &[&str] = &[
    "/console/platform",
    "/console/platform/nodes",
    "/console/platform/discrepancies",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_sessions_csrf_isolation_escaping_and_rate_limits_sqlite() {
    console_security("").await;
}

/// The same on the PostgreSQL ledger (a fresh database, dropped at the end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_sessions_csrf_isolation_escaping_and_rate_limits_postgres() {
    let db = PgDb::create();
    console_security(&format!("database_url = \"{}\"", db.url)).await;
}

/// The whole check on a gateway started with `extra` top-level TOML.
async fn console_security(extra: &str) {
    let engine = Engine::discover().unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    // a cap for the keys' own limits a builder sets (RPM 1000, TPM unlimited)
    let gw = Gateway::start_with(
        dir.path(),
        &engine,
        &format!("{extra}\ndefault_rpm_limit = 1000"),
    )
    .await;
    assert!(
        gw.console.starts_with("http://127.0.0.1:"),
        "{}",
        gw.console
    );
    let a = setup(&gw, dir.path(), &llama.url).await;
    // tenant B: another account (and key) and another operator (`tenant`'s credit key is one
    // per gateway)
    let (b_account, _b_key) = account_with_credit(&gw, CREDITS).await;
    let (s, b_op) = gw.admin_post("/admin/v1/operators", json!({})).await;
    assert_eq!(s, 201);
    let b_operator = b_op["id"].as_str().unwrap().to_owned();

    // a request of account A through the public API: its prompt and answer must never show
    let marker = "zebracorn-7431";
    let resp = gw
        .api_post(
            &a.api_key,
            "/v1/chat/completions",
            &json!({"model":"smollm2","max_tokens":24,"temperature":0,
                    "messages":[{"role":"user","content":format!("Write a sentence about {marker}.")}]}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let a_request = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let answer: Value = resp.json().await.unwrap();
    let completion = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let record = gw.record(&a_request).await;

    // console users: builders A and B (passwords), operator A (link only), operator B
    let pw = "correct horse battery";
    create_user(
        &gw,
        json!({"email":"a@example.com","account_id":a.account,"password":pw}),
    )
    .await;
    create_user(
        &gw,
        json!({"email":"b@example.com","account_id":b_account,"password":pw}),
    )
    .await;
    let op_a = create_user(
        &gw,
        json!({"email":"opa@example.com","operator_id":a.operator,"sign_in_link":true}),
    )
    .await;
    // operator B's user through the admin CLI, the password from the environment
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_reference-gateway"))
        .args([
            "admin",
            "console-users",
            "create",
            "--email",
            "opb@example.com",
        ])
        .args(["--operator", &b_operator])
        .env("SPINE_ADMIN_URL", &gw.admin)
        .env("SPINE_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("SPINE_CONSOLE_PASSWORD", pw)
        .output()
        .await
        .unwrap();
    let op_b: Value = serde_json::from_slice(&stdout_of(out, "")).unwrap();
    assert_eq!(op_b["role"], "operator", "{op_b}");
    assert!(op_b["sign_in_path"].is_null(), "no link asked for");
    // admin API refusals: both roles, no credential, a short password
    for bad in [
        json!({"email":"x@example.com","account_id":a.account,"operator_id":a.operator,"password":pw}),
        json!({"email":"x@example.com","account_id":a.account}),
        json!({"email":"x@example.com","account_id":a.account,"password":"short"}),
    ] {
        let (s, v) = gw.admin_post("/admin/v1/console/users", bad).await;
        assert_eq!(s, 400, "{v}");
    }
    let (s, _) = gw
        .admin_post(
            "/admin/v1/console/users",
            json!({"email":"a@example.com","account_id":a.account,"password":pw}),
        )
        .await;
    assert_eq!(s, 409, "the same e-mail twice");

    // --- no session: every page redirects to the sign-in page; posts are 403 ------------------
    let anon = Session::new(&gw.console);
    for page in BUILDER_PAGES
        .iter()
        .chain(OPERATOR_PAGES)
        .chain(PLATFORM_PAGES)
        .chain(&["/console"])
    {
        let (status, _, headers) = anon.get(page).await;
        assert_eq!(status, 303, "{page}");
        assert_eq!(headers["location"], "/console/signin", "{page}");
    }
    let (status, body, _) = anon.get("/console/signin").await;
    assert_eq!(status, 200);
    assert!(body.contains("name=\"password\""));
    for (path, form) in [
        ("/console/keys", vec![("name", "x")]),
        ("/console/keys/revoke", vec![("key_hash", "x")]),
        ("/console/enrollments", vec![]),
        ("/console/signout", vec![]),
    ] {
        assert_eq!(anon.post(path, &form).await.0, 403, "{path}");
    }
    let (status, body, _) = anon.get("/console/nope").await;
    assert_eq!(status, 404);
    assert!(body.contains("<html"), "an HTML error page");
    // hostile input: a form without its fields, a query that does not parse → HTML error pages
    let (status, body, headers) = anon.post("/console/signin", &[("email", "x")]).await;
    assert!((400..500).contains(&status), "{status}");
    assert!(headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    assert!(body.contains("<html"), "{body}");

    // --- sign in: a wrong password is 401 and sets no cookie ----------------------------------
    let (status, body, headers) = anon
        .post(
            "/console/signin",
            &[("email", "a@example.com"), ("password", "wrong password!")],
        )
        .await;
    assert_eq!(status, 401);
    assert!(headers.get("set-cookie").is_none());
    assert!(body.contains("Wrong e-mail or password."));
    let mut sa = Session::new(&gw.console);
    sa.sign_in("a@example.com", pw).await;
    let (status, _, headers) = sa.get("/console").await;
    assert_eq!(
        (status, headers["location"].to_str().unwrap()),
        (303, "/console/keys")
    );
    let (status, keys_page, headers) = sa.get("/console/keys").await;
    assert_eq!(status, 200);
    assert_eq!(headers["cache-control"], "no-store");
    assert!(headers["content-security-policy"]
        .to_str()
        .unwrap()
        .contains("script-src 'self'"));
    let csrf = csrf_in(&keys_page).unwrap();
    assert_eq!(csrf.len(), 64);

    // --- CSRF: missing or wrong → 403, nothing created ------------------------------------------
    let evil = "<script>alert(1)</script>";
    assert_eq!(sa.post("/console/keys", &[("name", evil)]).await.0, 403);
    assert_eq!(
        sa.post("/console/keys", &[("name", evil), ("csrf", "00")])
            .await
            .0,
        403
    );
    let other_csrf = "a".repeat(64);
    assert_eq!(
        sa.post("/console/keys", &[("name", evil), ("csrf", &other_csrf)])
            .await
            .0,
        403
    );
    assert!(
        !sa.get("/console/keys").await.1.contains("alert(1)"),
        "no key was created"
    );

    // --- a key created in the console: shown exactly once, its name escaped -------------------
    let (status, created, _) = sa
        .post("/console/keys", &[("name", evil), ("csrf", &csrf)])
        .await;
    assert_eq!(status, 200, "{created}");
    let start = created.find("sk-spine-").expect("the new key is shown");
    let new_key: String = created[start..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .collect();
    assert!(new_key.len() > 20, "{new_key}");
    assert_eq!(
        created.matches(&new_key).count(),
        1,
        "the full key appears exactly once"
    );
    assert!(!created.contains(evil), "the name is escaped");
    assert!(created.contains("&lt;script&gt;alert(1)&lt;&#x2f;script&gt;"));
    let (_, later, _) = sa.get("/console/keys").await;
    assert!(!later.contains(&new_key), "never shown again");
    assert!(later.contains(&new_key[new_key.len() - 4..]), "its hint is");
    // the key works on the public API and is billed to A with the key recorded
    let (s, id) = gw.say_hi(&new_key).await;
    assert_eq!(s, 200);
    let new_key_request = gw.record(&id).await;
    assert_eq!(new_key_request["account"], a.account.as_str());

    // --- A's own pages: the request with its billed tokens, never its text ---------------------
    let (_, requests, _) = sa.get("/console/requests").await;
    assert!(requests.contains(&a_request), "A sees its request");
    let billed = format!(
        "<span class=\"billed-prompt\">{}</span>",
        record["billed"]["prompt_tokens"].as_u64().unwrap()
    );
    assert!(requests.contains(&billed), "{billed}");
    for page in BUILDER_PAGES {
        let (status, body, _) = sa.get(page).await;
        assert_eq!(status, 200, "{page}");
        assert!(!body.contains(marker), "{page} shows the prompt");
        assert!(
            completion.len() < 12 || !body.contains(&completion),
            "{page} shows the completion"
        );
    }
    let (_, csv, headers) = sa.get("/console/usage.csv").await;
    assert_eq!(headers["content-type"], "text/csv; charset=utf-8");
    assert!(csv.starts_with("date,model,key,requests,"), "{csv}");
    assert!(csv.contains("smollm2"), "{csv}");
    let (status, body, _) = sa.get("/console/usage?days=lots").await;
    assert_eq!(status, 400);
    assert!(body.contains("<html"), "{body}");
    // a builder is not an operator, nor the platform
    for page in OPERATOR_PAGES.iter().chain(PLATFORM_PAGES) {
        assert_eq!(sa.get(page).await.0, 403, "{page}");
    }

    // --- per-key RPM/TPM: within the cap, hostile values a clear 400 page ----------------------
    let (status, limited, _) = sa
        .post(
            "/console/keys",
            &[
                ("name", "limited"),
                ("rpm", "7"),
                ("tpm", "900"),
                ("csrf", &csrf),
            ],
        )
        .await;
    assert_eq!(status, 200, "{limited}");
    assert!(
        limited.contains("<td class=\"rpm\">7</td>")
            && limited.contains("<td class=\"tpm\">900</td>"),
        "{limited}"
    );
    for (rpm, tpm) in [
        ("1001", ""),
        ("0", ""),
        ("-1", ""),
        ("7", "99999999999999999999"),
        ("<script>alert(1)</script>", ""),
        ("\u{0}\u{ff}\u{202e}", "1e3"),
    ] {
        let (status, body, headers) = sa
            .post(
                "/console/keys",
                &[
                    ("name", "over"),
                    ("rpm", rpm),
                    ("tpm", tpm),
                    ("csrf", &csrf),
                ],
            )
            .await;
        assert_eq!(status, 400, "rpm {rpm:?} tpm {tpm:?}: {body}");
        assert!(headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html"));
        assert!(
            body.contains("The RPM limit must be a whole number from 1 to 1000"),
            "{body}"
        );
        assert!(!body.contains("sk-spine-"), "no key was created");
    }
    assert!(
        !sa.get("/console/keys").await.1.contains(">over<"),
        "nothing created"
    );
    // edit: the account's own live key; CSRF checked; both limits needed
    // the newest key is the first row
    let limited_hash = value_of(&limited, "key_hash").unwrap();
    assert_eq!(sa.set_limits(&limited_hash, "8", "00").await, 403, "CSRF");
    assert_eq!(
        sa.set_limits(&limited_hash, "", &csrf).await,
        400,
        "both limits"
    );
    assert_eq!(
        sa.set_limits(&limited_hash, "5000", &csrf).await,
        400,
        "over the cap"
    );
    assert_eq!(sa.set_limits(&limited_hash, "8", &csrf).await, 303);
    let keys_now = sa.get("/console/keys").await.1;
    assert!(
        keys_now.contains("<td class=\"rpm\">8</td>")
            && keys_now.contains("<td class=\"tpm\">1200</td>"),
        "{keys_now}"
    );

    // --- B never sees A: every id-bearing URL with A's ids ------------------------------------
    let mut sb = Session::new(&gw.console);
    sb.sign_in("b@example.com", pw).await;
    let b_csrf = csrf_in(&sb.get("/console/keys").await.1).unwrap();
    let a_key_hash = {
        // A's key hash, from A's own revoke form
        value_of(&later, "key_hash").unwrap()
    };
    for page in BUILDER_PAGES {
        let (status, body, _) = sb.get(page).await;
        assert_eq!(status, 200, "{page}");
        for foreign in [
            a_request.as_str(),
            a_key_hash.as_str(),
            a.account.as_str(),
            marker,
        ] {
            assert!(!body.contains(foreign), "B's {page} shows {foreign}");
        }
    }
    let cursor = format!("{}.{}", i64::MAX, a_request);
    for url in [
        format!("/console/requests?key={a_key_hash}"),
        format!("/console/requests?key={a_key_hash}&model=smollm2&outcome=completed"),
        format!("/console/requests?after={cursor}"),
        format!("/console/balance?after={cursor}"),
    ] {
        let (status, body, _) = sb.get(&url).await;
        assert_eq!(status, 200, "{url}");
        assert!(
            !body.contains(&a_request) && !body.contains(&a.account),
            "{url}"
        );
    }
    let (status, _, _) = sb
        .post(
            "/console/keys/revoke",
            &[("csrf", &b_csrf), ("key_hash", &a_key_hash)],
        )
        .await;
    assert_eq!(status, 404, "B cannot revoke A's key");
    let (status, _, _) = sb
        .post(
            "/console/keys/limits",
            &[
                ("csrf", &b_csrf),
                ("key_hash", &a_key_hash),
                ("rpm", "1"),
                ("tpm", "1"),
            ],
        )
        .await;
    assert_eq!(status, 404, "B cannot set A's key's limits");
    assert_eq!(gw.say_hi(&new_key).await.0, 200, "A's key still works");
    // B's playground with A's key: refused before anything is sent
    let r = sb
        .http
        .post(format!("{}/console/playground/chat", gw.console))
        .header("cookie", sb.cookie.clone().unwrap())
        .header("x-csrf-token", &b_csrf)
        .body(json!({"key": new_key, "model":"smollm2","prompt":"hi"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    // and the playground without the CSRF header
    let r = sa
        .http
        .post(format!("{}/console/playground/chat", gw.console))
        .header("cookie", sa.cookie.clone().unwrap())
        .body(json!({"key": new_key, "model":"smollm2","prompt":"hi"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);

    // --- operators: a one-time link for A's operator; B's operator never sees A's node -------
    let link = op_a["sign_in_path"].as_str().unwrap().to_owned();
    let (status, page, _) = anon.get(&link).await;
    assert_eq!(status, 200);
    assert!(page.contains("id=\"use-link\""));
    let token = link.rsplit('/').next().unwrap().to_owned();
    let mut so = Session::new(&gw.console);
    let (status, _, headers) = so.post("/console/signin/link", &[("token", &token)]).await;
    assert_eq!(status, 303);
    so.take_cookie(&headers);
    assert_eq!(
        anon.post("/console/signin/link", &[("token", &token)])
            .await
            .0,
        403,
        "single use"
    );
    let (status, nodes, _) = so.get("/console/nodes").await;
    assert_eq!(status, 200);
    assert!(
        nodes.contains(&a.node_id) && nodes.contains("routable"),
        "{nodes}"
    );
    let o_csrf = csrf_in(&nodes).unwrap();
    let (status, issued, _) = so.post("/console/enrollments", &[("csrf", &o_csrf)]).await;
    assert_eq!(status, 200);
    let join = issued.replace("&#x2f;", "/");
    assert!(
        join.contains("reference-agent join --gateway wss://localhost:")
            && !join.contains("wss://localhost:0 "),
        "{issued}"
    );
    assert_eq!(
        issued.matches("spine-enroll-").count(),
        1,
        "the token, once"
    );
    let a_token_hash = value_of(&issued, "token_hash").unwrap();
    assert_eq!(a_token_hash.len(), 64);
    for page in BUILDER_PAGES.iter().chain(PLATFORM_PAGES) {
        assert_eq!(
            so.get(page).await.0,
            403,
            "an operator is neither a builder nor the platform: {page}"
        );
    }

    let mut sob = Session::new(&gw.console);
    sob.sign_in("opb@example.com", pw).await;
    let ob_csrf = csrf_in(&sob.get("/console/nodes").await.1).unwrap();
    for page in OPERATOR_PAGES {
        let (status, body, _) = sob.get(page).await;
        assert_eq!(status, 200, "{page}");
        for foreign in [
            a.node_id.as_str(),
            a.operator.as_str(),
            a_token_hash.as_str(),
        ] {
            assert!(
                !body.contains(foreign),
                "operator B's {page} shows {foreign}"
            );
        }
    }
    let (status, _, _) = sob
        .post(
            "/console/enrollments/revoke",
            &[("csrf", &ob_csrf), ("token_hash", &a_token_hash)],
        )
        .await;
    assert_eq!(status, 404, "B's operator cannot revoke A's token");
    let (status, _, _) = so
        .post(
            "/console/enrollments/revoke",
            &[("csrf", &o_csrf), ("token_hash", &a_token_hash)],
        )
        .await;
    assert_eq!(status, 303, "A's operator can");

    // --- the platform: every node and the money, never a builder's or operator's page ---------
    let (s, v) = gw
        .admin_post(
            "/admin/v1/console/users",
            json!({"email":"x@example.com","platform":true,"account_id":a.account,"password":pw}),
        )
        .await;
    assert_eq!(s, 400, "the platform and an account: {v}");
    let staff = create_user(
        &gw,
        json!({"email": format!("{evil}@example.com"), "platform": true, "sign_in_link": true}),
    )
    .await;
    assert_eq!(
        (staff["role"].as_str(), &staff["owner_id"]),
        (Some("platform"), &Value::Null)
    );
    let token = staff["sign_in_path"]
        .as_str()
        .unwrap()
        .rsplit('/')
        .next()
        .unwrap()
        .to_owned();
    // and through the admin CLI (`--platform`, alone: not beside an account)
    let cli = |args: &[&str]| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_reference-gateway"))
            .args(["admin", "console-users", "create"])
            .args(args)
            .env("SPINE_ADMIN_URL", &gw.admin)
            .env("SPINE_ADMIN_TOKEN", ADMIN_TOKEN)
            .env("SPINE_CONSOLE_PASSWORD", pw)
            .output()
    };
    let out = cli(&["--email", "staff2@example.com", "--platform"])
        .await
        .unwrap();
    let staff2: Value = serde_json::from_slice(&stdout_of(out, "")).unwrap();
    assert_eq!(staff2["role"], "platform", "{staff2}");
    let out = cli(&[
        "--email",
        "staff3@example.com",
        "--platform",
        "--account",
        &a.account,
    ])
    .await
    .unwrap();
    assert!(!out.status.success(), "--platform with --account");
    let mut sp = Session::new(&gw.console);
    let (status, _, headers) = sp.post("/console/signin/link", &[("token", &token)]).await;
    assert_eq!(status, 303);
    sp.take_cookie(&headers);
    let (status, _, headers) = sp.get("/console").await;
    assert_eq!(
        (status, headers["location"].to_str().unwrap()),
        (303, "/console/platform")
    );
    for page in BUILDER_PAGES.iter().chain(OPERATOR_PAGES) {
        assert_eq!(
            sp.get(page).await.0,
            403,
            "the platform is not an owner: {page}"
        );
    }
    let (_, overview, _) = sp.get("/console/platform").await;
    let p_csrf = csrf_in(&overview).unwrap();
    let cursor_of_hostility = format!("{}.%3Cscript%3Ealert(1)%3C%2Fscript%3E", i64::MAX);
    for page in PLATFORM_PAGES.iter().map(|p| (*p).to_owned()).chain([
        format!("/console/platform/nodes?after={cursor_of_hostility}"),
        format!("/console/platform/discrepancies?after={cursor_of_hostility}"),
        "/console/platform?days=7".to_owned(),
    ]) {
        let (status, body, headers) = sp.get(&page).await;
        assert_eq!(status, 200, "{page}");
        assert!(headers["content-security-policy"]
            .to_str()
            .unwrap()
            .contains("script-src 'self'"));
        assert!(!body.contains(evil), "{page}: the e-mail is escaped");
        assert!(body.contains("&lt;script&gt;alert(1)"), "{page}");
        assert!(!body.contains(marker), "{page} shows the prompt");
        assert!(
            completion.len() < 12 || !body.contains(&completion),
            "{page} shows the completion"
        );
    }
    let (_, all_nodes, _) = sp.get("/console/platform/nodes").await;
    assert!(
        all_nodes.contains(&a.node_id) && all_nodes.contains(&a.operator),
        "every operator's nodes: {all_nodes}"
    );
    let (status, body, _) = sp.get("/console/platform?days=lots").await;
    assert_eq!(status, 400);
    assert!(body.contains("<html"), "{body}");
    // its only POST, sign-out, needs the CSRF token
    assert_eq!(sp.post("/console/signout", &[]).await.0, 403);
    assert_eq!(
        sp.post("/console/signout", &[("csrf", &other_csrf)])
            .await
            .0,
        403
    );
    assert_eq!(
        sp.post("/console/signout", &[("csrf", &p_csrf)]).await.0,
        303
    );
    assert_eq!(sp.get("/console/platform").await.0, 303, "signed out");

    // --- sessions end: sign-out, and the admin API revokes a user's sessions ------------------
    let (status, _, headers) = sb.post("/console/signout", &[("csrf", &b_csrf)]).await;
    assert_eq!(status, 303);
    assert!(headers["set-cookie"]
        .to_str()
        .unwrap()
        .contains("Max-Age=0"));
    assert_eq!(sb.get("/console/keys").await.0, 303, "signed out");
    let (s, v) = gw
        .admin_post(
            &format!(
                "/admin/v1/console/users/{}/revoke-sessions",
                op_b["user_id"].as_str().unwrap()
            ),
            json!({}),
        )
        .await;
    assert_eq!((s, v["revoked"].as_u64()), (200, Some(1)), "{v}");
    assert_eq!(sob.get("/console/nodes").await.0, 303, "revoked");

    // --- the sign-in rate limit: an address tried too often gets 429 --------------------------
    let mut statuses = Vec::new();
    for _ in 0..8 {
        let (status, _, _) = anon
            .post(
                "/console/signin",
                &[
                    ("email", "nobody@example.com"),
                    ("password", "guess guess guess"),
                ],
            )
            .await;
        statuses.push(status);
    }
    // per address a burst of 5 (this client IP's own burst of 10 may end it sooner: it signed in
    // six times above); once refused, every further attempt is
    assert_eq!(statuses[0], 401, "{statuses:?}");
    let first_refused = statuses
        .iter()
        .position(|s| *s == 429)
        .expect("rate limited");
    assert!((1..=5).contains(&first_refused), "{statuses:?}");
    assert!(
        statuses[first_refused..].iter().all(|s| *s == 429),
        "{statuses:?}"
    );
    assert!(
        statuses[..first_refused].iter().all(|s| *s == 401),
        "{statuses:?}"
    );
    drop(llama);
}
