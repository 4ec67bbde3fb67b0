//! Where the model's "weights" and "KV cache" live, and what sleep and wake do to them.
//!
//! The engine only talks to [`Memory`]. The [`host`] backend keeps a small weight pattern in
//! ordinary memory; a real-GPU backend (`memory/cuda.rs`, behind the `cuda` feature, sized by
//! `--gpu-memory BYTES`) plugs in through [`from_settings`] without touching the engine.
//! Whether answers are correct is decided by [`Memory::weights_intact`], so a level-2 wake
//! without `reload_weights` answers garbage in every backend.

#[cfg(feature = "cuda")]
mod cuda;
mod host;

#[cfg(feature = "cuda")]
pub use cuda::CudaMemory;
pub use host::HostMemory;

/// Sleep level, as in `POST /sleep?level=N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Weights offloaded to CPU memory, KV cache discarded.
    One,
    /// Weights and KV cache discarded.
    Two,
}

/// What a wake restores (`POST /wake_up?tags=...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tags {
    /// `tags=weights`.
    pub weights: bool,
    /// `tags=kv_cache`.
    pub kv_cache: bool,
}

impl Tags {
    /// Every tag (a wake without `tags`).
    pub const ALL: Tags = Tags {
        weights: true,
        kv_cache: true,
    };
}

/// Errors of a memory backend.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The operation needs the weights to be resident.
    #[error("the weights are not resident (asleep)")]
    WeightsAsleep,
    /// A device error from a real backend.
    #[error("device memory: {0}")]
    Device(String),
}

/// A memory backend. Calls are short and may block (a GPU copy); the engine serializes them.
pub trait Memory: Send + Sync + std::fmt::Debug {
    /// Frees device memory for `level`: level 1 keeps a host copy of the weights.
    fn sleep(&self, level: Level) -> Result<(), MemoryError>;
    /// Re-allocates what `tags` name; weights come back from the host copy after level 1, and
    /// as garbage after level 2.
    fn wake(&self, tags: Tags) -> Result<(), MemoryError>;
    /// Loads the weights again from "disk" (`collective_rpc reload_weights`).
    fn reload_weights(&self) -> Result<(), MemoryError>;
    /// Whether resident weights hold the model (false after a level-2 wake without reload).
    fn weights_intact(&self) -> bool;
    /// Bytes currently held on the device (for `/fake/stats`).
    fn device_bytes(&self) -> u64;
    /// Reads every resident weight byte back and compares it with the pattern (`GET
    /// /fake/verify`: after a CUDA checkpoint and restore). Default: the recorded flag.
    fn verify_all(&self) -> Result<bool, MemoryError> {
        Ok(self.weights_intact())
    }
}

/// Chooses the backend: the host one unless a real-GPU backend is compiled in and
/// `--gpu-memory` asks for it.
pub fn from_settings(gpu_memory: Option<u64>) -> Result<Box<dyn Memory>, MemoryError> {
    #[cfg(feature = "cuda")]
    if let Some(bytes) = gpu_memory {
        return Ok(Box::new(CudaMemory::new(bytes)?));
    }
    if let Some(bytes) = gpu_memory {
        tracing::warn!(
            bytes,
            "--gpu-memory needs the `cuda` feature; using host memory"
        );
    }
    Ok(Box::new(HostMemory::new(host::DEFAULT_WEIGHT_BYTES)))
}
