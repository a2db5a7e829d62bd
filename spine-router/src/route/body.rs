use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use spine_core::{BodyClassifier, BodySignal, BoxBody, BoxError, NodeFault, NodeSlot};

use super::RouteConfig;
use crate::idle::IdleTimer;
use crate::{InFlightLease, NodeRegistry, RouteError};

/// What a committed body reports at its end.
pub(super) struct Watch {
    /// Set when a [`NodeSlot`] came with the request: a fault reported on it was scored already.
    pub(super) slot: Option<NodeSlot>,
    pub(super) classifier: Box<dyn BodyClassifier>,
    pub(super) registry: NodeRegistry,
    pub(super) ttft: Option<Duration>,
    pub(super) failed: bool,
}

impl Watch {
    fn fault_reported(&self) -> bool {
        self.slot
            .as_ref()
            .is_some_and(NodeSlot::node_fault_reported)
    }
}

/// A response body that replays the buffered prefix, then the node's body; holds the node's
/// in-flight lease until it ends or is dropped, and records a committed attempt's outcome once.
///
/// # End of stream
///
/// The outcome is recorded exactly once, at the first of: `None`, a trailers frame, a data frame
/// after which the inner body reports `is_end_stream()`, an error (a disconnect), a stall of
/// [`RouteConfig::stream_idle_timeout`] (a disconnect too), or a drop (a success unless a failure
/// was seen: see `Drop`). The lease is released at the same moment.
pub(super) struct RoutedBody {
    pub(super) prefix: VecDeque<Frame<Bytes>>,
    pub(super) inner: BoxBody,
    pub(super) inner_ended: bool,
    pub(super) lease: Option<InFlightLease>,
    /// `None` for a non-2xx answer (its failure is recorded already or left to [`route`], or a
    /// caller's 4xx that is not scored) and after the end.
    ///
    /// [`route`]: super::retry::route
    pub(super) watch: Option<Watch>,
    /// `None` when [`RouteConfig::stream_idle_timeout`] is zero (disabled).
    pub(super) idle: Option<IdleTimer>,
}

impl RoutedBody {
    /// A body that only holds the lease (a non-2xx answer), bounded by
    /// [`RouteConfig::stream_idle_timeout`] as well.
    pub(super) fn passthrough(inner: BoxBody, lease: InFlightLease, config: &RouteConfig) -> Self {
        Self {
            prefix: VecDeque::new(),
            inner,
            inner_ended: false,
            lease: Some(lease),
            watch: None,
            idle: IdleTimer::new(config.stream_idle_timeout),
        }
    }

    /// The body ended cleanly: success, unless the classifier saw a failure.
    pub(super) fn finish(&mut self) {
        self.inner_ended = true;
        // the transport's own stream slot goes first: a request queued for the node, woken by
        // the lease below, must find the tunnel's stream free too
        drop(std::mem::take(&mut self.inner));
        let lease = self.lease.take();
        if let (Some(mut watch), Some(lease)) = (self.watch.take(), lease) {
            if watch.fault_reported() {
                return;
            }
            // with a metering layer above, it is the judge of a committed stream (see poll_frame)
            let failed = watch.failed
                || (watch.slot.is_none() && watch.classifier.finish() == BodySignal::Failed);
            if failed {
                watch.registry.record_failure(lease.node());
            } else {
                watch.registry.record_success(lease.node(), watch.ttft);
            }
        }
    }

    /// The node's body broke after commit: a mid-request disconnect.
    fn broke(&mut self) {
        self.inner_ended = true;
        drop(std::mem::take(&mut self.inner));
        let lease = self.lease.take();
        if let (Some(watch), Some(lease)) = (self.watch.take(), lease) {
            match &watch.slot {
                // reported on the slot, whose hook (set at commit) scores a disconnect: once,
                // whoever reports first — the metering layer's stall bound and this body's idle
                // bound can fire together (seen: one stalled stream scored as two disconnects)
                Some(slot) => slot.report(NodeFault::Stalled),
                None => watch.registry.record_disconnect(lease.node()),
            }
        }
    }
}

impl Drop for RoutedBody {
    /// Dropped before its end: the caller went away, or the layer above stopped reading after
    /// the answer's last event. The node did nothing wrong by that, so a committed attempt
    /// counts as a success unless the classifier saw a failure.
    fn drop(&mut self) {
        // the node's body (and the transport's stream slot) before the lease, as in `finish`
        drop(std::mem::take(&mut self.inner));
        let lease = self.lease.take();
        if let (Some(watch), Some(lease)) = (self.watch.take(), lease) {
            if watch.fault_reported() {
                return;
            }
            if watch.failed {
                watch.registry.record_failure(lease.node());
            } else {
                watch.registry.record_success(lease.node(), watch.ttft);
            }
        }
    }
}

impl Body for RoutedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(frame) = this.prefix.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        if this.inner_ended {
            this.finish();
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        let Poll::Ready(polled) = polled else {
            if let Some(idle) = this.idle.as_mut() {
                if idle.poll_expired(cx) {
                    let timeout = idle.timeout();
                    tracing::info!(
                        node = ?this.lease.as_ref().map(|l| l.node().as_str()),
                        timeout_secs = timeout.as_secs(),
                        "node stream stalled; ending it"
                    );
                    this.broke();
                    // reset the node's stream: the agent cancels the engine request
                    this.inner = BoxBody::default();
                    this.idle = None;
                    return Poll::Ready(Some(Err(RouteError::StreamIdleTimeout(timeout).into())));
                }
            }
            return Poll::Pending;
        };
        if let Some(idle) = this.idle.as_mut() {
            idle.frame();
        }
        match polled {
            Some(Ok(frame)) => {
                match frame.data_ref() {
                    Some(data) => {
                        if let Some(watch) = this.watch.as_mut() {
                            // with a metering layer above (a NodeSlot came with the request), it
                            // judges the committed stream and reports a fault on the slot; the
                            // classifier would only parse every event a second time
                            if watch.slot.is_none()
                                && watch.classifier.feed(data) == BodySignal::Failed
                            {
                                watch.failed = true;
                            }
                        }
                        if this.inner.is_end_stream() {
                            this.finish();
                        }
                    }
                    None => this.finish(),
                }
                Poll::Ready(Some(Ok(frame)))
            }
            None => {
                this.finish();
                Poll::Ready(None)
            }
            Some(Err(e)) => {
                this.broke();
                Poll::Ready(Some(Err(e)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_empty() && (self.inner_ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let buffered: u64 = self
            .prefix
            .iter()
            .filter_map(|f| f.data_ref())
            .map(|d| d.len() as u64)
            .sum();
        if self.inner_ended {
            return SizeHint::with_exact(buffered);
        }
        let inner = self.inner.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower().saturating_add(buffered));
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(buffered));
        }
        hint
    }
}
