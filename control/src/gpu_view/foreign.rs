//! GPU memory held by processes siesta does not run: a notebook, another
//! user's job, a worker orphaned by an engine long gone. vLLM refuses to
//! start, and fails a wake, where it finds less free memory than its share;
//! placement counted only siesta's own models, so it admitted a start or
//! wake beside such a process that then failed in vLLM's words, and never
//! put an idle neighbour to sleep to make the room. Admission now plans
//! over what NVML says these processes hold.

use super::{GpuView, pgid_of, runtime};
use crate::gpu::{Inventory, InventorySource};
use crate::placement::{Foreign, Machine, budgets};
use crate::status::ModelStatus;
use std::collections::{BTreeMap, BTreeSet};

impl GpuView {
    /// What processes siesta does not run hold on each GPU now (NVML, read
    /// again when over a second old; empty without NVML).
    pub(crate) fn foreign(&self, models: &[ModelStatus]) -> BTreeMap<u32, Foreign> {
        self.refresh_inventory();
        let st = self.state.lock().unwrap();
        if st.inventory.source != InventorySource::Nvml {
            return BTreeMap::new();
        }
        // Attached engines' processes are not siesta's children: it knows
        // no pid of theirs, so what such an engine holds (as placement
        // counts it) is taken off what unknown processes hold.
        let attached: BTreeSet<&str> = models
            .iter()
            .filter(|m| m.launch == "attach" && m.pid.is_none())
            .map(|m| m.name.as_str())
            .collect();
        let attached_use: BTreeMap<u32, u64> = if attached.is_empty() {
            BTreeMap::new()
        } else {
            let machine = Machine::from_inventory(&st.inventory, st.p2p.clone());
            let placements: Vec<_> = st
                .placements
                .iter()
                .filter(|p| attached.contains(p.model.as_str()))
                .cloned()
                .collect();
            budgets(&machine, &placements, &runtime(models), &self.run_policy())
                .into_iter()
                .map(|b| (b.index, b.awake_bytes + b.asleep_bytes))
                .collect()
        };
        let engines: BTreeSet<u32> = models.iter().filter_map(|m| m.pid).collect();
        foreign_use(&st.inventory, &engines, &attached_use, pgid_of)
    }
}

/// Per GPU of `inventory`, the memory of processes that are none of
/// `engines` (process group leaders) nor in their groups, less what
/// attached engines hold there (`attached`). A process `pgid_of` cannot
/// see (another PID namespace: a container sees the host's pids in NVML)
/// is left out: it may be one of siesta's own engines.
pub(crate) fn foreign_use(
    inventory: &Inventory,
    engines: &BTreeSet<u32>,
    attached: &BTreeMap<u32, u64>,
    pgid_of: impl Fn(u32) -> Option<u32>,
) -> BTreeMap<u32, Foreign> {
    let mut out = BTreeMap::new();
    for g in &inventory.gpus {
        let mut processes: Vec<(u32, u64)> = g
            .processes
            .iter()
            .filter(|p| !engines.contains(&p.pid))
            .filter(|p| pgid_of(p.pid).is_some_and(|group| !engines.contains(&group)))
            .map(|p| (p.pid, p.used_bytes))
            .collect();
        let sum: u64 = processes.iter().map(|(_, b)| b).sum();
        let bytes = sum.saturating_sub(attached.get(&g.index).copied().unwrap_or(0));
        if bytes == 0 {
            continue;
        }
        processes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        out.insert(g.index, Foreign { bytes, processes });
    }
    out
}
