//! The response body type: either a small body the proxy wrote itself or an
//! engine's body streamed through frame by frame (never buffered). An
//! engine's body owns its upstream connection and drives it on every poll;
//! when the body ends the connection goes back to its pool.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

use crate::forward::{InFlightGuard, UpstreamConn};

/// Body of every response the proxy sends.
#[derive(Debug)]
pub enum ProxyBody {
    /// A body written by the proxy (errors, `/v1/models`, `/metrics`).
    Full(Option<Bytes>),
    /// An engine's body; the guard records completion when the body ends or
    /// is dropped (client gone), which also drops the upstream connection.
    Upstream {
        inner: Incoming,
        /// The connection `inner` arrives on: polled here, released to its
        /// pool at the end, dropped (closed) with an unfinished body.
        conn: Option<Box<UpstreamConn>>,
        guard: Option<InFlightGuard>,
        /// A server-sent event stream: if the engine fails midway, the
        /// client gets an error event and a clean end, not a cut connection.
        sse: bool,
    },
}

/// The event sent when an engine's event stream breaks off (its headers
/// and some events were already sent, so no status code can say it).
fn sse_error_event(error: &hyper::Error) -> Bytes {
    let body = serde_json::json!({
        "error": {
            "message": format!("the engine stopped in the middle of the response: {error}"),
            "type": "server_error",
            "code": "engine_failed",
        }
    });
    Bytes::from(format!("data: {body}\n\n"))
}

impl ProxyBody {
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        ProxyBody::Full(Some(bytes.into()))
    }

    /// An engine's body arriving on `conn`. An empty body ends here.
    pub fn upstream(
        inner: Incoming,
        conn: Box<UpstreamConn>,
        guard: InFlightGuard,
        sse: bool,
    ) -> Self {
        if inner.is_end_stream() {
            // hyper will not poll a body that is already over.
            conn.release();
            guard.finish(true);
            return ProxyBody::Full(None);
        }
        ProxyBody::Upstream {
            inner,
            conn: Some(conn),
            guard: Some(guard),
            sse,
        }
    }
}

/// The body ended normally: the connection goes back to its pool, then the
/// exchange is recorded (its slot freed).
fn ended(conn: &mut Option<Box<UpstreamConn>>, guard: &mut Option<InFlightGuard>) {
    if let Some(c) = conn.take() {
        c.release();
    }
    if let Some(g) = guard.take() {
        g.finish(true);
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        match this {
            ProxyBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            ProxyBody::Upstream {
                inner,
                conn,
                guard,
                sse,
            } => {
                // Reads from the engine in this task.
                let res = match conn.as_mut() {
                    Some(c) => c.poll_body(inner, cx),
                    None => Pin::new(&mut *inner).poll_frame(cx),
                };
                match &res {
                    // hyper stops polling once a sized body is complete.
                    Poll::Ready(Some(Ok(_))) if inner.is_end_stream() => ended(conn, guard),
                    Poll::Ready(None) => ended(conn, guard),
                    Poll::Ready(Some(Err(e))) => {
                        // Never reused: drop (close) the connection.
                        *conn = None;
                        if let Some(g) = guard.take() {
                            g.finish(false);
                        }
                        if *sse {
                            tracing::warn!(error = %e, "engine stream broke off: ending it with an error event");
                            let event = sse_error_event(e);
                            // Dropping the upstream body closes its connection.
                            *this = ProxyBody::Full(None);
                            return Poll::Ready(Some(Ok(Frame::data(event))));
                        }
                    }
                    _ => {}
                }
                res
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(b) => b.is_none(),
            ProxyBody::Upstream { inner, .. } => inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            ProxyBody::Full(None) => SizeHint::with_exact(0),
            ProxyBody::Upstream { inner, .. } => inner.size_hint(),
        }
    }
}
