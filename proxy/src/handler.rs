//! Request handling: which path goes where, the API key check, reading the
//! body, and the route → hold → forward loop for model requests.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::{Body as _, Incoming};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use crate::activity::Activity;
use crate::body::ProxyBody;
use crate::errors::{ApiError, ShedReason};
use crate::form_field::rewrite_form_model;
use crate::forward::{ClientRequest, ForwardError, Forwarder, SlotWait};
use crate::hold::{self, Holds, Release, Ticket, Wait};
use crate::metrics::{Metrics, ModelLabels, ShedLabels, no_model};
use crate::model_field::{FieldKind, ModelField, rewrite_model};
use crate::request_model::{find_request_model, refused_media, route_for};
use crate::route_table::{ModelRoute, RouteTable, View};

pub(crate) mod checks;
pub(crate) mod cors;
mod models;

use checks::{authorized, forwardable_path, read_body};

/// How long an endpoint that refused a connection is avoided.
const SUSPECT_MS: u64 = 1_000;
/// How often a request held because every endpoint refused re-checks.
const SUSPECT_POLL: Duration = Duration::from_millis(250);

/// Everything request handling needs.
#[derive(Debug)]
pub struct Shared {
    pub table: Arc<RouteTable>,
    pub holds: Arc<Holds>,
    pub forwarder: Forwarder,
    pub metrics: Arc<Metrics>,
    pub activity: Arc<Activity>,
    pub api_keys: Vec<Vec<u8>>,
    pub max_body_bytes: usize,
    pub body_timeout: Duration,
    /// How long a response relayed over HTTP/2 may wait for its client to
    /// take more of it (HTTP/1's socket writes are timed by the connection).
    pub send_timeout: Duration,
    /// How long a request waits for the first snapshot: a replica just
    /// started (`--reuse-port` gives it connections at once) knows no model
    /// until a control plane has sent one, and must not answer 404 meanwhile.
    pub first_snapshot_wait: Duration,
}

fn text(status: StatusCode, body: &'static str) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::full(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn health(shared: &Shared, path: &str) -> Option<Response<ProxyBody>> {
    match path {
        "/healthz" => Some(text(StatusCode::OK, "ok\n")),
        "/readyz" if shared.table.view().ready => Some(text(StatusCode::OK, "ready\n")),
        "/readyz" => Some(text(
            StatusCode::SERVICE_UNAVAILABLE,
            "no snapshot from any control plane yet\n",
        )),
        _ => None,
    }
}

/// The admin listener: `/metrics`, `/healthz`, `/readyz`, read with `GET`
/// or `HEAD` (as `GET`: hyper sends the head alone, its `Content-Length`
/// the body's); another method is a 405 naming those, as on the main
/// listener.
pub async fn handle_admin(shared: Arc<Shared>, req: Request<Incoming>) -> Response<ProxyBody> {
    let path = req.uri().path();
    if req.method() == Method::GET || req.method() == Method::HEAD {
        if let Some(r) = health(&shared, path) {
            return r;
        }
        if path == "/metrics" {
            let mut r = Response::new(ProxyBody::full(shared.metrics.encode()));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            return r;
        }
    }
    let e = if matches!(path, "/healthz" | "/readyz" | "/metrics") {
        wrong_method(req.method(), path, "GET, HEAD")
    } else {
        ApiError::NoAdminRoute(crate::errors::shown(&format!("{} {path}", req.method())))
    };
    closing_if(
        !req.body().is_end_stream(),
        req.version(),
        e.into_response(),
    )
}

/// What the waiting room hands on with a request that waited there
/// (nothing for any other request).
#[derive(Debug, Default)]
pub struct Waited {
    /// The request has waited for its model since then.
    pub since: Option<Instant>,
    /// Its place on the way to the engine: given back at the answer's head
    /// or after [`crate::hold::GATE_HOLD_MAX`] at the engine.
    pub gate: Option<OwnedSemaphorePermit>,
}

/// The OpenAI-compatible listener.
pub async fn handle_main(shared: Arc<Shared>, req: Request<Incoming>) -> Response<ProxyBody> {
    let path = req.uri().path();
    // Sent by a web page: what the proxy answers itself carries CORS headers.
    let page = req.headers().contains_key(header::ORIGIN);
    // Answered here, without reading a body it has (see `closing_if`).
    let answered_unread = |req: &Request<Incoming>, resp| {
        closing_if(!req.body().is_end_stream(), req.version(), resp)
    };
    // HEAD as GET: hyper sends the head alone.
    let (model, mut resp) = if req.method() == Method::GET || req.method() == Method::HEAD {
        if let Some(r) = health(&shared, path) {
            return r;
        }
        if !authorized(&shared, &req) {
            let resp = ApiError::Unauthorized.into_response();
            (no_model(), answered_unread(&req, resp))
        } else if path.starts_with("/v1/models")
            && let Err(e) = ready_view(&shared, None).await
        {
            (no_model(), e.into_response())
        } else if path == "/v1/models" || path == "/v1/models/" {
            (no_model(), models::list(&shared))
        } else if let Some(id) = path.strip_prefix("/v1/models/") {
            (no_model(), models::one(&shared, id))
        } else {
            (no_model(), not_served(req.method(), path).into_response())
        }
    } else if req.method() == Method::POST && forwardable_path(path) {
        if authorized(&shared, &req) {
            model_request(&shared, req).await
        } else {
            let resp = ApiError::Unauthorized.into_response();
            (no_model(), answered_unread(&req, resp))
        }
    } else if req.method() == Method::OPTIONS
        && let Some(r) = cors::preflight(req.headers())
    {
        return r;
    } else {
        let e = not_served(req.method(), path);
        (no_model(), answered_unread(&req, e.into_response()))
    };
    if page {
        cors::allow_origin(&mut resp);
    }
    shared.metrics.request(&model, resp.status());
    resp
}

/// A request this proxy serves no answer to: a path served here asked with
/// a method it does not take is a 405 naming those it takes, as vLLM's
/// router answers it (the model list and the probes are read, vLLM's model
/// routes take a POST; another `/v1` path is forwarded by POST too, but the
/// engine may not have it); any other path is a 404.
fn not_served(method: &Method, path: &str) -> ApiError {
    let allow = if matches!(path, "/healthz" | "/readyz") || path.starts_with("/v1/models") {
        "GET, HEAD"
    } else if crate::request_model::known_post_route(path) {
        "POST"
    } else {
        return ApiError::NoRoute(crate::errors::shown(&format!("{method} {path}")));
    };
    wrong_method(method, path, allow)
}

/// A path served here asked with a method it does not take (`allow`: those
/// it takes).
fn wrong_method(method: &Method, path: &str, allow: &'static str) -> ApiError {
    ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: crate::errors::shown(path),
        allow,
    }
}

/// An answer given before the request's body was read to its end: hyper
/// closes the connection after it (the rest of the body would be read as
/// the next request), and the answer says so, as nginx's does, so that a
/// keep-alive client does not send its next request into the closing
/// connection. HTTP/2 closes only the stream and has no such header.
fn closing_if(
    unread: bool,
    version: http::Version,
    mut resp: Response<ProxyBody>,
) -> Response<ProxyBody> {
    if unread && version < http::Version::HTTP_2 {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// A POST to a `/v1` path: read the body, then [`routed`].
async fn model_request(shared: &Shared, req: Request<Incoming>) -> (Arc<str>, Response<ProxyBody>) {
    let (parts, body) = req.into_parts();
    let content_length = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let body = match read_body(shared, body, content_length).await {
        Ok(b) => b,
        Err(e) => {
            return (
                no_model(),
                closing_if(true, parts.version, e.into_response()),
            );
        }
    };
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .map(|v| v.as_bytes());
    let field = find_request_model(&body, content_type);
    // Held, if at all, in the handler: only the proxy's own server's
    // requests wait in the waiting room.
    let waited = Waited::default();
    routed(shared, &ClientRequest::of(&parts), &body, field, waited).await
}

/// A plain request read whole by the proxy's own HTTP/1.1 server
/// ([`crate::server::http1`]): a POST to a forwardable path with a valid
/// key (or none needed), `field` its body's model field; `page`: it has an
/// `Origin` header.
pub async fn handle_plain(
    shared: &Shared,
    req: &ClientRequest<'_>,
    page: bool,
    body: &Bytes,
    field: Result<ModelField<'_>, ApiError>,
    waited: Waited,
) -> Response<ProxyBody> {
    let (model, mut resp) = routed(shared, req, body, field, waited).await;
    if page {
        cors::allow_origin(&mut resp);
    }
    shared.metrics.request(&model, resp.status());
    resp
}

/// A model request whose body is read: find the model, then forward or hold.
async fn routed(
    shared: &Shared,
    req: &ClientRequest<'_>,
    body: &Bytes,
    field: Result<ModelField<'_>, ApiError>,
    waited: Waited,
) -> (Arc<str>, Response<ProxyBody>) {
    let field = match field {
        Ok(f) => f,
        Err(e) => return (no_model(), e.into_response()),
    };
    let view = match ready_view(shared, Some(&field.name)).await {
        Ok(v) => v,
        Err(e) => return (no_model(), e.into_response()),
    };
    let route = match route_for(&view, &field.name) {
        Ok(r) => r,
        Err(e) => return (no_model(), e.into_response()),
    };
    let model = route.name.clone();
    if let Some(e) = refused_media(route, req.target, &field) {
        return (model, e.into_response());
    }
    drop(view);
    let http2 = req.version == http::Version::HTTP_2;
    let resp = route_loop(shared, &model, &field, req, body, waited)
        .await
        // A stalled HTTP/2 stream blocks no socket write: timed per stream.
        .map(|r| {
            if http2 {
                r.map(|b| b.watch_stalls(shared.send_timeout))
            } else {
                r
            }
        })
        .unwrap_or_else(|e| {
            if let ApiError::Shed { reason, .. } = &e {
                shared
                    .metrics
                    .shed
                    .get_or_create(&ShedLabels {
                        model: model.clone(),
                        reason: reason.code(),
                    })
                    .inc();
            }
            e.into_response()
        });
    (model, resp)
}

/// The route table once this proxy knows the models: at once after its
/// first snapshot, else when it comes (up to `first_snapshot_wait`; then
/// 503 with Retry-After, not a 404 for a model it cannot know yet). In the
/// proxy's first `first_snapshot_wait`, a request for a model no snapshot
/// has named (`None`: the list of models) also waits for every control
/// plane address watched to send its first: with `--control A,B`, A's
/// snapshot alone made a model only B has a 404.
async fn ready_view(shared: &Shared, model: Option<&str>) -> Result<Arc<View>, ApiError> {
    let known =
        |v: &View| v.ready && (!v.unsynced || model.is_some_and(|m| route_for(v, m).is_ok()));
    let view = shared.table.view();
    if known(&view) {
        return Ok(view);
    }
    let mut rx = shared.table.subscribe();
    if !view.ready {
        let first = async { rx.wait_for(|v| v.ready).await.map(|v| v.clone()) };
        if !matches!(
            tokio::time::timeout(shared.first_snapshot_wait, first).await,
            Ok(Ok(_))
        ) {
            return Err(ApiError::Shed {
                reason: ShedReason::NotReady,
                retry_after_s: Some(1),
                message: format!(
                    "this proxy has not heard from any control plane yet (waited {} ms), so it \
                     knows no model; retry, and if this lasts check that siesta-control runs and \
                     is reachable at this proxy's --control address (until then the admin /readyz is 503)",
                    shared.first_snapshot_wait.as_millis()
                ),
            });
        }
    }
    let all = async { rx.wait_for(|v| known(v)).await.map(|v| v.clone()) };
    let by = shared.table.created() + shared.first_snapshot_wait;
    match tokio::time::timeout_at(by, all).await {
        Ok(Ok(view)) => Ok(view),
        _ => Ok(shared.table.view()),
    }
}

/// Forward when an endpoint is up, hold otherwise, until answered or shed.
async fn route_loop(
    shared: &Shared,
    model: &Arc<str>,
    field: &ModelField<'_>,
    req: &ClientRequest<'_>,
    body: &Bytes,
    waited: Waited,
) -> Result<Response<ProxyBody>, ApiError> {
    // An unnamed model is the one served (see `route_for`).
    let requested = match field.kind {
        FieldKind::Unnamed => &**model,
        _ => &*field.name,
    };
    let Waited {
        since: mut held_since,
        mut gate,
    } = waited;
    let mut ticket: Option<Ticket> = None;
    let mut clock = HoldClock {
        shared,
        model,
        since: held_since,
    };
    loop {
        let view = shared.table.view();
        let Some(route) = view.by_name.get(&**model).cloned() else {
            return Err(ApiError::UnknownModel(requested.to_owned()));
        };
        drop(view);
        if route.is_awake()
            && let Some(up) = route.pick().cloned()
        {
            ticket = None; // leaves the queue
            clock.stop();
            let out = match field.kind {
                _ if up.served_name.as_bytes() == field.raw(body)
                    || up.served_name == requested =>
                {
                    body.clone()
                }
                // vLLM answers an unnamed request with its one model.
                FieldKind::Unnamed => body.clone(),
                FieldKind::Form => rewrite_form_model(body, field.span.clone(), &up.served_name),
                FieldKind::Json => rewrite_model(body, field.span.clone(), &up.served_name),
            };
            // A request waits for one of the engine's slots as long as it
            // may be held (from its first wait), and a few seconds at least.
            let slot_wait = SlotWait {
                since: held_since,
                hold: Duration::from_millis(route.max_hold_ms),
            };
            // Boxed: a held request's future need not carry its size.
            match Box::pin(
                shared
                    .forwarder
                    .forward(&up, req, out, gate.take(), slot_wait),
            )
            .await
            {
                Ok(resp) => return Ok(resp),
                Err(ForwardError::Busy { slots, waited }) => {
                    tracing::warn!(model = %model, url = %up.url, slots, ?waited, "engine busy: no slot came within the hold limit");
                    return Err(ApiError::Shed {
                        reason: ShedReason::EngineBusy,
                        retry_after_s: Some(1),
                        message: format!(
                            "model `{}`'s engine kept all {slots} of its request slots at this proxy \
                             taken for the {:.1} s this request waited (its hold limit, {} ms, \
                             5 s at least): retry, or raise the proxy's --engine-concurrency if \
                             the engine runs more at once",
                            route.name,
                            waited.as_secs_f64(),
                            route.max_hold_ms
                        ),
                    });
                }
                Err(ForwardError::Fenced) => {
                    // The route table is being rebuilt with the model not
                    // serving: let that finish, then route again (held).
                    tokio::task::yield_now().await;
                    continue;
                }
                Err(ForwardError::Connect(err)) => {
                    tracing::warn!(model = %model, url = %up.url, error = %err, "engine refused the connection, or reset it with the request unread; routing again");
                    up.mark_suspect(SUSPECT_MS);
                    shared
                        .metrics
                        .upstream_failures
                        .get_or_create(&ModelLabels {
                            model: model.clone(),
                        })
                        .inc();
                    shared
                        .activity
                        .endpoint_failed(&up.source, model, &up.url, err);
                    continue;
                }
                Err(ForwardError::Quiet(err)) => {
                    tracing::warn!(model = %model, url = %up.url, error = %err, "engine sent no answer");
                    return Err(ApiError::UpstreamTimeout(err));
                }
                Err(ForwardError::Other(err)) => {
                    tracing::warn!(model = %model, url = %up.url, error = %err, "upstream error");
                    return Err(ApiError::Upstream(err));
                }
            }
        }
        let held_before = held_since.is_some();
        let since = *held_since.get_or_insert_with(Instant::now);
        clock.since.get_or_insert(since);
        let deadline = since + Duration::from_millis(route.max_hold_ms);
        if ticket.is_none() {
            // Held its while already (in the waiting room, or released to a
            // model that went back to sleep): timed out, not admitted anew.
            if held_before && Instant::now() >= deadline {
                return Err(hold_timeout(shared, &route));
            }
            ticket = Some(shared.holds.admit(&route, since)?);
        }
        let poll = route.is_awake().then_some(SUSPECT_POLL);
        let t = ticket.as_mut().expect("ticket just set");
        match t.wait(deadline, poll).await {
            Wait::Released(Release::Go) => ticket = None,
            Wait::Poll => {}
            Wait::Released(Release::Gone) => {
                return Err(ApiError::UnknownModel(requested.to_owned()));
            }
            Wait::Released(Release::Fail(e)) => return Err(e),
            Wait::Timeout => {
                // Retry-After from what the model does now, not before.
                let now = shared.table.view().by_name.get(&**model).cloned();
                return Err(hold_timeout(shared, now.as_ref().unwrap_or(&route)));
            }
            Wait::Draining => {
                return Err(ApiError::Shed {
                    reason: ShedReason::ShuttingDown,
                    retry_after_s: Some(1),
                    message: format!(
                        "this proxy is shutting down before `{model}` woke; retry (another replica, or this one restarted, will hold it)"
                    ),
                });
            }
        }
    }
}

/// Observes the hold wait once: when the request leaves the queue for an
/// engine, or when it ends otherwise (shed, timeout, client gone).
struct HoldClock<'a> {
    shared: &'a Shared,
    model: &'a Arc<str>,
    since: Option<Instant>,
}

impl HoldClock<'_> {
    fn stop(&mut self) {
        if let Some(since) = self.since.take() {
            self.shared
                .metrics
                .hold_wait
                .get_or_create(&ModelLabels {
                    model: self.model.clone(),
                })
                .observe(since.elapsed().as_secs_f64());
        }
    }
}

impl Drop for HoldClock<'_> {
    fn drop(&mut self) {
        self.stop();
    }
}

fn hold_timeout(shared: &Shared, route: &ModelRoute) -> ApiError {
    let est = hold::estimate(route, crate::activity::now_unix_ms());
    let depth = shared.holds.depth(&route.name);
    ApiError::Shed {
        reason: ShedReason::HoldTimeout,
        retry_after_s: Some(hold::retry_after_s(est.ms, depth)),
        message: format!(
            "model `{}` did not become ready within {} ms{}",
            route.name,
            route.max_hold_ms,
            // What its control plane says it waits for (room held by
            // pinned or busy models, a neighbour's start): the 503 said
            // nothing of why.
            match route.status.waiting_for.as_str() {
                "" => String::new(),
                w => format!("; it waits for {w}"),
            }
        ),
    }
}
