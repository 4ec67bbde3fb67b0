//! Spawning `fake-vllm serve ...` and finding its port from the uvicorn banner.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Instant;

use crate::{Child, DEADLINE, POLL, bin_path};

/// A running fake-vllm whose HTTP server is up.
#[derive(Debug)]
pub struct FakeVllm {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// The address it serves on.
    pub addr: SocketAddr,
    /// The process (its group is killed on drop).
    pub child: Child,
}

impl FakeVllm {
    /// `self.url` + `path`.
    pub fn at(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// `POST path` with no body.
    pub async fn post(&self, path: &str) -> reqwest::Response {
        reqwest::Client::new()
            .post(self.at(path))
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path}: {e}"))
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> reqwest::Response {
        reqwest::Client::new()
            .get(self.at(path))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    /// `GET /fake/stats`.
    pub async fn stats(&self) -> serde_json::Value {
        self.get("/fake/stats").await.json().await.unwrap()
    }

    /// The value of the `/metrics` sample of `name` whose labels contain `label`
    /// (e.g. `sleep_state="awake"`, or `""` for the first sample).
    pub async fn metric(&self, name: &str, label: &str) -> f64 {
        let text = self.get("/metrics").await.text().await.unwrap();
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
            .unwrap_or_else(|| panic!("no {name} {label} in:\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    /// `vllm:engine_sleep_state` as (awake, weights_offloaded, discard_all).
    pub async fn sleep_state(&self) -> (f64, f64, f64) {
        let s = "vllm:engine_sleep_state";
        (
            self.metric(s, "sleep_state=\"awake\"").await,
            self.metric(s, "sleep_state=\"weights_offloaded\"").await,
            self.metric(s, "sleep_state=\"discard_all\"").await,
        )
    }

    /// The engine core's pid (from `/fake/stats`).
    pub async fn engine_core_pid(&self) -> i32 {
        self.stats().await["engine_core_pid"]
            .as_i64()
            .expect("engine core runs") as i32
    }
}

/// The command `fake-vllm serve ARGS... --host 127.0.0.1 --port 0`, with
/// `VLLM_SERVER_DEV_MODE=1` and then `env` applied. `args` start with the model name;
/// later flags override earlier ones, so `args` may override host and port.
pub fn fake_vllm_cmd(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(bin_path("fake-vllm"));
    cmd.arg("serve");
    let (model, rest) = args
        .split_first()
        .map_or(("fake-model", &[][..]), |(m, r)| (*m, r));
    cmd.arg(model)
        .args(["--host", "127.0.0.1", "--port", "0"])
        .args(rest);
    cmd.env("VLLM_SERVER_DEV_MODE", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Spawns fake-vllm (dev mode on) and waits until it serves HTTP.
/// `args`: the model, then flags, e.g. `&["m", "--enable-sleep-mode"]`.
pub async fn spawn_fake_vllm(args: &[&str]) -> FakeVllm {
    spawn_fake_vllm_env(args, &[]).await
}

/// Like [`spawn_fake_vllm`] with extra environment (e.g. `("VLLM_SERVER_DEV_MODE", "0")`).
pub async fn spawn_fake_vllm_env(args: &[&str], env: &[(&str, &str)]) -> FakeVllm {
    let mut child = spawn_fake_vllm_nowait(args, env);
    let addr = wait_uvicorn(&mut child).await;
    FakeVllm {
        url: format!("http://{addr}"),
        addr,
        child,
    }
}

/// Spawns `fake-vllm ARGS...` exactly as given (e.g. `--personality sglang --model-path m
/// --port 0 ...`), with `VLLM_SERVER_DEV_MODE=1` (a personality without vLLM's dev routes
/// must hide them anyway), and waits until it serves HTTP.
pub async fn spawn_fake_vllm_argv(args: &[&str]) -> FakeVllm {
    let mut cmd = Command::new(bin_path("fake-vllm"));
    cmd.args(args).env("VLLM_SERVER_DEV_MODE", "1");
    let mut child = Child::spawn("fake-vllm", cmd);
    let addr = wait_uvicorn(&mut child).await;
    FakeVllm {
        url: format!("http://{addr}"),
        addr,
        child,
    }
}

/// Spawns fake-vllm without waiting for start-up (for start-up fault tests).
pub fn spawn_fake_vllm_nowait(args: &[&str], env: &[(&str, &str)]) -> Child {
    Child::spawn("fake-vllm", fake_vllm_cmd(args, env))
}

/// Parses `INFO:     Uvicorn running on http://H:PORT (Press CTRL+C to quit)`.
pub fn parse_uvicorn_line(line: &str) -> Option<SocketAddr> {
    let rest = line.split("Uvicorn running on http://").nth(1)?;
    let addr = rest.split_whitespace().next()?;
    addr.parse().ok()
}

async fn wait_uvicorn(child: &mut Child) -> SocketAddr {
    let start = Instant::now();
    loop {
        if let Some(addr) = child
            .output()
            .find("Uvicorn running on")
            .and_then(|l| parse_uvicorn_line(&l))
        {
            return addr;
        }
        if let Some(status) = child.try_exit() {
            panic!(
                "fake-vllm exited ({status}) before serving; output:\n{}",
                child.output().text()
            );
        }
        if start.elapsed() > DEADLINE {
            panic!(
                "fake-vllm did not start within {DEADLINE:?}; output:\n{}",
                child.output().text()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Checks what vLLM answers two requests in flight when its engine core
/// dies (directly, or through siesta): `plain` (not streamed) a 500
/// `EngineDeadError`, `streamed` an error event and then `data: [DONE]`,
/// both whole (not cut off).
pub async fn assert_engine_dead_answers(
    plain: tokio::task::JoinHandle<reqwest::Result<reqwest::Response>>,
    streamed: reqwest::Response,
) {
    let plain = tokio::time::timeout(DEADLINE, plain)
        .await
        .expect("the request in flight was not answered")
        .unwrap()
        .expect("the request in flight was cut off");
    assert_eq!(plain.status(), 500);
    let body: serde_json::Value = plain.json().await.unwrap();
    assert_eq!(body["error"]["type"], "EngineDeadError", "{body}");
    let text = tokio::time::timeout(DEADLINE, streamed.text())
        .await
        .expect("the stream did not end")
        .expect("the stream was cut off instead of ending with an error event");
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{text}");
    let error = events[events.len().saturating_sub(2)];
    assert!(
        error.starts_with("data: {\"error\"") && error.contains("EngineDeadError"),
        "{error}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_uvicorn_banner() {
        let line = "INFO:     Uvicorn running on http://127.0.0.1:41234 (Press CTRL+C to quit)";
        assert_eq!(
            parse_uvicorn_line(line),
            Some("127.0.0.1:41234".parse().unwrap())
        );
        assert_eq!(parse_uvicorn_line("INFO: something else"), None);
    }
}
