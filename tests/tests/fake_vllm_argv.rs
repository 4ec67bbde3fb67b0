//! fake-vllm's command line and socket, as unkind as vLLM's: argparse errors, no
//! `SO_REUSEPORT`, and every flag siesta and its examples pass still accepted.

use std::time::Duration;

use siesta_tests::{
    DEADLINE, FakeVllm, spawn_fake_vllm, spawn_fake_vllm_env, spawn_fake_vllm_nowait,
};

/// Runs fake-vllm with `args` and expects it to exit by itself; returns (code, output).
async fn exits(args: &[&str]) -> (Option<i32>, String) {
    exits_env(args, &[]).await
}

/// [`exits`] with extra environment.
async fn exits_env(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut child = spawn_fake_vllm_nowait(args, env);
    let status = child.wait_exit(DEADLINE).await;
    // The output readers may lag the exit a little.
    let out = child.output().clone();
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while !out.contains("error") && !out.contains("Error") {
            tokio::time::sleep(siesta_tests::POLL).await;
        }
    })
    .await;
    (status.code(), out.text())
}

#[tokio::test]
async fn unknown_and_mistyped_flags_exit_2_like_argparse() {
    let (code, out) = exits(&["m", "--enable-sleep-mode", "--foo"]).await;
    assert_eq!(code, Some(2), "{out}");
    assert!(
        out.contains("vllm serve: error: unrecognized arguments: --foo"),
        "{out}"
    );
    assert!(!out.contains("Uvicorn running"), "{out}");

    let (code, out) = exits(&["m", "--gpu-memory-utilisation", "0.5"]).await;
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("--gpu-memory-utilisation"), "{out}");

    // uvicorn's keep-alive is no `vllm serve` flag (VLLM_HTTP_TIMEOUT_KEEP_ALIVE sets it).
    let (code, out) = exits(&["m", "--timeout-keep-alive", "1"]).await;
    assert_eq!(code, Some(2), "{out}");
    assert!(
        out.contains("unrecognized arguments: --timeout-keep-alive"),
        "{out}"
    );

    let (code, out) = exits_env(&["m"], &[("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "2s")]).await;
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("invalid literal for int() with base 10: \"2s\""),
        "{out}"
    );

    // Flags vLLM dropped before 0.24 (the GPU machine's) are unknown to it: a fake that took
    // them passed configurations that cannot start.
    for dropped in [
        &["--task", "embed"][..],
        &["--swap-space", "4"],
        &["--disable-log-requests"],
        &["--disable-frontend-multiprocessing"],
    ] {
        let args: Vec<&str> = std::iter::once("m")
            .chain(dropped.iter().copied())
            .collect();
        let (code, out) = exits(&args).await;
        assert_eq!(code, Some(2), "{dropped:?}: {out}");
        assert!(
            out.contains(&format!("unrecognized arguments: {}", dropped[0])),
            "{dropped:?}: {out}"
        );
    }

    // A known flag with a bad value is an argument error too.
    let (code, out) = exits(&["m", "--gpu-memory-utilization", "1.5"]).await;
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("1.5 is not in (0, 1]"), "{out}");
}

#[tokio::test]
async fn every_flag_siesta_and_the_examples_pass_is_accepted() {
    // siesta-control's argv (supervisor::spawn_spec) plus the flags in examples/, the
    // tests, deploy/ and the README.
    let fv = spawn_fake_vllm(&[
        "org/m",
        "--served-model-name",
        "m",
        "--enable-sleep-mode",
        "--tensor-parallel-size",
        "2",
        "--gpu-memory-utilization",
        "0.45",
        "--disable-custom-all-reduce",
        "--max-model-len",
        "16384",
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--runner",
        "pooling",
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
        "--seed",
        "0",
        "--trust-remote-code",
        "--max-num-seqs",
        "64",
        "--shutdown-timeout",
        "5",
        "--tokenizer",
        "org/tok",
        "--limit-mm-per-prompt",
        "{\"image\": 4}",
        "--max_num_batched_tokens",
        "8192",
        "--startup-time",
        "10ms",
    ])
    .await;
    assert_eq!(fv.get("/health").await.status(), 200);
}

/// vLLM 0.33 binds without `SO_REUSEPORT` (one API server): a second
/// engine on a taken port ends as vLLM does, on Python's `OSError` (the
/// line siesta's `last_error` takes as the cause; the fake wrote only its
/// own log line, and siesta said "exit status: 1" alone).
#[tokio::test]
async fn a_second_engine_on_a_taken_port_fails_with_address_in_use() {
    let fv = spawn_fake_vllm(&["m", "--imitate-version", "0.33.0"]).await;
    let port = fv.addr.port().to_string();
    let (code, out) = exits(&["m2", "--port", &port, "--imitate-version", "0.33.0"]).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(code.is_some(), "killed by a signal: {out}");
    assert!(
        out.contains("OSError: [Errno 98] Address already in use"),
        "{out}"
    );
    // The first engine is untouched.
    assert_eq!(fv.get("/health").await.status(), 200);
}

/// vLLM 0.24 always binds with `SO_REUSEPORT`: a second 0.24 engine on the
/// port a 0.24 engine holds binds beside it, and the kernel shares the
/// connections between them (siesta checks a configured `port` is free
/// before it starts an engine there: `control_lifecycle`).
#[tokio::test]
async fn a_second_vllm_0_24_engine_binds_beside_the_first() {
    let first = spawn_fake_vllm(&["m", "--imitate-version", "0.24.0"]).await;
    let port = first.addr.port().to_string();
    let second = spawn_fake_vllm(&["m2", "--port", &port, "--imitate-version", "0.24.0"]).await;
    assert_eq!(second.addr.port(), first.addr.port());
    assert_eq!(second.get("/health").await.status(), 200);
    assert_eq!(first.get("/health").await.status(), 200);
}

#[tokio::test]
async fn embeddings_exist_only_for_pooling_models() {
    let fv = spawn_fake_vllm(&["m"]).await;
    let body = serde_json::json!({"input": "x"});
    let c = reqwest::Client::new();
    let r = c
        .post(fv.at("/v1/embeddings"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let fv = spawn_fake_vllm(&["m", "--runner", "pooling"]).await;
    let r = c
        .post(fv.at("/v1/embeddings"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// The threads of `pid` whose name is tokio's default worker name (`tokio-rt-worker`).
fn tokio_threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|c| c.trim_end() == "tokio-rt-worker")
                .count()
        })
        .unwrap_or(0)
}

#[tokio::test]
async fn api_server_count_adds_serving_threads_and_headless_is_refused() {
    // One API server serves on two threads; three serve on six (their workers all start
    // with the runtime; a blocking thread would only add to the count).
    let one = spawn_fake_vllm(&["m"]).await;
    let three = spawn_fake_vllm(&["m3", "--api-server-count", "3"]).await;
    let (n1, n3) = (
        tokio_threads(one.child.pid()),
        tokio_threads(three.child.pid()),
    );
    assert!((2..6).contains(&n1), "one API server: {n1} threads");
    assert!(n3 >= 6, "three API servers: {n3} threads");
    assert_eq!(three.get("/health").await.status(), 200);

    // vLLM's `--api-server-count 0` runs a headless engine with no HTTP server: not modelled.
    let (code, out) = exits(&["m", "--api-server-count", "0"]).await;
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("--api-server-count"), "{out}");
    assert!(!out.contains("Uvicorn running"), "{out}");
}

/// (status, body) of a completion sent with `auth` as its Authorization header.
async fn complete_with(fv: &FakeVllm, path: &str, auth: Option<&str>) -> (u16, String) {
    let mut req = reqwest::Client::new()
        .post(fv.at(path))
        .header("content-type", "application/json")
        .body(r#"{"prompt": "hi", "max_tokens": 2}"#);
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// `--api-key` (or `VLLM_API_KEY`) is not ignored: as vLLM's `AuthenticationMiddleware`,
/// every `/v1` path answers 401 `{"error":"Unauthorized"}` without one of the keys, while
/// `/health`, `/metrics` and the dev routes stay open.
#[tokio::test]
async fn api_key_guards_every_v1_path_and_nothing_else() {
    let fv = spawn_fake_vllm(&["m", "--enable-sleep-mode", "--api-key", "k1", "k2"]).await;
    let unauthorized = (401, r#"{"error":"Unauthorized"}"#.to_string());
    assert_eq!(
        complete_with(&fv, "/v1/completions", None).await,
        unauthorized
    );
    assert_eq!(
        complete_with(&fv, "/v1/completions", Some("Bearer wrong")).await,
        unauthorized
    );
    assert_eq!(
        complete_with(&fv, "/v1/nowhere", Some("Bearer wrong")).await,
        unauthorized,
        "checked before routing"
    );
    assert_eq!(
        complete_with(&fv, "/v1/completions", Some("Bearer k1"))
            .await
            .0,
        200
    );
    assert_eq!(
        complete_with(&fv, "/v1/completions", Some("bearer k2"))
            .await
            .0,
        200
    );
    assert_eq!(fv.get("/v1/models").await.status(), 401);
    for path in ["/health", "/metrics", "/version", "/is_sleeping"] {
        assert_eq!(fv.get(path).await.status(), 200, "{path}");
    }
    assert_eq!(fv.post("/sleep?level=1").await.status(), 200);
    assert_eq!(fv.post("/wake_up").await.status(), 200);

    let fv = spawn_fake_vllm_env(&["m"], &[("VLLM_API_KEY", "env-key")]).await;
    assert_eq!(
        complete_with(&fv, "/v1/completions", None).await,
        unauthorized
    );
    assert_eq!(
        complete_with(&fv, "/v1/completions", Some("Bearer env-key"))
            .await
            .0,
        200
    );
    // An empty key is no key.
    let fv = spawn_fake_vllm_env(&["m"], &[("VLLM_API_KEY", "")]).await;
    assert_eq!(complete_with(&fv, "/v1/completions", None).await.0, 200);
}
