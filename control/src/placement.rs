//! Placement: which GPUs each model runs on, what the engine is told
//! (`CUDA_VISIBLE_DEVICES`, `--tensor-parallel-size`,
//! `--gpu-memory-utilization`, P2P switches), and, at run time, which idle
//! models to put to sleep so another can wake.
//!
//! Pure: no I/O, no clocks. [`place_config`] (over [`place`]) runs at daemon
//! start, on every reload and in `siesta config check`, and refuses a
//! configuration that can never fit; [`plan_wake`] runs before every wake.
//! [`Placed::engine_args`] and [`Placed::engine_env`] are the only builders
//! of the engine's GPU arguments and environment.
//!
//! Memory model: an awake (or starting, waking, sleeping, stopping, or
//! failed with its engine not yet gone) model takes its full share of each
//! of its GPUs; an asleep one a residual ([`Policy::residual_bytes`], vLLM
//! measures 1–7 GiB per GPU asleep); a stopped one (or failed, its engine
//! gone) nothing. Statically, every model must fit awake on its GPUs
//! while all the others placed there are asleep, so more models may be
//! placed than fit awake at once.

mod assign;
mod candidates;
mod evict;
mod from_config;
mod placed;

pub use assign::{PlacementError, PlacementErrors, place};
pub use evict::{FailedEngine, GpuBudget, ModelRuntime, RunState, WakePlan, budgets, plan_wake};
pub use from_config::{Planned, needs_of, place_config, policy_of};
pub use placed::{Placed, default_placement};

use std::collections::BTreeMap;

use crate::gpu::p2p::P2pMatrix;
use crate::gpu::{Inventory, LinkKind};

/// 1.5 GiB: what an asleep model is assumed to keep on each GPU when
/// nothing says more (a model the policy has no residual for).
pub const DEFAULT_RESIDUAL_BYTES: u64 = 3 << 29;

/// What an asleep engine keeps per GPU until measured: real vLLM 0.24 kept
/// 836 MiB at TP=1 and 2,204 MiB per GPU at TP=2 on H200s.
pub fn default_residual(tensor_parallel: u32) -> u64 {
    if tensor_parallel > 1 {
        5 << 29
    } else {
        1 << 30
    }
}

/// Knobs of placement.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// GPU memory an asleep model still holds per GPU, for models not in
    /// `residuals` (and for the static fit).
    pub residual_bytes: u64,
    /// Per model: what it holds asleep per GPU (measured or its default).
    pub residuals: BTreeMap<String, u64>,
    /// Treat GPU pairs the probe never checked as healthy (default false:
    /// a tensor-parallel group with an unprobed pair runs with P2P off).
    pub trust_unprobed_p2p: bool,
}

impl Policy {
    /// What `model` holds asleep per GPU.
    pub fn residual_of(&self, model: &str) -> u64 {
        self.residuals
            .get(model)
            .copied()
            .unwrap_or(self.residual_bytes)
    }
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            residual_bytes: DEFAULT_RESIDUAL_BYTES,
            residuals: BTreeMap::new(),
            trust_unprobed_p2p: false,
        }
    }
}

/// One GPU as placement sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuCapacity {
    pub index: u32,
    pub total_bytes: u64,
}

/// GPU memory held by processes siesta does not run (NVML): a notebook, a
/// job of another user, a worker orphaned by an engine long gone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Foreign {
    pub bytes: u64,
    /// (pid, bytes) of each such process, largest first.
    pub processes: Vec<(u32, u64)>,
    /// Of what they hold, what was taken for engines whose processes
    /// siesta cannot tell (attached ones, or spawned ones none of whose
    /// processes NVML lists as theirs): they may be among these.
    pub attached_bytes: u64,
}

impl Foreign {
    /// `pid 4242 (60.0 GiB), pid 4250 (1.0 GiB)`: at most three.
    pub fn describe(&self) -> String {
        let mut parts: Vec<String> = self
            .processes
            .iter()
            .take(3)
            .map(|(pid, b)| format!("pid {pid} ({})", gib(*b)))
            .collect();
        if self.processes.len() > 3 {
            parts.push(format!("{} more", self.processes.len() - 3));
        }
        let mut s = parts.join(", ");
        if self.attached_bytes > 0 {
            s += &format!(
                " (less {} taken for engines whose pids siesta does not know)",
                gib(self.attached_bytes)
            );
        }
        s
    }
}

/// The box: GPUs, how they are linked, and the P2P verdicts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Machine {
    pub gpus: Vec<GpuCapacity>,
    /// Link kind per unordered pair (key: (low, high)); missing = unknown.
    pub links: BTreeMap<(u32, u32), LinkKind>,
    pub p2p: P2pMatrix,
    /// Per GPU, what processes siesta does not run hold (run time only:
    /// placement at start plans over the whole GPU).
    pub foreign: BTreeMap<u32, Foreign>,
}

impl Machine {
    /// GPUs of equal size, no topology, no P2P results.
    pub fn uniform(count: u32, total_bytes: u64) -> Self {
        Self {
            gpus: (0..count)
                .map(|index| GpuCapacity { index, total_bytes })
                .collect(),
            ..Self::default()
        }
    }

    pub fn from_inventory(inv: &Inventory, p2p: P2pMatrix) -> Self {
        let mut links = BTreeMap::new();
        for g in &inv.gpus {
            for l in &g.links {
                let key = (g.index.min(l.peer), g.index.max(l.peer));
                links
                    .entry(key)
                    .and_modify(|k: &mut LinkKind| *k = (*k).min(l.kind))
                    .or_insert(l.kind);
            }
        }
        Self {
            gpus: inv
                .gpus
                .iter()
                .map(|g| GpuCapacity {
                    index: g.index,
                    total_bytes: g.memory_total_bytes,
                })
                .collect(),
            links,
            p2p,
            foreign: BTreeMap::new(),
        }
    }

    pub fn gpu(&self, index: u32) -> Option<&GpuCapacity> {
        self.gpus.iter().find(|g| g.index == index)
    }

    /// Bytes of GPU `index` held by processes siesta does not run.
    pub fn foreign_on(&self, index: u32) -> u64 {
        self.foreign.get(&index).map_or(0, |f| f.bytes)
    }

    pub fn link(&self, a: u32, b: u32) -> LinkKind {
        self.links
            .get(&(a.min(b), a.max(b)))
            .copied()
            .unwrap_or(LinkKind::Unknown)
    }
}

/// How much of each GPU a model takes awake.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryNeed {
    /// A fraction of each GPU's total, as vLLM's `--gpu-memory-utilization`.
    Fraction(f64),
    /// Bytes per GPU.
    Bytes(u64),
}

/// What a model asks of the GPUs (from its `[[model]]` table).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelNeeds {
    pub name: String,
    /// GPU count (the tensor-parallel size); 0: needs no GPU.
    pub gpus: u32,
    pub memory: MemoryNeed,
    /// Only these GPUs may be used (empty: any).
    pub pinned_gpus: Vec<u32>,
    /// No other model may share its GPUs.
    pub exclusive: bool,
}

/// Where a model runs and what its engine is told.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub model: String,
    /// GPU indices, ascending (empty: needs no GPU).
    pub gpus: Vec<u32>,
    /// Bytes taken awake on each GPU of `gpus`, same order.
    pub awake_bytes: Vec<u64>,
    /// Passed as `--gpu-memory-utilization` (0: not set).
    pub gpu_memory_utilization: f64,
    /// A pair in the set is not known `ok`: NCCL P2P off, no custom all-reduce.
    pub p2p_disabled: bool,
    pub exclusive: bool,
    /// Why this set, for humans (`siesta placement`).
    pub reason: String,
}

impl Placement {
    /// `CUDA_VISIBLE_DEVICES`, e.g. "0,1". Indices are NVML's (PCI bus
    /// order): launch engines with `CUDA_DEVICE_ORDER=PCI_BUS_ID`.
    pub fn cuda_visible_devices(&self) -> String {
        let v: Vec<String> = self.gpus.iter().map(u32::to_string).collect();
        v.join(",")
    }

    pub fn tensor_parallel_size(&self) -> u32 {
        self.gpus.len() as u32
    }

    /// Memory taken awake on `gpu` (0 if not placed there).
    pub fn awake_on(&self, gpu: u32) -> u64 {
        self.gpus
            .iter()
            .position(|&g| g == gpu)
            .map_or(0, |i| self.awake_bytes[i])
    }
}

/// After a new P2P probe, re-decide `p2p_disabled` of every placement
/// without moving any model (engines may be running on their GPUs; a full
/// [`place`] at the next start may choose healthier sets). Returns the
/// models whose decision changed; their engines get it at their next start.
pub fn refresh_p2p(
    machine: &Machine,
    placements: &mut [Placement],
    policy: &Policy,
) -> Vec<String> {
    let mut changed = Vec::new();
    for p in placements.iter_mut().filter(|p| p.gpus.len() > 1) {
        let (rank, first_bad) = candidates::p2p_rank(machine, &p.gpus);
        let disabled = rank == 2 || (rank == 1 && !policy.trust_unprobed_p2p);
        let said = match (rank, first_bad) {
            (0, _) => "P2P ok on every pair".to_string(),
            (_, Some(v)) if disabled => {
                format!("P2P disabled: {v} (NCCL_P2P_DISABLE=1, --disable-custom-all-reduce)")
            }
            (_, Some(v)) => format!("P2P {v}, trusted by policy"),
            _ => String::new(),
        };
        let mut parts: Vec<String> = p
            .reason
            .split("; ")
            .filter(|s| !s.starts_with("P2P ") && !s.starts_with("no set "))
            .map(String::from)
            .collect();
        parts.insert(1.min(parts.len()), said);
        p.reason = parts.join("; ");
        if p.p2p_disabled != disabled {
            p.p2p_disabled = disabled;
            changed.push(p.model.clone());
        }
    }
    changed
}

/// Bytes as GiB with one decimal, e.g. "80.0 GiB".
pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// "0, 1, 2".
pub(crate) fn list(gpus: &[u32]) -> String {
    let v: Vec<String> = gpus.iter().map(u32::to_string).collect();
    v.join(", ")
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_config;
#[cfg(test)]
mod tests_evict;
#[cfg(test)]
mod tests_mixes;
