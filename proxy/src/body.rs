//! The response body type: either a small body the proxy wrote itself or an
//! engine's body streamed through piece by piece (never buffered). An
//! engine's body owns its upstream connection and reads from it on every
//! poll; when the body ends the connection goes back to its pool.
//!
//! Over HTTP/2 an engine's body is also watched for stalls ([`StreamWatch`]):
//! a client that stops reading one stream blocks no socket write (the
//! connection's other streams and frames go on), so the per-connection
//! write timeout never fires; only that stream's flow-control window runs
//! out and hyper stops polling its body. A body that returned data and has
//! not been polled again for the send timeout ends its engine request.

use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

use crate::forward::{InFlightGuard, RawHead, UpstreamConn, UpstreamError};

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
    /// An engine's body relayed over HTTP/2, its stalls timed.
    Watched(StreamWatch),
}

/// An engine's body ([`ProxyBody::Upstream`]) with a watchdog task: when
/// the body returned data and then was not polled again for `timeout` (the
/// client's flow-control window for the stream stayed shut: it reads no
/// more), the watchdog drops the body (its engine connection is closed, so
/// the engine aborts the request, and the in-flight guard records the end)
/// and the next poll, if any comes, ends the stream with an error.
///
/// Cost, per HTTP/2 stream answered by an engine: one allocation for the
/// shared state, one spawned task holding one timer entry that wakes once
/// per `timeout` at most (it is re-armed lazily, from the time the body was
/// last left waiting, never by the body itself); per frame: an uncontended
/// mutex and, for a data frame, a clock read. HTTP/1 never has one (its
/// socket writes are timed by the connection's writer).
#[derive(Debug)]
pub struct StreamWatch {
    state: Arc<Mutex<Watched>>,
    watchdog: tokio::task::AbortHandle,
}

#[derive(Debug)]
struct Watched {
    /// The engine's body; `Full(None)` once it ended or was cut.
    body: ProxyBody,
    /// The body's last poll returned data at this time (waiting to be
    /// polled again: the client's turn); `None` while the body is polled
    /// or waits for the engine.
    parked_since: Option<Instant>,
    /// The watchdog ended the body: the client stalled for this long.
    cut: Option<Duration>,
}

impl Drop for StreamWatch {
    fn drop(&mut self) {
        self.watchdog.abort();
    }
}

impl StreamWatch {
    fn poll_frame(
        &self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        let mut w = self.state.lock().unwrap();
        if let Some(stalled) = w.cut.take() {
            return Poll::Ready(Some(Err(UpstreamError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the client read nothing of this stream for {} ms (--send-timeout): \
                     its request was ended at the engine",
                    stalled.as_millis()
                ),
            )))));
        }
        let r = Pin::new(&mut w.body).poll_frame(cx);
        w.parked_since = match &r {
            Poll::Ready(Some(Ok(_))) if !w.body.is_end_stream() => Some(Instant::now()),
            _ => None,
        };
        r
    }
}

/// Ends `state`'s body once it has waited to be polled for `timeout`.
async fn watchdog(state: Weak<Mutex<Watched>>, timeout: Duration) {
    let sleep = tokio::time::sleep(timeout);
    tokio::pin!(sleep);
    loop {
        sleep.as_mut().await;
        let Some(state) = state.upgrade() else {
            return;
        };
        let mut w = state.lock().unwrap();
        if w.body.is_end_stream() {
            return;
        }
        let now = Instant::now();
        let next = match w.parked_since {
            Some(since) if now >= since + timeout => {
                let body = std::mem::replace(&mut w.body, ProxyBody::Full(None));
                w.cut = Some(now - since);
                drop(w);
                tracing::warn!(
                    send_timeout_ms = timeout.as_millis() as u64,
                    "an HTTP/2 client stopped reading a streamed answer: ending its request at the engine"
                );
                // Closes the engine connection; the guard records the end.
                drop(body);
                return;
            }
            Some(since) => since + timeout,
            None => now + timeout,
        };
        drop(w);
        sleep.as_mut().reset(next);
    }
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

    /// An engine's end-to-end headers kept raw for the proxy's own HTTP/1.1
    /// server (then the response's `HeaderMap` has only what the proxy
    /// added).
    pub fn raw_head(&self) -> Option<&RawHead> {
        match self {
            ProxyBody::Upstream { conn, .. } => conn.raw_head(),
            _ => None,
        }
    }

    /// Over HTTP/2: an engine's body gets a stall watchdog ([`StreamWatch`]);
    /// any other body is returned as it is.
    pub fn watch_stalls(self, timeout: Duration) -> Self {
        if !matches!(self, ProxyBody::Upstream { .. }) || self.is_end_stream() {
            return self;
        }
        let state = Arc::new(Mutex::new(Watched {
            body: self,
            parked_since: None,
            cut: None,
        }));
        let watchdog = tokio::spawn(watchdog(Arc::downgrade(&state), timeout)).abort_handle();
        ProxyBody::Watched(StreamWatch { state, watchdog })
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
            ProxyBody::Watched(w) => return w.poll_frame(cx),
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
            ProxyBody::Watched(w) => {
                let w = w.state.lock().unwrap();
                w.cut.is_none() && w.body.is_end_stream()
            }
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
            ProxyBody::Watched(w) => {
                let w = w.state.lock().unwrap();
                match w.cut {
                    None => w.body.size_hint(),
                    Some(_) => SizeHint::default(),
                }
            }
        }
    }
}
