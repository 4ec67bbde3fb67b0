//! One HTTP/1 connection to an engine, driven by whoever holds it: the
//! request's own task polls the connection future while it waits for the
//! response head ([`UpstreamConn::send`]) and, through the response body,
//! while the body streams ([`UpstreamConn::drive`]). No task per connection,
//! no cross-task handoff per relayed chunk.

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::pool::EnginePool;
use crate::self_wake::{ROUNDS, SelfWake};

/// How long connecting to an engine may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// TCP keep-alive probes on upstream connections (a dead engine host is
/// noticed during a long generation).
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);

/// One upstream connection: the request sender and the connection future,
/// kept together so the holder drives both. Boxed wherever it goes (the
/// connection state is large), so handing it around moves a pointer.
#[derive(Debug)]
pub struct UpstreamConn {
    send: SendRequest<Full<Bytes>>,
    conn: Connection<TokioIo<TcpStream>, Full<Bytes>>,
    pool: Arc<EnginePool>,
    /// It carried an exchange before this one (it came from the idle pool).
    pub reused: bool,
    /// It may go back to the idle pool when its response has ended.
    pub poolable: bool,
    /// The serving thread that opened it (its runtime drives the socket).
    pub shard: usize,
    /// The connection future finished: the connection is closed.
    closed: bool,
    wake: SelfWake,
}

impl UpstreamConn {
    /// Opens a new connection to `pool`'s engine (TCP_NODELAY, 3 s connect
    /// timeout). The error says which engine and why.
    pub async fn connect(pool: &Arc<EnginePool>) -> Result<Box<UpstreamConn>, String> {
        let addr = pool.addr();
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(format!("connecting to {addr}: {e}")),
            Err(_) => {
                return Err(format!(
                    "connecting to {addr}: timed out after {CONNECT_TIMEOUT:?}"
                ));
            }
        };
        let _ = stream.set_nodelay(true);
        let sock = socket2::SockRef::from(&stream);
        let _ = sock.set_tcp_keepalive(&socket2::TcpKeepalive::new().with_time(TCP_KEEPALIVE));
        let (send, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP/1 handshake with {addr}: {e}"))?;
        Ok(Box::new(UpstreamConn {
            send,
            conn,
            pool: pool.clone(),
            reused: false,
            poolable: true,
            shard: pool.shard_here(),
            closed: false,
            wake: SelfWake::default(),
        }))
    }

    /// Polls the connection future once; true when the connection is
    /// closed (now or before).
    pub fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.closed
            && let Poll::Ready(res) = std::pin::Pin::new(&mut self.conn).poll(cx)
        {
            self.closed = true;
            if let Err(error) = res {
                tracing::debug!(engine = %self.pool.addr(), %error, "upstream connection ended with an error");
            }
        }
        self.closed
    }

    /// An idle connection that can carry a request now: still open (the
    /// engine has not closed it since) and its dispatcher waiting for one.
    pub fn is_usable(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        !self.drive(&mut cx) && self.send.is_ready() && !self.send.is_closed()
    }

    /// Sends `req` and waits for the response head, driving the connection
    /// in this task meanwhile. The body is read when the response body
    /// ([`crate::body::ProxyBody`]) is polled, which drives it further.
    pub async fn send(
        &mut self,
        req: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, hyper::Error> {
        let resp = self.send.send_request(req);
        let mut resp = std::pin::pin!(resp);
        std::future::poll_fn(|cx| self.poll_both(cx, |own| resp.as_mut().poll(own))).await
    }

    /// Polls the response body `inner` (arriving on this connection),
    /// driving the connection as needed.
    pub fn poll_body(
        &mut self,
        inner: &mut Incoming,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        self.poll_both(cx, |own| std::pin::Pin::new(&mut *inner).poll_frame(own))
    }

    /// Polls `side` (what this task waits for: the response head or body)
    /// and the connection future in turn until `side` is ready or neither
    /// can go on, with wakes they give each other kept inside ([`SelfWake`]).
    fn poll_both<T>(
        &mut self,
        cx: &mut Context<'_>,
        mut side: impl FnMut(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        for _ in 0..ROUNDS {
            self.wake.begin(cx);
            let waker = self.wake.waker().clone();
            let mut own = Context::from_waker(&waker);
            if let Poll::Ready(r) = side(&mut own) {
                self.wake.end();
                return Poll::Ready(r);
            }
            // Writes the request, reads what the engine sent (or notices
            // the close), then the side looks again.
            self.drive(&mut own);
            if let Poll::Ready(r) = side(&mut own) {
                self.wake.end();
                return Poll::Ready(r);
            }
            if !self.wake.end() {
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// The response has been read to its end: back to the idle pool if the
    /// connection can carry another request, closed otherwise.
    pub fn release(mut self: Box<Self>) {
        if !self.poolable {
            return;
        }
        // The dispatcher takes a poll or two after the body's last bytes to
        // become idle; a noop waker: nobody waits on an idle connection.
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..3 {
            if self.send.is_ready() || self.drive(&mut cx) {
                break;
            }
        }
        if !self.closed && self.send.is_ready() && !self.send.is_closed() {
            self.reused = true;
            let pool = self.pool.clone();
            pool.put_back(self);
        }
    }
}
