//! Static placement: a GPU set per model, chosen greedily (most constrained
//! model first), preferring sets whose pairs are all P2P `ok`, then the best
//! connected, then sets where the model fits awake beside its neighbours,
//! then the least loaded.

use std::collections::BTreeMap;
use std::fmt;

use super::candidates::{Tenant, awake_bytes, combinations, fits, p2p_rank, worst_link};
use super::{GpuCapacity, Machine, MemoryNeed, ModelNeeds, Placement, Policy, gib, list};
use crate::gpu::LinkKind;

/// How good a candidate set is (lower is better): P2P rank, worst link,
/// GPUs where it would not fit awake beside its neighbours, load.
type Score = (u8, Option<LinkKind>, usize, u64);

/// Why a model cannot be placed; the message carries the arithmetic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model \"{model}\": {message}")]
pub struct PlacementError {
    pub model: String,
    /// The `[[model]]` key at fault: `gpus`, `gpu_ids` or `gpu_memory`.
    pub key: &'static str,
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

/// Which GPUs a model may use, or why it can never be placed.
fn precheck(m: &ModelNeeds, machine: &Machine) -> Result<Vec<u32>, (&'static str, String)> {
    if let MemoryNeed::Fraction(f) = m.memory
        && !(f > 0.0 && f <= 1.0)
    {
        return Err((
            "gpu_memory",
            format!("gpu_memory {f} is not a fraction in (0, 1]"),
        ));
    }
    let all: Vec<u32> = machine.gpus.iter().map(|g| g.index).collect();
    if all.is_empty() {
        return Err((
            "gpus",
            format!(
                "needs {} GPU(s) but no GPUs are known (no NVML, and no [[gpu]] in the config)",
                m.gpus
            ),
        ));
    }
    let allowed = if m.pinned_gpus.is_empty() {
        all.clone()
    } else {
        if let Some(g) = m.pinned_gpus.iter().find(|g| !all.contains(g)) {
            return Err((
                "gpu_ids",
                format!("pinned GPU {g} does not exist (GPUs: {})", list(&all)),
            ));
        }
        let mut p = m.pinned_gpus.clone();
        p.sort_unstable();
        p.dedup();
        p
    };
    if (m.gpus as usize) > allowed.len() {
        let (key, what) = if m.pinned_gpus.is_empty() {
            ("gpus", "the box has")
        } else {
            ("gpu_ids", "it is pinned to")
        };
        return Err((
            key,
            format!(
                "needs {} GPUs but {what} {} ({})",
                m.gpus,
                allowed.len(),
                list(&allowed)
            ),
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
            return Err((
                "gpu_memory",
                format!(
                    "needs {} × {} but GPU {} has {}",
                    m.gpus,
                    gib(b),
                    largest.index,
                    gib(largest.total_bytes)
                ),
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
        let fail = |(key, message): (&'static str, String)| PlacementError {
            model: m.name.clone(),
            key,
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
                residual: policy.residual_of(&m.name),
                exclusive: m.exclusive,
            };
            let mut ok = true;
            let (mut crowded, mut load) = (0usize, 0u64);
            for (k, cap) in caps.iter().enumerate() {
                let mut t = tenants.get(&cap.index).cloned().unwrap_or_default();
                let others: u64 = t.iter().map(|x| x.awake).sum();
                t.push(me(k));
                if let Err(e) = fits(cap, &t) {
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
            errors.push(fail((
                "gpu_memory",
                format!(
                    "no set of {} GPU(s) has room ({})",
                    m.gpus,
                    detail.join("; ")
                ),
            )));
            continue;
        };
        for (k, &g) in set.iter().enumerate() {
            tenants.entry(g).or_default().push(Tenant {
                name: m.name.clone(),
                awake: bytes[k],
                residual: policy.residual_of(&m.name),
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
