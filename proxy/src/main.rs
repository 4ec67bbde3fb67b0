//! `siesta-proxy`: parse flags, init tracing, bind, serve until SIGINT/SIGTERM.
#![forbid(unsafe_code)]

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use siesta_proxy::{Proxy, ProxyConfig};
use tokio_util::sync::CancellationToken;

/// siesta's OpenAI-compatible front door: route, hold, forward, shed.
#[derive(Debug, Parser)]
#[command(name = "siesta-proxy", version)]
struct Args {
    /// Control plane URL; repeat for several. A host name may resolve to
    /// several addresses, each watched.
    #[arg(
        long = "control",
        env = "SIESTA_CONTROL",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:50051"
    )]
    controls: Vec<String>,
    /// Address for client traffic.
    #[arg(long, env = "SIESTA_PROXY_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Bind the client address with SO_REUSEPORT: several replicas started
    /// with it on one host share the address and the kernel spreads new
    /// connections over them (each replica is an independent proxy).
    #[arg(long, env = "SIESTA_PROXY_REUSE_PORT")]
    reuse_port: bool,
    /// Serving threads (default: one per CPU the process may use up to two,
    /// then half of them: the proxy shares its host with engines). Each runs
    /// its own single-threaded runtime and accepts from the one listener; a
    /// connection, its requests and their upstream connections stay on the
    /// thread that accepted it (nginx's worker model: no hand-offs between
    /// threads on the request path). The first thread also runs the Watch
    /// streams, the hold queue and the admin listener.
    #[arg(long, env = "SIESTA_PROXY_THREADS", value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
    /// Run the serving threads as one work-stealing tokio runtime instead
    /// (connections move between threads; the earlier model, kept to compare).
    #[arg(long, env = "SIESTA_PROXY_WORK_STEALING")]
    work_stealing: bool,
    /// Address for /metrics, /healthz and /readyz.
    #[arg(
        long,
        env = "SIESTA_PROXY_ADMIN_LISTEN",
        default_value = "127.0.0.1:9090"
    )]
    admin_listen: SocketAddr,
    /// After binding, write `http=IP:PORT` and `admin=IP:PORT` lines here.
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// Bearer token for the control planes.
    #[arg(long, env = "SIESTA_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// API key clients must send as `Authorization: Bearer KEY`; repeat or
    /// comma-separate for several. None: no authentication.
    #[arg(
        long = "api-key",
        env = "SIESTA_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    api_keys: Vec<String>,
    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = siesta_proxy::DEFAULT_MAX_BODY_BYTES)]
    max_body: usize,
    /// Largest request head (request line and headers), in bytes.
    #[arg(long, default_value_t = 64 * 1024)]
    max_header_bytes: usize,
    /// Time allowed to receive a request's headers.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    header_timeout: std::time::Duration,
    /// Longest wait for more of a request's body (between reads, as nginx's
    /// client_body_timeout; not a deadline on the whole body): a body that stalls this long
    /// gets 408. A body that takes longer than this must also average 1 KiB/s (408 below).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    body_timeout: std::time::Duration,
    /// How long a write to a client may wait for the client to read (a client that stops
    /// reading a streamed answer is cut after this, and its request ends at the engine; over
    /// HTTP/2, a stream the client stops reading is timed on its own).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    send_timeout: std::time::Duration,
    /// How long a request waits for the first snapshot from a control plane (a proxy just
    /// started knows no model yet) before it is answered 503 `proxy_not_ready` with
    /// Retry-After, never 404.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    first_snapshot_wait: std::time::Duration,
    /// Identity sent to control planes (default `proxy@HOST:PORT`, with `/PID` added under
    /// --reuse-port).
    #[arg(long)]
    proxy_id: Option<String>,
    /// Time allowed for in-flight requests to finish on shutdown.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    drain_timeout: std::time::Duration,
    /// How long an idle connection to an engine is kept; keep it below the
    /// engines' keep-alive (vLLM: 5 s).
    #[arg(long, default_value = "4s", value_parser = humantime::parse_duration)]
    upstream_idle_timeout: std::time::Duration,
    /// Requests at one engine at once (its connections from this proxy);
    /// more wait for a slot up to their model's hold limit, then get 503
    /// `engine_busy` with Retry-After.
    #[arg(long, default_value_t = siesta_proxy::DEFAULT_ENGINE_CONCURRENCY as u32,
          value_parser = clap::value_parser!(u32).range(1..))]
    engine_concurrency: u32,
    /// How long an engine may send nothing on a request: no response head
    /// (a non-streamed answer comes whole, so raise it for longer ones), or
    /// a pause between parts of its body; nor take any of a large request
    /// body (ended within twice this). Then 504 `upstream_timeout`, or
    /// an error event ending a stream; the engine sees the request end.
    #[arg(long, default_value = "10m", value_parser = positive_duration)]
    upstream_timeout: std::time::Duration,
}

/// A duration above zero (`0s` would end every request at once).
fn positive_duration(s: &str) -> Result<std::time::Duration, String> {
    match humantime::parse_duration(s) {
        Ok(d) if d.is_zero() => Err("must be more than 0".into()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.to_string()),
    }
}

fn write_addr_file(path: &PathBuf, proxy: &Proxy) -> anyhow::Result<()> {
    let mut tmp = path.clone().into_os_string();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let text = format!(
        "http={}\nadmin={}\n",
        proxy.local_addr(),
        proxy.admin_addr()
    );
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let threads = args.threads.map(usize::from).unwrap_or_else(|| {
        siesta_proxy::default_serving_threads(
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
        )
    });
    let rt = if args.work_stealing {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    }
    .context("starting the tokio runtime")?;
    // Work-stealing: one runtime serves everything; else one per thread.
    let serving_threads = if args.work_stealing { 1 } else { threads };
    rt.block_on(run(args, serving_threads))
}

async fn run(args: Args, threads: usize) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(colour())
        .init();
    // Handlers first: a signal during start-up is not lost.
    let signal = siesta_signal::shutdown_signal()?;
    let cfg = ProxyConfig {
        controls: args.controls,
        listen: args.listen,
        reuse_port: args.reuse_port,
        threads,
        admin_listen: args.admin_listen,
        token: args.token.filter(|t| !t.is_empty()),
        api_keys: args
            .api_keys
            .into_iter()
            .filter(|k| !k.is_empty())
            .collect(),
        max_body_bytes: args.max_body,
        max_header_bytes: args.max_header_bytes,
        header_timeout: args.header_timeout,
        body_timeout: args.body_timeout,
        send_timeout: args.send_timeout,
        first_snapshot_wait: args.first_snapshot_wait,
        drain_timeout: args.drain_timeout,
        proxy_id: args.proxy_id,
        upstream_idle_timeout: args.upstream_idle_timeout,
        engine_concurrency: args.engine_concurrency as usize,
        upstream_timeout: args.upstream_timeout,
        ..ProxyConfig::default()
    };
    raise_fd_limit();
    let proxy = Proxy::bind(cfg)?;
    if let Some(path) = &args.addr_file {
        write_addr_file(path, &proxy)?;
    }
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    tokio::spawn(async move {
        let signal = signal.await;
        tracing::info!(%signal, "shutting down");
        token.cancel();
    });
    proxy.run(shutdown).await?;
    Ok(())
}

/// One descriptor per client connection: a proxy holding many requests
/// needs more than the usual soft limit (1024); take the hard limit.
fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
    {
        match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::debug!(from = soft, to = hard, "raised the open-files limit"),
            Err(e) => {
                tracing::warn!(soft, hard, error = %e, "could not raise the open-files limit")
            }
        }
    }
}

/// Colour in the log only on a terminal, and never with `NO_COLOR` set.
fn colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
