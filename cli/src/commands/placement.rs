//! `siesta placement`: which GPUs each model is placed on, and why.

use siesta_proto::v1 as pb;

use super::print_json;
use crate::args::Format;
use crate::client::Conn;
use crate::failure::Failure;
use crate::render::{self, Table};
use crate::view::PlacementView;

pub async fn run(conn: Conn, format: Format) -> Result<(), Failure> {
    let r = conn
        .call(|mut c| async move { c.get_placement(pb::GetPlacementRequest {}).await })
        .await?;
    match format {
        Format::Json => print_json(&PlacementView::from(&r)),
        Format::Text => {
            print!("{}", describe(&r));
            Ok(())
        }
    }
}

pub fn describe(r: &pb::GetPlacementResponse) -> String {
    let mut t = Table::new([
        "model",
        "gpus",
        "awake per gpu",
        "asleep per gpu",
        "mem util",
        "exclusive",
        "p2p",
        "reason",
    ]);
    for p in &r.models {
        t.row(vec![
            p.model.clone(),
            render::gpus(&p.gpus),
            if p.awake_bytes_per_gpu == 0 {
                "-".into()
            } else {
                render::bytes(p.awake_bytes_per_gpu)
            },
            render::residual(p.asleep_residual_bytes, p.asleep_residual_measured),
            if p.gpu_memory_utilization > 0.0 {
                format!("{:.2}", p.gpu_memory_utilization)
            } else {
                "-".into()
            },
            if p.exclusive {
                "yes".into()
            } else {
                "no".into()
            },
            if p.p2p_disabled {
                "disabled".into()
            } else {
                "-".into()
            },
            render::or_dash(&p.reason),
        ]);
    }
    let mut out = t.render();
    if !r.gpus.is_empty() {
        out.push('\n');
        let mut g = Table::new([
            "gpu", "total", "awake", "asleep", "others", "free", "models",
        ]);
        for b in &r.gpus {
            g.row(vec![
                b.index.to_string(),
                render::bytes(b.total_bytes),
                render::bytes(b.awake_bytes),
                render::bytes(b.asleep_bytes),
                if b.foreign_bytes == 0 {
                    "-".into()
                } else {
                    render::bytes(b.foreign_bytes)
                },
                render::bytes(b.free_bytes),
                if b.models.is_empty() {
                    "-".into()
                } else {
                    b.models.join(", ")
                },
            ]);
        }
        out.push_str(&g.render());
    }
    out
}
