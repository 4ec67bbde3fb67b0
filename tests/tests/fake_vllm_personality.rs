//! fake-vllm's personalities: `sglang` (SGLang's argv and routes, and its deaths when
//! something reaches released memory) and `openai` (a plain OpenAI server).

use std::time::Duration;

use serde_json::{Value, json};
use siesta_tests::{DEADLINE, FakeVllm, spawn_fake_vllm_argv};

const SGLANG: &[&str] = &[
    "--personality",
    "sglang",
    "--model-path",
    "Qwen/Qwen3-0.6B",
    "--host",
    "127.0.0.1",
    "--port",
    "0",
    "--served-model-name",
    "sg",
    "--enable-memory-saver",
    "--enable-weights-cpu-backup",
    "--enable-metrics",
    "--trust-remote-code",
    "--startup-time",
    "50ms",
];

async fn sglang(extra: &[&str]) -> FakeVllm {
    let mut args = SGLANG.to_vec();
    args.extend_from_slice(extra);
    spawn_fake_vllm_argv(&args).await
}

async fn chat(fv: &FakeVllm, model: &str) -> reqwest::Result<reqwest::Response> {
    reqwest::Client::new()
        .post(fv.at("/v1/chat/completions"))
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
        .send()
        .await
}

async fn answer(fv: &FakeVllm, model: &str) -> String {
    let r = chat(fv, model).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn post_json(fv: &FakeVllm, path: &str, body: Value) -> (u16, String) {
    let r = reqwest::Client::new()
        .post(fv.at(path))
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test]
async fn sglang_releases_and_resumes_its_memory_and_has_no_vllm_routes() {
    let fv = sglang(&[]).await;
    assert_eq!(fv.get("/health").await.status(), 200);
    assert_eq!(fv.get("/health_generate").await.status(), 200);
    let info: Value = fv.get("/get_model_info").await.json().await.unwrap();
    assert_eq!(info["model_path"], "Qwen/Qwen3-0.6B");
    for path in ["/sleep?level=1", "/wake_up", "/collective_rpc"] {
        assert_eq!(fv.post(path).await.status(), 404, "{path}");
    }
    assert_eq!(fv.get("/is_sleeping").await.status(), 404);
    let metrics = fv.get("/metrics").await.text().await.unwrap();
    assert!(metrics.contains("sglang:num_running_reqs{"), "{metrics}");
    assert!(!metrics.contains("vllm:"), "{metrics}");
    let awake = answer(&fv, "sg").await;

    let (status, body) = post_json(&fv, "/release_memory_occupation", json!({})).await;
    assert_eq!((status, body.as_str()), (200, "null"));
    let st = fv.stats().await;
    assert_eq!(st["is_sleeping"], true, "{st}");
    // Released: only what never reaches the GPU answers.
    assert_eq!(fv.get("/get_model_info").await.status(), 200);

    let (status, body) = post_json(&fv, "/resume_memory_occupation", json!({})).await;
    assert_eq!((status, body.as_str()), (200, "null"));
    assert_eq!(fv.stats().await["is_sleeping"], false);
    // With the weights' CPU backup they come back intact.
    assert_eq!(answer(&fv, "sg").await, awake);
}

#[tokio::test]
async fn sglang_without_a_weights_backup_serves_garbage_after_a_resume() {
    let args: Vec<&str> = SGLANG
        .iter()
        .copied()
        .filter(|a| *a != "--enable-weights-cpu-backup")
        .collect();
    let fv = spawn_fake_vllm_argv(&args).await;
    let awake = answer(&fv, "sg").await;
    assert_eq!(
        post_json(&fv, "/release_memory_occupation", json!({}))
            .await
            .0,
        200
    );
    assert_eq!(
        post_json(&fv, "/resume_memory_occupation", json!({}))
            .await
            .0,
        200
    );
    let after = answer(&fv, "sg").await;
    assert_ne!(after, awake);
    assert!(after.chars().all(|c| c == '!'), "{after:?}");
}

/// Each of these kills an SGLang server: a request or a health generation while the memory
/// is released, and a resume of memory never released.
#[tokio::test]
async fn sglang_dies_when_anything_reaches_released_memory() {
    let mut fv = sglang(&[]).await;
    post_json(&fv, "/release_memory_occupation", json!({})).await;
    let _ = chat(&fv, "sg").await;
    let status = fv.child.wait_exit(DEADLINE).await;
    assert!(!status.success(), "{status}");
    assert!(fv.child.output().contains("illegal memory access"));

    let mut fv = sglang(&[]).await;
    post_json(&fv, "/release_memory_occupation", json!({})).await;
    let _ = reqwest::get(fv.at("/health")).await;
    assert!(!fv.child.wait_exit(DEADLINE).await.success());

    let mut fv = sglang(&[]).await;
    let _ = reqwest::Client::new()
        .post(fv.at("/resume_memory_occupation"))
        .json(&json!({}))
        .send()
        .await;
    assert!(!fv.child.wait_exit(DEADLINE).await.success());
    assert!(fv.child.output().contains("KeyError"));
}

#[tokio::test]
async fn sglang_argv_is_refused_like_argparse() {
    for (args, want) in [
        (
            &["--personality", "sglang", "--model-path", "m", "--bogus"][..],
            "launch_server.py: error: unrecognized arguments: --bogus",
        ),
        (
            &["--personality", "sglang", "--port", "0"][..],
            "the following arguments are required: --model-path",
        ),
    ] {
        let out = std::process::Command::new(siesta_tests::bin_path("fake-vllm"))
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[tokio::test]
async fn openai_is_a_plain_server_without_dev_routes_or_metrics() {
    let fv = spawn_fake_vllm_argv(&[
        "--personality",
        "openai",
        "serve",
        "ocr",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--startup-time",
        "50ms",
    ])
    .await;
    assert_eq!(fv.get("/health").await.status(), 200);
    for path in ["/sleep?level=1", "/wake_up"] {
        assert_eq!(fv.post(path).await.status(), 404, "{path}");
    }
    for path in ["/is_sleeping", "/metrics", "/version"] {
        assert_eq!(fv.get(path).await.status(), 404, "{path}");
    }
    answer(&fv, "ocr").await;
    // Nothing held or slept: it simply serves.
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(fv.stats().await["sleeps"], 0);
}
