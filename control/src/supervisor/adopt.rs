//! Taking over an engine a previous siesta-control spawned: it is not our
//! child, so its end is noticed by polling `/proc` (pid and start time),
//! and its output files are tailed from where they are.

use super::{
    ENGINE_LOG_MAX, Exit, LogRing, ProcHandle, appends, log_paths, procfs, sweep_group, tail,
};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How often an adopted engine's liveness is checked.
const POLL: Duration = Duration::from_millis(200);
/// How much of an adopted engine's earlier output goes into the log ring.
const BACKLOG: u64 = 16 * 1024;

/// A running engine found by recovery: the leader of its own process
/// group, and the `SIESTA_ENGINE_TAG` its processes carry.
#[derive(Debug, Clone, Copy)]
pub struct Leader<'a> {
    pub pid: u32,
    /// `/proc/PID/stat` start time: tells a reused pid apart.
    pub start_time: u64,
    pub tag: &'a str,
}

/// Supervises the running engine `leader` as [`spawn`](super::spawn) does
/// its children: `on_exit` runs once it is gone and the rest of its
/// processes (its group, and those carrying its tag) were killed and are
/// gone too.
pub fn adopt(
    name: &str,
    leader: Leader<'_>,
    log_dir: &Path,
    proc_gen: u64,
    logs: Arc<LogRing>,
    on_exit: impl FnOnce(Exit) + Send + 'static,
) -> ProcHandle {
    let (exited_tx, exited) = watch::channel(false);
    let model = name.to_string();
    let dir = log_dir.to_path_buf();
    let Leader {
        pid,
        start_time,
        tag,
    } = leader;
    let tag = tag.to_string();
    tokio::spawn(async move {
        while procfs::alive(pid, Some(start_time)) {
            tokio::time::sleep(POLL).await;
        }
        // The leader is gone; nothing of its group may stay behind.
        sweep_group(&model, pid, Some(start_time), &tag).await;
        let status = "exited (adopted engine: exit status unknown)".to_string();
        on_exit(Exit::read(status, model, dir).await);
        let _ = exited_tx.send(true);
    });
    for ((path, stream), fd) in log_paths(name, log_dir).into_iter().zip([1, 2]) {
        let len = std::fs::metadata(&path).map_or(0, |m| m.len());
        // Rotated only when the engine appends (spawned by this version).
        let max = appends(pid, fd).then_some(ENGINE_LOG_MAX);
        tokio::spawn(tail(
            path,
            len.saturating_sub(BACKLOG),
            stream,
            name.to_string(),
            logs.clone(),
            exited.clone(),
            max,
        ));
    }
    ProcHandle {
        pid,
        proc_gen,
        exited,
    }
}
