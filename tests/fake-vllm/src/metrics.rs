//! `GET /metrics` (Prometheus text, vLLM's names and labels) and `GET /fake/stats`.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use http::StatusCode;
use serde_json::json;

use crate::http::{Resp, full, json};
use crate::server::App;

/// Prometheus text exposition of the engine's gauges and counters.
pub fn metrics(app: &App) -> Resp {
    let e = &app.engine;
    if e.args.disable_log_stats {
        // vLLM registers its `vllm:` metrics only when stats are logged.
        let text = format!(
            "# HELP process_start_time_seconds Start time of the process since unix epoch in \
             seconds.\n# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {:?}\n",
            app.created as f64
        );
        return full(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            text,
        );
    }
    let model = e.args.served_names()[0]
        .replace('\\', "\\\\")
        .replace('"', "\\\"");
    let labels = format!("model_name=\"{model}\",engine=\"0\"");
    let running = e.running.load(Ordering::SeqCst);
    // fake-vllm has no scheduler queue, and requests held by a sleeping engine are in no
    // gauge: a paused vLLM engine takes no steps, so its waiting gauge does not move.
    let waiting = 0u64;
    let st = e.sleep_state();
    // Each running request's cache, and what each prefill chunk allocated (a chunked
    // prefill shows only here: no token comes until it is over).
    let chunks = e.prefill_chunks.load(Ordering::SeqCst);
    // Freed only when the cache sleeps: a draining sleep's requests still hold theirs.
    let kv = if st.kv_asleep {
        0.0
    } else {
        (running as f64 * 0.05 + chunks as f64 * 0.001).min(1.0)
    };
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, samples: &[(String, f64)]| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (l, v) in samples {
            let _ = writeln!(out, "{name}{{{l}}} {v:?}");
        }
    };
    gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        &[(labels.clone(), running as f64)],
    );
    gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        &[(labels.clone(), waiting as f64)],
    );
    gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        &[(labels.clone(), kv)],
    );
    let state = |s: &str, on: bool| {
        (
            format!("{labels},sleep_state=\"{s}\""),
            if on { 1.0 } else { 0.0 },
        )
    };
    gauge(
        "vllm:engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; \
         weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        &[
            // What the last `/sleep` or `/wake_up` recorded, not `/is_sleeping`: up to 0.24
            // every wake records awake (`tags=weights` alone too), and a draining sleep
            // records its level only once the drain is over.
            state("awake", !st.recorded_asleep),
            state("weights_offloaded", st.recorded_asleep && st.level == 1),
            state("discard_all", st.recorded_asleep && st.level == 2),
        ],
    );
    let mut counter = |name: &str, help: &str, v: u64| {
        let _ = writeln!(
            out,
            "# HELP {name}_total {help}\n# TYPE {name}_total counter"
        );
        let _ = writeln!(out, "{name}_total{{{labels}}} {:?}", v as f64);
    };
    counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        e.prompt_tokens.load(Ordering::SeqCst),
    );
    counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        e.generation_tokens.load(Ordering::SeqCst),
    );
    counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        e.served.load(Ordering::SeqCst),
    );
    full(
        StatusCode::OK,
        "text/plain; version=0.0.4; charset=utf-8",
        out,
    )
}

/// `GET /fake/verify`: every resident weight byte read back and compared with the pattern
/// (`{"intact": bool, "bytes": N, "ms": T}`; 500 when the device cannot be read).
pub fn verify(app: &App) -> Resp {
    let t = std::time::Instant::now();
    match app.engine.verify_all() {
        Ok(intact) => {
            tracing::info!(intact, "verified every weight byte");
            json(
                StatusCode::OK,
                &json!({
                    "intact": intact,
                    "bytes": app.engine.device_bytes(),
                    "ms": t.elapsed().as_millis() as u64,
                }),
            )
        }
        Err(e) => json(
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!({ "intact": false, "error": e }),
        ),
    }
}

/// `GET /fake/stats`: fake-only numbers for tests and benchmarks.
pub fn stats(app: &App) -> Resp {
    let e = &app.engine;
    let st = e.sleep_state();
    // As `vllm:engine_sleep_state` says.
    let state = match (st.recorded_asleep, st.level) {
        (false, _) => "awake",
        (true, 0) => "paused",
        (true, 1) => "weights_offloaded",
        (true, _) => "discard_all",
    };
    let last_wake = e.last_wake_finished_ns.load(Ordering::SeqCst);
    let last_arrival = e.last_request_arrived_ns.load(Ordering::SeqCst);
    json(
        StatusCode::OK,
        &json!({
            "state": state,
            "is_sleeping": st.is_sleeping(),
            "sleep_level": st.level,
            "weights_asleep": st.weights_asleep,
            "kv_cache_asleep": st.kv_asleep,
            "weights_intact": e.weights_intact(),
            "requests_arrived": e.arrived.load(Ordering::SeqCst),
            "requests_served": e.served.load(Ordering::SeqCst),
            "running": e.running.load(Ordering::SeqCst),
            "held": e.held.load(Ordering::SeqCst),
            "gpu_bytes": e.gpu.as_ref().map(|_| e.gpu_bytes.load(Ordering::SeqCst)),
            "gpu_used_bytes": e.gpu.as_ref().map(|g| {
                g.used().into_iter().collect::<std::collections::BTreeMap<_, _>>()
            }),
            "healthy": e.healthy(),
            "sleeps": e.sleeps.load(Ordering::SeqCst),
            "wakes": e.wakes.load(Ordering::SeqCst),
            "last_wake_finished_unix_ns": (last_wake > 0).then_some(last_wake),
            "last_request_arrived_unix_ns": (last_arrival > 0).then_some(last_arrival),
            "device_bytes": e.device_bytes(),
            "engine_core_pid": app.core.as_ref().and_then(|c| c.pid()),
            "pid": std::process::id(),
        }),
    )
}
