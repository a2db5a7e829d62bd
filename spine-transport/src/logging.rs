//! Log set-up for the reference binaries (feature `logging`): no prompt or completion text reaches
//! the log at any level (design brief §9).

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

use crate::{is_payload_logging_target, PAYLOAD_LOGGING_TARGETS};

/// `RUST_LOG` (default `info`), with the [`PAYLOAD_LOGGING_TARGETS`] capped at `info`.
pub fn env_filter() -> EnvFilter {
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    for target in PAYLOAD_LOGGING_TARGETS {
        if let Ok(d) = format!("{target}=info").parse() {
            filter = filter.add_directive(d);
        }
    }
    filter
}

/// Logs to stderr through [`env_filter`], and drops `debug`/`trace` events of the
/// payload-logging libraries whatever `RUST_LOG` says, even a directive naming one of their
/// modules (which would otherwise beat the cap). Colours only when stderr is a terminal (not in
/// a log file or a pipe). Call once, at start-up.
pub fn init() {
    use std::io::IsTerminal as _;
    let cap = tracing_subscriber::filter::filter_fn(|meta| {
        *meta.level() <= tracing::Level::INFO || !is_payload_logging_target(meta.target())
    });
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(env_filter())
        .finish()
        .with(cap)
        .init();
}
