//! The engine's use of the simulated GPU ([`crate::sim_gpu`]): taken at start-up, shrunk to
//! the residual by a sleep, grown again (or out of memory) by a wake.

use std::sync::atomic::Ordering;

use super::{Engine, SleepState};
use crate::sim_gpu::SimGpuError;

impl Engine {
    /// Bytes per GPU the simulated GPU holds for state `st`: all of `--gpu-memory-utilization`
    /// awake (or without sleep mode), the residual asleep, half the rest per woken tag.
    pub(super) fn gpu_usage(&self, st: SleepState) -> u64 {
        let Some(gpu) = &self.gpu else { return 0 };
        let full = (self.args.gpu_memory_utilization * gpu.total() as f64) as u64;
        if !self.args.enable_sleep_mode {
            return full;
        }
        let residual = self.args.asleep_residual_bytes().min(full);
        let weights = (full - residual) / 2;
        residual
            + if st.weights_asleep { 0 } else { weights }
            + if st.kv_asleep {
                0
            } else {
                full - residual - weights
            }
    }

    pub(super) fn set_gpu_usage(&self, to: u64, grow: bool) -> Result<(), SimGpuError> {
        let Some(gpu) = &self.gpu else { return Ok(()) };
        let holder = self.gpu_holder.load(Ordering::SeqCst);
        let from = self.gpu_bytes.load(Ordering::SeqCst);
        if grow {
            gpu.grow(holder, from, to)?;
        } else {
            gpu.record(holder, to)?;
        }
        self.gpu_bytes.store(to, Ordering::SeqCst);
        Ok(())
    }

    /// Start-up check on the simulated GPU: enough free memory. Returns the bytes to take
    /// when start-up ends ([`Engine::take_gpu`]).
    pub fn check_gpu(&self) -> Result<u64, SimGpuError> {
        let Some(gpu) = &self.gpu else { return Ok(0) };
        gpu.check(
            self.gpu_holder.load(Ordering::SeqCst),
            self.args.gpu_memory_utilization,
        )
    }

    /// What other processes hold on the simulated GPUs as start-up begins (empty without
    /// one), for [`Engine::profiled`].
    pub fn gpu_others(&self) -> Result<Vec<u64>, SimGpuError> {
        let Some(gpu) = &self.gpu else {
            return Ok(Vec::new());
        };
        gpu.others(self.gpu_holder.load(Ordering::SeqCst))
    }

    /// End of memory profiling: fails when another process freed GPU memory since `before`.
    pub fn profiled(&self, before: &[u64]) -> Result<(), SimGpuError> {
        let Some(gpu) = &self.gpu else { return Ok(()) };
        gpu.profiled(self.gpu_holder.load(Ordering::SeqCst), before)
    }

    /// End of start-up: takes `bytes` per GPU (weights, then the KV cache); out of memory
    /// when an engine that started at the same time took the room first.
    pub fn take_gpu(&self, bytes: u64) -> Result<(), SimGpuError> {
        self.set_gpu_usage(bytes, true)
    }

    /// Gives the simulated GPU memory back (clean shutdown).
    pub fn release_gpu(&self) {
        if let Some(gpu) = &self.gpu {
            gpu.release(self.gpu_holder.load(Ordering::SeqCst));
        }
    }
}
