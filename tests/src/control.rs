//! Spawning `siesta-control` on port 0 with a config written into a temp dir.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use siesta_proto::v1::control_client::ControlClient;
use tempfile::TempDir;
use tonic::transport::Channel;

use crate::{Child, DEADLINE, POLL, bin_path, fake_vllm_command, wait_addr_file};

/// A running `siesta-control`.
///
/// In the config text, `@DIR@` is replaced by the temp dir's path (e.g. for `state_dir`) and
/// `@FAKE_VLLM@` by the fake-vllm binary's path.
#[derive(Debug)]
pub struct ControlProc {
    /// The gRPC address it listens on.
    pub addr: SocketAddr,
    /// The process (its group is killed on drop; engines run in their own groups).
    pub child: Child,
    /// The temp dir holding `siesta.toml`, the addr file, and whatever the test puts there.
    pub dir: TempDir,
    /// The config file's path.
    pub config_path: PathBuf,
    extra_args: Vec<String>,
    /// Value of [`OWNER_ENV`] given to this control (and inherited by its engines).
    owner: String,
}

/// Environment variable marking every process a [`ControlProc`] started (the control plane
/// and, by inheritance, its engines), so that dropping it kills engines that outlived it.
pub const OWNER_ENV: &str = "SIESTA_TEST_OWNER";

/// Writes `config_toml` to `DIR/siesta.toml` and runs
/// `siesta-control --config DIR/siesta.toml --listen 127.0.0.1:0 --addr-file DIR/control.addr`.
pub async fn spawn_control(config_toml: &str) -> ControlProc {
    spawn_control_with(config_toml, &[]).await
}

/// Like [`spawn_control`] with extra arguments (e.g. `--stop-engines-on-exit`).
pub async fn spawn_control_with(config_toml: &str, extra_args: &[&str]) -> ControlProc {
    let dir = tempfile::Builder::new()
        .prefix("siesta-control-")
        .tempdir()
        .expect("tempdir");
    let config_path = dir.path().join("siesta.toml");
    let text = config_toml.replace("@DIR@", &dir.path().to_string_lossy());
    let text = if text.contains("@FAKE_VLLM@") {
        text.replace("@FAKE_VLLM@", &fake_vllm_command())
    } else {
        text
    };
    std::fs::write(&config_path, text).expect("writing config");
    let extra_args: Vec<String> = extra_args.iter().map(|s| s.to_string()).collect();
    let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let owner = format!(
        "{}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst),
        crate::unix_nanos()
    );
    let (child, addr) = launch(dir.path().into(), &config_path, listen, &extra_args, &owner).await;
    ControlProc {
        addr,
        child,
        dir,
        config_path,
        extra_args,
        owner,
    }
}

async fn launch(
    dir: PathBuf,
    config: &std::path::Path,
    listen: SocketAddr,
    extra: &[String],
    owner: &str,
) -> (Child, SocketAddr) {
    let addr_file = dir.join("control.addr");
    let _ = std::fs::remove_file(&addr_file);
    let mut cmd = Command::new(bin_path("siesta-control"));
    cmd.arg("--config")
        .arg(config)
        .arg("--listen")
        .arg(listen.to_string())
        .arg("--addr-file")
        .arg(&addr_file)
        .args(extra)
        .env(OWNER_ENV, owner);
    let mut child = Child::spawn("siesta-control", cmd);
    let addrs = wait_addr_file(&mut child, &addr_file, &["grpc"], DEADLINE).await;
    (child, addrs[0])
}

impl ControlProc {
    /// `http://IP:PORT`, for tonic clients and `--control` flags.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A connected gRPC client (retries connecting up to the deadline).
    pub async fn client(&self) -> ControlClient<Channel> {
        let start = Instant::now();
        loop {
            match ControlClient::connect(self.url()).await {
                Ok(c) => return c,
                Err(e) if start.elapsed() > DEADLINE => {
                    panic!("connecting to siesta-control at {}: {e}", self.url())
                }
                Err(_) => tokio::time::sleep(POLL).await,
            }
        }
    }

    /// Pids of every live process this control started, itself included (engines too, even
    /// after the control that started them was killed).
    pub fn owned_pids(&self) -> Vec<i32> {
        crate::pids_with_env(OWNER_ENV, &self.owner)
    }

    /// SIGKILLs the control process's group (not the engines, which have their own groups).
    pub fn kill9(&mut self) {
        self.child.kill9();
    }

    /// SIGTERMs the control process and waits for it to exit (its engines stay, unless it was
    /// started with `--stop-engines-on-exit`).
    pub async fn terminate(&mut self) -> std::process::ExitStatus {
        self.child.signal(nix::sys::signal::Signal::SIGTERM);
        self.child.wait_exit(DEADLINE).await
    }

    /// Kills (SIGKILL, if still running) and starts it again with the same config, dir and
    /// extra arguments, listening on the same address so that clients and proxies reconnect.
    pub async fn restart(&mut self) {
        self.kill9();
        let (child, addr) = launch(
            self.dir.path().into(),
            &self.config_path,
            self.addr,
            &self.extra_args,
            &self.owner,
        )
        .await;
        self.child = child;
        self.addr = addr;
    }
}

impl Drop for ControlProc {
    /// Kills the control plane and every engine it (or an earlier incarnation) started.
    fn drop(&mut self) {
        self.child.kill9();
        for pid in self.owned_pids() {
            let pgrp = crate::proc_stat(pid).map_or(pid, |s| s.pgrp);
            let _ = killpg(Pid::from_raw(pgrp), Signal::SIGKILL);
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

/// Runs `siesta-control` with `args` (and `env`) until it exits, which it
/// must within `within` (a daemon that refuses to start or gives up):
/// (exit code, stderr).
pub async fn control_exit(
    args: &[&std::ffi::OsStr],
    env: &[(&str, &std::ffi::OsStr)],
    within: std::time::Duration,
) -> (Option<i32>, String) {
    let run = tokio::process::Command::new(bin_path("siesta-control"))
        .args(args)
        .envs(env.iter().copied())
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(within, run)
        .await
        .unwrap_or_else(|_| panic!("siesta-control {args:?} did not exit within {within:?}"))
        .expect("running siesta-control");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
