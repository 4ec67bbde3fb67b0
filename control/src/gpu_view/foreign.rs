//! GPU memory held by processes siesta does not run: a notebook, another
//! user's job, a worker orphaned by an engine long gone. vLLM refuses to
//! start, and fails a wake, where it finds less free memory than its share;
//! placement counted only siesta's own models, so it admitted a start or
//! wake beside such a process that then failed in vLLM's words, and never
//! put an idle neighbour to sleep to make the room. Admission now plans
//! over what NVML says these processes hold.

use super::{GpuView, runtime};
use crate::gpu::{Inventory, InventorySource};
use crate::placement::{Foreign, Machine, budgets};
use crate::status::{ModelStatus, State};
use crate::supervisor::{STATE_ENV, TAG_ENV, procfs, state_marker};
use std::collections::{BTreeMap, BTreeSet};

/// Whose each process `inventory` lists is, and of siesta's, which
/// model's: an engine's pid, a process in an engine's group, or a worker
/// that left the group (`setsid`) but carries the state directory `marker`
/// siesta spawned it for and the engine tag of an engine that runs now. A
/// worker with the marker and any other tag is left over (it outlived the
/// sweep after its engine ended, stuck in the driver): counted, and named
/// by the model its tag names. Reads `/proc`: call without locks.
pub(super) fn owners<'a>(
    inventory: &Inventory,
    models: &'a [ModelStatus],
    marker: &str,
) -> BTreeMap<u32, (Whose, Option<&'a str>)> {
    let engines: BTreeMap<u32, &str> = models
        .iter()
        .filter_map(|m| Some((m.pid?, m.name.as_str())))
        .collect();
    // The tags of the engines that run now, read once when needed.
    let mut live: Option<BTreeSet<String>> = None;
    let mut owner = |pid: u32| -> (Whose, Option<&'a str>) {
        if let Some(m) = engines.get(&pid) {
            return (Whose::Siesta, Some(m));
        }
        match procfs::pgid(pid) {
            None => (Whose::Unseen, None),
            Some(group) if engines.contains_key(&group) => {
                (Whose::Siesta, engines.get(&group).copied())
            }
            Some(_) => {
                // One read of its environment for both keys.
                let Some(env) = procfs::Env::of(pid).filter(|e| e.carries(STATE_ENV, marker))
                else {
                    return (Whose::Other, None);
                };
                let tag = env.get(TAG_ENV).unwrap_or_default();
                let named = models
                    .iter()
                    .find(|m| tag_of(&tag, m))
                    .map(|m| m.name.as_str());
                let live = live.get_or_insert_with(|| {
                    engines
                        .keys()
                        .filter_map(|p| procfs::env_value(*p, TAG_ENV))
                        .collect()
                });
                if live.contains(&tag) {
                    (Whose::Siesta, named)
                } else {
                    (Whose::Other, named)
                }
            }
        }
    };
    inventory
        .gpus
        .iter()
        .flat_map(|g| &g.processes)
        .map(|p| (p.pid, owner(p.pid)))
        .collect()
}

/// Whether the engine tag `tag` (`CONTROL_ID/MODEL/GENERATION/NONCE`, see
/// the runner's spawn) is one of `m`'s engines.
pub(super) fn tag_of(tag: &str, m: &ModelStatus) -> bool {
    tag.strip_prefix(m.control_id.as_str())
        .and_then(|t| t.strip_prefix('/'))
        .and_then(|t| t.strip_prefix(m.name.as_str()))
        .and_then(|t| t.strip_prefix('/'))
        .is_some_and(|rest| rest.matches('/').count() == 1)
}

/// Whose a process NVML lists on a GPU is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Whose {
    /// One of siesta's engines (or their workers).
    Siesta,
    /// Someone else's.
    Other,
    /// Not seen from here (another PID namespace): left out.
    Unseen,
}

impl GpuView {
    /// What processes siesta does not run hold on each GPU now (NVML, read
    /// again when over a second old; empty without NVML or outside the
    /// host's PID namespace). After a failed read, the last good read's
    /// processes that still live count: a holder does not vanish from the
    /// plan because one read failed (one gone from `/proc` is not counted).
    pub(crate) fn foreign(&self, models: &[ModelStatus]) -> BTreeMap<u32, Foreign> {
        self.foreign_within(models, super::INVENTORY_MAX_AGE)
    }

    /// [`Self::foreign`] from an NVML read at most `max_age` old: admission
    /// reads afresh before it lets a start or wake go (a holder that took
    /// its memory a moment ago is in no older read).
    pub(crate) fn foreign_within(
        &self,
        models: &[ModelStatus],
        max_age: std::time::Duration,
    ) -> BTreeMap<u32, Foreign> {
        self.refresh_inventory_within(max_age);
        let st = self.state.lock().unwrap();
        if st.inventory.source != InventorySource::Nvml || !st.pids_here {
            return BTreeMap::new();
        }
        // `/proc` is read without the lock: a process stuck in the driver
        // can hold up a read of its environment.
        let inventory = st.inventory.clone();
        let machine = Machine::from_inventory(&st.inventory, st.p2p.clone());
        let placements = st.placements.clone();
        let read_failed = st.read_failed;
        drop(st);
        let listed = owners(&inventory, models, &state_marker(&self.state_dir));
        let seen: BTreeSet<&str> = listed
            .values()
            .filter(|(w, _)| *w == Whose::Siesta)
            .filter_map(|(_, m)| *m)
            .collect();
        // Engines whose processes NVML does not show as theirs: attached
        // ones (not siesta's children, no pid known), and spawned ones
        // awake or asleep with none of their processes listed (an
        // `executable` that runs the engine in a container, or under
        // `sudo`, which drops the marker). What they hold, as placement
        // counts it, is taken off what unknown processes hold, not
        // counted twice.
        // (Only on a good read: one that failed lists what ran before,
        // not an engine that started since.)
        let unseen: BTreeSet<&str> = models
            .iter()
            .filter(|m| {
                (m.launch == "attach" && m.pid.is_none())
                    || (!read_failed
                        && m.pid.is_some()
                        && matches!(m.state, State::Awake | State::Asleep)
                        && !seen.contains(m.name.as_str()))
            })
            .map(|m| m.name.as_str())
            .collect();
        let attached_use: BTreeMap<u32, u64> = if unseen.is_empty() {
            BTreeMap::new()
        } else {
            let placements: Vec<_> = placements
                .into_iter()
                .filter(|p| unseen.contains(p.model.as_str()))
                .collect();
            budgets(&machine, &placements, &runtime(models), &self.run_policy())
                .into_iter()
                .map(|b| (b.index, b.awake_bytes + b.asleep_bytes))
                .collect()
        };
        foreign_use(&inventory, &attached_use, |pid| {
            listed.get(&pid).map_or(Whose::Unseen, |(w, _)| *w)
        })
    }
}

/// Whether this process runs in the host's PID namespace, whose pids NVML
/// lists. In a container without it (a Kubernetes pod without `hostPID`)
/// NVML's pids name other processes here, or none: memory of processes
/// siesta does not run is then not counted (it could be its own engines').
pub(crate) fn host_pid_namespace() -> bool {
    /// The initial PID namespace's inode (`PROC_PID_INIT_INO`).
    const INIT: &str = "pid:[4026531836]";
    std::fs::read_link("/proc/self/ns/pid").is_ok_and(|l| l.as_os_str() == INIT)
}

/// Per GPU of `inventory`, the memory of the processes `whose` says are
/// someone else's, less what attached engines hold there (`attached`).
pub(crate) fn foreign_use(
    inventory: &Inventory,
    attached: &BTreeMap<u32, u64>,
    whose: impl Fn(u32) -> Whose,
) -> BTreeMap<u32, Foreign> {
    let mut out = BTreeMap::new();
    for g in &inventory.gpus {
        let mut processes: Vec<(u32, u64)> = g
            .processes
            .iter()
            .filter(|p| whose(p.pid) == Whose::Other)
            .map(|p| (p.pid, p.used_bytes))
            .collect();
        let sum: u64 = processes.iter().map(|(_, b)| b).sum();
        let taken = attached.get(&g.index).copied().unwrap_or(0).min(sum);
        let bytes = sum - taken;
        if bytes == 0 {
            continue;
        }
        processes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        out.insert(
            g.index,
            Foreign {
                bytes,
                processes,
                attached_bytes: taken,
            },
        );
    }
    out
}
