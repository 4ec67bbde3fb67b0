//! The response body type: either a small body the proxy wrote itself or an
//! engine's body streamed through piece by piece (never buffered). An
//! engine's body owns its upstream connection and reads from it on every
//! poll; when the body ends the connection goes back to its pool.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use crate::forward::{InFlightGuard, UpstreamConn, UpstreamError};

/// Body of every response the proxy sends.
#[derive(Debug)]
pub enum ProxyBody {
    /// A body written by the proxy (errors, `/v1/models`, `/metrics`).
    Full(Option<Bytes>),
    /// An engine's body, arriving on `conn`; the guard records completion
    /// when the body ends or is dropped (client gone), which also drops
    /// (closes) the unfinished connection.
    Upstream {
        conn: Box<UpstreamConn>,
        guard: InFlightGuard,
        /// A server-sent event stream: if the engine fails midway, the
        /// client gets an error event and a clean end, not a cut connection.
        sse: bool,
    },
}

/// The event sent when an engine's event stream breaks off (its headers
/// and some events were already sent, so no status code can say it).
fn sse_error_event(error: &UpstreamError) -> Bytes {
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
    pub fn upstream(conn: Box<UpstreamConn>, guard: InFlightGuard, sse: bool) -> Self {
        let mut body = ProxyBody::Upstream { conn, guard, sse };
        if body.is_end_stream() {
            // hyper will not poll a body that is already over.
            body.end(true);
        }
        body
    }

    /// The engine's body is over (`complete`: to its end): the connection
    /// goes back to its pool (or is closed), then the exchange is recorded
    /// (its slot freed).
    fn end(&mut self, complete: bool) {
        if let ProxyBody::Upstream { conn, guard, .. } =
            std::mem::replace(self, ProxyBody::Full(None))
        {
            if complete {
                conn.release();
            }
            guard.finish(complete);
        }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        let this = self.get_mut();
        let (conn, sse) = match this {
            ProxyBody::Full(b) => return Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            ProxyBody::Upstream { conn, sse, .. } => (conn, *sse),
        };
        // Reads from the engine in this task.
        match conn.poll_data(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(data))) => {
                // hyper stops polling once a sized body is complete.
                if conn.body_done() {
                    this.end(true);
                }
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Poll::Ready(None) => {
                this.end(true);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                // Never reused: the connection is dropped (closed).
                this.end(false);
                if sse {
                    tracing::warn!(error = %e, "engine stream broke off: ending it with an error event");
                    Poll::Ready(Some(Ok(Frame::data(sse_error_event(&e)))))
                } else {
                    Poll::Ready(Some(Err(e)))
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(b) => b.is_none(),
            ProxyBody::Upstream { conn, .. } => conn.body_done(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            ProxyBody::Full(None) => SizeHint::with_exact(0),
            ProxyBody::Upstream { conn, .. } => match conn.body_remaining() {
                Some(n) => SizeHint::with_exact(n),
                None => SizeHint::default(),
            },
        }
    }
}
