//! Engines this state directory's control plane started but has no record
//! of: the store they were recorded in was lost while they ran (moved aside
//! as corrupt or incompatible, or deleted). They cannot be adopted (their
//! placement and generation went with the record), and a new engine of the
//! model would find its port and its GPU memory taken: they are stopped,
//! SIGTERM to their process group and SIGKILL after the grace, before any
//! model starts. Engines are told apart from another control plane's on the
//! same host by the state directory in their environment
//! ([`STATE_ENV`](crate::supervisor::STATE_ENV)).

use crate::supervisor::{SWEEP_DEADLINE, procfs, signal_group, state_dir_groups, wait_gone};
use nix::sys::signal::Signal;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// The process groups of unrecorded engines of the state directory whose
/// marker is `marker`, each with the engine tags seen in it. A group
/// holding a recorded tag is the records' business.
pub(super) fn find(marker: &str, recorded: &BTreeSet<String>) -> BTreeMap<u32, BTreeSet<String>> {
    let mut groups = state_dir_groups(marker);
    groups.retain(|_, tags| tags.is_disjoint(recorded));
    groups
}

/// Stops every group [`find`] returns: SIGTERM where its leader still runs
/// (an engine whose server died is only its leftovers, killed at once),
/// SIGKILL once `grace` is over; returns when all are gone, or
/// [`SWEEP_DEADLINE`] after the SIGKILL.
pub(super) async fn stop(marker: &str, recorded: &BTreeSet<String>, grace: Duration) {
    let groups = find(marker, recorded);
    let stops = groups.into_iter().map(|(pgid, tags)| async move {
        let leader = procfs::alive(pgid, None);
        tracing::warn!(pgid, ?tags, leader,
            "an engine this state directory's control plane started has no record (its store was lost): stopping it so a new one can take its port and GPU memory");
        let members = || procfs::group_members(pgid);
        if leader {
            signal_group(pgid, Signal::SIGTERM);
            if wait_gone(members, grace).await.is_empty() {
                tracing::info!(pgid, "unrecorded engine stopped");
                return;
            }
            tracing::warn!(pgid, "stop grace over: SIGKILL to the unrecorded engine's group");
        }
        signal_group(pgid, Signal::SIGKILL);
        let left = wait_gone(members, SWEEP_DEADLINE).await;
        if left.is_empty() {
            tracing::info!(pgid, "unrecorded engine killed");
        } else {
            tracing::warn!(pgid, pids = ?left, "an unrecorded engine's processes still there after SIGKILL: they may hold GPU memory");
        }
    });
    futures::future::join_all(stops).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::{STATE_ENV, TAG_ENV};
    use std::os::unix::process::CommandExt;

    fn engine(marker: &str, tag: &str, script: &str) -> std::process::Child {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(script)
            .env(STATE_ENV, marker)
            .env(TAG_ENV, tag)
            .process_group(0)
            .spawn()
            .unwrap()
    }

    async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
        for _ in 0..500 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("timed out waiting for {what}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unrecorded_engines_of_this_state_dir_are_stopped_and_no_others() {
        let me = std::process::id();
        let ours = format!("/state/orphans-{me}");
        let theirs = format!("/state/other-{me}");
        // An engine that ignores SIGTERM, with a child, and one recorded.
        let mut stubborn = engine(&ours, "c/a/1/x", "trap '' TERM; sleep 600 & wait");
        let mut recorded = engine(&ours, "c/b/1/y", "sleep 600");
        let mut other = engine(&theirs, "c/a/1/z", "sleep 600");
        let pgid = stubborn.id();
        eventually("the engines' environments", || {
            procfs::group_members(pgid).len() == 2
                && procfs::pids_with_env(STATE_ENV, &ours).len() >= 3
                && !procfs::pids_with_env(STATE_ENV, &theirs).is_empty()
        })
        .await;
        let known = BTreeSet::from(["c/b/1/y".to_string()]);
        let found = find(&ours, &known);
        assert_eq!(found.keys().copied().collect::<Vec<_>>(), vec![pgid]);
        assert_eq!(found[&pgid], BTreeSet::from(["c/a/1/x".to_string()]));
        stop(&ours, &known, Duration::from_millis(300)).await;
        // Gone when stop returns (SIGKILL after the grace), not later.
        assert_eq!(procfs::group_members(pgid), Vec::<u32>::new());
        stubborn.wait().unwrap();
        assert!(
            recorded.try_wait().unwrap().is_none(),
            "recorded engine stopped"
        );
        assert!(
            other.try_wait().unwrap().is_none(),
            "another state dir's engine stopped"
        );
        for c in [&mut recorded, &mut other] {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }
}
