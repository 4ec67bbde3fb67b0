//! Running the `siesta` CLI in end-to-end tests and waiting on model
//! states.

use std::process::Stdio;
use std::time::Duration;

use crate::{ControlProc, DEADLINE, bin_path, wait_until};
use serde_json::Value;
use siesta_proto::v1 as pb;
use tokio::io::BufReader;

/// Two fake-vllm models, no GPU, idle tiers far away.
pub const CONFIG: &str = r#"
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
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn ok(self) -> Run {
        assert_eq!(self.code, 0, "siesta failed: {self:#?}");
        self
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {self:#?}"))
    }
}

/// Runs `siesta ARGS...` (without SIESTA_* from the environment).
pub async fn siesta(args: &[&str]) -> Run {
    siesta_env(args, &[]).await
}

pub async fn siesta_env(args: &[&str], env: &[(&str, &str)]) -> Run {
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
pub async fn at(control: &ControlProc, args: &[&str]) -> Run {
    let url = control.url();
    let mut all = vec!["--control", url.as_str()];
    all.extend_from_slice(args);
    siesta(&all).await
}

pub async fn model_state(control: &ControlProc, name: &str) -> (pb::ModelState, u32) {
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

pub async fn wait_state(
    control: &ControlProc,
    name: &str,
    want: pb::ModelState,
    level: Option<u32>,
) {
    let what = format!("{name} to be {want:?} (level {level:?})");
    wait_until(&what, DEADLINE, || async {
        let (s, l) = model_state(control, name).await;
        s == want && level.is_none_or(|lv| lv == l)
    })
    .await;
}

/// A port with nothing listening on it.
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// `siesta --control URL ARGS...` left running, stdout piped.
pub fn spawn_siesta(control: &ControlProc, args: &[&str]) -> tokio::process::Child {
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

pub async fn next_line(
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) -> String {
    tokio::time::timeout(DEADLINE, lines.next_line())
        .await
        .expect("a line within the deadline")
        .expect("reading stdout")
        .expect("stream still open")
}
