//! Scenario 4, hold capacity: N requests held at once by the proxy for one
//! sleeping model whose wake is slow (fake-vllm's --wake-time), all on
//! their own connections; then the wake releases them. Counts statuses and
//! samples the proxy's VmRSS throughout. Past one process's open-files
//! limit, `--clients N` holds from N client processes (`hold_client.rs`)
//! and the proxy may be several replicas on one port (`--reuse-port`):
//! `--proxy-pid` and `--proxy-admin` then list each, and RSS and the held
//! gauge are summed over them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::control;
use crate::hold_client::{self, Clients, Outcome};
use crate::http::{Conn, chat_body, socket_addr, unix_us};
use crate::stats::{Row, Target, print_table};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[arg(long)]
    control: String,
    #[arg(long)]
    proxy: String,
    /// The proxy's admin base URL (for the held-requests gauge on /metrics);
    /// comma-separated for replicas (the gauges are summed).
    #[arg(long, value_delimiter = ',')]
    proxy_admin: Vec<String>,
    /// The proxy's pid (for VmRSS); comma-separated for replicas (summed).
    #[arg(long, value_delimiter = ',', required = true)]
    proxy_pid: Vec<u32>,
    /// Client processes holding the connections (`siesta-bench
    /// hold-client`, each from its own loopback address); 0: this process.
    #[arg(long, default_value_t = 0)]
    clients: usize,
    #[arg(long, default_value = "bench-hold")]
    model: String,
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// Connections being opened at once (the listen backlog is finite).
    #[arg(long, default_value_t = 200)]
    connect_parallel: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// The held model's fake-vllm base URL (for /fake/stats: when the wake
    /// finished and when the last request arrived).
    #[arg(long)]
    engine: Option<String>,
    /// Loopback source addresses to connect from (127.0.0.1, .2, ...);
    /// 0: one per 25,000 requests.
    #[arg(long, default_value_t = 0)]
    sources: usize,
}

/// The soft open-files limit of a process (`/proc/PID/limits`).
pub fn open_files_limit(pid: &str) -> Option<usize> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// VmRSS summed over the proxy replicas.
fn rss_sum(pids: &[u32]) -> Result<u64> {
    pids.iter().map(|&p| control::rss_bytes(p)).sum()
}

pub async fn run(mut a: Args) -> Result<()> {
    // One descriptor per held connection in the holding process(es) and in
    // the proxy replicas (the kernel spreads them about evenly).
    let per = |limit: usize, n: usize| limit.saturating_sub(500).saturating_mul(n.max(1));
    let proxy_limit = a
        .proxy_pid
        .iter()
        .filter_map(|p| open_files_limit(&p.to_string()))
        .min();
    let allowed = [
        open_files_limit("self").map(|l| per(l, a.clients)),
        proxy_limit.map(|l| per(l, a.proxy_pid.len())),
    ]
    .into_iter()
    .flatten()
    .min()
    .unwrap_or(usize::MAX);
    if a.requests > allowed {
        eprintln!(
            "hold: {} requests asked, but the open-files limit allows {allowed}: holding {allowed}",
            a.requests
        );
        a.requests = allowed;
    }
    let sources = if a.sources == 0 {
        a.requests.div_ceil(25_000).max(1)
    } else {
        a.sources
    };
    let froms: Vec<Option<std::net::IpAddr>> = (0..sources)
        .map(|i| (sources > 1).then(|| std::net::IpAddr::from([127, 0, 0, 1 + i as u8])))
        .collect();
    let mut engine = match &a.engine {
        Some(e) => Some(Conn::connect(socket_addr(e)?).await?),
        None => None,
    };
    let mut ctl = control::connect(&a.control).await?;
    let addr = socket_addr(&a.proxy)?;
    let mut admin = Conn::connect(addr).await?;
    let pids = a.proxy_pid.clone();
    let body = Arc::new(chat_body(&a.model, 4, false));
    let s = "4";
    let mut rows = vec![
        Row::new(s, format!("requests answered 200 of {}", a.requests), "")
            .target(Target::AtLeast(a.requests as f64)),
        Row::new(s, "lost (error or non-200)", "").target(Target::AtMost(0.0)),
        Row::new(s, "proxy RSS at start of repeat", "MB"),
        Row::new(
            s,
            "proxy RSS growth while all held (vs before 1st repeat)",
            "MB",
        ),
        Row::new(
            s,
            "proxy RSS growth at peak, held + release (vs before 1st repeat)",
            "MB",
        )
        .target(Target::AtMost(a.requests as f64 * 10e3 / 1e6)),
        Row::new(s, "RSS growth at peak per held request", "KB").target(Target::AtMost(10.0)),
        Row::new(s, "RSS growth while held per held request", "KB"),
        Row::new(s, "time to connect all", "s"),
        Row::new(s, "held gauge on /metrics after connecting", ""),
        Row::new(s, "all connected → last response", "s"),
        Row::new(s, "proxy RSS after release − RSS before first repeat", "MB"),
        Row::new(s, "wake finished → last held request at the engine", "s")
            .target(Target::AtMost(2.0)),
        Row::new(s, "wake finished → last response at the client", "s"),
    ];
    let rss_first = rss_sum(&pids)?;
    control::wake_wait(&mut ctl, &a.model).await?;
    for rep in 0..a.repeats {
        control::sleep_and_wait(&mut ctl, &a.model).await?;
        control::wait_proxy_not_awake(&mut admin, &a.model).await?;
        let rss0 = rss_sum(&pids)?;
        let peak = Arc::new(AtomicU64::new(rss0));
        let sampler = {
            let peak = peak.clone();
            let pids = pids.clone();
            tokio::spawn(async move {
                loop {
                    if let Ok(r) = rss_sum(&pids) {
                        peak.fetch_max(r, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        };
        let start = Instant::now();
        let start_us = unix_us();
        enum Holding {
            Here(Vec<hold_client::HeldTask>),
            Clients(Clients),
        }
        let holding = if a.clients == 0 {
            let (tasks, _gate) =
                hold_client::open(addr, &froms, body.clone(), a.requests, a.connect_parallel)
                    .await?;
            Holding::Here(tasks)
        } else {
            let mut c = Clients::spawn(
                a.clients,
                &a.proxy,
                &a.model,
                a.requests,
                a.connect_parallel,
            )?;
            let n = c.connected().await?;
            eprintln!(
                "hold rep={rep}: {n} connected from {} client processes",
                a.clients
            );
            Holding::Clients(c)
        };
        let sent = start.elapsed();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let rss_held = rss_sum(&pids)?;
        let mut held = if a.proxy_admin.is_empty() {
            f64::NAN
        } else {
            0.0
        };
        let mut per_replica = Vec::new();
        for url in &a.proxy_admin {
            let h = held_gauge(url).await.unwrap_or(f64::NAN);
            per_replica.push(h);
            held += h;
        }
        if per_replica.len() > 1 {
            eprintln!("hold rep={rep}: held per proxy replica {per_replica:?}");
        }
        let outcome = match holding {
            Holding::Here(tasks) => Outcome::collect(tasks).await?,
            Holding::Clients(c) => c.finish().await?,
        };
        let (ok, lost) = (outcome.ok(), outcome.lost());
        let first_err = outcome.first_err.clone();
        sampler.abort();
        let peak = peak.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let rss_after = rss_sum(&pids)?;
        let st = control::state(&mut ctl, &a.model).await?;
        let last_us = if ok > 0 { outcome.last_ok_us } else { start_us };
        let awake_at = (last_us - start_us) / 1e6;
        // fake-vllm's clock: when the wake finished and when the last
        // request arrived (only the held ones reach this engine).
        let (to_engine, to_client) = match engine.as_mut() {
            Some(e) => {
                let stats = e.get_json("/fake/stats").await?;
                let ns = |k: &str| stats.get(k).and_then(|v| v.as_f64());
                match (
                    ns("last_wake_finished_unix_ns"),
                    ns("last_request_arrived_unix_ns"),
                ) {
                    (Some(w), Some(r)) => {
                        if w / 1e3 < start_us + sent.as_secs_f64() * 1e6 {
                            eprintln!(
                                "hold rep={rep}: WARNING the wake finished before all were connected; raise BENCH_HOLD_WAKE"
                            );
                        }
                        ((r - w) / 1e9, (last_us - w / 1e3) / 1e6)
                    }
                    _ => (f64::NAN, f64::NAN),
                }
            }
            None => (f64::NAN, f64::NAN),
        };
        let vals = [
            ok as f64,
            lost as f64,
            rss0 as f64 / 1e6,
            rss_held.saturating_sub(rss_first) as f64 / 1e6,
            peak.saturating_sub(rss_first) as f64 / 1e6,
            peak.saturating_sub(rss_first) as f64 / a.requests as f64 / 1e3,
            rss_held.saturating_sub(rss_first) as f64 / a.requests as f64 / 1e3,
            sent.as_secs_f64(),
            held,
            awake_at - sent.as_secs_f64(),
            (rss_after as f64 - rss_first as f64) / 1e6,
            to_engine,
            to_client,
        ];
        let statuses = outcome.summary();
        println!("\nScenario 4, repeat {rep}: responses by status: {statuses}");
        eprintln!(
            "hold rep={rep}: ok {ok} lost {lost} ({}) rss {:.1} MB → peak {:.1} MB; connected in {:.2}s; held {held}; state now {st:?}",
            first_err.unwrap_or_default(),
            vals[2],
            peak as f64 / 1e6,
            vals[7]
        );
        for (row, v) in rows.iter_mut().zip(vals) {
            row.push(v);
        }
    }
    let title = if a.clients == 0 && pids.len() == 1 {
        format!("4. Hold capacity ({} held requests)", a.requests)
    } else {
        format!(
            "4. Hold capacity ({} held requests, {} proxy replicas on one port, {} client processes; RSS summed over replicas)",
            a.requests,
            pids.len(),
            a.clients.max(1)
        )
    };
    print_table(&title, &rows);
    Ok(())
}

/// Sums the proxy's gauge(s) of held requests (any metric whose name has
/// "held" or "queue" and is not a histogram/counter series).
async fn held_gauge(admin: &str) -> Result<f64> {
    let mut c = Conn::connect(socket_addr(admin)?).await?;
    let t = c.request("GET", "/metrics", None).await?;
    let text = String::from_utf8_lossy(&t.body);
    let mut sum = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name = line.split(['{', ' ']).next().unwrap_or("");
        let gaugey = !(name.ends_with("_total")
            || name.ends_with("_bucket")
            || name.ends_with("_sum")
            || name.ends_with("_count")
            || name.ends_with("_created"));
        let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let (true, Some(v)) = (
            gaugey && (name.contains("held") || name.contains("queue")),
            value,
        ) {
            *sum.get_or_insert(0.0) += v;
        }
    }
    sum.context("no held/queue gauge on /metrics")
}
