//! Driving one siesta-control over gRPC in end-to-end tests: a [`Ctl`]
//! that kills its engines on drop, config builders, status polling.

use crate::ControlProc;
use siesta_proto::v1 as pb;
use siesta_proto::v1::control_client::ControlClient;
use std::ops::{Deref, DerefMut};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// A siesta-control that, when dropped, is killed along with every engine
/// it started (found by their `SIESTA_TEST_TAG`).
#[derive(Debug)]
pub struct Ctl(pub ControlProc);

pub async fn start(config_toml: &str) -> Ctl {
    Ctl(crate::spawn_control(config_toml).await)
}

pub async fn start_with(config_toml: &str, args: &[&str]) -> Ctl {
    Ctl(crate::spawn_control_with(config_toml, args).await)
}

impl Deref for Ctl {
    type Target = ControlProc;
    fn deref(&self) -> &ControlProc {
        &self.0
    }
}

impl DerefMut for Ctl {
    fn deref_mut(&mut self) -> &mut ControlProc {
        &mut self.0
    }
}

impl Drop for Ctl {
    fn drop(&mut self) {
        // Control first, so it cannot restart what is killed next.
        self.0.kill9();
        let tag = format!("SIESTA_TEST_TAG={}", self.0.dir.path().display());
        kill_tagged(&tag);
    }
}

/// SIGKILLs the process group of every process whose environment holds `tag`.
pub fn kill_tagged(tag: &str) {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        if env.split(|b| *b == 0).any(|kv| kv == tag.as_bytes()) {
            let pgid = crate::proc_stat(pid).map_or(pid, |s| s.pgrp);
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pgid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

pub type Client = ControlClient<Channel>;

pub const LONG: Duration = Duration::from_secs(60);

/// A config with `[control]` in the test's dir, quick defaults and `models`.
pub fn config(models: &str) -> String {
    format!(
        r#"
[control]
state_dir = "@DIR@/state"

[defaults]
idle = []
max_hold = "30s"
start_timeout = "20s"
wake_timeout = "10s"
sleep_timeout = "10s"
stop_grace = "5s"
backoff_initial = "500ms"
backoff_max = "2s"

{models}
"#
    )
}

/// A process model running fake-vllm with extra flags.
/// Engines get `SIESTA_TEST_TAG=<the test's dir>` so [`Ctl`] can find and
/// kill them: siesta-control leaves engines running when it dies.
pub fn fake_model(name: &str, preload: &str, flags: &[&str], extra: &str) -> String {
    fake_model_on(name, preload, 0, flags, extra)
}

/// [`fake_model`] on `gpus` GPUs (`extra` gives its `gpu_memory`).
pub fn fake_model_on(name: &str, preload: &str, gpus: u32, flags: &[&str], extra: &str) -> String {
    let args: Vec<String> = flags.iter().map(|f| format!("{f:?}")).collect();
    format!(
        r#"
[[model]]
name = "{name}"
model = "fake/{name}"
executable = "@FAKE_VLLM@"
gpus = {gpus}
preload = "{preload}"
env = {{ SIESTA_TEST_TAG = "@DIR@" }}
args = [{}]
{extra}
"#,
        args.join(", ")
    )
}

pub async fn status(c: &mut Client, name: &str) -> pb::ModelStatus {
    c.get_model(pb::GetModelRequest { name: name.into() })
        .await
        .expect("GetModel")
        .into_inner()
        .model
        .expect("model")
}

/// Sends `Wake`; with `wait`, the reply comes once the model is awake or
/// failed (the model's own wake or start deadline).
pub async fn wake(c: &mut Client, name: &str, wait: bool) -> pb::OperationResponse {
    c.wake(pb::WakeRequest {
        name: name.into(),
        wait,
        timeout_ms: 0,
    })
    .await
    .expect("Wake")
    .into_inner()
}

/// Wakes and waits; panics with the server's message unless it ended awake.
pub async fn wake_awake(c: &mut Client, name: &str) -> pb::ModelStatus {
    let r = wake(c, name, true).await;
    let s = r.model.expect("model");
    assert_eq!(state(&s), pb::ModelState::Awake, "{name}: {}", r.message);
    s
}

pub fn state(s: &pb::ModelStatus) -> pb::ModelState {
    pb::ModelState::try_from(s.state).unwrap_or(pb::ModelState::Unspecified)
}

/// Polls until the model is in `want`; panics with its status otherwise.
pub async fn wait_state(
    c: &mut Client,
    name: &str,
    want: pb::ModelState,
    deadline: Duration,
) -> pb::ModelStatus {
    let start = Instant::now();
    loop {
        let s = status(c, name).await;
        if state(&s) == want {
            return s;
        }
        if start.elapsed() > deadline {
            panic!("{name} not {want:?} within {deadline:?}: {s:#?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls until `f` holds for the model's status.
pub async fn wait_status(
    c: &mut Client,
    name: &str,
    what: &str,
    deadline: Duration,
    f: impl Fn(&pb::ModelStatus) -> bool,
) -> pb::ModelStatus {
    let start = Instant::now();
    loop {
        let s = status(c, name).await;
        if f(&s) {
            return s;
        }
        if start.elapsed() > deadline {
            panic!("{name}: {what} not seen within {deadline:?}: {s:#?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One chat completion of at most `max_tokens` for `model` at `base_url`
/// (an engine or the proxy) within `within`: Ok(answer text) on 200, else Err with the status
/// or transport error and the body, naming the model.
pub async fn try_chat(
    base_url: &str,
    model: &str,
    max_tokens: u32,
    within: Duration,
) -> Result<String, String> {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
    });
    let v = try_chat_json(base_url, &body, within).await?;
    Ok(v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

/// POSTs `body` to `/v1/chat/completions`; the answer's JSON if it is a
/// 200 within `within`, else what went wrong (naming the body's model).
pub async fn try_chat_json(
    base_url: &str,
    body: &serde_json::Value,
    within: Duration,
) -> Result<serde_json::Value, String> {
    let model = body["model"].as_str().unwrap_or_default();
    let resp = reqwest::Client::new()
        .post(format!("{base_url}/v1/chat/completions"))
        .json(body)
        .timeout(within)
        .send()
        .await
        .map_err(|e| format!("{model}: no answer within {within:?}: {e}"))?;
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    if status != 200 {
        return Err(format!("{model}: HTTP {status}: {text}"));
    }
    serde_json::from_str(&text).map_err(|e| format!("{model}: bad JSON {e}: {text}"))
}

/// A chat completion straight to the engine; returns the answer text.
pub async fn chat(base_url: &str, model: &str) -> String {
    try_chat(base_url, model, 64, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("chat: {e}"))
}

pub fn endpoint(s: &pb::ModelStatus) -> String {
    s.endpoints.first().expect("endpoint").url.clone()
}

/// Whether the control plane's GPUs are the config's `[[gpu]]` list; where
/// NVML is present they are the real ones and GPU tests skip (said once).
pub async fn gpus_from_config(c: &mut Client) -> bool {
    let gpus = c
        .list_gpus(pb::ListGpusRequest {})
        .await
        .expect("ListGpus")
        .into_inner();
    if gpus.source != "config" {
        eprintln!(
            "skipped: GPUs come from {} here, not the config",
            gpus.source
        );
        return false;
    }
    true
}

/// Waits until the proxy's `/v1/models/MODEL` shows `state` as its
/// `siesta_state` (the proxy has the event, not only the control plane).
pub async fn proxy_sees(proxy: &crate::ProxyProc, model: &str, state: &str) {
    let url = format!("{}/v1/models/{model}", proxy.url());
    crate::wait_until(&format!("the proxy sees {model} {state}"), LONG, || async {
        match reqwest::get(&url).await {
            Ok(r) if r.status() == 200 => r
                .json::<serde_json::Value>()
                .await
                .is_ok_and(|v| v["siesta_state"] == state),
            _ => false,
        }
    })
    .await;
}

/// Waits until the proxy's `/readyz` answers 200 (it has a route table).
pub async fn proxy_ready(proxy: &crate::ProxyProc) {
    let ready = format!("{}/readyz", proxy.admin_url());
    crate::wait_until("proxy ready", LONG, || async {
        matches!(reqwest::get(&ready).await, Ok(r) if r.status() == 200)
    })
    .await;
}

/// POSTs `body` to `url` with each `Content-Type` vLLM's JSON-only routes
/// refuse (none, a form's, text, and JSON with a space before its `;`,
/// which vLLM does not take off): each a 400 in vLLM's words, whose error
/// bodies are returned.
pub async fn refused_types(url: &str, body: &str) -> Vec<serde_json::Value> {
    let http = reqwest::Client::new();
    let mut refused = Vec::new();
    for content_type in [
        None,
        Some("application/x-www-form-urlencoded"),
        Some("text/plain"),
        Some("application/json ; charset=utf-8"),
    ] {
        let mut req = http.post(url).body(body.to_owned());
        if let Some(t) = content_type {
            req = req.header("content-type", t);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 400, "{content_type:?}");
        let v: serde_json::Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("Only 'application/json' is allowed")),
            "{content_type:?}: {v}"
        );
        refused.push(v);
    }
    refused
}

/// POSTs `body` to `url` as `Application/JSON; charset=utf-8`: a 200.
pub async fn json_taken(url: &str, body: &str) {
    let ok = reqwest::Client::new()
        .post(url)
        .header("content-type", "Application/JSON; charset=utf-8")
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
}
