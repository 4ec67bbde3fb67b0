//! One HTTP/1.1 connection to an engine, driven by whoever holds it: the
//! request's own task writes the request and reads the response head
//! ([`UpstreamConn::send`]) and, through the response body, reads the body
//! ([`UpstreamConn::poll_data`]). The bytes go straight between the socket
//! and the connection's buffers ([`super::h1`]): no task per connection, no
//! channel between the request and its connection, no second header map.

use std::io::IoSlice;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::response;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::h1::{self, ClientHeaders, Decoded, Decoder, RawHead, RequestHead, UpstreamError};
use super::pool::EnginePool;

/// How long connecting to an engine may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// TCP keep-alive probes on upstream connections (a dead engine host is
/// noticed during a long generation).
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);
/// Bodies up to this size are copied behind the head and sent in one write.
const COPY_BODY: usize = 16 * 1024;
/// Room made in the read buffer when less than [`MIN_ROOM`] is left (the
/// allocation is reused once the bytes handed on from it are dropped).
const READ_ROOM: usize = 16 * 1024;
const MIN_ROOM: usize = 4 * 1024;

/// One upstream connection. Boxed wherever it goes (the buffers' headers
/// and the socket), so handing it around moves a pointer.
#[derive(Debug)]
pub struct UpstreamConn {
    io: TcpStream,
    /// Bytes read from the engine and not used yet.
    read: BytesMut,
    /// The request head being written (kept for the next request).
    write: Vec<u8>,
    /// The body of the response in progress (`Done` between exchanges).
    body: Decoder,
    pool: Arc<EnginePool>,
    /// It carried an exchange before this one (it came from the idle pool).
    pub reused: bool,
    /// It may go back to the idle pool when its response has ended.
    pub poolable: bool,
    /// The serving thread that opened it (its runtime drives the socket).
    pub shard: usize,
    /// Bytes of the current response have arrived.
    answered: bool,
    /// The current response's headers, when the client's request came as
    /// [`ClientHeaders::Lines`] (the proxy's own server writes them as
    /// they are): `raw_valid` says they are the current response's.
    raw: RawHead,
    raw_valid: bool,
    /// `--upstream-timeout`: the longest the engine may send nothing on a
    /// request (for its head, and between reads of its body).
    quiet: Duration,
    /// The body's quiet timer, set again when a read finds nothing after
    /// data came (`quiet_armed` false).
    quiet_timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    quiet_armed: bool,
}

/// What [`UpstreamConn::send`] returns: the response's status and headers
/// (empty when kept raw: [`UpstreamConn::raw_head`]), and whether it is a
/// server-sent event stream.
#[derive(Debug)]
pub struct Answer {
    pub parts: response::Parts,
    pub sse: bool,
}

impl UpstreamConn {
    /// Opens a new connection to `pool`'s engine (TCP_NODELAY, 3 s connect
    /// timeout). The error says which engine and why.
    pub async fn connect(pool: &Arc<EnginePool>) -> Result<Box<UpstreamConn>, String> {
        let addr = pool.addr();
        let io = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(format!("connecting to {addr}: {e}")),
            Err(_) => {
                return Err(format!(
                    "connecting to {addr}: timed out after {CONNECT_TIMEOUT:?}"
                ));
            }
        };
        let _ = io.set_nodelay(true);
        let sock = socket2::SockRef::from(&io);
        let _ = sock.set_tcp_keepalive(&socket2::TcpKeepalive::new().with_time(TCP_KEEPALIVE));
        Ok(Box::new(UpstreamConn {
            io,
            read: BytesMut::new(),
            write: Vec::new(),
            body: Decoder::Done,
            pool: pool.clone(),
            reused: false,
            poolable: true,
            shard: pool.shard_here(),
            answered: false,
            raw: RawHead::default(),
            raw_valid: false,
            quiet: pool.quiet,
            quiet_timer: None,
            quiet_armed: false,
        }))
    }

    /// An idle connection that can carry a request now: the engine has
    /// neither closed it nor sent anything on it since its last response.
    /// Costs a system call only when the socket became readable meanwhile
    /// (`try_read` looks at the readiness tokio has cached first).
    pub fn is_usable(&mut self) -> bool {
        if !self.read.is_empty() || !self.body.is_done() {
            return false;
        }
        let mut probe = [0u8; 1];
        matches!(self.io.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }

    /// The engine sent something for the last request (a byte of a head,
    /// an interim response): a failure after that is not a connection
    /// closed before any answer, and the request is not sent again.
    pub fn answered(&self) -> bool {
        self.answered
    }

    /// Sends the request (`head` and the client's `headers`, then `body`)
    /// and reads the response head. The body is read by
    /// [`UpstreamConn::poll_data`].
    pub async fn send(
        &mut self,
        head: &RequestHead<'_>,
        headers: ClientHeaders<'_>,
        body: &Bytes,
    ) -> Result<Answer, UpstreamError> {
        self.answered = false;
        self.raw_valid = matches!(headers, ClientHeaders::Lines(_));
        self.write.clear();
        h1::encode_request(&mut self.write, head, headers);
        if body.len() <= COPY_BODY {
            self.write.extend_from_slice(body);
            self.io.write_all(&self.write).await?;
        // Boxed: its timer and state would otherwise make every request's
        // future larger (it is boxed per request), for the rare large body.
        } else if let Some(early) = Box::pin(self.write_reading(head.method, body)).await? {
            return Ok(early);
        }
        loop {
            let raw = self.raw_valid.then_some(&mut self.raw);
            if let Some(resp) = h1::parse_response(&mut self.read, head.method, raw)? {
                self.body = Decoder::new(resp.body);
                self.poolable &= resp.keep_alive;
                return Ok(Answer {
                    parts: resp.parts,
                    sse: resp.sse,
                });
            }
            make_room(&mut self.read);
            if std::future::poll_fn(|cx| self.poll_read(cx)).await? == 0 {
                self.poolable = false;
                return Err(UpstreamError::ClosedBeforeHead);
            }
            self.answered = true;
        }
    }

    /// Writes the head and a large body while reading what the engine
    /// sends meanwhile: an engine may answer before it has read the whole
    /// body (a 413, a 401 from a check in front of the handler) and then
    /// close, or stop reading. That answer is returned (`Some`) and goes to
    /// the client, where writing on alone would fail (the close) or never
    /// end (the engine no longer reads); the connection, with part of a
    /// request on it, is not reused. `None`: the whole request went out.
    /// An engine that takes no byte of the body and sends none for
    /// [`UpstreamConn::quiet`] (`--upstream-timeout`) ends the request, as
    /// one that sends no head does (within twice that: the timer is looked
    /// at when it rings).
    async fn write_reading(
        &mut self,
        method: &http::Method,
        body: &Bytes,
    ) -> Result<Option<Answer>, UpstreamError> {
        let (mut rd, mut wr) = self.io.split();
        let written = AtomicUsize::new(0);
        let write = write_both(&mut wr, &self.write, body, &written);
        tokio::pin!(write);
        // Looked at when it rings, not moved on each write: a body that
        // goes out in many writes sets no timer per write.
        let quiet = tokio::time::sleep(self.quiet);
        tokio::pin!(quiet);
        let mut written_at_ring = 0;
        // A failed write (the engine closed) may still have an answer
        // behind it, already in the socket.
        let mut write_failed = None;
        loop {
            tokio::select! {
                biased;
                r = &mut write, if write_failed.is_none() => match r {
                    Ok(()) => return Ok(None),
                    Err(e) => write_failed = Some(e),
                },
                () = &mut quiet => {
                    let now = written.load(Ordering::Relaxed);
                    if now == written_at_ring {
                        self.poolable = false;
                        return Err(UpstreamError::Quiet(self.quiet));
                    }
                    written_at_ring = now;
                    quiet.as_mut().reset(tokio::time::Instant::now() + self.quiet);
                }
                r = rd.read_buf(&mut self.read) => {
                    let closed = match r {
                        Ok(0) => None,
                        Ok(_) => {
                            self.answered = true;
                            quiet.as_mut().reset(tokio::time::Instant::now() + self.quiet);
                            let raw = self.raw_valid.then_some(&mut self.raw);
                            if let Some(resp) = h1::parse_response(&mut self.read, method, raw)? {
                                self.body = Decoder::new(resp.body);
                                self.poolable = false;
                                return Ok(Some(Answer {
                                    parts: resp.parts,
                                    sse: resp.sse,
                                }));
                            }
                            make_room(&mut self.read);
                            continue;
                        }
                        Err(e) => Some(e),
                    };
                    self.poolable = false;
                    return Err(match (write_failed, closed) {
                        (Some(e), _) | (None, Some(e)) => e.into(),
                        (None, None) => UpstreamError::ClosedBeforeHead,
                    });
                }
            }
        }
    }

    /// The next piece of the response body (`None` at its end), reading
    /// from the engine as needed.
    pub fn poll_data(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, UpstreamError>>> {
        loop {
            match self.body.decode(&mut self.read) {
                Ok(Decoded::Data(b)) => return Poll::Ready(Some(Ok(b))),
                Ok(Decoded::Done) => return Poll::Ready(None),
                Ok(Decoded::NeedMore) => {}
                Err(e) => {
                    self.poolable = false;
                    return Poll::Ready(Some(Err(e)));
                }
            }
            make_room(&mut self.read);
            match ready!(self.poll_read(cx)) {
                Ok(0) => {
                    self.poolable = false;
                    if let Err(e) = self.body.eof() {
                        return Poll::Ready(Some(Err(e)));
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    self.poolable = false;
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }

    /// Reads what the engine sent into the read buffer; an engine that
    /// sends nothing for [`UpstreamConn::quiet`] is an error, and the
    /// connection is not reused (dropped, so the engine sees the request
    /// end). The timer is the connection's own, set again, not made anew,
    /// for each request.
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<Result<usize, UpstreamError>> {
        match tokio_util::io::poll_read_buf(std::pin::Pin::new(&mut self.io), cx, &mut self.read) {
            Poll::Ready(res) => {
                self.quiet_armed = false;
                Poll::Ready(res.map_err(UpstreamError::from))
            }
            Poll::Pending => {
                ready!(self.poll_quiet(cx));
                self.poolable = false;
                Poll::Ready(Err(UpstreamError::Quiet(self.quiet)))
            }
        }
    }

    /// Ready once the engine has sent nothing for [`UpstreamConn::quiet`]
    /// since the last read that found data (the timer is set again at the
    /// first read after data that finds none: one timer per quiet spell,
    /// not per chunk).
    fn poll_quiet(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.quiet_armed {
            let deadline = tokio::time::Instant::now() + self.quiet;
            match &mut self.quiet_timer {
                Some(timer) => timer.as_mut().reset(deadline),
                None => self.quiet_timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
            self.quiet_armed = true;
        }
        let timer = self.quiet_timer.as_mut().expect("made when first armed");
        timer.as_mut().poll(cx)
    }

    /// The current response's end-to-end headers, when they were kept raw.
    pub fn raw_head(&self) -> Option<&RawHead> {
        self.raw_valid.then_some(&self.raw)
    }

    /// The response body has been read to its end.
    pub fn body_done(&self) -> bool {
        self.body.is_done()
    }

    /// Bytes of response body still to come, when known.
    pub fn body_remaining(&self) -> Option<u64> {
        self.body.remaining()
    }

    /// The response has been read to its end: back to the idle pool if the
    /// connection can carry another request, closed otherwise.
    pub fn release(mut self: Box<Self>) {
        if self.poolable && self.body.is_done() && self.read.is_empty() {
            self.reused = true;
            let pool = self.pool.clone();
            pool.put_back(self);
        }
    }
}

/// Makes room in a read buffer with less than [`MIN_ROOM`] left.
fn make_room(read: &mut BytesMut) {
    if read.capacity() - read.len() < MIN_ROOM {
        read.reserve(READ_ROOM);
    }
}

/// Writes `head` then `body` with as few writes as the socket allows,
/// counting the bytes written in `written`.
async fn write_both(
    io: &mut (impl tokio::io::AsyncWrite + Unpin),
    head: &[u8],
    body: &[u8],
    written: &AtomicUsize,
) -> std::io::Result<()> {
    let (mut h, mut b) = (0, 0);
    while h < head.len() || b < body.len() {
        let bufs = [IoSlice::new(&head[h..]), IoSlice::new(&body[b..])];
        let n = io.write_vectored(&bufs).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        written.fetch_add(n, Ordering::Relaxed);
        let from_head = n.min(head.len() - h);
        h += from_head;
        b += n - from_head;
    }
    Ok(())
}
