//! Start-up recovery: engines a previous siesta-control left running are
//! adopted, not killed or duplicated.
//!
//! For each engine record in the store:
//! 1. find the process: the recorded pid if alive with the recorded start
//!    time, else the group leader carrying the record's `SIESTA_ENGINE_TAG`
//!    (siesta died between spawn and recording the pid); none: the record
//!    is dropped (and tagged leftovers killed);
//! 2. an engine no longer wanted (model removed, now attach, or its command
//!    changed) is stopped: SIGTERM to its group, SIGKILL after the grace;
//! 3. otherwise probe it: `/health`, then `/is_sleeping` (level from
//!    `/metrics`, else the recorded one); no answer: still starting;
//! 4. the model's task starts from that state ([`crate::reconciler::adopt`])
//!    with its restored intent and drives on from there.
//!
//! Intents of models no longer configured are forgotten.

use crate::config::{Config, Launch, ModelConfig};
use crate::engine::EngineClient;
use crate::models::default_placement;
use crate::reconciler::Observed;
use crate::runner::Placed;
use crate::store::{EngineRecord, Store};
use crate::supervisor::{TAG_ENV, command_hash, procfs, signal_group, spawn_spec};
use nix::sys::signal::Signal;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// A model whose engine was stopped here waits for it up to this long.
const STOP_WAIT_MAX: Duration = Duration::from_secs(60);

/// An engine found running and still wanted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adopted {
    pub pid: u32,
    pub start_time: u64,
    pub port: u16,
    pub proc_gen: u64,
    pub observed: Observed,
}

/// The leader of the recorded engine's process group, and its start time.
fn locate(rec: &EngineRecord) -> Option<(u32, u64)> {
    if rec.pid > 1 && procfs::alive(rec.pid, Some(rec.start_time)) {
        return Some((rec.pid, rec.start_time));
    }
    let tagged = procfs::pids_with_env(TAG_ENV, &rec.tag);
    let leader = tagged
        .iter()
        .copied()
        .find(|p| procfs::pgid(*p) == Some(*p));
    match leader {
        Some(p) => procfs::start_time(p).map(|t| (p, t)),
        None => {
            // The leader is gone: no member of its group may stay behind.
            for p in tagged {
                if let Some(g) = procfs::pgid(p) {
                    signal_group(g, Signal::SIGKILL);
                }
            }
            None
        }
    }
}

/// Why a running engine is not adopted (None: it is).
fn unwanted(
    rec: &EngineRecord,
    cfg: Option<&ModelConfig>,
    placed: &BTreeMap<String, Placed>,
) -> Option<&'static str> {
    let Some(cfg) = cfg else {
        return Some("model no longer configured");
    };
    if !matches!(cfg.launch, Launch::Process { .. }) {
        return Some("model is now an attach engine");
    }
    let placed = placed
        .get(&cfg.name)
        .cloned()
        .unwrap_or_else(|| default_placement(cfg));
    (command_hash(&spawn_spec(cfg, rec.port, &placed)) != rec.command_hash)
        .then_some("its command line changed in the configuration")
}

async fn observe(host: &str, rec: &EngineRecord) -> Observed {
    let client = EngineClient::new(&format!("http://{host}:{}", rec.port));
    if client.health(PROBE_TIMEOUT).await.is_err() {
        return Observed::NotServing;
    }
    match client.is_sleeping(PROBE_TIMEOUT).await {
        Ok(false) => Observed::Awake,
        Ok(true) => {
            let level = client
                .metrics(PROBE_TIMEOUT)
                .await
                .ok()
                .and_then(|m| m.sleep_level)
                .filter(|l| *l > 0)
                .unwrap_or(rec.sleep_level.max(1));
            Observed::Asleep(level.min(2))
        }
        Err(_) => Observed::NotServing,
    }
}

/// SIGTERM to the group, SIGKILL after `grace`; the record goes once it is gone.
async fn stop(
    store: Arc<Store>,
    name: String,
    rec: EngineRecord,
    pid: u32,
    start: u64,
    grace: Duration,
) {
    signal_group(pid, Signal::SIGTERM);
    let gone = |d: Duration| async move {
        let end = tokio::time::Instant::now() + d;
        while procfs::alive(pid, Some(start)) {
            if tokio::time::Instant::now() >= end {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        true
    };
    if !gone(grace).await {
        tracing::warn!(model = %name, pid, "stop grace over: SIGKILL to the process group");
        signal_group(pid, Signal::SIGKILL);
        gone(Duration::from_secs(10)).await;
    }
    signal_group(pid, Signal::SIGKILL);
    store.remove_engine(&name, Some(rec.proc_gen));
    tracing::info!(model = %name, pid, "stopped an engine no longer wanted");
}

/// Runs the recovery over every engine record; returns the adopted engines
/// by model name. Unwanted engines are stopped before this returns when
/// their model is configured again (so no two engines of a model run),
/// in the background otherwise.
pub async fn recover(
    config: &Config,
    placed: &BTreeMap<String, Placed>,
    store: &Arc<Store>,
) -> BTreeMap<String, Adopted> {
    let mut adopted = BTreeMap::new();
    let mut waits = Vec::new();
    let mut probes = Vec::new();
    for (name, rec) in store.engines() {
        let Some((pid, start_time)) = locate(&rec) else {
            tracing::info!(model = %name, pid = rec.pid, "recorded engine is gone");
            store.remove_engine(&name, Some(rec.proc_gen));
            continue;
        };
        let cfg = config.models.iter().find(|m| m.name == name);
        if let Some(why) = unwanted(&rec, cfg, placed) {
            tracing::info!(model = %name, pid, reason = why, "stopping a recorded engine");
            let grace = cfg.map_or(config.defaults.timeouts.stop_grace, |c| {
                c.timeouts.stop_grace
            });
            let task = tokio::spawn(stop(
                store.clone(),
                name.clone(),
                rec,
                pid,
                start_time,
                grace,
            ));
            if cfg.is_some() {
                waits.push(task);
            }
            continue;
        }
        let host = match cfg.map(|c| &c.launch) {
            Some(Launch::Process { host, .. }) => host.clone(),
            _ => continue,
        };
        probes.push(async move {
            let observed = observe(&host, &rec).await;
            let a = Adopted {
                pid,
                start_time,
                port: rec.port,
                proc_gen: rec.proc_gen,
                observed,
            };
            (name, a)
        });
    }
    for (name, a) in futures::future::join_all(probes).await {
        tracing::info!(model = %name, pid = a.pid, port = a.port, observed = ?a.observed, "adopting a running engine");
        adopted.insert(name, a);
    }
    for w in waits {
        let _ = tokio::time::timeout(STOP_WAIT_MAX, w).await;
    }
    // Intents of models no longer configured must not come back with them.
    for name in store.intent_names() {
        if !config.models.iter().any(|m| m.name == name) {
            tracing::info!(model = %name, "forgetting the intent of a model no longer configured");
            store.forget(&name);
        }
    }
    adopted
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    fn sleeper(tag: &str) -> std::process::Child {
        std::process::Command::new("sleep")
            .arg("60")
            .env(TAG_ENV, tag)
            .process_group(0)
            .spawn()
            .unwrap()
    }

    fn record(pid: u32, start_time: u64, tag: &str) -> EngineRecord {
        EngineRecord {
            pid,
            pgid: pid,
            port: 9,
            start_time,
            command_hash: String::new(),
            tag: tag.into(),
            proc_gen: 1,
            sleep_level: 0,
            spawned_unix_ms: 0,
        }
    }

    #[test]
    fn an_engine_whose_pid_was_never_recorded_is_found_by_its_tag() {
        let tag = format!("recovery-test-{}", std::process::id());
        let mut child = sleeper(&tag);
        let pid = child.id();
        let start = procfs::start_time(pid).unwrap();
        // The new environment shows in /proc a moment after the spawn returns.
        for _ in 0..250 {
            if !procfs::pids_with_env(TAG_ENV, &tag).is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(locate(&record(0, 0, &tag)), Some((pid, start)));
        // A recorded pid with another start time is a reused pid: the tag decides.
        assert_eq!(locate(&record(pid, start + 1, &tag)), Some((pid, start)));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(locate(&record(pid, start, &tag)), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_engine_of_a_removed_model_is_stopped_and_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let tag = format!("recovery-removed-{}", std::process::id());
        let mut child = sleeper(&tag);
        let pid = child.id();
        let start = procfs::start_time(pid).unwrap();
        assert!(store.set_engine("gone", &record(pid, start, &tag)));
        let config = Config::demo(vec!["x".into()]);
        let adopted = recover(&config, &BTreeMap::new(), &store).await;
        assert!(adopted.is_empty());
        // `sleep` dies of the SIGTERM.
        let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
            .await
            .unwrap();
        assert!(!status.success());
        for _ in 0..100 {
            if store.engine("gone").is_none() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("record of the stopped engine kept");
    }
}
