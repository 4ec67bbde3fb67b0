//! The engine-core child process, as vLLM runs `VLLM::EngineCore` beside its API server.
//!
//! The child is this same executable re-run with the hidden `engine-core` subcommand (with
//! the argv prefix that led to `serve`, so it also works under `siesta fake-vllm serve ...`).
//! It stays in the server's process group, is SIGTERMed when the server stops, and exits by
//! itself when its parent is gone (unless `--orphan-engine-core`).

use std::ffi::OsString;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::cli::EngineCoreArgs;

/// Handle on the running child.
#[derive(Debug)]
pub struct EngineCore {
    child: Mutex<Option<Child>>,
}

impl EngineCore {
    /// Spawns the child. `argv` is the argv `main_with_args` got.
    pub fn spawn(argv: &[OsString], orphan: bool) -> std::io::Result<EngineCore> {
        let exe = std::env::current_exe()?;
        // The process's real argv tells how this code was reached (e.g. `siesta fake-vllm`).
        let real: Vec<OsString> = std::env::args_os().collect();
        let prefix: Vec<OsString> = match real.iter().position(|a| a == "serve") {
            Some(i) if i >= 1 => real[1..i].to_vec(),
            _ => argv
                .iter()
                .position(|a| a == "serve")
                .map(|i| argv[1.min(i)..i].to_vec())
                .unwrap_or_default(),
        };
        let mut cmd = Command::new(exe);
        cmd.args(prefix)
            .arg("engine-core")
            .arg("--parent-pid")
            .arg(std::process::id().to_string())
            .stdin(Stdio::null());
        if orphan {
            cmd.arg("--orphan");
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

/// The child's main: names itself like vLLM's engine core and waits for its parent to go.
pub fn run_child(args: &EngineCoreArgs) -> std::process::ExitCode {
    let _ = nix::sys::prctl::set_name(c"VLLM::EngineCor");
    loop {
        if !args.orphan && nix::unistd::getppid().as_raw() != args.parent_pid {
            return std::process::ExitCode::SUCCESS;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
