//! Discovery through NVML (nvml-wrapper, libnvidia-ml loaded at run time).

use std::path::PathBuf;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus, TopologyLevel};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

use super::{GpuInfo, GpuLinkInfo, GpuProcessInfo, LinkKind, sysfs};

/// Most NVLink links any GPU has (NVML_NVLINK_MAX_LINKS in current drivers).
const MAX_NVLINKS: u32 = 18;

/// An initialised NVML.
#[derive(Debug)]
pub struct NvmlInventory {
    nvml: Nvml,
    sys_root: PathBuf,
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
        })
    }

    /// Every GPU with memory, processes, IOMMU mode and links to the others.
    pub fn snapshot(&self) -> Result<Vec<GpuInfo>, NvmlFailure> {
        let count = ctx("device count", self.nvml.device_count())?;
        let mut gpus = Vec::with_capacity(count as usize);
        for i in 0..count {
            let dev = ctx("device by index", self.nvml.device_by_index(i))?;
            let mem = ctx("memory info", dev.memory_info())?;
            let pci_bus_id = dev.pci_info().map(|p| p.bus_id).unwrap_or_default();
            let processes = dev
                .running_compute_processes()
                .unwrap_or_default()
                .into_iter()
                .map(|p| GpuProcessInfo {
                    pid: p.pid,
                    used_bytes: match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => b,
                        UsedGpuMemory::Unavailable => 0,
                    },
                })
                .collect();
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
