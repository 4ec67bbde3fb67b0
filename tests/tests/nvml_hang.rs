//! An NVML that never answers at start-up (a GPU off the bus, a driver
//! stuck in a reset: `nvmlInit` blocks in the kernel). The daemon must not
//! hang with it: past `[control] gpu_detect_timeout` it exits non-zero,
//! saying what hung and where to look, and a SIGTERM meanwhile ends it at
//! once. The NVML here is a stand-in `libnvidia-ml.so.1`, built by the test
//! with the C compiler Rust links with, found first on `LD_LIBRARY_PATH`;
//! its `nvmlInit_v2` marks a file, then blocks for ever.

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use siesta_tests::{DEADLINE, bin_path, control_exit, wait_until};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

const HUNG_NVML: &str = r#"
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>
int nvmlInit_v2(void) {
    const char *mark = getenv("HUNG_NVML_MARK");
    if (mark) close(open(mark, O_CREAT | O_WRONLY, 0644));
    for (;;) pause();
    return 0;
}
"#;

/// A folder holding the hanging `libnvidia-ml.so.1`.
fn hung_nvml(dir: &Path) -> PathBuf {
    let lib = dir.join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    let src = dir.join("hung-nvml.c");
    std::fs::write(&src, HUNG_NVML).unwrap();
    let out = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(lib.join("libnvidia-ml.so.1"))
        .arg(&src)
        .output()
        .expect("running cc (the C compiler Rust links with)");
    assert!(out.status.success(), "cc: {out:?}");
    lib
}

/// One model on one GPU (so NVML is asked), `[[gpu]]` listed as a machine
/// without NVML would have it, no P2P probe.
fn config(dir: &Path, detect: &str) -> PathBuf {
    let path = dir.join("siesta.toml");
    let text = format!(
        r#"
[control]
state_dir = "{state}"
p2p_probe = "off"
gpu_detect_timeout = "{detect}"

[[gpu]]
index = 0
name = "test-gpu"
memory = "80GiB"

[[model]]
name = "m"
model = "m"
gpus = 1
gpu_memory = 0.5
"#,
        state = dir.join("state").display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test]
async fn a_hung_nvml_at_start_up_ends_the_daemon_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let (config, lib) = (config(dir.path(), "2s"), hung_nvml(dir.path()));
    let mark = dir.path().join("nvml-called");
    let args = [
        "--config".as_ref(),
        config.as_os_str(),
        "--listen".as_ref(),
        "127.0.0.1:0".as_ref(),
    ];
    let env = [
        ("LD_LIBRARY_PATH", lib.as_os_str()),
        ("HUNG_NVML_MARK", mark.as_os_str()),
    ];
    let (code, stderr) = control_exit(&args, &env, DEADLINE.max(Duration::from_secs(60))).await;
    assert!(mark.exists(), "NVML was never called: {stderr}");
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "GPU detection (loading NVML, reading the GPUs) did not finish within 2s: \
             NVML or a GPU is hung; see nvidia-smi and the kernel log for Xid errors \
             ([control] gpu_detect_timeout is 2s)"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("serving"), "{stderr}");
    assert_eq!(
        stderr.matches("did not finish").count(),
        1,
        "said once: {stderr}"
    );
}

#[tokio::test]
async fn a_sigterm_while_nvml_hangs_at_start_up_ends_the_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let mark = dir.path().join("nvml-called");
    let child = tokio::process::Command::new(bin_path("siesta-control"))
        .arg("--config")
        .arg(config(dir.path(), "1h"))
        .arg("--listen")
        .arg("127.0.0.1:0")
        .env("LD_LIBRARY_PATH", hung_nvml(dir.path()))
        .env("HUNG_NVML_MARK", &mark)
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    wait_until("NVML called", DEADLINE, || {
        let there = mark.exists();
        async move { there }
    })
    .await;
    let pid = child.id().expect("running") as i32;
    kill(Pid::from_raw(pid), Signal::SIGTERM).unwrap();
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("siesta-control did not exit at SIGTERM")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("GPU detection abandoned"), "{stderr}");
}
