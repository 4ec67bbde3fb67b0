//! Engine kinds end to end: one siesta-control runs a vLLM, an SGLang and a plain OpenAI
//! server (fake-vllm's three personalities) on one GPU that fits one of them awake. Each is
//! started and answered through the proxy; SGLang sleeps by releasing its memory (and the
//! GPU then counts it as asleep: the next model wakes beside it), the OpenAI server cannot
//! sleep and is stopped to make room, and its idle tier stops it; a request held through
//! each wake or start is answered 200. A config asking an OpenAI server to sleep is refused
//! with the tiers it has, and `siesta get` shows each kind and what it can do.

use siesta_proto::v1 as pb;
use siesta_tests::cli::{at, siesta};
use siesta_tests::ctl::*;
use siesta_tests::{ProxyProc, spawn_proxy};
use std::time::Duration;

const ANSWER_WITHIN: Duration = Duration::from_secs(60);

/// The three kinds, each taking 60% of the one 80 GiB GPU when awake.
fn models(ocr_idle: &str) -> String {
    format!(
        r#"
[[model]]
name = "chat"
model = "fake/chat"
executable = "@FAKE_VLLM@"
gpus = 1
gpu_memory = 0.6
env = {{ SIESTA_TEST_TAG = "@DIR@" }}

[[model]]
name = "sg"
engine = "sglang"
model = "fake/sg"
command = ["@FAKE_VLLM@", "--personality", "sglang"]
args = ["--trust-remote-code", "--startup-time", "100ms"]
gpus = 1
gpu_memory = 0.6
env = {{ SIESTA_TEST_TAG = "@DIR@" }}

[[model]]
name = "ocr"
engine = "openai"
executable = "@FAKE_VLLM@"
args = ["--personality", "openai", "serve", "ocr", "--host", "{{host}}", "--port", "{{port}}"]
health_path = "/health"
gpus = 1
gpu_memory = 0.6
env = {{ SIESTA_TEST_TAG = "@DIR@" }}
{ocr_idle}
"#
    )
}

fn one_gpu(models: &str) -> String {
    let base = config(models).replace(
        "state_dir = \"@DIR@/state\"",
        "state_dir = \"@DIR@/state\"\np2p_probe = \"off\"",
    );
    format!("{base}\n[[gpu]]\nindex = 0\nname = \"test-gpu\"\nmemory = \"80GiB\"\n")
}

async fn ask(proxy: &ProxyProc, model: &str) -> String {
    try_chat(&proxy.url(), model, 4, ANSWER_WITHIN)
        .await
        .unwrap_or_else(|e| panic!("through the proxy: {e}"))
}

async fn fake_stats(s: &pb::ModelStatus) -> serde_json::Value {
    reqwest::get(format!("{}/fake/stats", endpoint(s)))
        .await
        .expect("fake stats")
        .json()
        .await
        .unwrap()
}

fn reason(s: &pb::ModelStatus) -> i32 {
    s.intent.as_ref().map_or(0, |i| i.reason)
}

#[tokio::test]
async fn vllm_sglang_and_openai_take_turns_on_one_gpu_through_the_proxy() {
    let ctl = start(&one_gpu(&models(""))).await;
    let mut c = ctl.client().await;
    if !gpus_from_config(&mut c).await {
        return;
    }
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&proxy).await;

    // SGLang starts on demand; its request is held through the start.
    ask(&proxy, "sg").await;
    let sg = wait_state(&mut c, "sg", pb::ModelState::Awake, LONG).await;
    assert_eq!(sg.engine, "sglang");
    let caps = sg.capabilities.clone().expect("capabilities");
    assert_eq!(caps.sleep_levels, [1]);
    assert!(!caps.sleep_query && caps.can_stop);
    assert_eq!(caps.activity_metric, "sglang:num_running_reqs");
    let sg_pid = sg.pid;

    // vLLM needs sg's room: sg releases its memory (level 1), counted asleep, and chat wakes.
    ask(&proxy, "chat").await;
    let sg = wait_state(&mut c, "sg", pb::ModelState::Asleep, LONG).await;
    assert_eq!(sg.sleep_level, 1);
    assert_eq!(reason(&sg), pb::IntentReason::Eviction as i32);
    assert_eq!(fake_stats(&sg).await["is_sleeping"], true);
    wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;

    // The OpenAI server needs the room next: chat sleeps, ocr starts.
    ask(&proxy, "ocr").await;
    let ocr = wait_state(&mut c, "ocr", pb::ModelState::Awake, LONG).await;
    assert_eq!(ocr.engine, "openai");
    let caps = ocr.capabilities.clone().expect("capabilities");
    assert!(caps.sleep_levels.is_empty() && caps.can_stop);
    assert_eq!(caps.health_path, "/health");
    let chat = wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG).await;
    assert_eq!(reason(&chat), pb::IntentReason::Eviction as i32);

    // SGLang again: ocr cannot sleep, so it is stopped to make room; sg is resumed, not
    // restarted, and its held request answered.
    ask(&proxy, "sg").await;
    let ocr = wait_state(&mut c, "ocr", pb::ModelState::Stopped, LONG).await;
    assert_eq!(reason(&ocr), pb::IntentReason::Eviction as i32);
    let sg = wait_state(&mut c, "sg", pb::ModelState::Awake, LONG).await;
    assert_eq!(
        (sg.pid, sg.restarts),
        (sg_pid, 1),
        "sg was resumed, not restarted"
    );
    assert_eq!(fake_stats(&sg).await["is_sleeping"], false);
    // SGLang reads a body whatever its `Content-Type`: the proxy passes a
    // text/plain one on (only a vLLM engine's is answered 400 by the proxy).
    let body = serde_json::json!({"model": "sg", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]});
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .header("content-type", "text/plain")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);

    // `siesta get` names each kind and what it can do.
    let get = at(&ctl, &["get", "sg"]).await.ok().stdout;
    assert!(get.contains("Engine:           sglang"), "{get}");
    assert!(get.contains("sleep (level 1), suspend, stop"), "{get}");
    let get = at(&ctl, &["get", "ocr"]).await.ok().stdout;
    assert!(get.contains("Engine:           openai"), "{get}");
    assert!(get.contains("Can:              suspend, stop;"), "{get}");
    let get = at(&ctl, &["get", "chat", "-o", "json"]).await.ok().json();
    assert_eq!(get["model"]["engine"], "vllm");
    assert_eq!(
        get["model"]["capabilities"]["sleep_levels"],
        serde_json::json!([1, 2])
    );

    // An operator cannot put the OpenAI server to sleep.
    let run = at(&ctl, &["sleep", "ocr"]).await;
    assert_ne!(run.code, 0, "{run:#?}");
    assert!(
        run.stderr
            .contains("engine = \"openai\", which cannot sleep at level 1"),
        "{run:#?}"
    );
}

#[tokio::test]
async fn an_openai_server_is_stopped_by_its_idle_tier_and_started_by_the_next_request() {
    let ocr_idle = r#"idle = [ { after = "1s", action = "stop" } ]"#;
    let ctl = start(&one_gpu(&models(ocr_idle))).await;
    let mut c = ctl.client().await;
    if !gpus_from_config(&mut c).await {
        return;
    }
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&proxy).await;
    ask(&proxy, "ocr").await;
    let ocr = wait_state(&mut c, "ocr", pb::ModelState::Stopped, LONG).await;
    assert_eq!(reason(&ocr), pb::IntentReason::IdleTier as i32);
    // The next request starts it again and is held until it serves.
    ask(&proxy, "ocr").await;
    let ocr = status(&mut c, "ocr").await;
    assert_eq!(ocr.restarts, 2);
}

#[tokio::test]
async fn a_reload_asking_an_openai_server_to_sleep_is_refused_with_its_tiers() {
    let ctl = start(&one_gpu(&models(""))).await;
    let bad = one_gpu(&models(
        r#"idle = [ { after = "5m", action = "sleep", level = 1 } ]"#,
    ))
    .replace("@DIR@", &ctl.dir.path().display().to_string())
    .replace("@FAKE_VLLM@", &siesta_tests::fake_vllm_command());
    std::fs::write(&ctl.config_path, bad).unwrap();
    let run = at(&ctl, &["reload"]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    let want = format!(
        "{}: model[2].idle[0].action: an engine = \"openai\" cannot sleep at level 1; \
         its idle tiers can be: suspend, stop",
        ctl.config_path.display()
    );
    assert!(run.stderr.contains(&want), "{run:#?}");
    // The running configuration stays.
    let mut c = ctl.client().await;
    let ocr = status(&mut c, "ocr").await;
    assert_eq!(ocr.engine, "openai");
}

#[tokio::test]
async fn a_config_asking_an_openai_server_to_sleep_is_refused_with_its_tiers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("box.toml");
    let text = models(r#"idle = [ { after = "5m", action = "sleep", level = 1 } ]"#)
        .replace("@FAKE_VLLM@", "/bin/true")
        .replace("@DIR@", &dir.path().display().to_string());
    std::fs::write(&path, text).unwrap();
    let run = siesta(&["config", "check", path.to_str().unwrap()]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert_eq!(
        run.stderr.trim_end(),
        format!(
            "{}: model[2].idle[0].action: an engine = \"openai\" cannot sleep at level 1; \
             its idle tiers can be: suspend, stop",
            path.display()
        ),
        "{run:#?}"
    );
}

/// SGLang cannot say whether it sleeps: after a control restart it is adopted at the state
/// siesta recorded (asleep), probed only where nothing reaches its GPU (the stand-in dies
/// otherwise), and woken by a resume when a request comes; the OpenAI server is adopted
/// awake from its health.
#[tokio::test]
async fn a_restarted_control_adopts_a_released_sglang_and_an_openai_server() {
    let text = one_gpu(&models(""))
        .replace(
            "name = \"sg\"\nengine = \"sglang\"",
            "name = \"sg\"\nengine = \"sglang\"\npreload = \"asleep\"",
        )
        .replace(
            "name = \"ocr\"\nengine = \"openai\"",
            "name = \"ocr\"\nengine = \"openai\"\npreload = \"awake\"",
        )
        // All fit awake together: only adoption is tested here.
        .replace("gpu_memory = 0.6", "gpu_memory = 0.3");
    let mut ctl = start(&text).await;
    let mut c = ctl.client().await;
    if !gpus_from_config(&mut c).await {
        return;
    }
    let sg = wait_state(&mut c, "sg", pb::ModelState::Asleep, LONG).await;
    let ocr = wait_state(&mut c, "ocr", pb::ModelState::Awake, LONG).await;
    let (sg_pid, ocr_pid) = (sg.pid, ocr.pid);

    ctl.restart().await;
    let mut c = ctl.client().await;
    let sg = wait_state(&mut c, "sg", pb::ModelState::Asleep, LONG).await;
    assert_eq!(
        (sg.pid, sg.sleep_level),
        (sg_pid, 1),
        "adopted, not restarted"
    );
    let ocr = wait_state(&mut c, "ocr", pb::ModelState::Awake, LONG).await;
    assert_eq!(ocr.pid, ocr_pid, "adopted, not restarted");
    assert_eq!(fake_stats(&sg).await["is_sleeping"], true);

    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&proxy).await;
    ask(&proxy, "sg").await;
    let sg = wait_state(&mut c, "sg", pb::ModelState::Awake, LONG).await;
    assert_eq!(sg.pid, sg_pid, "woken by a resume, not restarted");
}
