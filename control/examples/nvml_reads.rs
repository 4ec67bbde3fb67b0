//! NVML reads as admission makes them, timed on this machine's GPUs: a
//! whole read (memory, processes, names, IOMMU, NVLinks, every GPU pair's
//! links) against what `NvmlInventory::snapshot` reads within a minute of
//! one (memory and processes). Prints the GPUs, then per kind of read its
//! p50, p99 and mean over N reads, alternating the two.
//!
//!   cargo build --release -p siesta-control --example nvml_reads
//!   target/release/examples/nvml_reads [N]      (default 200)

use siesta_control::gpu::nvml::NvmlInventory;
use std::time::{Duration, Instant};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(200);
    let inv = NvmlInventory::init()?;
    let gpus = inv.whole()?;
    let pairs: usize = gpus.iter().map(|g| g.links.len()).sum();
    println!("GPUs: {} ({} ordered pairs)", gpus.len(), pairs);
    for g in &gpus {
        println!(
            "  GPU {} {} {} MiB, {} NVLinks active, {} processes",
            g.index,
            g.name,
            g.memory_total_bytes >> 20,
            g.nvlinks_active,
            g.processes.len()
        );
    }
    inv.snapshot()?; // a whole read, kept: the reads below are the light ones
    let (mut whole, mut light) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let t = Instant::now();
        inv.whole()?;
        whole.push(t.elapsed());
        let t = Instant::now();
        inv.snapshot()?;
        light.push(t.elapsed());
    }
    let (w, l) = (stats(&mut whole), stats(&mut light));
    println!("reads: {n} of each, alternating");
    println!("  whole read: p50 {:?}  p99 {:?}  mean {:?}", w.0, w.1, w.2);
    println!(
        "  snapshot (memory and processes): p50 {:?}  p99 {:?}  mean {:?}",
        l.0, l.1, l.2
    );
    println!(
        "  whole / snapshot, p50: {:.1}x",
        w.0.as_secs_f64() / l.0.as_secs_f64().max(1e-9)
    );
    Ok(())
}

/// p50, p99 and mean.
fn stats(v: &mut [Duration]) -> (Duration, Duration, Duration) {
    v.sort();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    let mean = v.iter().sum::<Duration>() / v.len().max(1) as u32;
    (at(0.5), at(0.99), mean)
}
