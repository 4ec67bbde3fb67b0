//! An engine's process group: signals to it, and its sweep once the leader
//! is gone. vLLM's engine core and `VLLM::Worker_TPn` processes do not watch
//! their parent, and a killed process keeps its memory, GPU memory
//! included, until it has exited. So an engine has ended only when no
//! member of its group is left: until then a new engine placed on its GPUs
//! would find their memory still taken.

use super::procfs;
use nix::sys::signal::{Signal as NixSignal, killpg};
use nix::unistd::Pid;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// How long a sweep waits for the killed members to be gone. Past it the
/// engine counts as ended anyway (a process stuck in the kernel, such as in
/// a hung GPU driver, may never go), with a warning naming what is left.
pub const SWEEP_DEADLINE: Duration = Duration::from_secs(10);

/// Sends `sig` to the process group led by `pid` (errors such as "no such
/// process" are ignored: the group is gone).
pub fn signal_group(pid: u32, sig: NixSignal) {
    if pid > 1 {
        let _ = killpg(Pid::from_raw(pid as i32), sig);
    }
}

/// SIGKILL to what is left of the process group `pgid` once its leader
/// (started at `leader_start`, when known) is gone. While any member lives
/// the group id cannot be reused; a group id now led by another process
/// (the pid was reused after the group emptied) is left alone. Returns
/// whether the group was signalled.
pub fn kill_group_leftovers(pgid: u32, leader_start: Option<u64>) -> bool {
    if pgid <= 1 {
        return false;
    }
    let reused = match (procfs::start_time(pgid), leader_start) {
        (None, _) => false,
        (Some(now), Some(t)) => now != t,
        (Some(_), None) => procfs::alive(pgid, None),
    };
    if reused {
        tracing::debug!(
            pgid,
            "process group id reused by another process; not signalled"
        );
        return false;
    }
    signal_group(pgid, NixSignal::SIGKILL);
    true
}

/// The leader of `pgid` is gone: SIGKILL to the rest of its group, and to
/// the group of every process that left it but still carries the engine's
/// `tag` in its environment (a worker started with `setsid`); then waits
/// (up to [`SWEEP_DEADLINE`]) until none of them lives. Zombies count as
/// gone: they hold no memory. Returns the processes still there at the
/// deadline.
pub async fn sweep_group(model: &str, pgid: u32, leader_start: Option<u64>, tag: &str) -> Vec<u32> {
    let signalled = kill_group_leftovers(pgid, leader_start);
    let escaped = kill_escaped(model, tag, pgid);
    let members = || {
        let mut left = if signalled {
            procfs::group_members(pgid)
        } else {
            Vec::new()
        };
        left.extend(escaped.iter().flat_map(|g| procfs::group_members(*g)));
        left
    };
    let killed = members();
    if killed.is_empty() {
        return killed;
    }
    let began = tokio::time::Instant::now();
    let left = wait_gone(members, SWEEP_DEADLINE).await;
    let waited_ms = began.elapsed().as_millis() as u64;
    if left.is_empty() {
        tracing::info!(model, pgid, pids = ?killed, waited_ms, "killed what was left of the engine's processes: gone");
    } else {
        tracing::warn!(model, pgid, pids = ?left, waited_ms,
            "engine processes still there after SIGKILL: taken as ended, but they may hold GPU memory");
    }
    left
}

/// SIGKILL to the process groups, other than `pgid` and this process's
/// own, of live processes whose environment carries the engine tag `tag`
/// (workers that left the engine's group, e.g. with `setsid`); returns
/// those groups.
pub fn kill_escaped(model: &str, tag: &str, pgid: u32) -> BTreeSet<u32> {
    if tag.is_empty() {
        return BTreeSet::new();
    }
    let own = procfs::pgid(std::process::id());
    let groups: BTreeSet<u32> = procfs::pids_with_env(super::TAG_ENV, tag)
        .into_iter()
        .filter_map(procfs::pgid)
        .filter(|g| *g > 1 && *g != pgid && Some(*g) != own)
        .collect();
    for g in &groups {
        tracing::warn!(model, pgid = g, tag, pids = ?procfs::group_members(*g),
            "killing engine processes that left its process group (found by its tag)");
        signal_group(*g, NixSignal::SIGKILL);
    }
    groups
}

/// The process groups of the live engine processes spawned for the state
/// directory whose [`state_marker`](super::state_marker) is `marker`, each
/// with the engine tags seen in it.
pub fn state_dir_groups(marker: &str) -> BTreeMap<u32, BTreeSet<String>> {
    let mut groups: BTreeMap<u32, BTreeSet<String>> = BTreeMap::new();
    for pid in procfs::pids_with_env(super::STATE_ENV, marker) {
        let tag = procfs::env_value(pid, super::TAG_ENV).unwrap_or_default();
        if let Some(pgid) = procfs::pgid(pid) {
            groups.entry(pgid).or_default().insert(tag);
        }
    }
    groups
}

/// SIGKILL, now, to the process group of every engine process spawned for
/// `state_dir` ([`state_dir_groups`]), then waits up to [`SWEEP_DEADLINE`]
/// for their members to be gone; returns how many groups were killed and
/// the pids still there. For an operator who will not wait for the stop
/// grace (`siesta up`'s second Ctrl-C): the next start's recovery finds
/// them gone and drops their records.
pub async fn kill_engines_now(state_dir: &std::path::Path) -> (usize, Vec<u32>) {
    let own = procfs::pgid(std::process::id());
    let groups: Vec<u32> = state_dir_groups(&super::state_marker(state_dir))
        .into_keys()
        .filter(|g| Some(*g) != own)
        .collect();
    for g in &groups {
        signal_group(*g, NixSignal::SIGKILL);
    }
    let members = || {
        groups
            .iter()
            .flat_map(|g| procfs::group_members(*g))
            .collect()
    };
    (groups.len(), wait_gone(members, SWEEP_DEADLINE).await)
}

/// Polls `members` (5 ms, doubling up to 100 ms) until it is empty or
/// `deadline` has passed; returns its last answer.
pub(crate) async fn wait_gone(members: impl Fn() -> Vec<u32>, deadline: Duration) -> Vec<u32> {
    let end = tokio::time::Instant::now() + deadline;
    let mut every = Duration::from_millis(5);
    loop {
        let left = members();
        if left.is_empty() || tokio::time::Instant::now() >= end {
            return left;
        }
        tokio::time::sleep(every).await;
        every = (every * 2).min(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test(start_paused = true)]
    async fn waits_until_the_last_member_is_gone() {
        // Members that take 1.5 s to go (a process slow to give back its
        // GPU memory).
        let t0 = tokio::time::Instant::now();
        let calls = AtomicU32::new(0);
        let members = || {
            calls.fetch_add(1, Ordering::Relaxed);
            if t0.elapsed() < Duration::from_millis(1500) {
                vec![41, 42]
            } else {
                Vec::new()
            }
        };
        assert!(wait_gone(members, SWEEP_DEADLINE).await.is_empty());
        assert!(t0.elapsed() >= Duration::from_millis(1500));
        assert!(
            t0.elapsed() < Duration::from_millis(1600),
            "{:?}",
            t0.elapsed()
        );
        assert!(calls.load(Ordering::Relaxed) > 2);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_at_the_deadline_and_names_what_is_left() {
        let t0 = tokio::time::Instant::now();
        let left = wait_gone(|| vec![7], Duration::from_secs(3)).await;
        assert_eq!(left, vec![7]);
        assert!(t0.elapsed() >= Duration::from_secs(3));
        assert!(t0.elapsed() < Duration::from_millis(3200));
    }

    #[tokio::test(start_paused = true)]
    async fn an_empty_group_is_not_waited_for() {
        let t0 = tokio::time::Instant::now();
        assert!(wait_gone(Vec::new, SWEEP_DEADLINE).await.is_empty());
        assert_eq!(t0.elapsed(), Duration::ZERO);
    }
}
