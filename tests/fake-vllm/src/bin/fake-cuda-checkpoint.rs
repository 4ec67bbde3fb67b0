//! `fake-cuda-checkpoint`: a stand-in for `siesta-cuda-checkpoint` (same
//! arguments, same JSON lines) that is as unkind as the driver: `suspend`
//! SIGSTOPs every pid, so anything that reaches a "checkpointed" engine
//! hangs (the real engine core dies); `resume` SIGCONTs them.
//!
//! Faults: when the file named by `FAKE_CUDA_CHECKPOINT_FAULTS` (in the
//! target process's environment, else this one's) holds a line `resume`,
//! a resume fails the way a failed restore does (the pids stay stopped);
//! `suspend` fails a suspend (nothing is stopped); `slow` makes each
//! command take a second (a resume long enough to see requests held).
//!
//! On fake-vllm's simulated GPU (`FAKE_VLLM_GPU_DIR` in the target's environment), a
//! suspend frees what the process holds there and a resume takes it again, failing out of
//! memory when another engine took the room meanwhile, as the driver's restore does.
//!
//! Like the real thing, an engine that something reached while it was
//! checkpointed is dead: a resume first looks for bytes (or connections)
//! the kernel queued for the engine's sockets while it was frozen; if there
//! are any, it kills the engine and fails the restore, as a real vLLM
//! engine core died with EngineDeadError and its restore then failed.

use std::io::Write;
use std::time::Instant;

use fake_vllm::sim_gpu::SimGpu;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const FAULTS: &str = "FAKE_CUDA_CHECKPOINT_FAULTS";

fn fault(pid: i32, op: &str) -> bool {
    let from_target = std::fs::read(format!("/proc/{pid}/environ"))
        .ok()
        .and_then(|env| {
            env.split(|b| *b == 0).find_map(|kv| {
                kv.strip_prefix(format!("{FAULTS}=").as_bytes())
                    .map(<[u8]>::to_vec)
            })
        })
        .map(|v| String::from_utf8_lossy(&v).into_owned());
    from_target
        .or_else(|| std::env::var(FAULTS).ok())
        .and_then(|p| std::fs::read_to_string(p).ok())
        .is_some_and(|s| s.lines().any(|l| l.trim() == op))
}

/// `/proc/PID/stat` state letter (None: no such process).
fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].chars().next()
}

/// Bytes and pending connections the kernel holds, unread, for the TCP
/// sockets of `pids` (a peer's FIN, one sequence number, is not data).
fn queued_for(pids: &[i32]) -> u64 {
    let mut inodes = std::collections::HashSet::new();
    for pid in pids {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path())
                && let Some(inode) = target
                    .to_str()
                    .and_then(|t| t.strip_prefix("socket:["))
                    .and_then(|t| t.strip_suffix(']'))
            {
                inodes.insert(inode.to_string());
            }
        }
    }
    let mut total = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for row in text.lines().skip(1) {
            let f: Vec<&str> = row.split_whitespace().collect();
            if f.len() < 10 || !inodes.contains(f[9]) {
                continue;
            }
            let rx = f[4]
                .split(':')
                .nth(1)
                .and_then(|q| u64::from_str_radix(q, 16).ok())
                .unwrap_or(0);
            total += rx.saturating_sub(u64::from(f[3] == "08"));
        }
    }
    total
}

fn line(pid: i32, op: &str, ok: bool, extra: serde_json::Value) {
    let mut v = serde_json::json!({ "pid": pid, "op": op, "ok": ok });
    if let (Some(o), serde_json::Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
}

fn failed(pid: i32, op: &str, error: String) {
    line(pid, op, false, serde_json::json!({ "error": error }));
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((op, rest)) = args.split_first() else {
        eprintln!("usage: fake-cuda-checkpoint suspend|resume|state PID...");
        std::process::exit(2);
    };
    let pids: Vec<i32> = rest.iter().filter_map(|p| p.parse().ok()).collect();
    if pids.first().is_some_and(|&p| fault(p, "slow")) {
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
    if op == "resume" {
        let queued = queued_for(&pids);
        if queued > 0 {
            for &pid in &pids {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                line(
                    pid,
                    op,
                    false,
                    serde_json::json!({ "error": format!(
                        "restore failed: cuCheckpointProcessRestore(pid) failed: \
                         CUDA_ERROR_OPERATING_SYSTEM (304): something reached the engine while \
                         it was checkpointed ({queued} unread bytes or connections): it died"
                    ) }),
                );
            }
            std::process::exit(1);
        }
    }
    let mut all = true;
    for &pid in &pids {
        let t = Instant::now();
        let ms = || t.elapsed().as_millis() as u64;
        let Some(state) = proc_state(pid) else {
            all = false;
            line(
                pid,
                op,
                false,
                serde_json::json!({ "error": format!("pid {pid}: no such process") }),
            );
            continue;
        };
        match op.as_str() {
            "suspend" if fault(pid, "suspend") => {
                all = false;
                line(
                    pid,
                    op,
                    false,
                    serde_json::json!({
                        "error": "driver has no cuCheckpointProcessLock: needs r570+ (injected)"
                    }),
                );
            }
            "suspend" => {
                let ok = kill(Pid::from_raw(pid), Signal::SIGSTOP).is_ok();
                // The checkpoint frees what the process holds on its GPUs (a failure is
                // rolled back: the process runs on).
                if let Some(Err(e)) =
                    SimGpu::of_process(pid as u32).map(|g| g.checkpoint(pid as u32))
                {
                    let _ = kill(Pid::from_raw(pid), Signal::SIGCONT);
                    all = false;
                    failed(pid, op, e.to_string());
                    continue;
                }
                all &= ok;
                line(
                    pid,
                    op,
                    ok,
                    serde_json::json!({
                        "state": "checkpointed", "lock_ms": 0, "checkpoint_ms": ms()
                    }),
                );
            }
            "resume" if fault(pid, "resume") => {
                all = false;
                line(
                    pid,
                    op,
                    false,
                    serde_json::json!({
                        "error": "restore failed: cuCheckpointProcessRestore(pid) failed: CUDA_ERROR_OPERATING_SYSTEM (304) (injected)"
                    }),
                );
            }
            "resume" => {
                // The restore allocates on its GPUs again: out of memory when another
                // process took the room meanwhile (the process stays checkpointed).
                if let Some(Err(e)) = SimGpu::of_process(pid as u32).map(|g| g.restore(pid as u32))
                {
                    all = false;
                    failed(
                        pid,
                        op,
                        format!(
                            "restore failed: cuCheckpointProcessRestore(pid) failed: \
                             CUDA_ERROR_OUT_OF_MEMORY (2): {e}"
                        ),
                    );
                    continue;
                }
                let ok = kill(Pid::from_raw(pid), Signal::SIGCONT).is_ok();
                all &= ok;
                line(
                    pid,
                    op,
                    ok,
                    serde_json::json!({
                        "state": "running", "restore_ms": ms(), "unlock_ms": 0
                    }),
                );
            }
            "state" => {
                let s = if state == 'T' {
                    "checkpointed"
                } else {
                    "running"
                };
                line(pid, op, true, serde_json::json!({ "state": s }));
            }
            other => {
                eprintln!("fake-cuda-checkpoint: unknown command {other:?}");
                std::process::exit(2);
            }
        }
    }
    std::process::exit(if all { 0 } else { 1 });
}
