//! siesta-bench: the benchmark scenarios that need their own clients.
//! `scripts/bench` starts the processes and runs every scenario; each
//! subcommand prints a markdown table to stdout and progress to stderr.

#![forbid(unsafe_code)]

mod control;
mod fwd;
mod hold;
mod hold_client;
mod http;
mod relay;
mod release;
mod scale;
mod stats;
mod stream;
mod util;
mod watch;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "siesta-bench", about = "siesta benchmark scenarios")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// 1. Forwarding overhead through wrk: direct, siesta, nginx, LiteLLM.
    Fwd(fwd::Args),
    /// 2. Streaming: time to first byte, total, chunks, direct vs proxy.
    Stream(stream::Args),
    /// 3. Release after wake: wake finished → held request at the engine.
    Release(release::Args),
    /// 4. Hold capacity: many requests held for one sleeping model.
    Hold(hold::Args),
    /// Helper of `hold --clients N`: one process's share of the held requests.
    HoldClient(hold_client::Args),
    /// 5. Watch fan-out: many subscribers while models change state.
    Watch(watch::Args),
    /// 6. Control plane scale: ListModels and Watch snapshot with many models.
    Scale(scale::Args),
    /// Helper of scenarios 1 and 2: a byte relay (blocking, a thread per
    /// direction), the floor for any proxy's added latency.
    Relay(relay::Args),
    /// Helper: wait until a URL answers 200.
    WaitHttp(util::WaitArgs),
    /// Helper: print a free TCP port on 127.0.0.1.
    FreePort,
}

fn main() -> anyhow::Result<()> {
    let cmd = Cli::parse().cmd;
    if let Cmd::Relay(a) = cmd {
        // Blocking threads, no runtime.
        return relay::run(a);
    }
    let runtime = match &cmd {
        Cmd::Stream(a) if a.client == stream::ClientRuntime::CurrentThread => {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
        }
        _ => tokio::runtime::Runtime::new()?,
    };
    runtime.block_on(run(cmd))
}

async fn run(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Fwd(a) => fwd::run(a).await,
        Cmd::Stream(a) => stream::run(a).await,
        Cmd::Release(a) => release::run(a).await,
        Cmd::Hold(a) => hold::run(a).await,
        Cmd::HoldClient(a) => hold_client::run(a).await,
        Cmd::Watch(a) => watch::run(a).await,
        Cmd::Scale(a) => scale::run(a).await,
        Cmd::Relay(_) => unreachable!("run without a runtime, in main"),
        Cmd::WaitHttp(a) => util::wait_http(a).await,
        Cmd::FreePort => util::free_port(),
    }
}
