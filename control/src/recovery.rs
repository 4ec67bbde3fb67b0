//! Start-up recovery: engines a previous siesta-control left running are
//! adopted, not killed or duplicated.
//!
//! For each engine record in the store:
//! 1. find the process: the recorded pid if alive with the recorded start
//!    time; if no pid was recorded (siesta died between spawn and recording
//!    it), the first group leader carrying the record's `SIESTA_ENGINE_TAG`;
//!    none: the record is dropped, and what is left of the engine (its
//!    process group, and anything carrying its tag) is killed;
//! 2. an engine no longer wanted (model removed, now attach, or its command
//!    changed) is stopped: SIGTERM to its group, SIGKILL after the grace;
//! 3. otherwise probe it (an engine that cannot say whether it sleeps,
//!    SGLang's or an `openai` one, is taken at the state siesta recorded:
//!    see `observe_recorded`): `/health` (no answer: still starting), then
//!    `/is_sleeping`, waited on up to the model's wake timeout (it queues
//!    behind a running wake). Asleep: at the level from `/metrics`, else
//!    the recorded one, else 2. No answer or an error: asleep at the
//!    recorded level (else 2), never awake, so a wake cut short by the
//!    restart runs again;
//! 4. the model's task starts from that state ([`crate::reconciler::adopt`])
//!    with its restored intent and drives on from there.
//!
//! Intents of models no longer configured are forgotten, and engines this
//! state directory's control plane started but has no record of (its store
//! was lost) are stopped ([`orphans`]).

mod orphans;

use crate::config::{Config, Launch, ModelConfig};
use crate::engine::EngineClient;
use crate::placement::Placed;
use crate::placement::default_placement;
use crate::reconciler::Observed;
use crate::store::{EngineRecord, IntentRecord, Store};
use crate::supervisor::{
    SWEEP_DEADLINE, TAG_ENV, command_hash, kill_escaped, kill_group_leftovers, procfs,
    signal_group, spawn_spec, state_marker, sweep_group, wait_gone,
};
use nix::sys::signal::Signal;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// A model whose engine was stopped here waits for it up to this long.
const STOP_WAIT_MAX: Duration = Duration::from_secs(60);

/// An engine found running and still wanted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adopted {
    /// Runs without P2P between its GPUs (as spawned; see [`adoption`]).
    pub p2p_disabled: bool,
    pub pid: u32,
    pub start_time: u64,
    /// Its `SIESTA_ENGINE_TAG`: finds its processes that left its group.
    pub tag: String,
    pub port: u16,
    pub proc_gen: u64,
    pub observed: Observed,
}

/// The leader of the recorded engine's process group, and its start time.
/// None: the engine is gone, and whatever its group left behind was killed.
fn locate(name: &str, rec: &EngineRecord) -> Option<(u32, u64)> {
    if rec.pid > 1 && procfs::alive(rec.pid, Some(rec.start_time)) && !foreign(rec.pid, rec) {
        return Some((rec.pid, rec.start_time));
    }
    let tagged = procfs::pids_with_env(TAG_ENV, &rec.tag);
    if rec.pid > 1 && rec.start_time != 0 {
        // The recorded leader is gone: whatever still carries the tag is
        // a leftover, even one that leads a group of its own.
        sweep(name, rec);
        return None;
    }
    // The first process started with the tag (a child that made a group
    // of its own started later).
    let leader = tagged
        .iter()
        .filter(|p| procfs::pgid(**p) == Some(**p))
        .filter_map(|p| Some((*p, procfs::start_time(*p)?)))
        .min_by_key(|(_, t)| *t);
    match leader {
        Some(found) => Some(found),
        None => {
            sweep(name, rec);
            None
        }
    }
}

/// `pid` is a live process that does not carry the engine's tag: the
/// recorded pid and start time were matched by another process (after a
/// reboot, a daemon started as early as the engine was), which is neither
/// adopted nor signalled.
fn foreign(pid: u32, rec: &EngineRecord) -> bool {
    let foreign = !rec.tag.is_empty() && procfs::carries_env(pid, TAG_ENV, &rec.tag) == Some(false);
    if foreign {
        tracing::warn!(pid, tag = %rec.tag, "the recorded engine's pid is now another process (no engine tag): left alone");
    }
    foreign
}

/// The leader is gone; no member of its group may stay behind (vLLM's
/// engine core and TP workers do not watch their parent and keep their GPU
/// memory): SIGKILL to the recorded group, found by its id, and to the
/// group of every process still carrying the engine's tag (one that left
/// the group keeps the tag in its environment).
fn sweep(name: &str, rec: &EngineRecord) {
    if rec.pgid > 1 && !foreign(rec.pgid, rec) {
        let left = procfs::group_members(rec.pgid);
        if !left.is_empty() {
            tracing::warn!(pgid = rec.pgid, pids = ?left, tag = %rec.tag, "killing what is left of a dead engine's process group");
        }
        kill_group_leftovers(rec.pgid, (rec.pid == rec.pgid).then_some(rec.start_time));
    }
    kill_escaped(name, &rec.tag, rec.pgid);
}

/// Live processes of a dead engine: those with its tag, and the members of
/// its recorded group unless that id now leads another process's group.
fn leftovers(rec: &EngineRecord) -> Vec<u32> {
    let mut left = procfs::pids_with_env(TAG_ENV, &rec.tag);
    if rec.pgid > 1 && !procfs::alive(rec.pgid, None) {
        left.extend(procfs::group_members(rec.pgid));
    }
    left.sort_unstable();
    left.dedup();
    left
}

/// Whether a running engine is adopted: `Ok(p2p_disabled)`, the P2P
/// switches it runs with, or why not.
///
/// The P2P verdict between its GPUs may have changed since its spawn (a
/// probe at this start, saved results of a later one): the command siesta
/// would spawn now then differs in those switches alone. One started
/// without P2P, now trusted, is adopted as it runs (slower, not wrong; its
/// next start uses P2P); before, it was stopped as if its configuration had
/// changed, a cold start of a multi-GPU model for nothing. One started
/// with P2P that is no longer trusted is stopped, saying why: data between
/// its GPUs may be corrupted silently.
fn adoption(
    rec: &EngineRecord,
    cfg: Option<&ModelConfig>,
    placed: &BTreeMap<String, Placed>,
    intent: Option<&IntentRecord>,
) -> Result<bool, &'static str> {
    let Some(cfg) = cfg else {
        return Err("model no longer configured");
    };
    if intent.is_some_and(|i| i.restart_pending(rec)) {
        return Err("an operator's restart was under way when the control plane stopped");
    }
    if !matches!(cfg.launch, Launch::Process { .. }) {
        return Err("model is now an attach engine");
    }
    let placed = placed
        .get(&cfg.name)
        .cloned()
        .unwrap_or_else(|| default_placement(cfg));
    // A port the configuration fixes is the one it must run on (a changed
    // one is a changed command line); one siesta picked is the engine's.
    let port = match &cfg.launch {
        Launch::Process { port: Some(p), .. } => *p,
        _ => rec.port,
    };
    let runs_with = |p2p_disabled: bool| {
        let p = Placed {
            p2p_disabled,
            ..placed.clone()
        };
        command_hash(&spawn_spec(cfg, port, &p)) == rec.command_hash
    };
    let now = placed.p2p_disabled;
    if runs_with(now) {
        Ok(now)
    } else if !now && runs_with(true) {
        Ok(true)
    } else if now && runs_with(false) {
        Err(
            "P2P between its GPUs is no longer trusted and it runs with P2P on (data between them could be corrupted silently)",
        )
    } else {
        Err("its command line changed in the configuration")
    }
}

/// The level to wake an engine from when it does not say: the one recorded
/// in the store, else 2 (a level-2 wake reloads the weights and is right
/// for any state; a level-1 wake on a level-2 engine serves garbage).
fn recorded_level(rec: &EngineRecord) -> u8 {
    match rec.sleep_level {
        0 => 2,
        l => l.min(2),
    }
}

/// What the adopted engine is doing. `/is_sleeping` waits behind a running
/// wake or `reload_weights` (a control plane restarted mid-wake): "no
/// answer yet" is waited on up to `wake_timeout`, and is never taken for
/// awake; still nothing (or an error), the engine is taken as asleep at
/// the recorded level and the reconciler runs the wake sequence again.
async fn observe(client: &EngineClient, rec: &EngineRecord, wake_timeout: Duration) -> Observed {
    let url = client.base();
    let kind = client.kind();
    if rec.suspended {
        // Nothing may reach a checkpointed engine: adopted as recorded, and
        // a demand resumes it (a resume of a process the helper never got
        // to checkpoint finds it running and leaves it so).
        return Observed::Suspended(rec.sleep_level);
    }
    if !kind.capabilities().sleep_query {
        return observe_recorded(client, rec).await;
    }
    if client.health(PROBE_TIMEOUT).await.is_err() {
        return Observed::NotServing;
    }
    let mut answer = client.is_sleeping_within(PROBE_TIMEOUT).await;
    if let Ok(None) = answer {
        let wait = wake_timeout
            .saturating_sub(PROBE_TIMEOUT)
            .max(PROBE_TIMEOUT);
        tracing::info!(engine = %url, ?wait, "/is_sleeping not answered yet (a wake or reload_weights may be running); waiting");
        answer = client.is_sleeping_within(wait).await;
    }
    let level = recorded_level(rec);
    match answer {
        Ok(Some(false)) => Observed::Awake,
        Ok(Some(true)) => {
            // The metric alone never says awake (vLLM 0.24 records awake
            // after `wake_up?tags=weights`, and a draining sleep records its
            // level only at its end); it only refines a deeper level.
            let metric = client
                .metrics(PROBE_TIMEOUT)
                .await
                .ok()
                .and_then(|m| m.sleep_level)
                .filter(|l| *l > 0);
            Observed::Asleep(metric.unwrap_or(level).min(2))
        }
        Ok(None) => {
            tracing::warn!(engine = %url, level, "/is_sleeping never answered; taking the engine as asleep so it is woken again");
            Observed::Asleep(level)
        }
        Err(error) => {
            tracing::warn!(engine = %url, level, %error, "/is_sleeping failed; taking the engine as asleep so it is woken again");
            Observed::Asleep(level)
        }
    }
}

/// An engine that cannot say whether it sleeps (SGLang, an `openai`
/// server): asleep at the level siesta recorded before its last release
/// (probed where nothing reaches the GPU), else awake if its health answers.
/// A control killed between recording a release and the engine doing it
/// resumes an engine that never released: SGLang then exits (its scheduler
/// has no such tag) and siesta restarts it, which costs a start but never
/// sends a request to released memory.
async fn observe_recorded(client: &EngineClient, rec: &EngineRecord) -> Observed {
    let kind = client.kind();
    match kind.deepest_sleep().filter(|_| rec.sleep_level > 0) {
        Some(deepest) => match client.alive(PROBE_TIMEOUT).await {
            Ok(()) => Observed::Asleep(rec.sleep_level.min(deepest)),
            Err(_) => Observed::NotServing,
        },
        None => match client.health(PROBE_TIMEOUT).await {
            Ok(()) => Observed::Awake,
            Err(_) => Observed::NotServing,
        },
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
    let leader = || {
        if procfs::alive(pid, Some(start)) {
            vec![pid]
        } else {
            Vec::new()
        }
    };
    if !wait_gone(leader, grace).await.is_empty() {
        tracing::warn!(model = %name, pid, "stop grace over: SIGKILL to the process group");
        signal_group(pid, Signal::SIGKILL);
        wait_gone(leader, SWEEP_DEADLINE).await;
    }
    sweep_group(&name, pid, Some(start), &rec.tag).await;
    store.remove_engine(&name, &rec.tag);
    tracing::info!(model = %name, pid, "stopped an engine no longer wanted");
}

/// Runs the recovery over every engine record; returns the adopted engines
/// by model name. Unwanted engines are stopped before this returns (up to
/// [`STOP_WAIT_MAX`]): no two engines of a model run, and a removed model's
/// engine has freed its GPU memory before a model placed there starts.
pub async fn recover(
    config: &Config,
    placed: &BTreeMap<String, Placed>,
    store: &Arc<Store>,
) -> BTreeMap<String, Adopted> {
    let mut adopted = BTreeMap::new();
    let mut waits = Vec::new();
    let mut probes = Vec::new();
    let records = store.engines();
    let recorded: BTreeSet<String> = records.iter().map(|(_, r)| r.tag.clone()).collect();
    for (name, rec) in records {
        let Some((pid, start_time)) = locate(&name, &rec) else {
            // Its killed leftovers may still hold GPU memory a new engine
            // of the model is about to ask for.
            let left = wait_gone(|| leftovers(&rec), SWEEP_DEADLINE).await;
            if !left.is_empty() {
                tracing::warn!(model = %name, pids = ?left, "a dead engine's processes still there after SIGKILL: they may hold GPU memory");
            }
            tracing::info!(model = %name, pid = rec.pid, "recorded engine is gone");
            store.remove_engine(&name, &rec.tag);
            continue;
        };
        let cfg = config.models.iter().find(|m| m.name == name);
        let p2p_disabled = match adoption(&rec, cfg, placed, store.get(&name).as_ref()) {
            Ok(off) => off,
            Err(why) => {
                tracing::info!(model = %name, pid, reason = why, "stopping a recorded engine");
                let grace = cfg
                    .map_or(config.defaults.timeouts.stop_grace, |c| {
                        c.timeouts.stop_grace
                    })
                    // The SIGKILL and its sweep must come within the wait below.
                    .min(STOP_WAIT_MAX - SWEEP_DEADLINE);
                waits.push(tokio::spawn(stop(
                    store.clone(),
                    name.clone(),
                    rec,
                    pid,
                    start_time,
                    grace,
                )));
                continue;
            }
        };
        let Some(cfg) = cfg else { continue };
        let (host, wake_timeout) = match &cfg.launch {
            Launch::Process { host, .. } => (host.clone(), cfg.timeouts.wake),
            Launch::Attach { .. } => continue,
        };
        let idle = config.control.engine_idle_timeout;
        let cfg = cfg.clone();
        probes.push(async move {
            let url = crate::engine::base_url(&host, rec.port);
            let client = EngineClient::for_model(&url, idle, &cfg);
            let observed = observe(&client, &rec, wake_timeout).await;
            let a = Adopted {
                p2p_disabled,
                pid,
                start_time,
                tag: rec.tag.clone(),
                port: rec.port,
                proc_gen: rec.proc_gen,
                observed,
            };
            (name, a)
        });
    }
    // The longest grace any model is given: an unrecorded engine's model
    // is not known for sure (its name is only in its tag).
    let grace = config
        .models
        .iter()
        .map(|m| m.timeouts.stop_grace)
        .fold(config.defaults.timeouts.stop_grace, Duration::max)
        // The SIGKILL and its sweep must come within the wait below.
        .min(STOP_WAIT_MAX - SWEEP_DEADLINE);
    let marker = state_marker(&config.control.state_dir);
    let unrecorded = async {
        if tokio::time::timeout(STOP_WAIT_MAX, orphans::stop(&marker, &recorded, grace))
            .await
            .is_err()
        {
            tracing::warn!(
                "unrecorded engines still there after {STOP_WAIT_MAX:?} and a SIGKILL (stuck in the kernel, e.g. a hung GPU driver): models start anyway and may find their port or GPU memory taken; see `ps -eo pid,stat,cmd` and nvidia-smi"
            );
        }
    };
    let (probed, ()) = tokio::join!(futures::future::join_all(probes), unrecorded);
    for (name, a) in probed {
        tracing::info!(model = %name, pid = a.pid, port = a.port, observed = ?a.observed, "adopting a running engine");
        adopted.insert(name, a);
    }
    // Stops run side by side, so one deadline covers them all.
    if tokio::time::timeout(STOP_WAIT_MAX, futures::future::join_all(waits))
        .await
        .is_err()
    {
        tracing::warn!(
            "recorded engines still stopping after {STOP_WAIT_MAX:?}: models start anyway and may find their GPU memory taken; see `ps -eo pid,stat,cmd` and nvidia-smi"
        );
    }
    // Intents of models no longer configured must not come back with them.
    for name in store.intent_names() {
        if !config.models.iter().any(|m| m.name == name) {
            tracing::info!(model = %name, "forgetting the intent of a model no longer configured");
            store.forget(&name).wait().await;
        }
    }
    adopted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::test_server::{Act, engine};
    use std::os::unix::process::CommandExt;

    /// Why a running engine is not adopted (None: it is).
    fn unwanted(
        rec: &EngineRecord,
        cfg: Option<&ModelConfig>,
        placed: &BTreeMap<String, Placed>,
        intent: Option<&IntentRecord>,
    ) -> Option<&'static str> {
        adoption(rec, cfg, placed, intent).err()
    }

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
            suspended: false,
            suspended_pids: Vec::new(),
            spawned_unix_ms: 0,
            gpus: Vec::new(),
        }
    }

    /// An operator's restart drains the old engine first (up to a stop
    /// grace); a control plane stopped meanwhile must not adopt it, or the
    /// restart is lost. The new engine is adopted as usual.
    #[test]
    fn an_engine_spawned_before_an_operators_restart_is_not_adopted() {
        use crate::reconciler::{Command, Event, ModelState, Phase, Settings, adopt, step};
        use crate::status::Clock;
        let config = Config::demo(vec!["x".into()]);
        let cfg = &config.models[0];
        let clock = Clock::new();
        let now = tokio::time::Instant::now();
        let mut old = record(1, 1, "t");
        old.command_hash = command_hash(&spawn_spec(cfg, old.port, &default_placement(cfg)));
        old.spawned_unix_ms = clock.unix_ms(now) - 60_000;
        let mut m = ModelState::new(Settings::from_config(cfg), cfg.preload, now);
        adopt(&mut m, 1, 1, Observed::Awake, now);
        let before = IntentRecord::from_state(&m, &clock);
        assert_eq!(
            unwanted(&old, Some(cfg), &BTreeMap::new(), Some(&before)),
            None
        );

        let at = now + Duration::from_secs(1);
        let (m, fx) = step(m, Event::Command(Command::Restart), at);
        assert!(matches!(m.phase, Phase::Draining { .. }));
        assert!(fx.contains(&crate::reconciler::Effect::Persist), "{fx:?}");
        let asked = IntentRecord::from_state(&m, &clock);
        let why = unwanted(&old, Some(cfg), &BTreeMap::new(), Some(&asked));
        assert!(why.is_some_and(|w| w.contains("restart")), "{why:?}");

        // The restart done: its new engine, spawned after, is kept.
        let mut new = old.clone();
        new.spawned_unix_ms = clock.unix_ms(at) + 5_000;
        assert_eq!(
            unwanted(&new, Some(cfg), &BTreeMap::new(), Some(&asked)),
            None
        );
        // and once it runs, the ask is done and no longer written.
        let epoch = m.epoch;
        let (m, _) = step(m, Event::Drained { epoch, error: None }, at);
        let exited = Event::ChildExited {
            proc_gen: 1,
            status: "exit 0".into(),
            cause: None,
        };
        let (m, fx) = step(m, exited, at + Duration::from_secs(6));
        let spawn_gen = fx.iter().find_map(|f| match f {
            crate::reconciler::Effect::Spawn { proc_gen, .. } => Some(*proc_gen),
            _ => None,
        });
        let spawn_gen = spawn_gen.expect("a fresh start");
        let (m, _) = step(
            m,
            Event::Spawned {
                proc_gen: spawn_gen,
                pid: 2,
            },
            at + Duration::from_secs(7),
        );
        assert_eq!(
            IntentRecord::from_state(&m, &clock).restart_asked_unix_ms,
            0
        );
    }

    /// A control plane restarted after a reload that removed `z` (pinned
    /// to GPU 0, exclusive): `a`'s engine, spawned on GPU 1 under v1, is
    /// adopted, its recorded GPUs kept by start-up placement; placed
    /// afresh (GPU 0), it was stopped for a command it never changed.
    #[test]
    fn an_engine_kept_by_a_reload_is_adopted_after_a_restart() {
        use crate::placement::{Machine, Planned, place_config};
        let two =
            "[[gpu]]\nindex = 0\nmemory = \"80GiB\"\n[[gpu]]\nindex = 1\nmemory = \"80GiB\"\n";
        let a = "[[model]]\nname = \"a\"\nmodel = \"m\"\ngpu_memory = 0.5\n";
        let z = "[[model]]\nname = \"z\"\nmodel = \"m\"\ngpu_ids = [0]\nexclusive = true\n";
        let v1 = Config::parse(&format!("{two}{z}{a}"), "v1.toml").unwrap();
        let v2 = Config::parse(&format!("{two}{a}"), "v2.toml").unwrap();
        let machine = Machine::uniform(2, 80 << 30);
        let placed =
            |c: &Config, keep: &BTreeMap<String, Vec<u32>>| match place_config(c, &machine, keep)
                .unwrap()
            {
                Planned::Placed(p) => p
                    .iter()
                    .map(|p| (p.model.clone(), p.placed()))
                    .collect::<BTreeMap<_, _>>(),
                other => panic!("{other:?}"),
            };
        // Spawned under v1, on GPU 1, and recorded so.
        let on_v1 = placed(&v1, &BTreeMap::new())["a"].clone();
        assert_eq!(on_v1.gpus, [1]);
        let cfg = v2.models.iter().find(|m| m.name == "a").unwrap();
        let mut rec = record(1, 1, "t");
        rec.command_hash = command_hash(&spawn_spec(cfg, rec.port, &on_v1));
        rec.gpus = on_v1.gpus.clone();
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        assert!(store.set_engine("a", &rec));
        // The restart: v2 placed with the recorded GPUs kept.
        let kept = placed(&v2, &store.engine_gpus());
        assert_eq!(unwanted(&rec, Some(cfg), &kept, None), None);
        // Placed afresh, the engine would have been stopped.
        let fresh = placed(&v2, &BTreeMap::new());
        let why = unwanted(&rec, Some(cfg), &fresh, None);
        assert!(why.is_some_and(|w| w.contains("command line")), "{why:?}");
    }

    /// A tensor-parallel engine spawned under one P2P verdict, found by a
    /// control plane that holds another: started without P2P, now trusted,
    /// it is adopted as it runs (it was stopped, a cold start for nothing);
    /// started with P2P, no longer trusted, it is stopped, saying why.
    #[test]
    fn a_changed_p2p_verdict_stops_only_an_engine_that_runs_with_p2p() {
        let two =
            "[[gpu]]\nindex = 0\nmemory = \"80GiB\"\n[[gpu]]\nindex = 1\nmemory = \"80GiB\"\n";
        let tp = "[[model]]\nname = \"big\"\nmodel = \"m\"\ngpus = 2\n";
        let config = Config::parse(&format!("{two}{tp}"), "c.toml").unwrap();
        let cfg = &config.models[0];
        let with = |p2p_disabled: bool| Placed {
            gpus: vec![0, 1],
            p2p_disabled,
            ..default_placement(cfg)
        };
        let spawned = |p2p_disabled: bool| {
            let mut rec = record(1, 1, "t");
            rec.command_hash = command_hash(&spawn_spec(cfg, rec.port, &with(p2p_disabled)));
            rec
        };
        let now = |p2p_disabled: bool| BTreeMap::from([("big".to_string(), with(p2p_disabled))]);
        // As spawned: adopted with its switches.
        assert_eq!(
            adoption(&spawned(false), Some(cfg), &now(false), None),
            Ok(false)
        );
        assert_eq!(
            adoption(&spawned(true), Some(cfg), &now(true), None),
            Ok(true)
        );
        // Spawned without P2P, trusted now: adopted, still without.
        assert_eq!(
            adoption(&spawned(true), Some(cfg), &now(false), None),
            Ok(true)
        );
        // Spawned with P2P, no longer trusted: stopped.
        let why = adoption(&spawned(false), Some(cfg), &now(true), None).unwrap_err();
        assert!(why.contains("no longer trusted"), "{why}");
        assert_ne!(
            command_hash(&spawn_spec(cfg, 1, &with(false))),
            command_hash(&spawn_spec(cfg, 1, &with(true))),
            "the verdict changes the command"
        );
    }

    /// A fixed `port` changed in the file while siesta was down: the engine
    /// on the old port is not adopted (it was, and every later start of
    /// the model reused the old port for good); one on a port siesta
    /// picked is adopted on it.
    #[test]
    fn an_engine_on_a_fixed_port_changed_since_is_not_adopted() {
        let fixed = |port: &str| {
            let text = format!("[[model]]\nname = \"m\"\nmodel = \"m\"\ngpus = 0\n{port}");
            Config::parse(&text, "c.toml").unwrap().models.remove(0)
        };
        let spawned_on = |cfg: &ModelConfig, port: u16| {
            let mut rec = record(1, 1, "t");
            rec.port = port;
            rec.command_hash = command_hash(&spawn_spec(cfg, port, &default_placement(cfg)));
            rec
        };
        let none = BTreeMap::new();
        let old = spawned_on(&fixed("port = 8001\n"), 8001);
        assert_eq!(
            adoption(&old, Some(&fixed("port = 8001\n")), &none, None),
            Ok(false)
        );
        assert_eq!(
            unwanted(&old, Some(&fixed("port = 8002\n")), &none, None),
            Some("its command line changed in the configuration")
        );
        let picked = fixed("");
        assert_eq!(
            adoption(&spawned_on(&picked, 41234), Some(&picked), &none, None),
            Ok(false)
        );
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
        assert_eq!(locate("x", &record(0, 0, &tag)), Some((pid, start)));
        // A recorded pid without its start time: the tag decides.
        assert_eq!(locate("x", &record(pid, 0, &tag)), Some((pid, start)));
        assert_eq!(locate("x", &record(pid, start, &tag)), Some((pid, start)));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(locate("x", &record(pid, start, &tag)), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_engine_of_a_removed_model_is_stopped_and_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let tag = format!("recovery-removed-{}", std::process::id());
        // An engine that takes a moment to exit after SIGTERM (freeing GPU
        // memory does): a model placed on its GPU must not start before.
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg("trap 'sleep 1; exit 0' TERM; while :; do sleep 0.05; done")
            .env(TAG_ENV, &tag)
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = child.id();
        let start = procfs::start_time(pid).unwrap();
        assert!(store.set_engine("gone", &record(pid, start, &tag)));
        let config = Config::demo(vec!["x".into()]);
        let adopted = recover(&config, &BTreeMap::new(), &store).await;
        assert!(adopted.is_empty());
        assert!(
            child.try_wait().unwrap().is_some(),
            "recovery returned with the removed model's engine still running"
        );
        assert!(store.engine("gone").is_none(), "record kept");
    }

    /// Polls `done` every 20 ms for up to 10 s.
    fn eventually(mut done: impl FnMut() -> bool) -> bool {
        for _ in 0..500 {
            if done() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        done()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_engines_leftovers_are_killed_by_their_group() {
        let tag = format!("recovery-orphans-{}", std::process::id());
        // An engine leader with two children that ignore its death, as
        // vLLM's engine core and TP workers do, here without the tag in
        // their environment: only the process group finds them.
        let mut leader = std::process::Command::new("sh")
            .arg("-c")
            .arg("env -u SIESTA_ENGINE_TAG sleep 600 & env -u SIESTA_ENGINE_TAG sleep 600 & wait")
            .env(TAG_ENV, &tag)
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = leader.id();
        let start = procfs::start_time(pid).unwrap();
        let untagged_in_group = || {
            let tagged = procfs::pids_with_env(TAG_ENV, &tag);
            procfs::group_members(pid)
                .iter()
                .filter(|p| !tagged.contains(p))
                .count()
        };
        assert!(eventually(|| untagged_in_group() == 2));
        // The leader alone dies (SIGKILL to it, not its group).
        leader.kill().unwrap();
        leader.wait().unwrap();
        assert_eq!(
            procfs::group_members(pid).len(),
            2,
            "children died with the leader"
        );
        // Recovery kills them and returns only once they are gone: a new
        // engine of the model may start right after, and a killed process
        // keeps its GPU memory until it has exited.
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        assert!(store.set_engine("x", &record(pid, start, &tag)));
        let config = Config::demo(vec!["x".into()]);
        assert!(recover(&config, &BTreeMap::new(), &store).await.is_empty());
        assert_eq!(procfs::group_members(pid), Vec::<u32>::new());
        assert!(store.engines().is_empty());
    }

    /// After a reboot another process may have the recorded pid and even
    /// its start time (a daemon started as early at boot as the engine
    /// was): without the engine's tag it is neither adopted nor killed.
    #[test]
    fn a_process_that_took_the_recorded_pid_is_left_alone() {
        let mut other = std::process::Command::new("sleep")
            .arg("60")
            .env_remove(TAG_ENV)
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = other.id();
        let start = procfs::start_time(pid).unwrap();
        // Its environment is readable once exec is done.
        assert!(eventually(
            || procfs::carries_env(pid, TAG_ENV, "x") == Some(false)
        ));
        let rec = record(
            pid,
            start,
            &format!("recovery-foreign-{}", std::process::id()),
        );
        assert_eq!(locate("x", &rec), None);
        assert!(leftovers(&rec).is_empty());
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            other.try_wait().unwrap().is_none(),
            "a process that is not the engine was killed"
        );
        other.kill().unwrap();
        other.wait().unwrap();
    }

    #[test]
    fn a_tagged_leftover_in_a_group_of_its_own_is_killed_too() {
        let tag = format!("recovery-setsid-{}", std::process::id());
        let mut leader = std::process::Command::new("sh")
            .arg("-c")
            .arg("setsid sleep 600 & wait")
            .env(TAG_ENV, &tag)
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = leader.id();
        let start = procfs::start_time(pid).unwrap();
        let elsewhere = || {
            procfs::pids_with_env(TAG_ENV, &tag)
                .into_iter()
                .filter(|p| procfs::pgid(*p).is_some_and(|g| g != pid))
                .collect::<Vec<_>>()
        };
        assert!(eventually(|| !elsewhere().is_empty()));
        // While the leader lives, it (the first started) is the engine.
        assert_eq!(locate("x", &record(0, 0, &tag)), Some((pid, start)));
        leader.kill().unwrap();
        leader.wait().unwrap();
        // The leftover leads a group of its own; it is still not the engine.
        assert!(!elsewhere().is_empty());
        assert_eq!(locate("x", &record(pid, start, &tag)), None);
        assert!(
            eventually(|| procfs::pids_with_env(TAG_ENV, &tag).is_empty()),
            "tagged left: {:?}",
            procfs::pids_with_env(TAG_ENV, &tag)
        );
    }

    #[tokio::test]
    async fn an_engine_whose_is_sleeping_never_answers_is_asleep_at_the_recorded_level() {
        // A control plane restarted mid-wake: /health answers, /is_sleeping
        // waits behind the reload.
        let e = engine(|_, _, line| {
            if line.contains("/is_sleeping") {
                Act::Hang
            } else {
                Act::Ok("")
            }
        })
        .await;
        let client = EngineClient::new(&e.url);
        let mut rec = record(1, 0, "t");
        rec.sleep_level = 1;
        let observed = observe(&client, &rec, Duration::from_secs(3)).await;
        assert_eq!(observed, Observed::Asleep(1));
        // Asked again after the first deadline (waiting longer), never awake.
        let asked = e.requests.lock().unwrap().clone();
        let probes = asked.iter().filter(|l| l.contains("/is_sleeping")).count();
        assert_eq!(probes, 2, "{asked:?}");
    }

    #[tokio::test]
    async fn the_sleep_metric_alone_never_makes_an_engine_awake() {
        // After `wake_up?tags=weights`: the metric reads awake, /is_sleeping
        // is still true. The recorded level (2) stands.
        let e = engine(|_, _, line| {
            if line.contains("/is_sleeping") {
                Act::Ok(r#"{"is_sleeping":true}"#)
            } else if line.contains("/metrics") {
                Act::Ok("vllm:engine_sleep_state{sleep_state=\"awake\"} 1.0\n")
            } else {
                Act::Ok("")
            }
        })
        .await;
        let client = EngineClient::new(&e.url);
        let mut rec = record(1, 0, "t");
        rec.sleep_level = 2;
        let observed = observe(&client, &rec, Duration::from_secs(3)).await;
        assert_eq!(observed, Observed::Asleep(2));
    }

    #[test]
    fn no_recorded_level_means_the_safe_level_two() {
        let mut rec = record(1, 0, "t");
        assert_eq!(recorded_level(&rec), 2);
        rec.sleep_level = 1;
        assert_eq!(recorded_level(&rec), 1);
    }
}
