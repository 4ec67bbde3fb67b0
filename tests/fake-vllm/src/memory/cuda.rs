//! The real-GPU backend (feature `cuda`): `--gpu-memory BYTES` of device
//! memory on the first visible GPU, split into "weights" (a known pattern)
//! and "KV cache" (zeros). Sleep level 1 copies the weights to host memory
//! and frees the device memory; level 2 frees both; a wake copies the
//! weights back (level 1) or allocates fresh, garbage weights that
//! `reload_weights` refills (level 2). NVML sees the memory move, and wake
//! times are real PCIe copies.
//!
//! The weights' share of `--gpu-memory` is `FAKE_VLLM_GPU_WEIGHTS_FRACTION`
//! (default 0.5). libcuda is loaded at run time (cudarc); without it,
//! [`CudaMemory::new`] fails instead of panicking.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};

use super::{Level, Memory, MemoryError, Tags};

/// Host pattern chunk: a multiple of 251 so `i % 251` continues across chunks.
const CHUNK: usize = 251 << 18;
/// Bytes compared after a level-1 wake (a sample: the copy really came back).
const VERIFY: usize = 1 << 20;

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

fn dev(e: DriverError) -> MemoryError {
    MemoryError::Device(format!("{e:?}"))
}

struct Inner {
    weights: Option<CudaSlice<u8>>,
    kv: Option<CudaSlice<u8>>,
    /// The level-1 host copy.
    offloaded: Option<Vec<u8>>,
    /// Resident weights hold the pattern.
    intact: bool,
}

/// Device memory held as weights + KV cache; see the module docs.
pub struct CudaMemory {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    weight_bytes: usize,
    kv_bytes: usize,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaMemory")
            .field("device", &self.ctx.ordinal())
            .field("weight_bytes", &self.weight_bytes)
            .field("kv_bytes", &self.kv_bytes)
            .finish_non_exhaustive()
    }
}

impl CudaMemory {
    /// Allocate `total` bytes on CUDA device 0 (of `CUDA_VISIBLE_DEVICES`).
    pub fn new(total: u64) -> Result<CudaMemory, MemoryError> {
        let fraction = std::env::var("FAKE_VLLM_GPU_WEIGHTS_FRACTION")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|f| (0.0..=1.0).contains(f))
            .unwrap_or(0.5);
        let total = usize::try_from(total)
            .map_err(|_| MemoryError::Device("--gpu-memory too large".into()))?;
        let weight_bytes = (total as f64 * fraction) as usize;
        // cudarc panics where libcuda cannot be loaded: turn that into an error.
        let ctx = std::panic::catch_unwind(|| CudaContext::new(0))
            .map_err(|_| MemoryError::Device("libcuda could not be loaded".into()))?
            .map_err(dev)?;
        let stream = ctx.default_stream();
        let mem = CudaMemory {
            ctx,
            stream,
            weight_bytes,
            kv_bytes: total - weight_bytes,
            inner: Mutex::new(Inner {
                weights: None,
                kv: None,
                offloaded: None,
                intact: false,
            }),
        };
        {
            let mut m = mem.inner.lock().unwrap();
            let mut w = mem
                .stream
                .alloc_zeros::<u8>(mem.weight_bytes)
                .map_err(dev)?;
            mem.fill(&mut w)?;
            m.weights = Some(w);
            m.intact = true;
            m.kv = Some(mem.stream.alloc_zeros::<u8>(mem.kv_bytes).map_err(dev)?);
            mem.stream.synchronize().map_err(dev)?;
        }
        tracing::info!(
            device = mem.ctx.ordinal(),
            weight_bytes,
            kv_bytes = mem.kv_bytes,
            "holding real GPU memory"
        );
        Ok(mem)
    }

    /// Write the weight pattern into `w`, chunk by chunk.
    fn fill(&self, w: &mut CudaSlice<u8>) -> Result<(), MemoryError> {
        let chunk = pattern(CHUNK.min(self.weight_bytes));
        let mut at = 0;
        while at < self.weight_bytes {
            let n = CHUNK.min(self.weight_bytes - at);
            self.stream
                .memcpy_htod(&chunk[..n], &mut w.slice_mut(at..at + n))
                .map_err(dev)?;
            at += n;
        }
        self.stream.synchronize().map_err(dev)
    }

    /// Free device memory now; the default pool releases it to the driver
    /// at the next synchronisation (release threshold 0), so NVML sees it.
    fn release(&self, slice: Option<CudaSlice<u8>>) -> Result<(), MemoryError> {
        drop(slice);
        self.stream.synchronize().map_err(dev)
    }
}

impl Memory for CudaMemory {
    fn sleep(&self, level: Level) -> Result<(), MemoryError> {
        let mut m = self.inner.lock().unwrap();
        if let Some(w) = m.weights.take() {
            if level == Level::One {
                m.offloaded = Some(self.stream.clone_dtoh(&w).map_err(dev)?);
            } else {
                m.offloaded = None;
            }
            self.release(Some(w))?;
        }
        let kv = m.kv.take();
        self.release(kv)
    }

    fn wake(&self, tags: Tags) -> Result<(), MemoryError> {
        let mut m = self.inner.lock().unwrap();
        if tags.weights && m.weights.is_none() {
            match m.offloaded.take() {
                Some(host) => {
                    let w = self.stream.clone_htod(&host).map_err(dev)?;
                    let n = VERIFY.min(self.weight_bytes);
                    let back = self.stream.clone_dtoh(&w.slice(0..n)).map_err(dev)?;
                    m.intact = back == pattern(n);
                    if !m.intact {
                        tracing::error!("weights came back from host memory altered");
                    }
                    m.weights = Some(w);
                }
                None => {
                    // After level 2 nothing was kept: fresh memory, not the model.
                    m.weights = Some(
                        self.stream
                            .alloc_zeros::<u8>(self.weight_bytes)
                            .map_err(dev)?,
                    );
                    m.intact = self.weight_bytes == 0;
                }
            }
        }
        if tags.kv_cache && m.kv.is_none() {
            m.kv = Some(self.stream.alloc_zeros::<u8>(self.kv_bytes).map_err(dev)?);
        }
        self.stream.synchronize().map_err(dev)
    }

    fn reload_weights(&self) -> Result<(), MemoryError> {
        let mut m = self.inner.lock().unwrap();
        let Some(mut w) = m.weights.take() else {
            return Err(MemoryError::WeightsAsleep);
        };
        let r = self.fill(&mut w);
        m.weights = Some(w);
        r?;
        m.intact = true;
        Ok(())
    }

    fn weights_intact(&self) -> bool {
        let m = self.inner.lock().unwrap();
        m.weights.is_some() && m.intact
    }

    fn verify_all(&self) -> Result<bool, MemoryError> {
        let m = self.inner.lock().unwrap();
        let Some(w) = m.weights.as_ref() else {
            return Ok(false);
        };
        let chunk = pattern(CHUNK.min(self.weight_bytes));
        let mut at = 0;
        while at < self.weight_bytes {
            let n = CHUNK.min(self.weight_bytes - at);
            let back = self.stream.clone_dtoh(&w.slice(at..at + n)).map_err(dev)?;
            if back[..] != chunk[..n] {
                tracing::error!(offset = at, "weights differ from the pattern");
                return Ok(false);
            }
            at += n;
        }
        Ok(true)
    }

    fn device_bytes(&self) -> u64 {
        let m = self.inner.lock().unwrap();
        m.weights.as_ref().map_or(0, |w| w.len() as u64)
            + m.kv.as_ref().map_or(0, |k| k.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs where a GPU is present; elsewhere says so and passes.
    #[test]
    fn sleep_and_wake_move_real_memory() {
        let m = match CudaMemory::new(64 << 20) {
            Ok(m) => m,
            Err(e) => {
                eprintln!("skipped: no usable GPU ({e})");
                return;
            }
        };
        assert_eq!(m.device_bytes(), 64 << 20);
        m.sleep(Level::One).unwrap();
        assert_eq!(m.device_bytes(), 0);
        m.wake(Tags::ALL).unwrap();
        assert!(m.weights_intact());
        m.sleep(Level::Two).unwrap();
        m.wake(Tags {
            weights: true,
            kv_cache: false,
        })
        .unwrap();
        assert!(!m.weights_intact());
        m.reload_weights().unwrap();
        assert!(m.weights_intact());
    }
}
