//! The proxy's own HTTP/1.1 server, for the request nearly every client
//! sends: a POST of a whole body to a `/v1/...` path, on a keep-alive
//! connection. Each such request is read whole ([`request`]), waits in the
//! waiting room if its model is not awake, goes through the usual handler
//! ([`handler::handle_plain`]), and its response is written here
//! ([`response`]); then the next request on the connection.
//!
//! Why not hyper's server for these: at one request at a time hyper's
//! connection machinery (its dispatcher, its parse into a `HeaderMap`, its
//! moves of the request's future between layers) costs as much as the rest
//! of the proxy's work per request (BENCHMARKS.md, runs M, O and S). Here
//! the head is parsed once, in place, and the task runs the request and
//! writes its answer without an intermediate layer.
//!
//! Anything else goes to hyper for the rest of the connection, with the
//! bytes already read put back in front of the stream: HTTP/2, HTTP/1.0,
//! any other method or path, a chunked or `Expect: 100-continue` request, a
//! body over the limit, a request without a valid API key, one that is not
//! valid HTTP. hyper answers those exactly as it always did.
//!
//! What hyper's server and the handler did for these requests, done here
//! the same way: a keep-alive connection waits for its next request for at
//! most the header timeout (`--header-timeout`; then it is closed); the
//! request's head has that deadline too, and its body the body timeout
//! (`--body-timeout`, from its last bytes; then a 408 and the connection
//! closes); a client that closes its connection while
//! its request is with the engine (or held) ends it there; writes have the
//! send timeout; a draining proxy closes idle connections at once, answers
//! a request already begun (with `connection: close`), and gives a new
//! connection [`FIRST_REQUEST_GRACE`] to send its first request; pipelined
//! requests are answered in order.

mod request;
mod response;

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::errors::ApiError;
use crate::handler::{self, Shared, Waited};
use crate::request_model::{find_request_model, refused_media};
use crate::waiting_room;
use request::Read;

/// How long a new connection may take to send its first request once the
/// proxy is draining; it is then served (and closed), or closed if it sent
/// nothing.
pub const FIRST_REQUEST_GRACE: Duration = Duration::from_secs(1);

/// A connection's read buffer is kept between requests (its space is
/// reused once a request's bytes are let go) unless a request was larger.
const KEEP_BUFFER: usize = 4096;

/// The client connection limits the server keeps.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The longest request head.
    pub max_header_bytes: usize,
    /// How long a request's head may take to arrive whole (and an idle
    /// keep-alive connection may wait for its next one).
    pub header_timeout: Duration,
    /// How long a write may wait for the client to take more.
    pub send_timeout: Duration,
}

/// How a connection left this server.
#[derive(Debug)]
pub enum End {
    /// Closed (by either side): nothing more to serve.
    Closed,
    /// To hyper, these bytes (read, not yet served) first.
    Hyper(Bytes),
}

/// Serves `stream`'s plain requests until it closes or sends another kind.
pub async fn serve(
    shared: &Shared,
    stream: &mut TcpStream,
    limits: &Limits,
    stopping: &CancellationToken,
) -> End {
    let mut buf = BytesMut::new();
    let mut first = true;
    loop {
        let req = match next_request(shared, stream, &mut buf, limits, stopping, first).await {
            Read::Plain(r) => r,
            Read::Other => return End::Hyper(buf.freeze()),
            Read::Closed => return End::Closed,
            Read::HeadTooLarge => {
                let error = ApiError::HeadersTooLarge {
                    limit: limits.max_header_bytes,
                };
                // Boxed: its buffer is not carried by every connection.
                Box::pin(refuse(shared, stream, limits, error.into_response())).await;
                return End::Closed;
            }
            Read::BodyTimeout { error, origin } => {
                let mut resp = error.into_response();
                if origin {
                    handler::cors::allow_origin(&mut resp);
                }
                Box::pin(refuse(shared, stream, limits, resp)).await;
                return End::Closed;
            }
        };
        first = false;
        let field = find_request_model(&req.body, req.content_type.clone().map(|r| &req.head[r]));
        // Only a request sent alone waits here: the waiting room watches
        // the connection for the client closing it.
        let mut waited = Waited::default();
        if buf.is_empty()
            && let Ok(f) = &field
            && let Some(route) = waiting_room::asleep(shared, &f.name)
            && refused_media(&route, req.client().target, f).is_none()
        {
            let held = waiting_room::hold(shared, stream, route).await;
            if held.closed {
                return End::Closed;
            }
            waited = Waited {
                since: held.since,
                gate: held.gate,
            };
        }
        let alone = buf.is_empty();
        let resp = {
            let client = req.client();
            // Boxed: a connection waiting for its next request (or held)
            // keeps no handler state.
            let mut handling = Box::pin(handler::handle_plain(
                shared, &client, req.origin, &req.body, field, waited,
            ));
            if alone {
                tokio::select! {
                    biased;
                    r = &mut handling => r,
                    // The client is gone: its request is dropped here (and
                    // at its engine, whose connection closes).
                    () = response::hung_up(stream) => return End::Closed,
                }
            } else {
                handling.await
            }
        };
        let large = req.head.len() + req.body.len() > KEEP_BUFFER;
        let close = req.close;
        drop(req);
        let keep_alive = !close && !stopping.is_cancelled();
        if !response::write(stream, resp, keep_alive, limits.send_timeout, alone).await {
            return End::Closed;
        }
        if large && buf.is_empty() {
            // The buffer grew for a large request: an idle connection
            // keeps no more than a small one.
            buf = BytesMut::new();
        }
    }
}

/// Answers a request not read whole (a head over `--max-header-bytes`: an
/// OpenAI-shaped 431; a body that stalled: 408) and closes: the rest of the
/// request is read and dropped for at most [`LINGER`] first, as closing
/// with unread bytes would reset the connection and could take the answer
/// with it.
async fn refuse(
    shared: &Shared,
    stream: &mut TcpStream,
    limits: &Limits,
    resp: http::Response<crate::body::ProxyBody>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    shared
        .metrics
        .request(&crate::metrics::no_model(), resp.status());
    // (It says the connection may carry no more: that is known.)
    let _ = response::write(stream, resp, false, limits.send_timeout, false).await;
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 8192];
    let _ = tokio::time::timeout(LINGER, async {
        while let Ok(1..) = stream.read(&mut sink).await {}
    })
    .await;
}

/// How long a refused connection's unread bytes are read and dropped
/// before it is closed.
const LINGER: Duration = Duration::from_secs(1);

/// The next request: its head within the header timeout, its body within
/// the body timeout between reads; once the proxy drains, an idle
/// connection closes, and a new one (or one with part of a request read)
/// has [`FIRST_REQUEST_GRACE`] to send it whole.
async fn next_request(
    shared: &Shared,
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    limits: &Limits,
    stopping: &CancellationToken,
    first: bool,
) -> Read {
    let draining = stopping.is_cancelled();
    if draining && !first && buf.is_empty() {
        return Read::Closed;
    }
    let rules = request::Rules::of(shared, limits.max_header_bytes);
    if !draining {
        {
            let head_by = Instant::now() + limits.header_timeout;
            let reading = request::read(&rules, stream, buf, head_by);
            tokio::pin!(reading);
            tokio::select! {
                r = &mut reading => return r,
                () = stopping.cancelled() => {}
            }
        }
        // The drain began while this connection waited.
        if !first && buf.is_empty() {
            return Read::Closed;
        }
    }
    let grace = FIRST_REQUEST_GRACE.min(limits.header_timeout);
    match tokio::time::timeout(
        grace,
        request::read(&rules, stream, buf, Instant::now() + grace),
    )
    .await
    {
        Ok(read) => read,
        // Not whole within the grace: part of a head is closed with no
        // answer, as the header timeout does; a whole head whose body is
        // still on its way goes to hyper, which reads it under its own
        // rules (and closes the connection after its answer).
        Err(_) if !request::head_is_whole(buf) => Read::Closed,
        Err(_) => Read::Other,
    }
}
