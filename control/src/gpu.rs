//! GPU inventory: what GPUs the box has, how they are connected, and who uses
//! their memory.
//!
//! The inventory comes from NVML (loaded at run time through nvml-wrapper, so
//! the same binary runs on machines without a GPU) or, where NVML is missing,
//! from the `[[gpu]]` list in the config ([`GpuSpec`]). These are domain
//! types; [`convert`] turns them into `siesta_proto::v1` messages.
//!
//! NVML calls block: call [`GpuSource::snapshot`] from `spawn_blocking`.

pub mod nvml;
pub mod p2p;
pub mod sysfs;

use serde::{Deserialize, Serialize};

/// One GPU listed by hand in the config (`[[gpu]]`), for machines without NVML.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSpec {
    pub index: u32,
    pub name: String,
    pub memory_bytes: u64,
}

/// Where an [`Inventory`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InventorySource {
    /// Discovered through NVML.
    Nvml,
    /// The `[[gpu]]` list of the config.
    Config,
    /// Neither: the box has no GPUs siesta knows of.
    None,
}

/// A snapshot of the box's GPUs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Inventory {
    pub source: InventorySource,
    pub gpus: Vec<GpuInfo>,
    /// Why NVML was not used (or what failed while reading it), if anything.
    pub note: Option<String>,
}

impl Inventory {
    /// The GPU with this index.
    pub fn gpu(&self, index: u32) -> Option<&GpuInfo> {
        self.gpus.iter().find(|g| g.index == index)
    }
}

/// One GPU as the inventory sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total_bytes: u64,
    pub memory_used_bytes: u64,
    /// PCI bus id as NVML prints it, e.g. "00000000:18:00.0" ("" from config).
    pub pci_bus_id: String,
    pub iommu: IommuMode,
    pub nvlinks_active: u32,
    pub processes: Vec<GpuProcessInfo>,
    /// Topology to each other GPU.
    pub links: Vec<GpuLinkInfo>,
}

impl GpuInfo {
    /// A GPU from the config: no processes, links or IOMMU information.
    pub fn from_spec(spec: &GpuSpec) -> Self {
        Self {
            index: spec.index,
            uuid: String::new(),
            name: spec.name.clone(),
            memory_total_bytes: spec.memory_bytes,
            memory_used_bytes: 0,
            pci_bus_id: String::new(),
            iommu: IommuMode::Unknown,
            nvlinks_active: 0,
            processes: Vec::new(),
            links: Vec::new(),
        }
    }
}

/// A compute process on a GPU and the memory NVML accounts to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcessInfo {
    pub pid: u32,
    pub used_bytes: u64,
}

/// The IOMMU mode of a GPU's group, from `/sys/bus/pci/devices/<bdf>/iommu_group/type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IommuMode {
    /// `DMA` or `DMA-FQ`: every peer write crosses address translation.
    Translated,
    /// `identity`: passthrough.
    Identity,
    /// `blocked`.
    Blocked,
    /// sysfs does not say (no IOMMU group, a VM, no sysfs).
    Unknown,
}

impl IommuMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Translated => "translated",
            Self::Identity => "identity",
            Self::Blocked => "blocked",
            Self::Unknown => "unknown",
        }
    }
}

/// How two GPUs are connected, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkKind {
    #[serde(rename = "nvlink")]
    NvLink,
    SameSwitch,
    SameCpu,
    CrossCpu,
    Unknown,
}

impl LinkKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NvLink => "nvlink",
            Self::SameSwitch => "same-switch",
            Self::SameCpu => "same-cpu",
            Self::CrossCpu => "cross-cpu",
            Self::Unknown => "unknown",
        }
    }
}

/// Topology from one GPU to a peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLinkInfo {
    pub peer: u32,
    pub kind: LinkKind,
    /// What the driver claims (NVML p2p status for reads): "ok",
    /// "not-supported", ... Recorded, never trusted alone.
    pub driver_p2p: String,
}

/// Where GPU snapshots come from: an initialised NVML, or the config's list.
#[derive(Debug)]
pub enum GpuSource {
    Nvml(Box<nvml::NvmlInventory>),
    Config {
        specs: Vec<GpuSpec>,
        note: Option<String>,
    },
    /// Tests: reads as NVML would, what the test last put here.
    #[cfg(test)]
    Scripted(std::sync::Arc<std::sync::Mutex<Vec<GpuInfo>>>),
}

impl GpuSource {
    /// Initialise NVML; without it (no library, no driver), fall back to the
    /// config's `[[gpu]]` list. Never fails: a missing NVML is not an error.
    pub fn detect(fallback: &[GpuSpec]) -> Self {
        match nvml::NvmlInventory::init() {
            Ok(inv) => Self::Nvml(Box::new(inv)),
            Err(e) => {
                tracing::info!(error = %e, configured = fallback.len(), "NVML not available; using the configured GPU list");
                Self::Config {
                    specs: fallback.to_vec(),
                    note: Some(format!("NVML not available: {e}")),
                }
            }
        }
    }

    /// Only the config's list, without trying NVML (tests, `gpus = 0` demos).
    pub fn from_config(specs: &[GpuSpec]) -> Self {
        Self::Config {
            specs: specs.to_vec(),
            note: None,
        }
    }

    /// Whether a snapshot reads the GPUs now (NVML), not a fixed list.
    pub fn reads_live(&self) -> bool {
        match self {
            Self::Nvml(_) => true,
            Self::Config { .. } => false,
            #[cfg(test)]
            Self::Scripted(_) => true,
        }
    }

    /// The current inventory (blocking; NVML queries take milliseconds).
    pub fn snapshot(&self) -> Inventory {
        match self {
            #[cfg(test)]
            Self::Scripted(gpus) => Inventory {
                source: InventorySource::Nvml,
                gpus: gpus.lock().unwrap().clone(),
                note: None,
            },
            Self::Nvml(inv) => match inv.snapshot() {
                Ok(gpus) => Inventory {
                    source: InventorySource::Nvml,
                    gpus,
                    note: None,
                },
                Err(e) => Inventory {
                    source: InventorySource::Nvml,
                    gpus: Vec::new(),
                    note: Some(format!("NVML query failed: {e}")),
                },
            },
            Self::Config { specs, note } => Inventory {
                source: if specs.is_empty() {
                    InventorySource::None
                } else {
                    InventorySource::Config
                },
                gpus: specs.iter().map(GpuInfo::from_spec).collect(),
                note: note.clone(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_source_lists_specs_without_topology() {
        let specs = vec![
            GpuSpec {
                index: 0,
                name: "A100".into(),
                memory_bytes: 80 << 30,
            },
            GpuSpec {
                index: 1,
                name: "A100".into(),
                memory_bytes: 80 << 30,
            },
        ];
        let inv = GpuSource::from_config(&specs).snapshot();
        assert_eq!(inv.source, InventorySource::Config);
        assert_eq!(inv.gpus.len(), 2);
        assert_eq!(inv.gpu(1).unwrap().memory_total_bytes, 80 << 30);
        assert_eq!(inv.gpu(1).unwrap().iommu, IommuMode::Unknown);
        assert!(inv.gpu(2).is_none());
    }

    #[test]
    fn empty_config_is_source_none() {
        let inv = GpuSource::from_config(&[]).snapshot();
        assert_eq!(inv.source, InventorySource::None);
        assert!(inv.gpus.is_empty());
    }

    #[test]
    fn link_kinds_order_best_first() {
        assert!(LinkKind::NvLink < LinkKind::SameSwitch);
        assert!(LinkKind::SameSwitch < LinkKind::SameCpu);
        assert!(LinkKind::SameCpu < LinkKind::CrossCpu);
        assert!(LinkKind::CrossCpu < LinkKind::Unknown);
        assert_eq!(
            serde_json::to_string(&LinkKind::SameSwitch).unwrap(),
            "\"same-switch\""
        );
        assert_eq!(
            serde_json::to_string(&LinkKind::NvLink).unwrap(),
            format!("\"{}\"", LinkKind::NvLink.as_str())
        );
    }
}
