//! `/api/...`: JSON reads and model operations, each the same call as the
//! gRPC method it names (the same checks, the same answers):
//!
//! - `GET /api/models` → `ListModels`; `GET /api/gpus` → `ListGpus`;
//! - `POST /api/models/NAME/wake|start|stop|restart|unpin`;
//! - `POST /api/models/NAME/sleep?level=1|2`;
//! - `POST /api/models/NAME/pin[?until_unix_ms=T]`.

use super::view::{GpusView, ModelView, OperationView};
use super::{Body, Web, error, json, query_param};
use hyper::{Method, Request, Response, StatusCode};
use serde::Serialize;
use siesta_proto::v1 as pb;
use siesta_proto::v1::control_server::Control;
use tonic::Code;

#[derive(Debug, Serialize)]
struct ModelsView {
    models: Vec<ModelView>,
    revision: u64,
}

/// gRPC status → HTTP status.
fn http_status(code: Code) -> StatusCode {
    match code {
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::InvalidArgument => StatusCode::BAD_REQUEST,
        Code::FailedPrecondition => StatusCode::CONFLICT,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn refused(s: tonic::Status) -> Response<Body> {
    error(http_status(s.code()), s.message())
}

fn number<T: std::str::FromStr>(uri: &hyper::Uri, key: &str) -> Result<Option<T>, String> {
    match query_param(uri, key) {
        None => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|_| format!("query parameter {key}={v:?} is not a number")),
    }
}

pub async fn handle<B>(web: &Web, req: Request<B>) -> Response<Body> {
    let path = req.uri().path().trim_end_matches('/').to_string();
    let svc = &web.service;
    match (req.method(), path.as_str()) {
        (&Method::GET, "/api/models") => {
            match svc
                .list_models(tonic::Request::new(pb::ListModelsRequest::default()))
                .await
            {
                Ok(r) => {
                    let r = r.into_inner();
                    let view = ModelsView {
                        models: r.models.iter().map(ModelView::from).collect(),
                        revision: r.revision,
                    };
                    json(StatusCode::OK, &view)
                }
                Err(s) => refused(s),
            }
        }
        (&Method::GET, "/api/gpus") => {
            match svc
                .list_gpus(tonic::Request::new(pb::ListGpusRequest::default()))
                .await
            {
                Ok(r) => json(StatusCode::OK, &GpusView::from(&r.into_inner())),
                Err(s) => refused(s),
            }
        }
        (&Method::POST, p) if p.starts_with("/api/models/") => {
            let rest = &p["/api/models/".len()..];
            let Some((name, op)) = rest.rsplit_once('/') else {
                return error(
                    StatusCode::NOT_FOUND,
                    &format!("{p}: expected /api/models/NAME/OPERATION"),
                );
            };
            let name = super::percent_decode(name);
            operation(web, &req, name, op).await
        }
        (m, p) => match allowed(p) {
            // A call that exists, by another method: 405 with `Allow` (a
            // GET of an operation read as "no such API call").
            Some(allow) => {
                let mut r = error(
                    StatusCode::METHOD_NOT_ALLOWED,
                    &format!("{p} takes {allow}, not {m}"),
                );
                r.headers_mut().insert(
                    hyper::header::ALLOW,
                    hyper::header::HeaderValue::from_static(allow),
                );
                r
            }
            None => error(
                StatusCode::NOT_FOUND,
                &format!("no such API call: {m} {p} (see the README's web listener section)"),
            ),
        },
    }
}

/// The method the API call at `path` takes, if there is one there.
fn allowed(path: &str) -> Option<&'static str> {
    match path {
        "/api/models" | "/api/gpus" | "/api/history" => Some("GET"),
        p if p
            .strip_prefix("/api/models/")
            .is_some_and(|rest| rest.contains('/')) =>
        {
            Some("POST")
        }
        _ => None,
    }
}

async fn operation<B>(web: &Web, req: &Request<B>, name: String, op: &str) -> Response<Body> {
    let svc = &web.service;
    let model = || tonic::Request::new(pb::ModelRequest { name: name.clone() });
    let result = match op {
        "wake" => {
            svc.wake(tonic::Request::new(pb::WakeRequest {
                name: name.clone(),
                wait: false,
                timeout_ms: 0,
            }))
            .await
        }
        "sleep" => {
            let level = match number::<u32>(req.uri(), "level") {
                // Given, 0 is not "the default" as the gRPC field's 0 is.
                Ok(Some(0)) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "level: 0 is not a sleep level (1 or 2)",
                    );
                }
                Ok(l) => l.unwrap_or(1),
                Err(msg) => return error(StatusCode::BAD_REQUEST, &msg),
            };
            svc.sleep(tonic::Request::new(pb::SleepRequest {
                name: name.clone(),
                level,
            }))
            .await
        }
        "pin" => {
            let until = match number::<i64>(req.uri(), "until_unix_ms") {
                Ok(u) => u.unwrap_or(0),
                Err(msg) => return error(StatusCode::BAD_REQUEST, &msg),
            };
            let for_ms = match number::<u64>(req.uri(), "for_ms") {
                Ok(f) => f.unwrap_or(0),
                Err(msg) => return error(StatusCode::BAD_REQUEST, &msg),
            };
            svc.pin(tonic::Request::new(pb::PinRequest {
                name: name.clone(),
                until_unix_ms: until,
                for_ms,
            }))
            .await
        }
        "unpin" => svc.unpin(model()).await,
        "start" => svc.start(model()).await,
        "stop" => svc.stop(model()).await,
        "restart" => svc.restart(model()).await,
        other => {
            return error(
                StatusCode::NOT_FOUND,
                &format!(
                    "no operation {other:?} on model {name:?}: wake, sleep, pin, unpin, start, stop or restart"
                ),
            );
        }
    };
    tracing::info!(model = %name, op, ok = result.is_ok(), "web: operation");
    match result {
        Ok(r) => json(StatusCode::OK, &OperationView::from(&r.into_inner())),
        Err(s) => refused(s),
    }
}
