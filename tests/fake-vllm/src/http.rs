//! Small HTTP helpers: bodies, JSON and error responses in vLLM's and FastAPI's shapes.

use std::convert::Infallible;

use bytes::Bytes;
use http::{Response, StatusCode, header};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use serde_json::{Value, json};

/// Response body type.
pub type Body = BoxBody<Bytes, Infallible>;
/// A response.
pub type Resp = Response<Body>;

/// A complete body.
pub fn full(status: StatusCode, content_type: &str, bytes: impl Into<Bytes>) -> Resp {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(Full::new(bytes.into()).boxed())
        .expect("valid response")
}

/// An empty body (vLLM's `Response(status_code=200)`).
pub fn empty(status: StatusCode) -> Resp {
    Response::builder()
        .status(status)
        .body(Empty::new().boxed())
        .expect("valid response")
}

/// A JSON body.
pub fn json(status: StatusCode, v: &Value) -> Resp {
    full(status, "application/json", v.to_string())
}

/// vLLM's `ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`.
pub fn error(status: StatusCode, kind: &str, message: &str, param: Option<&str>) -> Resp {
    json(
        status,
        &json!({"error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": status.as_u16(),
        }}),
    )
}

/// FastAPI's `{"detail": ...}` (404 for unknown routes, HTTPException).
pub fn detail(status: StatusCode, message: &str) -> Resp {
    json(status, &json!({"detail": message}))
}

/// An error answered in vLLM's `ErrorResponse` shape.
#[derive(Debug)]
pub struct ApiError {
    /// HTTP status (also the `code` field).
    pub status: StatusCode,
    /// The `type` field, e.g. `NotFoundError`.
    pub kind: &'static str,
    /// The `message` field.
    pub message: String,
    /// The `param` field.
    pub param: Option<&'static str>,
}

impl ApiError {
    /// A 400 `BadRequestError`.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: message.into(),
            param: None,
        }
    }

    /// The response.
    pub fn resp(&self) -> Resp {
        error(self.status, self.kind, &self.message, self.param)
    }
}

/// Reads the whole request body as JSON; a 400 when it is not.
pub async fn read_json(body: Incoming) -> Result<Value, ApiError> {
    let bytes = body
        .collect()
        .await
        .map_err(|e| ApiError::bad_request(format!("reading body: {e}")))?
        .to_bytes();
    parse_json(&bytes)
}

/// A body as vLLM's server reads it: Python's `json.loads` of the bytes,
/// which takes a UTF-8 byte order mark first (it decodes as `utf-8-sig`).
pub fn parse_json(bytes: &[u8]) -> Result<Value, ApiError> {
    let bytes = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes);
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("JSON decode error: {e}")))
}

/// The query string's pairs, percent-decoded.
pub fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16)
                {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let q = query_pairs(Some(
            "level=2&mode=wait&tags=weights&tags=kv%5Fcache&x=a+b&y=%",
        ));
        assert_eq!(
            q,
            vec![
                ("level".into(), "2".into()),
                ("mode".into(), "wait".into()),
                ("tags".into(), "weights".into()),
                ("tags".into(), "kv_cache".into()),
                ("x".into(), "a b".into()),
                ("y".into(), "%".into()),
            ]
        );
        assert!(query_pairs(None).is_empty());
    }
}
