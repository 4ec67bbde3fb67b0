//! A spawned process in its own process group, killed with its whole group on drop, whose
//! stdout and stderr lines are captured for tests to search (and echoed to test output).

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

/// Captured output lines of a [`Child`], shared with its reader threads.
#[derive(Debug, Clone, Default)]
pub struct Output {
    lines: Arc<Mutex<Vec<String>>>,
}

impl Output {
    /// Every line so far (stdout and stderr interleaved as read).
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// All lines joined with newlines.
    pub fn text(&self) -> String {
        self.lines().join("\n")
    }

    /// Whether any line contains `needle`.
    pub fn contains(&self, needle: &str) -> bool {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains(needle))
    }

    /// The first line containing `needle`.
    pub fn find(&self, needle: &str) -> Option<String> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .find(|l| l.contains(needle))
            .cloned()
    }

    /// Number of lines containing `needle`.
    pub fn count(&self, needle: &str) -> usize {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Waits up to `deadline` for a line containing `needle` and returns it.
    pub async fn wait_for(&self, needle: &str, deadline: Duration) -> String {
        let what = format!("an output line containing {needle:?}");
        crate::wait_for(&what, deadline, || self.find(needle)).await
    }

    fn push(&self, line: String) {
        self.lines.lock().unwrap().push(line);
    }
}

/// A child process in its own process group (`process_group(0)`): dropping it SIGKILLs the
/// whole group and reaps the leader.
#[derive(Debug)]
pub struct Child {
    name: String,
    proc: std::process::Child,
    output: Output,
    status: Option<ExitStatus>,
}

impl Child {
    /// Spawns `cmd` in a new process group with stdin closed and stdout/stderr captured.
    /// `name` prefixes echoed lines and error messages.
    pub fn spawn(name: &str, mut cmd: Command) -> Child {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut proc = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name} ({cmd:?}): {e}"));
        let output = Output::default();
        let pid = proc.id();
        if let Some(out) = proc.stdout.take() {
            pump(format!("{name}[{pid}]"), out, output.clone());
        }
        if let Some(err) = proc.stderr.take() {
            pump(format!("{name}[{pid}] err"), err, output.clone());
        }
        Child {
            name: name.to_string(),
            proc,
            output,
            status: None,
        }
    }

    /// The name given at spawn.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The leader's pid (also the process group id).
    pub fn pid(&self) -> u32 {
        self.proc.id()
    }

    /// The process group id (equal to [`Child::pid`]).
    pub fn pgid(&self) -> i32 {
        self.proc.id() as i32
    }

    /// The captured output.
    pub fn output(&self) -> &Output {
        &self.output
    }

    /// Sends `sig` to the leader only.
    pub fn signal(&self, sig: Signal) {
        let _ = kill(Pid::from_raw(self.pgid()), sig);
    }

    /// Sends `sig` to the whole process group.
    pub fn signal_group(&self, sig: Signal) {
        let _ = killpg(Pid::from_raw(self.pgid()), sig);
    }

    /// SIGKILLs the whole group and reaps the leader.
    pub fn kill9(&mut self) {
        self.signal_group(Signal::SIGKILL);
        if self.status.is_none() {
            self.status = self.proc.wait().ok();
        }
    }

    /// The leader's exit status, if it has exited (non-blocking; reaps it).
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.proc.try_wait().ok().flatten();
        }
        self.status
    }

    /// Waits up to `deadline` for the leader to exit; panics (with its output) otherwise.
    pub async fn wait_exit(&mut self, deadline: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(s) = self.try_exit() {
                return s;
            }
            if start.elapsed() > deadline {
                panic!(
                    "{} did not exit within {deadline:?}; output:\n{}",
                    self.name,
                    self.output.text()
                );
            }
            tokio::time::sleep(crate::POLL).await;
        }
    }

    /// Live (non-zombie) processes still in this child's process group.
    pub fn group_members(&self) -> Vec<i32> {
        crate::group_members(self.pgid())
    }

    /// Live descendants of the leader (children, grandchildren, ...).
    pub fn descendants(&self) -> Vec<i32> {
        crate::descendants(self.pgid())
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.signal_group(Signal::SIGKILL);
        if self.status.is_none() {
            let _ = self.proc.wait();
        }
    }
}

/// Reads `src` line by line on a thread (inheriting the test's output capture), echoing each
/// line to stderr with `tag` and storing it in `output`.
fn pump(tag: String, src: impl Read + Send + 'static, output: Output) {
    std::thread::Builder::new()
        .name(format!("pump {tag}"))
        .spawn(move || {
            let mut reader = BufReader::new(src);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match reader.read_until(b'\n', &mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        let line = String::from_utf8_lossy(&buf);
                        let line = line.trim_end_matches(['\n', '\r']).to_string();
                        eprintln!("[{tag}] {line}");
                        output.push(line);
                    }
                }
            }
        })
        .expect("spawning output reader thread");
}
