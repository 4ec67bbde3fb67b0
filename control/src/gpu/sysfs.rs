//! IOMMU mode from sysfs: `/sys/bus/pci/devices/<bdf>/iommu_group/type`.

use std::path::Path;

use super::IommuMode;

/// NVML's bus id ("00000000:3D:00.0", 8-digit domain, upper case) as sysfs
/// names the device ("0000:3d:00.0", 4-digit domain, lower case).
pub fn sysfs_bdf(nvml_bus_id: &str) -> String {
    let id = nvml_bus_id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) => {
            let domain = domain.trim_start_matches('0');
            format!("{domain:0>4}:{rest}")
        }
        None => id,
    }
}

/// The contents of an `iommu_group/type` file, classified.
pub fn parse_iommu_type(text: &str) -> IommuMode {
    match text.trim() {
        "DMA" | "DMA-FQ" => IommuMode::Translated,
        "identity" => IommuMode::Identity,
        "blocked" => IommuMode::Blocked,
        _ => IommuMode::Unknown,
    }
}

/// The IOMMU mode of a PCI device under `sys_root` (normally `/sys`); a
/// missing file (no IOMMU, a VM) is `Unknown`, never an error.
pub fn iommu_mode(sys_root: &Path, nvml_bus_id: &str) -> IommuMode {
    if nvml_bus_id.is_empty() {
        return IommuMode::Unknown;
    }
    let path = sys_root
        .join("bus/pci/devices")
        .join(sysfs_bdf(nvml_bus_id))
        .join("iommu_group/type");
    match std::fs::read_to_string(&path) {
        Ok(text) => parse_iommu_type(&text),
        Err(_) => IommuMode::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_id_becomes_sysfs_name() {
        assert_eq!(sysfs_bdf("00000000:3D:00.0"), "0000:3d:00.0");
        assert_eq!(sysfs_bdf("0000:AB:00.0"), "0000:ab:00.0");
        assert_eq!(sysfs_bdf("00010000:18:00.0"), "10000:18:00.0");
        assert_eq!(sysfs_bdf("00000001:18:00.0"), "0001:18:00.0");
    }

    #[test]
    fn iommu_types_classify() {
        assert_eq!(parse_iommu_type("DMA\n"), IommuMode::Translated);
        assert_eq!(parse_iommu_type("DMA-FQ\n"), IommuMode::Translated);
        assert_eq!(parse_iommu_type("identity\n"), IommuMode::Identity);
        assert_eq!(parse_iommu_type("blocked"), IommuMode::Blocked);
        assert_eq!(parse_iommu_type("weird"), IommuMode::Unknown);
    }

    #[test]
    fn reads_sysfs_tree_and_tolerates_missing_files() {
        let dir = tempfile::tempdir().unwrap();
        let group = dir.path().join("bus/pci/devices/0000:3d:00.0/iommu_group");
        std::fs::create_dir_all(&group).unwrap();
        std::fs::write(group.join("type"), "DMA-FQ\n").unwrap();
        assert_eq!(
            iommu_mode(dir.path(), "00000000:3D:00.0"),
            IommuMode::Translated
        );
        assert_eq!(
            iommu_mode(dir.path(), "00000000:63:00.0"),
            IommuMode::Unknown
        );
        assert_eq!(iommu_mode(dir.path(), ""), IommuMode::Unknown);
    }
}
