//! What `/proc` says about a process: its start time (to tell a reused pid
//! apart), whether it lives, and which process carries an engine tag.
//!
//! Reading another process's environment takes its memory map's lock in
//! the kernel: a process stuck in the GPU driver (an Xid fault, a worker
//! orphaned mid-call) can hold it for good, and the read with it. Those
//! reads run on a thread of their own and are waited for at most
//! [`ENVIRON_WAIT`]; a process whose read did not answer is not read again
//! (its environment is unknown: callers count it as not siesta's), so a
//! stuck process costs one parked thread, not admission or the placement
//! publisher stuck behind it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

/// Longest wait for one process's environment.
pub const ENVIRON_WAIT: Duration = Duration::from_millis(500);

/// Processes (pid, start time) whose environment read did not answer.
static STUCK: Mutex<Option<HashSet<(u32, u64)>>> = Mutex::new(None);

/// Fields of `/proc/PID/stat` after the command name.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let close = text.rfind(')')?;
    Some(
        text.get(close + 1..)?
            .split_whitespace()
            .map(str::to_string)
            .collect(),
    )
}

/// `/proc/PID/stat` field 22: start time in clock ticks after boot.
pub fn start_time(pid: u32) -> Option<u64> {
    // Field 3 (state) is index 0 after the command name; field 22 is index 19.
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// Whether `pid` runs (not a zombie) and, when `start_time` is given,
/// started then (the same process, not a reused pid).
pub fn alive(pid: u32, start: Option<u64>) -> bool {
    let Some(f) = stat_fields(pid) else {
        return false;
    };
    let running = f.first().is_some_and(|s| s != "Z" && s != "X");
    running && start.is_none_or(|t| f.get(19).and_then(|v| v.parse().ok()) == Some(t))
}

/// Process group of `pid`.
pub fn pgid(pid: u32) -> Option<u32> {
    stat_fields(pid)?.get(2)?.parse().ok()
}

/// Live members of process group `pgid` (its leader included, if alive).
pub fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| pgid_of_live(*pid) == Some(pgid))
        .collect()
}

/// Process group of `pid` if it runs (not a zombie).
fn pgid_of_live(pid: u32) -> Option<u32> {
    let f = stat_fields(pid)?;
    if f.first().is_none_or(|s| s == "Z" || s == "X") {
        return None;
    }
    f.get(2)?.parse().ok()
}

/// Live processes whose environment holds `key=value` (our own processes'
/// environments are readable).
pub fn pids_with_env(key: &str, value: &str) -> Vec<u32> {
    let needle = format!("{key}={value}");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let keys: Vec<(u32, u64)> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, start_time(pid)?)))
        .collect();
    let envs = environs(keys.clone());
    keys.into_iter()
        .zip(envs)
        .filter(|(_, env)| {
            env.as_ref()
                .is_some_and(|env| env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()))
        })
        .map(|((pid, _), _)| pid)
        .filter(|pid| alive(*pid, None))
        .collect()
}

/// The value of `key` in the environment `pid` started with.
pub fn env_value(pid: u32, key: &str) -> Option<String> {
    Env::of(pid)?.get(key)
}

/// Whether `pid`'s environment holds `key=value`; None when it cannot be
/// read (the process is gone, or another user's).
pub fn carries_env(pid: u32, key: &str, value: &str) -> Option<bool> {
    Some(Env::of(pid)?.carries(key, value))
}

/// The environment a process started with, read once for several keys.
pub struct Env(Vec<u8>);

impl Env {
    /// `pid`'s; None when it cannot be read (gone, another user's) or did
    /// not answer within [`ENVIRON_WAIT`].
    pub fn of(pid: u32) -> Option<Env> {
        environ(pid).map(Env)
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<String> {
        let prefix = format!("{key}=");
        self.0
            .split(|b| *b == 0)
            .find_map(|kv| kv.strip_prefix(prefix.as_bytes()))
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }

    /// Whether it holds `key=value`.
    pub fn carries(&self, key: &str, value: &str) -> bool {
        let needle = format!("{key}={value}");
        self.0.split(|b| *b == 0).any(|kv| kv == needle.as_bytes())
    }
}

/// The environment `pid` started with; None when it cannot be read (gone,
/// another user's) or did not answer within [`ENVIRON_WAIT`].
fn environ(pid: u32) -> Option<Vec<u8>> {
    let key = (pid, start_time(pid)?);
    environs(vec![key]).pop().flatten()
}

/// The environments of `keys` (pid, start time), in order.
fn environs(keys: Vec<(u32, u64)>) -> Vec<Option<Vec<u8>>> {
    bounded(
        keys,
        ENVIRON_WAIT,
        Arc::new(|pid| std::fs::read(format!("/proc/{pid}/environ"))),
    )
}

/// `read` of each key in turn on one thread of its own, each waited for at
/// most `wait`. A key whose read did not answer in time is marked and not
/// read again, and the keys after it are read on a new thread.
fn bounded(
    keys: Vec<(u32, u64)>,
    wait: Duration,
    read: Arc<dyn Fn(u32) -> std::io::Result<Vec<u8>> + Send + Sync>,
) -> Vec<Option<Vec<u8>>> {
    let mut out: Vec<Option<Vec<u8>>> = Vec::with_capacity(keys.len());
    while out.len() < keys.len() {
        let rest: Vec<(u32, u64)> = keys[out.len()..].to_vec();
        let stuck = STUCK.lock().unwrap().clone().unwrap_or_default();
        let (tx, rx) = mpsc::channel();
        let reader = read.clone();
        let todo = rest.clone();
        let spawned = std::thread::Builder::new()
            .name("siesta-procfs".into())
            .spawn(move || {
                for key in todo {
                    let env = if stuck.contains(&key) {
                        None
                    } else {
                        reader(key.0).ok()
                    };
                    if tx.send(env).is_err() {
                        return;
                    }
                }
            });
        if spawned.is_err() {
            out.resize(keys.len(), None);
            break;
        }
        for key in rest {
            match rx.recv_timeout(wait) {
                Ok(env) => out.push(env),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    tracing::warn!(
                        pid = key.0,
                        waited = ?wait,
                        "reading the process's environment in /proc did not answer (stuck in \
                         the kernel, e.g. in the GPU driver): its memory counts as another \
                         program's, and it is not read again"
                    );
                    STUCK
                        .lock()
                        .unwrap()
                        .get_or_insert_with(HashSet::new)
                        .insert(key);
                    out.push(None);
                    break;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    out.push(None);
                    break;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read that never answers (a process stuck in the driver holds its
    /// memory map's lock) is given up after the wait; the processes after
    /// it are still read, and that one is not read again.
    #[test]
    fn a_read_that_never_answers_is_given_up_and_not_tried_again() {
        let stuck_pid = u32::MAX - 7;
        let keys = vec![(1, 1), (stuck_pid, 42), (3, 3)];
        let (never_tx, never) = mpsc::channel::<()>();
        let never = Mutex::new(never);
        let reads = Arc::new(Mutex::new(Vec::new()));
        let seen = reads.clone();
        let read = Arc::new(move |pid: u32| {
            seen.lock().unwrap().push(pid);
            if pid == stuck_pid {
                let _ = never.lock().unwrap().recv();
            }
            Ok(format!("PID={pid}").into_bytes())
        });
        let got = bounded(keys.clone(), Duration::from_millis(50), read.clone());
        assert_eq!(
            got,
            vec![Some(b"PID=1".to_vec()), None, Some(b"PID=3".to_vec())]
        );
        reads.lock().unwrap().clear();
        let again = bounded(keys, Duration::from_secs(3600), read);
        assert_eq!(again[1], None);
        assert_eq!(
            *reads.lock().unwrap(),
            vec![1, 3],
            "the stuck one read again"
        );
        drop(never_tx);
    }

    #[test]
    fn own_process_has_a_stable_start_time() {
        let me = std::process::id();
        let t = start_time(me).unwrap();
        assert!(alive(me, Some(t)));
        assert!(!alive(me, Some(t + 1)));
        assert!(pgid(me).is_some());
    }

    #[test]
    fn finds_a_process_by_its_tag() {
        let tag = format!("procfs-{}", std::process::id());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env("SIESTA_ENGINE_TAG", &tag)
            .spawn()
            .unwrap();
        // The new environment shows in /proc a moment after the spawn returns.
        let mut found = Vec::new();
        for _ in 0..250 {
            found = pids_with_env("SIESTA_ENGINE_TAG", &tag);
            if !found.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let value = env_value(child.id(), "SIESTA_ENGINE_TAG");
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(found, vec![child.id()]);
        assert_eq!(value.as_deref(), Some(tag.as_str()));
        assert!(!alive(child.id(), None));
    }
}
