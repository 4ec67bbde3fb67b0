//! What the GPU view reports (ListGpus, GetPlacement, DiagP2p, and the
//! Watch stream's GPU and placement events), as domain types: the prost
//! conversions live in `api::convert`.

use crate::gpu::p2p::P2pResult;
use crate::gpu::{GpuInfo, InventorySource};
use crate::placement::GpuBudget;
use crate::status::Residual;
use std::collections::BTreeMap;

/// The inventory, with the model each GPU process belongs to.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuList {
    pub gpus: Vec<GpuInfo>,
    /// pid → model, for the GPU processes that are siesta's engines.
    pub owners: BTreeMap<u32, String>,
    pub source: InventorySource,
    pub p2p: Vec<P2pResult>,
    pub p2p_probed_unix_ms: i64,
    /// Why the inventory is not NVML's, or is an older read (see
    /// [`crate::gpu::Inventory::note`]).
    pub note: Option<String>,
}

/// Where one model runs and why.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ModelPlacement {
    pub model: String,
    pub gpus: Vec<u32>,
    pub awake_bytes_per_gpu: u64,
    pub gpu_memory_utilization: f64,
    pub p2p_disabled: bool,
    pub reason: String,
    pub exclusive: bool,
    pub asleep_residual: Residual,
}

/// Every model's placement and every GPU's budget.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PlacementReport {
    pub models: Vec<ModelPlacement>,
    pub gpus: Vec<GpuBudget>,
}

/// A P2P probe run on demand: its results, or why it did not run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct P2pDiag {
    pub results: Vec<P2pResult>,
    pub probed_unix_ms: i64,
    /// Empty when the probe ran.
    pub message: String,
    /// The probe should have run (two GPUs or more) but could not.
    pub failed: bool,
}
