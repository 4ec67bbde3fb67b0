//! The parent side of the probe: run `siesta-p2p-probe` with a deadline,
//! keep what it finished, mark the rest `hung` (or `error` if it died).

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::time::{Instant, timeout, timeout_at};

use super::{P2pHealth, P2pResult, ProbeLine};

/// How to run the probe.
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// Path of the `siesta-p2p-probe` binary.
    pub bin: PathBuf,
    /// Arguments before the probe's own (e.g. a script when `bin` is a shell).
    pub args_prefix: Vec<String>,
    /// GPU indices to probe (all ordered pairs of them); empty: every GPU
    /// the probe finds.
    pub gpus: Vec<u32>,
    /// Buffer size per copy (hundreds of MiB: faults can depend on load).
    pub bytes: u64,
    /// The whole probe's deadline; pairs unfinished by then are `hung`.
    pub deadline: Duration,
}

impl ProbeOptions {
    pub fn new(bin: impl Into<PathBuf>, gpus: Vec<u32>) -> Self {
        Self {
            bin: bin.into(),
            args_prefix: Vec::new(),
            gpus,
            bytes: 256 << 20,
            deadline: Duration::from_secs(120),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("cannot start the P2P probe {bin}: {source}")]
    Spawn {
        bin: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The probe could not use CUDA at all (no libcuda, cuInit failed).
    #[error("P2P probe cannot run: {0}")]
    Unavailable(String),
    /// Neither the caller nor the probe said which GPUs there are.
    #[error("P2P probe gave no results: {0}")]
    NoResults(String),
}

/// Run the probe child; returns one result per ordered pair, in (src, dst)
/// order. Pairs the child did not finish before `opts.deadline` are `hung`
/// (the child's process group is killed); pairs missing because it exited
/// early are `error` with its stderr's tail.
pub async fn run_probe(opts: &ProbeOptions) -> Result<Vec<P2pResult>, ProbeError> {
    let end = Instant::now() + opts.deadline;
    let mut cmd = Command::new(&opts.bin);
    cmd.args(&opts.args_prefix)
        .arg("--bytes")
        .arg(opts.bytes.to_string());
    if !opts.gpus.is_empty() {
        let list: Vec<String> = opts.gpus.iter().map(u32::to_string).collect();
        cmd.arg("--gpus").arg(list.join(","));
    }
    // CUDA ordinals in NVML (PCI bus) order, every GPU visible.
    cmd.env("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .process_group(0);
    let mut child = cmd.spawn().map_err(|source| ProbeError::Spawn {
        bin: opts.bin.clone(),
        source,
    })?;
    let pid = child.id();
    tracing::info!(bin = %opts.bin.display(), ?pid, bytes = opts.bytes, deadline = ?opts.deadline, "P2P probe started");

    let stderr_tail = Arc::new(Mutex::new(VecDeque::<String>::new()));
    let stderr_task = child.stderr.take().map(|err| {
        let tail = stderr_tail.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(err).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let mut t = tail.lock().unwrap();
                if t.len() == 10 {
                    t.pop_front();
                }
                t.push_back(line);
            }
        })
    });

    let mut results = BTreeMap::new();
    let mut devices = None;
    let mut timed_out = false;
    if let Some(out) = child.stdout.take() {
        let mut lines = BufReader::new(out).lines();
        loop {
            match timeout_at(end, lines.next_line()).await {
                Err(_) => {
                    timed_out = true;
                    break;
                }
                Ok(Ok(Some(line))) => match serde_json::from_str::<ProbeLine>(&line) {
                    Ok(ProbeLine::Start { devices: n, .. }) => devices = Some(n),
                    Ok(ProbeLine::Pair(r)) => {
                        tracing::info!(
                            src = r.src,
                            dst = r.dst,
                            health = r.health.as_str(),
                            bandwidth_gbps = r.bandwidth_gbps,
                            "P2P pair probed"
                        );
                        results.insert((r.src, r.dst), r);
                    }
                    Ok(ProbeLine::Done) => break,
                    Ok(ProbeLine::Fatal { detail }) => {
                        let _ = child.start_kill();
                        return Err(ProbeError::Unavailable(detail));
                    }
                    Err(e) => {
                        tracing::warn!(%line, error = %e, "P2P probe printed an unreadable line")
                    }
                },
                Ok(Ok(None)) | Ok(Err(_)) => break,
            }
        }
    }

    if timed_out {
        tracing::warn!(?pid, deadline = ?opts.deadline, "P2P probe passed its deadline; killing it");
        if let Some(pid) = pid {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = child.start_kill();
    }
    // A process stuck in the driver may not die at once: never wait long.
    let status = timeout(Duration::from_secs(5), child.wait()).await;
    if let Some(task) = stderr_task {
        let _ = timeout(Duration::from_secs(1), task).await;
    }
    let tail: Vec<String> = stderr_tail.lock().unwrap().iter().cloned().collect();

    let gpus: Vec<u32> = if !opts.gpus.is_empty() {
        opts.gpus.clone()
    } else if let Some(n) = devices {
        (0..n).collect()
    } else if !results.is_empty() {
        let mut g: Vec<u32> = results.keys().flat_map(|&(s, d)| [s, d]).collect();
        g.sort_unstable();
        g.dedup();
        g
    } else {
        return Err(ProbeError::NoResults(if timed_out {
            format!("no output within {:?}", opts.deadline)
        } else {
            format!("exited ({status:?}) without output: {}", tail.join(" | "))
        }));
    };

    let mut out = Vec::new();
    for &src in &gpus {
        for &dst in &gpus {
            if src == dst {
                continue;
            }
            out.push(match results.remove(&(src, dst)) {
                Some(r) => r,
                None if timed_out => P2pResult::missing(
                    src,
                    dst,
                    P2pHealth::Hung,
                    format!("no result within {:?}; probe killed", opts.deadline),
                ),
                None => P2pResult::missing(
                    src,
                    dst,
                    P2pHealth::Error,
                    format!(
                        "probe exited ({}) before this pair: {}",
                        match &status {
                            Ok(Ok(s)) => s.to_string(),
                            _ => "status unknown".to_string(),
                        },
                        tail.join(" | ")
                    ),
                ),
            });
        }
    }
    Ok(out)
}

/// The probe binary next to the running executable (where cargo and the
/// release tarball put it), if it exists.
pub fn default_probe_bin() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir: &Path = exe.parent()?;
    let candidate = dir.join("siesta-p2p-probe");
    candidate.exists().then_some(candidate)
}

#[cfg(test)]
#[path = "run_tests.rs"]
mod tests;
