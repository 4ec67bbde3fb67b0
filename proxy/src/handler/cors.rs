//! Browsers' CORS, answered as vLLM's server answers it by default
//! (Starlette's `CORSMiddleware` with `--allowed-origins '["*"]'`,
//! `--allowed-methods`, `--allowed-headers` `["*"]`, no credentials): a page
//! that may call vLLM may call the proxy. Requests that reach an engine get
//! the engine's own CORS headers (the `Origin` header goes to it); the
//! proxy adds them only to what it answers itself.

use bytes::Bytes;
use http::header::{
    ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN,
    ACCESS_CONTROL_MAX_AGE, ACCESS_CONTROL_REQUEST_HEADERS, ACCESS_CONTROL_REQUEST_METHOD,
    CONTENT_TYPE, ORIGIN,
};
use http::{HeaderMap, HeaderValue, Response};

use crate::body::ProxyBody;

/// The answer to a preflight (`OPTIONS` with an `Origin` and an
/// `Access-Control-Request-Method`); `None` for any other request. No API
/// key is asked: a browser never sends one with a preflight.
pub fn preflight(headers: &HeaderMap) -> Option<Response<ProxyBody>> {
    if !headers.contains_key(ORIGIN) || !headers.contains_key(ACCESS_CONTROL_REQUEST_METHOD) {
        return None;
    }
    let mut r = Response::new(ProxyBody::full(Bytes::from_static(b"OK")));
    let h = r.headers_mut();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    h.insert(ACCESS_CONTROL_ALLOW_ORIGIN, HeaderValue::from_static("*"));
    h.insert(
        ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"),
    );
    h.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    if let Some(asked) = headers.get(ACCESS_CONTROL_REQUEST_HEADERS) {
        h.insert(ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
    }
    Some(r)
}

/// Lets the page that sent a request read the proxy's own answer to it.
/// The proxy's own have a body not yet sent; an engine's is `Upstream`, or,
/// when it was empty, already over (`Full(None)`).
pub fn allow_origin(resp: &mut Response<ProxyBody>) {
    if matches!(resp.body(), ProxyBody::Full(Some(_))) {
        resp.headers_mut()
            .insert(ACCESS_CONTROL_ALLOW_ORIGIN, HeaderValue::from_static("*"));
    }
}
