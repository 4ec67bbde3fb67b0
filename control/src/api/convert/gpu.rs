//! Domain GPU and placement reports → `siesta_proto::v1` messages (for
//! ListGpus, GetPlacement, DiagP2p and the Watch stream).

use siesta_proto::v1 as pb;

use crate::gpu::p2p::{P2pHealth, P2pResult};
use crate::gpu::{GpuInfo, GpuLinkInfo, InventorySource};
use crate::gpu_view::{GpuList, ModelPlacement, P2pDiag, PlacementReport};
use crate::placement::GpuBudget;

pub fn gpu_list(l: &GpuList) -> pb::ListGpusResponse {
    pb::ListGpusResponse {
        gpus: l
            .gpus
            .iter()
            .map(|g| gpu_to_proto(g, |pid| l.owners.get(&pid).cloned()))
            .collect(),
        source: match l.source {
            InventorySource::Nvml => "nvml",
            InventorySource::Config => "config",
            InventorySource::None => "none",
        }
        .into(),
        p2p: l.p2p.iter().map(p2p_to_proto).collect(),
        p2p_probed_unix_ms: l.p2p_probed_unix_ms,
        note: l.note.clone().unwrap_or_default(),
    }
}

pub fn model_placement(p: &ModelPlacement) -> pb::ModelPlacement {
    pb::ModelPlacement {
        model: p.model.clone(),
        gpus: p.gpus.clone(),
        awake_bytes_per_gpu: p.awake_bytes_per_gpu,
        gpu_memory_utilization: p.gpu_memory_utilization,
        p2p_disabled: p.p2p_disabled,
        reason: p.reason.clone(),
        exclusive: p.exclusive,
        asleep_residual_bytes: p.asleep_residual.bytes,
        asleep_residual_measured: p.asleep_residual.measured,
    }
}

pub fn gpu_budget(b: &GpuBudget) -> pb::GpuBudget {
    pb::GpuBudget {
        index: b.index,
        total_bytes: b.total_bytes,
        awake_bytes: b.awake_bytes,
        asleep_bytes: b.asleep_bytes,
        free_bytes: b.free_bytes,
        models: b.models.clone(),
        foreign_bytes: b.foreign_bytes,
    }
}

pub fn placement(r: &PlacementReport) -> pb::GetPlacementResponse {
    pb::GetPlacementResponse {
        models: r.models.iter().map(model_placement).collect(),
        gpus: r.gpus.iter().map(gpu_budget).collect(),
    }
}

pub fn p2p_diag(d: &P2pDiag) -> pb::DiagP2pResponse {
    pb::DiagP2pResponse {
        results: d.results.iter().map(p2p_to_proto).collect(),
        probed_unix_ms: d.probed_unix_ms,
        message: d.message.clone(),
        failed: d.failed,
    }
}

/// A GPU as `ListGpus` returns it. `model_of` names the model whose engine
/// process (group) a pid belongs to, if it is one of siesta's.
pub fn gpu_to_proto(g: &GpuInfo, model_of: impl Fn(u32) -> Option<String>) -> pb::Gpu {
    pb::Gpu {
        index: g.index,
        uuid: g.uuid.clone(),
        name: g.name.clone(),
        memory_total_bytes: g.memory_total_bytes,
        memory_used_bytes: g.memory_used_bytes,
        pci_bus_id: g.pci_bus_id.clone(),
        iommu_mode: g.iommu.as_str().to_string(),
        nvlinks_active: g.nvlinks_active,
        processes: g
            .processes
            .iter()
            .map(|p| pb::GpuProcess {
                pid: p.pid,
                used_bytes: p.used_bytes,
                model: model_of(p.pid).unwrap_or_default(),
            })
            .collect(),
        links: g.links.iter().map(link_to_proto).collect(),
    }
}

pub fn link_to_proto(l: &GpuLinkInfo) -> pb::GpuLink {
    pb::GpuLink {
        peer: l.peer,
        kind: l.kind.as_str().to_string(),
        driver_p2p: l.driver_p2p.clone(),
    }
}

pub fn health_to_proto(h: P2pHealth) -> pb::P2pHealth {
    match h {
        P2pHealth::Ok => pb::P2pHealth::Ok,
        P2pHealth::Corrupt => pb::P2pHealth::Corrupt,
        P2pHealth::Unsupported => pb::P2pHealth::Unsupported,
        P2pHealth::Hung => pb::P2pHealth::Hung,
        P2pHealth::Error => pb::P2pHealth::Error,
    }
}

pub fn p2p_to_proto(r: &P2pResult) -> pb::P2pResult {
    pb::P2pResult {
        src: r.src,
        dst: r.dst,
        health: health_to_proto(r.health) as i32,
        elements: r.elements,
        corrupt_elements: r.corrupt_elements,
        bandwidth_gbps: r.bandwidth_gbps,
        driver_says: r.driver_says.clone(),
        detail: r.detail.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{GpuProcessInfo, GpuSpec, IommuMode, LinkKind};

    #[test]
    fn gpu_converts_with_links_and_owned_processes() {
        let mut g = GpuInfo::from_spec(&GpuSpec {
            index: 1,
            name: "H200".into(),
            memory_bytes: 150_754_820_096,
        });
        g.iommu = IommuMode::Translated;
        g.processes = vec![
            GpuProcessInfo {
                pid: 42,
                used_bytes: 8 << 30,
            },
            GpuProcessInfo {
                pid: 7,
                used_bytes: 1,
            },
        ];
        g.links = vec![GpuLinkInfo {
            peer: 0,
            kind: LinkKind::NvLink,
            driver_p2p: "ok".into(),
        }];
        let p = gpu_to_proto(&g, |pid| (pid == 42).then(|| "text".to_string()));
        assert_eq!(p.iommu_mode, "translated");
        assert_eq!(p.processes[0].model, "text");
        assert_eq!(p.processes[1].model, "");
        assert_eq!(p.links[0].kind, "nvlink");
    }

    #[test]
    fn p2p_result_converts() {
        let r = P2pResult::missing(0, 1, P2pHealth::Hung, "killed");
        let p = p2p_to_proto(&r);
        assert_eq!(p.health(), pb::P2pHealth::Hung);
        assert_eq!(p.detail, "killed");
    }
}
