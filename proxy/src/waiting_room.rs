//! The waiting room: a new HTTP/1 connection whose first request is for a
//! model that is not awake waits here, before hyper serves it, holding only
//! the request's own bytes (sized to the request) and its place in the hold
//! queue, not hyper's per-connection buffers and state (8 KB read buffer,
//! 8 KB write buffer, the connection future: ~20–40 KB per connection).
//!
//! When the wait ends (the model woke, the hold limit passed, the proxy is
//! draining, or the client sent more or closed), the connection goes to
//! hyper with the bytes already read put back in front of the stream, and
//! the usual handler answers the request, with the hold's start carried
//! over so the hold limit and the hold-wait metric count from the first
//! wait. Anything unusual goes to hyper at once, exactly as before: HTTP/2,
//! a chunked or `Expect: 100-continue` request, a body over the limit, a
//! request that is not complete within the header timeout, a request
//! without a valid API key, a model that is awake or unknown, a full queue.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::handler::Shared;
use crate::handler::checks::{forwardable_path, key_ok};
use crate::hold::{Release, Wait};
use crate::metrics::ModelLabels;
use crate::request_model::{find_request_model, route_for};

/// What the waiting room read and how long the request has been held.
#[derive(Debug, Default)]
pub struct Entry {
    /// Bytes read from the connection, to be served before the rest.
    pub prefix: Bytes,
    /// When the first request started waiting, if it waited here.
    pub held_since: Option<Instant>,
    /// Its place among its model's requests leaving the waiting room
    /// ([`crate::hold::LEAVING_AT_ONCE`]); given up at the answer's head,
    /// after [`crate::hold::GATE_HOLD_MAX`] at the engine, or when the
    /// request ends before.
    pub gate: Option<OwnedSemaphorePermit>,
    /// The client closed the connection while waiting: nothing to serve.
    pub closed: bool,
}

/// How long a new connection may take to send its first request once the
/// proxy is draining; it is then served (and closed), or closed if it sent
/// nothing.
pub const FIRST_REQUEST_GRACE: Duration = Duration::from_secs(1);

/// Headers parsed at most (more: hyper takes the request).
const MAX_HEADERS: usize = 64;

/// Reads the first request; when it must wait for its model, waits here.
/// The proxy stopping (`stopping`) ends the reading at once (what was read
/// goes to hyper, which closes the connection as the drain asks).
pub async fn enter(
    shared: &Shared,
    stream: &TcpStream,
    max_header_bytes: usize,
    header_timeout: Duration,
    stopping: &CancellationToken,
) -> Entry {
    let mut buf = Vec::new();
    // `buf` keeps what was read if the read is cut short.
    let read = {
        let reading = tokio::time::timeout(
            header_timeout,
            read_request(shared, stream, &mut buf, max_header_bytes),
        );
        tokio::pin!(reading);
        tokio::select! {
            r = &mut reading => r.ok().flatten(),
            // Draining: a connection accepted a moment ago is about to send
            // its first request; closing it unread would answer nothing.
            () = stopping.cancelled() => tokio::time::timeout(FIRST_REQUEST_GRACE, &mut reading)
                .await
                .ok()
                .and_then(|r| r.ok().flatten()),
        }
    };
    let Some(model) = read else {
        return Entry {
            prefix: Bytes::from(buf),
            ..Entry::default()
        };
    };
    let view = shared.table.view();
    let Ok(route) = route_for(&view, &model).cloned() else {
        return Entry {
            prefix: Bytes::from(buf),
            ..Entry::default()
        };
    };
    drop(view);
    if route.is_awake() {
        return Entry {
            prefix: Bytes::from(buf),
            ..Entry::default()
        };
    }
    let since = Instant::now();
    let Ok(mut ticket) = shared.holds.admit(&route, since) else {
        // Shed: the handler gives the same answer.
        return Entry {
            prefix: Bytes::from(buf),
            ..Entry::default()
        };
    };
    buf.shrink_to_fit();
    let prefix = Bytes::from(buf);
    let deadline = since + Duration::from_millis(route.max_hold_ms);
    let model = route.name.clone();
    drop(route);
    let mut one = [0u8; 1];
    let (released, mut closed) = tokio::select! {
        // Released, timed out or draining: the handler decides.
        w = ticket.wait(deadline, None) => (matches!(w, Wait::Released(Release::Go)), false),
        // The client sent more (hyper serves it after this one) or closed.
        n = stream.peek(&mut one) => (false, matches!(n, Ok(0) | Err(_))),
    };
    let leaving = ticket.leaving();
    drop(ticket);
    // Only a released request waits for its turn to leave (the others are
    // answered at once or held again by the handler); a client that hangs
    // up meanwhile is let go, one that sends more is served without a turn.
    let mut gate = None;
    if released {
        tokio::select! {
            p = leaving.acquire_owned() => gate = p.ok(),
            n = stream.peek(&mut one) => closed = matches!(n, Ok(0) | Err(_)),
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
    Entry {
        prefix,
        held_since: Some(since),
        gate,
        closed,
    }
}

/// Reads one complete HTTP/1 request into `buf`; its model when it is a
/// plain POST to a forwardable path with an exact body (and nothing after
/// it) that may be held. `None`: leave it to hyper (what was read is kept).
async fn read_request(
    shared: &Shared,
    stream: &TcpStream,
    buf: &mut Vec<u8>,
    max_header_bytes: usize,
) -> Option<String> {
    let limit = max_header_bytes.saturating_add(shared.max_body_bytes);
    let head_len = loop {
        read_more(stream, buf, limit).await?;
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(buf) {
            Ok(httparse::Status::Complete(n)) => break n,
            Ok(httparse::Status::Partial) if buf.len() < max_header_bytes => continue,
            _ => return None,
        }
    };
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    req.parse(buf).ok()?;
    if req.method != Some("POST") || !forwardable_path(req.path?) {
        return None;
    }
    let mut length = None;
    let mut auth = None;
    // Where the Content-Type value is in `buf` (read again after the body).
    let mut content_type = None;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            if length.is_some() {
                return None;
            }
            // Digits only, as hyper reads it: `usize::from_str` also takes
            // "+13", which hyper refuses (400), after a hold here.
            let v = h.value.trim_ascii();
            if v.is_empty() || !v.iter().all(u8::is_ascii_digit) {
                return None;
            }
            length = Some(std::str::from_utf8(v).ok()?.parse::<usize>().ok()?);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding")
            || h.name.eq_ignore_ascii_case("expect")
            || h.name.eq_ignore_ascii_case("upgrade")
        {
            return None;
        } else if h.name.eq_ignore_ascii_case("authorization") {
            auth = Some(h.value);
        } else if h.name.eq_ignore_ascii_case("content-type") {
            let at = h.value.as_ptr() as usize - buf.as_ptr() as usize;
            content_type = Some(at..at + h.value.len());
        }
    }
    let length = length?;
    if length > shared.max_body_bytes || !key_ok(shared, auth) {
        return None;
    }
    let end = head_len + length;
    while buf.len() < end {
        read_more(stream, buf, end).await?;
    }
    if buf.len() != end {
        return None;
    }
    let content_type = content_type.map(|r| &buf[r]);
    // "" when it names none: the one model served ([`route_for`]).
    let field = find_request_model(&buf[head_len..], content_type).ok()?;
    Some(field.name.into_owned())
}

/// Reads what is there (at least one byte); `None` at EOF, on error or
/// when `buf` is already `limit` long.
async fn read_more(stream: &TcpStream, buf: &mut Vec<u8>, limit: usize) -> Option<()> {
    if buf.len() >= limit {
        return None;
    }
    if buf.capacity() == buf.len() {
        buf.reserve((buf.len().max(1024)).min(limit - buf.len()));
    }
    loop {
        stream.readable().await.ok()?;
        match stream.try_read_buf(buf) {
            Ok(0) => return None,
            Ok(_) => return Some(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(_) => return None,
        }
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
}
