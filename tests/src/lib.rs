//! Shared helpers for siesta's end-to-end tests.
//!
//! The tests drive the real binaries (`siesta-control`, `siesta-proxy`, `siesta`, `fake-vllm`)
//! found in the target directory next to the test executable; build them first with
//! `cargo build --workspace --bins`. Every process runs in its own process group, which is
//! SIGKILLed when its [`Child`] is dropped, so a failing test leaves nothing behind.
//!
//! [`ctl`] drives one siesta-control over gRPC (a [`ctl::Ctl`] also kills the engines it
//! started), [`cli`] runs the `siesta` command line against one.
#![forbid(unsafe_code)]

mod browser;
mod child;
pub mod cli;
mod control;
pub mod ctl;
mod fake;
mod procfs;
mod proxy;
pub mod swap;
pub mod web;

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use browser::{Browser, chromium_path};
pub use child::{Child, Output};
pub use control::{ControlProc, control_exit, spawn_control, spawn_control_with};
pub use fake::{
    FakeVllm, assert_engine_dead_answers, fake_vllm_cmd, parse_uvicorn_line, spawn_fake_vllm,
    spawn_fake_vllm_argv, spawn_fake_vllm_env, spawn_fake_vllm_nowait,
};
pub use procfs::{
    ProcStat, alive, any_alive, descendants, group_members, pids_with_env, proc_stat,
};
pub use proxy::{ProxyProc, spawn_proxy, spawn_proxy_at};

/// How often [`wait_until`] polls its condition.
pub const POLL: Duration = Duration::from_millis(20);

/// A generous deadline for things that should take well under a second.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// The directory holding the workspace's binaries: the parent of the test executable's
/// `deps` directory (or `SIESTA_BIN_DIR` when set).
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SIESTA_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe
        .parent()
        .expect("test executable has a parent")
        .to_path_buf();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    dir
}

/// The path of the workspace binary `name` (e.g. `"fake-vllm"`, `"siesta-control"`).
///
/// Panics with a clear message when it has not been built.
pub fn bin_path(name: &str) -> PathBuf {
    let path = bin_dir().join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "binary `{name}` not found at {}: run `cargo build --workspace --bins` first",
        path.display()
    );
    path
}

/// The path of the fake-vllm binary as a string, for `executable = "..."` in configs.
pub fn fake_vllm_command() -> String {
    bin_path("fake-vllm").to_string_lossy().into_owned()
}

/// Polls `f` every [`POLL`] until it returns true; panics naming `what` after `deadline`.
pub async fn wait_until<F, Fut>(what: &str, deadline: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if f().await {
            return;
        }
        if start.elapsed() > deadline {
            panic!("timed out after {deadline:?} waiting for {what}");
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Like [`wait_until`] but for a synchronous condition that yields a value.
pub async fn wait_for<T>(what: &str, deadline: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        if start.elapsed() > deadline {
            panic!("timed out after {deadline:?} waiting for {what}");
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Nanoseconds since the Unix epoch (for unique tags).
pub(crate) fn unix_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// Reads an address file of `key=IP:PORT` lines (as written by `--addr-file`) into pairs.
/// Returns `None` while the file does not exist yet.
pub fn read_addr_file(path: &std::path::Path) -> Option<Vec<(String, std::net::SocketAddr)>> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut out = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (k, v) = line.split_once('=')?;
        out.push((k.trim().to_string(), v.trim().parse().ok()?));
    }
    Some(out)
}

/// Waits for `child` to write its address file with every key in `keys`; panics (with the
/// child's output) if it exits first or the deadline passes.
pub async fn wait_addr_file(
    child: &mut Child,
    path: &std::path::Path,
    keys: &[&str],
    deadline: Duration,
) -> Vec<std::net::SocketAddr> {
    let start = Instant::now();
    loop {
        if let Some(pairs) = read_addr_file(path) {
            let found: Option<Vec<_>> = keys
                .iter()
                .map(|k| pairs.iter().find(|(pk, _)| pk == k).map(|(_, a)| *a))
                .collect();
            if let Some(found) = found {
                return found;
            }
        }
        if let Some(status) = child.try_exit() {
            panic!(
                "{} exited ({status}) before writing {}; output:\n{}",
                child.name(),
                path.display(),
                child.output().text()
            );
        }
        if start.elapsed() > deadline {
            panic!(
                "{} did not write {} within {deadline:?}; output:\n{}",
                child.name(),
                path.display(),
                child.output().text()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}
