//! `siesta gpus`: the inventory, topology and P2P health.

use std::collections::BTreeSet;

use siesta_proto::v1 as pb;

use super::print_json;
use crate::args::Format;
use crate::client::Conn;
use crate::failure::Failure;
use crate::render::{self, Table};
use crate::view::GpusView;

pub async fn run(conn: Conn, format: Format) -> Result<(), Failure> {
    let r = conn
        .call(|mut c| async move { c.list_gpus(pb::ListGpusRequest {}).await })
        .await?;
    match format {
        Format::Json => print_json(&GpusView::from(&r)),
        Format::Text => {
            print!("{}", describe(render::now_ms(), &r));
            Ok(())
        }
    }
}

pub fn describe(now: i64, r: &pb::ListGpusResponse) -> String {
    let mut out = format!("inventory: {}\n", render::or_dash(&r.source));
    if !r.note.is_empty() {
        out.push_str(&format!("note: {}\n", r.note));
    }
    if r.gpus.is_empty() {
        out.push_str("no GPUs\n");
    } else {
        let mut t = Table::new([
            "gpu",
            "name",
            "memory used",
            "pci",
            "iommu",
            "nvlinks",
            "processes",
        ]);
        for g in &r.gpus {
            let procs: Vec<String> = g
                .processes
                .iter()
                .map(|p| {
                    let who = if p.model.is_empty() {
                        format!("pid {}", p.pid)
                    } else {
                        format!("{} ({})", p.model, p.pid)
                    };
                    format!("{who} {}", render::bytes(p.used_bytes))
                })
                .collect();
            t.row(vec![
                g.index.to_string(),
                render::or_dash(&g.name),
                format!(
                    "{} / {}",
                    render::bytes(g.memory_used_bytes),
                    render::bytes(g.memory_total_bytes)
                ),
                render::or_dash(&g.pci_bus_id),
                render::or_dash(&g.iommu_mode),
                g.nvlinks_active.to_string(),
                if procs.is_empty() {
                    "-".into()
                } else {
                    procs.join(", ")
                },
            ]);
        }
        out.push_str(&t.render());
    }
    if r.p2p.is_empty() {
        out.push_str("p2p: never probed (run `siesta diag p2p`)\n");
    } else {
        out.push_str(&format!(
            "p2p (probed {} ago; rows: source, columns: destination):\n",
            render::ago(now, r.p2p_probed_unix_ms)
        ));
        out.push_str(&p2p_matrix(&r.p2p));
    }
    out
}

/// The P2P verdicts as a source × destination matrix.
pub fn p2p_matrix(results: &[pb::P2pResult]) -> String {
    let ids: BTreeSet<u32> = results.iter().flat_map(|p| [p.src, p.dst]).collect();
    let mut header = vec!["src\\dst".to_owned()];
    header.extend(ids.iter().map(u32::to_string));
    let mut t = Table::bare();
    t.row(header);
    for &src in &ids {
        let mut row = vec![src.to_string()];
        for &dst in &ids {
            let cell = match results.iter().find(|p| p.src == src && p.dst == dst) {
                _ if src == dst => "-".to_owned(),
                Some(p) => render::p2p_name(p.health()).to_owned(),
                None => "?".to_owned(),
            };
            row.push(cell);
        }
        t.row(row);
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Why the GPUs shown are an older read is said under the source.
    #[test]
    fn an_old_inventory_says_why() {
        let mut r = pb::ListGpusResponse {
            source: "nvml".into(),
            ..Default::default()
        };
        assert_eq!(
            describe(0, &r),
            "inventory: nvml\nno GPUs\np2p: never probed (run `siesta diag p2p`)\n"
        );
        r.note = "NVML has not answered for 4.0s".into();
        assert!(
            describe(0, &r).starts_with("inventory: nvml\nnote: NVML has not answered for 4.0s\n"),
            "{}",
            describe(0, &r)
        );
    }

    #[test]
    fn matrix_rows_are_sources() {
        let r = |src, dst, h: pb::P2pHealth| pb::P2pResult {
            src,
            dst,
            health: h as i32,
            ..Default::default()
        };
        let m = p2p_matrix(&[r(0, 1, pb::P2pHealth::Corrupt), r(1, 0, pb::P2pHealth::Ok)]);
        assert_eq!(m, "src\\dst  0   1\n0        -   corrupt\n1        ok  -\n");
    }
}
