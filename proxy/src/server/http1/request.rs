//! Reading one request of a client connection: its head parsed in place
//! (`httparse`), its body read whole, both taken out of the connection's
//! buffer without a copy. Only a *plain* request is read here: a POST to a
//! forwardable `/v1/...` path, HTTP/1.1, one `Content-Length` within the
//! body limit, no `Transfer-Encoding`, `Expect` or `Upgrade`, a valid API
//! key when keys are configured. Anything else is hyper's (the connection
//! goes to it with the bytes read), which answers it exactly as before.
//!
//! The head has `--header-timeout` to arrive whole; from then on the body
//! has `--body-timeout` between reads (timed from its last bytes, or from
//! the end of the head before any came) and the minimum average rate, as
//! hyper's requests have in the handler ([`BodyClock`]).

use std::io;
use std::mem::MaybeUninit;
use std::ops::Range;

use bytes::{Bytes, BytesMut};
use http::{Method, Version};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::errors::ApiError;
use crate::forward::{ClientHeaders, ClientRequest, named_in, stops_here};
use crate::handler::Shared;
use crate::handler::checks::{BodyClock, forwardable_path, key_among};

/// A partial head shorter than this is parsed again at each read.
const REPARSE_BELOW: usize = 8192;

/// Headers parsed at most (more: hyper takes the request).
pub const MAX_HEADERS: usize = 64;

/// What reading a request came to.
#[derive(Debug)]
pub enum Read {
    /// A whole plain request, taken out of the buffer.
    Plain(Request),
    /// Not a plain request (or not a valid one): hyper serves it from the
    /// bytes still in the buffer.
    Other,
    /// A head longer than the limit (whole or not): answered 431 here, in
    /// the OpenAI shape (hyper's 431 has no body).
    HeadTooLarge,
    /// A plain request's body stalled for the body timeout, or came too
    /// slowly (`error`, a 408); `origin`: the request has an `Origin`.
    BodyTimeout { error: ApiError, origin: bool },
    /// The client closed the connection (or it failed).
    Closed,
}

/// One plain request.
#[derive(Debug)]
pub struct Request {
    /// The head's bytes (request line and headers, through the empty line).
    pub head: Bytes,
    pub body: Bytes,
    /// Where the target (path and query) is in `head`.
    target: Range<usize>,
    /// The headers passed on to the engine, filtered and written as lines
    /// ([`ClientHeaders::Lines`]).
    pub lines: Vec<u8>,
    /// Where the `Content-Type` value is in `head`.
    pub content_type: Option<Range<usize>>,
    /// It has an `Origin` header (sent by a web page).
    pub origin: bool,
    /// The client asked to close the connection after this request.
    pub close: bool,
}

impl Request {
    /// The request as forwarding needs it.
    pub fn client(&self) -> ClientRequest<'_> {
        ClientRequest {
            method: &Method::POST,
            // httparse took it as UTF-8 (visible ASCII).
            target: std::str::from_utf8(&self.head[self.target.clone()]).unwrap_or("/"),
            version: Version::HTTP_11,
            headers: ClientHeaders::Lines(&self.lines),
        }
    }
}

/// What the buffer holds.
enum Parsed {
    /// A whole plain request, taken out of it.
    Whole(Request),
    /// The head is not whole yet: this many bytes are needed in all.
    Need(usize),
    /// A plain request's head (`head` bytes) is whole, its body
    /// (`length` bytes) not yet; `origin`: it has an `Origin`.
    Body {
        head: usize,
        length: usize,
        origin: bool,
    },
    /// Not a plain request (or not valid HTTP/1).
    Other,
    /// A head over the limit.
    TooLarge,
}

/// A byte the `http` crate takes in a query (what it refuses, hyper
/// answers 400; a fragment it drops): httparse has already refused
/// controls and spaces.
fn query_byte(b: u8) -> bool {
    b.is_ascii_graphic() && !matches!(b, b'"' | b'#' | b'<' | b'>' | b'`' | b'{' | b'}')
}

fn ascii_eq(a: &str, b: &[u8]) -> bool {
    a.as_bytes().eq_ignore_ascii_case(b)
}

/// What makes a request plain besides its form: the body limit and the API
/// keys (when there are any, a request must carry one, and its
/// `Authorization` is not passed on).
#[derive(Debug, Clone, Copy)]
pub struct Rules<'a> {
    pub max_header_bytes: usize,
    pub max_body_bytes: usize,
    pub api_keys: &'a [Vec<u8>],
    /// `--body-timeout`.
    pub body_timeout: std::time::Duration,
}

impl<'a> Rules<'a> {
    pub fn of(shared: &'a Shared, max_header_bytes: usize) -> Self {
        Rules {
            max_header_bytes,
            max_body_bytes: shared.max_body_bytes,
            api_keys: &shared.api_keys,
            body_timeout: shared.body_timeout,
        }
    }
}

/// Parses the head at the start of `buf`; when the request is plain and
/// whole, takes it out.
fn take(rules: &Rules<'_>, buf: &mut BytesMut) -> Parsed {
    let max_header_bytes = rules.max_header_bytes;
    let mut raw = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let len = match httparse::ParserConfig::default()
        .parse_request_with_uninit_headers(&mut req, buf, &mut raw)
    {
        // A head over the limit is refused even when it came whole.
        Ok(httparse::Status::Complete(n)) if n <= max_header_bytes => n,
        Ok(httparse::Status::Complete(_)) => return Parsed::TooLarge,
        Ok(httparse::Status::Partial) if buf.len() >= max_header_bytes => {
            return Parsed::TooLarge;
        }
        Ok(httparse::Status::Partial) => return Parsed::Need(max_header_bytes),
        Err(_) => return Parsed::Other,
    };
    let Some(target) = req.path else {
        return Parsed::Other;
    };
    // The path alone is checked (as the handler checks `uri().path()`);
    // a query goes to the engine with it.
    let (path, query) = match target.bytes().position(|b| b == b'?') {
        Some(q) => (&target[..q], &target[q..]),
        None => (target, ""),
    };
    if req.method != Some("POST")
        || req.version != Some(1)
        || !forwardable_path(path)
        || !query.bytes().all(query_byte)
    {
        return Parsed::Other;
    }
    let base = buf.as_ptr() as usize;
    let at = |s: &[u8]| s.as_ptr() as usize - base;
    let mut length = None;
    let mut auth = None;
    let mut content_type = None;
    let mut origin = false;
    let mut close = false;
    let mut connection = false;
    for h in req.headers.iter() {
        if ascii_eq(h.name, b"content-length") {
            // Digits only, as hyper reads it: `usize::from_str` also takes
            // "+13", which hyper refuses (400).
            let v = h.value.trim_ascii();
            if length.is_some() || v.is_empty() || v.len() > 18 || !v.iter().all(u8::is_ascii_digit)
            {
                return Parsed::Other;
            }
            length = Some(v.iter().fold(0usize, |n, d| n * 10 + usize::from(d - b'0')));
        } else if ascii_eq(h.name, b"transfer-encoding")
            || ascii_eq(h.name, b"expect")
            || ascii_eq(h.name, b"upgrade")
        {
            return Parsed::Other;
        } else if ascii_eq(h.name, b"authorization") {
            // Twice: which one counts is hyper's to say (the first).
            if auth.replace(h.value).is_some() {
                return Parsed::Other;
            }
        } else if ascii_eq(h.name, b"content-type") {
            if content_type.is_some() {
                return Parsed::Other;
            }
            content_type = Some(at(h.value)..at(h.value) + h.value.len());
        } else if ascii_eq(h.name, b"origin") {
            origin = true;
        } else if ascii_eq(h.name, b"connection") {
            connection = true;
            close |= named_in(h.value, b"close");
        }
    }
    let Some(content_length) = length else {
        return Parsed::Other;
    };
    if content_length > rules.max_body_bytes || !key_among(rules.api_keys, auth) {
        return Parsed::Other;
    }
    if buf.len() < len + content_length {
        return Parsed::Body {
            head: len,
            length: content_length,
            origin,
        };
    }
    // The headers the engine gets, as hyper's path filters them.
    let strip_authorization = !rules.api_keys.is_empty();
    let headers = &*req.headers;
    let named = |name: &[u8]| {
        connection
            && headers
                .iter()
                .any(|c| ascii_eq(c.name, b"connection") && named_in(c.value, name))
    };
    let mut lines = Vec::with_capacity(len);
    for h in headers {
        let name = h.name.as_bytes();
        if stops_here(name, strip_authorization) || named(name) {
            continue;
        }
        lines.extend_from_slice(b"\r\n");
        lines.extend_from_slice(name);
        lines.extend_from_slice(b": ");
        lines.extend_from_slice(h.value);
    }
    let target = at(target.as_bytes())..at(target.as_bytes()) + target.len();
    let head = buf.split_to(len).freeze();
    let body = buf.split_to(content_length).freeze();
    Parsed::Whole(Request {
        head,
        body,
        target,
        lines,
        content_type,
        origin,
        close,
    })
}

/// Whether `buf` holds a whole request head (an empty line ends it; an
/// LF alone ends a line, as httparse takes it).
pub fn head_is_whole(buf: &[u8]) -> bool {
    buf.windows(2).any(|w| w == b"\n\n") || buf.windows(3).any(|w| w == b"\n\r\n")
}

/// A plain request's body on its way: the body timeout's clock, started
/// at the end of its head.
struct Coming {
    clock: BodyClock,
    head: usize,
    length: usize,
    origin: bool,
}

/// Reads the next request into `buf` and takes it out when it is plain and
/// whole: its head by `head_by` (else the connection is closed, or, a head
/// whole but not taken, goes to hyper), then its body within the body
/// timeout between reads. Safe to cancel and call again: what was read
/// stays in `buf` (a body's clock starts again).
pub async fn read(
    rules: &Rules<'_>,
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    head_by: Instant,
) -> Read {
    // A long head arriving in small pieces is parsed again only when its
    // end may have come (an empty line in the new bytes) or at the limit,
    // and a body only once it is whole: each piece costs a scan of itself,
    // not a parse of everything so far. A short head is parsed at each read
    // (what is not HTTP is refused at once).
    let mut want = rules.max_header_bytes;
    let mut scanned = 0usize;
    let mut body: Option<Coming> = None;
    // The head's deadline, then the body's (moved on lazily when it fires).
    let timer = tokio::time::sleep_until(head_by);
    tokio::pin!(timer);
    loop {
        let parse = if body.is_some() {
            buf.len() >= want
        } else if buf.len() < REPARSE_BELOW || buf.len() >= want {
            !buf.is_empty()
        } else {
            let from = scanned.saturating_sub(2);
            scanned = buf.len();
            buf[from..].windows(2).any(|w| w == b"\n\n" || w == b"\n\r")
        };
        if parse {
            match take(rules, buf) {
                Parsed::Whole(r) => return Read::Plain(r),
                Parsed::Other => return Read::Other,
                Parsed::TooLarge => return Read::HeadTooLarge,
                Parsed::Need(n) => want = n,
                Parsed::Body {
                    head,
                    length,
                    origin,
                } => {
                    want = head + length;
                    // The head is whole: the body's clock starts now.
                    let clock = BodyClock::start(rules.body_timeout);
                    timer.as_mut().reset(clock.deadline());
                    body = Some(Coming {
                        clock,
                        head,
                        length,
                        origin,
                    });
                }
            }
        }
        let more = tokio::select! {
            biased;
            more = read_more(stream, buf, want) => more,
            () = &mut timer => match &body {
                // Nothing came in time, or part of a head: close, with no
                // answer, as hyper's server does when its header timeout
                // ends. (A whole head not taken: hyper's, to say why.)
                None if !head_is_whole(buf) => return Read::Closed,
                None => return Read::Other,
                Some(b) => match b.clock.check(buf.len() - b.head, Some(b.length)) {
                    Ok(next) => {
                        timer.as_mut().reset(next);
                        continue;
                    }
                    Err(error) => {
                        return Read::BodyTimeout {
                            error,
                            origin: b.origin,
                        };
                    }
                },
            },
        };
        match more {
            Ok(true) => {
                if let Some(b) = &mut body {
                    b.clock.came();
                }
            }
            // Closed: with nothing of a request read, nothing to answer;
            // with part of one, hyper says what is wrong with it.
            Ok(false) | Err(_) if buf.is_empty() => return Read::Closed,
            Ok(false) | Err(_) => return Read::Other,
        }
    }
}

/// Reads what is there (at least one byte) into `buf`, which is to hold
/// `want` bytes in all; `Ok(false)` at EOF.
///
/// Through tokio's `AsyncRead`, not `try_read_buf`: a read that fills less
/// than the room it was given drained the socket, and tokio then forgets
/// the socket's readiness (race-free: only if no new event came since). So
/// the watch for the client hanging up while the engine answers, and the
/// wait for the next request, go straight to `epoll_wait`. With
/// `try_read_buf` the readiness stayed, and every request cost one more
/// read that found nothing (a `MSG_PEEK` right after the request went to
/// the engine; BENCHMARKS.md, run Z).
async fn read_more(stream: &mut TcpStream, buf: &mut BytesMut, want: usize) -> io::Result<bool> {
    if buf.capacity() == buf.len() {
        let more = buf
            .len()
            .max(1024)
            .min(want.saturating_sub(buf.len()).max(1));
        buf.reserve(more);
    }
    Ok(stream.read_buf(buf).await? > 0)
}

#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
