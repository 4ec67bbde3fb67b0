//! fake-vllm's behaviour, over HTTP against the real binary (`cargo build -p fake-vllm` first).

use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use siesta_tests::{
    DEADLINE, FakeVllm, any_alive, proc_stat, spawn_fake_vllm, spawn_fake_vllm_env, wait_until,
};

fn http() -> reqwest::Client {
    reqwest::Client::new()
}

async fn post(url: &str) -> reqwest::Response {
    http().post(url).send().await.unwrap()
}

async fn post_json(url: &str, body: &Value) -> reqwest::Response {
    http().post(url).json(body).send().await.unwrap()
}

async fn get_json(url: &str) -> Value {
    http().get(url).send().await.unwrap().json().await.unwrap()
}

async fn is_sleeping(fv: &FakeVllm) -> bool {
    get_json(&fv.at("/is_sleeping")).await["is_sleeping"]
        .as_bool()
        .unwrap()
}

async fn stats(fv: &FakeVllm) -> Value {
    get_json(&fv.at("/fake/stats")).await
}

/// The value of the sample of `name` whose labels contain `label` (e.g. `sleep_state="awake"`).
async fn metric(fv: &FakeVllm, name: &str, label: &str) -> f64 {
    let text = http()
        .get(fv.at("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .unwrap_or_else(|| panic!("no {name} {label} in:\n{text}"));
    assert!(
        line.contains("model_name=\"") && line.contains("engine=\"0\""),
        "{line}"
    );
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

async fn sleep_state(fv: &FakeVllm) -> (f64, f64, f64) {
    let s = "vllm:engine_sleep_state";
    (
        metric(fv, s, "sleep_state=\"awake\"").await,
        metric(fv, s, "sleep_state=\"weights_offloaded\"").await,
        metric(fv, s, "sleep_state=\"discard_all\"").await,
    )
}

async fn complete(fv: &FakeVllm, max_tokens: u64) -> String {
    let r = post_json(
        &fv.at("/v1/completions"),
        &json!({"prompt": "hi", "max_tokens": max_tokens}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

fn is_garbage(text: &str) -> bool {
    !text.is_empty() && text.chars().all(|c| c == '!')
}

#[tokio::test]
async fn sleep_and_wake_level_1() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode"]).await;
    assert!(!is_sleeping(&fv).await);
    assert_eq!(sleep_state(&fv).await, (1.0, 0.0, 0.0));
    let good = complete(&fv, 4).await;
    assert!(!is_garbage(&good), "{good}");

    let r = post(&fv.at("/sleep?level=1")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"status": "sleeping", "level": 1}),
        "vLLM 0.33's body"
    );
    assert!(is_sleeping(&fv).await);
    assert_eq!(sleep_state(&fv).await, (0.0, 1.0, 0.0));
    assert_eq!(
        get_json(&fv.at("/fake/stats")).await["state"],
        "weights_offloaded"
    );
    // Health and the model list work while asleep.
    assert_eq!(
        http().get(fv.at("/health")).send().await.unwrap().status(),
        200
    );
    assert_eq!(get_json(&fv.at("/v1/models")).await["data"][0]["id"], "m");

    let before = stats(&fv).await["last_wake_finished_unix_ns"].clone();
    assert!(before.is_null());
    let r = post(&fv.at("/wake_up")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"status": "awake", "tags": null})
    );
    assert!(!is_sleeping(&fv).await);
    assert_eq!(sleep_state(&fv).await, (1.0, 0.0, 0.0));
    assert_eq!(complete(&fv, 4).await, good, "level 1 keeps the weights");
    let s = stats(&fv).await;
    assert_eq!(
        (s["sleeps"].as_u64(), s["wakes"].as_u64()),
        (Some(1), Some(1))
    );
    assert!(s["last_wake_finished_unix_ns"].as_u64().unwrap() > 1_700_000_000_000_000_000);
}

#[tokio::test]
async fn level_2_wake_needs_reload_weights() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--tensor-parallel-size", "2"]).await;
    let good = complete(&fv, 5).await;

    // Woken without reload_weights: garbage, with no warning.
    assert_eq!(post(&fv.at("/sleep?level=2")).await.status(), 200);
    assert_eq!(sleep_state(&fv).await, (0.0, 0.0, 1.0));
    assert_eq!(post(&fv.at("/wake_up")).await.status(), 200);
    assert!(!is_sleeping(&fv).await);
    assert!(is_garbage(&complete(&fv, 5).await));

    // The four-call wake that siesta uses gives correct answers again.
    assert_eq!(post(&fv.at("/sleep?level=2&mode=wait")).await.status(), 200);
    assert_eq!(post(&fv.at("/wake_up?tags=weights")).await.status(), 200);
    assert!(
        is_sleeping(&fv).await,
        "still sleeping until kv_cache is awake"
    );
    let r = post_json(
        &fv.at("/collective_rpc"),
        &json!({"method": "reload_weights"}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"results": [null, null]})
    );
    assert_eq!(post(&fv.at("/wake_up?tags=kv_cache")).await.status(), 200);
    assert_eq!(post(&fv.at("/reset_prefix_cache")).await.status(), 200);
    assert!(!is_sleeping(&fv).await);
    assert_eq!(sleep_state(&fv).await, (1.0, 0.0, 0.0));
    assert_eq!(complete(&fv, 5).await, good);

    // reload_weights while the weights are asleep is an engine error; a missing method is 400.
    assert_eq!(post(&fv.at("/sleep?level=2")).await.status(), 200);
    let r = post_json(
        &fv.at("/collective_rpc"),
        &json!({"method": "reload_weights"}),
    )
    .await;
    assert_eq!(r.status(), 500);
    assert_eq!(
        post_json(&fv.at("/collective_rpc"), &json!({}))
            .await
            .status(),
        400
    );
}

#[tokio::test]
async fn a_request_is_held_while_asleep_and_answered_after_wake() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode"]).await;
    assert_eq!(post(&fv.at("/sleep?level=1")).await.status(), 200);
    let url = fv.at("/v1/chat/completions");
    let held = tokio::spawn(async move {
        let body =
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
        let r = post_json(&url, &body).await;
        (r.status(), r.json::<Value>().await.unwrap())
    });
    wait_until("the request to be held", DEADLINE, || async {
        stats(&fv).await["held"] == 1
    })
    .await;
    // A paused vLLM engine takes no steps: its gauges do not count the held request.
    assert_eq!(metric(&fv, "vllm:num_requests_waiting", "").await, 0.0);
    assert_eq!(metric(&fv, "vllm:num_requests_running", "").await, 0.0);
    assert!(
        !held.is_finished(),
        "a request to a sleeping engine must not be answered"
    );
    assert_eq!(post(&fv.at("/wake_up")).await.status(), 200);
    let (status, body) = tokio::time::timeout(DEADLINE, held).await.unwrap().unwrap();
    assert_eq!(status, 200);
    assert_eq!(body["choices"][0]["message"]["content"], "Hello! I am");
    assert_eq!(body["usage"]["completion_tokens"], 3);
    assert_eq!(stats(&fv).await["held"], 0);
}

/// A client that hangs up mid-answer aborts its request, streamed or not,
/// as vLLM's `with_cancellation` does: `vllm:num_requests_running` drops
/// back to 0 long before the answer would have ended (before, a whole
/// answer's request stayed counted for ever, so the engine never looked
/// idle again).
#[tokio::test]
async fn a_client_that_hangs_up_aborts_its_request() {
    let fv = spawn_fake_vllm(&["m", "--tokens-per-second", "5"]).await;
    for stream in [false, true] {
        let url = fv.at("/v1/chat/completions");
        // 500 tokens at 5 tokens/s: 100 s.
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 500, "ignore_eos": true, "stream": stream});
        let client = tokio::spawn(async move {
            let r = post_json(&url, &body).await;
            r.bytes().await.map(|b| b.len())
        });
        wait_until("the request to run", DEADLINE, || async {
            metric(&fv, "vllm:num_requests_running", "").await == 1.0
        })
        .await;
        client.abort();
        wait_until("the request aborted", DEADLINE, || async {
            metric(&fv, "vllm:num_requests_running", "").await == 0.0
        })
        .await;
    }
}

/// Splits an SSE body into its `data:` payloads, checking the framing.
fn sse_events(body: &str) -> Vec<String> {
    assert!(
        body.ends_with("data: [DONE]\n\n"),
        "stream must end with [DONE]: {body:?}"
    );
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            assert!(
                e.starts_with("data: ") && !e.contains('\n'),
                "bad event {e:?}"
            );
            e["data: ".len()..].to_string()
        })
        .collect()
}

#[tokio::test]
async fn chat_stream_has_vllm_chunks_usage_and_done() {
    let fv = spawn_fake_vllm(&["m", "--served-model-name", "a", "b"]).await;
    let body = json!({"model": "b", "messages": [{"role": "user", "content": "hello there"}],
                      "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}});
    let r = post_json(&fv.at("/v1/chat/completions"), &body).await;
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = sse_events(&r.text().await.unwrap());
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
        assert_eq!(c["model"], "a", "vLLM answers with its first served name");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let (usage_chunk, content_chunks) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 4);
    let p = usage_chunk["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        usage_chunk["usage"]["total_tokens"].as_u64().unwrap(),
        p + 4
    );
    let text: String = content_chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "Hello! I am a");
    let last = content_chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(
        content_chunks[..content_chunks.len() - 1]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null())
    );
    assert!(content_chunks.iter().all(|c| c.get("usage").is_none()));

    // Completions: `text_completion` chunks, no usage unless asked, natural stop.
    let body = json!({"model": "a", "prompt": "x", "max_tokens": 1000, "stream": true});
    let r = post_json(&fv.at("/v1/completions"), &body).await;
    let events = sse_events(&r.text().await.unwrap());
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "text_completion" && c.get("usage").is_none())
    );
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, complete(&fv, 1000).await);
}

/// `--tokens-per-second` paces each token to the kernel's clock, finer
/// than a millisecond: 400 tokens at 4,000 a second take 100 ms. With
/// tokio's sleep (1 ms grain) every 250 µs step lasted until the next
/// millisecond boundary and they took 400 ms or more, and the first byte
/// moved with where in the millisecond a request arrived (benchmarks
/// comparing two paths measured that grid).
#[tokio::test]
async fn paced_tokens_keep_a_sub_millisecond_step() {
    let fv = spawn_fake_vllm(&["m", "--tokens-per-second", "4000"]).await;
    let body = json!({"model": "m", "prompt": "x", "max_tokens": 400,
                      "ignore_eos": true, "stream": true});
    // A first request warms the connection and the server.
    post_json(&fv.at("/v1/completions"), &body)
        .await
        .text()
        .await
        .unwrap();
    let start = std::time::Instant::now();
    let text = post_json(&fv.at("/v1/completions"), &body)
        .await
        .text()
        .await
        .unwrap();
    let took = start.elapsed();
    assert_eq!(sse_events(&text).len(), 401, "400 tokens and [DONE]");
    assert!(
        took >= Duration::from_millis(99),
        "faster than the pace: {took:?}"
    );
    // 200 ms of room for a loaded box; the 1 ms grain takes 400 at least.
    assert!(took < Duration::from_millis(300), "{took:?}");
}

/// A paced answer whose server stalls (here SIGSTOP for 1.5 s; in vLLM a
/// scheduler paused by a sleep) goes on at its pace afterwards: the steps
/// missed meanwhile are not sent in a burst, as vLLM's are not made up.
/// On a fixed schedule alone the 30 missed tokens came at once on SIGCONT
/// and the rest of the answer took 0.2 s.
#[tokio::test]
async fn a_stalled_paced_answer_goes_on_at_its_pace() {
    let fv = spawn_fake_vllm(&["m", "--tokens-per-second", "20"]).await;
    let body = json!({"model": "m", "prompt": "x", "max_tokens": 40,
                      "ignore_eos": true, "stream": true});
    let mut stream = post_json(&fv.at("/v1/completions"), &body).await;
    let mut events = 0;
    while events < 5 {
        let chunk = stream
            .chunk()
            .await
            .unwrap()
            .expect("events before the stall");
        events += sse_events_in(&chunk);
    }
    fv.child.signal(Signal::SIGSTOP);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    fv.child.signal(Signal::SIGCONT);
    let resumed = std::time::Instant::now();
    while let Some(chunk) = stream.chunk().await.unwrap() {
        events += sse_events_in(&chunk);
    }
    let rest = resumed.elapsed();
    assert_eq!(events, 41, "40 tokens and [DONE]");
    // About 34 tokens were left at 50 ms each: 1.7 s.
    assert!(
        rest >= Duration::from_millis(1000),
        "the rest came in {rest:?}"
    );
}

/// A prefill (`--prefill-time`) is running and generates nothing, as vLLM's: its prompt
/// tokens count with its first token; only the KV-cache gauge grows, chunk by chunk. A paused
/// scheduler (`mode=keep`) holds it: the cache stops growing until the wake.
#[tokio::test]
async fn a_prefill_runs_without_tokens_while_its_cache_grows() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--prefill-time", "3s"]).await;
    let (client, url) = (http(), fv.at("/v1/completions"));
    let request = tokio::spawn(async move {
        let body = json!({"prompt": "x", "max_tokens": 2});
        client.post(url).json(&body).send().await.unwrap().status()
    });
    let running = "vllm:num_requests_running";
    let kv = "vllm:kv_cache_usage_perc";
    let tokens = "vllm:generation_tokens_total";
    wait_until("the request to run", DEADLINE, || async {
        metric(&fv, running, "").await == 1.0
    })
    .await;
    let first = metric(&fv, kv, "").await;
    wait_until("the cache to grow", DEADLINE, || async {
        metric(&fv, kv, "").await > first
    })
    .await;
    assert_eq!(
        metric(&fv, tokens, "").await,
        0.0,
        "no token while it prefills"
    );
    assert_eq!(post(&fv.at("/sleep?level=0&mode=keep")).await.status(), 200);
    // A chunk under way when the pause came ends, as vLLM's step does.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let held = metric(&fv, kv, "").await;
    // No growth can only be sampled: four chunks' time.
    tokio::time::sleep(Duration::from_millis(400)).await;
    // At most the one chunk a loaded box may still be finishing; running, four more.
    let grew = metric(&fv, kv, "").await - held;
    assert!(grew < 0.0015, "held by the paused scheduler: grew {grew}");
    assert_eq!(post(&fv.at("/wake_up")).await.status(), 200);
    assert_eq!(request.await.unwrap(), 200);
    assert_eq!(metric(&fv, tokens, "").await, 2.0);
    assert_eq!(metric(&fv, running, "").await, 0.0);
}

/// vLLM's OpenAI routes take only `Content-Type: application/json` (any parameters after
/// it, no space before them): anything else, or none, is a 400 before the body is read.
#[tokio::test]
async fn a_request_not_said_to_be_json_is_refused() {
    let fv = spawn_fake_vllm(&["m"]).await;
    let body = r#"{"model": "m", "prompt": "x", "max_tokens": 1}"#;
    let url = fv.at("/v1/completions");
    for v in siesta_tests::ctl::refused_types(&url, body).await {
        assert_eq!(v["error"]["type"], "Bad Request", "{v}");
    }
    siesta_tests::ctl::json_taken(&url, body).await;
    assert_eq!(
        stats(&fv).await["requests_arrived"],
        1,
        "the refused ones never reached the engine"
    );
}

fn sse_events_in(chunk: &[u8]) -> usize {
    chunk
        .split(|&b| b == b'\n')
        .filter(|l| l.starts_with(b"data:"))
        .count()
}

#[tokio::test]
async fn openai_shapes_models_errors_embeddings() {
    let fv = spawn_fake_vllm(&[
        "org/model",
        "--served-model-name",
        "a",
        "b",
        "--max-model-len",
        "4096",
        "--dtype",
        "bfloat16",
        "--disable-custom-all-reduce",
        "--gpu-memory-utilization",
        "0.4",
        "-tp",
        "2",
        "--trust-remote-code",
        "--runner",
        "pooling",
    ])
    .await;
    let models = get_json(&fv.at("/v1/models")).await;
    assert_eq!(models["object"], "list");
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!(models["data"][0]["root"], "org/model");
    assert_eq!(models["data"][0]["max_model_len"], 4096);
    assert_eq!(models["data"][0]["owned_by"], "vllm");
    assert!(get_json(&fv.at("/version")).await["version"].is_string());
    assert_eq!(post(&fv.at("/ping")).await.status(), 200);

    let r = post_json(
        &fv.at("/v1/chat/completions"),
        &json!({"model": "nope", "messages": []}),
    )
    .await;
    assert_eq!(r.status(), 404);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "NotFoundError");
    assert_eq!(e["error"]["code"], 404);
    let r = http()
        .post(fv.at("/v1/completions"))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    let r = post_json(
        &fv.at("/v1/embeddings"),
        &json!({"model": "a", "input": ["x", "y z"]}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert_eq!(v["data"][1]["object"], "embedding");
    assert!(!v["data"][0]["embedding"].as_array().unwrap().is_empty());
}

#[tokio::test]
async fn dev_endpoints_exist_only_in_dev_mode() {
    let fv = spawn_fake_vllm_env(
        &["m", "--enable-sleep-mode"],
        &[("VLLM_SERVER_DEV_MODE", "0")],
    )
    .await;
    for path in [
        "/sleep?level=1",
        "/wake_up",
        "/collective_rpc",
        "/reset_prefix_cache",
    ] {
        assert_eq!(post(&fv.at(path)).await.status(), 404, "{path}");
    }
    assert_eq!(
        http()
            .get(fv.at("/is_sleeping"))
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    // The sleep-state gauge is exported without dev mode too.
    assert_eq!(sleep_state(&fv).await, (1.0, 0.0, 0.0));
    assert_eq!(
        http().get(fv.at("/health")).send().await.unwrap().status(),
        200
    );

    // Dev mode without --enable-sleep-mode: vLLM 0.33 and 0.24 (the GPU machine's) sleep,
    // freeing nothing; older versions (V0's engine) refuse.
    for version in ["0.33.0", "0.24.0"] {
        let fv = spawn_fake_vllm(&["m", "--imitate-version", version]).await;
        assert_eq!(
            post(&fv.at("/sleep?level=1")).await.status(),
            200,
            "{version}"
        );
        assert!(is_sleeping(&fv).await, "{version}");
    }
    let fv = spawn_fake_vllm(&["m", "--imitate-version", "0.10.0"]).await;
    assert_eq!(post(&fv.at("/sleep?level=1")).await.status(), 500);
    assert!(!is_sleeping(&fv).await);
}

#[tokio::test]
async fn engine_core_child_is_gone_after_sigterm() {
    let mut fv = spawn_fake_vllm(&["m"]).await;
    let core = stats(&fv).await["engine_core_pid"].as_i64().unwrap() as i32;
    let st = proc_stat(core).expect("engine core runs");
    assert_eq!(st.ppid, fv.child.pid() as i32);
    assert_eq!(
        st.pgrp,
        fv.child.pgid(),
        "engine core shares the server's process group"
    );
    assert_eq!(st.comm, "VLLM::EngineCor");
    fv.child.signal(Signal::SIGTERM);
    let status = fv.child.wait_exit(DEADLINE).await;
    assert!(status.success(), "{status}");
    wait_until("the engine core to exit", DEADLINE, || async {
        any_alive(&[core]).is_empty()
    })
    .await;
    assert!(fv.child.group_members().is_empty());
}

#[tokio::test]
async fn kind_engine_core_exits_when_its_server_is_sigkilled() {
    let mut fv = spawn_fake_vllm(&["m", "--engine-core-dies-with-parent"]).await;
    let core = stats(&fv).await["engine_core_pid"].as_i64().unwrap() as i32;
    fv.child.signal(Signal::SIGKILL);
    fv.child.wait_exit(DEADLINE).await;
    wait_until("the orphaned engine core to exit", DEADLINE, || async {
        any_alive(&[core]).is_empty()
    })
    .await;
}

#[tokio::test]
async fn engine_core_outlives_a_sigkilled_server_by_default() {
    let mut fv = spawn_fake_vllm(&["m"]).await;
    let core = stats(&fv).await["engine_core_pid"].as_i64().unwrap() as i32;
    fv.child.signal(Signal::SIGKILL);
    fv.child.wait_exit(DEADLINE).await;
    // Absence of exit can only be sampled: give it several of its 50 ms polls.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        any_alive(&[core]),
        vec![core],
        "like vLLM (#55510) the engine core survives"
    );
    fv.child.signal_group(Signal::SIGKILL);
    wait_until(
        "the group kill to reach the engine core",
        DEADLINE,
        || async { any_alive(&[core]).is_empty() },
    )
    .await;
}

/// A JSON body that starts with a UTF-8 byte order mark is read as vLLM
/// reads it (Python's `json.loads` of the bytes decodes `utf-8-sig`): 200,
/// not a 400 "JSON decode error" (which made siesta-proxy's BOM routing,
/// README "The proxy", fail end to end on the demo's engines).
#[tokio::test]
async fn a_body_with_a_byte_order_mark_is_read_as_vllm_reads_it() {
    let fv = spawn_fake_vllm(&["m"]).await;
    let body =
        r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}"#;
    let mut bom = b"\xef\xbb\xbf".to_vec();
    bom.extend_from_slice(body.as_bytes());
    let r = http()
        .post(fv.at("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(bom)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    // Not a way around the JSON check: a BOM before garbage is still a 400.
    let r = http()
        .post(fv.at("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(b"\xef\xbb\xbfnot json".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}
