//! Booting a `reference-gateway` child process: the configuration every test gateway shares
//! and the ready line it prints, written once for the gateway's and the agent's test suites.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::process::Command;

use crate::{Child, Error};

/// A test gateway's TOML configuration: ephemeral listeners on 127.0.0.1, an admin token and a
/// data directory, then whatever top-level keys and catalog entries a test adds.
///
/// ```
/// # use spine_test_support::GatewayToml;
/// let toml = GatewayToml::new("admin-token", std::path::Path::new("/tmp/d"))
///     .line("operator_share_bps = 8000")
///     .model("smollm2", std::path::Path::new("/m.gguf"), 150_000, 600_000, "")
///     .into_string();
/// assert!(toml.contains("[[models]]\nid = \"smollm2\""));
/// ```
#[derive(Debug, Clone)]
pub struct GatewayToml {
    top: String,
    models: String,
}

impl GatewayToml {
    /// The base: `public_listen`, `tunnel_listen`, `admin_listen` and `console_listen` on
    /// `127.0.0.1:0`,
    /// `admin_token` and `data_dir`.
    pub fn new(admin_token: &str, data_dir: &Path) -> Self {
        Self {
            top: format!(
                "public_listen = \"127.0.0.1:0\"\ntunnel_listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nconsole_listen = \"127.0.0.1:0\"\nadmin_token = \"{admin_token}\"\ndata_dir = \"{}\"\n",
                data_dir.display()
            ),
            models: String::new(),
        }
    }

    /// Adds top-level TOML (one key or several lines; empty is fine).
    #[must_use]
    pub fn line(mut self, toml: &str) -> Self {
        self.top.push_str(toml);
        self.top.push('\n');
        self
    }

    /// Adds a `[[models]]` catalog entry with prices in micros per million tokens and `extra`
    /// keys inside the entry (e.g. `reference_url = "…"`; empty for none).
    #[must_use]
    pub fn model(
        mut self,
        id: &str,
        gguf: &Path,
        input_price_micros_per_mtok: u64,
        output_price_micros_per_mtok: u64,
        extra: &str,
    ) -> Self {
        let _ = write!(
            self.models,
            "\n[[models]]\nid = \"{id}\"\ngguf = \"{}\"\ninput_price_micros_per_mtok = {input_price_micros_per_mtok}\noutput_price_micros_per_mtok = {output_price_micros_per_mtok}\n{extra}\n",
            gguf.display()
        );
        self
    }

    /// The whole file.
    pub fn into_string(self) -> String {
        self.top + &self.models
    }

    /// Writes the file to `path` and spawns the gateway binary `bin` on it with `RUST_LOG` set
    /// to `rust_log`, as child `name` (its ready line not read yet: see [`Ready::read`]).
    ///
    /// # Errors
    ///
    /// Writing the file or spawning the process failed.
    pub fn spawn(
        self,
        path: &Path,
        bin: &Path,
        rust_log: &str,
        name: &str,
    ) -> Result<Child, Error> {
        std::fs::write(path, self.into_string())?;
        let mut cmd = Command::new(bin);
        cmd.arg("--config").arg(path).env("RUST_LOG", rust_log);
        Child::spawn(name, cmd)
    }
}

/// What a gateway's ready line (its first stdout line, JSON) says.
#[derive(Debug, Clone)]
pub struct Ready {
    /// `http://<public_addr>`.
    pub public: String,
    /// `http://<admin_addr>`.
    pub admin: String,
    /// The tunnel listener's `host:port`.
    pub tunnel_addr: String,
    /// `wss://<tunnel_addr>/v1/tunnel`, the URL agents dial.
    pub tunnel: String,
    /// The tunnel's CA certificate file (self-signed unless configured).
    pub tunnel_ca_file: PathBuf,
    /// `instance_id`, when the line has one.
    pub instance_id: Option<String>,
    /// `internal_addr` (several-instance mode), when the line has one.
    pub internal_addr: Option<String>,
    /// `http://<console_addr>`, when the line has one.
    pub console: Option<String>,
}

impl Ready {
    /// Reads the ready line of `child`, waiting at most `timeout`.
    ///
    /// # Errors
    ///
    /// No JSON line in time, or one without the listeners' addresses.
    pub async fn read(child: &mut Child, timeout: Duration) -> Result<Self, Error> {
        let line = child.read_json_line(timeout).await?;
        let field = |k: &str| {
            line[k]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| format!("ready line without {k:?}: {line}"))
        };
        let tunnel_addr = field("tunnel_addr")?;
        Ok(Self {
            public: format!("http://{}", field("public_addr")?),
            admin: format!("http://{}", field("admin_addr")?),
            tunnel: format!("wss://{tunnel_addr}/v1/tunnel"),
            tunnel_addr,
            tunnel_ca_file: PathBuf::from(field("tunnel_ca_file")?),
            instance_id: field("instance_id").ok(),
            internal_addr: field("internal_addr").ok(),
            console: field("console_addr").ok().map(|a| format!("http://{a}")),
        })
    }
}
