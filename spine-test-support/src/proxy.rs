//! [`CutProxy`]: a TCP proxy in front of a real server (PostgreSQL, Redis) that a test can cut,
//! stall and restore, to see what spine does while that server is unreachable — without ever
//! stopping the real server, which other tests share.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

type Relays = Arc<Mutex<Vec<JoinHandle<()>>>>;

/// A TCP proxy on `127.0.0.1:<port>` relaying every connection to `upstream`.
///
/// - [`cut`](Self::cut): the listener is closed and every relayed connection dropped — new
///   connections are refused, open ones see EOF (a server that went away);
/// - [`restore`](Self::restore): listening again on the same port;
/// - [`stall`](Self::stall): connections stay open but nothing is relayed (a server that hangs).
#[derive(Debug)]
pub struct CutProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    accept: Mutex<Option<JoinHandle<()>>>,
    relays: Relays,
    stalled: watch::Sender<bool>,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Copies `from` to `to`, holding each chunk while `stalled` is true.
async fn relay_half(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut stalled: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if stalled.wait_for(|s| !*s).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl CutProxy {
    /// Starts relaying to `upstream` on a free loopback port.
    ///
    /// # Errors
    ///
    /// The port could not be bound.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let relays = Relays::default();
        let (stalled, _) = watch::channel(false);
        let accept = Self::serve(listener, upstream, relays.clone(), stalled.subscribe());
        Ok(Self {
            addr,
            upstream,
            accept: Mutex::new(Some(accept)),
            relays,
            stalled,
        })
    }

    /// The proxy's address: point the client here instead of at the server.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn serve(
        listener: TcpListener,
        upstream: SocketAddr,
        relays: Relays,
        stalled: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let stalled = stalled.clone();
                let relay = tokio::spawn(async move {
                    if let Ok(outbound) = TcpStream::connect(upstream).await {
                        let (ir, iw) = inbound.into_split();
                        let (or, ow) = outbound.into_split();
                        tokio::join!(
                            relay_half(ir, ow, stalled.clone()),
                            relay_half(or, iw, stalled)
                        );
                    }
                });
                locked(&relays).push(relay);
            }
        })
    }

    /// Holds (`true`) or releases (`false`) every byte in both directions.
    pub fn stall(&self, on: bool) {
        self.stalled.send_replace(on);
    }

    /// Closes the listener and drops every relayed connection; returns once they are gone.
    pub async fn cut(&self) {
        let accept = locked(&self.accept).take();
        if let Some(a) = accept {
            a.abort();
            let _ = a.await;
        }
        let relays: Vec<_> = std::mem::take(&mut *locked(&self.relays));
        for r in relays {
            r.abort();
            let _ = r.await;
        }
    }

    /// Listens again on the same port (after [`cut`](Self::cut)).
    ///
    /// # Errors
    ///
    /// The port could not be bound again.
    pub fn restore(&self) -> std::io::Result<()> {
        let socket = TcpSocket::new_v4()?;
        socket.set_reuseaddr(true)?;
        socket.bind(self.addr)?;
        let listener = socket.listen(128)?;
        *locked(&self.accept) = Some(Self::serve(
            listener,
            self.upstream,
            self.relays.clone(),
            self.stalled.subscribe(),
        ));
        Ok(())
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        if let Some(a) = locked(&self.accept).take() {
            a.abort();
        }
        for r in locked(&self.relays).drain(..) {
            r.abort();
        }
    }
}
