//! `siesta-control`: the control-plane daemon.
#![forbid(unsafe_code)]

use anyhow::Context;
use clap::Parser;
use siesta_control::{Config, ServeOptions, Server};
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use tokio_util::sync::CancellationToken;

/// siesta's control plane: runs, sleeps and wakes vLLM engines.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The configuration file (TOML).
    #[arg(long, env = "SIESTA_CONFIG")]
    config: PathBuf,
    /// gRPC listen address (overrides [control] listen; port 0 picks one).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// After binding, write `grpc=IP:PORT` to this file.
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// Stop every engine on exit (default: leave them running).
    #[arg(long)]
    stop_engines_on_exit: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(colour())
        .init();
    // Handlers first: a signal during start-up is not lost.
    let mut signal = Box::pin(siesta_signal::shutdown_signal()?);
    let config = Config::load(&args.config).map_err(|e| anyhow::anyhow!("{e}"))?;
    let opts = ServeOptions {
        listen: args.listen,
        stop_engines_on_exit: args.stop_engines_on_exit,
        config_path: Some(args.config.clone()),
    };
    // Start-up (recovery, the P2P probe) can take a while: a signal then
    // ends the process as it would have without a handler.
    let server = tokio::select! {
        server = Server::bind(config, opts) => server?,
        signal = &mut signal => {
            tracing::info!(%signal, "exiting during start-up");
            return Ok(());
        }
    };
    let addr = server.local_addr();
    tracing::info!(%addr, "siesta-control listening");
    if let Some(path) = &args.addr_file {
        let mut tmp = path.clone().into_os_string();
        tmp.push(".tmp");
        let what = || format!("writing the address file {}", path.display());
        let mut text = format!("grpc={addr}\n");
        if let Some(web) = server.web_addr() {
            text.push_str(&format!("web={web}\n"));
        }
        std::fs::write(&tmp, text).with_context(what)?;
        std::fs::rename(&tmp, path).with_context(what)?;
    }
    let shutdown = CancellationToken::new();
    let signals = shutdown.clone();
    tokio::spawn(async move {
        let signal = signal.await;
        tracing::info!(%signal, "shutting down");
        signals.cancel();
    });
    let ran = server.run(shutdown).await;
    // A start-up step the signal cut short (the GPU probe), or one that
    // ran past its deadline (a hung NVML call), may still run on a
    // blocking thread, which dropping the runtime would wait for.
    if let Err(e) = ran {
        // Once, as anyhow's `Error:` line would have been (a tracing line
        // too would say it twice on the same stderr).
        eprintln!("Error: {e}");
        std::process::exit(1)
    }
    std::process::exit(0)
}

/// Colour in the log only on a terminal, and never with `NO_COLOR` set.
fn colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
