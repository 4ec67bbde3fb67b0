//! Scenario 3, release after wake: a request sent through the proxy to a
//! sleeping model is held, the proxy's Demand wakes it, and fake-vllm
//! records when its wake finished and when the request arrived. The
//! metric is arrival − wake-finished; when fake-vllm does not record
//! arrivals, the client's receipt of the response − wake-finished stands
//! in (an upper bound: it adds the engine's reply and the way back).

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::control;
use crate::http::{Conn, chat_body, socket_addr, unix_us};
use crate::stats::{Row, Target, median, percentile, print_table};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[arg(long)]
    control: String,
    #[arg(long)]
    proxy: String,
    /// fake-vllm's base URL (for /fake/stats).
    #[arg(long)]
    engine: String,
    #[arg(long, default_value = "bench")]
    model: String,
    /// Sleep/hold/wake rounds per repeat.
    #[arg(long, default_value_t = 100)]
    rounds: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

pub async fn run(a: Args) -> Result<()> {
    let mut ctl = control::connect(&a.control).await?;
    let mut proxy = Conn::connect(socket_addr(&a.proxy)?).await?;
    let mut proxy_admin = Conn::connect(socket_addr(&a.proxy)?).await?;
    let mut engine = Conn::connect(socket_addr(&a.engine)?).await?;
    let body = chat_body(&a.model, 4, false);
    let s = "3";
    let mut rows = vec![
        Row::new(s, "wake-finished → request at engine p50", "µs"),
        Row::new(s, "wake-finished → request at engine p99", "µs").target(Target::AtMost(5000.0)),
        Row::new(s, "wake-finished → response at client p50", "µs"),
        Row::new(s, "wake-finished → response at client p99", "µs").target(Target::AtMost(5000.0)),
        Row::new(s, "client hold (send → response) p50", "µs"),
        Row::new(s, "client hold (send → response) p99", "µs"),
        Row::new(s, "rounds without a recorded wake", ""),
        Row::new(s, "for reference: direct round trip p50", "µs"),
    ];
    control::wake_wait(&mut ctl, &a.model).await?;
    for rep in 0..a.repeats {
        let (mut arrive, mut respond, mut hold) = (Vec::new(), Vec::new(), Vec::new());
        let mut missing = 0.0;
        let mut rtt = Vec::new();
        for _ in 0..50 {
            let t = engine
                .request("POST", "/v1/chat/completions", Some(&body))
                .await?;
            rtt.push(t.total.as_secs_f64() * 1e6);
        }
        for _ in 0..a.rounds {
            control::sleep_and_wait(&mut ctl, &a.model).await?;
            control::wait_proxy_not_awake(&mut proxy_admin, &a.model).await?;
            let t0 = unix_us();
            let t = proxy
                .request("POST", "/v1/chat/completions", Some(&body))
                .await
                .context("held request")?;
            let t1 = unix_us();
            if t.status != 200 {
                bail!(
                    "held request: {} {}",
                    t.status,
                    String::from_utf8_lossy(&t.body)
                );
            }
            let stats = engine
                .get_json("/fake/stats")
                .await
                .context("GET /fake/stats")?;
            let wake = latest(&stats, &is_wake_key).filter(|&w| w >= t0 - 1000.0);
            let Some(wake) = wake else {
                missing += 1.0;
                continue;
            };
            if let Some(arr) = latest(&stats, &is_arrival_key).filter(|&x| x >= wake - 1e6) {
                arrive.push(arr - wake);
            }
            respond.push(t1 - wake);
            hold.push(t1 - t0);
        }
        let vals = [
            median(&arrive),
            percentile(&arrive, 99.0),
            median(&respond),
            percentile(&respond, 99.0),
            median(&hold),
            percentile(&hold, 99.0),
            missing,
            median(&rtt),
        ];
        eprintln!(
            "release rep={rep}: arrive p50 {:.0} p99 {:.0} µs; respond p50 {:.0} p99 {:.0} µs; hold p50 {:.0} µs; missing {missing}",
            vals[0], vals[1], vals[2], vals[3], vals[4]
        );
        for (row, v) in rows.iter_mut().zip(vals) {
            row.push(v);
        }
    }
    print_table(
        "3. Release after wake (sleep → held request → Demand → wake)",
        &rows,
    );
    Ok(())
}

fn is_wake_key(k: &str) -> bool {
    let k = k.to_ascii_lowercase();
    k.contains("wake") && (k.contains("finish") || k.contains("done") || k.contains("end"))
}

fn is_arrival_key(k: &str) -> bool {
    let k = k.to_ascii_lowercase();
    k.contains("arriv") || k.contains("received") || (k.contains("request") && k.contains("_at"))
}

/// The latest time (µs since epoch) under any key matching `key` anywhere
/// in the stats document; numbers are read by magnitude as s, ms, µs or ns.
fn latest(v: &Value, key: &dyn Fn(&str) -> bool) -> Option<f64> {
    let mut best: Option<f64> = None;
    walk(v, false, key, &mut best);
    best
}

fn walk(v: &Value, under: bool, key: &dyn Fn(&str) -> bool, best: &mut Option<f64>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                walk(x, under || key(k), key, best);
            }
        }
        Value::Array(xs) => xs.iter().for_each(|x| walk(x, under, key, best)),
        Value::Number(n) if under => {
            if let Some(us) = n.as_f64().and_then(to_unix_us) {
                *best = Some(best.map_or(us, |b: f64| b.max(us)));
            }
        }
        _ => {}
    }
}

fn to_unix_us(x: f64) -> Option<f64> {
    match x {
        x if x >= 1e17 => Some(x / 1e3),
        x if x >= 1e14 => Some(x),
        x if x >= 1e11 => Some(x * 1e3),
        x if x >= 1e9 => Some(x * 1e6),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_latest_by_key() {
        let v = serde_json::json!({
            "wakes": [{"finished_unix_us": 1_700_000_000_000_000u64}],
            "last_wake_finished_unix_ms": 1_700_000_000_100u64,
            "requests": [{"arrived_unix_ms": 1_700_000_000_200.5}],
            "count": 3,
        });
        assert_eq!(latest(&v, &is_wake_key), Some(1_700_000_000_100_000.0));
        assert_eq!(latest(&v, &is_arrival_key), Some(1_700_000_000_200_500.0));
    }
}
