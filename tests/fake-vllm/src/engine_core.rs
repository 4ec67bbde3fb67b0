//! The engine-core child process, as vLLM runs `VLLM::EngineCore` beside its API server, and
//! its tensor-parallel workers `VLLM::Worker_TPn`.
//!
//! The children are this same executable re-run with the hidden `engine-core` and `worker`
//! subcommands (with the argv prefix that led to `serve`, so they also work under
//! `siesta fake-vllm serve ...`). All stay in the server's process group. Like vLLM's, the
//! engine core does not watch its parent: it outlives a SIGKILLed server (vllm#55510) unless
//! `--engine-core-dies-with-parent`; workers never watch theirs. A SIGTERMed engine core
//! stops its workers first.

use std::ffi::{CString, OsString};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::cli::{EngineCoreArgs, WorkerArgs};

/// Handle on the running child.
#[derive(Debug)]
pub struct EngineCore {
    child: Mutex<Option<Child>>,
}

/// The argv between argv[0] and the subcommand `marker` (e.g. `["fake-vllm"]` under
/// `siesta fake-vllm serve`), from the process's real argv or else `argv`.
fn prefix(argv: &[OsString], marker: &str) -> Vec<OsString> {
    let real: Vec<OsString> = std::env::args_os().collect();
    match real.iter().position(|a| a == marker) {
        // `--personality P` before `serve` is the server's, not the engine core's.
        Some(i) if i >= 1 => {
            let mut out = Vec::new();
            let mut it = real[1..i].iter();
            while let Some(a) = it.next() {
                if a == "--personality" {
                    it.next();
                } else if !a.to_string_lossy().starts_with("--personality=") {
                    out.push(a.clone());
                }
            }
            out
        }
        _ => argv
            .iter()
            .position(|a| a == marker)
            .map(|i| argv[1.min(i)..i].to_vec())
            .unwrap_or_default(),
    }
}

/// `exe PREFIX... sub`, stdin closed, its environment as `/proc` will show it.
fn this_exe(argv: &[OsString], marker: &str, sub: &str) -> std::io::Result<Command> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(prefix(argv, marker)).arg(sub).stdin(Stdio::null());
    environ_as_setproctitle_leaves_it(&mut cmd);
    Ok(cmd)
}

/// vLLM names its engine core and workers with py-setproctitle
/// (`VLLM::EngineCore`, `VLLM::Worker_TP0`), which zeroes the memory that
/// `/proc/PID/environ` reads, unless `SPT_NOENV` is set (checked with
/// setproctitle 1.3.7, vLLM 0.24.0's: not one byte left). Python keeps its
/// own copy, so the process still has its variables; only what others read
/// of it is gone. These children read no variable, so they are spawned
/// without any: `/proc` shows what it shows of vLLM's.
fn environ_as_setproctitle_leaves_it(cmd: &mut Command) {
    if std::env::var_os("SPT_NOENV").is_none_or(|v| v.is_empty()) {
        cmd.env_clear();
    }
}

fn set_name(name: &str) {
    if let Ok(c) = CString::new(name) {
        // The kernel keeps 15 bytes: `VLLM::EngineCor`, `VLLM::Worker_TP`, as with vLLM.
        let _ = nix::sys::prctl::set_name(&c);
    }
}

impl EngineCore {
    /// Spawns the child. `argv` is the argv `main_with_args` got.
    pub fn spawn(
        argv: &[OsString],
        dies_with_parent: bool,
        tensor_parallel_size: u32,
    ) -> std::io::Result<EngineCore> {
        let mut cmd = this_exe(argv, "serve", "engine-core")?;
        cmd.arg("--parent-pid")
            .arg(std::process::id().to_string())
            .arg("--tensor-parallel-size")
            .arg(tensor_parallel_size.to_string());
        if dies_with_parent {
            cmd.arg("--dies-with-parent");
        }
        let child = cmd.spawn()?;
        tracing::info!(pid = child.id(), "started engine core process");
        Ok(EngineCore {
            child: Mutex::new(Some(child)),
        })
    }

    /// The child's pid, while it is running.
    pub fn pid(&self) -> Option<u32> {
        self.child.lock().unwrap().as_ref().map(Child::id)
    }

    /// Whether the child has exited (reaping it); false once stopped by [`EngineCore::stop`].
    pub fn exited(&self) -> bool {
        self.child
            .lock()
            .unwrap()
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))))
    }

    /// SIGTERMs the child, waits up to `grace`, then SIGKILLs it; reaps it.
    pub fn stop(&self, grace: Duration) {
        let Some(mut child) = self.child.lock().unwrap().take() else {
            return;
        };
        let pid = Pid::from_raw(child.id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        let start = Instant::now();
        while start.elapsed() < grace {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for EngineCore {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(1));
    }
}

/// The engine core's main: names itself like vLLM's, starts one worker per tensor-parallel
/// rank when TP > 1, and runs until SIGTERM (stopping its workers) or, only with
/// `--dies-with-parent`, until its parent is gone.
pub fn run_child(args: &EngineCoreArgs) -> std::process::ExitCode {
    set_name("VLLM::EngineCore");
    let argv: Vec<OsString> = std::env::args_os().collect();
    let mut workers: Vec<Child> = Vec::new();
    if args.tensor_parallel_size > 1 {
        for rank in 0..args.tensor_parallel_size {
            let spawned = this_exe(&argv, "engine-core", "worker")
                .and_then(|mut c| c.arg("--rank").arg(rank.to_string()).spawn());
            match spawned {
                Ok(c) => workers.push(c),
                Err(e) => eprintln!("fake-vllm engine core: starting worker {rank}: {e}"),
            }
        }
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fake-vllm engine core: building the runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    // Like vLLM's engine core, SIGTERM or SIGINT ends it.
    let ended = rt.block_on(async {
        let signal = match siesta_signal::shutdown_signal() {
            Ok(s) => s,
            Err(e) => {
                eprintln!("fake-vllm engine core: {e}");
                return Err(());
            }
        };
        tokio::pin!(signal);
        loop {
            tokio::select! {
                _ = &mut signal => return Ok(()),
                () = tokio::time::sleep(Duration::from_millis(50)) => {
                    if args.dies_with_parent
                        && nix::unistd::getppid().as_raw() != args.parent_pid
                    {
                        return Ok(());
                    }
                }
            }
        }
    });
    for w in &workers {
        let _ = kill(Pid::from_raw(w.id() as i32), Signal::SIGTERM);
    }
    for mut w in workers {
        let _ = w.wait();
    }
    match ended {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(()) => std::process::ExitCode::from(1),
    }
}

/// A worker's main: names itself `VLLM::Worker_TPn` and waits to be killed.
pub fn run_worker(args: &WorkerArgs) -> std::process::ExitCode {
    set_name(&format!("VLLM::Worker_TP{}", args.rank));
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
