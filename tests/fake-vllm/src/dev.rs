//! vLLM's dev-mode endpoints (only with `VLLM_SERVER_DEV_MODE=1`): sleep, wake, RPC.

use std::sync::Arc;

use http::{Method, StatusCode, Uri};
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::engine::{EngineError, SleepMode};
use crate::http::{Resp, detail, empty, error, json, query_pairs, read_json};
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
    let resp = match (method, uri.path()) {
        (&Method::POST, "/sleep") => to_the_end(async move { sleep(&app, &q).await }).await,
        (&Method::POST, "/wake_up") => to_the_end(async move { wake_up(&app, &q).await }).await,
        (&Method::GET, "/is_sleeping") => json(
            StatusCode::OK,
            &json!({"is_sleeping": app.engine.is_sleeping().await}),
        ),
        (&Method::POST, "/collective_rpc") => {
            to_the_end(async move { collective_rpc(&app, body).await }).await
        }
        (&Method::POST, "/reset_prefix_cache") => reset_prefix_cache(&app).await,
        (_, "/sleep" | "/wake_up" | "/is_sleeping" | "/collective_rpc" | "/reset_prefix_cache") => {
            detail(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed")
        }
        _ => return None,
    };
    Some(resp)
}

/// Runs a sleep, wake or RPC to its end even when its client goes away, as
/// vLLM's server does (uvicorn does not cancel a handler whose client
/// disconnected; hyper would drop it). A siesta-control killed during a
/// `/sleep?mode=wait` then finds the engine asleep, not paused for ever
/// with `/is_sleeping` saying false.
async fn to_the_end(op: impl Future<Output = Resp> + Send + 'static) -> Resp {
    tokio::spawn(op).await.unwrap_or_else(|e| {
        error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            &format!("operation failed: {e}"),
            None,
        )
    })
}

async fn collective_rpc(app: &App, body: Incoming) -> Resp {
    let v = match read_json(body).await {
        Ok(v) => v,
        Err(_) => return detail(StatusCode::BAD_REQUEST, "JSON decode error"),
    };
    let Some(method) = v["method"].as_str() else {
        return detail(StatusCode::BAD_REQUEST, "Missing 'method' in request body");
    };
    let tp = app.engine.args.tensor_parallel_size.max(1);
    let result = match method {
        "reload_weights" => app.engine.reload_weights().await,
        // A method the worker lacks: `run_method`'s NotImplementedError in the engine core
        // (TP=1), the worker process's AttributeError with TP > 1; the engine core's utility
        // call fails, and the API server answers its message as a 500.
        _ if tp == 1 => Err(EngineError::RpcFailed(format!(
            "Method '{method}' is not implemented."
        ))),
        _ => Err(EngineError::RpcFailed(format!(
            "Worker failed with error ''Worker' object has no attribute '{method}'', please \
             check the stack trace above for the root cause"
        ))),
    };
    if let Err(e) = result {
        return engine_error(&e);
    }
    // One result per worker; `None` from reload_weights serializes as null.
    let results: Vec<Value> = (0..tp).map(|_| Value::Null).collect();
    json(StatusCode::OK, &json!({"results": results}))
}

/// FastAPI's 422 for a bad query parameter.
fn unprocessable(kind: &str, param: &str, msg: &str, input: &str) -> Resp {
    json(
        StatusCode::UNPROCESSABLE_ENTITY,
        &json!({"detail": [{"type": kind, "loc": ["query", param], "msg": msg, "input": input}]}),
    )
}

/// `POST /sleep?level=&mode=`. Levels 0-2 (0.33 answers 422 above; older versions treat
/// 3 and up as 2); 0.33 answers `{"status":"sleeping","level":N}`, older an empty 200.
async fn sleep(app: &App, q: &[(String, String)]) -> Resp {
    let get = |k: &str| {
        q.iter()
            .rev()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    };
    let json_bodies = app.engine.version().json_sleep_bodies();
    let raw = get("level").unwrap_or("1");
    let level = match raw.trim().parse::<i64>() {
        Ok(l @ 0..=2) => l as u8,
        Ok(l) if l > 2 && !json_bodies => 2,
        Ok(_) => {
            return unprocessable(
                "less_than_equal",
                "level",
                "Input should be less than or equal to 2",
                raw,
            );
        }
        Err(_) => {
            return unprocessable(
                "int_parsing",
                "level",
                "Input should be a valid integer, unable to parse string as an integer",
                raw,
            );
        }
    };
    let mode = match get("mode").unwrap_or("abort") {
        "abort" => SleepMode::Abort,
        "wait" => SleepMode::Wait,
        "keep" => SleepMode::Keep,
        other => {
            return unprocessable(
                "literal_error",
                "mode",
                "Input should be 'abort', 'wait' or 'keep'",
                other,
            );
        }
    };
    match app.engine.sleep(level, mode).await {
        Ok(()) if json_bodies => json(
            StatusCode::OK,
            &json!({"status": "sleeping", "level": level}),
        ),
        Ok(()) => empty(StatusCode::OK),
        Err(e) => engine_error(&e),
    }
}

/// `POST /wake_up[?tags=..]`: 0.32 and later answer `{"status":"awake"|"sleeping","tags":
/// [..]}` ("sleeping" while an executor tag is still asleep; `tags` as given, `null` when
/// none), older an empty 200. vLLM checks no tag: one it does not know makes the executor do
/// nothing, and the answer is still 200.
async fn wake_up(app: &App, q: &[(String, String)]) -> Resp {
    let json_bodies = app.engine.version().json_sleep_bodies();
    let named: Vec<String> = q
        .iter()
        .filter(|(k, _)| k == "tags")
        .map(|(_, v)| v.clone())
        .collect();
    let tags = (!named.is_empty()).then_some(named);
    tracing::info!("wake up the engine with tags: {tags:?}");
    match app.engine.wake(tags.as_deref()).await {
        Ok(w) if json_bodies => json(
            StatusCode::OK,
            &json!({
                "status": if w.fully_awake { "awake" } else { "sleeping" },
                "tags": tags,
            }),
        ),
        Ok(_) => empty(StatusCode::OK),
        Err(e) => engine_error(&e),
    }
}

/// `POST /reset_prefix_cache`: an engine-core utility call (it waits behind a running wake
/// or RPC, as `/is_sleeping` does) that fails while requests hold KV-cache blocks. 0.33
/// answers `{"success": bool}` (200 either way: a failed reset is no error); older versions
/// an empty 200 whatever happened.
async fn reset_prefix_cache(app: &App) -> Resp {
    tracing::info!("Resetting prefix cache...");
    let success = app.engine.reset_prefix_cache().await;
    if !success {
        tracing::warn!(
            "Failed to reset prefix cache because some blocks ({} requests running) are not freed yet",
            app.engine.running.load(std::sync::atomic::Ordering::SeqCst)
        );
    }
    if app.engine.version().json_sleep_bodies() {
        json(StatusCode::OK, &json!({"success": success}))
    } else {
        empty(StatusCode::OK)
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
