//! Scenario 6, control plane scale: a control plane configured with many
//! models. Times ListModels and the first message (snapshot) of a new Watch,
//! and reads the daemon's resident memory.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use siesta_proto::v1::watch_event::Kind;
use siesta_proto::v1::{ListModelsRequest, WatchRequest};

use crate::control;
use crate::stats::{Row, Target, median, percentile, print_table};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[arg(long)]
    control: String,
    /// The daemon's pid (for VmRSS).
    #[arg(long)]
    pid: u32,
    /// Models the config holds (waited for in ListModels).
    #[arg(long, default_value_t = 1000)]
    models: usize,
    /// RSS of the same daemon with one model, for the per-model cost (bytes).
    #[arg(long)]
    baseline_rss: Option<u64>,
    #[arg(long, default_value_t = 200)]
    iterations: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

pub async fn run(a: Args) -> Result<()> {
    let mut ctl = control::connect(&a.control).await?;
    let t = Instant::now();
    loop {
        let n = ctl
            .list_models(ListModelsRequest {})
            .await?
            .into_inner()
            .models
            .len();
        if n >= a.models {
            break;
        }
        if t.elapsed() > Duration::from_secs(60) {
            bail!("ListModels has {n} models, want {}", a.models);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = "6";
    let mut rows = vec![
        Row::new(s, format!("ListModels ({} models) p50", a.models), "ms"),
        Row::new(s, "ListModels p99", "ms").target(Target::AtMost(5.0)),
        Row::new(s, "Watch snapshot (new stream → snapshot) p50", "ms"),
        Row::new(s, "Watch snapshot p99", "ms").target(Target::AtMost(5.0)),
        Row::new(s, "models in snapshot", ""),
        Row::new(s, "daemon RSS", "MB"),
    ];
    if a.baseline_rss.is_some() {
        rows.push(Row::new(
            s,
            "daemon RSS per model over 1-model baseline",
            "KB",
        ));
    }
    for rep in 0..a.repeats {
        let mut list = Vec::new();
        for _ in 0..a.iterations {
            let t = Instant::now();
            let r = ctl.list_models(ListModelsRequest {}).await?.into_inner();
            list.push(t.elapsed().as_secs_f64() * 1e3);
            if r.models.len() < a.models {
                bail!("ListModels lost models: {}", r.models.len());
            }
        }
        let mut snap = Vec::new();
        let mut in_snap = 0;
        for i in 0..a.iterations {
            let t = Instant::now();
            let mut st = ctl
                .watch(WatchRequest {
                    since_revision: 0,
                    client_id: format!("bench-scale-{i}"),
                    incarnation: 0,
                    heartbeat: false,
                })
                .await?
                .into_inner();
            let ev = st
                .message()
                .await?
                .context("Watch ended before a snapshot")?;
            snap.push(t.elapsed().as_secs_f64() * 1e3);
            match ev.kind {
                Some(Kind::Snapshot(s)) => in_snap = s.models.len(),
                other => bail!("first Watch message is not a snapshot: {other:?}"),
            }
        }
        let rss = control::rss_bytes(a.pid)?;
        let mut vals = vec![
            median(&list),
            percentile(&list, 99.0),
            median(&snap),
            percentile(&snap, 99.0),
            in_snap as f64,
            rss as f64 / 1e6,
        ];
        if let Some(b) = a.baseline_rss {
            vals.push((rss as f64 - b as f64) / (a.models.saturating_sub(1).max(1)) as f64 / 1e3);
        }
        eprintln!("scale rep={rep}: {vals:?}");
        for (row, x) in rows.iter_mut().zip(vals) {
            row.push(x);
        }
    }
    print_table(
        &format!("6. Control plane scale ({} attach models)", a.models),
        &rows,
    );
    Ok(())
}
