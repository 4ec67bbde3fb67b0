//! A simulated GPU shared by every fake engine on the machine, so that memory runs out as it
//! does under vLLM: start-up needs `--gpu-memory-utilization` x total free on each GPU, and a
//! wake needs room for what it allocates again.
//!
//! On only when `FAKE_VLLM_GPU_TOTAL_BYTES` (`--sim-gpu-total-bytes`) and `FAKE_VLLM_GPU_DIR`
//! (`--sim-gpu-dir`) are set. GPUs are the ids in `CUDA_VISIBLE_DEVICES` (default `0`). Each
//! live engine records its use of GPU `ID` in `DIR/gpu-ID/PID` (bytes, decimal), PID being the
//! process that holds the memory: the engine core, which outlives a SIGKILLed server as in
//! vLLM. Entries of dead processes are ignored.

use std::path::{Path, PathBuf};

use crate::cli::ServeArgs;

/// Errors of the simulated GPU, worded like vLLM's and PyTorch's.
#[derive(Debug, thiserror::Error)]
pub enum SimGpuError {
    /// Start-up: less free memory than `--gpu-memory-utilization` asks for.
    #[error(
        "ValueError: Free memory on device cuda:{gpu} ({free:.2}/{total:.2} GiB) on startup is \
         less than desired GPU memory utilization ({fraction}, {want:.2} GiB). Decrease GPU \
         memory utilization or reduce GPU memory used by other processes."
    )]
    Startup {
        /// GPU id.
        gpu: String,
        /// Free GiB.
        free: f64,
        /// Total GiB.
        total: f64,
        /// `--gpu-memory-utilization`.
        fraction: f64,
        /// GiB wanted.
        want: f64,
    },
    /// A wake could not allocate.
    #[error(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {want:.2} GiB. GPU {gpu} \
         has a total capacity of \
         {total:.2} GiB of which {free:.2} GiB is free."
    )]
    OutOfMemory {
        /// GPU id.
        gpu: String,
        /// GiB wanted.
        want: f64,
        /// Total GiB.
        total: f64,
        /// Free GiB.
        free: f64,
    },
    /// Start-up: another process freed GPU memory while this engine profiled its memory
    /// (vLLM's `determine_available_memory` asserts that free memory did not grow since
    /// `init_device`; with a small model almost any memory a neighbour frees trips it).
    #[error(
        "AssertionError: Error in memory profiling. Initial free memory {before:.2} GiB, current \
         free memory {now:.2} GiB. This happens when other processes sharing the same container \
         release GPU memory while vLLM is profiling during initialization."
    )]
    Profiling {
        /// Free GiB (apart from this engine's own) when start-up began.
        before: f64,
        /// Free GiB (apart from this engine's own) when profiling ended.
        now: f64,
    },
    /// The accounting directory could not be read or written.
    #[error("simulated GPU accounting {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

const GIB: f64 = (1u64 << 30) as f64;

/// The name's suffix of an entry a CUDA checkpoint set aside (not counted: the memory is free).
const CHECKPOINTED: &str = ".checkpointed";

/// GPU ids from `CUDA_VISIBLE_DEVICES` (default `0`).
fn gpus_of(visible: &str) -> Vec<String> {
    let mut gpus: Vec<String> = visible
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    if gpus.is_empty() {
        gpus.push("0".into());
    }
    gpus
}

/// This engine's view of the simulated GPUs.
#[derive(Debug)]
pub struct SimGpu {
    dir: PathBuf,
    total: u64,
    gpus: Vec<String>,
}

/// Whether `pid` is a live (non-zombie) process.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, r)| r.trim_start().chars().next())
        })
        .is_some_and(|state| state != 'Z' && state != 'X')
}

impl SimGpu {
    /// The simulated GPUs, when configured.
    pub fn from_args(args: &ServeArgs) -> Option<SimGpu> {
        let (Some(total), Some(dir)) = (args.sim.sim_gpu_total_bytes, &args.sim.sim_gpu_dir) else {
            return None;
        };
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
        Some(SimGpu {
            dir: dir.clone(),
            total,
            gpus: gpus_of(&visible),
        })
    }

    /// The simulated GPUs process `pid` was started with (its environment's
    /// `FAKE_VLLM_GPU_TOTAL_BYTES`, `FAKE_VLLM_GPU_DIR` and `CUDA_VISIBLE_DEVICES`): what the
    /// fake CUDA checkpoint helper frees and takes again. None when it has none.
    pub fn of_process(pid: u32) -> Option<SimGpu> {
        let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let var = |name: &str| {
            env.split(|b| *b == 0).find_map(|kv| {
                kv.strip_prefix(format!("{name}=").as_bytes())
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            })
        };
        Some(SimGpu {
            dir: PathBuf::from(var("FAKE_VLLM_GPU_DIR")?),
            total: var("FAKE_VLLM_GPU_TOTAL_BYTES")?.parse().ok()?,
            gpus: gpus_of(&var("CUDA_VISIBLE_DEVICES").unwrap_or_default()),
        })
    }

    /// A CUDA checkpoint of `holder`: its memory on every GPU is free until
    /// [`SimGpu::restore`] (its entry is set aside). False when it held none.
    pub fn checkpoint(&self, holder: u32) -> Result<bool, SimGpuError> {
        let _taking = self.lock()?;
        let mut held = false;
        for gpu in &self.gpus {
            let dir = self.gpu_dir(gpu);
            let entry = dir.join(holder.to_string());
            if entry.exists() {
                let aside = dir.join(format!("{holder}{CHECKPOINTED}"));
                std::fs::rename(&entry, &aside).map_err(|e| Self::io(&aside, e))?;
                held = true;
            }
        }
        Ok(held)
    }

    /// The restore of a checkpointed `holder`: its memory is taken again on every GPU, out
    /// of memory (nothing taken) when others took the room meanwhile.
    pub fn restore(&self, holder: u32) -> Result<(), SimGpuError> {
        let _taking = self.lock()?;
        let aside = |gpu: &str| self.gpu_dir(gpu).join(format!("{holder}{CHECKPOINTED}"));
        for gpu in &self.gpus {
            let Ok(text) = std::fs::read_to_string(aside(gpu)) else {
                continue;
            };
            let want = text.trim().parse::<u64>().unwrap_or(0);
            let free = self.total.saturating_sub(self.used_by_others(gpu, holder)?);
            if free < want {
                return Err(SimGpuError::OutOfMemory {
                    gpu: gpu.clone(),
                    want: want as f64 / GIB,
                    total: self.total as f64 / GIB,
                    free: free as f64 / GIB,
                });
            }
        }
        for gpu in &self.gpus {
            let from = aside(gpu);
            if from.exists() {
                let to = self.gpu_dir(gpu).join(holder.to_string());
                std::fs::rename(&from, &to).map_err(|e| Self::io(&to, e))?;
            }
        }
        Ok(())
    }

    /// Bytes per GPU.
    pub fn total(&self) -> u64 {
        self.total
    }

    fn gpu_dir(&self, gpu: &str) -> PathBuf {
        self.dir.join(format!("gpu-{gpu}"))
    }

    fn io(path: &Path, source: std::io::Error) -> SimGpuError {
        SimGpuError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// Bytes of `gpu` used by live processes other than `holder`.
    fn used_by_others(&self, gpu: &str, holder: u32) -> Result<u64, SimGpuError> {
        let dir = self.gpu_dir(gpu);
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(Self::io(&dir, e)),
        };
        let mut used = 0u64;
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if pid == holder || !alive(pid) {
                continue;
            }
            let bytes = std::fs::read_to_string(entry.path())
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .unwrap_or(0);
            used = used.saturating_add(bytes);
        }
        Ok(used)
    }

    /// Start-up check: every GPU must have `fraction` x total free. Returns the bytes wanted,
    /// which the engine takes only when its start-up ends ([`SimGpu::grow`]): as in vLLM
    /// (vllm#55827), engines starting at the same time do not see each other.
    pub fn check(&self, holder: u32, fraction: f64) -> Result<u64, SimGpuError> {
        let want = (fraction * self.total as f64) as u64;
        for gpu in &self.gpus {
            let free = self.total.saturating_sub(self.used_by_others(gpu, holder)?);
            if free < want {
                return Err(SimGpuError::Startup {
                    gpu: gpu.clone(),
                    free: free as f64 / GIB,
                    total: self.total as f64 / GIB,
                    fraction,
                    want: want as f64 / GIB,
                });
            }
        }
        Ok(want)
    }

    /// Bytes each GPU holds for other live processes now: the snapshot vLLM takes when its
    /// start-up begins (`init_device`), compared by [`SimGpu::profiled`] when profiling ends.
    pub fn others(&self, holder: u32) -> Result<Vec<u64>, SimGpuError> {
        self.gpus
            .iter()
            .map(|g| self.used_by_others(g, holder))
            .collect()
    }

    /// End of memory profiling: an error when another process freed memory on any GPU since
    /// `before` ([`SimGpu::others`]), as vLLM's assertion fails then.
    pub fn profiled(&self, holder: u32, before: &[u64]) -> Result<(), SimGpuError> {
        for (gpu, was) in self.gpus.iter().zip(before) {
            let now = self.used_by_others(gpu, holder)?;
            if now < *was {
                return Err(SimGpuError::Profiling {
                    before: self.total.saturating_sub(*was) as f64 / GIB,
                    now: self.total.saturating_sub(now) as f64 / GIB,
                });
            }
        }
        Ok(())
    }

    /// An exclusive lock on the simulated GPUs (`flock` on `DIR/.lock`, released on drop):
    /// one engine's look at the free memory and its taking it are one step for every
    /// engine sharing them, as the CUDA allocator's are.
    fn lock(&self) -> Result<nix::fcntl::Flock<std::fs::File>, SimGpuError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| Self::io(&self.dir, e))?;
        let path = self.dir.join(".lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| Self::io(&path, e))?;
        nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, errno)| Self::io(&path, errno.into()))
    }

    /// Grows this engine's use from `from` to `to` bytes per GPU: out of memory when another
    /// engine took the room meanwhile (two engines growing at once are taken in turn).
    pub fn grow(&self, holder: u32, from: u64, to: u64) -> Result<(), SimGpuError> {
        let _taking = self.lock()?;
        if to > from {
            for gpu in &self.gpus {
                let free = self
                    .total
                    .saturating_sub(self.used_by_others(gpu, holder)?)
                    .saturating_sub(from);
                if free < to - from {
                    return Err(SimGpuError::OutOfMemory {
                        gpu: gpu.clone(),
                        want: (to - from) as f64 / GIB,
                        total: self.total as f64 / GIB,
                        free: free as f64 / GIB,
                    });
                }
            }
        }
        self.record(holder, to)
    }

    /// Records `bytes` per GPU as used by `holder` (atomically: write, then rename).
    pub fn record(&self, holder: u32, bytes: u64) -> Result<(), SimGpuError> {
        for gpu in &self.gpus {
            let dir = self.gpu_dir(gpu);
            std::fs::create_dir_all(&dir).map_err(|e| Self::io(&dir, e))?;
            let tmp = dir.join(format!(".{holder}.tmp"));
            std::fs::write(&tmp, bytes.to_string()).map_err(|e| Self::io(&tmp, e))?;
            let path = dir.join(holder.to_string());
            std::fs::rename(&tmp, &path).map_err(|e| Self::io(&path, e))?;
        }
        Ok(())
    }

    /// Forgets `holder` (clean shutdown).
    pub fn release(&self, holder: u32) {
        for gpu in &self.gpus {
            let _ = std::fs::remove_file(self.gpu_dir(gpu).join(holder.to_string()));
        }
    }

    /// Bytes used on each GPU by every live engine (for `/fake/stats`).
    pub fn used(&self) -> Vec<(String, u64)> {
        self.gpus
            .iter()
            .map(|g| (g.clone(), self.used_by_others(g, 0).unwrap_or(0)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(dir: &Path) -> SimGpu {
        SimGpu {
            dir: dir.to_path_buf(),
            total: 10 << 30,
            gpus: vec!["0".into(), "3".into()],
        }
    }

    /// Memory another engine frees between the start of start-up and the end of profiling
    /// fails the start, as vLLM's profiling assertion does; memory taken meanwhile does not.
    #[test]
    fn memory_freed_by_another_engine_during_start_up_fails_profiling() {
        let dir = std::env::temp_dir().join(format!("fake-vllm-profile-{}", std::process::id()));
        let g = gpu(&dir);
        let me = std::process::id();
        // The test process's parent stands in for a live neighbour holding 4 GiB.
        let other = std::os::unix::process::parent_id();
        g.record(other, 4 << 30).unwrap();
        let before = g.others(me).unwrap();
        assert_eq!(before, vec![4 << 30, 4 << 30]);
        g.record(other, 6 << 30).unwrap();
        assert!(g.profiled(me, &before).is_ok());
        g.record(other, 1 << 30).unwrap();
        let e = g.profiled(me, &before).unwrap_err().to_string();
        assert!(
            e.starts_with("AssertionError: Error in memory profiling. Initial free memory 6.00 GiB, current free memory 9.00 GiB."),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A CUDA checkpoint frees the engine's memory; its restore takes it again, or fails out
    /// of memory (taking nothing) when another engine took the room meanwhile.
    #[test]
    fn a_checkpoint_frees_memory_and_a_restore_needs_it_back() {
        let dir = std::env::temp_dir().join(format!("fake-vllm-ckpt-{}", std::process::id()));
        let g = gpu(&dir);
        let me = std::process::id();
        let other = std::os::unix::process::parent_id();
        g.grow(me, 0, 6 << 30).unwrap();
        assert!(g.checkpoint(me).unwrap());
        assert_eq!(g.used(), vec![("0".into(), 0), ("3".into(), 0)]);
        g.record(other, 5 << 30).unwrap();
        let e = g.restore(me).unwrap_err().to_string();
        assert!(
            e.starts_with("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.00 GiB"),
            "{e}"
        );
        assert_eq!(g.used(), vec![("0".into(), 5 << 30), ("3".into(), 5 << 30)]);
        g.record(other, 4 << 30).unwrap();
        g.restore(me).unwrap();
        assert_eq!(
            g.used(),
            vec![("0".into(), 10 << 30), ("3".into(), 10 << 30)]
        );
        assert!(!g.checkpoint(other + 1_000_000).unwrap(), "held nothing");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn start_checks_free_memory_and_dead_holders_are_ignored() {
        let dir = std::env::temp_dir().join(format!("fake-vllm-simgpu-{}", std::process::id()));
        let g = gpu(&dir);
        let me = std::process::id();
        assert_eq!(g.check(me, 0.5).unwrap(), 5 << 30);
        // Until it is taken, another engine sees the memory free.
        assert!(g.check(1, 0.6).is_ok());
        g.grow(me, 0, 5 << 30).unwrap();
        // Another engine wanting 60% does not fit beside this one.
        let e = g.check(1, 0.6).unwrap_err();
        assert!(
            e.to_string()
                .contains("Free memory on device cuda:0 (5.00/10.00 GiB)"),
            "{e}"
        );
        // pid 1's entry is live (init); a dead pid's entry counts for nothing.
        g.record(u32::MAX - 1, 9 << 30).unwrap();
        assert_eq!(g.used(), vec![("0".into(), 5 << 30), ("3".into(), 5 << 30)]);
        assert!(g.grow(me, 5 << 30, 10 << 30).is_ok());
        g.record(1, 1 << 30).unwrap();
        let e = g.grow(me, 1 << 30, 10 << 30).unwrap_err();
        assert!(
            e.to_string().starts_with(
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 9.00 GiB"
            ),
            "{e}"
        );
        g.release(me);
        g.release(1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
