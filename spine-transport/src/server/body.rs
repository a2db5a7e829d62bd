use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::Incoming;
use spine_core::BoxError;

use super::state::SessionShared;
use crate::{metric, TunnelError};

/// One stream counted against its node's limit and the open-streams gauge until dropped.
pub(super) struct StreamGuard {
    session: Arc<SessionShared>,
}

impl StreamGuard {
    pub(super) fn acquire(session: Arc<SessionShared>) -> Option<Self> {
        let max = session.max_streams;
        let before = session
            .streams_open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        if before == 0 {
            // idle → busy: the stall clock starts now
            session
                .last_progress_ms
                .store(session.now_ms(), Ordering::Relaxed);
        }
        metrics::gauge!(metric::STREAMS_OPEN).increment(1.0);
        Some(Self { session })
    }

    /// Completes when the node is found stalled after this stream was opened.
    pub(super) fn stall_signal(&self) -> StallSignal {
        let mut rx = self.session.stall.subscribe();
        Box::pin(async move {
            if rx.changed().await.is_err() {
                // the session is gone; its connection's end fails the stream
                std::future::pending::<()>().await;
            }
        })
    }
}

/// See [`StreamGuard::stall_signal`].
pub(super) type StallSignal = Pin<Box<dyn Future<Output = ()> + Send>>;

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.session.streams_open.fetch_sub(1, Ordering::AcqRel);
        metrics::gauge!(metric::STREAMS_OPEN).decrement(1.0);
    }
}

pin_project_lite::pin_project! {
    /// A response body from a tunnel: holds its stream's slot until it ends or is dropped,
    /// counts its frames as the node's progress and a body that breaks off, and fails with
    /// [`TunnelError::is_stalled`] when the node is found stalled before its first frame.
    pub(super) struct StreamBody {
        #[pin]
        pub(super) inner: Incoming,
        // until the first frame
        pub(super) stall: Option<StallSignal>,
        pub(super) stream: StreamGuard,
    }
}

impl http_body::Body for StreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        match polled {
            Poll::Ready(Some(Err(e))) => {
                metrics::counter!(metric::REQUESTS_FAILED, "reason" => "body").increment(1);
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(Some(Ok(frame))) => {
                *this.stall = None;
                this.stream.session.progressed();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                let stalled = this
                    .stall
                    .as_mut()
                    .is_some_and(|stall| stall.as_mut().poll(cx).is_ready());
                if !stalled {
                    return Poll::Pending;
                }
                *this.stall = None;
                metrics::counter!(metric::REQUESTS_FAILED, "reason" => "stalled").increment(1);
                Poll::Ready(Some(Err(Box::new(TunnelError::stalled()))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
