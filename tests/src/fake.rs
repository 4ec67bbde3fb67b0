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
