//! The web listener (`[control] web_listen`): the status page (assets
//! embedded in the binary), the Watch stream as server-sent events
//! (`/events`), JSON reads and model operations (`/api/...`), and the
//! control plane's Prometheus metrics (`/metrics`). With a token configured
//! every path but the script and style sheet requires it, as
//! `Authorization: Bearer TOKEN` or `?token=TOKEN` (browsers' `EventSource`
//! cannot send headers).

mod actions;
mod metrics;
mod sse;
pub mod track;
pub mod view;

use crate::api::ControlService;
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, Response, StatusCode};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use track::Tracker;

/// A response body: whole or streamed.
pub type Body = BoxBody<Bytes, Infallible>;

const INDEX_HTML: &str = include_str!("web/assets/index.html");
const APP_JS: &str = include_str!("web/assets/app.js");
const STYLE_CSS: &str = include_str!("web/assets/style.css");

/// What the handlers share.
#[derive(Debug)]
pub struct Web {
    service: ControlService,
    tracker: Arc<Tracker>,
    token: Option<String>,
}

/// Binds the web listener; a non-loopback address without a token is
/// refused, as for gRPC.
pub async fn bind(addr: SocketAddr, token: Option<&str>) -> Result<TcpListener, crate::Error> {
    if crate::config::needs_token(addr, token) {
        return Err(crate::Error::TokenRequired(addr));
    }
    TcpListener::bind(addr)
        .await
        .map_err(|error| crate::Error::Bind {
            addr,
            key: "[control] web_listen",
            error,
        })
}

/// Serves the web listener in the background until `cancel`.
pub fn spawn(
    listener: TcpListener,
    service: ControlService,
    token: Option<String>,
    cancel: CancellationToken,
) {
    let tracker = Tracker::new();
    tokio::spawn(
        tracker
            .clone()
            .run(service.hub.clone(), cancel.child_token()),
    );
    let web = Arc::new(Web {
        service,
        tracker,
        token,
    });
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "web status page, /events and /metrics listening");
    }
    tokio::spawn(accept(listener, web, cancel));
}

/// How long a request's head may take to arrive, and a keep-alive
/// connection may sit idle between requests: a client that connects and
/// sends nothing (before its token is checked) holds no task and file for
/// ever. An `/events` stream is a response, not timed by this.
pub const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

async fn accept(listener: TcpListener, web: Arc<Web>, cancel: CancellationToken) {
    loop {
        let (stream, peer) = tokio::select! {
            _ = cancel.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "web listener: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let web = web.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let web = web.clone();
                let cancel = cancel.clone();
                async move { Ok::<_, Infallible>(handle(&web, req, cancel).await) }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(io, svc)
                .await
            {
                tracing::debug!(%peer, error = %e, "web connection ended");
            }
        });
    }
}

async fn handle(
    web: &Web,
    req: Request<hyper::body::Incoming>,
    cancel: CancellationToken,
) -> Response<Body> {
    // The script and style sheet hold no data: a page opened with its
    // token loads them without one.
    let public = matches!(req.uri().path(), "/app.js" | "/style.css");
    if !public && !authorized(web.token.as_deref(), &req) {
        tracing::info!(path = %req.uri().path(), "web: request without the right token refused");
        return error(StatusCode::UNAUTHORIZED, TOKEN_REFUSED);
    }
    if let Err(why) = same_origin(web.token.is_some(), &req) {
        tracing::info!(path = %req.uri().path(), why, "web: cross-origin request refused");
        return error(StatusCode::FORBIDDEN, &why);
    }
    let path = req.uri().path().to_string();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/") => asset(INDEX_HTML, "text/html; charset=utf-8"),
        (&Method::GET, "/app.js") => asset(APP_JS, "text/javascript; charset=utf-8"),
        (&Method::GET, "/style.css") => asset(STYLE_CSS, "text/css; charset=utf-8"),
        (&Method::GET, "/metrics") => {
            let (hub, gpus, tracker, admission) = (
                web.service.hub.clone(),
                web.service.gpus.clone(),
                web.tracker.clone(),
                web.service.models.admission().clone(),
            );
            let encode = move || metrics::encode(&hub, &gpus, &tracker, admission.metrics());
            match tokio::task::spawn_blocking(encode).await {
                Ok(text) => text_response(
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    text,
                ),
                Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &format!("metrics: {e}")),
            }
        }
        (&Method::GET, "/events") => sse::events(web, &req, cancel),
        (&Method::GET, "/api/history") => json(
            StatusCode::OK,
            &web.tracker.history(web.service.clock.now_ms()),
        ),
        (_, p) if p.starts_with("/api/") => actions::handle(web, req).await,
        (_, p) => error(StatusCode::NOT_FOUND, &format!("no such page: {p}")),
    }
}

const TOKEN_REFUSED: &str = "missing or wrong token: open the page as /?token=TOKEN, or send `Authorization: Bearer TOKEN` (the control plane's [control] token or SIESTA_TOKEN)";

/// With a token, every request must carry it (header or `?token=`).
fn authorized<B>(token: Option<&str>, req: &Request<B>) -> bool {
    let Some(token) = token else { return true };
    let header = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        });
    let query = query_param(req.uri(), "token");
    let given = header.map(str::to_string).or(query).unwrap_or_default();
    bool::from(given.as_bytes().ct_eq(token.as_bytes()))
}

/// Refuses what another web site could make a browser send. Without a
/// token (allowed on loopback, as `siesta up` runs) `POST /api/models/...`
/// is a CORS "simple request": any page the operator visits could stop or
/// restart models. So a state-changing request whose `Origin` is not this
/// listener's own (scheme-less `host:port`, as in `Host`), or whose
/// `Sec-Fetch-Site` says it came from another site, is refused; the page's
/// own `fetch` calls are same-origin and pass, and tools such as curl send
/// neither header. Without a token every request must also name the
/// listener by an IP literal or `localhost`: a DNS-rebinding page (its own
/// name resolved to 127.0.0.1) is same-origin to the browser, and only its
/// `Host` gives it away. With a token the token is the guard (a listener
/// beyond loopback is reached by name).
fn same_origin<B>(token: bool, req: &Request<B>) -> Result<(), String> {
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
    let host = header("host");
    if !token && let Some(h) = host.filter(|h| !loopback_name(h)) {
        return Err(format!(
            "Host {h:?} is not an IP address or localhost: without a token the web listener answers only to those (DNS rebinding); open it as http://127.0.0.1:PORT/ or configure a token"
        ));
    }
    if matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return Ok(());
    }
    cross_site(host, header("origin"), header("sec-fetch-site"))
        .map_or(Ok(()), |why| Err(format!("cross-origin request refused ({why}): operations are accepted from this listener's own page or from tools, not from other web sites")))
}

/// Why a request comes from another site, if it says so: a `Sec-Fetch-Site`
/// other than `same-origin` or `none` (typed by the user), or an `Origin`
/// whose `host:port` is not the `Host` it was sent to.
fn cross_site(host: Option<&str>, origin: Option<&str>, site: Option<&str>) -> Option<String> {
    if let Some(site) = site.filter(|s| !matches!(*s, "same-origin" | "none")) {
        return Some(format!("Sec-Fetch-Site: {site}"));
    }
    let origin = origin?;
    let same = host.is_some_and(|h| origin_host(origin).eq_ignore_ascii_case(h));
    (!same).then(|| format!("Origin {origin:?}, Host {:?}", host.unwrap_or_default()))
}

/// `http://host:port` → `host:port` (what a browser puts in `Host`);
/// `null` and other opaque origins stay as they are and match no `Host`.
fn origin_host(origin: &str) -> &str {
    origin
        .split_once("://")
        .map_or(origin, |(_, rest)| rest.trim_end_matches('/'))
}

/// `Host` is an IP literal (`127.0.0.1:8081`, `[::1]:8081`) or `localhost`
/// (or a name under it, which browsers resolve to loopback themselves).
fn loopback_name(host: &str) -> bool {
    let name = match host.rsplit_once(':') {
        Some((n, port)) if port.bytes().all(|b| b.is_ascii_digit()) && !n.ends_with(':') => n,
        _ => host,
    };
    let name = name.trim_start_matches('[').trim_end_matches(']');
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name.parse::<std::net::IpAddr>().is_ok() || name == "localhost" || name.ends_with(".localhost")
}

/// A query parameter, percent-decoded.
pub(crate) fn query_param(uri: &hyper::Uri, key: &str) -> Option<String> {
    uri.query()?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (k == key).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn asset(text: &'static str, content_type: &str) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from_static(text.as_bytes())).boxed());
    r.headers_mut()
        .insert(hyper::header::CONTENT_TYPE, content_type.parse().unwrap());
    r.headers_mut()
        .insert(hyper::header::CACHE_CONTROL, "no-cache".parse().unwrap());
    r
}

fn text_response(status: StatusCode, content_type: &str, text: String) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(text)).boxed());
    *r.status_mut() = status;
    r.headers_mut()
        .insert(hyper::header::CONTENT_TYPE, content_type.parse().unwrap());
    r
}

/// A JSON reply.
pub(crate) fn json<T: serde::Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    match serde_json::to_string(value) {
        Ok(s) => text_response(status, "application/json", s),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &format!("json: {e}")),
    }
}

/// `{"error": {"message", "code"}}`.
pub(crate) fn error(status: StatusCode, message: &str) -> Response<Body> {
    let body = serde_json::json!({"error": {"message": message, "code": status.as_u16()}});
    text_response(status, "application/json", body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_params_are_decoded() {
        let uri: hyper::Uri = "/events?since=12&token=a%2Bb+c".parse().unwrap();
        assert_eq!(query_param(&uri, "since").as_deref(), Some("12"));
        assert_eq!(query_param(&uri, "token").as_deref(), Some("a+b c"));
        assert_eq!(query_param(&uri, "x"), None);
        let bad: hyper::Uri = "/?token=%4".parse().unwrap();
        assert_eq!(query_param(&bad, "token").as_deref(), Some("%4"));
    }

    fn post(host: Option<&str>, headers: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::builder()
            .method(Method::POST)
            .uri("/api/models/m/stop");
        if let Some(h) = host {
            b = b.header("host", h);
        }
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap()
    }

    /// The page's own fetch (same origin) and tools (no Origin) pass.
    #[test]
    fn same_origin_and_tools_may_operate() {
        let host = Some("127.0.0.1:8081");
        assert_eq!(same_origin(false, &post(host, &[])), Ok(()));
        let page = [
            ("origin", "http://127.0.0.1:8081"),
            ("sec-fetch-site", "same-origin"),
        ];
        assert_eq!(same_origin(false, &post(host, &page)), Ok(()));
        let v6 = [("origin", "http://[::1]:8081")];
        assert_eq!(same_origin(false, &post(Some("[::1]:8081"), &v6)), Ok(()));
        let named = [("origin", "http://LocalHost:8081")];
        assert_eq!(
            same_origin(false, &post(Some("localhost:8081"), &named)),
            Ok(())
        );
        assert_eq!(same_origin(false, &post(None, &[])), Ok(()));
    }

    /// Another site's page: refused by its Origin or its Sec-Fetch-Site.
    #[test]
    fn cross_origin_operations_are_refused() {
        let host = Some("127.0.0.1:8081");
        for headers in [
            &[("origin", "http://evil.example")][..],
            &[("origin", "http://127.0.0.1:9999")][..],
            &[("origin", "null")][..],
            &[("sec-fetch-site", "cross-site")][..],
            &[("sec-fetch-site", "same-site")][..],
        ] {
            for token in [false, true] {
                let err = same_origin(token, &post(host, headers)).unwrap_err();
                assert!(err.contains("cross-origin"), "{headers:?}: {err}");
            }
        }
        // Reads carry nothing another site could act with.
        let get = Request::builder()
            .uri("/api/models")
            .header("host", "127.0.0.1:8081")
            .header("origin", "http://evil.example")
            .body(())
            .unwrap();
        assert_eq!(same_origin(false, &get), Ok(()));
    }

    /// Without a token a name other than localhost is a rebinding page.
    #[test]
    fn rebound_names_are_refused_without_a_token() {
        let page = [("origin", "http://evil.example:8081")];
        let err = same_origin(false, &post(Some("evil.example:8081"), &page)).unwrap_err();
        assert!(err.contains("DNS rebinding"), "{err}");
        let get = Request::builder()
            .uri("/events")
            .header("host", "evil.example:8081")
            .body(())
            .unwrap();
        assert!(same_origin(false, &get).is_err());
        assert_eq!(
            same_origin(
                true,
                &post(Some("box.lan:8081"), &[("origin", "http://box.lan:8081")])
            ),
            Ok(()),
            "with a token, a name is how a remote listener is reached"
        );
        for ok in [
            "127.0.0.1",
            "[::1]",
            "[::1]:80",
            "localhost.",
            "a.localhost:1",
        ] {
            assert!(loopback_name(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "localhost.evil.example:80",
            "127.0.0.1.nip.io",
        ] {
            assert!(!loopback_name(bad), "{bad}");
        }
    }

    #[test]
    fn token_is_required_when_set() {
        let req = |uri: &str, auth: Option<&str>| {
            let mut b = Request::builder().uri(uri);
            if let Some(a) = auth {
                b = b.header("authorization", a);
            }
            b.body(()).unwrap()
        };
        assert!(authorized(None, &req("/", None)));
        assert!(authorized(Some("s3"), &req("/?token=s3", None)));
        assert!(authorized(Some("s3"), &req("/", Some("Bearer s3"))));
        assert!(!authorized(Some("s3"), &req("/?token=s", None)));
        assert!(!authorized(Some("s3"), &req("/", Some("Bearer s"))));
        assert!(!authorized(Some("s3"), &req("/", None)));
    }
}
