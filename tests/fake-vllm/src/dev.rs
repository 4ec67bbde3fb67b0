//! vLLM's dev-mode endpoints (only with `VLLM_SERVER_DEV_MODE=1`): sleep, wake, RPC.

use std::sync::Arc;

use http::{Method, StatusCode, Uri};
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::engine::{EngineError, SleepMode};
use crate::http::{Resp, detail, empty, error, json, query_pairs, read_json};
use crate::memory::{Level, Tags};
use crate::server::App;

/// Whether `VLLM_SERVER_DEV_MODE` enables the dev routes (vLLM: `bool(int(value))`).
pub fn dev_mode_from_env() -> bool {
    std::env::var("VLLM_SERVER_DEV_MODE")
        .ok()
        .and_then(|v| v.trim().parse::<i64>().ok())
        .is_some_and(|v| v != 0)
}

/// Routes a dev path; `None` when `path` is not a dev route.
pub async fn route(app: Arc<App>, method: &Method, uri: &Uri, body: Incoming) -> Option<Resp> {
    let q = query_pairs(uri.query());
    let get = |k: &str| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let resp = match (method, uri.path()) {
        (&Method::POST, "/sleep") => {
            let level = match get("level").unwrap_or("1") {
                "1" => Level::One,
                "2" => Level::Two,
                other => return Some(bad(&format!("invalid sleep level {other:?}"))),
            };
            let mode = match get("mode").unwrap_or("abort") {
                "abort" => SleepMode::Abort,
                "wait" => SleepMode::Wait,
                "keep" => SleepMode::Keep,
                other => return Some(bad(&format!("invalid sleep mode {other:?}"))),
            };
            done(app.engine.sleep(level, mode).await)
        }
        (&Method::POST, "/wake_up") => {
            let tags: Vec<&str> = q
                .iter()
                .filter(|(k, _)| k == "tags")
                .map(|(_, v)| v.as_str())
                .collect();
            let tags = if tags.is_empty() {
                Tags::ALL
            } else {
                Tags {
                    weights: tags.contains(&"weights"),
                    kv_cache: tags.contains(&"kv_cache"),
                }
            };
            tracing::info!(?tags, "wake up the engine");
            done(app.engine.wake(tags).await)
        }
        (&Method::GET, "/is_sleeping") => json(
            StatusCode::OK,
            &json!({"is_sleeping": app.engine.sleep_state().is_sleeping()}),
        ),
        (&Method::POST, "/collective_rpc") => collective_rpc(&app, body).await,
        (&Method::POST, "/reset_prefix_cache") => empty(StatusCode::OK),
        (_, "/sleep" | "/wake_up" | "/is_sleeping" | "/collective_rpc" | "/reset_prefix_cache") => {
            detail(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed")
        }
        _ => return None,
    };
    Some(resp)
}

async fn collective_rpc(app: &App, body: Incoming) -> Resp {
    let v = match read_json(body).await {
        Ok(v) => v,
        Err(_) => return detail(StatusCode::BAD_REQUEST, "JSON decode error"),
    };
    let Some(method) = v["method"].as_str() else {
        return detail(StatusCode::BAD_REQUEST, "Missing 'method' in request body");
    };
    let result = match method {
        "reload_weights" => app.engine.reload_weights().await,
        // Other worker methods are accepted and do nothing.
        _ => Ok(()),
    };
    if let Err(e) = result {
        return engine_error(&e);
    }
    // One result per worker; `None` from reload_weights serializes as null.
    let results: Vec<Value> = (0..app.engine.args.tensor_parallel_size.max(1))
        .map(|_| Value::Null)
        .collect();
    json(StatusCode::OK, &json!({"results": results}))
}

fn done(r: Result<(), EngineError>) -> Resp {
    match r {
        Ok(()) => empty(StatusCode::OK),
        Err(e) => engine_error(&e),
    }
}

fn engine_error(e: &EngineError) -> Resp {
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "InternalServerError",
        &e.to_string(),
        None,
    )
}

fn bad(msg: &str) -> Resp {
    error(StatusCode::BAD_REQUEST, "BadRequestError", msg, None)
}
