//! Scenario 2, streaming: a streamed chat completion of N tokens, direct vs
//! through siesta-proxy (and, with `--nginx` and `--relay`, through nginx
//! and a byte relay for reference), one keep-alive connection each,
//! requests alternating between them so noise hits all alike. Reports time
//! to the first body byte, total time, body frames and SSE events per
//! response.
//!
//! Two controls say what the alternation itself does to the figures:
//! `--warm-pair` sends every siesta request twice in a row, on two
//! connections, and reports the second's TTFB less the first's: the first
//! finds the proxy's code and data cold (it last ran three requests ago),
//! the second warm. `--client current-thread` runs the client on one
//! thread (as wrk does) instead of tokio's multi-threaded runtime, where
//! hyper's connection task and the timing request hand each body frame
//! from thread to thread.

use anyhow::{Context, Result, bail};

use crate::http::{Conn, chat_body, socket_addr, sse_events};
use crate::stats::{Row, Target, median, percentile, print_table};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// fake-vllm's base URL.
    #[arg(long)]
    direct: String,
    /// siesta-proxy's base URL.
    #[arg(long)]
    proxy: String,
    /// nginx in front of the same engine: its TTFB over direct is measured
    /// alongside, for reference (no target).
    #[arg(long)]
    nginx: Option<String>,
    /// A byte relay in front of the same engine (`siesta-bench relay`): its
    /// TTFB over direct is the floor of what any proxy adds here.
    #[arg(long)]
    relay: Option<String>,
    #[arg(long, default_value = "bench")]
    model: String,
    #[arg(long, default_value_t = 256)]
    tokens: u32,
    /// Streamed requests per target per repeat.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Label for the table (e.g. "unpaced" or "paced 2000 tok/s").
    #[arg(long, default_value = "")]
    label: String,
    /// Print TTFB without judging it against the +50 µs target.
    #[arg(long)]
    no_ttfb_target: bool,
    /// Send every siesta request a second time at once, on a second
    /// connection, and report the TTFB of the second (the proxy warm) less
    /// the first's (cold).
    #[arg(long)]
    warm_pair: bool,
    /// The client's tokio runtime (chosen in `main`).
    #[arg(long, value_enum, default_value_t = ClientRuntime::MultiThread)]
    pub client: ClientRuntime,
}

/// The runtime the streaming client runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ClientRuntime {
    /// tokio's default: the timing request on the main thread, hyper's
    /// connection task on a worker (a hand-over between threads per frame).
    MultiThread,
    /// One thread for everything, as wrk's client.
    CurrentThread,
}

#[derive(Debug, Default)]
struct Sample {
    ttfb_us: Vec<f64>,
    total_us: Vec<f64>,
    frames: Vec<f64>,
    events: Vec<f64>,
}

pub async fn run(a: Args) -> Result<()> {
    let body = chat_body(&a.model, a.tokens, true);
    let mut direct = Conn::connect(socket_addr(&a.direct)?).await?;
    let mut proxy = Conn::connect(socket_addr(&a.proxy)?).await?;
    let mut nginx = match &a.nginx {
        Some(url) => Some(Conn::connect(socket_addr(url)?).await?),
        None => None,
    };
    let mut relay = match &a.relay {
        Some(url) => Some(Conn::connect(socket_addr(url)?).await?),
        None => None,
    };
    let mut again = if a.warm_pair {
        Some(Conn::connect(socket_addr(&a.proxy)?).await?)
    } else {
        None
    };
    // Warm every path (pools, caches).
    for _ in 0..5 {
        one(&mut direct, &body).await.context("direct")?;
        one(&mut proxy, &body).await.context("proxy")?;
        if let Some(n) = nginx.as_mut() {
            one(n, &body).await.context("nginx")?;
        }
        if let Some(r) = relay.as_mut() {
            one(r, &body).await.context("relay")?;
        }
        if let Some(w) = again.as_mut() {
            one(w, &body).await.context("proxy again")?;
        }
    }
    let s = if a.label.is_empty() {
        "2".to_string()
    } else {
        format!("2 {}", a.label)
    };
    let mut rows = vec![
        Row::new(&s, "direct TTFB p50", "µs"),
        Row::new(&s, "siesta TTFB p50", "µs"),
        ttfb_row(&s, !a.no_ttfb_target),
        Row::new(&s, "direct TTFB p99", "µs"),
        Row::new(&s, "siesta TTFB p99", "µs"),
        Row::new(&s, "direct total p50", "µs"),
        Row::new(&s, "siesta total p50", "µs"),
        Row::new(&s, "direct body frames / response", ""),
        Row::new(&s, "siesta body frames / response", ""),
        Row::new(&s, "direct SSE events / response", ""),
        Row::new(&s, "siesta SSE events / response", ""),
        Row::new(&s, "responses with fewer SSE events via siesta", "").target(Target::AtMost(0.0)),
    ];
    // Past the fixed rows, in this order: nginx's, the relay's, the warm pair's.
    if nginx.is_some() {
        rows.push(Row::new(&s, "nginx − direct TTFB p50 (reference)", "µs"));
    }
    if relay.is_some() {
        rows.push(Row::new(
            &s,
            "byte relay − direct TTFB p50 (the floor)",
            "µs",
        ));
    }
    if again.is_some() {
        rows.push(Row::new(
            &s,
            "siesta warm − siesta cold TTFB p50 (the same request again at once)",
            "µs",
        ));
    }
    for rep in 0..a.repeats {
        let (mut d, mut p) = (Sample::default(), Sample::default());
        let (mut n, mut r) = (Sample::default(), Sample::default());
        let mut w = Sample::default();
        for _ in 0..a.requests {
            record(&mut d, one(&mut direct, &body).await.context("direct")?);
            record(&mut p, one(&mut proxy, &body).await.context("proxy")?);
            if let Some(c) = again.as_mut() {
                record(&mut w, one(c, &body).await.context("proxy again")?);
            }
            if let Some(c) = nginx.as_mut() {
                record(&mut n, one(c, &body).await.context("nginx")?);
            }
            if let Some(c) = relay.as_mut() {
                record(&mut r, one(c, &body).await.context("relay")?);
            }
        }
        let want = median(&d.events);
        let short = p.events.iter().filter(|&&e| e < want).count() as f64;
        let mut vals = vec![
            median(&d.ttfb_us),
            median(&p.ttfb_us),
            median(&p.ttfb_us) - median(&d.ttfb_us),
            percentile(&d.ttfb_us, 99.0),
            percentile(&p.ttfb_us, 99.0),
            median(&d.total_us),
            median(&p.total_us),
            mean(&d.frames),
            mean(&p.frames),
            mean(&d.events),
            mean(&p.events),
            short,
        ];
        if nginx.is_some() {
            vals.push(median(&n.ttfb_us) - median(&d.ttfb_us));
        }
        if relay.is_some() {
            vals.push(median(&r.ttfb_us) - median(&d.ttfb_us));
        }
        if again.is_some() {
            vals.push(median(&w.ttfb_us) - median(&p.ttfb_us));
        }
        for (row, v) in rows.iter_mut().zip(vals.iter()) {
            row.push(*v);
        }
        eprintln!(
            "stream {} rep={rep}: ttfb direct {:.0}µs siesta {:.0}µs; frames {:.1}/{:.1}; events {:.1}/{:.1}",
            a.label, vals[0], vals[1], vals[7], vals[8], vals[9], vals[10]
        );
    }
    print_table(
        &format!("2. Streaming {} tokens {}", a.tokens, a.label),
        &rows,
    );
    Ok(())
}

fn ttfb_row(s: &str, judged: bool) -> Row {
    let row = Row::new(s, "siesta − direct TTFB p50", "µs");
    if judged {
        row.target(Target::AtMost(50.0))
    } else {
        row
    }
}

async fn one(c: &mut Conn, body: &str) -> Result<crate::http::Timed> {
    let t = c
        .request("POST", "/v1/chat/completions", Some(body))
        .await?;
    if t.status != 200 {
        bail!("status {}: {}", t.status, String::from_utf8_lossy(&t.body));
    }
    Ok(t)
}

fn record(s: &mut Sample, t: crate::http::Timed) {
    s.ttfb_us.push(t.first_byte.as_secs_f64() * 1e6);
    s.total_us.push(t.total.as_secs_f64() * 1e6);
    s.frames.push(t.frames as f64);
    s.events.push(sse_events(&t.body) as f64);
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}
