//! Writing one response to a client connection: the head encoded in one
//! pass, the body relayed as it comes (what the body has ready is gathered
//! into one write, up to [`FLUSH_AT`] bytes; the head goes with the first
//! of it), framed by its length when known, else chunked.
//!
//! Writes have the send timeout (`--send-timeout`) as a deadline for
//! progress: a client that stops reading is cut, and its engine request
//! ended, once a write has waited that long. While the proxy waits for the
//! engine, a client that closes the connection is noticed (a read of
//! nothing) and its request dropped, so the engine aborts it.

use std::cell::RefCell;
use std::io;
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header;
use http::{Response, StatusCode};
use http_body::Body as _;
use tokio::net::TcpStream;

use crate::body::ProxyBody;
use crate::forward::named_in;

/// Gathered body bytes written at once at most (then the next are read).
pub const FLUSH_AT: usize = 64 * 1024;

/// How the body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// No body (204, 304), or a sized one: `Some(n)` bytes still owed
    /// (`None`: a length header the body gave no size for; the connection
    /// closes after it).
    Plain(Option<u64>),
    Chunked,
}

/// What one gathering pass came to.
enum Step {
    /// Bytes to write; the body goes on.
    More,
    /// The body ended (its bytes, if any, are to be written).
    End,
    /// The body failed midway: the response cannot be finished.
    Failed,
}

/// Writes `resp` to `stream`; whether the connection may carry another
/// request after it. `keep_alive`: the connection stays open after this
/// response (else the head says `connection: close`). `watch`: notice a
/// client that closes the connection while the body waits for its engine
/// (not when the client has already sent its next request).
pub async fn write(
    stream: &TcpStream,
    resp: Response<ProxyBody>,
    keep_alive: bool,
    send_timeout: Duration,
    watch: bool,
) -> bool {
    let (parts, mut body) = resp.into_parts();
    // The head and a small body go out in one write, from one allocation.
    let sized = body.size_hint().exact().unwrap_or(0).min(FLUSH_AT as u64) as usize;
    let raw = body.raw_head().map_or(0, |r| r.lines.len());
    let mut out = Vec::with_capacity(128 + 64 * parts.headers.len() + raw + sized);
    let (mut framing, keep_alive) = encode_head(&mut out, &parts, &body, keep_alive);
    if framing == Framing::Plain(Some(0)) {
        // Nothing to relay (a 204 or 304, or an empty body).
        drop(body);
        return write_all(stream, &out, send_timeout).await.is_ok() && keep_alive;
    }
    loop {
        let waits = out.is_empty() && watch;
        let gathering =
            std::future::poll_fn(|cx| gather(Pin::new(&mut body), cx, &mut out, &mut framing));
        let step = if waits {
            tokio::select! {
                biased;
                s = gathering => s,
                () = hung_up(stream) => return false,
            }
        } else {
            gathering.await
        };
        if !out.is_empty() {
            if write_all(stream, &out, send_timeout).await.is_err() {
                return false;
            }
            out.clear();
        }
        match step {
            Step::More => {}
            Step::End => return keep_alive,
            Step::Failed => return false,
        }
    }
}

/// Takes what `body` has ready into `out`, framed; pending only when it has
/// nothing ready and `out` is empty.
fn gather(
    mut body: Pin<&mut ProxyBody>,
    cx: &mut std::task::Context<'_>,
    out: &mut Vec<u8>,
    framing: &mut Framing,
) -> Poll<Step> {
    loop {
        match body.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data()
                    && !frame_data(out, &data, framing)
                {
                    // More than the length said (an error event in place
                    // of the rest of a sized body): what fits was sent,
                    // the connection closes.
                    tracing::debug!("response body longer than its length: closing the connection");
                    return Poll::Ready(Step::Failed);
                }
                if out.len() >= FLUSH_AT {
                    return Poll::Ready(Step::More);
                }
            }
            Poll::Ready(Some(Err(error))) => {
                tracing::debug!(%error, "response body failed midway: closing the connection");
                return Poll::Ready(Step::Failed);
            }
            Poll::Ready(None) => {
                return Poll::Ready(match *framing {
                    Framing::Chunked => {
                        out.extend_from_slice(b"0\r\n\r\n");
                        Step::End
                    }
                    Framing::Plain(Some(0)) => Step::End,
                    // Shorter than its length, or of a length not known
                    // here: the client must not read the next answer as
                    // the rest of this one.
                    Framing::Plain(_) => {
                        tracing::debug!(
                            "response body ended short of its length: closing the connection"
                        );
                        Step::Failed
                    }
                });
            }
            Poll::Pending if out.is_empty() => return Poll::Pending,
            Poll::Pending => return Poll::Ready(Step::More),
        }
    }
}

/// Appends `data`, framed; false when a sized body got more than it owed
/// (what it owed is appended).
fn frame_data(out: &mut Vec<u8>, data: &Bytes, framing: &mut Framing) -> bool {
    if data.is_empty() {
        return true;
    }
    if let Framing::Plain(Some(left)) = framing {
        let take = (data.len() as u64).min(*left);
        out.extend_from_slice(&data[..take as usize]);
        *left -= take;
        return take == data.len() as u64;
    }
    if *framing == Framing::Chunked {
        let mut hex = [0u8; 16];
        let mut i = hex.len();
        let mut n = data.len();
        while n > 0 || i == hex.len() {
            i -= 1;
            hex[i] = b"0123456789abcdef"[n & 0xf];
            n >>= 4;
        }
        out.extend_from_slice(&hex[i..]);
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
    } else {
        out.extend_from_slice(data);
    }
    true
}

/// Encodes the status line and headers; the framing, and whether the
/// connection stays open (a `Connection: close` of the response closes it).
fn encode_head(
    out: &mut Vec<u8>,
    parts: &http::response::Parts,
    body: &ProxyBody,
    mut keep_alive: bool,
) -> (Framing, bool) {
    let status = parts.status;
    if status == StatusCode::OK {
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
    } else {
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let mut has_length = false;
    let mut has_date = false;
    for (name, value) in &parts.headers {
        if *name == header::TRANSFER_ENCODING {
            // The framing is decided here.
            continue;
        } else if *name == header::CONTENT_LENGTH {
            has_length = true;
        } else if *name == header::DATE {
            has_date = true;
        } else if *name == header::CONNECTION && named_in(value.as_bytes(), b"close") {
            keep_alive = false;
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if let Some(raw) = body.raw_head() {
        // An engine's headers, as it sent them (hop-by-hop ones left out).
        out.extend_from_slice(&raw.lines);
        has_length |= raw.has_length;
        has_date |= raw.has_date;
    }
    let bodiless = status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let exact = body.size_hint().exact();
    let framing = if bodiless {
        Framing::Plain(Some(0))
    } else if has_length {
        // An engine's length: its body is sized by it (the decoder's count).
        if exact.is_none() {
            keep_alive = false;
        }
        Framing::Plain(exact)
    } else if let Some(n) = exact {
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
        out.extend_from_slice(b"\r\n");
        Framing::Plain(Some(n))
    } else {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
        Framing::Chunked
    };
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    }
    if !has_date {
        out.extend_from_slice(b"date: ");
        date(out);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    (framing, keep_alive)
}

thread_local! {
    /// This second's `Date` value, formatted once a second per thread.
    static DATE: RefCell<(u64, [u8; 29])> = const { RefCell::new((u64::MAX, [0; 29])) };
}

/// Appends the current time as an HTTP date (RFC 9110 §5.6.7).
fn date(out: &mut Vec<u8>) {
    let now = SystemTime::now();
    let secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    DATE.with_borrow_mut(|(at, text)| {
        if *at != secs {
            let s = httpdate::fmt_http_date(now);
            if s.len() == text.len() {
                text.copy_from_slice(s.as_bytes());
                *at = secs;
            } else {
                out.extend_from_slice(s.as_bytes());
                return;
            }
        }
        out.extend_from_slice(&text[..]);
    });
}

/// Writes all of `buf`; each wait for the socket to take more may last
/// `timeout` (the client reads nothing: `TimedOut`).
pub async fn write_all(stream: &TcpStream, mut buf: &[u8], timeout: Duration) -> io::Result<()> {
    while !buf.is_empty() {
        match stream.try_write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                match tokio::time::timeout(timeout, stream.writable()).await {
                    Ok(r) => r?,
                    Err(_) => {
                        tracing::debug!(
                            send_timeout_ms = timeout.as_millis() as u64,
                            "the client took nothing of the answer for the send timeout: closing"
                        );
                        return Err(io::ErrorKind::TimedOut.into());
                    }
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Resolves when the client has closed the connection (a read of nothing,
/// or an error); never, once it has sent more (its next request).
pub async fn hung_up(stream: &TcpStream) {
    let mut one = [0u8; 1];
    match stream.peek(&mut one).await {
        Ok(0) | Err(_) => {}
        Ok(_) => std::future::pending().await,
    }
}
