//! The `siesta` CLI against a real siesta-control with fake-vllm engines:
//! every command, `-o json`, exit codes, and the message when the control
//! plane is down.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use siesta_proto::v1 as pb;
use siesta_tests::{ControlProc, DEADLINE, bin_path, spawn_control_with, wait_until};
use tokio::io::{AsyncBufReadExt, BufReader};

const CONFIG: &str = r#"
[control]
state_dir = "@DIR@/state"

[defaults]
idle = [ { after = "1h", action = "sleep", level = 1 } ]
start_timeout = "30s"
wake_timeout = "30s"
sleep_timeout = "30s"
stop_grace = "5s"

[[model]]
name = "chat"
aliases = ["gpt-4o-mini"]
model = "Qwen/Qwen3-8B"
executable = "@FAKE_VLLM@"
gpus = 0
preload = "asleep"

[[model]]
name = "embed"
model = "Qwen/Qwen3-Embedding-0.6B"
executable = "@FAKE_VLLM@"
gpus = 0
args = ["--runner", "pooling"]
"#;

/// What one `siesta` run printed and how it exited.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn ok(self) -> Run {
        assert_eq!(self.code, 0, "siesta failed: {self:#?}");
        self
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {self:#?}"))
    }
}

/// Runs `siesta ARGS...` (without SIESTA_* from the environment).
async fn siesta(args: &[&str]) -> Run {
    siesta_env(args, &[]).await
}

async fn siesta_env(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = tokio::process::Command::new(bin_path("siesta"));
    cmd.args(args)
        .env_remove("SIESTA_CONTROL")
        .env_remove("SIESTA_TOKEN")
        .envs(env.iter().copied());
    cmd.stdin(Stdio::null()).kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("siesta {args:?} did not finish within 60s"))
        .expect("running siesta");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `siesta --control URL ARGS...`
async fn at(control: &ControlProc, args: &[&str]) -> Run {
    let url = control.url();
    let mut all = vec!["--control", url.as_str()];
    all.extend_from_slice(args);
    siesta(&all).await
}

async fn model_state(control: &ControlProc, name: &str) -> (pb::ModelState, u32) {
    let mut client = control.client().await;
    let m = client
        .get_model(pb::GetModelRequest { name: name.into() })
        .await
        .expect("GetModel")
        .into_inner()
        .model
        .expect("model status");
    (m.state(), m.sleep_level)
}

async fn wait_state(control: &ControlProc, name: &str, want: pb::ModelState, level: Option<u32>) {
    let what = format!("{name} to be {want:?} (level {level:?})");
    wait_until(&what, DEADLINE, || async {
        let (s, l) = model_state(control, name).await;
        s == want && level.is_none_or(|lv| lv == l)
    })
    .await;
}

/// A port with nothing listening on it.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[tokio::test]
async fn unreachable_control_plane_is_exit_3_with_one_clear_line() {
    let url = format!("http://127.0.0.1:{}", closed_port());
    let want =
        format!("cannot reach siesta-control at {url}: connection refused — is it running?\n");
    for args in [
        &["status"][..],
        &["wake", "chat", "--wait"],
        &["watch", "-o", "json"],
        &["logs", "chat", "-f"],
    ] {
        let mut all = vec!["--control", url.as_str()];
        all.extend_from_slice(args);
        let run = siesta(&all).await;
        assert_eq!(run.code, 3, "{args:?}: {run:#?}");
        assert_eq!(run.stderr, want, "{args:?}");
        assert_eq!(run.stdout, "", "{args:?}");
    }
    // The address also comes from SIESTA_CONTROL.
    let run = siesta_env(&["status"], &[("SIESTA_CONTROL", &url)]).await;
    assert_eq!((run.code, run.stderr.as_str()), (3, want.as_str()));
}

#[tokio::test]
async fn usage_errors_are_exit_2() {
    for args in [
        &["sleep", "chat", "--level", "3"][..],
        &["frobnicate"],
        &["pin", "chat", "--for", "soon"],
        &[],
    ] {
        let run = siesta(args).await;
        assert_eq!(run.code, 2, "{args:?}: {run:#?}");
    }
}

#[tokio::test]
async fn config_check_prints_each_problem_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        "[[model]]\nname = \"chat\"\nmodel = \"m\"\ngpus = 0\n",
    )
    .unwrap();
    let run = siesta(&["config", "check", good.to_str().unwrap()])
        .await
        .ok();
    assert!(run.stdout.contains("ok"), "{run:#?}");

    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[model]]\nname = \"chat\"\nmodel = \"m\"\ncolour = \"red\"\npreload = \"maybe\"\n",
    )
    .unwrap();
    let run = siesta(&["config", "check", bad.to_str().unwrap()]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    let lines: Vec<&str> = run.stderr.lines().collect();
    assert_eq!(lines.len(), 2, "one line per problem: {run:#?}");
    let file = bad.display().to_string();
    assert!(
        lines
            .iter()
            .all(|l| l.starts_with(&format!("{file}: model[0]."))),
        "{run:#?}"
    );
    assert!(run.stderr.contains("colour"), "{run:#?}");
    assert!(run.stderr.contains("preload"), "{run:#?}");
}

#[tokio::test]
async fn completion_scripts_are_generated() {
    for shell in ["bash", "zsh", "fish"] {
        let run = siesta(&["completion", shell]).await.ok();
        assert!(run.stdout.contains("siesta"), "{shell}: {run:#?}");
        assert!(run.stdout.contains("placement"), "{shell}: {run:#?}");
    }
}

#[tokio::test]
async fn every_command_against_a_real_control_plane() {
    let mut control = spawn_control_with(CONFIG, &["--stop-engines-on-exit"]).await;
    wait_state(&control, "chat", pb::ModelState::Asleep, Some(1)).await;

    // status: table and JSON.
    let run = at(&control, &["status"]).await.ok();
    let header = run.stdout.lines().next().unwrap_or("");
    for col in [
        "MODEL",
        "STATE",
        "GPUS",
        "ENDPOINT",
        "IDLE",
        "IN FLIGHT",
        "NEXT TIER",
        "LAST ERROR",
    ] {
        assert!(header.contains(col), "{col} missing: {run:#?}");
    }
    let chat_line = run
        .stdout
        .lines()
        .find(|l| l.starts_with("chat "))
        .expect("chat row");
    assert!(chat_line.contains("asleep(l1)"), "{run:#?}");
    let json = at(&control, &["status", "-o", "json"]).await.ok().json();
    let names: Vec<&str> = json["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["chat", "embed"]);
    assert_eq!(json["models"][0]["state"], "asleep");
    assert_eq!(json["models"][0]["sleep_level"], 1);
    assert!(json["revision"].as_u64().unwrap() > 0);

    // get: by alias, text and JSON, with calibration and placement.
    let run = at(&control, &["get", "gpt-4o-mini"]).await.ok();
    for key in ["Name:", "State:", "Calibration:", "start:", "Placement:"] {
        assert!(run.stdout.contains(key), "{key}: {run:#?}");
    }
    let json = at(&control, &["get", "chat", "-o", "json"])
        .await
        .ok()
        .json();
    assert_eq!(json["model"]["name"], "chat");
    assert_eq!(json["model"]["aliases"][0], "gpt-4o-mini");
    assert!(
        json["model"]["calibration"]["start_ms"].as_u64().unwrap() > 0,
        "start measured: {json}"
    );
    assert!(json["placement"].is_object(), "{json}");

    // An unknown model: exit 1 with the server's message.
    let run = at(&control, &["get", "no-such-model"]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert!(
        run.stderr.starts_with("error: ") && run.stderr.contains("no-such-model"),
        "{run:#?}"
    );

    // wake --wait: ends awake, says how long against the estimate.
    let run = at(&control, &["wake", "chat", "--wait"]).await.ok();
    assert!(run.stdout.starts_with("chat: awake after "), "{run:#?}");
    assert_eq!(model_state(&control, "chat").await.0, pb::ModelState::Awake);

    // sleep --level 2, then a JSON wake --wait.
    let json = at(&control, &["sleep", "chat", "--level", "2", "-o", "json"])
        .await
        .ok()
        .json();
    assert_eq!(json["model"]["name"], "chat");
    wait_state(&control, "chat", pb::ModelState::Asleep, Some(2)).await;
    let json = at(&control, &["wake", "chat", "--wait", "-o", "json"])
        .await
        .ok()
        .json();
    assert_eq!(json["model"]["state"], "awake", "{json}");

    // pin --for / unpin.
    at(&control, &["pin", "chat", "--for", "1h"]).await.ok();
    let json = at(&control, &["get", "chat", "-o", "json"])
        .await
        .ok()
        .json();
    let pinned = json["model"]["pinned_until_unix_ms"].as_i64().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    assert!(
        (now + 3_500_000..=now + 3_700_000).contains(&pinned),
        "pinned until {pinned}, now {now}"
    );
    at(&control, &["unpin", "chat"]).await.ok();
    let json = at(&control, &["get", "chat", "-o", "json"])
        .await
        .ok()
        .json();
    assert_eq!(json["model"]["pinned_until_unix_ms"], 0);

    // logs: the engine's own output.
    let run = at(&control, &["logs", "chat"]).await.ok();
    assert!(run.stdout.contains("Uvicorn running on"), "{run:#?}");
    let run = at(&control, &["logs", "chat", "--tail", "1", "-o", "json"])
        .await
        .ok();
    let lines: Vec<Value> = run
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{run:#?}");
    assert!(lines[0]["seq"].is_u64() && lines[0]["line"].is_string());

    // watch -o json: a snapshot first, then the events of a stop and a start.
    let mut watch = spawn_siesta(&control, &["watch", "-o", "json"]);
    let mut events = BufReader::new(watch.stdout.take().unwrap()).lines();
    let first: Value = serde_json::from_str(&next_line(&mut events).await).unwrap();
    assert_eq!(first["type"], "snapshot");
    assert_eq!(first["models"].as_array().unwrap().len(), 2);

    // stop / start / restart.
    let run = at(&control, &["stop", "embed"]).await.ok();
    assert!(run.stdout.starts_with("embed: "), "{run:#?}");
    wait_state(&control, "embed", pb::ModelState::Stopped, None).await;
    at(&control, &["start", "embed"]).await.ok();
    wait_state(&control, "embed", pb::ModelState::Awake, None).await;
    let mut last_rev = first["revision"].as_u64().unwrap();
    let mut saw_awake = false;
    while !saw_awake {
        let ev: Value = serde_json::from_str(&next_line(&mut events).await).unwrap();
        let rev = ev["revision"].as_u64().unwrap();
        assert!(rev > last_rev, "revisions increase: {rev} after {last_rev}");
        last_rev = rev;
        saw_awake = ev["type"] == "model"
            && ev["model"]["name"] == "embed"
            && ev["model"]["state"] == "awake";
    }
    drop(watch);
    let json = at(&control, &["restart", "embed", "-o", "json"])
        .await
        .ok()
        .json();
    assert_eq!(json["model"]["name"], "embed");
    wait_until("embed restarted", DEADLINE, || async {
        let mut c = control.client().await;
        let m = c
            .get_model(pb::GetModelRequest {
                name: "embed".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .model
            .unwrap();
        m.state() == pb::ModelState::Awake && m.restarts >= 2
    })
    .await;

    // watch, human-readable: a snapshot line, then one line per model.
    let mut watch = spawn_siesta(&control, &["watch"]);
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    assert!(next_line(&mut lines).await.contains("snapshot"));
    let chat = next_line(&mut lines).await;
    assert!(chat.contains("chat: awake"), "{chat}");
    drop(watch);

    // gpus, placement, diag p2p: no GPUs here, still answered.
    let run = at(&control, &["gpus"]).await.ok();
    assert!(run.stdout.starts_with("inventory: "), "{run:#?}");
    let json = at(&control, &["gpus", "-o", "json"]).await.ok().json();
    assert!(
        json["gpus"].is_array() && json["source"].is_string(),
        "{json}"
    );
    let run = at(&control, &["placement"]).await.ok();
    assert!(
        run.stdout.contains("chat") && run.stdout.contains("embed"),
        "{run:#?}"
    );
    let json = at(&control, &["placement", "-o", "json"]).await.ok().json();
    assert_eq!(json["models"].as_array().unwrap().len(), 2, "{json}");
    let run = at(&control, &["diag", "p2p", "-o", "json"]).await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert!(run.json()["results"].is_array());

    // reload: the same file, nothing changes.
    let json = at(&control, &["reload", "-o", "json"]).await.ok().json();
    assert_eq!(json["unchanged"].as_array().unwrap().len(), 2, "{json}");

    // Operations on an unknown model fail with exit 1.
    let run = at(&control, &["sleep", "nope"]).await;
    assert_eq!(run.code, 1, "{run:#?}");

    control.terminate().await;
}

#[tokio::test]
async fn logs_follow_streams_new_lines() {
    let mut control = spawn_control_with(CONFIG, &["--stop-engines-on-exit"]).await;
    wait_state(&control, "chat", pb::ModelState::Asleep, Some(1)).await;
    let mut follow = spawn_siesta(&control, &["logs", "chat", "-f"]);
    let mut lines = BufReader::new(follow.stdout.take().unwrap()).lines();
    // A wake makes the engine (and siesta) log new lines.
    at(&control, &["wake", "chat"]).await.ok();
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !seen.iter().any(|l: &String| l.contains("wake")) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no wake line in {seen:#?}"
        );
        seen.push(next_line(&mut lines).await);
    }
    assert!(
        follow.try_wait().unwrap().is_none(),
        "logs -f keeps running"
    );
    drop(follow);
    control.terminate().await;
}

#[tokio::test]
async fn wake_wait_of_a_failing_model_exits_1_with_the_error() {
    let config = r#"
[control]
state_dir = "@DIR@/state"

[defaults]
start_timeout = "20s"
backoff_initial = "30s"

[[model]]
name = "broken"
model = "m"
executable = "@FAKE_VLLM@"
gpus = 0
args = ["--exit-during-startup"]
"#;
    let mut control = spawn_control_with(config, &["--stop-engines-on-exit"]).await;
    let run = at(&control, &["wake", "broken", "--wait"]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert!(run.stderr.contains("broken: not awake after"), "{run:#?}");
    let json = at(&control, &["status", "-o", "json"]).await.ok().json();
    assert_eq!(json["models"][0]["state"], "failed", "{json}");
    assert_ne!(json["models"][0]["last_error"], "", "{json}");
    let run = at(&control, &["status"]).await.ok();
    assert!(
        run.stdout.contains("failed") && run.stdout.contains("retry"),
        "{run:#?}"
    );
    control.terminate().await;
}

#[tokio::test]
async fn the_token_is_sent_as_a_bearer() {
    let config = r#"
[control]
state_dir = "@DIR@/state"
token = "s3cret-token"

[[model]]
name = "chat"
model = "m"
executable = "@FAKE_VLLM@"
gpus = 0
"#;
    let mut control = spawn_control_with(config, &["--stop-engines-on-exit"]).await;
    let url = control.url();
    let run = siesta(&["--control", &url, "status"]).await;
    assert_eq!(run.code, 1, "no token: {run:#?}");
    assert!(run.stderr.contains("SIESTA_TOKEN"), "{run:#?}");
    let run = siesta(&["--control", &url, "--token", "wrong", "status"]).await;
    assert_eq!(run.code, 1, "wrong token: {run:#?}");
    siesta(&["--control", &url, "--token", "s3cret-token", "status"])
        .await
        .ok();
    siesta_env(
        &["--control", &url, "status"],
        &[("SIESTA_TOKEN", "s3cret-token")],
    )
    .await
    .ok();
    control.terminate().await;
}

/// `siesta --control URL ARGS...` left running, stdout piped.
fn spawn_siesta(control: &ControlProc, args: &[&str]) -> tokio::process::Child {
    tokio::process::Command::new(bin_path("siesta"))
        .arg("--control")
        .arg(control.url())
        .args(args)
        .env_remove("SIESTA_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawning siesta")
}

async fn next_line(lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>) -> String {
    tokio::time::timeout(DEADLINE, lines.next_line())
        .await
        .expect("a line within the deadline")
        .expect("reading stdout")
        .expect("stream still open")
}
