//! The HTTP/1.1 client side of the proxy's upstream connections, as bytes
//! in and bytes out (the I/O is in `conn.rs`): the request head written
//! straight into the connection's buffer from the client's request, the
//! response head parsed in place (`httparse`; header values are slices of
//! the bytes read, not copies), and the body's framing decoded
//! (`Content-Length`, chunked, or until the engine closes).
//!
//! Hop-by-hop headers stop here in both directions (RFC 9110 §7.6.1):
//! `Connection`, the headers it names, `Keep-Alive`, `Proxy-*`, `TE`,
//! `Trailer`, `Transfer-Encoding` and `Upgrade`. So do `Host` and
//! `Content-Length` (the engine's and the body's own are written) and
//! `Expect` (the body is already whole; the client got its 100 Continue).

use std::io::Write;
use std::mem::MaybeUninit;

use arrayvec::ArrayVec;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, response};

/// The longest response head (and chunk trailer section) taken from an
/// engine: hyper's default buffer limit, as before the proxy had its own.
pub const MAX_HEAD: usize = 8192 + 4096 * 100;
/// Headers in one response head.
const MAX_HEADERS: usize = 100;
/// The longest chunk-size line (size, extensions).
const MAX_CHUNK_LINE: usize = 4096;

/// Why an exchange with an engine failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The engine closed the connection before a whole response head.
    #[error("connection closed before message completed")]
    ClosedBeforeHead,
    /// The engine closed the connection before the body's end.
    #[error("connection closed before the end of the response body")]
    ClosedInBody,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The engine sent what is not HTTP/1.1 (or beyond its limits).
    #[error("invalid response from the engine: {0}")]
    Invalid(String),
    /// The engine sent nothing on the request for this long
    /// (`--upstream-timeout`): it is hung, or slower than that allows.
    #[error(
        "the engine sent nothing for {} (--upstream-timeout); the request was ended",
        humantime::format_duration(*.0)
    )]
    Quiet(std::time::Duration),
}

impl UpstreamError {
    /// The connection was closed or reset before any answer came: an engine
    /// closing an idle connection as the request went out.
    pub fn closed_before_answer(&self) -> bool {
        match self {
            UpstreamError::ClosedBeforeHead => true,
            UpstreamError::Io(e) => matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            ),
            _ => false,
        }
    }
}

impl UpstreamError {
    /// The engine reset the connection (or it was reset as the request
    /// went out) with no byte of answer: a socket closed with data in it
    /// unread is reset, one whose data was all read is closed (FIN). So the
    /// engine never read the whole request: one going away (a crash, with
    /// its listening socket accepting into the backlog as the process
    /// dies) that can be routed again like a refused connection. This holds
    /// for an engine reached directly over TCP, as siesta's are (on their
    /// `host`); a TCP proxy or sidecar in between may reset a connection
    /// after it forwarded the whole request.
    pub fn reset_unread(&self) -> bool {
        matches!(self, UpstreamError::Io(e) if matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ))
    }
}

fn invalid(what: impl Into<String>) -> UpstreamError {
    UpstreamError::Invalid(what.into())
}

/// Hop-by-hop by name, in any case (those the `Connection` header names
/// aside).
fn hop_by_hop(name: &[u8]) -> bool {
    const NAMES: [&[u8]; 9] = [
        b"connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"keep-alive",
        b"proxy-connection",
    ];
    NAMES.iter().any(|n| n.eq_ignore_ascii_case(name))
}

/// Whether `name` is one of the comma-separated tokens of `connection`.
pub fn named_in(connection: &[u8], name: &[u8]) -> bool {
    connection
        .split(|b| *b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(name))
}

/// What the request to the engine carries besides the client's headers.
#[derive(Debug, Clone, Copy)]
pub struct RequestHead<'a> {
    pub method: &'a Method,
    /// Origin form: path and query.
    pub target: &'a str,
    /// The engine's `host[:port]`.
    pub host: &'a [u8],
    pub content_length: usize,
    /// Leave the client's `Authorization` out (it is the proxy's key).
    pub strip_authorization: bool,
}

/// The client's headers, to pass on to the engine.
#[derive(Debug, Clone, Copy)]
pub enum ClientHeaders<'a> {
    /// As hyper parsed them; those that stop at the proxy are left out
    /// when the request head is written.
    Map(&'a HeaderMap),
    /// Already filtered ([`stops_here`], `Connection`-named ones too) and
    /// written as lines, each beginning with CRLF: the proxy's own server.
    Lines(&'a [u8]),
}

/// A client header that is not passed on to the engine (`name` in any
/// case): hop-by-hop by name, `Host` and `Content-Length` (the engine's
/// and the body's own are written), `Expect` (the body is already whole),
/// and `Authorization` when it carries the proxy's key. Those the
/// `Connection` header names are left out too (see [`named_in`]).
pub fn stops_here(name: &[u8], strip_authorization: bool) -> bool {
    hop_by_hop(name)
        || name.eq_ignore_ascii_case(b"host")
        || name.eq_ignore_ascii_case(b"content-length")
        || name.eq_ignore_ascii_case(b"expect")
        || (strip_authorization && name.eq_ignore_ascii_case(b"authorization"))
}

/// Writes the request head for `headers` (the client's) into `out`.
pub fn encode_request(out: &mut Vec<u8>, head: &RequestHead<'_>, headers: ClientHeaders<'_>) {
    out.extend_from_slice(head.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(head.target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(head.host);
    match headers {
        ClientHeaders::Lines(lines) => out.extend_from_slice(lines),
        ClientHeaders::Map(headers) => {
            let connection = headers.get_all(header::CONNECTION);
            let named = |name: &HeaderName| {
                connection
                    .iter()
                    .any(|c| named_in(c.as_bytes(), name.as_str().as_bytes()))
            };
            for (name, value) in headers {
                if stops_here(name.as_str().as_bytes(), head.strip_authorization) || named(name) {
                    continue;
                }
                out.extend_from_slice(b"\r\n");
                out.extend_from_slice(name.as_str().as_bytes());
                out.extend_from_slice(b": ");
                out.extend_from_slice(value.as_bytes());
            }
        }
    }
    // Writing to a Vec cannot fail.
    let _ = write!(out, "\r\ncontent-length: {}\r\n\r\n", head.content_length);
}

/// How the response body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    Empty,
    Length(u64),
    Chunked,
    /// Until the engine closes the connection (no length, not chunked).
    UntilClose,
}

/// A parsed response head.
#[derive(Debug)]
pub struct ResponseHead {
    /// Status and end-to-end headers (hop-by-hop ones removed); the headers
    /// are left empty when they were asked for as a [`RawHead`].
    pub parts: response::Parts,
    pub body: BodyKind,
    /// The connection may carry another request after this response.
    pub keep_alive: bool,
    /// A server-sent event stream (`Content-Type: text/event-stream`).
    pub sse: bool,
}

/// A response's end-to-end headers as the proxy's own HTTP/1.1 server
/// writes them: the engine's lines, filtered as for a `HeaderMap`, each
/// `name: value` and CRLF. Kept with the upstream connection and reused.
#[derive(Debug, Default)]
pub struct RawHead {
    pub lines: Vec<u8>,
    /// A `Content-Length` line is among them (the body is sized).
    pub has_length: bool,
    /// A `Date` line is among them.
    pub has_date: bool,
}

impl RawHead {
    /// The lines as a `HeaderMap` (for a body that ended before it was
    /// relayed, whose lines are not kept with it).
    pub fn to_map(&self) -> HeaderMap {
        let mut map = HeaderMap::new();
        for line in self.lines.split(|b| *b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(colon) = line.iter().position(|b| *b == b':') else {
                continue;
            };
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(&line[..colon]),
                HeaderValue::from_bytes(line[colon + 1..].trim_ascii()),
            ) {
                map.append(name, value);
            }
        }
        map
    }
}

/// One header's name and value as offsets into the head's bytes.
#[derive(Debug, Clone, Copy)]
struct Span {
    name: (usize, usize),
    value: (usize, usize),
    /// A `Connection` header.
    connection: bool,
}

impl Span {
    fn value<'h>(&self, head: &'h [u8]) -> &'h [u8] {
        &head[self.value.0..self.value.0 + self.value.1]
    }
}

/// A `Content-Length` value: digits, or a list of equal ones ("5, 5").
fn content_length(value: &[u8]) -> Option<u64> {
    let mut found = None;
    for part in value.split(|b| *b == b',') {
        let part = part.trim_ascii();
        if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let n = std::str::from_utf8(part).ok()?.parse::<u64>().ok()?;
        if found.is_some_and(|f| f != n) {
            return None;
        }
        found = Some(n);
    }
    found
}

/// Parses the response head at the start of `buf` and takes its bytes out
/// (interim 1xx responses are skipped); `None` until the head is whole.
/// `method` is the request's (a `HEAD` response has no body). With `keep_raw`,
/// the end-to-end headers are written there instead of into a `HeaderMap`.
pub fn parse_response(
    buf: &mut BytesMut,
    method: &Method,
    mut keep_raw: Option<&mut RawHead>,
) -> Result<Option<ResponseHead>, UpstreamError> {
    loop {
        // Neither array is initialised up front: zeroing room for 100
        // headers (7 KB) cost more than the parse of a usual head (run O).
        let mut raw = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut []);
        let n = match httparse::ParserConfig::default()
            .parse_response_with_uninit_headers(&mut resp, buf, &mut raw)
        {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
                return Err(invalid(format!(
                    "response head longer than {MAX_HEAD} bytes"
                )));
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => return Err(invalid(format!("response head: {e}"))),
        };
        let code = resp.code.unwrap_or_default();
        let status =
            StatusCode::from_u16(code).map_err(|_| invalid(format!("status code {code}")))?;
        if status.is_informational() {
            if status == StatusCode::SWITCHING_PROTOCOLS {
                return Err(invalid(
                    "101 Switching Protocols to a request without Upgrade",
                ));
            }
            buf.advance(n);
            continue;
        }
        let http10 = resp.version == Some(0);
        let base = buf.as_ptr() as usize;
        let at = |s: &[u8]| (s.as_ptr() as usize - base, s.len());
        let mut spans = ArrayVec::<Span, MAX_HEADERS>::new();
        let mut length: Option<u64> = None;
        let mut chunked = None;
        for h in resp.headers.iter() {
            let name = h.name.as_bytes();
            if name.eq_ignore_ascii_case(b"content-length") {
                let v = content_length(h.value)
                    .ok_or_else(|| invalid("content-length is not a number"))?;
                if length.is_some_and(|l| l != v) {
                    return Err(invalid("two different content-lengths"));
                }
                length = Some(v);
            } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
                // The last coding decides: chunked, or read until close.
                let last = h.value.rsplit(|b| *b == b',').next().unwrap_or_default();
                chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            }
            // httparse stops at MAX_HEADERS: `raw` has no room for more.
            spans.push(Span {
                name: at(name),
                value: at(h.value),
                connection: name.eq_ignore_ascii_case(b"connection"),
            });
        }
        let head = buf.split_to(n).freeze();
        let spans = &spans[..];
        // Every Connection line counts (a list may be split over several).
        let any_connection = spans.iter().any(|s| s.connection);
        let named = |token: &[u8]| {
            any_connection
                && spans
                    .iter()
                    .any(|s| s.connection && named_in(s.value(&head), token))
        };
        let keep_alive = if http10 {
            // RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding
            // closes after it.
            named(b"keep-alive") && chunked.is_none()
        } else {
            // §6.3: with both Transfer-Encoding and Content-Length, close.
            let both_framings = chunked.is_some() && length.is_some();
            !(named(b"close") || both_framings)
        };
        let body = if *method == Method::HEAD
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
        {
            BodyKind::Empty
        } else {
            match (chunked, length) {
                (Some(true), _) => BodyKind::Chunked,
                (Some(false), _) | (None, None) => BodyKind::UntilClose,
                (None, Some(0)) => BodyKind::Empty,
                (None, Some(l)) => BodyKind::Length(l),
            }
        };
        // With chunked framing any length is wrong (RFC 9112 §6.3), and a
        // 1xx or 204 has none (RFC 9110 §8.6; hyper's server dropped it).
        let no_length =
            chunked.is_some() || status.is_informational() || status == StatusCode::NO_CONTENT;
        let passed = |name: &[u8]| {
            !(hop_by_hop(name)
                || named(name)
                || (no_length && name.eq_ignore_ascii_case(b"content-length")))
        };
        let mut sse = false;
        let mut parts = response::Response::new(()).into_parts().0;
        parts.status = status;
        if let Some(raw) = keep_raw.as_deref_mut() {
            // httparse checked the names (tokens) and values (no control
            // bytes) as `HeaderName` and `HeaderValue` would.
            raw.lines.clear();
            raw.has_length = false;
            raw.has_date = false;
            for s in spans {
                let name = &head[s.name.0..s.name.0 + s.name.1];
                let value = &head[s.value.0..s.value.0 + s.value.1];
                let length = name.eq_ignore_ascii_case(b"content-length");
                // One length line (equal ones were checked above).
                if !passed(name) || (length && raw.has_length) {
                    continue;
                }
                raw.has_length |= length;
                raw.has_date |= name.eq_ignore_ascii_case(b"date");
                sse |= name.eq_ignore_ascii_case(b"content-type") && is_sse(value);
                raw.lines.extend_from_slice(name);
                raw.lines.extend_from_slice(b": ");
                raw.lines.extend_from_slice(value);
                raw.lines.extend_from_slice(b"\r\n");
            }
        } else {
            let mut headers = HeaderMap::with_capacity(spans.len());
            for s in spans {
                let name = HeaderName::from_bytes(&head[s.name.0..s.name.0 + s.name.1])
                    .map_err(|_| invalid("a header name"))?;
                if !passed(name.as_str().as_bytes()) {
                    continue;
                }
                let value =
                    HeaderValue::from_maybe_shared(head.slice(s.value.0..s.value.0 + s.value.1))
                        .map_err(|_| invalid(format!("the value of {name}")))?;
                sse |= name == header::CONTENT_TYPE && is_sse(value.as_bytes());
                headers.append(name, value);
            }
            parts.headers = headers;
        }
        return Ok(Some(ResponseHead {
            parts,
            body,
            keep_alive: keep_alive && body != BodyKind::UntilClose,
            sse,
        }));
    }
}

/// A `Content-Type` of server-sent events.
fn is_sse(value: &[u8]) -> bool {
    value.len() >= 17 && value[..17].eq_ignore_ascii_case(b"text/event-stream")
}

/// What the decoder took out of the buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    Data(Bytes),
    /// More bytes are needed from the engine.
    NeedMore,
    /// The body has ended.
    Done,
}

/// The body decoder of one response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoder {
    Length(u64),
    ChunkSize,
    ChunkData(u64),
    /// The CRLF after a chunk's data.
    ChunkEnd,
    /// After the last chunk: trailer lines until an empty one (dropped).
    Trailers(usize),
    UntilClose,
    Done,
}

impl Decoder {
    pub fn new(kind: BodyKind) -> Decoder {
        match kind {
            BodyKind::Empty | BodyKind::Length(0) => Decoder::Done,
            BodyKind::Length(n) => Decoder::Length(n),
            BodyKind::Chunked => Decoder::ChunkSize,
            BodyKind::UntilClose => Decoder::UntilClose,
        }
    }

    pub fn is_done(&self) -> bool {
        *self == Decoder::Done
    }

    /// Bytes of body still to come, when known.
    pub fn remaining(&self) -> Option<u64> {
        match self {
            Decoder::Length(n) => Some(*n),
            Decoder::Done => Some(0),
            _ => None,
        }
    }

    /// Takes the next piece of body data out of `buf` (one chunk's data,
    /// or what of it has arrived).
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, UpstreamError> {
        loop {
            match *self {
                Decoder::Done => return Ok(Decoded::Done),
                Decoder::Length(n) | Decoder::ChunkData(n) => {
                    if buf.is_empty() {
                        return Ok(Decoded::NeedMore);
                    }
                    let take = (buf.len() as u64).min(n);
                    let left = n - take;
                    *self = match (*self, left) {
                        (Decoder::Length(_), 0) => Decoder::Done,
                        (Decoder::Length(_), _) => Decoder::Length(left),
                        (_, 0) => Decoder::ChunkEnd,
                        _ => Decoder::ChunkData(left),
                    };
                    return Ok(Decoded::Data(buf.split_to(take as usize).freeze()));
                }
                Decoder::UntilClose => {
                    if buf.is_empty() {
                        return Ok(Decoded::NeedMore);
                    }
                    return Ok(Decoded::Data(buf.split().freeze()));
                }
                // httparse takes a line without digits for a size of 0.
                Decoder::ChunkSize if buf.first().is_some_and(|b| !b.is_ascii_hexdigit()) => {
                    return Err(invalid("invalid chunk size"));
                }
                Decoder::ChunkSize => match httparse::parse_chunk_size(buf) {
                    Ok(httparse::Status::Complete((used, 0))) => {
                        buf.advance(used);
                        *self = Decoder::Trailers(0);
                    }
                    Ok(httparse::Status::Complete((used, size))) => {
                        buf.advance(used);
                        *self = Decoder::ChunkData(size);
                    }
                    Ok(httparse::Status::Partial) if buf.len() > MAX_CHUNK_LINE => {
                        return Err(invalid("chunk size line too long"));
                    }
                    Ok(httparse::Status::Partial) => return Ok(Decoded::NeedMore),
                    Err(_) => return Err(invalid("invalid chunk size")),
                },
                Decoder::ChunkEnd => {
                    if buf.len() < 2 {
                        return Ok(Decoded::NeedMore);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(invalid("chunk data longer than its size"));
                    }
                    buf.advance(2);
                    *self = Decoder::ChunkSize;
                }
                Decoder::Trailers(seen) => {
                    let Some(end) = buf.windows(2).position(|w| w == b"\r\n") else {
                        if seen + buf.len() > MAX_HEAD {
                            return Err(invalid("trailers too long"));
                        }
                        return Ok(Decoded::NeedMore);
                    };
                    buf.advance(end + 2);
                    *self = if end == 0 {
                        Decoder::Done
                    } else {
                        Decoder::Trailers(seen + end + 2)
                    };
                }
            }
        }
    }

    /// The engine closed the connection: the end of an until-close body,
    /// an error for any other unfinished one.
    pub fn eof(&mut self) -> Result<(), UpstreamError> {
        match self {
            Decoder::UntilClose | Decoder::Done => {
                *self = Decoder::Done;
                Ok(())
            }
            _ => Err(UpstreamError::ClosedInBody),
        }
    }
}

#[cfg(test)]
mod tests;
