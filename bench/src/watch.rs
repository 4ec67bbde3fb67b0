//! Scenario 5, Watch fan-out: N Watch subscribers spread over a few HTTP/2
//! connections while models are put to sleep and woken. Measures the delay
//! from each event's `at_unix_ms` to its arrival at every subscriber, and
//! the transitions' own durations with and without the subscribers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use siesta_proto::v1::ListModelsRequest;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::control::{self, Client};
use crate::stats::{Row, Target, median, percentile, print_table};

mod subscribers;
use subscribers::ClientKind;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[arg(long)]
    control: String,
    /// Models to cycle through sleep and wake (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "bench")]
    models: Vec<String>,
    #[arg(long, default_value_t = 1000)]
    subscribers: usize,
    /// HTTP/2 connections the subscribers share.
    #[arg(long, default_value_t = 8)]
    connections: usize,
    /// Sleep+wake cycles per model per phase.
    #[arg(long, default_value_t = 10)]
    cycles: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// After the repeats: this many subscribers held at once (0: skip),
    /// with the daemon's RSS (needs --pid) and one event delivered to all.
    #[arg(long, default_value_t = 0)]
    held: usize,
    /// HTTP/2 connections the held subscribers share.
    #[arg(long, default_value_t = 40)]
    held_connections: usize,
    /// siesta-control's pid (for VmRSS).
    #[arg(long)]
    pid: Option<u32>,
    /// The subscribers' client: `lean` (one task per connection, events
    /// read for their revision, time and kind) or `full` (a task per
    /// subscriber decoding each event whole); see `watch/subscribers.rs`.
    #[arg(long, value_enum, default_value = "lean")]
    client: ClientKind,
}

/// (revision, at_unix_ms, received unix µs) of each model event after the
/// snapshot, and how many snapshots (resyncs included) arrived.
type Seen = (Vec<(u64, i64, f64)>, usize);

/// Open subscribers: their tasks and the last revision each has seen.
struct Subs {
    tasks: Vec<JoinHandle<Result<Vec<Seen>>>>,
    last: Arc<Vec<AtomicU64>>,
}

pub async fn run(a: Args) -> Result<()> {
    let mut ctl = control::connect(&a.control).await?;
    let mut chans = Vec::new();
    for _ in 0..a.connections.max(1) {
        chans.push(control::channel(&a.control).await?);
    }
    for m in &a.models {
        control::wake_wait(&mut ctl, m).await?;
    }
    if a.repeats > 0 {
        fan_out(&a, &mut ctl, &chans).await?;
    }
    if a.held > 0 {
        held(&a, &mut ctl).await?;
    }
    Ok(())
}

/// Opens `n` subscribers over `chans`; returns them and the time until
/// every one had its snapshot.
async fn open(
    kind: ClientKind,
    n: usize,
    chans: &[Channel],
    stop: &Arc<tokio::sync::Notify>,
) -> Result<(Subs, f64)> {
    let ready = Arc::new(AtomicUsize::new(0));
    let last: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
    let t_open = Instant::now();
    let shared = subscribers::Shared {
        ready: ready.clone(),
        last: last.clone(),
        stop: stop.clone(),
    };
    let tasks = subscribers::spawn(kind, n, chans, &shared);
    while ready.load(Ordering::Relaxed) < n {
        if t_open.elapsed() > Duration::from_secs(120) {
            bail!(
                "only {} of {n} subscribers got a snapshot",
                ready.load(Ordering::Relaxed),
            );
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok((Subs { tasks, last }, t_open.elapsed().as_secs_f64() * 1e3))
}

/// Ends the subscribers once every one has seen the daemon's current
/// revision (or 10 s passed: those that have not count as missing it), and
/// collects what each saw. Returns that revision with them: an event
/// published after it (a status change while the subscribers were being
/// stopped) is not expected of every subscriber.
async fn close(
    ctl: &mut Client,
    stop: &tokio::sync::Notify,
    subs: Subs,
) -> Result<(Vec<Seen>, u64)> {
    let upto = ctl
        .list_models(ListModelsRequest {})
        .await?
        .into_inner()
        .revision;
    let deadline = Instant::now() + Duration::from_secs(10);
    while subs.last.iter().any(|r| r.load(Ordering::Relaxed) < upto) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.notify_waiters();
    let mut seen = Vec::with_capacity(subs.last.len());
    for h in subs.tasks {
        seen.extend(h.await.context("join")??);
    }
    Ok((seen, upto))
}

/// 10,000 subscribers (or `--held`) held by one daemon: its RSS, and one
/// sleep+wake of the first model delivered to every one of them.
async fn held(a: &Args, ctl: &mut Client) -> Result<()> {
    let mut chans = Vec::new();
    for _ in 0..a.held_connections.max(1) {
        chans.push(control::channel(&a.control).await?);
    }
    let rss = || {
        a.pid
            .and_then(|p| control::rss_bytes(p).ok())
            .map_or(f64::NAN, |b| b as f64)
    };
    let s = "5";
    let mut rows = vec![
        Row::new(
            s,
            format!("{} subscribers: all snapshots received", a.held),
            "ms",
        ),
        Row::new(s, "daemon RSS before", "MB"),
        Row::new(s, format!("daemon RSS with {} subscribers", a.held), "MB"),
        Row::new(s, "RSS per subscriber", "KB"),
        Row::new(
            s,
            format!("event delay to every one of {} p99", a.held),
            "ms",
        ),
        Row::new(s, "events missed (subscriber × revision)", "").target(Target::AtMost(0.0)),
        Row::new(s, "sleep + wake with them", "ms"),
    ];
    let before = rss();
    let stop = Arc::new(tokio::sync::Notify::new());
    let (subs, snap_ms) = open(a.client, a.held, &chans, &stop).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let with = rss();
    let m = &a.models[0];
    let t = Instant::now();
    control::sleep_and_wait(ctl, m).await?;
    control::wake_wait(ctl, m).await?;
    let cycle_ms = t.elapsed().as_secs_f64() * 1e3;
    let (seen, upto) = close(ctl, &stop, subs).await?;
    let v = analyse(&seen, upto);
    let vals = [
        snap_ms,
        before / 1e6,
        with / 1e6,
        (with - before) / a.held as f64 / 1e3,
        v.every_p99,
        v.missed,
        cycle_ms,
    ];
    eprintln!(
        "watch held={}: snapshots in {snap_ms:.0} ms, RSS {:.1} → {:.1} MB, every-p99 {:.1} ms, missed {} (resyncs {})",
        a.held, vals[1], vals[2], v.every_p99, v.missed, v.resyncs
    );
    for (row, x) in rows.iter_mut().zip(vals) {
        row.push(x);
    }
    print_table(
        &format!(
            "5. Watch: {} subscribers held on {} connections",
            a.held, a.held_connections
        ),
        &rows,
    );
    Ok(())
}

async fn fan_out(a: &Args, ctl: &mut Client, chans: &[Channel]) -> Result<()> {
    let s = "5";
    let mut rows = vec![
        Row::new(s, "event delay, all (event, subscriber) p50", "ms"),
        Row::new(s, "event delay, all (event, subscriber) p99", "ms"),
        Row::new(s, "event delay to every subscriber p99", "ms").target(Target::AtMost(20.0)),
        Row::new(s, "event delay max", "ms"),
        Row::new(s, "fan-out spread first→last subscriber p99", "ms"),
        Row::new(s, "events missed (subscriber × revision)", "").target(Target::AtMost(0.0)),
        Row::new(s, "all snapshots received", "ms"),
        Row::new(s, "sleep transition p50, no subscribers", "ms"),
        Row::new(s, "sleep transition p50, with subscribers", "ms"),
        Row::new(s, "wake transition p50, no subscribers", "ms"),
        Row::new(s, "wake transition p50, with subscribers", "ms"),
        Row::new(s, "transition p50 with/without subscribers", "").target(Target::AtMost(1.25)),
        Row::new(s, "daemon CPU per delivery (event × subscriber)", "µs"),
    ];
    let cpu = || {
        a.pid
            .and_then(|p| control::cpu_us(p).ok())
            .unwrap_or(f64::NAN)
    };
    for rep in 0..a.repeats {
        let c0 = cpu();
        let (sleep0, wake0) = cycle(ctl, a).await?;
        let c1 = cpu();
        let stop = Arc::new(tokio::sync::Notify::new());
        let (subs, snap_ms) = open(a.client, a.subscribers, chans, &stop).await?;
        let c2 = cpu();
        let (sleep1, wake1) = cycle(ctl, a).await?;
        let c3 = cpu();
        let (seen, upto) = close(ctl, &stop, subs).await?;
        let v = analyse(&seen, upto);
        let ratio = (median(&sleep1) + median(&wake1)) / (median(&sleep0) + median(&wake0));
        // The daemon's CPU for the cycles with subscribers, less the same
        // cycles' without, over what it delivered.
        let per_delivery = ((c3 - c2) - (c1 - c0)) / v.deliveries.max(1) as f64;
        let vals = [
            v.p50,
            v.p99,
            v.every_p99,
            v.max,
            v.spread_p99,
            v.missed,
            snap_ms,
            median(&sleep0),
            median(&sleep1),
            median(&wake0),
            median(&wake1),
            ratio,
            per_delivery,
        ];
        eprintln!(
            "watch rep={rep}: {} events/subscriber, delay p50 {:.2} p99 {:.2} every-p99 {:.2} ms, missed {} (resyncs {}), snapshots {:.0} ms, sleep {:.1}/{:.1} wake {:.1}/{:.1} ms, daemon {:.2} µs/delivery",
            v.events,
            vals[0],
            vals[1],
            vals[2],
            v.missed,
            v.resyncs,
            snap_ms,
            vals[7],
            vals[8],
            vals[9],
            vals[10],
            vals[12]
        );
        for (row, x) in rows.iter_mut().zip(vals) {
            row.push(x);
        }
    }
    print_table(
        &format!(
            "5. Watch fan-out ({} subscribers on {} connections, {:?} client)",
            a.subscribers, a.connections, a.client
        ),
        &rows,
    );
    Ok(())
}

/// Sleeps and wakes every model `cycles` times; returns the sleep durations
/// (RPC → observed asleep) and wake durations (waited Wake RPC), in ms.
async fn cycle(ctl: &mut Client, a: &Args) -> Result<(Vec<f64>, Vec<f64>)> {
    let (mut sl, mut wk) = (Vec::new(), Vec::new());
    for _ in 0..a.cycles {
        for m in &a.models {
            let t = Instant::now();
            control::sleep_and_wait(ctl, m).await?;
            sl.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            control::wake_wait(ctl, m).await?;
            wk.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok((sl, wk))
}

#[derive(Debug, Default)]
struct Analysis {
    p50: f64,
    p99: f64,
    every_p99: f64,
    max: f64,
    spread_p99: f64,
    missed: f64,
    /// Snapshots after a subscriber's first: it fell behind and was resynced.
    resyncs: usize,
    events: usize,
    /// (event, subscriber) pairs received.
    deliveries: usize,
}

/// Delays and losses over the revisions up to `upto`.
fn analyse(seen: &[Seen], upto: u64) -> Analysis {
    use std::collections::BTreeMap;
    let mut all = Vec::new();
    // revision → (at_ms, first arrival µs, last arrival µs, subscribers)
    let mut by_rev: BTreeMap<u64, (i64, f64, f64, usize)> = BTreeMap::new();
    for (events, _) in seen {
        for &(rev, at, now) in events.iter().filter(|e| e.0 <= upto) {
            all.push(now / 1e3 - at as f64);
            let e = by_rev.entry(rev).or_insert((at, now, now, 0));
            e.1 = e.1.min(now);
            e.2 = e.2.max(now);
            e.3 += 1;
        }
    }
    let every: Vec<f64> = by_rev
        .values()
        .map(|&(at, _, last, _)| last / 1e3 - at as f64)
        .collect();
    let spread: Vec<f64> = by_rev
        .values()
        .map(|&(_, first, last, _)| (last - first) / 1e3)
        .collect();
    let missed: usize = by_rev.values().map(|&(_, _, _, n)| seen.len() - n).sum();
    Analysis {
        p50: percentile(&all, 50.0),
        p99: percentile(&all, 99.0),
        every_p99: percentile(&every, 99.0),
        max: percentile(&all, 100.0),
        spread_p99: percentile(&spread, 99.0),
        missed: missed as f64,
        resyncs: seen.iter().map(|(_, n)| n.saturating_sub(1)).sum(),
        events: by_rev.len(),
        deliveries: all.len(),
    }
}
