//! `reference-gateway admin …` against a real gateway (issue 16): every resource through the
//! command line, `--field` for scripts, and errors with the API's message and exit status 1.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod common;

use common::{Gateway, ADMIN_TOKEN};
use serde_json::Value;
use spine_test_support::Engine;

/// Runs `reference-gateway admin <args>`; (exit success, stdout, stderr).
async fn admin(gw: &Gateway, args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_reference-gateway"))
        .arg("admin")
        .args(args)
        .env("SPINE_ADMIN_URL", &gw.admin)
        .env("SPINE_ADMIN_TOKEN", ADMIN_TOKEN)
        .env_remove("SPINE_CONFIG")
        .output()
        .await
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

async fn field(gw: &Gateway, args: &[&str], name: &str) -> String {
    let mut all = args.to_vec();
    all.extend(["--field", name]);
    let (ok, out, err) = admin(gw, &all).await;
    assert!(ok, "{args:?}: {err}");
    out.trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_call_from_the_command_line() {
    let engine = Engine::discover().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(dir.path(), &engine).await;

    let operator = field(&gw, &["operators", "create"], "id").await;
    assert!(operator.starts_with("op_"), "{operator}");
    let account = field(&gw, &["accounts", "create", "--id", "acct_cli"], "id").await;
    assert_eq!(account, "acct_cli");
    let key = field(&gw, &["keys", "create", &account, "--rpm", "60"], "key").await;
    assert!(key.starts_with("sk-"), "{key}");
    let credits_t1 = [
        "credits",
        "add",
        account.as_str(),
        "1000000",
        "--idempotency-key",
        "t1",
    ];
    let (ok, out, err) = admin(&gw, &credits_t1).await;
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["applied"], true);
    // the same key again adds nothing
    let (ok, out, _) = admin(&gw, &credits_t1).await;
    assert!(ok);
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["applied"],
        false
    );
    assert_eq!(gw.balance(&account).await, (1_000_000, 0));
    let balance = field(&gw, &["accounts", "show", &account], "balance_micros").await;
    assert_eq!(balance, "1000000");

    let token = field(&gw, &["enrollments", "create", &operator], "token").await;
    assert!(token.starts_with("spine-enroll-"), "{token}");
    let (_, public_key) = common::keygen(dir.path(), "n.key").await;
    let node = field(
        &gw,
        &["nodes", "register", &operator, &public_key],
        "node_id",
    )
    .await;
    assert!(node.starts_with("node_"), "{node}");
    let (ok, out, _) = admin(&gw, &["nodes", "list"]).await;
    assert!(ok);
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["object"],
        "list"
    );
    let (ok, out, _) = admin(&gw, &["operators", "show", &operator]).await;
    assert!(ok);
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap()["id"], operator);
    let (ok, out, _) = admin(&gw, &["queues"]).await;
    assert!(ok, "{out}");

    // errors: the API's message, exit status 1, nothing on stdout
    let (ok, out, err) = admin(&gw, &["accounts", "show", "acct_nope"]).await;
    assert!(!ok);
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains("HTTP 404") && err.contains("acct_nope"),
        "{err}"
    );
    let (ok, _, err) = admin(&gw, &["requests", "show", "req_nope"]).await;
    assert!(!ok && err.contains("404"), "{err}");
    let (ok, _, err) = admin(&gw, &["accounts", "show", &account, "--field", "nope"]).await;
    assert!(!ok && err.contains("no member 'nope'"), "{err}");
    // a wrong token and an unreachable gateway say so
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_reference-gateway"))
        .args(["admin", "nodes", "list"])
        .env("SPINE_ADMIN_URL", &gw.admin)
        .env("SPINE_ADMIN_TOKEN", "wrong-token-0123456789")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("HTTP 401"));
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_reference-gateway"))
        .args(["admin", "nodes", "list"])
        .env("SPINE_ADMIN_URL", "http://127.0.0.1:9")
        .env("SPINE_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot reach the admin API at http://127.0.0.1:9"),
        "{err}"
    );
}
