//! fake-vllm's simulation knobs and injected faults, over HTTP against the real binary.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use siesta_tests::{
    Child, DEADLINE, FakeVllm, any_alive, spawn_fake_vllm, spawn_fake_vllm_env,
    spawn_fake_vllm_nowait, wait_until,
};

fn http() -> reqwest::Client {
    reqwest::Client::new()
}

async fn post(url: &str) -> reqwest::Response {
    http().post(url).send().await.unwrap()
}

async fn stats(fv: &FakeVllm) -> Value {
    http()
        .get(fv.at("/fake/stats"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn completion(fv: &FakeVllm, body: Value) -> reqwest::Result<reqwest::Response> {
    http()
        .post(fv.at("/v1/completions"))
        .json(&body)
        .send()
        .await
}

/// The bound address from `Starting vLLM API server 0 on http://H:P`, printed at bind time.
async fn bound_url(child: &Child) -> String {
    let line = child
        .output()
        .wait_for("Starting vLLM API server", DEADLINE)
        .await;
    line.split("on ").nth(1).unwrap().trim().to_string()
}

/// Whether `GET url/health` answers within `within`; during start-up the connection is
/// refused (vLLM binds early but listens only once start-up is done).
async fn answers(url: &str, within: Duration) -> bool {
    let c = reqwest::Client::builder().timeout(within).build().unwrap();
    match c.get(format!("{url}/health")).send().await {
        Ok(_) => true,
        Err(e) => {
            assert!(e.is_connect(), "expected connection refused, got {e:?}");
            false
        }
    }
}

#[tokio::test]
async fn http_is_silent_until_startup_is_done() {
    let started = Instant::now();
    let mut child = spawn_fake_vllm_nowait(&["m", "--startup-time", "3s"], &[]);
    let url = bound_url(&child).await;
    assert!(
        !answers(&url, Duration::from_millis(500)).await,
        "served HTTP during start-up"
    );
    assert!(!child.output().contains("Uvicorn running on"));
    child
        .output()
        .wait_for("Uvicorn running on", DEADLINE)
        .await;
    assert!(started.elapsed() >= Duration::from_secs(3));
    assert!(answers(&url, DEADLINE).await);
    assert!(child.try_exit().is_none());
}

#[tokio::test]
async fn hang_on_startup_never_serves() {
    let mut child =
        spawn_fake_vllm_nowait(&["m", "--hang-on-startup", "--startup-time", "10ms"], &[]);
    let url = bound_url(&child).await;
    assert!(!answers(&url, Duration::from_millis(700)).await);
    assert!(!child.output().contains("Uvicorn running on"));
    assert!(child.try_exit().is_none());
    child.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(child.wait_exit(DEADLINE).await.success());
}

#[tokio::test]
async fn exit_during_startup_exits_1_without_serving() {
    let mut child = spawn_fake_vllm_nowait(&["m", "--exit-during-startup"], &[]);
    let status = child.wait_exit(DEADLINE).await;
    assert_eq!(status.code(), Some(1));
    assert!(!child.output().contains("Uvicorn running on"));
    assert!(child.output().contains("initialization failed"));
    wait_until("the group to be gone", DEADLINE, || async {
        child.group_members().is_empty()
    })
    .await;
}

#[tokio::test]
async fn crash_after_requests_exits_on_the_next_request() {
    let mut fv = spawn_fake_vllm(&["m", "--crash-after-requests", "2"]).await;
    let core = stats(&fv).await["engine_core_pid"].as_i64().unwrap() as i32;
    for _ in 0..2 {
        let r = completion(&fv, json!({"prompt": "x"})).await.unwrap();
        assert_eq!(r.status(), 200);
    }
    assert!(
        completion(&fv, json!({"prompt": "x"})).await.is_err(),
        "the third request must fail"
    );
    assert_eq!(fv.child.wait_exit(DEADLINE).await.code(), Some(1));
    wait_until("the engine core to be gone", DEADLINE, || async {
        any_alive(&[core]).is_empty()
    })
    .await;
}

#[tokio::test]
async fn hang_on_wake_from_env_never_wakes() {
    let fv = spawn_fake_vllm_env(
        &["m", "--enable-sleep-mode"],
        &[("FAKE_VLLM_HANG_ON_WAKE", "1")],
    )
    .await;
    assert_eq!(post(&fv.at("/sleep?level=1")).await.status(), 200);
    let c = reqwest::Client::builder()
        .timeout(Duration::from_millis(800))
        .build()
        .unwrap();
    let r = c.post(fv.at("/wake_up")).send().await;
    assert!(r.is_err_and(|e| e.is_timeout()), "wake_up must hang");
    assert_eq!(stats(&fv).await["is_sleeping"], true);
}

#[tokio::test]
async fn fail_health_after_turns_health_503_and_generation_500() {
    let fv = spawn_fake_vllm(&["m", "--fail-health-after", "1s"]).await;
    let health = || async {
        http()
            .get(fv.at("/health"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    wait_until("/health to fail", DEADLINE, || async {
        health().await == 503
    })
    .await;
    assert_eq!(post(&fv.at("/ping")).await.status(), 503);
    let r = completion(&fv, json!({"prompt": "x"})).await.unwrap();
    assert_eq!(r.status(), 500);
}

#[tokio::test]
async fn timing_knobs_bound_sleep_wake_and_reload() {
    let fv = spawn_fake_vllm(&[
        "m",
        "--enable-sleep-mode",
        "--sleep-time",
        "300ms",
        "--wake-time",
        "0.6s",
        "--reload-time",
        "400ms",
    ])
    .await;
    let timed = |path: &'static str| {
        let url = fv.at(path);
        async move {
            let t = Instant::now();
            let r = if path == "/collective_rpc" {
                http()
                    .post(url)
                    .json(&json!({"method": "reload_weights"}))
                    .send()
                    .await
                    .unwrap()
            } else {
                post(&url).await
            };
            assert_eq!(r.status(), 200, "{path}");
            t.elapsed()
        }
    };
    assert!(timed("/sleep?level=2").await >= Duration::from_millis(300));
    assert!(timed("/wake_up?tags=weights").await >= Duration::from_millis(600));
    assert!(timed("/collective_rpc").await >= Duration::from_millis(400));
    timed("/wake_up?tags=kv_cache").await;
    assert_eq!(stats(&fv).await["weights_intact"], true);
}

#[tokio::test]
async fn tokens_per_second_paces_and_max_tokens_default_applies() {
    let fv = spawn_fake_vllm_env(
        &["m", "--tokens-per-second", "20"],
        &[("FAKE_VLLM_MAX_TOKENS_DEFAULT", "3")],
    )
    .await;
    let url = fv.at("/v1/completions");
    let t = Instant::now();
    let slow = tokio::spawn(async move {
        let r = http()
            .post(url)
            .json(&json!({"prompt": "x", "max_tokens": 10}))
            .send()
            .await
            .unwrap();
        r.json::<Value>().await.unwrap()
    });
    wait_until("the request to run", DEADLINE, || async {
        stats(&fv).await["running"] == 1
    })
    .await;
    let v = slow.await.unwrap();
    assert!(
        t.elapsed() >= Duration::from_millis(450),
        "10 tokens at 20/s took {:?}",
        t.elapsed()
    );
    assert_eq!(v["usage"]["completion_tokens"], 10);
    let v: Value = completion(&fv, json!({"prompt": "x"}))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        v["usage"]["completion_tokens"], 3,
        "FAKE_VLLM_MAX_TOKENS_DEFAULT"
    );
}

async fn stream_text(r: reqwest::Response) -> String {
    r.text().await.unwrap()
}

#[tokio::test]
async fn sleep_modes_abort_wait_keep() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--tokens-per-second", "50"]).await;
    let start = |max: u64| {
        let url = fv.at("/v1/completions");
        tokio::spawn(async move {
            let body =
                json!({"prompt": "x", "max_tokens": max, "stream": true, "ignore_eos": true});
            stream_text(http().post(url).json(&body).send().await.unwrap()).await
        })
    };
    let running = || async { stats(&fv).await["running"] == 1 };

    // abort (the default): the stream ends at once with finish_reason "abort".
    let req = start(1000);
    wait_until("running", DEADLINE, running).await;
    assert_eq!(post(&fv.at("/sleep?level=1")).await.status(), 200);
    let body = tokio::time::timeout(DEADLINE, req).await.unwrap().unwrap();
    assert!(
        body.contains("\"finish_reason\":\"abort\"") && body.ends_with("data: [DONE]\n\n"),
        "{body}"
    );
    assert_eq!(post(&fv.at("/wake_up")).await.status(), 200);

    // wait: the sleep returns only after the request finished.
    let req = start(10);
    wait_until("running", DEADLINE, running).await;
    assert_eq!(post(&fv.at("/sleep?level=1&mode=wait")).await.status(), 200);
    assert!(
        req.is_finished()
            || tokio::time::timeout(Duration::from_secs(1), req)
                .await
                .is_ok()
    );
    assert_eq!(post(&fv.at("/wake_up")).await.status(), 200);

    // keep: the request (2 s of tokens) is frozen while asleep and finishes after the wake.
    let req = start(100);
    wait_until("running", DEADLINE, running).await;
    assert_eq!(post(&fv.at("/sleep?level=1&mode=keep")).await.status(), 200);
    assert!(!req.is_finished());
    assert_eq!(post(&fv.at("/wake_up")).await.status(), 200);
    let body = tokio::time::timeout(DEADLINE, req).await.unwrap().unwrap();
    assert!(body.contains("\"finish_reason\":\"length\""), "{body}");
    assert_eq!(
        body.matches("data: {").count(),
        100,
        "all 100 tokens arrive after the wake"
    );
}
