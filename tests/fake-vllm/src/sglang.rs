//! `--personality sglang`: SGLang's `python -m sglang.launch_server` argv and the routes
//! siesta uses, with SGLang's behaviour while its memory is released (sources in
//! `docs/SGLANG-NOTES.md`):
//! - `/release_memory_occupation` and `/resume_memory_occupation` (GET or POST, JSON body
//!   `{"tags": [...]}` optional) answer 200 with `null`;
//! - a release with requests running kills the server (the scheduler's assertion), a resume
//!   of memory not released kills it too (`offload_tags.remove` raises KeyError in the
//!   scheduler), and so does any generation, including `/health`, while the memory is
//!   released (a forward pass over unmapped memory);
//! - without `--enable-memory-saver` the release frees nothing (SGLang's no-op adapter);
//!   without `--enable-weights-cpu-backup` the weights are garbage after a resume;
//! - `/metrics` only with `--enable-metrics`, as `sglang:` gauges; no vLLM dev routes.

use std::ffi::OsString;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use http::{Method, StatusCode};
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::engine::SleepMode;
use crate::http::{Resp, detail, empty, full};
use crate::server::App;

/// SGLang flags (taking a value) fake-vllm accepts and ignores.
const IGNORED_VALUE_FLAGS: &[&str] = &[
    "attention-backend",
    "chat-template",
    "chunked-prefill-size",
    "dp-size",
    "dtype",
    "kv-cache-dtype",
    "log-level",
    "max-running-requests",
    "quantization",
    "random-seed",
    "tokenizer-path",
];

/// SGLang flags (no value) fake-vllm accepts and ignores.
const IGNORED_BOOL_FLAGS: &[&str] = &[
    "disable-cuda-graph",
    "disable-custom-all-reduce",
    "disable-radix-cache",
    "enable-torch-compile",
    "trust-remote-code",
];

/// SGLang flags and the `fake-vllm serve` flag each becomes (`None`: a flag with no value).
const MAPPED: &[(&str, &str, bool)] = &[
    ("host", "host", true),
    ("port", "port", true),
    ("served-model-name", "served-model-name", true),
    ("tp-size", "tensor-parallel-size", true),
    ("tp", "tensor-parallel-size", true),
    ("mem-fraction-static", "gpu-memory-utilization", true),
    ("context-length", "max-model-len", true),
    ("enable-memory-saver", "sglang-memory-saver", false),
    (
        "enable-weights-cpu-backup",
        "sglang-weights-cpu-backup",
        false,
    ),
    ("enable-metrics", "sglang-metrics", false),
];

/// argparse's refusal, as `python -m sglang.launch_server` prints it (exit status 2).
#[derive(Debug, thiserror::Error)]
#[error(
    "usage: launch_server.py [-h] --model-path MODEL_PATH [options]\nlaunch_server.py: error: {0}"
)]
pub struct SglangArgvError(pub String);

/// The fake-vllm knobs (simulation and faults) that pass through unchanged, and whether
/// each takes a value.
fn fake_knobs() -> Vec<(String, bool)> {
    use clap::CommandFactory;
    let cmd = crate::cli::Cli::command();
    let serve = cmd.find_subcommand("serve").expect("serve subcommand");
    serve
        .get_arguments()
        .filter(|a| {
            a.get_help_heading()
                .is_some_and(|h| h.contains("fake-vllm only"))
        })
        .filter_map(|a| {
            let takes = a.get_action().takes_values();
            a.get_long().map(|l| (l.to_string(), takes))
        })
        .collect()
}

/// Rewrites SGLang's argv (after `--personality sglang` was taken out) into `fake-vllm serve`
/// with the sglang personality.
pub fn translate(args: &[OsString]) -> Result<Vec<OsString>, SglangArgvError> {
    let knobs = fake_knobs();
    let argv0 = args.first().cloned().unwrap_or_else(|| "fake-vllm".into());
    let mut model = None;
    let mut out: Vec<String> = vec!["--personality".into(), "sglang".into()];
    let mut unknown = Vec::new();
    let mut rest = args
        .iter()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned());
    while let Some(arg) = rest.next() {
        let Some(long) = arg.strip_prefix("--") else {
            unknown.push(arg);
            continue;
        };
        let (name, inline) = match long.split_once('=') {
            Some((n, v)) => (n.replace('_', "-"), Some(v.to_string())),
            None => (long.replace('_', "-"), None),
        };
        let value = |rest: &mut dyn Iterator<Item = String>| inline.clone().or_else(|| rest.next());
        if name == "model-path" || name == "model" {
            model = value(&mut rest);
        } else if let Some((_, to, takes)) = MAPPED.iter().find(|(from, _, _)| *from == name) {
            out.push(format!("--{to}"));
            if *takes {
                match value(&mut rest) {
                    Some(v) => out.push(v),
                    None => {
                        return Err(SglangArgvError(format!(
                            "argument --{name}: expected one argument"
                        )));
                    }
                }
            }
            if name == "enable-memory-saver" {
                // The fake's memory really goes (and comes back) only with sleep support.
                out.push("--enable-sleep-mode".into());
            }
        } else if name == "is-embedding" {
            out.extend(["--runner".into(), "pooling".into()]);
        } else if IGNORED_VALUE_FLAGS.contains(&name.as_str()) {
            value(&mut rest);
        } else if IGNORED_BOOL_FLAGS.contains(&name.as_str()) {
        } else if let Some((_, takes)) = knobs.iter().find(|(k, _)| *k == name) {
            out.push(format!("--{name}"));
            if *takes {
                match value(&mut rest) {
                    Some(v) => out.push(v),
                    None => {
                        return Err(SglangArgvError(format!(
                            "argument --{name}: expected one argument"
                        )));
                    }
                }
            }
        } else {
            unknown.push(arg);
        }
    }
    if !unknown.is_empty() {
        return Err(SglangArgvError(format!(
            "unrecognized arguments: {}",
            unknown.join(" ")
        )));
    }
    let Some(model) = model else {
        return Err(SglangArgvError(
            "the following arguments are required: --model-path".into(),
        ));
    };
    let mut argv = vec![argv0, "serve".into(), model.into()];
    argv.extend(out.into_iter().map(OsString::from));
    Ok(argv)
}

/// Dies like SGLang when something reaches memory it released, or its scheduler asserts.
pub fn die(app: &App, why: &str) -> ! {
    tracing::error!("Scheduler hit an exception: {why}");
    tracing::error!("Received sigquit from a child process. It usually means the child failed.");
    if let Some(core) = &app.core {
        core.stop(std::time::Duration::ZERO);
    }
    std::process::exit(1);
}

/// Whether the memory is released (tags offloaded and really freed).
pub fn released(app: &App) -> bool {
    app.sglang_released.load(Ordering::SeqCst) && app.engine.args.sglang_memory_saver
}

/// Routes SGLang's own paths; gives the body back when `path` is not one.
pub async fn route(
    app: Arc<App>,
    method: &Method,
    path: &str,
    body: Incoming,
) -> Result<Resp, Incoming> {
    let get_or_post = *method == Method::GET || *method == Method::POST;
    let resp = match path {
        "/health" | "/health_generate" if *method == Method::GET => {
            if released(&app) {
                // Both run a one-token generation.
                die(
                    &app,
                    "CUDA error: an illegal memory access was encountered (a health generation while the memory is released)",
                );
            }
            if app.engine.healthy() {
                empty(StatusCode::OK)
            } else {
                empty(StatusCode::SERVICE_UNAVAILABLE)
            }
        }
        "/get_model_info" if *method == Method::GET => crate::http::json(
            StatusCode::OK,
            &json!({
                "model_path": app.engine.args.model(),
                "tokenizer_path": app.engine.args.model(),
                "is_generation": !app.engine.args.pooling(),
                "preferred_sampling_params": null,
                "weight_version": "default",
            }),
        ),
        "/metrics" if *method == Method::GET && app.engine.args.sglang_metrics => metrics(&app),
        "/release_memory_occupation" if get_or_post => release(&app, tags(body).await).await,
        "/resume_memory_occupation" if get_or_post => resume(&app, tags(body).await).await,
        "/health"
        | "/health_generate"
        | "/get_model_info"
        | "/release_memory_occupation"
        | "/resume_memory_occupation" => {
            detail(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed")
        }
        _ => return Err(body),
    };
    Ok(resp)
}

/// The `tags` of a release or resume body (absent or empty: every tag).
async fn tags(body: Incoming) -> Vec<String> {
    let v = crate::http::read_json(body).await.unwrap_or(Value::Null);
    v["tags"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn null_ok() -> Resp {
    full(StatusCode::OK, "application/json", "null")
}

async fn release(app: &App, tags: Vec<String>) -> Resp {
    let e = &app.engine;
    if e.running.load(Ordering::SeqCst) > 0 || e.held.load(Ordering::SeqCst) > 0 {
        die(
            app,
            "AssertionError: release_memory_occupation should be called only when no ongoing request.",
        );
    }
    tracing::info!(?tags, "release memory occupation");
    app.sglang_released.store(true, Ordering::SeqCst);
    if !e.args.sglang_memory_saver {
        // TorchMemorySaverAdapter.create(enable=False): pause() does nothing.
        return null_ok();
    }
    // Weights with a CPU backup come back intact (level 1); without one they are discarded.
    let level = if e.args.sglang_weights_cpu_backup {
        1
    } else {
        2
    };
    match e.sleep(level, SleepMode::Wait).await {
        Ok(()) => null_ok(),
        Err(err) => die(app, &format!("release failed: {err}")),
    }
}

async fn resume(app: &App, tags: Vec<String>) -> Resp {
    if !app.sglang_released.swap(false, Ordering::SeqCst) {
        let tag = tags.first().map_or("kv_cache", String::as_str);
        die(
            app,
            &format!("KeyError: '{tag}' (resume_memory_occupation of memory not released)"),
        );
    }
    tracing::info!(?tags, "resume memory occupation");
    if !app.engine.args.sglang_memory_saver {
        return null_ok();
    }
    match app.engine.wake(None).await {
        Ok(_) => null_ok(),
        Err(err) => die(app, &format!("resume failed: {err}")),
    }
}

/// `GET /metrics` with `--enable-metrics`: SGLang's gauge names.
fn metrics(app: &App) -> Resp {
    let e = &app.engine;
    let model = e.args.served_names()[0].replace('"', "\\\"");
    let running = e.running.load(Ordering::SeqCst);
    let text = format!(
        "# HELP sglang:num_running_reqs The number of running requests.\n\
         # TYPE sglang:num_running_reqs gauge\n\
         sglang:num_running_reqs{{model_name=\"{model}\"}} {:?}\n\
         # HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n\
         # TYPE sglang:num_queue_reqs gauge\n\
         sglang:num_queue_reqs{{model_name=\"{model}\"}} 0.0\n",
        running as f64
    );
    full(
        StatusCode::OK,
        "text/plain; version=0.0.4; charset=utf-8",
        text,
    )
}
