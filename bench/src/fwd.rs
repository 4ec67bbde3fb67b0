//! Scenario 1, forwarding overhead: wrk against each target (direct,
//! siesta-proxy, nginx, a byte relay, LiteLLM) at concurrency 1 and 64,
//! interleaved within each repeat so that machine noise spreads over all of
//! them; ratios are taken within one repeat.

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::http::{Conn, chat_body, socket_addr};
use crate::stats::{Row, Target, print_table};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Targets as NAME=URL, e.g. direct=http://127.0.0.1:8000 (names
    /// `direct`, `siesta`, `nginx`, `litellm` get the comparisons;
    /// `relay`, a byte relay, gives the floor of the added latency).
    #[arg(long = "target", required = true)]
    targets: Vec<String>,
    #[arg(long, default_value = "bench")]
    model: String,
    /// Seconds per wrk run.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    #[arg(long, default_value = "1,64", value_delimiter = ',')]
    concurrency: Vec<u32>,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    #[arg(long, default_value = "wrk")]
    wrk: String,
    /// NAME=PGID: the process group serving target NAME (all its processes
    /// and threads); its CPU time per request is reported. Repeatable.
    #[arg(long = "cpu")]
    cpu: Vec<String>,
}

#[derive(Debug, Clone, Copy, Default)]
struct WrkResult {
    rps: f64,
    /// Requests wrk completed.
    requests: f64,
    p50_us: f64,
    p99_us: f64,
    errors: u64,
    /// CPU time of the target's process group per request (µs); NaN when
    /// its group was not given.
    cpu_us: f64,
}

pub async fn run(a: Args) -> Result<()> {
    let targets: Vec<(String, String)> = a
        .targets
        .iter()
        .map(|t| {
            let (n, u) = t.split_once('=').context("target must be NAME=URL")?;
            Ok((n.to_string(), u.trim_end_matches('/').to_string()))
        })
        .collect::<Result<_>>()?;
    let groups: Vec<Option<i32>> = targets
        .iter()
        .map(|(name, _)| group_of(&a.cpu, name))
        .collect::<Result<_>>()?;
    let body = chat_body(&a.model, 16, false);
    for (name, url) in &targets {
        let mut c = Conn::connect(socket_addr(url)?).await?;
        let t = c
            .request("POST", "/v1/chat/completions", Some(&body))
            .await?;
        if t.status != 200 {
            bail!(
                "{name}: status {} {}",
                t.status,
                String::from_utf8_lossy(&t.body)
            );
        }
    }
    let dir = std::env::temp_dir().join(format!("siesta-bench-wrk-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let lua = dir.join("post.lua");
    std::fs::write(
        &lua,
        format!(
            "wrk.method = \"POST\"\nwrk.headers[\"Content-Type\"] = \"application/json\"\nwrk.body = [[{body}]]\n"
        ),
    )?;

    // Warm-up, discarded: pools, caches, LiteLLM's lazy start-up.
    for (name, url) in &targets {
        let warm = Args {
            duration: 2,
            ..a.clone()
        };
        wrk(&warm, url, 8, &lua).with_context(|| format!("warm-up {name}"))?;
    }
    let mut rows = Vec::new();
    for &c in &a.concurrency {
        let mut results: Vec<Vec<WrkResult>> = vec![Vec::new(); targets.len()];
        for rep in 0..a.repeats {
            for (i, (name, url)) in targets.iter().enumerate() {
                let before = groups[i].map(group_cpu_ticks);
                let mut r = wrk(&a, url, c, &lua)?;
                // A process of the group may exit meanwhile: never below 0.
                r.cpu_us = match (groups[i], before) {
                    (Some(g), Some(b)) if r.requests > 0.0 => {
                        group_cpu_ticks(g).saturating_sub(b) as f64 * 1e6
                            / ticks_per_s()
                            / r.requests
                    }
                    _ => f64::NAN,
                };
                eprintln!(
                    "fwd c={c} rep={rep} {name}: {:.0} req/s p50 {:.0}µs p99 {:.0}µs errors {} cpu {:.1}µs/req",
                    r.rps, r.p50_us, r.p99_us, r.errors, r.cpu_us
                );
                results[i].push(r);
            }
        }
        rows.extend(rows_for(&targets, &results, c, a.repeats));
    }
    print_table(
        "1. Forwarding overhead (wrk, keep-alive, small chat completion)",
        &rows,
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn rows_for(targets: &[(String, String)], res: &[Vec<WrkResult>], c: u32, reps: usize) -> Vec<Row> {
    let s = format!("1 c={c}");
    let mut rows = Vec::new();
    for (i, (name, _)) in targets.iter().enumerate() {
        let mut rps = Row::new(&s, format!("{name} throughput"), "req/s");
        let mut p50 = Row::new(&s, format!("{name} p50"), "µs");
        let mut p99 = Row::new(&s, format!("{name} p99"), "µs");
        let mut err = Row::new(&s, format!("{name} non-2xx/errors"), "");
        for r in &res[i] {
            rps.push(r.rps);
            p50.push(r.p50_us);
            p99.push(r.p99_us);
            err.push(r.errors as f64);
        }
        rows.extend([rps, p50, p99, err]);
        if res[i].iter().all(|r| !r.cpu_us.is_nan()) {
            // A proxy's own CPU; for `direct`, the engine's.
            let label = match name.as_str() {
                "direct" => "engine CPU per request (direct)".to_owned(),
                _ => format!("{name} CPU per request"),
            };
            let mut cpu = Row::new(&s, label, "µs");
            for r in &res[i] {
                cpu.push(r.cpu_us);
            }
            rows.push(cpu);
        }
    }
    let idx = |n: &str| targets.iter().position(|(name, _)| name == n);
    let ratio = |a: usize, b: usize, f: fn(&WrkResult) -> f64, metric: &str, t: Option<Target>| {
        let mut row = Row::new(&s, metric.to_string(), "");
        if let Some(t) = t {
            row = row.target(t);
        }
        for (x, y) in res[a].iter().zip(&res[b]).take(reps) {
            row.push(f(x) / f(y));
        }
        row
    };
    let diff = |a: usize, b: usize, f: fn(&WrkResult) -> f64, metric: &str, t: Option<Target>| {
        let mut row = Row::new(&s, metric.to_string(), "µs");
        if let Some(t) = t {
            row = row.target(t);
        }
        for (x, y) in res[a].iter().zip(&res[b]).take(reps) {
            row.push(f(x) - f(y));
        }
        row
    };
    if let Some(si) = idx("siesta") {
        if let Some(ni) = idx("nginx") {
            rows.push(ratio(
                si,
                ni,
                |r| r.rps,
                "siesta/nginx throughput",
                Some(Target::AtLeast(1.0)),
            ));
        }
        if let Some(ni) = idx("nginx")
            && res[si].iter().chain(&res[ni]).all(|r| !r.cpu_us.is_nan())
        {
            rows.push(ratio(
                si,
                ni,
                |r| r.cpu_us,
                "siesta/nginx CPU per request",
                None,
            ));
        }
        if let Some(li) = idx("litellm") {
            rows.push(ratio(
                si,
                li,
                |r| r.rps,
                "siesta/LiteLLM throughput",
                Some(Target::AtLeast(10.0)),
            ));
        }
        if let Some(di) = idx("direct") {
            let (t50, t99) = if c == 1 {
                (Some(Target::AtMost(30.0)), Some(Target::AtMost(150.0)))
            } else {
                (None, None)
            };
            rows.push(diff(si, di, |r| r.p50_us, "siesta − direct p50", t50));
            rows.push(diff(si, di, |r| r.p99_us, "siesta − direct p99", t99));
            if let Some(ni) = idx("nginx") {
                rows.push(diff(ni, di, |r| r.p50_us, "nginx − direct p50", None));
            }
            if let Some(ri) = idx("relay") {
                rows.push(diff(
                    ri,
                    di,
                    |r| r.p50_us,
                    "byte relay − direct p50 (the floor)",
                    None,
                ));
            }
        }
    }
    rows
}

fn wrk(a: &Args, url: &str, c: u32, lua: &std::path::Path) -> Result<WrkResult> {
    let threads = c.clamp(1, 2);
    let out = Command::new(&a.wrk)
        .args(["-t", &threads.to_string(), "-c", &c.to_string()])
        .args([
            "-d",
            &format!("{}s", a.duration),
            "--timeout",
            "10s",
            "--latency",
        ])
        .arg("-s")
        .arg(lua)
        .arg(format!("{url}/v1/chat/completions"))
        .output()
        .with_context(|| format!("run {}", a.wrk))?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    if !out.status.success() {
        bail!("wrk failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    }
    parse_wrk(&text).with_context(|| format!("parse wrk output:\n{text}"))
}

fn parse_wrk(text: &str) -> Result<WrkResult> {
    let mut r = WrkResult::default();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["Requests/sec:", v] => r.rps = v.parse()?,
            [n, "requests", "in", ..] => r.requests = n.parse()?,
            ["50%", v] => r.p50_us = dur_us(v)?,
            ["99%", v] => r.p99_us = dur_us(v)?,
            ["Non-2xx", "or", "3xx", "responses:", v] => r.errors += v.parse::<u64>()?,
            ["Socket", "errors:", rest @ ..] => {
                for w in rest.chunks(2) {
                    if let [_, v] = w {
                        r.errors += v.trim_end_matches(',').parse::<u64>().unwrap_or(0);
                    }
                }
            }
            _ => {}
        }
    }
    if r.rps == 0.0 {
        bail!("no Requests/sec");
    }
    Ok(r)
}

/// The process group given for `name` with `--cpu NAME=PGID`.
fn group_of(cpu: &[String], name: &str) -> Result<Option<i32>> {
    for c in cpu {
        let (n, g) = c.split_once('=').context("--cpu must be NAME=PGID")?;
        if n == name {
            return Ok(Some(g.parse().with_context(|| format!("--cpu {c}: PGID"))?));
        }
    }
    Ok(None)
}

/// User + system CPU ticks of every process in group `pgid` (all their
/// threads: /proc/PID/stat counts them), from /proc.
fn group_cpu_ticks(pgid: i32) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(crate::control::cpu_ticks)
        .filter(|&(group, _)| group == pgid)
        .map(|(_, ticks)| ticks)
        .sum()
}

/// Clock ticks per second of /proc's CPU times (USER_HZ: 100 on Linux).
fn ticks_per_s() -> f64 {
    100.0
}

/// wrk prints `85.00us`, `1.20ms`, `2.00s`, `1.00m`.
fn dur_us(v: &str) -> Result<f64> {
    let (num, mult) = if let Some(n) = v.strip_suffix("us") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1e3)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1e6)
    } else if let Some(n) = v.strip_suffix('m') {
        (n, 60e6)
    } else {
        bail!("unit of {v}")
    };
    Ok(num.parse::<f64>()? * mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_wrk_output() {
        let text = "Running 1s test @ http://x\n  Latency Distribution\n     50%   85.00us\n     75%  100.00us\n     90%  1.20ms\n     99%    2.50ms\n  1000 requests in 1.00s\n  Socket errors: connect 0, read 2, write 0, timeout 1\n  Non-2xx or 3xx responses: 3\nRequests/sec:   1000.50\nTransfer/sec: 1MB\n";
        let r = parse_wrk(text).unwrap();
        assert_eq!(r.rps, 1000.5);
        assert_eq!(r.p50_us, 85.0);
        assert_eq!(r.p99_us, 2500.0);
        assert_eq!(r.errors, 6);
        assert_eq!(r.requests, 1000.0);
    }

    #[test]
    fn counts_the_cpu_of_its_own_process_group() {
        let pgid = std::fs::read_to_string("/proc/self/stat").unwrap();
        let pgid: i32 = pgid
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .nth(2)
            .unwrap()
            .parse()
            .unwrap();
        let before = group_cpu_ticks(pgid);
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < std::time::Duration::from_millis(200) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        assert!(
            group_cpu_ticks(pgid) > before,
            "200 ms of spinning not counted"
        );
        assert_eq!(group_cpu_ticks(-7), 0);
    }
}
