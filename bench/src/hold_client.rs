//! Scenario 4 beyond one process's open-files limit. `siesta-bench hold
//! --clients N` spawns N `siesta-bench hold-client` processes; each opens
//! its share of the held connections from its own loopback source address
//! (127.0.0.1, .2, …, so each has a full ephemeral port range), prints
//! `connected N` on stdout once every connection is open and its request
//! sent, then `result {json}` (status counts, errors, the last 200's time)
//! when every response is in. The coordinator waits for every `connected`
//! line before it measures "all held", so all are held at once.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::process::Stdio;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::http::{Conn, chat_body, socket_addr, unix_us};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The proxy's base URL (replicas sharing it with --reuse-port).
    #[arg(long)]
    proxy: String,
    #[arg(long, default_value = "bench-hold")]
    model: String,
    #[arg(long)]
    requests: usize,
    /// Connections being opened at once.
    #[arg(long, default_value_t = 200)]
    connect_parallel: usize,
    /// Loopback source address to connect from (none: the kernel's choice).
    #[arg(long)]
    from: Option<IpAddr>,
}

/// One held request's answer.
pub struct Answer {
    pub status: u16,
    /// When the response was complete (Unix µs).
    pub at_us: f64,
    /// The start of the body of a non-200 response.
    pub why: Option<String>,
}

/// One held request.
pub type HeldTask = JoinHandle<Result<Answer>>;

/// Opens `n` connections to `addr` (`parallel` connecting at once, spread
/// over `froms`) and sends one request on each; returns once every connect
/// has been started. The gate is returned so a caller can wait for the last
/// connects to finish (acquire all of its permits).
pub async fn open(
    addr: SocketAddr,
    froms: &[Option<IpAddr>],
    body: Arc<String>,
    n: usize,
    parallel: usize,
) -> Result<(Vec<HeldTask>, Arc<Semaphore>)> {
    let gate = Arc::new(Semaphore::new(parallel));
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let permit = gate.clone().acquire_owned().await?;
        let body = body.clone();
        let from = froms[i % froms.len()];
        tasks.push(tokio::spawn(async move {
            let mut c = Conn::connect_from(addr, from).await;
            drop(permit);
            let c = c.as_mut().map_err(|e| anyhow::anyhow!("{e:#}"))?;
            let t = c
                .request("POST", "/v1/chat/completions", Some(&body))
                .await?;
            let at = unix_us();
            // The body of an error names its reason (e.g. which shed).
            let why = (t.status != 200).then(|| {
                let text = String::from_utf8_lossy(&t.body);
                text.chars().take(300).collect::<String>()
            });
            Ok::<Answer, anyhow::Error>(Answer {
                status: t.status,
                at_us: at,
                why,
            })
        }));
    }
    Ok((tasks, gate))
}

/// What a batch of held requests came to.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Responses by HTTP status.
    pub statuses: BTreeMap<u16, usize>,
    /// Requests that got no response (connect or I/O error).
    pub errors: usize,
    pub first_err: Option<String>,
    /// Unix µs of the last 200 response (0: none).
    pub last_ok_us: f64,
}

impl Outcome {
    pub async fn collect(tasks: Vec<HeldTask>) -> Result<Outcome> {
        let mut o = Outcome::default();
        for t in tasks {
            match t.await.context("join")? {
                Ok(Answer { status, at_us, why }) => {
                    *o.statuses.entry(status).or_default() += 1;
                    if status == 200 {
                        o.last_ok_us = o.last_ok_us.max(at_us);
                    } else {
                        o.first_err.get_or_insert_with(|| {
                            format!("status {status}: {}", why.unwrap_or_default())
                        });
                    }
                }
                Err(e) => {
                    o.errors += 1;
                    o.first_err.get_or_insert_with(|| format!("{e:#}"));
                }
            }
        }
        Ok(o)
    }

    pub fn ok(&self) -> usize {
        self.statuses.get(&200).copied().unwrap_or(0)
    }

    /// Errors plus every non-200 response.
    pub fn lost(&self) -> usize {
        self.errors + self.statuses.values().sum::<usize>() - self.ok()
    }

    pub fn merge(&mut self, other: Outcome) {
        for (s, n) in other.statuses {
            *self.statuses.entry(s).or_default() += n;
        }
        self.errors += other.errors;
        if self.first_err.is_none() {
            self.first_err = other.first_err;
        }
        self.last_ok_us = self.last_ok_us.max(other.last_ok_us);
    }

    /// `200 × 99990, 503 × 10, no response × 0`.
    pub fn summary(&self) -> String {
        let mut parts: Vec<String> = self
            .statuses
            .iter()
            .map(|(s, n)| format!("{s} × {n}"))
            .collect();
        parts.push(format!("no response × {}", self.errors));
        parts.join(", ")
    }

    fn to_json(&self) -> serde_json::Value {
        let statuses: serde_json::Map<String, serde_json::Value> = self
            .statuses
            .iter()
            .map(|(s, n)| (s.to_string(), (*n).into()))
            .collect();
        serde_json::json!({
            "statuses": statuses,
            "errors": self.errors,
            "first_err": self.first_err,
            "last_ok_us": self.last_ok_us,
        })
    }

    fn from_json(v: &serde_json::Value) -> Result<Outcome> {
        let mut o = Outcome::default();
        for (s, n) in v["statuses"].as_object().context("no statuses")? {
            o.statuses
                .insert(s.parse()?, n.as_u64().context("status count")? as usize);
        }
        o.errors = v["errors"].as_u64().context("no errors")? as usize;
        o.first_err = v["first_err"].as_str().map(str::to_owned);
        o.last_ok_us = v["last_ok_us"].as_f64().context("no last_ok_us")?;
        Ok(o)
    }
}

/// `siesta-bench hold-client`: hold, report `connected`, then `result`.
pub async fn run(a: Args) -> Result<()> {
    if let Some(limit) = crate::hold::open_files_limit("self")
        && a.requests + 100 > limit
    {
        bail!(
            "hold-client: {} connections need more than the open-files limit {limit}",
            a.requests
        );
    }
    let addr = socket_addr(&a.proxy)?;
    let body = Arc::new(chat_body(&a.model, 4, false));
    let (tasks, gate) = open(addr, &[a.from], body, a.requests, a.connect_parallel).await?;
    // Every connect done (each task drops its permit after connecting).
    let _all = gate.acquire_many(a.connect_parallel as u32).await?;
    println!("connected {}", tasks.len());
    let o = Outcome::collect(tasks).await?;
    println!("result {}", o.to_json());
    Ok(())
}

/// The spawned `hold-client` processes.
pub struct Clients {
    children: Vec<(Child, Lines<BufReader<ChildStdout>>)>,
}

impl Clients {
    /// Starts `n` clients sharing `requests`, client i from 127.0.0.(i+1).
    pub fn spawn(
        n: usize,
        proxy: &str,
        model: &str,
        requests: usize,
        parallel: usize,
    ) -> Result<Clients> {
        let exe = std::env::current_exe().context("own executable")?;
        let mut children = Vec::with_capacity(n);
        for i in 0..n {
            let share = requests / n + usize::from(i < requests % n);
            let mut child = Command::new(&exe)
                .args(["hold-client", "--proxy", proxy, "--model", model])
                .arg("--requests")
                .arg(share.to_string())
                .arg("--connect-parallel")
                .arg(parallel.to_string())
                .arg("--from")
                .arg(IpAddr::from([127, 0, 0, 1 + i as u8]).to_string())
                .stdout(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("spawn {} hold-client", exe.display()))?;
            let out = child.stdout.take().context("client stdout")?;
            children.push((child, BufReader::new(out).lines()));
        }
        Ok(Clients { children })
    }

    /// Waits for every client's `connected` line; returns how many are held.
    pub async fn connected(&mut self) -> Result<usize> {
        let mut total = 0;
        for (i, (_, lines)) in self.children.iter_mut().enumerate() {
            let line = next_line(lines, i, "connected").await?;
            total += line.trim().parse::<usize>().context("connected count")?;
        }
        Ok(total)
    }

    /// Waits for every client's result and exit; merges the outcomes.
    pub async fn finish(self) -> Result<Outcome> {
        let mut all = Outcome::default();
        for (i, (mut child, mut lines)) in self.children.into_iter().enumerate() {
            let line = next_line(&mut lines, i, "result").await?;
            let v: serde_json::Value = serde_json::from_str(&line)
                .with_context(|| format!("hold-client {i}: bad result {line:?}"))?;
            all.merge(Outcome::from_json(&v)?);
            let status = child.wait().await?;
            if !status.success() {
                bail!("hold-client {i} exited with {status}");
            }
        }
        Ok(all)
    }
}

/// The rest of the next `WORD ...` line of client `i`.
async fn next_line(
    lines: &mut Lines<BufReader<ChildStdout>>,
    i: usize,
    word: &str,
) -> Result<String> {
    let line = lines
        .next_line()
        .await?
        .with_context(|| format!("hold-client {i} ended before `{word}` (see its stderr)"))?;
    line.strip_prefix(word)
        .map(str::to_owned)
        .with_context(|| format!("hold-client {i}: expected `{word} ...`, got {line:?}"))
}
