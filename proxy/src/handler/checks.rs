//! Checks before routing: which paths may reach an engine, the API key, and
//! reading the body within its size and time limits.

use bytes::{Bytes, BytesMut};
use http::{Request, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;

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
    if shared.api_keys.is_empty() {
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
    shared
        .api_keys
        .iter()
        .fold(false, |ok, k| ok | constant_time_eq(k, key))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub async fn read_body(
    shared: &Shared,
    body: Incoming,
    content_length: Option<usize>,
) -> Result<Bytes, ApiError> {
    let limit = shared.max_body_bytes;
    if content_length.is_some_and(|n| n > limit) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    let read = async {
        let mut body = body;
        let mut first: Option<Bytes> = None;
        let mut buf: Option<BytesMut> = None;
        let mut total = 0usize;
        while let Some(frame) = body.frame().await {
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
    };
    tokio::time::timeout(shared.body_timeout, read)
        .await
        .map_err(|_| ApiError::BodyTimeout)?
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
