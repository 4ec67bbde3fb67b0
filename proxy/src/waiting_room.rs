//! The waiting room: a plain request (see [`crate::server::http1`]) for a
//! model that is not awake waits here, before any handler runs, holding
//! only the request's own bytes (sized to the request) and its place in
//! the hold queue: no handler future, no parsed headers, no response
//! buffers. Its connection's task is all that is kept per held request.
//!
//! When the wait ends (the model woke, the hold limit passed, the proxy is
//! draining, or the client sent more or closed), the usual handler answers
//! the request, with the hold's start carried over so the hold limit and
//! the hold-wait metric count from the first wait. Anything else waits in
//! the handler, if at all: a request hyper serves (HTTP/2, a chunked or
//! `Expect: 100-continue` request, a body over the limit, one without a
//! valid API key...), a model that is unknown, a full queue.
//!
//! [`Rewind`] puts the bytes already read back in front of the stream when
//! a connection goes to hyper.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::handler::Shared;
use crate::hold::{Release, Wait};
use crate::metrics::ModelLabels;
use crate::request_model::route_for;
use crate::route_table::ModelRoute;

/// How a request's wait in the waiting room ended.
#[derive(Debug, Default)]
pub struct Held {
    /// When it started waiting, if it waited here.
    pub since: Option<Instant>,
    /// Its place among its model's requests leaving the waiting room
    /// ([`crate::hold::LEAVING_AT_ONCE`]); given up at the answer's head,
    /// after [`crate::hold::GATE_HOLD_MAX`] at the engine, or when the
    /// request ends before.
    pub gate: Option<OwnedSemaphorePermit>,
    /// The client closed the connection while waiting: nothing to serve.
    pub closed: bool,
}

/// The route of `model` (as a body names it: "" for none) when it is known
/// and not awake: a request for it may wait here ([`hold`]).
pub fn asleep(shared: &Shared, model: &str) -> Option<Arc<ModelRoute>> {
    route_for(&shared.table.view(), model)
        .ok()
        .filter(|r| !r.is_awake())
        .cloned()
}

/// A whole request for `route`'s model ([`asleep`]) that the client sent
/// alone (nothing after it yet): when its queue has room, the request
/// waits here until it is released, times out, the proxy drains, or the
/// client sends more or closes. Otherwise (and after the wait) the handler
/// answers it: it holds again, sheds or forwards, with the wait's start
/// carried over.
pub async fn hold(shared: &Shared, stream: &TcpStream, route: Arc<ModelRoute>) -> Held {
    let since = Instant::now();
    let Ok(mut ticket) = shared.holds.admit(&route, since) else {
        // Shed: the handler gives the same answer.
        return Held::default();
    };
    let deadline = since + Duration::from_millis(route.max_hold_ms);
    let model = route.name.clone();
    drop(route);
    let mut one = [0u8; 1];
    let (released, mut closed) = tokio::select! {
        // Released, timed out or draining: the handler decides.
        w = ticket.wait(deadline, None) => (matches!(w, Wait::Released(Release::Go)), false),
        // The client sent more (served after this one) or closed.
        n = stream.peek(&mut one) => (false, matches!(n, Ok(0) | Err(_))),
    };
    let leaving = ticket.leaving();
    drop(ticket);
    // Only a released request waits for its turn to leave (the others are
    // answered at once or held again by the handler); a client that hangs
    // up meanwhile is let go, one that sends more is served without a turn,
    // and so is one whose hold limit passes (its engine's slots are all
    // taken, by requests that wait with their turns): the handler sheds it
    // if no slot comes either.
    let mut gate = None;
    if released {
        let turn_by = deadline.max(Instant::now() + crate::hold::SLOT_WAIT_MIN);
        match take_turn(leaving, stream, turn_by).await {
            Turn::Got(p) => gate = Some(p),
            Turn::Closed => closed = true,
            Turn::SentMore | Turn::Late => {}
        }
    }
    if closed {
        // The handler never sees it: its wait counts here (the waits
        // clients gave up on, as on a reused connection).
        shared
            .metrics
            .hold_wait
            .get_or_create(&ModelLabels { model })
            .observe(since.elapsed().as_secs_f64());
    }
    Held {
        since: Some(since),
        gate,
        closed,
    }
}

/// How a released request's wait for its turn to leave ended.
#[derive(Debug)]
enum Turn {
    /// Its place among the model's requests leaving ([`Held::gate`]).
    Got(OwnedSemaphorePermit),
    /// The client closed the connection.
    Closed,
    /// The client sent more: served without a turn.
    SentMore,
    /// `turn_by` passed first (every place taken by requests waiting on
    /// the engine's slots): served without a turn, and shed by the handler
    /// if no slot comes either. Never a wait without an end.
    Late,
}

/// Waits for a place in `leaving`, until `turn_by` at the latest.
async fn take_turn(leaving: Arc<Semaphore>, stream: &TcpStream, turn_by: Instant) -> Turn {
    let mut one = [0u8; 1];
    tokio::select! {
        // The places are never closed; were they, it would be served without one.
        p = leaving.acquire_owned() => p.map_or(Turn::Late, Turn::Got),
        n = stream.peek(&mut one) => match n {
            Ok(0) | Err(_) => Turn::Closed,
            Ok(_) => Turn::SentMore,
        },
        () = tokio::time::sleep_until(turn_by) => Turn::Late,
    }
}

/// A stream with bytes already read put back in front.
#[derive(Debug)]
pub struct Rewind {
    prefix: Bytes,
    io: TcpStream,
}

impl Rewind {
    pub fn new(prefix: Bytes, io: TcpStream) -> Self {
        Rewind { prefix, io }
    }
}

impl AsyncRead for Rewind {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            if n == self.prefix.len() {
                // Given back now: an emptied `Bytes` still holds its
                // allocation (the whole first request, up to the body limit)
                // for as long as the connection stays open.
                self.prefix = Bytes::new();
            } else {
                self.prefix.advance(n);
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Rewind {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// The bytes read here (a whole first request, body included: up to
    /// `--max-body`) are given back once hyper has them, not kept for as
    /// long as the client keeps the connection open.
    #[tokio::test]
    async fn the_bytes_read_first_are_let_go_once_served() {
        struct Owner(Vec<u8>, Arc<AtomicBool>);
        impl AsRef<[u8]> for Owner {
            fn as_ref(&self) -> &[u8] {
                &self.0
            }
        }
        impl Drop for Owner {
            fn drop(&mut self) {
                self.1.store(true, Ordering::SeqCst);
            }
        }
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        let dropped = Arc::new(AtomicBool::new(false));
        let first = b"POST /v1/x HTTP/1.1\r\n".to_vec();
        let prefix = Bytes::from_owner(Owner(first.clone(), dropped.clone()));
        let mut io = Rewind::new(prefix, server);
        let mut buf = vec![0u8; 8];
        io.read_exact(&mut buf).await.unwrap();
        assert_eq!(buf, first[..8]);
        assert!(!dropped.load(Ordering::SeqCst));
        let mut rest = vec![0u8; first.len() - 8];
        io.read_exact(&mut rest).await.unwrap();
        assert_eq!(rest, first[8..]);
        assert!(
            dropped.load(Ordering::SeqCst),
            "the first request's bytes stay allocated while the connection is open"
        );
        client.write_all(b"next").await.unwrap();
        let mut next = [0u8; 4];
        io.read_exact(&mut next).await.unwrap();
        assert_eq!(&next, b"next");
    }

    async fn pair() -> (TcpStream, TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        (client, server)
    }

    /// Every place taken (256 released requests each waiting on a busy
    /// engine's slots): the next released request's turn still ends, at
    /// `turn_by`, and not before; a place given back meanwhile is taken.
    #[tokio::test(start_paused = true)]
    async fn a_turn_with_every_place_taken_ends_at_its_deadline() {
        let (_client, server) = pair().await;
        let leaving = Arc::new(Semaphore::new(1));
        let taken = leaving.clone().acquire_owned().await.unwrap();
        let start = Instant::now();
        let turn_by = start + Duration::from_secs(5);
        let turn = tokio::time::timeout(
            Duration::from_secs(60),
            take_turn(leaving.clone(), &server, turn_by),
        )
        .await
        .expect("the turn waited past its deadline");
        assert!(matches!(turn, Turn::Late), "{turn:?}");
        assert_eq!(start.elapsed(), Duration::from_secs(5));

        let giver = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            drop(taken);
        });
        let turn = take_turn(leaving, &server, Instant::now() + Duration::from_secs(5)).await;
        assert!(matches!(turn, Turn::Got(_)), "{turn:?}");
        giver.await.unwrap();
    }

    /// A client that closes, or sends its next request, while waiting for
    /// its turn is let go at once, without a place.
    #[tokio::test]
    async fn a_turn_ends_when_the_client_closes_or_sends_more() {
        let none = Arc::new(Semaphore::new(0));
        let far = Instant::now() + Duration::from_secs(600);

        let (mut client, server) = pair().await;
        client.write_all(b"GET").await.unwrap();
        let turn = take_turn(none.clone(), &server, far).await;
        assert!(matches!(turn, Turn::SentMore), "{turn:?}");

        let (client, server) = pair().await;
        drop(client);
        let turn = take_turn(none, &server, far).await;
        assert!(matches!(turn, Turn::Closed), "{turn:?}");
    }
}
