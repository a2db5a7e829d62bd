//! The request body a [`LimitedServer`](super::LimitedServer) hands its service: bounded in
//! time ([`TimedBody`], [`BodyReadTimeout`]).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use spine_core::BoxError;
use tokio::time::{Instant, Sleep};

use super::Conn;

/// Reading a request body took longer than
/// [`ListenerLimits::body_read_timeout`](super::ListenerLimits::body_read_timeout).
#[derive(Debug, thiserror::Error)]
#[error("request body not received within {timeout:?}")]
pub struct BodyReadTimeout {
    /// The bound that passed.
    pub timeout: Duration,
}

pin_project_lite::pin_project! {
    /// A request body that must arrive whole before a deadline ([`BodyReadTimeout`] past it).
    /// The body type [`LimitedServer`] hands its service.
    pub struct TimedBody {
        #[pin]
        inner: Incoming,
        deadline: Instant,
        timeout: Duration,
        sleep: Option<Pin<Box<Sleep>>>,
        // counts the request as still receiving its body on its connection, until the body
        // ends, fails or is dropped
        receiving: Option<Receiving>,
    }
}

impl fmt::Debug for TimedBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TimedBody")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl TimedBody {
    /// The body, and for a request that has one, a flag set once it has been read whole (a
    /// response given while it is unset is given before the body was read).
    pub(super) fn new(
        inner: Incoming,
        timeout: Duration,
        conn: &Arc<Conn>,
    ) -> (Self, Option<Arc<AtomicBool>>) {
        let now = Instant::now();
        let receiving = (!inner.is_end_stream()).then(|| Receiving::start(conn.clone()));
        let whole = receiving.as_ref().map(|r| r.whole.clone());
        let body = Self {
            inner,
            deadline: now
                .checked_add(timeout)
                .unwrap_or(now + Duration::from_secs(86_400 * 365)),
            timeout,
            sleep: None,
            receiving,
        };
        (body, whole)
    }
}

/// A request on a connection whose body has not all arrived: such a connection is as
/// evictable as an idle one (see [`Registry::evict_oldest_idle`]).
struct Receiving {
    conn: Arc<Conn>,
    /// Set when the body ended whole (not when it failed or was dropped unread).
    whole: Arc<AtomicBool>,
}

impl Receiving {
    fn start(conn: Arc<Conn>) -> Self {
        conn.receiving.fetch_add(1, Ordering::AcqRel);
        Self {
            conn,
            whole: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl Drop for Receiving {
    fn drop(&mut self) {
        self.conn.receiving.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Body for TimedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        match this.inner.as_mut().poll_frame(cx) {
            Poll::Ready(frame) => {
                let ended = match &frame {
                    None => true,
                    Some(Ok(_)) => this.inner.is_end_stream(),
                    Some(Err(_)) => false,
                };
                if ended {
                    if let Some(r) = this.receiving.as_ref() {
                        r.whole.store(true, Ordering::Release);
                    }
                }
                if !matches!(frame, Some(Ok(_))) || this.inner.is_end_stream() {
                    this.receiving.take();
                }
                return Poll::Ready(frame.map(|f| f.map_err(BoxError::from)));
            }
            Poll::Pending => {}
        }
        // the timer exists only while a body is actually waited on
        let deadline = *this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                this.receiving.take();
                Poll::Ready(Some(Err(BodyReadTimeout {
                    timeout: *this.timeout,
                }
                .into())))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
