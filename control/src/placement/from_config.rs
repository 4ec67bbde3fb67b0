//! A configuration's placement: the one function the daemon (at start and
//! on reload) and `siesta config check` call, so they refuse the same
//! configurations with the same message (`FILE: model[i].KEY: model "NAME":
//! ...` with the arithmetic).

use std::collections::{BTreeMap, BTreeSet};

use super::{Machine, MemoryNeed, ModelNeeds, Placement, PlacementErrors, Policy, place};
use crate::config::{Config, ConfigError, GpuMemory, ModelConfig, Problem};

/// What a `[[model]]` asks of the GPUs.
pub fn needs_of(m: &ModelConfig) -> ModelNeeds {
    ModelNeeds {
        name: m.name.clone(),
        gpus: m.gpus,
        memory: match m.gpu_memory {
            Some(GpuMemory::Fraction(f)) => MemoryNeed::Fraction(f),
            Some(GpuMemory::Bytes(b)) => MemoryNeed::Bytes(b),
            // vLLM's own default --gpu-memory-utilization.
            None => MemoryNeed::Fraction(0.9),
        },
        pinned_gpus: m.gpu_ids.clone(),
        exclusive: m.exclusive,
    }
}

/// Placement's knobs from `[control]`: what each model keeps asleep per
/// GPU is `asleep_residual` when set, else the default for its tensor
/// parallelism ([`super::default_residual`]), as at run time until measured.
pub fn policy_of(config: &Config) -> Policy {
    let configured = config.control.asleep_residual;
    Policy {
        residual_bytes: configured.unwrap_or(super::DEFAULT_RESIDUAL_BYTES),
        residuals: config
            .models
            .iter()
            .filter(|m| m.gpus > 0)
            .map(|m| {
                let bytes = configured.unwrap_or_else(|| super::default_residual(m.gpus));
                (m.name.clone(), bytes)
            })
            .collect(),
        ..Policy::default()
    }
}

/// What placing a configuration gave.
#[derive(Debug, Clone, PartialEq)]
pub enum Planned {
    /// Every model that needs GPUs has a set.
    Placed(Vec<Placement>),
    /// No GPU is known (no NVML, no `[[gpu]]`): nothing can be checked;
    /// models run on their pinned or first GPUs ([`super::default_placement`]).
    NoInventory,
}

/// Places every model of `config` on `machine`, or refuses with one
/// problem per model that can never be placed, naming the file and key.
///
/// `keep`: GPUs models already run on (a reload, or the engines recorded
/// at a restart): each model whose needs allow it is kept there if the
/// whole configuration still fits that way, else as many as fit are (see
/// [`place_keeping`]); the others are placed afresh.
pub fn place_config(
    config: &Config,
    machine: &Machine,
    keep: &BTreeMap<String, Vec<u32>>,
) -> Result<Planned, ConfigError> {
    if machine.gpus.is_empty() {
        return Ok(Planned::NoInventory);
    }
    let policy = policy_of(config);
    let needs: Vec<ModelNeeds> = config.models.iter().map(needs_of).collect();
    if let Some(mut placed) = place_keeping(machine, &needs, keep, &policy) {
        for p in &mut placed {
            let was_free = needs
                .iter()
                .any(|n| n.name == p.model && n.pinned_gpus.is_empty());
            if was_free {
                let pinned = format!("(pinned to {})", super::list(&p.gpus));
                p.reason = p.reason.replacen(&pinned, "(kept where it runs)", 1);
            }
        }
        return Ok(Planned::Placed(placed));
    }
    place(machine, &needs, &policy)
        .map(Planned::Placed)
        .map_err(|e| refusal(config, e))
}

/// Whether `n` may be kept on `gpus`: not pinned by the configuration, and
/// asking for as many GPUs as it runs on.
fn keepable(n: &ModelNeeds, gpus: &[u32]) -> bool {
    n.pinned_gpus.is_empty() && !gpus.is_empty() && gpus.len() == n.gpus as usize
}

/// `needs` with the models named in `kept` pinned to their GPUs in `keep`.
fn pin_kept(
    needs: &[ModelNeeds],
    keep: &BTreeMap<String, Vec<u32>>,
    kept: &BTreeSet<&str>,
) -> Vec<ModelNeeds> {
    needs
        .iter()
        .map(|n| match keep.get(&n.name) {
            Some(g) if kept.contains(n.name.as_str()) => ModelNeeds {
                pinned_gpus: g.clone(),
                ..n.clone()
            },
            _ => n.clone(),
        })
        .collect()
}

/// Places `needs` keeping the models of `keep` on their GPUs: all of them
/// if that fits, else as many as fit, added one at a time by name, so one
/// model that cannot stay (a model now pinned where it ran) does not move
/// every other running engine (a move restarts an engine; at a restart of
/// the control plane it stops an engine recovery would adopt). None: no
/// model can be kept, place afresh.
fn place_keeping(
    machine: &Machine,
    needs: &[ModelNeeds],
    keep: &BTreeMap<String, Vec<u32>>,
    policy: &Policy,
) -> Option<Vec<Placement>> {
    let candidates: BTreeSet<&str> = needs
        .iter()
        .filter(|n| keep.get(&n.name).is_some_and(|g| keepable(n, g)))
        .map(|n| n.name.as_str())
        .collect();
    if candidates.is_empty() {
        return None;
    }
    if let Ok(placed) = place(machine, &pin_kept(needs, keep, &candidates), policy) {
        return Some(placed);
    }
    let mut kept = BTreeSet::new();
    for name in candidates {
        kept.insert(name);
        if place(machine, &pin_kept(needs, keep, &kept), policy).is_err() {
            tracing::info!(model = name, gpus = ?keep[name], "cannot keep a running model on its GPUs: placed afresh");
            kept.remove(name);
        }
    }
    if kept.is_empty() {
        return None;
    }
    place(machine, &pin_kept(needs, keep, &kept), policy).ok()
}

/// Placement errors as configuration problems: `model[i].KEY`.
fn refusal(config: &Config, errors: PlacementErrors) -> ConfigError {
    ConfigError {
        origin: config.origin.clone(),
        problems: errors
            .0
            .into_iter()
            .map(|e| {
                let i = config.models.iter().position(|m| m.name == e.model);
                Problem {
                    key: i.map_or_else(String::new, |i| format!("model[{i}].{}", e.key)),
                    message: e.to_string(),
                }
            })
            .collect(),
    }
}
