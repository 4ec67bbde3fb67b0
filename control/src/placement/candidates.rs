//! Candidate GPU sets: enumeration, memory arithmetic, P2P and link ranks.

use super::{GpuCapacity, Machine, MemoryNeed, gib};
use crate::gpu::LinkKind;
use crate::gpu::p2p::PairVerdict;

/// A model already given GPUs, as the GPUs' tenants see it.
#[derive(Debug, Clone)]
pub(super) struct Tenant {
    pub name: String,
    pub awake: u64,
    /// What it keeps on the GPU asleep ([`super::Policy::residual_of`]).
    pub residual: u64,
    pub exclusive: bool,
}

/// Memory a model takes awake on each GPU of `set`, and the utilization.
pub(super) fn awake_bytes(need: MemoryNeed, set: &[&GpuCapacity]) -> (Vec<u64>, f64) {
    match need {
        MemoryNeed::Fraction(f) => (
            set.iter()
                .map(|g| (g.total_bytes as f64 * f) as u64)
                .collect(),
            f,
        ),
        MemoryNeed::Bytes(b) => {
            let min_total = set.iter().map(|g| g.total_bytes).min().unwrap_or(1).max(1);
            let util = ((b as f64 / min_total as f64) * 10_000.0).ceil() / 10_000.0;
            (
                set.iter()
                    .map(|g| b.max((g.total_bytes as f64 * util) as u64))
                    .collect(),
                util,
            )
        }
    }
}

/// Does the worst case on a GPU fit: each tenant awake while the rest are asleep?
/// Err: the arithmetic of the worst tenant.
pub(super) fn fits(gpu: &GpuCapacity, tenants: &[Tenant]) -> Result<(), String> {
    if tenants.len() > 1
        && let Some(x) = tenants.iter().find(|t| t.exclusive)
    {
        return Err(format!("GPU {}: exclusive to \"{}\"", gpu.index, x.name));
    }
    for t in tenants {
        let others: Vec<&Tenant> = tenants.iter().filter(|o| o.name != t.name).collect();
        let res: u64 = others.iter().map(|o| o.awake.min(o.residual)).sum();
        if t.awake + res > gpu.total_bytes {
            let names: Vec<String> = others.iter().map(|o| format!("\"{}\"", o.name)).collect();
            return Err(if others.is_empty() {
                format!(
                    "GPU {}: \"{}\" needs {} but it has {}",
                    gpu.index,
                    t.name,
                    gib(t.awake),
                    gib(gpu.total_bytes)
                )
            } else {
                format!(
                    "GPU {}: \"{}\" awake {} + asleep residual of {} {} = {} > {}",
                    gpu.index,
                    t.name,
                    gib(t.awake),
                    names.join(", "),
                    gib(res),
                    gib(t.awake + res),
                    gib(gpu.total_bytes)
                )
            });
        }
    }
    Ok(())
}

/// All k-subsets of `items`, in lexicographic order.
pub(super) fn combinations(items: &[u32], k: usize) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    if k == 0 || k > items.len() {
        return out;
    }
    let mut idx: Vec<usize> = (0..k).collect();
    loop {
        out.push(idx.iter().map(|&i| items[i]).collect());
        let Some(i) = (0..k).rev().find(|&i| idx[i] != i + items.len() - k) else {
            return out;
        };
        idx[i] += 1;
        for j in i + 1..k {
            idx[j] = idx[j - 1] + 1;
        }
    }
}

/// P2P rank of a set: 0 all pairs ok, 1 some unprobed, 2 some bad; and the
/// first pair that is not ok.
pub(super) fn p2p_rank(machine: &Machine, set: &[u32]) -> (u8, Option<PairVerdict>) {
    let mut rank = 0;
    let mut first = None;
    for (i, &a) in set.iter().enumerate() {
        for &b in &set[i + 1..] {
            let v = machine.p2p.pair(a, b);
            let r = match v {
                PairVerdict::Ok => 0,
                PairVerdict::Unknown => 1,
                PairVerdict::Bad(..) => 2,
            };
            if r > rank {
                rank = r;
                first = Some(v);
            }
        }
    }
    (rank, first)
}

pub(super) fn worst_link(machine: &Machine, set: &[u32]) -> Option<LinkKind> {
    let mut worst = None;
    for (i, &a) in set.iter().enumerate() {
        for &b in &set[i + 1..] {
            let k = machine.link(a, b);
            worst = Some(worst.map_or(k, |w: LinkKind| w.max(k)));
        }
    }
    worst
}
