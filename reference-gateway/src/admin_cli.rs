//! `reference-gateway admin …`: every admin API call from the command line (issue 16), so nobody
//! needs `curl` and hand-written JSON. Talks to a running gateway's admin listener over plain
//! HTTP (it listens on 127.0.0.1 by default) with the admin token from `SPINE_ADMIN_TOKEN`.
//!
//! Prints the API's JSON answer (pretty), or one member of it with `--field` (for scripts:
//! `ACCOUNT=$(reference-gateway admin accounts create --field id)`). A non-2xx answer prints the
//! API's error message on stderr and exits 1.

use clap::{Args, Subcommand};
use http_body_util::BodyExt as _;
use serde_json::{json, Value};

/// `reference-gateway admin`.
#[derive(Debug, Args)]
pub(crate) struct AdminArgs {
    /// The gateway's admin API.
    #[arg(long, env = "SPINE_ADMIN_URL", default_value = "http://127.0.0.1:8401")]
    url: String,
    /// The admin token (the gateway's `admin_token`); prefer the environment variable: a
    /// command line is visible to every local user.
    #[arg(long, env = "SPINE_ADMIN_TOKEN", hide_env_values = true)]
    token: String,
    /// Print only this member of the answer, unquoted (e.g. `id`, `key`).
    #[arg(long, global = true)]
    field: Option<String>,
    #[command(subcommand)]
    resource: Resource,
}

#[derive(Debug, Subcommand)]
enum Resource {
    /// Caller accounts (builders).
    #[command(subcommand)]
    Accounts(AccountCmd),
    /// API keys of an account.
    #[command(subcommand)]
    Keys(KeyCmd),
    /// Prepaid credits.
    #[command(subcommand)]
    Credits(CreditCmd),
    /// GPU operators.
    #[command(subcommand)]
    Operators(OperatorCmd),
    /// One-time enrollment tokens for `reference-agent join`.
    #[command(subcommand)]
    Enrollments(EnrollmentCmd),
    /// Nodes: routable ones with their scores and audits; registration; re-verification.
    #[command(subcommand)]
    Nodes(NodeCmd),
    /// Settled request records.
    #[command(subcommand)]
    Requests(RequestCmd),
    /// The admission queues.
    Queues,
    /// Console users (the web console: `docs/console.md`).
    #[command(subcommand)]
    ConsoleUsers(ConsoleUserCmd),
}

#[derive(Debug, Subcommand)]
enum ConsoleUserCmd {
    /// Creates a console user of one account (a builder), one operator (a GPU owner) or the
    /// platform (`--platform`: the platform pages), with the password in the environment variable `SPINE_CONSOLE_PASSWORD` (12+ bytes; never on
    /// the command line, which every local user can read) and/or a one-time sign-in link.
    Create {
        #[arg(long)]
        email: String,
        /// The builder's account.
        #[arg(long, conflicts_with_all = ["operator", "platform"], required_unless_present_any = ["operator", "platform"])]
        account: Option<String>,
        /// The GPU owner's operator.
        #[arg(long, conflicts_with = "platform")]
        operator: Option<String>,
        /// A user of the platform itself (every node, traffic, revenue and fees).
        #[arg(long)]
        platform: bool,
        /// Also issue a one-time sign-in link (24 h), printed as `sign_in_path`.
        #[arg(long)]
        link: bool,
    },
    /// Issues another one-time sign-in link for USER.
    Link { user: String },
    /// Revokes every session of USER.
    RevokeSessions { user: String },
}

#[derive(Debug, Subcommand)]
enum AccountCmd {
    /// Creates an account (`acct_…`, or `--id`).
    Create {
        #[arg(long)]
        id: Option<String>,
    },
    /// Balance and held credit.
    Show { id: String },
}

#[derive(Debug, Subcommand)]
enum KeyCmd {
    /// Creates an API key for ACCOUNT; the key is shown once.
    Create {
        account: String,
        /// Requests per minute (0: unlimited; absent: the gateway's default).
        #[arg(long)]
        rpm: Option<u32>,
        /// Tokens per minute (0: unlimited; absent: the gateway's default).
        #[arg(long)]
        tpm: Option<u64>,
    },
}

#[derive(Debug, Subcommand)]
enum CreditCmd {
    /// Adds AMOUNT_MICROS to ACCOUNT, once per idempotency key.
    Add {
        account: String,
        amount_micros: u64,
        /// Retrying with the same key adds nothing more.
        #[arg(long)]
        idempotency_key: String,
    },
}

#[derive(Debug, Subcommand)]
enum OperatorCmd {
    /// Creates an operator (`op_…`, or `--id`).
    Create {
        #[arg(long)]
        id: Option<String>,
    },
    /// Earnings and nodes.
    Show { id: String },
}

#[derive(Debug, Subcommand)]
enum EnrollmentCmd {
    /// Issues a one-time enrollment token for OPERATOR (24 h).
    Create { operator: String },
}

#[derive(Debug, Subcommand)]
enum NodeCmd {
    /// Routable nodes with score, in-flight, sticky stats and audit verdicts.
    List,
    /// Registers PUBLIC_KEY (from `reference-agent keygen`) as a node of OPERATOR.
    Register {
        operator: String,
        public_key: String,
    },
    /// Restarts NODE's model audit (its operator re-verified the weights): routed again.
    Reverify {
        node: String,
        /// One model; absent: every audited model of the node.
        #[arg(long)]
        model: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
enum RequestCmd {
    /// The settled record of a request id (`x-request-id`).
    Show { id: String },
}

type CliError = Box<dyn std::error::Error + Send + Sync>;

impl AdminArgs {
    /// The method, admin path and body of the call.
    fn call(&self) -> (http::Method, String, Option<Value>) {
        use http::Method as M;
        let opt_id = |id: &Option<String>| match id {
            Some(id) => json!({ "id": id }),
            None => json!({}),
        };
        match &self.resource {
            Resource::Accounts(AccountCmd::Create { id }) => {
                (M::POST, "accounts".into(), Some(opt_id(id)))
            }
            Resource::Accounts(AccountCmd::Show { id }) => (M::GET, format!("accounts/{id}"), None),
            Resource::Keys(KeyCmd::Create { account, rpm, tpm }) => {
                let mut body = json!({});
                if let Some(r) = rpm {
                    body["rpm_limit"] = json!(r);
                }
                if let Some(t) = tpm {
                    body["tpm_limit"] = json!(t);
                }
                (M::POST, format!("accounts/{account}/keys"), Some(body))
            }
            Resource::Credits(CreditCmd::Add {
                account,
                amount_micros,
                idempotency_key,
            }) => (
                M::POST,
                format!("accounts/{account}/credits"),
                Some(json!({ "amount_micros": amount_micros, "idempotency_key": idempotency_key })),
            ),
            Resource::Operators(OperatorCmd::Create { id }) => {
                (M::POST, "operators".into(), Some(opt_id(id)))
            }
            Resource::Operators(OperatorCmd::Show { id }) => {
                (M::GET, format!("operators/{id}"), None)
            }
            Resource::Enrollments(EnrollmentCmd::Create { operator }) => (
                M::POST,
                format!("operators/{operator}/enrollments"),
                Some(json!({})),
            ),
            Resource::Nodes(NodeCmd::List) => (M::GET, "nodes".into(), None),
            Resource::Nodes(NodeCmd::Register {
                operator,
                public_key,
            }) => (
                M::POST,
                "nodes".into(),
                Some(json!({ "operator_id": operator, "public_key": public_key })),
            ),
            Resource::Nodes(NodeCmd::Reverify { node, model }) => (
                M::POST,
                format!("nodes/{node}/reverify"),
                Some(match model {
                    Some(m) => json!({ "model": m }),
                    None => json!({}),
                }),
            ),
            Resource::Requests(RequestCmd::Show { id }) => (M::GET, format!("requests/{id}"), None),
            Resource::Queues => (M::GET, "queues".into(), None),
            Resource::ConsoleUsers(ConsoleUserCmd::Create {
                email,
                account,
                operator,
                platform,
                link,
            }) => {
                let mut body = json!({ "email": email, "sign_in_link": link });
                match (account, operator) {
                    (Some(a), _) => body["account_id"] = json!(a),
                    (None, Some(o)) => body["operator_id"] = json!(o),
                    (None, None) => body["platform"] = json!(platform),
                }
                if let Ok(p) = std::env::var("SPINE_CONSOLE_PASSWORD") {
                    body["password"] = json!(p);
                }
                (M::POST, "console/users".into(), Some(body))
            }
            Resource::ConsoleUsers(ConsoleUserCmd::Link { user }) => (
                M::POST,
                format!("console/users/{user}/sign-in-link"),
                Some(json!({})),
            ),
            Resource::ConsoleUsers(ConsoleUserCmd::RevokeSessions { user }) => (
                M::POST,
                format!("console/users/{user}/revoke-sessions"),
                Some(json!({})),
            ),
        }
    }
}

/// Runs one admin command; the answer on stdout.
///
/// # Errors
///
/// The gateway unreachable (with its address), a non-2xx answer (with the API's message), an
/// answer that is not JSON, or `--field` naming no member.
#[allow(clippy::print_stdout)] // the answer on stdout is the command's output
pub(crate) async fn run(args: AdminArgs) -> Result<(), CliError> {
    let (method, path, body) = args.call();
    let url = format!("{}/admin/v1/{path}", args.url.trim_end_matches('/'));
    if !url.starts_with("http://") {
        return Err(format!(
            "--url {}: the admin API is plain http:// (it listens on 127.0.0.1; use an SSH tunnel to reach another host)",
            args.url
        )
        .into());
    }
    let req = http::Request::builder()
        .method(method)
        .uri(&url)
        .header(
            http::header::AUTHORIZATION,
            format!("Bearer {}", args.token),
        )
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))?;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let resp = client.request(req).await.map_err(|e| {
        format!(
            "cannot reach the admin API at {}: {e} (is the gateway running? is --url / SPINE_ADMIN_URL its admin_listen?)",
            args.url
        )
    })?;
    let status = resp.status();
    let bytes = http_body_util::Limited::new(resp.into_body(), 64 << 20)
        .collect()
        .await
        .map_err(|e| format!("reading the answer: {e}"))?
        .to_bytes();
    let answer: Value = serde_json::from_slice(&bytes).map_err(|_| {
        format!(
            "HTTP {status}: not JSON: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
        )
    })?;
    if !status.is_success() {
        let message = answer["error"]["message"]
            .as_str()
            .map_or_else(|| answer.to_string(), str::to_owned);
        return Err(format!("HTTP {status}: {message}").into());
    }
    match &args.field {
        None => println!("{}", serde_json::to_string_pretty(&answer)?),
        Some(f) => match answer.get(f) {
            Some(Value::String(s)) => println!("{s}"),
            Some(v) => println!("{v}"),
            None => return Err(format!("the answer has no member '{f}': {answer}").into()),
        },
    }
    Ok(())
}
