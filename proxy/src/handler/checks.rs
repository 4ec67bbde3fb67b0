//! Checks before routing: which paths may reach an engine, the API key, and
//! reading the body within its size and time limits.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Request, header};
use hyper::body::Body;
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::errors::ApiError;
use crate::handler::Shared;

/// A `/v1/...` path an engine cannot resolve to anything else: no empty, `.`
/// or `..` segments and no escapes, so `/v1/../sleep` never reaches `/sleep`.
pub fn forwardable_path(path: &str) -> bool {
    let Some(rest) = path.strip_prefix("/v1/") else {
        return false;
    };
    !rest.is_empty()
        && rest.split('/').all(|seg| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
        })
}

pub fn authorized(shared: &Shared, req: &Request<Incoming>) -> bool {
    key_ok(
        shared,
        req.headers()
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes()),
    )
}

/// The Authorization header's value carries a valid API key (or none is
/// needed).
pub fn key_ok(shared: &Shared, authorization: Option<&[u8]>) -> bool {
    key_among(&shared.api_keys, authorization)
}

/// The Authorization header's value carries one of `keys` (or `keys` is
/// empty).
pub fn key_among(keys: &[Vec<u8>], authorization: Option<&[u8]>) -> bool {
    if keys.is_empty() {
        return true;
    }
    let Some(v) = authorization else {
        return false;
    };
    if v.len() < 7 || !v[..7].eq_ignore_ascii_case(b"bearer ") {
        return false;
    }
    let key = v[7..].trim_ascii();
    // Compare against every key without stopping early.
    keys.iter()
        .fold(false, |ok, k| ok | constant_time_eq(k, key))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A body that has taken longer than the body timeout must have averaged
/// at least this many bytes a second since it began (checked when the
/// timeout's timer comes round): the body timeout is between reads, so a
/// client trickling a byte every few seconds would otherwise hold its
/// connection for as long as `--max-body` bytes take at that pace (years).
/// 1 KiB/s is far below any real uplink (a 20 MB body at 1 KiB/s: 5.7 h).
pub const MIN_BODY_RATE: u64 = 1024;

/// Reads the request body within `--max-body`; `--body-timeout` is the
/// longest wait for more of it (nginx's `client_body_timeout`: between
/// reads, not a deadline on the whole body), and a body slower than
/// [`MIN_BODY_RATE`] on average is cut once it has taken longer than that.
///
/// Cost over one deadline for the whole body: none while the body's
/// frames are ready when polled (a small body comes with its head); a
/// clock read per frame that arrived after a wait. The one timer is armed
/// only while the body waits, and moved on lazily when it fires (never
/// re-armed per frame).
pub async fn read_body(
    shared: &Shared,
    body: Incoming,
    content_length: Option<usize>,
) -> Result<Bytes, ApiError> {
    let limit = shared.max_body_bytes;
    if content_length.is_some_and(|n| n > limit) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    let mut body = body;
    let mut clock = BodyClock::start(shared.body_timeout);
    let mut waited = false;
    let stall = tokio::time::sleep_until(clock.deadline());
    tokio::pin!(stall);
    let mut first: Option<Bytes> = None;
    let mut buf: Option<BytesMut> = None;
    let mut total = 0usize;
    loop {
        let next = std::future::poll_fn(|cx| {
            if let Poll::Ready(frame) = Pin::new(&mut body).poll_frame(cx) {
                if std::mem::take(&mut waited) {
                    clock.came();
                }
                return Poll::Ready(Ok(frame));
            }
            waited = true;
            while stall.as_mut().poll(cx).is_ready() {
                let next = clock.check(total, content_length)?;
                stall.as_mut().reset(next);
            }
            Poll::Pending
        })
        .await?;
        let Some(frame) = next else { break };
        let frame = frame.map_err(|e| ApiError::BodyRead(e.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len();
        if total > limit {
            return Err(ApiError::BodyTooLarge { limit });
        }
        match (&mut first, &mut buf) {
            (_, Some(b)) => b.extend_from_slice(&data),
            (None, None) => first = Some(data),
            (Some(f), None) => {
                let cap = content_length.unwrap_or(0).max(f.len() + data.len());
                let mut b = BytesMut::with_capacity(cap);
                b.extend_from_slice(f);
                b.extend_from_slice(&data);
                buf = Some(b);
            }
        }
    }
    Ok(match buf {
        Some(b) => b.freeze(),
        None => first.unwrap_or_default(),
    })
}

/// The body timeout's clock for one request body: how long it has stalled
/// (since its last bytes came, or since it began) and how fast it has come
/// on average. Shared by hyper's requests ([`read_body`]) and the proxy's
/// own HTTP/1.1 server, which starts it at the end of the request's head.
#[derive(Debug, Clone, Copy)]
pub struct BodyClock {
    timeout: Duration,
    started: Instant,
    /// When the body's last bytes came (its start, before any did).
    last: Instant,
}

impl BodyClock {
    /// The body begins now (`--body-timeout` is `timeout`).
    pub fn start(timeout: Duration) -> Self {
        let now = Instant::now();
        BodyClock {
            timeout,
            started: now,
            last: now,
        }
    }

    /// More of the body came now.
    pub fn came(&mut self) {
        self.last = Instant::now();
    }

    /// When the body will have stalled for the timeout, unless more comes.
    pub fn deadline(&self) -> Instant {
        self.last + self.timeout
    }

    /// The timer set for [`deadline`](Self::deadline) (or an earlier one)
    /// fired, with `total` bytes of the body read: the error (408) when it
    /// stalled for the timeout or has come too slowly, else when to look
    /// again.
    pub fn check(&self, total: usize, content_length: Option<usize>) -> Result<Instant, ApiError> {
        let now = Instant::now();
        if now >= self.deadline() {
            return Err(body_stalled(self.timeout, total, content_length));
        }
        let elapsed = now - self.started;
        let floor = elapsed.as_millis() as u64 * MIN_BODY_RATE / 1000;
        if (total as u64) < floor {
            return Err(body_too_slow(self.timeout, total, elapsed));
        }
        Ok(self.deadline())
    }
}

fn body_stalled(timeout: Duration, total: usize, content_length: Option<usize>) -> ApiError {
    let of = content_length.map_or(String::new(), |n| format!(" of {n}"));
    ApiError::BodyTimeout(format!(
        "request body not received in time: nothing more of it came for {} ms (the proxy's \
         --body-timeout, between reads) after {total}{of} bytes",
        timeout.as_millis()
    ))
}

fn body_too_slow(timeout: Duration, total: usize, elapsed: Duration) -> ApiError {
    ApiError::BodyTimeout(format!(
        "request body not received in time: {total} bytes in {} ms, below the minimum of \
         {MIN_BODY_RATE} bytes/s on average that a body taking longer than {} ms (the proxy's \
         --body-timeout) must keep",
        elapsed.as_millis(),
        timeout.as_millis()
    ))
}

#[cfg(test)]
mod tests {
    use super::forwardable_path;

    #[test]
    fn only_plain_v1_paths_are_forwarded() {
        for ok in [
            "/v1/chat/completions",
            "/v1/embeddings",
            "/v1/audio/transcriptions",
            "/v1/a.b",
        ] {
            assert!(forwardable_path(ok), "{ok}");
        }
        for bad in [
            "/v1/",
            "/v1",
            "/sleep",
            "/v1/../sleep",
            "/v1/./x",
            "/v1//x",
            "/v1/%2e%2e/sleep",
            "/v1/x/",
            "/v1/x\\..",
            "/wake_up",
            "/v2/chat",
        ] {
            assert!(!forwardable_path(bad), "{bad}");
        }
    }
}
