//! A configuration's placement: the one function the daemon (at start and
//! on reload) and `siesta config check` call, so they refuse the same
//! configurations with the same message (`FILE: model[i].KEY: model "NAME":
//! ...` with the arithmetic).

use std::collections::BTreeMap;

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

/// Placement's knobs from `[control]`.
pub fn policy_of(config: &Config) -> Policy {
    Policy {
        residual_bytes: config
            .control
            .asleep_residual
            .unwrap_or(super::DEFAULT_RESIDUAL_BYTES),
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
/// `keep`: GPUs models already run on (a reload): each model whose needs
/// allow it is kept there if the whole configuration still fits that way;
/// otherwise everything is placed afresh.
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
    if !keep.is_empty() {
        let kept: Vec<ModelNeeds> = needs
            .iter()
            .map(|n| match keep.get(&n.name) {
                Some(g) if n.pinned_gpus.is_empty() && g.len() == n.gpus as usize => ModelNeeds {
                    pinned_gpus: g.clone(),
                    ..n.clone()
                },
                _ => n.clone(),
            })
            .collect();
        if let Ok(mut placed) = place(machine, &kept, &policy) {
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
    }
    place(machine, &needs, &policy)
        .map(Planned::Placed)
        .map_err(|e| refusal(config, e))
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
