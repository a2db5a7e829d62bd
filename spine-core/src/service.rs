//! The service a spine layer wraps: the bounds it must meet ([`UpstreamService`]) and the
//! accessors every spine middleware has over it
//! ([`inner_service_accessors!`](crate::inner_service_accessors)).

use crate::{BoxBody, BoxError};

/// The bounds the router's and the meter's layers ask of the service behind them (upstream of
/// the layer, towards the node): requests and responses with bodies `B` ([`BoxBody`] unless
/// said), [`BoxError`] errors, a `Send + 'static` future; cloned per request (tower's pattern),
/// so `Clone + Send + 'static`. Implemented for every such service, so a bound or
/// `impl UpstreamService` stands for the whole list. Not the node's own local service, which the
/// tunnel serves: that is `spine_transport::NodeService`.
pub trait UpstreamService<B = BoxBody>:
    tower_service::Service<
        http::Request<B>,
        Response = http::Response<B>,
        Error = BoxError,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S, B> UpstreamService<B> for S where
    S: tower_service::Service<
            http::Request<B>,
            Response = http::Response<B>,
            Error = BoxError,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// Writes the three accessors of a tower middleware over the service it wraps, each documented:
/// `get_ref(&self) -> &S`, `get_mut(&mut self) -> &mut S` and `into_inner(self) -> S`, over the
/// field named. Invoked inside the middleware's `impl<S> Middleware<S>` block, as
/// `inner_service_accessors!(field: S);`.
///
/// ```
/// struct Wrap<S> {
///     inner: S,
/// }
///
/// impl<S> Wrap<S> {
///     spine_core::inner_service_accessors!(inner: S);
/// }
///
/// let mut w = Wrap { inner: 1 };
/// *w.get_mut() += 1;
/// assert_eq!(*w.get_ref(), 2);
/// assert_eq!(w.into_inner(), 2);
/// ```
#[macro_export]
macro_rules! inner_service_accessors {
    ($field:ident: $inner:ty) => {
        /// The inner service.
        pub fn get_ref(&self) -> &$inner {
            &self.$field
        }

        /// The inner service, mutably.
        pub fn get_mut(&mut self) -> &mut $inner {
            &mut self.$field
        }

        /// Unwraps the inner service.
        pub fn into_inner(self) -> $inner {
            self.$field
        }
    };
}

/// Whether a client request failed because its connection closed before any answer: hyper's
/// "connection closed before message completed" (`is_incomplete_message`) or the request
/// canceled with its connection (`is_canceled`), anywhere in `err`'s source chain. This is the
/// race between reusing an idle keep-alive connection and the server closing it (llama.cpp's
/// HTTP server closes one idle for 5 s, and measured in `docs/trust.md`, sometimes one a stream
/// just ended on); nothing was answered, so the request may be sent again.
pub fn closed_before_answer(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(h) = e.downcast_ref::<hyper::Error>() {
            return h.is_incomplete_message() || h.is_canceled();
        }
        next = e.source();
    }
    false
}
