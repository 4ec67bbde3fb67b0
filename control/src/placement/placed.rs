//! What a model task is told about its GPUs ([`Placed`]), and the one place
//! where that becomes the engine's GPU arguments and environment.

use super::Placement;
use crate::config::{GpuMemory, ModelConfig};

/// Where a model runs: placement's answer, as its task keeps it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Placed {
    pub gpus: Vec<u32>,
    /// NCCL P2P off and no custom all-reduce (a pair is not known `ok`).
    pub p2p_disabled: bool,
    /// `--gpu-memory-utilization` (0: not passed, vLLM's default applies).
    pub gpu_memory_utilization: f64,
}

impl Placed {
    /// `vllm serve` arguments siesta adds for the GPUs: the tensor-parallel
    /// size (when above 1), the memory fraction, the all-reduce switch.
    pub fn engine_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if self.gpus.len() > 1 {
            args.extend([
                "--tensor-parallel-size".to_string(),
                self.gpus.len().to_string(),
            ]);
        }
        if !self.gpus.is_empty() && self.gpu_memory_utilization > 0.0 {
            args.extend([
                "--gpu-memory-utilization".to_string(),
                format!("{}", self.gpu_memory_utilization),
            ]);
        }
        if self.p2p_disabled {
            args.push("--disable-custom-all-reduce".to_string());
        }
        args
    }

    /// Environment siesta sets for the GPUs. Indices are NVML's (PCI bus
    /// order), hence `CUDA_DEVICE_ORDER=PCI_BUS_ID`.
    pub fn engine_env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        if !self.gpus.is_empty() {
            let ids: Vec<String> = self.gpus.iter().map(u32::to_string).collect();
            env.push(("CUDA_DEVICE_ORDER".to_string(), "PCI_BUS_ID".to_string()));
            env.push(("CUDA_VISIBLE_DEVICES".to_string(), ids.join(",")));
        }
        if self.p2p_disabled {
            env.push(("NCCL_P2P_DISABLE".to_string(), "1".to_string()));
        }
        env
    }
}

impl Placement {
    /// What the model's task is told.
    pub fn placed(&self) -> Placed {
        Placed {
            gpus: self.gpus.clone(),
            p2p_disabled: self.p2p_disabled,
            gpu_memory_utilization: self.gpu_memory_utilization,
        }
    }
}

/// Where a model runs when no inventory is known (no NVML, no `[[gpu]]`):
/// its pinned GPUs, or the first `gpus` indices, with its `gpu_memory`
/// fraction if it has one.
pub fn default_placement(m: &ModelConfig) -> Placed {
    let gpus = if !m.gpu_ids.is_empty() {
        m.gpu_ids.clone()
    } else {
        (0..m.gpus).collect()
    };
    let gpu_memory_utilization = match m.gpu_memory {
        Some(GpuMemory::Fraction(f)) => f,
        _ => 0.0,
    };
    Placed {
        gpus,
        p2p_disabled: false,
        gpu_memory_utilization,
    }
}
