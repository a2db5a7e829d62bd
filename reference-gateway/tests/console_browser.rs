//! The console in real Chromium (issue 18): Debian's `chromium`, driven by `playwright-core`
//! (`reference-gateway/browser/console.test.mjs`; no browser download), against the real
//! gateway, agent and llama.cpp node. A builder signs in, creates a key, streams a chat in the
//! playground and finds that request in the log with the billed tokens of the ledger's record,
//! and the usage table and chart updated; a GPU operator signs in, sees the node routable and
//! earnings equal to the ledger's operator credit, and issues an enrollment token; a platform
//! user signs in and sees revenue equal to the callers' debits, fees equal to debits less
//! operator credits, and the node. Every page is screenshotted under
//! `<target>/tmp/console-screenshots/`.
//!
//! Needs `chromium` and `npm ci` in `reference-gateway/browser` (both done by
//! `scripts/setup.sh`); fails, rather than skips, without them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use spine_test_support::{Engine, LlamaServer};

/// Micros as the console prints credits (`1.234567`).
fn credits(micros: u64) -> String {
    format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builder_and_operator_in_real_chromium() {
    let chromium = std::env::var_os("SPINE_CHROMIUM")
        .map_or_else(|| PathBuf::from("/usr/bin/chromium"), PathBuf::from);
    let browser_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("browser");
    assert!(
        chromium.exists() && browser_dir.join("node_modules/playwright-core").exists(),
        "needs {} and playwright-core in {}: run scripts/setup.sh",
        chromium.display(),
        browser_dir.display()
    );
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
    std::fs::create_dir_all(&shots).unwrap();

    let engine = Engine::discover().unwrap();
    let llama = LlamaServer::start(&engine, 2).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    // defaults the builder's own key limits must stay within
    let key_limits = "default_rpm_limit = 600\ndefault_tpm_limit = 1000000";
    let gw = Gateway::start_with(dir.path(), &engine, key_limits).await;
    let s = setup(&gw, dir.path(), &llama.url).await;
    let password = "a long console password";
    for body in [
        json!({"email":"builder@example.com","account_id":s.account,"password":password}),
        json!({"email":"gpu@example.com","operator_id":s.operator,"password":password}),
        json!({"email":"staff@example.com","platform":true,"password":password}),
    ] {
        let (status, v) = gw.admin_post("/admin/v1/console/users", body).await;
        assert_eq!(status, 201, "{v}");
    }

    let started = std::time::Instant::now();
    let run = tokio::process::Command::new("node")
        .arg(browser_dir.join("console.test.mjs"))
        .current_dir(&browser_dir)
        .env("CONSOLE_URL", &gw.console)
        .env("BUILDER_EMAIL", "builder@example.com")
        .env("OPERATOR_EMAIL", "gpu@example.com")
        .env("PLATFORM_EMAIL", "staff@example.com")
        .env("PASSWORD", password)
        .env("NODE_ID", &s.node_id)
        .env("SCREENSHOT_DIR", &shots)
        .env("CHROMIUM", &chromium)
        .kill_on_drop(true)
        .output();
    // a bound for a hang only (it takes seconds)
    let out = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .expect("the browser run hung for 5 minutes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "browser run failed:\n{stdout}\n{}\ngateway:\n{}",
        String::from_utf8_lossy(&out.stderr),
        gw.child.stderr_tail(30)
    );
    println!("browser run: {:?}", started.elapsed());
    let seen: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    println!("{seen:#}");

    // the builder
    assert_eq!(
        seen["page_errors"],
        json!([]),
        "no script errors, no CSP refusals"
    );
    assert_eq!(seen["redirected_to_signin"], true);
    assert_eq!(seen["key_prefix_ok"], true);
    assert_eq!(
        seen["key_name_escaped"], true,
        "the name is text, not markup"
    );
    assert_eq!(seen["key_shown_again"], false, "the key is shown once");
    assert_eq!(seen["playground_done"], "true", "{seen}");
    assert_eq!(seen["playground_error"], "");
    assert!(!seen["playground_text"].as_str().unwrap().is_empty());
    let request_id = seen["request_id"].as_str().unwrap();
    assert!(request_id.starts_with("req_"), "{request_id}");
    let record = gw.record(request_id).await;
    assert_eq!(record["outcome"], "completed", "{record}");
    assert_eq!(record["account"], s.account.as_str());
    let billed_prompt = record["billed"]["prompt_tokens"].as_u64().unwrap();
    let billed_completion = record["billed"]["completion_tokens"].as_u64().unwrap();
    // the stream's usage, the log's row and the ledger's record: one number each
    assert_eq!(seen["stream_prompt_tokens"].as_u64(), Some(billed_prompt));
    assert_eq!(
        seen["stream_completion_tokens"].as_u64(),
        Some(billed_completion)
    );
    assert_eq!(seen["log_prompt_tokens"].as_u64(), Some(billed_prompt));
    assert_eq!(
        seen["log_completion_tokens"].as_u64(),
        Some(billed_completion)
    );
    assert_eq!(
        seen["log_cost"],
        credits(record["debit_micros"].as_u64().unwrap())
    );
    // TTFT: recorded for the streamed chat, shown in the log
    let ttft: u64 = seen["log_ttft"].as_str().unwrap().parse().unwrap();
    assert!(ttft > 0, "{seen}");
    assert_eq!(seen["chart_drawn"], true);
    assert_eq!(
        seen["spend_micros"].as_u64(),
        record["debit_micros"].as_u64(),
        "the spend chart sums to the debit"
    );
    assert_eq!(
        (seen["key_rpm"].as_str(), seen["key_tpm"].as_str()),
        (Some("30"), Some("50000"))
    );
    assert_eq!(seen["usage_rows"], 1, "one day × model × key: {seen}");
    let usage = seen["usage_text"].as_str().unwrap();
    assert!(
        usage.contains("smollm2") && usage.contains(&billed_completion.to_string()),
        "{usage}"
    );
    let (balance, _) = gw.balance_once_released(&s.account).await;
    assert_eq!(seen["balance"], credits(balance));

    // the operator
    assert_eq!(seen["node_state"], "routable");
    let earned = gw.earned(&s.operator).await;
    assert_eq!(earned, record["operator_credit_micros"].as_u64().unwrap());
    assert_eq!(seen["earned_total"], credits(earned));
    assert_eq!(seen["earned_window"], credits(earned));
    assert_eq!(seen["node_earned"], credits(earned));
    let join = seen["join_command"].as_str().unwrap();
    assert!(
        join.contains("reference-agent join --gateway wss://localhost:")
            && join.contains("SPINE_AGENT_ENROLLMENT_TOKEN"),
        "{join}"
    );

    // the platform: revenue = Σ caller debits (one account, one request), fees = revenue −
    // operator credits, nothing held once settled
    let revenue = CREDITS - balance;
    assert_eq!(revenue, record["debit_micros"].as_u64().unwrap());
    assert_eq!(seen["platform_revenue"], credits(revenue));
    assert_eq!(seen["platform_operator_credits"], credits(earned));
    assert_eq!(seen["platform_fees"], credits(revenue - earned));
    assert_eq!(seen["platform_requests"], "1");
    assert_eq!(seen["platform_held"], credits(0));
    assert_eq!(seen["platform_node_state"], "routable");
    assert_eq!(seen["platform_node_operator"], s.operator.as_str());
    assert_eq!(
        seen["platform_keys_status"], 403,
        "the platform is not a builder"
    );
    assert_eq!(
        seen["operator_platform_status"], 403,
        "an operator is not the platform"
    );

    for page in [
        "platform",
        "platform-nodes",
        "platform-discrepancies",
        "signin",
        "keys",
        "playground",
        "requests",
        "usage",
        "balance",
        "nodes",
        "earnings",
        "enrollments",
    ] {
        let png = std::fs::read(shots.join(format!("{page}.png"))).unwrap();
        assert!(
            png.starts_with(b"\x89PNG") && png.len() > 5_000,
            "{page}.png"
        );
    }
    drop(llama);
}
