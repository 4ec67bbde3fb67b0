//! `siesta diag p2p`: run the GPU peer-to-peer probe now.

use std::time::Duration;

use serde::Serialize;
use siesta_proto::v1 as pb;

use super::gpus::p2p_matrix;
use super::print_json;
use crate::args::Format;
use crate::client::{Conn, RPC_TIMEOUT};

use crate::args::PROBE_TIMEOUT_MAX;
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
    let wait = deadline(timeout);
    // The call's own deadline is this one's: a daemon that cannot be
    // reached still fails fast (exit 3), one that does not answer in time
    // was reached, and its probe may still run (exit 1).
    let call = conn.call_within(Duration::MAX, |mut c| async move {
        c.diag_p2p(pb::DiagP2pRequest {
            bytes: bytes.unwrap_or(0),
            timeout_ms: timeout.map_or(0, |d| d.as_millis() as u64),
        })
        .await
    });
    let Ok(r) = tokio::time::timeout(wait, call).await else {
        return Err(Failure::Failed(format!(
            "the P2P probe gave no answer within {}; `siesta gpus` shows its results if it ends",
            render::duration(wait.as_millis() as u64)
        )));
    };
    let r = r?;
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

/// How long to wait for the probe's answer: its own deadline (the
/// daemon's `p2p_probe_timeout` when not given, which is at most
/// [`PROBE_TIMEOUT_MAX`]) and a call's slack.
fn deadline(timeout: Option<Duration>) -> Duration {
    timeout.unwrap_or(PROBE_TIMEOUT_MAX) + RPC_TIMEOUT
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CLI waited 600 s by default for a probe whose configured
    /// deadline may be an hour, then called the daemon unreachable.
    #[test]
    fn the_wait_outlasts_the_longest_probe_deadline() {
        assert!(deadline(None) > PROBE_TIMEOUT_MAX);
        assert_eq!(
            deadline(Some(Duration::from_secs(60))),
            Duration::from_secs(60) + RPC_TIMEOUT
        );
    }
}
