//! Discovery through NVML (nvml-wrapper, libnvidia-ml loaded at run time).

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus, TopologyLevel};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

use super::{GpuInfo, GpuLinkInfo, GpuProcessInfo, LinkKind, sysfs};

/// Most NVLink links any GPU has (NVML_NVLINK_MAX_LINKS in current drivers).
const MAX_NVLINKS: u32 = 18;

/// How long what does not move on its own (names, PCI ids, IOMMU mode,
/// NVLinks, the links between GPU pairs) is kept between whole reads.
pub const FIXED_MAX_AGE: Duration = Duration::from_secs(60);

/// An initialised NVML.
#[derive(Debug)]
pub struct NvmlInventory {
    nvml: Nvml,
    sys_root: PathBuf,
    /// The last whole read, for the parts that stay put ([`FIXED_MAX_AGE`]).
    fixed: Mutex<Option<(Instant, Vec<GpuInfo>)>>,
}

/// Whether a whole read from `read_at` with `gpus` GPUs still stands for
/// the fixed parts of a read of `count` GPUs at `now` (a GPU gone or come
/// makes a whole read).
fn fixed_fresh(read_at: Instant, gpus: usize, count: u32, now: Instant) -> bool {
    gpus == count as usize && now.saturating_duration_since(read_at) < FIXED_MAX_AGE
}

/// NVML failed to load or answer.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct NvmlFailure {
    what: &'static str,
    #[source]
    source: NvmlError,
}

fn ctx<T>(what: &'static str, r: Result<T, NvmlError>) -> Result<T, NvmlFailure> {
    r.map_err(|source| NvmlFailure { what, source })
}

impl NvmlInventory {
    /// Load libnvidia-ml and initialise it. An error means "no NVML here".
    pub fn init() -> Result<Self, NvmlFailure> {
        let nvml = ctx("loading NVML", Nvml::init())?;
        Ok(Self {
            nvml,
            sys_root: PathBuf::from("/sys"),
            fixed: Mutex::new(None),
        })
    }

    /// Every GPU with memory, processes, IOMMU mode and links to the
    /// others: memory and processes read now, the rest from a whole read
    /// at most [`FIXED_MAX_AGE`] old. Admission reads this before every
    /// start or wake; the links of every GPU pair are most of a whole
    /// read's NVML calls (on 8 GPUs, 56 pairs of 5 calls, and 144 NVLink
    /// states), and they do not move.
    pub fn snapshot(&self) -> Result<Vec<GpuInfo>, NvmlFailure> {
        let count = ctx("device count", self.nvml.device_count())?;
        let fixed = self.fixed.lock().unwrap().clone();
        if let Some((read_at, fixed)) = fixed
            && fixed_fresh(read_at, fixed.len(), count, Instant::now())
        {
            return fixed
                .into_iter()
                .enumerate()
                .map(|(i, g)| self.live(i as u32, g))
                .collect();
        }
        let whole = self.whole()?;
        *self.fixed.lock().unwrap() = Some((Instant::now(), whole.clone()));
        Ok(whole)
    }

    /// `fixed` (GPU `i` of a whole read) with its memory and processes read now.
    fn live(&self, i: u32, mut fixed: GpuInfo) -> Result<GpuInfo, NvmlFailure> {
        let dev = ctx("device by index", self.nvml.device_by_index(i))?;
        let mem = ctx("memory info", dev.memory_info())?;
        fixed.memory_total_bytes = mem.total;
        fixed.memory_used_bytes = mem.used;
        fixed.processes = processes(&dev);
        Ok(fixed)
    }

    /// A whole read: every GPU, every part, every pair (blocking; what
    /// [`Self::snapshot`] does at most once a [`FIXED_MAX_AGE`]).
    pub fn whole(&self) -> Result<Vec<GpuInfo>, NvmlFailure> {
        let count = ctx("device count", self.nvml.device_count())?;
        let mut gpus = Vec::with_capacity(count as usize);
        for i in 0..count {
            let dev = ctx("device by index", self.nvml.device_by_index(i))?;
            let mem = ctx("memory info", dev.memory_info())?;
            let pci_bus_id = dev.pci_info().map(|p| p.bus_id).unwrap_or_default();
            let processes = processes(&dev);
            let nvlinks_active = (0..MAX_NVLINKS)
                .filter(|&l| dev.link_wrapper_for(l).is_active().unwrap_or(false))
                .count() as u32;
            let mut links = Vec::new();
            for j in 0..count {
                if j == i {
                    continue;
                }
                let peer = ctx("device by index", self.nvml.device_by_index(j))?;
                let over_nvlink = matches!(
                    dev.p2p_status(&peer, P2pCapabilitiesIndex::NvLink),
                    Ok(P2pStatus::Ok)
                );
                let kind = if over_nvlink {
                    LinkKind::NvLink
                } else {
                    dev.topology_common_ancestor(peer)
                        .map(link_kind)
                        .unwrap_or(LinkKind::Unknown)
                };
                let peer = ctx("device by index", self.nvml.device_by_index(j))?;
                let driver_p2p = match dev.p2p_status(&peer, P2pCapabilitiesIndex::Read) {
                    Ok(s) => p2p_status_str(s).to_string(),
                    Err(e) => format!("error: {e}"),
                };
                links.push(GpuLinkInfo {
                    peer: j,
                    kind,
                    driver_p2p,
                });
            }
            gpus.push(GpuInfo {
                index: dev.index().unwrap_or(i),
                uuid: dev.uuid().unwrap_or_default(),
                name: dev.name().unwrap_or_default(),
                memory_total_bytes: mem.total,
                memory_used_bytes: mem.used,
                iommu: sysfs::iommu_mode(&self.sys_root, &pci_bus_id),
                pci_bus_id,
                nvlinks_active,
                processes,
                links,
            });
        }
        Ok(gpus)
    }
}

/// The compute processes on `dev` and the memory each holds (none where
/// NVML will not say).
fn processes(dev: &nvml_wrapper::Device<'_>) -> Vec<GpuProcessInfo> {
    dev.running_compute_processes()
        .unwrap_or_default()
        .into_iter()
        .map(|p| GpuProcessInfo {
            pid: p.pid,
            used_bytes: match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => b,
                UsedGpuMemory::Unavailable => 0,
            },
        })
        .collect()
}

/// NVML's common ancestor as the link kinds placement ranks.
pub fn link_kind(level: TopologyLevel) -> LinkKind {
    match level {
        TopologyLevel::Internal | TopologyLevel::Single | TopologyLevel::Multiple => {
            LinkKind::SameSwitch
        }
        TopologyLevel::HostBridge | TopologyLevel::Node => LinkKind::SameCpu,
        TopologyLevel::System => LinkKind::CrossCpu,
    }
}

/// NVML's P2P status as a short word.
pub fn p2p_status_str(s: P2pStatus) -> &'static str {
    match s {
        P2pStatus::Ok => "ok",
        P2pStatus::ChipsetNotSupported => "chipset-not-supported",
        P2pStatus::GpuNotSupported => "gpu-not-supported",
        P2pStatus::IohTopologyNotSupported => "ioh-topology-not-supported",
        P2pStatus::DisabledByRegkey => "disabled-by-regkey",
        P2pStatus::NotSupported => "not-supported",
        P2pStatus::Unknown => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixed parts of a whole read stand for a minute, and only for as
    /// many GPUs as NVML counts now.
    #[test]
    fn a_whole_read_stands_for_a_minute_and_the_same_gpus() {
        let t = Instant::now();
        assert!(fixed_fresh(t, 8, 8, t));
        assert!(fixed_fresh(
            t,
            8,
            8,
            t + FIXED_MAX_AGE - Duration::from_millis(1)
        ));
        assert!(!fixed_fresh(t, 8, 8, t + FIXED_MAX_AGE));
        assert!(!fixed_fresh(t, 8, 7, t), "a GPU gone");
        assert!(!fixed_fresh(t, 1, 2, t), "a GPU come");
    }

    #[test]
    fn topology_levels_map_to_link_kinds() {
        assert_eq!(link_kind(TopologyLevel::Single), LinkKind::SameSwitch);
        assert_eq!(link_kind(TopologyLevel::Multiple), LinkKind::SameSwitch);
        assert_eq!(link_kind(TopologyLevel::HostBridge), LinkKind::SameCpu);
        assert_eq!(link_kind(TopologyLevel::Node), LinkKind::SameCpu);
        assert_eq!(link_kind(TopologyLevel::System), LinkKind::CrossCpu);
    }

    #[test]
    fn init_without_nvml_is_an_error_not_a_panic() {
        // On a machine with NVML this succeeds; either way it must not panic.
        match NvmlInventory::init() {
            Ok(inv) => {
                let gpus = inv.snapshot().unwrap();
                assert!(gpus.iter().all(|g| g.memory_total_bytes > 0));
            }
            Err(e) => assert!(e.to_string().starts_with("loading NVML")),
        }
    }
}
