//! `siesta-cuda-checkpoint`: the child process siesta-control runs (with a
//! deadline) to suspend an engine's GPU state to host memory and restore
//! it, through the CUDA driver's checkpoint API (r570+), by pid.
//!
//! `suspend PID...` locks every pid first, then checkpoints each (a
//! failure part way puts the others back: restore, unlock). `resume
//! PID...` restores each, then unlocks each. `state PID...` reports.
//! One JSON line per pid on stdout; exit status 0 only when every pid
//! succeeded, 1 when one failed, 2 when the driver cannot do it at all.

#[path = "siesta-cuda-checkpoint/ffi.rs"]
mod ffi;

use std::io::Write;
use std::time::Instant;

use clap::{Parser, Subcommand};
use ffi::{Driver, DriverError, ProcState};
use serde::Serialize;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Suspend a CUDA process's GPU state to host memory and restore it"
)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Lock every pid, then checkpoint each (GPU memory to host memory).
    Suspend {
        /// How long a lock may wait for the process's CUDA work to finish.
        #[arg(long, default_value_t = 30_000)]
        lock_timeout_ms: u32,
        #[arg(required = true)]
        pids: Vec<i32>,
    },
    /// Restore every pid, then unlock each.
    Resume {
        #[arg(required = true)]
        pids: Vec<i32>,
    },
    /// Print each pid's checkpoint state.
    State {
        #[arg(required = true)]
        pids: Vec<i32>,
    },
}

/// One line of output.
#[derive(Debug, Default, Serialize)]
struct Line {
    pid: i32,
    op: &'static str,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    state: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lock_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    checkpoint_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    restore_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    unlock_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

fn emit<T: Serialize>(v: &T) {
    let mut out = std::io::stdout().lock();
    // A closed stdout leaves the exit status to tell.
    let _ = serde_json::to_writer(&mut out, v);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}

fn ms(t: Instant) -> u64 {
    t.elapsed().as_millis() as u64
}

/// Checks a pid before touching it: it exists and holds a CUDA context.
fn precheck(d: &Driver, pid: i32) -> Result<ProcState, String> {
    if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
        return Err(format!("pid {pid}: no such process"));
    }
    d.state(pid).map_err(|e| {
        format!("pid {pid} is not a CUDA process (no CUDA context the driver can checkpoint): {e}")
    })
}

fn suspend(d: &Driver, pids: &[i32], timeout_ms: u32) -> bool {
    let mut lines: Vec<Line> = pids
        .iter()
        .map(|&pid| Line {
            pid,
            op: "suspend",
            ..Line::default()
        })
        .collect();
    let mut failed = false;
    for l in &mut lines {
        match precheck(d, l.pid) {
            Ok(ProcState::Running) => {}
            Ok(s) => {
                l.error = Some(format!(
                    "pid {} is {}, not running: resume it first",
                    l.pid,
                    s.as_str()
                ));
                failed = true;
            }
            Err(e) => {
                l.error = Some(e);
                failed = true;
            }
        }
    }
    let mut locked = Vec::new();
    if !failed {
        for (i, l) in lines.iter_mut().enumerate() {
            let t = Instant::now();
            match d.lock(l.pid, timeout_ms) {
                Ok(()) => {
                    l.lock_ms = Some(ms(t));
                    locked.push(i);
                }
                Err(e) => {
                    l.error = Some(format!("lock (waited up to {timeout_ms} ms): {e}"));
                    failed = true;
                    break;
                }
            }
        }
    }
    let mut checkpointed = Vec::new();
    if !failed {
        for &i in &locked {
            let l = &mut lines[i];
            let t = Instant::now();
            match d.checkpoint(l.pid) {
                Ok(()) => {
                    l.checkpoint_ms = Some(ms(t));
                    checkpointed.push(i);
                }
                Err(e) => {
                    l.error = Some(format!("checkpoint: {e}"));
                    failed = true;
                    break;
                }
            }
        }
    }
    if failed {
        // Put back what was done: all or nothing.
        for &i in &checkpointed {
            if let Err(e) = d.restore(lines[i].pid) {
                let l = &mut lines[i];
                l.error = Some(format!(
                    "rolled back after another pid failed, but restore failed: {e}"
                ));
            }
        }
        for &i in &locked {
            let _ = d.unlock(lines[i].pid);
        }
        for l in &mut lines {
            if l.error.is_none() {
                l.error =
                    Some("not suspended: another pid of the engine failed (rolled back)".into());
            }
        }
    }
    for l in &mut lines {
        l.ok = !failed;
        l.state = d.state(l.pid).ok().map(ProcState::as_str);
        emit(l);
    }
    !failed
}

fn resume(d: &Driver, pids: &[i32]) -> bool {
    let mut lines: Vec<Line> = pids
        .iter()
        .map(|&pid| Line {
            pid,
            op: "resume",
            ok: true,
            ..Line::default()
        })
        .collect();
    // Restore every checkpointed pid first, then unlock every locked one.
    for l in &mut lines {
        match precheck(d, l.pid) {
            Ok(ProcState::Checkpointed) => {
                let t = Instant::now();
                match d.restore(l.pid) {
                    Ok(()) => l.restore_ms = Some(ms(t)),
                    Err(e) => {
                        l.ok = false;
                        l.error = Some(format!("restore failed: {e}"));
                    }
                }
            }
            Ok(ProcState::Locked | ProcState::Running) => {}
            Ok(s) => {
                l.ok = false;
                l.error = Some(format!(
                    "pid {} is {}: cannot restore it",
                    l.pid,
                    s.as_str()
                ));
            }
            Err(e) => {
                l.ok = false;
                l.error = Some(e);
            }
        }
    }
    for l in &mut lines {
        if l.ok && d.state(l.pid).ok() == Some(ProcState::Locked) {
            let t = Instant::now();
            match d.unlock(l.pid) {
                Ok(()) => l.unlock_ms = Some(ms(t)),
                Err(e) => {
                    l.ok = false;
                    l.error = Some(format!("unlock after restore: {e}"));
                }
            }
        }
    }
    let mut all = true;
    for l in &mut lines {
        l.state = d.state(l.pid).ok().map(ProcState::as_str);
        all &= l.ok;
        emit(l);
    }
    all
}

fn state(d: &Driver, pids: &[i32]) -> bool {
    let mut all = true;
    for &pid in pids {
        let mut l = Line {
            pid,
            op: "state",
            ..Line::default()
        };
        match precheck(d, pid) {
            Ok(s) => {
                l.ok = true;
                l.state = Some(s.as_str());
            }
            Err(e) => {
                all = false;
                l.error = Some(e);
            }
        }
        emit(&l);
    }
    all
}

fn main() {
    let args = Args::parse();
    let driver = match Driver::load() {
        Ok(d) => d,
        Err(e) => {
            let fatal = matches!(e, DriverError::NoLibrary(_) | DriverError::MissingSymbol(_));
            #[derive(Serialize)]
            struct Fatal {
                ok: bool,
                error: String,
                code: Option<i32>,
            }
            emit(&Fatal {
                ok: false,
                error: e.to_string(),
                code: e.code(),
            });
            eprintln!("siesta-cuda-checkpoint: {e}");
            std::process::exit(if fatal { 2 } else { 1 });
        }
    };
    let ok = match &args.cmd {
        Cmd::Suspend {
            lock_timeout_ms,
            pids,
        } => suspend(&driver, pids, *lock_timeout_ms),
        Cmd::Resume { pids } => resume(&driver, pids),
        Cmd::State { pids } => state(&driver, pids),
    };
    std::process::exit(if ok { 0 } else { 1 });
}
