//! The OpenAI-compatible endpoints, in vLLM's response and SSE chunk shapes.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_io::Timer;
use bytes::Bytes;
use http::{Response, StatusCode, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::http::{ApiError, Resp, json, read_json};
use crate::server::App;

/// What a correct model answers, one word per token.
const ANSWER: &[&str] = &[
    "Hello!",
    " I",
    " am",
    " a",
    " fake",
    " model",
    " served",
    " by",
    " fake-vllm,",
    " a",
    " stand-in",
    " for",
    " vLLM",
    " that",
    " lets",
    " siesta",
    " be",
    " tested",
    " without",
    " a",
    " GPU.",
];

/// What weights left as garbage answer (zeroed weights pick token 0, `!`, every time).
const GARBAGE: &str = "!";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

#[derive(Debug)]
struct Gen {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u64,
    max_tokens: u64,
    ignore_eos: bool,
    include_usage: bool,
    continuous_usage: bool,
}

/// `POST /v1/chat/completions`.
pub async fn chat(app: Arc<App>, body: Incoming) -> Resp {
    generate(app, body, Kind::Chat).await
}

/// `POST /v1/completions`.
pub async fn completions(app: Arc<App>, body: Incoming) -> Resp {
    generate(app, body, Kind::Completion).await
}

/// `GET /v1/models`.
pub fn models(app: &App) -> Resp {
    let root = app.engine.args.model();
    let data: Vec<Value> = app
        .engine
        .args
        .served_names()
        .iter()
        .map(|name| {
            json!({
                "id": name, "object": "model", "created": app.created, "owned_by": "vllm",
                "root": root, "parent": null, "max_model_len": app.engine.args.max_model_len,
                "permission": [{
                    "id": format!("modelperm-{}", random_hex()), "object": "model_permission",
                    "created": app.created, "allow_create_engine": false, "allow_sampling": true,
                    "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                    "allow_fine_tuning": false, "organization": "*", "group": null,
                    "is_blocking": false,
                }],
            })
        })
        .collect();
    json(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// `POST /v1/embeddings`: deterministic unit vectors, held while asleep like generation.
pub async fn embeddings(app: Arc<App>, body: Incoming) -> Resp {
    let v = match read_json(body).await {
        Ok(v) => v,
        Err(e) => return e.resp(),
    };
    let model = match resolve_model(&app, &v) {
        Ok(m) => m,
        Err(e) => return e.resp(),
    };
    let inputs: Vec<String> = match &v["input"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) if a.iter().all(Value::is_string) => a
            .iter()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect(),
        Value::Array(a) if a.iter().all(Value::is_number) => {
            vec![Value::Array(a.clone()).to_string()]
        }
        Value::Array(a) => a.iter().map(Value::to_string).collect(),
        _ => return bad_request("`input` must be a string or an array"),
    };
    if let Err(e) = app.arrive() {
        return e.resp();
    }
    if app.engine.admit().await.is_err() {
        return ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "InternalServerError",
            message: "The request was aborted (the engine was put to sleep).".into(),
            param: None,
        }
        .resp();
    }
    app.run_request();
    let prompt_tokens: u64 = inputs.iter().map(|s| count_tokens(s)).sum();
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, s)| json!({"index": i, "object": "embedding", "embedding": embed(s)}))
        .collect();
    app.engine
        .prompt_tokens
        .fetch_add(prompt_tokens, Ordering::SeqCst);
    app.engine.served.fetch_add(1, Ordering::SeqCst);
    json(
        StatusCode::OK,
        &json!({
            "id": format!("embd-{}", random_hex()), "object": "list", "created": now_s(),
            "model": model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": null},
        }),
    )
}

async fn generate(app: Arc<App>, body: Incoming, kind: Kind) -> Resp {
    let v = match read_json(body).await {
        Ok(v) => v,
        Err(e) => return e.resp(),
    };
    let model = match resolve_model(&app, &v) {
        Ok(m) => m,
        Err(e) => return e.resp(),
    };
    let prompt_tokens = match kind {
        Kind::Chat => match v["messages"].as_array() {
            Some(msgs) => msgs
                .iter()
                .map(|m| 4 + count_tokens(&content_text(&m["content"])))
                .sum(),
            None => return bad_request("`messages` is required"),
        },
        Kind::Completion => match &v["prompt"] {
            Value::String(s) => count_tokens(s),
            Value::Array(a) => a.len() as u64,
            _ => return bad_request("`prompt` is required"),
        },
    };
    let max_tokens = v["max_completion_tokens"]
        .as_u64()
        .or_else(|| v["max_tokens"].as_u64())
        .unwrap_or(app.engine.args.sim.max_tokens_default);
    let stream = v["stream"].as_bool().unwrap_or(false);
    let opts = &v["stream_options"];
    let job = Gen {
        kind,
        id: match kind {
            Kind::Chat => format!("chatcmpl-{}", random_hex()),
            Kind::Completion => format!("cmpl-{}", random_hex()),
        },
        created: now_s(),
        model,
        prompt_tokens,
        max_tokens,
        ignore_eos: v["ignore_eos"].as_bool().unwrap_or(false),
        include_usage: opts["include_usage"].as_bool().unwrap_or(false),
        continuous_usage: opts["continuous_usage_stats"].as_bool().unwrap_or(false),
    };
    if let Err(e) = app.arrive() {
        return e.resp();
    }
    if stream {
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        tokio::spawn(run_stream(app, job, tx));
        let body = StreamBody::new(UnboundedReceiverStream::new(rx).map(|b| Ok(Frame::data(b))));
        return Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
            .body(body.boxed())
            .expect("valid response");
    }
    let mut text = String::new();
    let Some((n, finish)) = run_tokens(&app, &job, |t| {
        text.push_str(t);
        true
    })
    .await
    else {
        return crate::server::engine_dead().resp();
    };
    let usage = usage(&job, n);
    let choice = match kind {
        Kind::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": null, "annotations": null,
                        "audio": null, "function_call": null, "tool_calls": [], "reasoning_content": null},
            "logprobs": null, "finish_reason": finish, "stop_reason": null,
        }),
        Kind::Completion => json!({
            "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
            "stop_reason": null, "prompt_logprobs": null,
        }),
    };
    let object = if kind == Kind::Chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    json(
        StatusCode::OK,
        &json!({
            "id": job.id, "object": object, "created": job.created, "model": job.model,
            "choices": [choice], "service_tier": null, "system_fingerprint": null,
            "usage": usage, "prompt_logprobs": null, "kv_transfer_params": null,
        }),
    )
}

/// A request's prefill chunks in the KV-cache gauge, for as long as it lives.
struct Prefilled<'a>(&'a crate::engine::Engine, u64);

impl Prefilled<'_> {
    fn chunk(&mut self) {
        self.0.prefill_chunks.fetch_add(1, Ordering::SeqCst);
        self.1 += 1;
    }
}

impl Drop for Prefilled<'_> {
    fn drop(&mut self) {
        self.0.prefill_chunks.fetch_sub(self.1, Ordering::SeqCst);
    }
}

/// How long one chunk of a prefill takes (`--prefill-time` is made of these).
const PREFILL_CHUNK: Duration = Duration::from_millis(100);

/// One request in `vllm:num_requests_running`, for as long as it lives.
struct Running<'a>(&'a crate::engine::Engine);

impl<'a> Running<'a> {
    fn start(engine: &'a crate::engine::Engine) -> Self {
        engine.request_started();
        Running(engine)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}

/// Lateness of a paced step past which it counts as a stall, not made up.
const STALL: Duration = Duration::from_millis(50);

/// Waits for admission, then produces tokens through `emit` (false: the client is gone).
/// Returns the number of tokens and the finish reason; None if the engine core died
/// meanwhile (vLLM's output handler fails every request in flight with `EngineDeadError`:
/// a 500, or an error event in a stream; the answer is not cut off).
async fn run_tokens(
    app: &App,
    job: &Gen,
    mut emit: impl FnMut(&str) -> bool,
) -> Option<(u64, &'static str)> {
    let engine = &app.engine;
    let Ok(epoch) = engine.admit().await else {
        // Aborted by a `/sleep` while held: nothing was generated.
        engine
            .prompt_tokens
            .fetch_add(job.prompt_tokens, Ordering::SeqCst);
        return Some((0, "abort"));
    };
    // Counted as running until it ends or its handler is dropped: a
    // client that hangs up mid-answer aborts it (vLLM's `with_cancellation`
    // cancels the handler, which aborts the request; before, the gauge
    // kept counting it for ever and the engine never looked idle).
    app.run_request();
    let running = Running::start(engine);
    let garbage = !engine.weights_intact();
    let natural = ANSWER.len() as u64;
    let (n, mut finish) = if garbage || job.ignore_eos || job.max_tokens < natural {
        (job.max_tokens, "length")
    } else {
        (natural, "stop")
    };
    let tps = engine.args.sim.tokens_per_second;
    // One token per decode step, on a steady clock. Not tokio's sleep: its
    // timer has a 1 ms grain, so a 500 µs step lasted until the next
    // millisecond boundary (1–2 ms at 2,000 tokens/s) and the first token
    // came 0.5–1.5 ms after the request depending on where in the
    // millisecond it arrived: two clients asking in turn (straight to the
    // engine, then through a proxy) met different phases of that grid, and
    // the difference in their first bytes measured the grid, not the path.
    // async-io's timer fires to the kernel's high-resolution clock (a
    // timerfd behind its reactor).
    let period = (tps > 0.0).then(|| Duration::from_secs_f64(1.0 / tps));
    let mut step = Timer::never();
    let mut produced = 0;
    let mut dead = false;
    // The prefill (`--prefill-time`): running, no token yet, the KV cache growing a chunk
    // at a time; a paused scheduler holds it between chunks, as it holds a decode.
    let mut prefilled = Prefilled(engine, 0);
    let prefill = engine.args.sim.prefill_time;
    let chunks = prefill.as_nanos().div_ceil(PREFILL_CHUNK.as_nanos()) as u32;
    let mut n = n;
    for _ in 0..chunks {
        if !engine.core_alive() {
            (dead, n) = (true, 0);
            break;
        }
        if engine.step(epoch).await.is_err() {
            (finish, n) = ("abort", 0);
            break;
        }
        Timer::after(prefill / chunks).await;
        prefilled.chunk();
    }
    let mut next = std::time::Instant::now();
    for i in 0..n {
        if !engine.core_alive() {
            dead = true;
            break;
        }
        if engine.step(epoch).await.is_err() {
            finish = "abort";
            break;
        }
        if let Some(p) = period {
            // On a fixed schedule: a step a little late does not delay the
            // ones after it. A stall (a paused scheduler holding the
            // request, a stopped process) is not made up in a burst of
            // tokens afterwards: vLLM's steps after one are paced again.
            next += p;
            let now = std::time::Instant::now();
            if next + p.max(STALL) < now {
                next = now + p;
            }
            step.set_at(next);
            (&mut step).await;
        }
        let tok = if garbage {
            GARBAGE
        } else {
            ANSWER[(i % natural) as usize]
        };
        produced += 1;
        // Counted per step, as vLLM's iteration stats are (a drain's
        // progress shows in the counter while it runs).
        engine.generation_tokens.fetch_add(1, Ordering::SeqCst);
        if !emit(tok) {
            finish = "abort";
            break;
        }
    }
    drop((running, prefilled));
    engine
        .prompt_tokens
        .fetch_add(job.prompt_tokens, Ordering::SeqCst);
    engine.served.fetch_add(1, Ordering::SeqCst);
    (!dead).then_some((produced, finish))
}

async fn run_stream(app: Arc<App>, job: Gen, tx: mpsc::UnboundedSender<Bytes>) {
    let sse = |v: &Value| Bytes::from(format!("data: {v}\n\n"));
    let chunk = |choices: Value, produced: u64, usage_always: bool| {
        let object = if job.kind == Kind::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let mut c = json!({"id": job.id, "object": object, "created": job.created,
                           "model": job.model, "choices": choices});
        if usage_always || (job.include_usage && job.continuous_usage) {
            c["usage"] = usage(&job, produced);
        }
        c
    };
    let delta = |text: &str, finish: Option<&str>| match job.kind {
        Kind::Chat => json!([{"index": 0, "delta": {"content": text}, "logprobs": null,
                              "finish_reason": finish, "stop_reason": null}]),
        Kind::Completion => json!([{"index": 0, "text": text, "logprobs": null,
                                    "finish_reason": finish, "stop_reason": null}]),
    };
    // Tokens are sent one behind so that the last one carries the finish reason, as vLLM does.
    let mut pending: Option<String> = None;
    let mut produced = 0u64;
    let mut first = true;
    let outcome = run_tokens(&app, &job, |tok| {
        if first && job.kind == Kind::Chat {
            let role = json!([{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": null, "finish_reason": null}]);
            if tx.send(sse(&chunk(role, 0, false))).is_err() {
                return false;
            }
        }
        first = false;
        let ok = match pending.replace(tok.to_string()) {
            Some(prev) => tx
                .send(sse(&chunk(delta(&prev, None), produced, false)))
                .is_ok(),
            None => true,
        };
        produced += 1;
        ok
    })
    .await;
    let Some((n, finish)) = outcome else {
        // vLLM's stream generator sends the error as an event, then `[DONE]`.
        let e = crate::server::engine_dead();
        let error = json!({"error": {"message": e.message, "type": e.kind, "param": null,
                                     "code": e.status.as_u16()}});
        let _ = tx.send(sse(&error));
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n"));
        return;
    };
    let last = pending.take().unwrap_or_default();
    let _ = tx.send(sse(&chunk(delta(&last, Some(finish)), n, false)));
    if job.include_usage {
        let _ = tx.send(sse(&chunk(json!([]), n, true)));
    }
    let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n"));
}

fn usage(job: &Gen, completion: u64) -> Value {
    json!({"prompt_tokens": job.prompt_tokens, "total_tokens": job.prompt_tokens + completion,
           "completion_tokens": completion, "prompt_tokens_details": null})
}

/// The model named in the body (the first served name when absent, `null` or `""`, as
/// vLLM's `_is_model_supported` reads it); vLLM answers with its first served name whichever
/// alias was asked for.
fn resolve_model(app: &App, v: &Value) -> Result<String, ApiError> {
    let names = app.engine.args.served_names();
    match v["model"].as_str() {
        None | Some("") => Ok(names[0].clone()),
        Some(m) if names.iter().any(|n| n == m) => Ok(names[0].clone()),
        Some(m) => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!("The model `{m}` does not exist."),
            param: Some("model"),
        }),
    }
}

fn bad_request(msg: &str) -> Resp {
    ApiError::bad_request(msg).resp()
}

fn content_text(c: &Value) -> String {
    match c {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

fn count_tokens(s: &str) -> u64 {
    s.split_whitespace().count().max(1) as u64
}

fn embed(s: &str) -> Vec<f64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let v: Vec<f64> = (0..32)
        .map(|i| {
            for b in s.bytes().chain([i as u8]) {
                h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
            }
            (h % 2001) as f64 / 1000.0 - 1.0
        })
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-9);
    v.into_iter().map(|x| x / norm).collect()
}

fn random_hex() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn now_s() -> u64 {
    crate::engine::unix_ns() / 1_000_000_000
}
