//! Static placement: a GPU set per model, chosen greedily (most constrained
//! model first), preferring sets whose pairs are all P2P `ok`, then the best
//! connected, then sets where the model fits awake beside its neighbours,
//! then the least loaded.

use std::collections::BTreeMap;
use std::fmt;

use super::{GpuCapacity, Machine, MemoryNeed, ModelNeeds, Placement, Policy, gib, list};
use crate::gpu::LinkKind;
use crate::gpu::p2p::PairVerdict;

/// How good a candidate set is (lower is better): P2P rank, worst link,
/// GPUs where it would not fit awake beside its neighbours, load.
type Score = (u8, Option<LinkKind>, usize, u64);

/// Why a model cannot be placed; the message carries the arithmetic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model \"{model}\": {message}")]
pub struct PlacementError {
    pub model: String,
    pub message: String,
}

/// Every model that could not be placed, one line each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementErrors(pub Vec<PlacementError>);

impl fmt::Display for PlacementErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lines: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&lines.join("\n"))
    }
}

impl std::error::Error for PlacementErrors {}

/// A model already given GPUs, as the GPUs' tenants see it.
#[derive(Debug, Clone)]
struct Tenant {
    name: String,
    awake: u64,
    exclusive: bool,
}

/// Memory a model takes awake on each GPU of `set`, and the utilization.
fn awake_bytes(need: MemoryNeed, set: &[&GpuCapacity]) -> (Vec<u64>, f64) {
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
fn fits(gpu: &GpuCapacity, tenants: &[Tenant], residual: u64) -> Result<(), String> {
    if tenants.len() > 1
        && let Some(x) = tenants.iter().find(|t| t.exclusive)
    {
        return Err(format!("GPU {}: exclusive to \"{}\"", gpu.index, x.name));
    }
    for t in tenants {
        let others: Vec<&Tenant> = tenants.iter().filter(|o| o.name != t.name).collect();
        let res: u64 = others.iter().map(|o| o.awake.min(residual)).sum();
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
fn combinations(items: &[u32], k: usize) -> Vec<Vec<u32>> {
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
fn p2p_rank(machine: &Machine, set: &[u32]) -> (u8, Option<PairVerdict>) {
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

fn worst_link(machine: &Machine, set: &[u32]) -> Option<LinkKind> {
    let mut worst = None;
    for (i, &a) in set.iter().enumerate() {
        for &b in &set[i + 1..] {
            let k = machine.link(a, b);
            worst = Some(worst.map_or(k, |w: LinkKind| w.max(k)));
        }
    }
    worst
}

/// Which GPUs a model may use, or why it can never be placed.
fn precheck(m: &ModelNeeds, machine: &Machine) -> Result<Vec<u32>, String> {
    if let MemoryNeed::Fraction(f) = m.memory
        && !(f > 0.0 && f <= 1.0)
    {
        return Err(format!("gpu_memory {f} is not a fraction in (0, 1]"));
    }
    let all: Vec<u32> = machine.gpus.iter().map(|g| g.index).collect();
    if all.is_empty() {
        return Err(format!(
            "needs {} GPU(s) but no GPUs are known (no NVML, and no [[gpu]] in the config)",
            m.gpus
        ));
    }
    let allowed = if m.pinned_gpus.is_empty() {
        all.clone()
    } else {
        if let Some(g) = m.pinned_gpus.iter().find(|g| !all.contains(g)) {
            return Err(format!(
                "pinned GPU {g} does not exist (GPUs: {})",
                list(&all)
            ));
        }
        let mut p = m.pinned_gpus.clone();
        p.sort_unstable();
        p.dedup();
        p
    };
    if (m.gpus as usize) > allowed.len() {
        let what = if m.pinned_gpus.is_empty() {
            "the box has"
        } else {
            "it is pinned to"
        };
        return Err(format!(
            "needs {} GPUs but {what} {} ({})",
            m.gpus,
            allowed.len(),
            list(&allowed)
        ));
    }
    if let MemoryNeed::Bytes(b) = m.memory {
        let big: Vec<u32> = allowed
            .iter()
            .copied()
            .filter(|&g| machine.gpu(g).is_some_and(|c| c.total_bytes >= b))
            .collect();
        if big.len() < m.gpus as usize {
            let largest = allowed
                .iter()
                .filter_map(|&g| machine.gpu(g))
                .filter(|c| c.total_bytes < b)
                .max_by_key(|c| (c.total_bytes, std::cmp::Reverse(c.index)))
                .copied()
                .unwrap_or(GpuCapacity {
                    index: 0,
                    total_bytes: 0,
                });
            return Err(format!(
                "needs {} × {} but GPU {} has {}",
                m.gpus,
                gib(b),
                largest.index,
                gib(largest.total_bytes)
            ));
        }
    }
    Ok(allowed)
}

/// Place every model, or list every one that cannot be placed.
pub fn place(
    machine: &Machine,
    models: &[ModelNeeds],
    policy: &Policy,
) -> Result<Vec<Placement>, PlacementErrors> {
    let mut tenants: BTreeMap<u32, Vec<Tenant>> = BTreeMap::new();
    let mut placed: BTreeMap<usize, Placement> = BTreeMap::new();
    let mut errors = Vec::new();

    let mut order: Vec<usize> = (0..models.len()).collect();
    let demand = |m: &ModelNeeds| match m.memory {
        MemoryNeed::Fraction(f) => f,
        MemoryNeed::Bytes(b) => {
            b as f64
                / machine
                    .gpus
                    .iter()
                    .map(|g| g.total_bytes)
                    .max()
                    .unwrap_or(1) as f64
        }
    };
    order.sort_by(|&a, &b| {
        let (x, y) = (&models[a], &models[b]);
        (
            x.pinned_gpus.is_empty(),
            !x.exclusive,
            std::cmp::Reverse(x.gpus),
        )
            .cmp(&(
                y.pinned_gpus.is_empty(),
                !y.exclusive,
                std::cmp::Reverse(y.gpus),
            ))
            .then(demand(y).total_cmp(&demand(x)))
            .then(a.cmp(&b))
    });

    for i in order {
        let m = &models[i];
        let fail = |message: String| PlacementError {
            model: m.name.clone(),
            message,
        };
        if m.gpus == 0 {
            placed.insert(
                i,
                Placement {
                    model: m.name.clone(),
                    gpus: Vec::new(),
                    awake_bytes: Vec::new(),
                    gpu_memory_utilization: 0.0,
                    p2p_disabled: false,
                    exclusive: false,
                    reason: "needs no GPU".into(),
                },
            );
            continue;
        }
        let allowed = match precheck(m, machine) {
            Ok(a) => a,
            Err(e) => {
                errors.push(fail(e));
                continue;
            }
        };
        let mut best: Option<(Score, Vec<u32>, Vec<u64>, f64)> = None;
        let mut why_not: BTreeMap<u32, String> = BTreeMap::new();
        let candidates = combinations(&allowed, m.gpus as usize);
        let best_possible_p2p = candidates
            .iter()
            .map(|s| p2p_rank(machine, s).0)
            .min()
            .unwrap_or(0);
        for set in &candidates {
            let caps: Vec<&GpuCapacity> = set.iter().filter_map(|&g| machine.gpu(g)).collect();
            let (bytes, util) = awake_bytes(m.memory, &caps);
            let me = |k: usize| Tenant {
                name: m.name.clone(),
                awake: bytes[k],
                exclusive: m.exclusive,
            };
            let mut ok = true;
            let (mut crowded, mut load) = (0usize, 0u64);
            for (k, cap) in caps.iter().enumerate() {
                let mut t = tenants.get(&cap.index).cloned().unwrap_or_default();
                let others: u64 = t.iter().map(|x| x.awake).sum();
                t.push(me(k));
                if let Err(e) = fits(cap, &t, policy.residual_bytes) {
                    why_not.entry(cap.index).or_insert(e);
                    ok = false;
                    break;
                }
                crowded += usize::from(others + bytes[k] > cap.total_bytes);
                load += (others as f64 / cap.total_bytes.max(1) as f64 * 1e6) as u64;
            }
            if !ok {
                continue;
            }
            let score = (
                p2p_rank(machine, set).0,
                worst_link(machine, set),
                crowded,
                load,
            );
            if best.as_ref().is_none_or(|(s, ..)| score < *s) {
                best = Some((score, set.clone(), bytes, util));
            }
        }
        let Some((score, set, bytes, util)) = best else {
            let detail: Vec<String> = why_not.into_values().collect();
            errors.push(fail(format!(
                "no set of {} GPU(s) has room ({})",
                m.gpus,
                detail.join("; ")
            )));
            continue;
        };
        for (k, &g) in set.iter().enumerate() {
            tenants.entry(g).or_default().push(Tenant {
                name: m.name.clone(),
                awake: bytes[k],
                exclusive: m.exclusive,
            });
        }
        let (rank, first_bad) = p2p_rank(machine, &set);
        let p2p_disabled =
            set.len() > 1 && (rank == 2 || (rank == 1 && !policy.trust_unprobed_p2p));
        let mut reason = vec![if m.pinned_gpus.is_empty() {
            format!(
                "GPU {} (best of {} possible sets)",
                list(&set),
                candidates.len()
            )
        } else {
            format!("GPU {} (pinned to {})", list(&set), list(&m.pinned_gpus))
        }];
        if set.len() > 1 {
            reason.push(match (rank, first_bad) {
                (0, _) => "P2P ok on every pair".to_string(),
                (_, Some(v)) if p2p_disabled => {
                    format!("P2P disabled: {v} (NCCL_P2P_DISABLE=1, --disable-custom-all-reduce)")
                }
                (_, Some(v)) => format!("P2P {v}, trusted by policy"),
                _ => String::new(),
            });
            if rank > best_possible_p2p {
                reason.push("no set with healthier P2P had room".into());
            } else if rank > 0 && best_possible_p2p > 0 {
                reason.push("no set of that size has P2P ok on every pair".into());
            }
            if let Some(k) = score.1 {
                reason.push(format!("linked by {}", k.as_str()));
            }
        }
        let max = bytes.iter().copied().max().unwrap_or(0);
        reason.push(format!("{} awake per GPU (utilization {util})", gib(max)));
        if m.exclusive {
            reason.push("exclusive".into());
        }
        placed.insert(
            i,
            Placement {
                model: m.name.clone(),
                gpus: set,
                awake_bytes: bytes,
                gpu_memory_utilization: util,
                p2p_disabled,
                exclusive: m.exclusive,
                reason: reason.join("; "),
            },
        );
    }
    // Neighbours are known only once everyone is placed.
    for p in placed.values_mut() {
        let shared: Vec<String> = p
            .gpus
            .iter()
            .flat_map(|g| {
                tenants[g]
                    .iter()
                    .filter(|t| t.name != p.model)
                    .map(move |t| format!("\"{}\" on GPU {g}", t.name))
            })
            .collect();
        if !shared.is_empty() {
            p.reason
                .push_str(&format!("; shares with {}", shared.join(", ")));
        }
    }
    if errors.is_empty() {
        Ok(placed.into_values().collect())
    } else {
        Err(PlacementErrors(errors))
    }
}

#[cfg(test)]
pub(super) fn combinations_for_test(items: &[u32], k: usize) -> Vec<Vec<u32>> {
    combinations(items, k)
}
