//! Faults around the proxy: the proxy killed with requests held or in
//! flight, and an engine that dies in the middle of a streamed response.

use futures::StreamExt;
use serde_json::{Value, json};
use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;
use siesta_tests::{DEADLINE, spawn_proxy, wait_until};
use std::time::Duration;

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

fn chat_body(model: &str, stream: bool, max_tokens: u32) -> Value {
    json!({"model": model, "max_tokens": max_tokens, "stream": stream,
           "messages": [{"role": "user", "content": "hi"}]})
}

async fn ready(proxy: &siesta_tests::ProxyProc) {
    let url = format!("{}/readyz", proxy.admin_url());
    let url2 = format!("{}/readyz", proxy.url());
    wait_until("proxy ready", DEADLINE, || async {
        for u in [&url, &url2] {
            if matches!(http().get(u).send().await, Ok(r) if r.status() == 200) {
                return true;
            }
        }
        false
    })
    .await;
}

#[tokio::test]
async fn proxy_killed_with_requests_held_then_restarted_serves_and_engines_are_untouched() {
    let model = fake_model("sleepy", "asleep", &["--wake-time", "3s"], "");
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let pid = wait_state(&mut c, "sleepy", pb::ModelState::Asleep, LONG)
        .await
        .pid;
    let mut proxy = spawn_proxy(&[ctl.url()], &[]).await;
    ready(&proxy).await;
    let url = format!("{}/v1/chat/completions", proxy.url());
    let held: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                http()
                    .post(&url)
                    .json(&chat_body("sleepy", false, 4))
                    .send()
                    .await
            })
        })
        .collect();
    // The proxy asked for the model: it is waking, the requests are held.
    wait_state(&mut c, "sleepy", pb::ModelState::Waking, LONG).await;
    proxy.kill9();
    for h in held {
        assert!(h.await.unwrap().is_err(), "a held request got an answer");
    }
    proxy.restart().await;
    ready(&proxy).await;
    let url = format!("{}/v1/chat/completions", proxy.url());
    let r = http()
        .post(&url)
        .json(&chat_body("sleepy", false, 4))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let s = status(&mut c, "sleepy").await;
    assert_eq!(state(&s), pb::ModelState::Awake);
    assert_eq!(s.pid, pid, "engine was replaced");
    assert_eq!(s.failures, 0);
}

/// A proxy killed (-9) with a request in flight cannot say it is gone:
/// control drops its counts once it has been silent 10 s (it re-reports
/// every second while it has any), so an operator's sleep waiting for that
/// request goes ahead then, not 30 s later as before.
#[tokio::test]
async fn a_proxy_killed_with_a_request_in_flight_stops_counting_within_seconds() {
    let model = fake_model("busy", "awake", &["--tokens-per-second", "10"], "");
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "busy", pb::ModelState::Awake, LONG).await;
    let mut proxy = spawn_proxy(&[ctl.url()], &[]).await;
    ready(&proxy).await;
    let url = format!("{}/v1/chat/completions", proxy.url());
    let resp = http()
        .post(&url)
        .json(&chat_body("busy", true, 1000))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    assert!(
        stream.next().await.is_some_and(|c| c.is_ok()),
        "first chunk"
    );
    wait_status(&mut c, "busy", "the proxy's request counted", LONG, |s| {
        s.in_flight > 0
    })
    .await;
    c.sleep(pb::SleepRequest {
        name: "busy".into(),
        level: 1,
    })
    .await
    .unwrap();
    proxy.kill9();
    let killed = std::time::Instant::now();
    drop(stream);
    wait_state(&mut c, "busy", pb::ModelState::Asleep, LONG).await;
    let took = killed.elapsed();
    eprintln!("asleep {took:?} after the proxy was killed");
    assert!(
        took < Duration::from_secs(22),
        "the killed proxy's request counted for {took:?}"
    );
}

#[tokio::test]
async fn engine_dying_mid_stream_ends_the_stream_with_an_error_event_and_is_restarted() {
    let model = fake_model(
        "chat",
        "awake",
        &["--tokens-per-second", "5"],
        "backoff_initial = \"200ms\"",
    );
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let pid = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG)
        .await
        .pid as i32;
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    ready(&proxy).await;
    let resp = http()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&chat_body("chat", true, 200))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let mut text = String::new();
    while !text.contains("chat.completion.chunk") {
        let chunk = tokio::time::timeout(DEADLINE, body.next())
            .await
            .expect("first chunk")
            .expect("stream ended early")
            .expect("chunk");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    // The engine dies while the response streams.
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // The rest of the stream ends cleanly (no transport error) with an error event.
    while let Some(chunk) = tokio::time::timeout(DEADLINE, body.next())
        .await
        .expect("stream end")
    {
        text.push_str(&String::from_utf8_lossy(
            &chunk.expect("clean end, not a cut stream"),
        ));
    }
    let last = text
        .trim_end()
        .rsplit("\n\n")
        .next()
        .unwrap()
        .trim()
        .to_string();
    let event: Value = serde_json::from_str(last.strip_prefix("data: ").expect(&last)).unwrap();
    assert_eq!(event["error"]["code"], "engine_failed", "{text}");
    assert!(!text.contains("[DONE]"));
    // The engine is restarted and serves again.
    let s = wait_status(&mut c, "chat", "restarted", LONG, |s| {
        state(s) == pb::ModelState::Awake && s.pid as i32 != pid
    })
    .await;
    assert!(chat(&endpoint(&s), "chat").await.contains("siesta"));
    assert!(siesta_tests::group_members(pid).is_empty());
}

#[tokio::test]
async fn engine_dying_before_answering_is_a_502() {
    let model = fake_model(
        "chat",
        "awake",
        &["--crash-after-requests", "0"],
        "backoff_initial = \"200ms\"",
    );
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    ready(&proxy).await;
    let r = http()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&chat_body("chat", true, 4))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].is_string(), "{v}");
}

/// Only the engine core dies (a CUDA error, an out-of-memory kill), as on
/// a real GPU: vLLM's server answers the requests in flight (a 500
/// `EngineDeadError`; in a stream an error event and `[DONE]`) and exits
/// within seconds. Through siesta both answers reach their clients whole,
/// no request stays counted, and the model is restarted and serves again.
#[tokio::test]
async fn an_engine_core_dying_under_requests_in_flight_answers_them_and_is_restarted() {
    let model = fake_model(
        "chat",
        "awake",
        &["--tokens-per-second", "10"],
        "backoff_initial = \"200ms\"",
    );
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    let (pid, engine) = (s.pid as i32, endpoint(&s));
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    ready(&proxy).await;
    let url = format!("{}/v1/chat/completions", proxy.url());
    let plain = tokio::spawn({
        let url = url.clone();
        async move {
            http()
                .post(&url)
                .json(&chat_body("chat", false, 1000))
                .send()
                .await
        }
    });
    let streamed = http()
        .post(&url)
        .json(&chat_body("chat", true, 1000))
        .send()
        .await
        .unwrap();
    assert_eq!(streamed.status(), 200);
    wait_status(&mut c, "chat", "both requests counted", LONG, |s| {
        s.in_flight == 2
    })
    .await;
    let stats: Value = http()
        .get(format!("{engine}/fake/stats"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let core = stats["engine_core_pid"].as_i64().expect("engine core") as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(core),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    siesta_tests::assert_engine_dead_answers(plain, streamed).await;
    wait_status(&mut c, "chat", "nothing counted in flight", LONG, |s| {
        s.in_flight == 0
    })
    .await;
    let s = wait_status(&mut c, "chat", "restarted", LONG, |s| {
        state(s) == pb::ModelState::Awake && s.pid as i32 != pid
    })
    .await;
    assert!(chat(&endpoint(&s), "chat").await.contains("siesta"));
}

/// The engine's running gauge, read straight from it.
async fn engine_running(url: &str) -> f64 {
    let Ok(r) = http().get(format!("{url}/metrics")).send().await else {
        return -1.0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with("vllm:num_requests_running"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(-1.0)
}

/// Someone else SIGTERMs an engine siesta runs (an operator's `kill`):
/// vLLM closes its listener at once and, with `--shutdown-timeout`,
/// finishes what it runs. siesta does not kill it under that answer (three
/// failed probes used to): the answer through the proxy ends whole, a
/// request sent meanwhile is held, and the engine is started again once
/// the old one has exited, which answers it.
#[tokio::test]
async fn an_engine_sigtermed_by_someone_else_finishes_its_answer_and_is_started_again() {
    // 120 tokens at 20 a second: 6 s, past three probe periods.
    let model = fake_model(
        "chat",
        "awake",
        &["--tokens-per-second", "20", "--shutdown-timeout", "120"],
        "backoff_initial = \"200ms\"\nstop_grace = \"60s\"",
    );
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    let (pid, url) = (s.pid as i32, endpoint(&s));
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    ready(&proxy).await;
    let long = tokio::spawn({
        let p = proxy.url();
        async move {
            let body = json!({"model": "chat", "max_tokens": 120, "ignore_eos": true,
                              "messages": [{"role": "user", "content": "hi"}]});
            try_chat_json(&p, &body, LONG).await
        }
    });
    wait_until("the answer to run", DEADLINE, || async {
        engine_running(&url).await == 1.0
    })
    .await;
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let addr = url.trim_start_matches("http://").to_string();
    wait_until("the engine to refuse connections", DEADLINE, || async {
        tokio::net::TcpStream::connect(&addr).await.is_err()
    })
    .await;
    let meanwhile = tokio::spawn({
        let p = proxy.url();
        async move { try_chat(&p, "chat", 4, LONG).await }
    });
    let v = long
        .await
        .unwrap()
        .expect("the answer under way ends whole");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    meanwhile
        .await
        .unwrap()
        .expect("the request sent meanwhile is answered");
    let s = wait_status(&mut c, "chat", "started again", LONG, |s| {
        state(s) == pb::ModelState::Awake && s.pid as i32 != pid
    })
    .await;
    assert_eq!(s.failures, 0, "{s:#?}");
    let log = siesta_tests::swap::siesta_log(&mut c, "chat").await;
    assert!(
        log.iter()
            .any(|l| l.contains("refuses connections with") && l.contains("answer(s) under way")),
        "{log:#?}"
    );
}

/// With every one of an engine's slots at this proxy taken
/// (`--engine-concurrency 1`) by an answer longer than the model's hold
/// limit, another request waits for a slot that long (5 s at least), then
/// gets 503 `engine_busy` with Retry-After; it used to wait without end.
/// Once the slot is free, the next request is answered.
#[tokio::test]
async fn a_request_that_gets_no_engine_slot_within_the_hold_limit_is_shed() {
    let model = fake_model(
        "busy",
        "awake",
        &["--tokens-per-second", "10"],
        "max_hold = \"2s\"",
    );
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "busy", pb::ModelState::Awake, LONG).await;
    let proxy = spawn_proxy(&[ctl.url()], &["--engine-concurrency", "1"]).await;
    ready(&proxy).await;
    let url = format!("{}/v1/chat/completions", proxy.url());
    // 1,000 tokens at 10 a second: the one slot is taken for 100 s.
    let mut body = chat_body("busy", true, 1000);
    body["ignore_eos"] = json!(true);
    let long = http().post(&url).json(&body).send().await.unwrap();
    assert_eq!(long.status(), 200);
    let mut stream = long.bytes_stream();
    assert!(
        stream.next().await.is_some_and(|c| c.is_ok()),
        "first chunk"
    );
    let asked = std::time::Instant::now();
    let r = http()
        .post(&url)
        .json(&chat_body("busy", false, 4))
        .send()
        .await
        .expect("no answer while the engine's one slot was taken");
    let waited = asked.elapsed();
    assert_eq!(r.status(), 503, "after {waited:?}");
    assert_eq!(
        r.headers().get("retry-after").and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "engine_busy", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("all 1 of its request slots")
                && m.contains("raise the proxy's --engine-concurrency")),
        "{body}"
    );
    assert!(
        waited >= Duration::from_secs(2),
        "shed after {waited:?}, before the hold limit"
    );
    // The long answer ends (its client hangs up): the slot is free again.
    drop(stream);
    wait_until("a request answered once the slot is free", DEADLINE, || {
        let url = url.clone();
        async move {
            let r = http()
                .post(&url)
                .json(&chat_body("busy", false, 4))
                .send()
                .await;
            matches!(r, Ok(r) if r.status() == 200)
        }
    })
    .await;
}
