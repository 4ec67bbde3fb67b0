//! fake-vllm's sleep endpoints, as unkind as vLLM's: version-dependent bodies, 422s, level 0,
//! repeated sleeps, `/is_sleeping` stuck behind a wake or reload, frozen gauges.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use siesta_tests::{DEADLINE, FakeVllm, spawn_fake_vllm, wait_until};

async fn body(r: reqwest::Response) -> (u16, String) {
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn complete(fv: &FakeVllm) -> Value {
    let r = reqwest::Client::new()
        .post(fv.at("/v1/completions"))
        .json(&json!({"prompt": "hi", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// A completion of `max_tokens` sent in the background, once it runs; its
/// status when it ends.
async fn running_request(fv: &FakeVllm, max_tokens: u32) -> tokio::task::JoinHandle<u16> {
    let url = fv.at("/v1/completions");
    let running = tokio::spawn(async move {
        let r = reqwest::Client::new()
            .post(url)
            .json(&json!({"prompt": "hi", "max_tokens": max_tokens}))
            .send()
            .await
            .unwrap();
        r.status().as_u16()
    });
    wait_until("the request to run", DEADLINE, || async {
        fv.stats().await["running"].as_u64().unwrap() > 0
    })
    .await;
    running
}

/// Sends a completion that the sleeping engine holds; returns its task once it is held.
async fn held_completion(fv: &FakeVllm) -> tokio::task::JoinHandle<Value> {
    let before = fv.stats().await["held"].as_u64().unwrap();
    let url = fv.at("/v1/completions");
    let task = tokio::spawn(async move {
        let r = reqwest::Client::new()
            .post(url)
            .json(&json!({"prompt": "hi", "max_tokens": 4}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()
    });
    wait_until("the request to be held", DEADLINE, || async {
        fv.stats().await["held"].as_u64().unwrap() > before
    })
    .await;
    task
}

#[tokio::test]
async fn version_0_33_bodies_and_422s() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode"]).await;
    let v: Value = fv.get("/version").await.json().await.unwrap();
    assert_eq!(v["version"], "0.33.0");
    for (path, param) in [
        ("/sleep?level=abc", "level"),
        ("/sleep?level=3", "level"),
        ("/sleep?level=-1", "level"),
        ("/sleep?mode=nap", "mode"),
    ] {
        let r = fv.post(path).await;
        assert_eq!(r.status(), 422, "{path}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(
            v["detail"][0]["loc"],
            json!(["query", param]),
            "{path}: {v}"
        );
    }
    assert!(!fv.stats().await["is_sleeping"].as_bool().unwrap());

    let (status, text) = body(fv.post("/sleep?level=1").await).await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v, json!({"status": "sleeping", "level": 1}));
    // vLLM checks no tag: an unknown one makes the executor do nothing.
    let v: Value = fv.post("/wake_up?tags=bogus").await.json().await.unwrap();
    assert_eq!(v, json!({"status": "sleeping", "tags": ["bogus"]}));
    // Weights awake, KV cache asleep: "sleeping", and the scheduler stays paused.
    let v: Value = fv.post("/wake_up?tags=weights").await.json().await.unwrap();
    assert_eq!(v, json!({"status": "sleeping", "tags": ["weights"]}));
    // Naming a tag that is awake again makes the whole call do nothing.
    let v: Value = fv
        .post("/wake_up?tags=weights&tags=kv_cache")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["status"], "sleeping");
    let v: Value = fv
        .post("/wake_up?tags=kv_cache")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v, json!({"status": "awake", "tags": ["kv_cache"]}));
    assert_eq!(fv.sleep_state().await, (1.0, 0.0, 0.0));
}

#[tokio::test]
async fn version_0_24_empty_bodies_and_level_3_as_level_2() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--imitate-version", "0.24.0"]).await;
    let v: Value = fv.get("/version").await.json().await.unwrap();
    assert_eq!(v["version"], "0.24.0");
    assert_eq!(
        body(fv.post("/sleep?level=3").await).await,
        (200, String::new())
    );
    assert_eq!(fv.sleep_state().await, (0.0, 0.0, 1.0));
    assert_eq!(body(fv.post("/wake_up").await).await, (200, String::new()));
    assert_eq!(fv.post("/sleep?level=x").await.status(), 422);
}

#[tokio::test]
async fn level_0_pauses_without_freeing_and_any_wake_resumes_it() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode"]).await;
    let before = fv.stats().await["device_bytes"].clone();
    let v: Value = fv.post("/sleep?level=0").await.json().await.unwrap();
    assert_eq!(v, json!({"status": "sleeping", "level": 0}));
    let s = fv.stats().await;
    assert_eq!(s["is_sleeping"], true);
    assert_eq!(s["device_bytes"], before, "level 0 frees nothing");
    assert_eq!(fv.sleep_state().await, (0.0, 0.0, 0.0));
    let req = held_completion(&fv).await;
    // The executor is not asleep: a wake with any tag resumes the scheduler.
    let v: Value = fv.post("/wake_up?tags=weights").await.json().await.unwrap();
    assert_eq!(v, json!({"status": "awake", "tags": ["weights"]}));
    assert_eq!(fv.stats().await["is_sleeping"], false);
    let v = tokio::time::timeout(DEADLINE, req).await.unwrap().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn a_repeated_sleep_aborts_held_requests_and_level_2_over_1_keeps_weights() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode"]).await;
    let good = complete(&fv).await["choices"][0]["text"].clone();
    assert_eq!(fv.post("/sleep?level=1").await.status(), 200);

    // mode=keep leaves the held request alone; the default (abort) ends it.
    let req = held_completion(&fv).await;
    assert_eq!(fv.post("/sleep?level=1&mode=keep").await.status(), 200);
    assert_eq!(fv.stats().await["held"], 1);
    let v: Value = fv.post("/sleep?level=2").await.json().await.unwrap();
    assert_eq!(v, json!({"status": "sleeping", "level": 2}));
    let v = tokio::time::timeout(DEADLINE, req).await.unwrap().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "abort", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 0);
    assert_eq!(fv.stats().await["held"], 0);

    // Level 2 over level 1 reads discard_all but kept the weights: a plain wake answers well.
    assert_eq!(fv.sleep_state().await, (0.0, 0.0, 1.0));
    assert_eq!(fv.stats().await["weights_intact"], false);
    assert_eq!(fv.post("/wake_up").await.status(), 200);
    assert_eq!(complete(&fv).await["choices"][0]["text"], good);
}

#[tokio::test]
async fn is_sleeping_waits_behind_reload_weights_and_a_hung_wake() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--reload-time", "1s"]).await;
    assert_eq!(fv.post("/sleep?level=2").await.status(), 200);
    assert_eq!(fv.post("/wake_up?tags=weights").await.status(), 200);
    let url = fv.at("/collective_rpc");
    let reload = tokio::spawn(async move {
        let r = reqwest::Client::new()
            .post(url)
            .json(&json!({"method": "reload_weights"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    });
    fv.child
        .output()
        .wait_for("reloading weights", DEADLINE)
        .await;
    // The reload (1 s) is under way: /is_sleeping answers only after it.
    // (Measured from the ask, not against when the reload's own answer
    // reached its client: on one test thread that task may be polled later.)
    let asked = Instant::now();
    let v: Value = fv.get("/is_sleeping").await.json().await.unwrap();
    let waited = asked.elapsed();
    assert_eq!(v["is_sleeping"], true);
    reload.await.unwrap();
    assert!(
        waited >= Duration::from_millis(500),
        "/is_sleeping answered after {waited:?}, during a 1 s reload"
    );

    let (fv, c) = in_a_wake_that_never_finishes().await;
    let r = c.get(fv.at("/is_sleeping")).send().await;
    assert!(r.is_err_and(|e| e.is_timeout()), "/is_sleeping must hang");
}

#[tokio::test]
async fn disable_log_stats_removes_every_vllm_metric() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--disable-log-stats"]).await;
    assert_eq!(fv.post("/sleep").await.status(), 200);
    let r = fv.get("/metrics").await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(!text.contains("vllm:"), "{text}");
    assert!(text.contains("process_start_time_seconds"), "{text}");
}

/// Like vLLM's server (uvicorn runs a handler to its end), a `/sleep`
/// whose client goes away still finishes: here a `mode=wait` sleep waiting
/// for a running request, its client gone after 200 ms (siesta-control
/// killed mid-sleep). Before, hyper dropped the sleep half done: the
/// engine stayed paused with `/is_sleeping` false, and every request
/// reaching it waited for ever.
#[tokio::test]
async fn a_sleep_whose_client_went_away_still_finishes() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--tokens-per-second", "8"]).await;
    let running = running_request(&fv, 8).await;
    let gone = reqwest::Client::new()
        .post(fv.at("/sleep?level=1&mode=wait"))
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(gone.is_err(), "the sleep waits for the running request");
    assert_eq!(running.await.unwrap(), 200);
    // (`/is_sleeping` says true from the start of the drain.)
    wait_until("the engine asleep", DEADLINE, || async {
        fv.stats().await["sleeps"] == 1
    })
    .await;
    assert_eq!(fv.sleep_state().await, (0.0, 1.0, 0.0));
}

/// After `wake_up?tags=weights` alone `/is_sleeping` stays true in every version, but
/// `vllm:engine_sleep_state` differs: 0.24's `AsyncLLM.wake_up` records awake after every
/// wake, 0.32 and later only after a full one.
#[tokio::test]
async fn the_sleep_metric_after_a_partial_wake_depends_on_the_version() {
    for (version, metric) in [("0.24.0", (1.0, 0.0, 0.0)), ("0.33.0", (0.0, 1.0, 0.0))] {
        let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--imitate-version", version]).await;
        assert_eq!(fv.post("/sleep?level=1").await.status(), 200);
        assert_eq!(fv.post("/wake_up?tags=weights").await.status(), 200);
        let v: Value = fv.get("/is_sleeping").await.json().await.unwrap();
        assert_eq!(v["is_sleeping"], true, "{version}");
        assert_eq!(fv.sleep_state().await, metric, "{version}");
        // Held, not run: the scheduler resumes only with the KV cache awake.
        let req = held_completion(&fv).await;
        assert_eq!(fv.post("/wake_up?tags=kv_cache").await.status(), 200);
        let v = tokio::time::timeout(DEADLINE, req).await.unwrap().unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{version}: {v}");
        assert_eq!(fv.sleep_state().await, (1.0, 0.0, 0.0), "{version}");
    }
}

/// `/collective_rpc` of a method the worker lacks fails in the engine core: a 500 with the
/// utility call's message (`run_method`'s NotImplementedError; TP > 1: the worker's
/// AttributeError).
#[tokio::test]
async fn collective_rpc_of_an_unknown_method_is_a_500() {
    for (tp, message) in [
        (
            "1",
            "Call to collective_rpc method failed: Method 'nope' is not implemented.",
        ),
        (
            "2",
            "Call to collective_rpc method failed: Worker failed with error ''Worker' object \
             has no attribute 'nope'', please check the stack trace above for the root cause",
        ),
    ] {
        let fv = spawn_fake_vllm(&["m", "--tensor-parallel-size", tp]).await;
        let r = reqwest::Client::new()
            .post(fv.at("/collective_rpc"))
            .json(&json!({"method": "nope"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 500);
        let v: Value = r.json().await.unwrap();
        assert_eq!(
            v,
            json!({"error": {"message": message, "type": "InternalServerError",
                             "param": null, "code": 500}})
        );
    }
}

/// `/sleep?mode=wait` with a request running (vLLM's `EngineCore.sleep`: the pause is a
/// Future, the executor sleeps in its callback): `/is_sleeping` says true at once and the
/// metric still says awake; a `/wake_up` meanwhile finds the executor awake, resumes the
/// scheduler and answers "awake", yet the executor still goes to sleep once the request is
/// done, under a running scheduler: the next request reaches freed memory and the engine
/// core dies.
#[tokio::test]
async fn a_wake_during_a_draining_sleep_does_not_stop_the_sleep() {
    let mut fv = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--tokens-per-second", "5"]).await;
    let running = running_request(&fv, 10).await;
    let url = fv.at("/sleep?level=1&mode=wait");
    let sleep = tokio::spawn(async move {
        let r = reqwest::Client::new().post(url).send().await.unwrap();
        (Instant::now(), r.status().as_u16())
    });
    wait_until("the sleep to pause the scheduler", DEADLINE, || async {
        fv.stats().await["is_sleeping"] == true
    })
    .await;
    let asked = Instant::now();
    let v: Value = fv.get("/is_sleeping").await.json().await.unwrap();
    assert_eq!(v["is_sleeping"], true);
    assert!(
        asked.elapsed() < Duration::from_millis(500),
        "/is_sleeping answers during the drain"
    );
    assert_eq!(
        fv.sleep_state().await,
        (1.0, 0.0, 0.0),
        "recorded at its end"
    );

    let v: Value = fv.post("/wake_up").await.json().await.unwrap();
    let woken = Instant::now();
    assert_eq!(v, json!({"status": "awake", "tags": null}));
    assert_eq!(fv.stats().await["is_sleeping"], false);
    assert!(
        !sleep.is_finished(),
        "the sleep still waits for the request"
    );

    assert_eq!(running.await.unwrap(), 200);
    let (slept, status) = sleep.await.unwrap();
    assert_eq!(status, 200);
    assert!(slept > woken);
    let v: Value = fv.get("/is_sleeping").await.json().await.unwrap();
    assert_eq!(v["is_sleeping"], true, "the executor slept after the wake");
    assert_eq!(fv.sleep_state().await, (0.0, 1.0, 0.0));

    // The scheduler runs: the next request is scheduled onto freed memory.
    let r = reqwest::Client::new()
        .post(fv.at("/v1/completions"))
        .json(&json!({"prompt": "hi", "max_tokens": 2}))
        .send()
        .await;
    assert!(r.is_err(), "{r:?}");
    let status = fv.child.wait_exit(DEADLINE).await;
    assert_eq!(status.code(), Some(1));
    assert!(
        fv.child
            .output()
            .text()
            .contains("an illegal memory access was encountered")
    );
}

/// A half-woken executor (KV cache asleep) sleeps again from 0.32; 0.24 calls it
/// "already sleeping" and keeps the weights where they are.
#[tokio::test]
async fn a_sleep_after_a_partial_wake_depends_on_the_version() {
    for (version, weights_asleep) in [("0.24.0", false), ("0.33.0", true)] {
        let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--imitate-version", version]).await;
        assert_eq!(fv.post("/sleep?level=1").await.status(), 200);
        assert_eq!(fv.post("/wake_up?tags=weights").await.status(), 200);
        assert_eq!(fv.post("/sleep?level=1").await.status(), 200);
        let s = fv.stats().await;
        assert_eq!(s["weights_asleep"], weights_asleep, "{version}: {s}");
        assert_eq!(s["kv_cache_asleep"], true, "{version}: {s}");
    }
}

/// `/reset_prefix_cache` as vLLM 0.33 has it: `{"success": bool}`, false while a running
/// request holds KV-cache blocks (200 either way), and a utility call that waits behind a
/// hung wake; 0.24 answers an empty 200.
#[tokio::test]
async fn reset_prefix_cache_answers_success_and_waits_behind_a_wake() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--tokens-per-second", "20"]).await;
    assert_eq!(
        body(fv.post("/reset_prefix_cache").await).await,
        (200, r#"{"success":true}"#.to_string())
    );
    let running = running_request(&fv, 400).await;
    assert_eq!(
        body(fv.post("/reset_prefix_cache").await).await,
        (200, r#"{"success":false}"#.to_string())
    );
    // Frozen by `mode=keep`, it still holds its blocks.
    assert_eq!(fv.post("/sleep?level=1&mode=keep").await.status(), 200);
    assert_eq!(
        body(fv.post("/reset_prefix_cache").await).await,
        (200, r#"{"success":false}"#.to_string())
    );
    // Aborted by the default mode, it frees them.
    assert_eq!(fv.post("/sleep?level=1").await.status(), 200);
    assert_eq!(running.await.unwrap(), 200);
    assert_eq!(
        body(fv.post("/reset_prefix_cache").await).await,
        (200, r#"{"success":true}"#.to_string())
    );

    let old = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--imitate-version", "0.24.0"]).await;
    assert_eq!(
        body(old.post("/reset_prefix_cache").await).await,
        (200, String::new())
    );

    let (fv, c) = in_a_wake_that_never_finishes().await;
    let r = c.post(fv.at("/reset_prefix_cache")).send().await;
    assert!(
        r.is_err_and(|e| e.is_timeout()),
        "/reset_prefix_cache must wait behind the wake"
    );
}

/// An engine asleep at level 1 whose wake, sent, never finishes, and a
/// client that gives up after 800 ms (what is asked of it must hang).
async fn in_a_wake_that_never_finishes() -> (FakeVllm, reqwest::Client) {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--hang-on-wake"]).await;
    assert_eq!(fv.post("/sleep?level=1").await.status(), 200);
    let url = fv.at("/wake_up");
    tokio::spawn(async move { reqwest::Client::new().post(url).send().await });
    fv.child
        .output()
        .wait_for("this wake never finishes", DEADLINE)
        .await;
    let c = reqwest::Client::builder()
        .timeout(Duration::from_millis(800))
        .build()
        .unwrap();
    (fv, c)
}
