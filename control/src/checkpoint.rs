//! The CUDA-suspend tier at run time: which processes of an engine hold
//! its GPU state, whether host memory can take it, and the
//! `siesta-cuda-checkpoint` helper run as a child with a deadline (the
//! driver calls live there, in the one `unsafe` module of that binary).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Host memory kept free beyond the checkpoint itself (the OS, page cache
/// the engine needs to come back, other processes' growth).
pub const HOST_HEADROOM: u64 = 4 << 30;

/// Which helper command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Suspend,
    Resume,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Suspend => "suspend",
            Op::Resume => "resume",
        }
    }
}

/// Why the helper did not do its work.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(
        "cannot run the CUDA checkpoint helper {path}: {source} (set [control] cuda_checkpoint)"
    )]
    Spawn {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the CUDA checkpoint helper did not finish {op} within {secs} s (killed)")]
    TimedOut { op: &'static str, secs: u64 },
    #[error("{0}")]
    Failed(String),
    #[error("no process of the engine (process group {0}) to checkpoint")]
    NoProcess(u32),
}

/// One line of the helper's output.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct PidReport {
    #[serde(default)]
    pub pid: i32,
    #[serde(default)]
    pub ok: bool,
    #[serde(default)]
    pub state: Option<String>,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub lock_ms: Option<u64>,
    #[serde(default)]
    pub checkpoint_ms: Option<u64>,
    #[serde(default)]
    pub restore_ms: Option<u64>,
}

/// The helper next to the running binary (`siesta-control`'s directory).
pub fn default_tool() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_default()
        .join("siesta-cuda-checkpoint")
}

/// The processes to checkpoint and the GPU memory they hold: the CUDA
/// processes NVML lists within the engine's process group (the API
/// server, its engine core, every TP worker); without NVML (no GPU, a
/// stand-in engine), every process of the group, memory unknown.
pub fn targets(pgid: u32, nvml: Option<Vec<(u32, u64)>>) -> (Vec<u32>, Option<u64>) {
    match nvml {
        Some(list) if !list.is_empty() => {
            let bytes = list.iter().map(|(_, b)| *b).sum();
            let mut pids: Vec<u32> = list.into_iter().map(|(p, _)| p).collect();
            pids.sort_unstable();
            pids.dedup();
            (pids, Some(bytes))
        }
        _ => (group_pids(pgid), None),
    }
}

/// Every live process whose process group is `pgid`.
pub fn group_pids(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| crate::supervisor::procfs::pgid(pid) == Some(pgid))
        .collect();
    pids.sort_unstable();
    pids
}

/// `MemAvailable` of `/proc/meminfo`, bytes.
pub fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub fn mem_available() -> Option<u64> {
    parse_mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// Refuses a suspend that would not fit in host memory.
pub fn check_host_room(need: u64, available: u64) -> Result<(), String> {
    if need.saturating_add(HOST_HEADROOM) <= available {
        return Ok(());
    }
    Err(format!(
        "not suspended: its GPU state ({} MiB) would not fit in host memory \
         (MemAvailable {} MiB, {} MiB kept free)",
        need >> 20,
        available >> 20,
        HOST_HEADROOM >> 20
    ))
}

/// Runs `tool OP PID...`, killed at `deadline`; every pid's report, or
/// why it failed (the helper's own words for each pid that failed).
pub async fn run(
    tool: &Path,
    op: Op,
    pids: &[u32],
    deadline: Duration,
) -> Result<Vec<PidReport>, CheckpointError> {
    let mut cmd = tokio::process::Command::new(tool);
    cmd.arg(op.name())
        .args(pids.iter().map(u32::to_string))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(|source| CheckpointError::Spawn {
        path: tool.to_path_buf(),
        source,
    })?;
    let out = tokio::time::timeout(deadline, child.wait_with_output())
        .await
        .map_err(|_| CheckpointError::TimedOut {
            op: op.name(),
            secs: deadline.as_secs(),
        })?
        .map_err(|source| CheckpointError::Spawn {
            path: tool.to_path_buf(),
            source,
        })?;
    let reports: Vec<PidReport> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if out.status.success() && !reports.is_empty() && reports.iter().all(|r| r.ok) {
        return Ok(reports);
    }
    let mut why: Vec<String> = reports
        .iter()
        .filter_map(|r| r.error.as_ref().map(|e| (r.pid, e)))
        .map(|(pid, e)| {
            if pid > 0 {
                format!("pid {pid}: {e}")
            } else {
                e.clone()
            }
        })
        .collect();
    why.dedup();
    if why.is_empty() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        why.push(format!("{} ({})", stderr.trim(), out.status));
    }
    Err(CheckpointError::Failed(format!(
        "siesta-cuda-checkpoint {}: {}",
        op.name(),
        why.join("; ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_room_counts_headroom_and_names_sizes() {
        assert!(check_host_room(10 << 30, 20 << 30).is_ok());
        let e = check_host_room(17 << 30, 20 << 30).unwrap_err();
        assert!(
            e.contains("17408 MiB") && e.contains("MemAvailable 20480 MiB"),
            "{e}"
        );
    }

    #[test]
    fn mem_available_is_read_in_bytes() {
        let m = "MemTotal:       16318412 kB\nMemFree:  1 kB\nMemAvailable:   12000000 kB\n";
        assert_eq!(parse_mem_available(m), Some(12_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn nvml_processes_are_the_targets_else_the_whole_group() {
        let (pids, bytes) = targets(1, Some(vec![(30, 5), (20, 7)]));
        assert_eq!((pids, bytes), (vec![20, 30], Some(12)));
        let me = std::process::id();
        let group = crate::supervisor::procfs::pgid(me).unwrap();
        let (pids, bytes) = targets(group, None);
        assert!(pids.contains(&me) && bytes.is_none());
    }

    #[tokio::test]
    async fn a_missing_helper_says_which_path_and_key() {
        let e = run(
            Path::new("/nonexistent/tool"),
            Op::Suspend,
            &[1],
            Duration::from_secs(5),
        )
        .await
        .unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("/nonexistent/tool") && s.contains("cuda_checkpoint"),
            "{s}"
        );
    }
}
