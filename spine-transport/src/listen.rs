//! A server process's listening basics: sockets bound with a long accept queue, the open-file
//! limit raised to what the connection caps need, and the shutdown signal.

use tokio::net::TcpListener;

/// Accept-queue length asked for on every listener (the kernel caps it at its own maximum,
/// `net.core.somaxconn`). Tokio's default (1024) overflows under a connection flood while the
/// accept loop catches up, and each dropped SYN costs its client a 1 s retransmit.
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds a listener with [`LISTEN_BACKLOG`] (and `SO_REUSEADDR` on Unix, as tokio's `bind`).
///
/// # Errors
///
/// The socket's error: creating, setting the option, binding or listening.
pub fn bind_listener(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Raises the soft limit on open files to the hard limit: every connection a listener holds is
/// a descriptor (up to the sum of the listeners' connection caps, plus the tunnels, the
/// database and engine sockets), and the usual soft default (1024) is far below the connection
/// caps. Logs the limit in force; a failure is logged and the process goes on. Does nothing off
/// Unix.
#[cfg(unix)]
pub fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let limit = getrlimit(Resource::Nofile);
    if limit.current == limit.maximum {
        tracing::info!(open_files = ?limit.current, "open file limit");
        return;
    }
    let raised = rustix::process::Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => tracing::info!(
            from = ?limit.current,
            to = ?limit.maximum,
            "open file limit raised to the hard limit"
        ),
        Err(e) => tracing::warn!(
            error = %e,
            open_files = ?limit.current,
            "could not raise the open file limit"
        ),
    }
}

/// Raises the soft limit on open files (Unix only; nothing here).
#[cfg(not(unix))]
pub fn raise_fd_limit() {}

/// Completes at the first SIGTERM or ctrl-c (SIGINT); only ctrl-c off Unix, or when the SIGTERM
/// handler cannot be installed.
///
/// # Cancel safety
///
/// Cancel safe; a signal that arrives while no future waits is not remembered.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
