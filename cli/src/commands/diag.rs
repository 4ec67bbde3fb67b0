//! `siesta diag p2p`: run the GPU peer-to-peer probe now.

use std::time::Duration;

use serde::Serialize;
use siesta_proto::v1 as pb;

use super::gpus::p2p_matrix;
use super::print_json;
use crate::args::Format;
use crate::client::{Conn, RPC_TIMEOUT};

/// How long to wait for a probe run with the control plane's default deadline.
const PROBE_WAIT: Duration = Duration::from_secs(600);
use crate::failure::Failure;
use crate::render::{self, Table};
use crate::view::P2pView;

#[derive(Debug, Serialize)]
struct DiagView {
    results: Vec<P2pView>,
    probed_unix_ms: i64,
    message: String,
}

pub async fn p2p(
    conn: Conn,
    bytes: Option<u64>,
    timeout: Option<Duration>,
    format: Format,
) -> Result<(), Failure> {
    // The probe has its own deadline (default: the control plane's, minutes).
    let deadline = timeout.map_or(PROBE_WAIT, |t| t + RPC_TIMEOUT);
    let r = conn
        .call_within(deadline, |mut c| async move {
            c.diag_p2p(pb::DiagP2pRequest {
                bytes: bytes.unwrap_or(0),
                timeout_ms: timeout.map_or(0, |d| d.as_millis() as u64),
            })
            .await
        })
        .await?;
    // Two GPUs or more and no probe run (none found, no CUDA): failed.
    if r.failed {
        return Err(Failure::Failed(r.message));
    }
    if format == Format::Json {
        return print_json(&DiagView {
            results: r.results.iter().map(P2pView::from).collect(),
            probed_unix_ms: r.probed_unix_ms,
            message: r.message,
        });
    }
    if !r.message.is_empty() {
        println!("{}", r.message);
    }
    if r.results.is_empty() {
        if r.message.is_empty() {
            println!("no GPU pairs to probe");
        }
        return Ok(());
    }
    print!("{}", p2p_matrix(&r.results));
    println!();
    let mut t = Table::new([
        "src",
        "dst",
        "health",
        "corrupt",
        "bandwidth",
        "driver says",
        "detail",
    ]);
    for p in &r.results {
        t.row(vec![
            p.src.to_string(),
            p.dst.to_string(),
            render::p2p_name(p.health()).into(),
            format!("{}/{}", p.corrupt_elements, p.elements),
            if p.bandwidth_gbps > 0.0 {
                format!("{:.1} GB/s", p.bandwidth_gbps)
            } else {
                "-".into()
            },
            render::or_dash(&p.driver_says),
            render::or_dash(&p.detail),
        ]);
    }
    print!("{}", t.render());
    let bad = r
        .results
        .iter()
        .filter(|p| p.health() != pb::P2pHealth::Ok)
        .count();
    if bad > 0 {
        println!(
            "{bad} of {} pairs are not healthy: tensor-parallel groups on them run with NCCL_P2P_DISABLE=1",
            r.results.len()
        );
    }
    Ok(())
}
