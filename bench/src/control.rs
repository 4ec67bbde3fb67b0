//! gRPC helpers against siesta-control, and process memory from /proc.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use siesta_proto::v1::control_client::ControlClient;
use siesta_proto::v1::{GetModelRequest, ModelState, SleepRequest, WakeRequest};
use tonic::transport::{Channel, Endpoint};

use crate::http::{Conn, proxy_state};

pub type Client = ControlClient<Channel>;

/// One HTTP/2 connection to the control plane.
pub async fn connect(url: &str) -> Result<Client> {
    Ok(ControlClient::new(channel(url).await?).max_decoding_message_size(256 << 20))
}

/// One HTTP/2 connection to the control plane, as a channel.
pub async fn channel(url: &str) -> Result<Channel> {
    Endpoint::from_shared(url.to_string())?
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("connect to control at {url}"))
}

pub async fn state(c: &mut Client, name: &str) -> Result<ModelState> {
    let r = c
        .get_model(GetModelRequest {
            name: name.to_string(),
        })
        .await?
        .into_inner();
    Ok(r.model
        .map(|m| m.state())
        .unwrap_or(ModelState::Unspecified))
}

/// Between two polls of [`wait_state`], on async-io's timer (the kernel's
/// high-resolution clock, as fake-vllm's pacing). Not tokio's sleep: its
/// timer has a 1 ms grain, and the 2 ms pause it had until run AA lasted 2–3 ms, so a
/// transition was seen up to that late. Scenario 5's sleep transition read
/// 3.9–4.1 ms without subscribers and 4.5–4.6 with them; polled every
/// 250 µs it reads 1.9–2.2 and 2.6–3.6. The lag, added to both, had pulled
/// their ratio (the ≤ 1.25× target) toward 1 (BENCHMARKS.md, run AA).
const POLL: Duration = Duration::from_micros(250);

/// Polls GetModel every [`POLL`] until the model is in `want`.
pub async fn wait_state(
    c: &mut Client,
    name: &str,
    want: ModelState,
    limit: Duration,
) -> Result<()> {
    let start = Instant::now();
    loop {
        let s = state(c, name).await?;
        if s == want {
            return Ok(());
        }
        if start.elapsed() > limit {
            bail!("{name}: still {s:?} after {limit:?}, want {want:?}");
        }
        async_io::Timer::after(POLL).await;
    }
}

/// Puts the model to sleep at level 1 and waits until control says asleep.
pub async fn sleep_and_wait(c: &mut Client, name: &str) -> Result<()> {
    c.sleep(SleepRequest {
        name: name.to_string(),
        level: 1,
    })
    .await
    .with_context(|| format!("Sleep {name}"))?;
    wait_state(c, name, ModelState::Asleep, Duration::from_secs(60)).await
}

/// Wakes the model and waits (server side) until it is awake.
pub async fn wake_wait(c: &mut Client, name: &str) -> Result<()> {
    c.wake(WakeRequest {
        name: name.to_string(),
        wait: true,
        timeout_ms: 120_000,
    })
    .await
    .with_context(|| format!("Wake {name}"))?;
    wait_state(c, name, ModelState::Awake, Duration::from_secs(120)).await
}

/// Waits until the proxy's model listing no longer says the model is
/// awake (it saw the Watch event). Falls back to a short pause when the
/// listing carries no state.
pub async fn wait_proxy_not_awake(proxy: &mut Conn, name: &str) -> Result<()> {
    let start = Instant::now();
    loop {
        match proxy_state(proxy, name).await? {
            None => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                return Ok(());
            }
            Some(s) if s == "asleep" => return Ok(()),
            Some(s) => {
                if start.elapsed() > Duration::from_secs(10) {
                    bail!("proxy still reports {name} as {s}");
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A process's group and its user + system CPU ticks (all its threads;
/// USER_HZ, 100 per second on Linux), from /proc/PID/stat.
pub fn cpu_ticks(pid: u32) -> Option<(i32, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command's closing parenthesis: state(3) ppid pgrp(5) ... utime(14) stime(15).
    let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    Some((f.get(2)?.parse().ok()?, n(11)? + n(12)?))
}

/// User + system CPU time of a process (all its threads) in µs.
pub fn cpu_us(pid: u32) -> Result<f64> {
    let (_, ticks) = cpu_ticks(pid).with_context(|| format!("read /proc/{pid}/stat"))?;
    Ok(ticks as f64 * 1e4)
}

/// Resident set size of a process in bytes (VmRSS).
pub fn rss_bytes(pid: u32) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("read /proc/{pid}/status"))?;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("VmRSS:") {
            let kb: u64 = rest
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .context("VmRSS")?;
            return Ok(kb * 1024);
        }
    }
    bail!("no VmRSS for pid {pid}")
}
