//! `siesta-p2p-probe`: the child process siesta-control runs (with a
//! deadline) to check GPU peer-to-peer copies, one JSON line per pair on
//! stdout. `--inventory` prints the NVML inventory as JSON instead.

#[path = "siesta-p2p-probe/copy.rs"]
mod copy;
#[path = "siesta-p2p-probe/ffi.rs"]
mod ffi;

use std::io::Write;

use anyhow::Context;
use clap::Parser;
use siesta_control::gpu::GpuSource;
use siesta_control::gpu::p2p::{P2pHealth, P2pResult, ProbeLine, ProbeOptions, run_probe};

#[derive(Debug, Parser)]
#[command(version, about = "Check GPU peer-to-peer copies element by element")]
struct Args {
    /// Bytes per copy buffer (two such buffers per GPU).
    #[arg(long, default_value_t = 256 << 20)]
    bytes: u64,
    /// GPU indices (CUDA ordinals in PCI bus order), comma-separated; default all.
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<u32>,
    /// Copies per pair; the verdict is the worst, the bandwidth the best.
    #[arg(long, default_value_t = 3)]
    repeat: u32,
    /// Print the NVML inventory as one JSON object and exit.
    #[arg(long)]
    inventory: bool,
    /// Print one line per GPU (used memory, compute processes) and exit.
    #[arg(long)]
    memory: bool,
    /// Run the probe the way siesta-control does: this binary as a child,
    /// killed at the deadline (unfinished pairs: hung); print the results.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration, hide = true)]
    as_parent: Option<std::time::Duration>,
}

fn print_memory() {
    let inv = GpuSource::detect(&[]).snapshot();
    if let Some(note) = &inv.note {
        println!("note: {note}");
    }
    for g in &inv.gpus {
        let procs: Vec<String> = g
            .processes
            .iter()
            .map(|p| format!("pid {} {} MiB", p.pid, p.used_bytes >> 20))
            .collect();
        println!(
            "GPU {} {}: used {} MiB of {} MiB; processes: [{}]",
            g.index,
            g.name,
            g.memory_used_bytes >> 20,
            g.memory_total_bytes >> 20,
            procs.join(", ")
        );
    }
}

fn run_as_parent(args: &Args, deadline: std::time::Duration) -> anyhow::Result<()> {
    let mut opts = ProbeOptions::new(std::env::current_exe()?, args.gpus.clone());
    opts.bytes = args.bytes;
    opts.deadline = deadline;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let results = rt.block_on(run_probe(&opts))?;
    for r in results {
        println!(
            "GPU {} -> GPU {}: {:<11} {:>7.1} GB/s  {}/{} elements wrong  driver: {}  {}",
            r.src,
            r.dst,
            r.health.as_str(),
            r.bandwidth_gbps,
            r.corrupt_elements,
            r.elements,
            r.driver_says,
            r.detail
        );
    }
    Ok(())
}

fn emit(line: &ProbeLine) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, line)?;
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(deadline) = args.as_parent {
        return run_as_parent(&args, deadline);
    }
    if args.memory {
        print_memory();
        return Ok(());
    }
    if args.inventory {
        let inv = GpuSource::detect(&[]).snapshot();
        println!("{}", serde_json::to_string_pretty(&inv)?);
        return Ok(());
    }
    if !ffi::libcuda_present() {
        return emit(&ProbeLine::Fatal {
            detail: "libcuda not found".into(),
        });
    }
    let count = match cudarc::driver::CudaContext::device_count() {
        Ok(n) => n as u32,
        Err(e) => {
            return emit(&ProbeLine::Fatal {
                detail: format!("cuInit: {e:?}"),
            });
        }
    };
    let gpus: Vec<u32> = if args.gpus.is_empty() {
        (0..count).collect()
    } else {
        args.gpus.clone()
    };
    emit(&ProbeLine::Start {
        devices: count,
        bytes: args.bytes,
    })?;
    let elements = usize::try_from(args.bytes / 4).context("--bytes too large")?;
    let mut devices = Vec::new();
    let mut setup_errors = Vec::new();
    for &g in &gpus {
        match copy::Device::new(g, elements) {
            Ok(d) => devices.push(Some(d)),
            Err(e) => {
                devices.push(None);
                setup_errors.push((
                    g,
                    format!(
                        "GPU {g} setup (context, {} MiB buffers): {e:?}",
                        args.bytes >> 20
                    ),
                ));
            }
        }
    }
    for s in 0..gpus.len() {
        for d in 0..gpus.len() {
            if s == d {
                continue;
            }
            let result = match (devices[s].take(), devices[d].take()) {
                (Some(src), Some(mut dst)) => {
                    let r = copy::probe_pair(&src, &mut dst, args.repeat);
                    devices[s] = Some(src);
                    devices[d] = Some(dst);
                    r
                }
                (a, b) => {
                    devices[s] = a;
                    devices[d] = b;
                    let why = setup_errors
                        .iter()
                        .filter(|(g, _)| *g == gpus[s] || *g == gpus[d])
                        .map(|(_, e)| e.as_str())
                        .collect::<Vec<_>>()
                        .join("; ");
                    P2pResult::missing(gpus[s], gpus[d], P2pHealth::Error, why)
                }
            };
            emit(&ProbeLine::Pair(result))?;
        }
    }
    emit(&ProbeLine::Done)
}
