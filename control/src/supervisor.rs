//! Engine processes: argv, spawn in their own process group with output to
//! files tailed into the log ring, signals to the group, per-GPU start locks.

mod adopt;
mod argv;
mod exit_cause;
mod group;
mod logs;
mod ports;
pub mod procfs;
mod tail;

pub use adopt::{Leader, adopt};
pub use argv::spawn_spec;
pub(crate) use group::wait_gone;
pub use group::{
    SWEEP_DEADLINE, kill_engines_now, kill_escaped, kill_group_leftovers, signal_group,
    state_dir_groups, sweep_group,
};
pub use logs::{LogLine, LogRing};
pub use ports::{PortBook, check_hosts, port_is_free};
pub(crate) use tail::{ENGINE_LOG_MAX, appends, fresh_log, tail};

use nix::sys::signal::Signal as NixSignal;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, watch};

/// How an engine ended, once it and the rest of its group are gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exit {
    /// `exit status: 1`, `signal: 9 (SIGKILL)`.
    pub status: String,
    /// The exception its stderr ended with, if any ([`exit_cause`]).
    pub cause: Option<String>,
}

/// How long the cause of an engine's exit is looked for in its output
/// files: on a disk that stopped answering, the exit is told without it
/// (the model's task waits for the exit: a stop, a restart).
pub const EXIT_CAUSE_WAIT: Duration = Duration::from_secs(2);

impl Exit {
    /// Reads the cause from the ends of the engine's output files
    /// ([`log_paths`]; blocking I/O on a blocking thread), for
    /// [`EXIT_CAUSE_WAIT`] at most.
    async fn read(status: String, name: String, log_dir: PathBuf) -> Self {
        Self::read_within(status, EXIT_CAUSE_WAIT, move || {
            let [(out, _), (err, _)] = log_paths(&name, &log_dir);
            exit_cause::read(&[&err, &out])
        })
        .await
    }

    async fn read_within(
        status: String,
        wait: Duration,
        read: impl FnOnce() -> Option<String> + Send + 'static,
    ) -> Self {
        let cause = match tokio::time::timeout(wait, tokio::task::spawn_blocking(read)).await {
            Ok(read) => read.ok().flatten(),
            Err(_) => Some(format!(
                "(the cause is unknown: the engine's log could not be read within {wait:?})"
            )),
        };
        Self { status, cause }
    }
}

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpawnSpec {
    pub program: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

/// Environment variable marking an engine with a unique tag, so that one
/// whose pid was never recorded (siesta killed right after the spawn) is
/// still found in `/proc`.
pub const TAG_ENV: &str = "SIESTA_ENGINE_TAG";

/// Environment variable naming the state directory of the control plane
/// that spawned an engine: an engine whose record was lost with its store
/// (moved aside as corrupt, or deleted) is still found as this state
/// directory's, and told apart from another control plane's on the host.
pub const STATE_ENV: &str = "SIESTA_STATE_DIR";

/// Set for every engine: vLLM (and SGLang) name their engine core and
/// workers with py-setproctitle, which zeroes what `/proc/PID/environ`
/// shows of them unless this is set, and siesta finds an engine's
/// leftovers by [`TAG_ENV`] and [`STATE_ENV`] there (an engine core that
/// outlived its server while the store was lost was never found, and kept
/// its GPU memory). With it the titles are limited to the length of the
/// command line, which vLLM's short ones fit.
pub const NO_ENV_CLOBBER: (&str, &str) = ("SPT_NOENV", "1");

/// The value of [`STATE_ENV`] for `state_dir`: its canonical path (as
/// given when it cannot be resolved).
pub fn state_marker(state_dir: &Path) -> String {
    std::fs::canonicalize(state_dir)
        .unwrap_or_else(|_| state_dir.to_path_buf())
        .display()
        .to_string()
}

/// A stable hash (FNV-1a, 64 bits, hex) of what is run: program, arguments
/// and environment. An engine recorded with another hash is not adopted.
pub fn command_hash(spec: &SpawnSpec) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |s: &str| {
        for b in s.bytes().chain([0u8]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(&spec.program);
    spec.args.iter().for_each(|a| eat(a));
    let mut env = spec.env.clone();
    env.sort();
    for (k, v) in &env {
        eat(k);
        eat(v);
    }
    format!("{h:016x}")
}

/// A running (or exited) engine process group.
#[derive(Debug, Clone)]
pub struct ProcHandle {
    pub pid: u32,
    pub proc_gen: u64,
    /// Becomes true once the leader has exited and the group was swept.
    pub exited: watch::Receiver<bool>,
}

impl ProcHandle {
    pub fn signal(&self, sig: NixSignal) {
        signal_group(self.pid, sig);
    }

    pub fn has_exited(&self) -> bool {
        *self.exited.borrow()
    }

    /// SIGKILL to the group, then wait (up to [`KILL_WAIT`]) until the
    /// leader is reaped and the rest of the group is gone ([`sweep_group`]).
    pub async fn kill_and_wait(&self) {
        if !self.has_exited() {
            self.signal(NixSignal::SIGKILL);
            let mut rx = self.exited.clone();
            let _ = tokio::time::timeout(KILL_WAIT, rx.wait_for(|e| *e)).await;
        }
    }
}

/// How long [`ProcHandle::kill_and_wait`] waits for the leader to be
/// reaped and then the rest of its group to be gone.
pub const KILL_WAIT: Duration = Duration::from_secs(10).saturating_add(SWEEP_DEADLINE);

/// The engine's output files: `log_dir/NAME.{stdout,stderr}.log` (NAME as
/// [`crate::config::log_file_stem`] folds it).
pub fn log_paths(name: &str, log_dir: &Path) -> [(PathBuf, &'static str); 2] {
    [
        (
            log_dir.join(format!("{}.stdout.log", crate::config::log_file_stem(name))),
            "stdout",
        ),
        (
            log_dir.join(format!("{}.stderr.log", crate::config::log_file_stem(name))),
            "stderr",
        ),
    ]
}

/// Spawns the engine in its own process group, with `SIESTA_ENGINE_TAG=tag`
/// and `SIESTA_STATE_DIR` naming the state directory `log_dir` is in.
/// Output goes to `log_dir/NAME.{stdout,stderr}.log` (so an engine left
/// running outlives siesta without a broken pipe), tailed into `logs` (and
/// tracing at `trace` level only). `on_exit` runs with the exit status and
/// the cause its stderr ends with once the leader is reaped and the rest of
/// its group killed and gone ([`sweep_group`]).
pub fn spawn(
    name: &str,
    spec: &SpawnSpec,
    tag: &str,
    log_dir: &Path,
    proc_gen: u64,
    logs: Arc<LogRing>,
    on_exit: impl FnOnce(Exit) + Send + 'static,
) -> std::io::Result<ProcHandle> {
    let at = |path: &Path| {
        let path = path.display().to_string();
        move |e: std::io::Error| std::io::Error::new(e.kind(), format!("{path}: {e}"))
    };
    std::fs::create_dir_all(log_dir).map_err(at(log_dir))?;
    let [(out_path, _), (err_path, _)] = log_paths(name, log_dir);
    let out = fresh_log(&out_path).map_err(at(&out_path))?;
    let err = fresh_log(&err_path).map_err(at(&err_path))?;
    let mut cmd = tokio::process::Command::new(&spec.program);
    cmd.args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .env(TAG_ENV, tag)
        .env(STATE_ENV, state_marker(log_dir.parent().unwrap_or(log_dir)))
        .env(NO_ENV_CLOBBER.0, NO_ENV_CLOBBER.1)
        // systemd's notify socket and watchdog are the daemon's, not an
        // engine's (one that speaks sd_notify would say ready or alive
        // for it).
        .env_remove("NOTIFY_SOCKET")
        .env_remove("WATCHDOG_USEC")
        .env_remove("WATCHDOG_PID")
        .stdin(std::process::Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .kill_on_drop(false);
    let mut child = cmd.spawn().map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::NotFound {
            " (set the model's `executable` or `command` to a program on PATH or a full path)"
        } else {
            ""
        };
        std::io::Error::new(
            e.kind(),
            format!("cannot run {:?}: {e}{hint}", spec.program),
        )
    })?;
    let pid = child.id().unwrap_or(0);
    let start = procfs::start_time(pid);
    let (exited_tx, exited) = watch::channel(false);
    let name_owned = name.to_string();
    let tag_owned = tag.to_string();
    let log_dir = log_dir.to_path_buf();
    tokio::spawn(async move {
        let status = match child.wait().await {
            Ok(s) => s.to_string(),
            Err(e) => format!("wait failed: {e}"),
        };
        // The leader is gone; nothing of its group may stay behind, and
        // the engine has ended only once the rest is gone too.
        sweep_group(&name_owned, pid, start, &tag_owned).await;
        on_exit(Exit::read(status, name_owned, log_dir).await);
        let _ = exited_tx.send(true);
    });
    for (path, stream) in [(out_path, "stdout"), (err_path, "stderr")] {
        tokio::spawn(tail(
            path,
            0,
            stream,
            name.to_string(),
            logs.clone(),
            exited.clone(),
            Some(ENGINE_LOG_MAX),
        ));
    }
    Ok(ProcHandle {
        pid,
        proc_gen,
        exited,
    })
}

/// Engines sharing a GPU start one after another: one start lock per GPU. A start
/// holds it (written) from before its spawn until its engine is ready.
///
/// Memory freed on a GPU while an engine starts there fails that start:
/// vLLM compares the free memory after profiling with the free memory when
/// it began, and asserts it did not grow ("Error in memory profiling").
/// So a sleep holds the lock read: it waits for starts under way, and
/// starts wait for it, while sleeps go on side by side.
///
/// The other way round, a sleep fails when its GPU's memory use grows while
/// it frees: vLLM compares the GPU's free memory before and after and
/// asserts it did not shrink ("Memory usage increased after sleeping", a
/// 500; seen on an H200 when a neighbour woke on the same GPU during a
/// level-2 sleep). So each GPU has a second lock: a sleep holds it written
/// (no wake there meanwhile; sleeps there take turns, a fraction of a
/// second each), a wake's engine call holds it read (wakes go on side by
/// side). Starts allocate too, and already exclude sleeps through the
/// first lock.
#[derive(Debug, Default)]
pub struct GpuLocks {
    starts: PerGpu,
    sleeps: PerGpu,
}

/// A start's hold on its GPUs (see [`GpuLocks::acquire`]).
pub type StartGuards = Vec<OwnedRwLockWriteGuard<()>>;

/// A sleep's hold on its GPUs: no start there meanwhile.
pub type FreeGuards = Vec<OwnedRwLockReadGuard<()>>;

/// A sleep's hold on its GPUs: no wake there meanwhile.
pub type SleepGuards = Vec<OwnedRwLockWriteGuard<()>>;

/// A wake's hold on its GPUs: no sleep there meanwhile.
pub type WakeGuards = Vec<OwnedRwLockReadGuard<()>>;

/// One lock per GPU, made on first use.
type PerGpu = Mutex<BTreeMap<u32, Arc<tokio::sync::RwLock<()>>>>;

/// The locks of `gpus` in `map`, in index order (taken in that order: no
/// deadlock).
fn locks_of(map: &PerGpu, gpus: &[u32]) -> Vec<Arc<tokio::sync::RwLock<()>>> {
    let mut sorted = gpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut map = map.lock().unwrap();
    sorted
        .iter()
        .map(|g| map.entry(*g).or_default().clone())
        .collect()
}

async fn write_all(map: &PerGpu, gpus: &[u32]) -> Vec<OwnedRwLockWriteGuard<()>> {
    let mut guards = Vec::new();
    for l in locks_of(map, gpus) {
        guards.push(l.write_owned().await);
    }
    guards
}

async fn read_all(map: &PerGpu, gpus: &[u32]) -> Vec<OwnedRwLockReadGuard<()>> {
    let mut guards = Vec::new();
    for l in locks_of(map, gpus) {
        guards.push(l.read_owned().await);
    }
    guards
}

/// All of them read, if none is written now (None: one is).
fn try_read_all(map: &PerGpu, gpus: &[u32]) -> Option<Vec<OwnedRwLockReadGuard<()>>> {
    locks_of(map, gpus)
        .into_iter()
        .map(|l| l.try_read_owned().ok())
        .collect()
}

impl GpuLocks {
    /// Takes the start locks of `gpus`, for a start.
    pub async fn acquire(&self, gpus: &[u32]) -> StartGuards {
        write_all(&self.starts, gpus).await
    }

    /// Takes the start locks of `gpus` shared, to free memory there, if no
    /// start is under way on them. None: one is (the caller may say so,
    /// then wait with [`Self::free`]).
    pub fn try_free(&self, gpus: &[u32]) -> Option<FreeGuards> {
        try_read_all(&self.starts, gpus)
    }

    /// [`Self::try_free`], waiting.
    pub async fn free(&self, gpus: &[u32]) -> FreeGuards {
        read_all(&self.starts, gpus).await
    }

    /// A sleep's hold on `gpus` if no wake is under way there (None: one is).
    pub fn try_sleep(&self, gpus: &[u32]) -> Option<SleepGuards> {
        locks_of(&self.sleeps, gpus)
            .into_iter()
            .map(|l| l.try_write_owned().ok())
            .collect()
    }

    /// [`Self::try_sleep`], waiting.
    pub async fn sleep(&self, gpus: &[u32]) -> SleepGuards {
        write_all(&self.sleeps, gpus).await
    }

    /// A wake's hold on `gpus` if no sleep is under way there (None: one is).
    pub fn try_wake(&self, gpus: &[u32]) -> Option<WakeGuards> {
        try_read_all(&self.sleeps, gpus)
    }

    /// [`Self::try_wake`], waiting.
    pub async fn wake(&self, gpus: &[u32]) -> WakeGuards {
        read_all(&self.sleeps, gpus).await
    }
}

/// A start's hold on its GPUs' start locks, from when the spawn task
/// takes them until the model's task says the start is over. Released by
/// the model's task itself, at once: a sleep or stop it begins next must
/// not find its own start still holding the GPUs.
#[derive(Debug, Clone, Default)]
pub struct StartHold(Arc<Mutex<Hold>>);

#[derive(Debug, Default)]
enum Hold {
    #[default]
    Waiting,
    Held {
        _guards: StartGuards,
    },
    Released,
}

impl StartHold {
    /// Keeps `guards` until [`Self::release`] (dropped at once if that
    /// came first).
    pub fn keep(&self, guards: StartGuards) {
        let mut hold = self.0.lock().unwrap();
        if !matches!(*hold, Hold::Released) {
            *hold = Hold::Held { _guards: guards };
        }
    }

    /// Ends the hold (now, or as soon as the guards are taken).
    pub fn release(&self) {
        *self.0.lock().unwrap() = Hold::Released;
    }

    /// Whether the start holds its GPUs' start locks now (taken, not
    /// released).
    pub fn is_held(&self) -> bool {
        matches!(*self.0.lock().unwrap(), Hold::Held { .. })
    }
}

/// A [`StartHold`] released when dropped: the stop of an engine still
/// starting keeps its start's hold until the engine has exited.
#[derive(Debug)]
pub struct ReleasedOnDrop(pub StartHold);

impl Drop for ReleasedOnDrop {
    fn drop(&mut self) {
        self.0.release();
    }
}

#[cfg(test)]
mod tests {

    /// An exit whose log cannot be read (a disk that stopped answering) is
    /// told within the wait, without its cause: the model's task waits for
    /// the exit to stop or restart the engine.
    #[tokio::test]
    async fn an_exit_is_told_though_its_log_cannot_be_read() {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let read = move || {
            let _ = held.recv_timeout(Duration::from_secs(30));
            Some("never seen".to_string())
        };
        let exit = tokio::time::timeout(
            Duration::from_secs(10),
            Exit::read_within("exit status: 1".into(), Duration::from_millis(100), read),
        )
        .await
        .expect("the exit waited for its log");
        let _ = release.send(());
        assert_eq!(exit.status, "exit status: 1");
        let cause = exit.cause.unwrap();
        assert!(cause.contains("could not be read within 100ms"), "{cause}");
    }

    use super::*;
    use crate::config::{Config, GpuMemory};
    use crate::placement::Placed;
    use crate::placement::{Machine, Policy, needs_of, place};

    #[test]
    fn argv_matches_the_contract() {
        let cfg = Config::demo(vec!["/bin/siesta".into(), "fake-vllm".into()]);
        let mut m = cfg.models[0].clone();
        m.gpu_memory = Some(GpuMemory::Fraction(0.45));
        let placed = Placed {
            gpus: vec![2, 3],
            gpu_memory_utilization: 0.45,
            ..Placed::default()
        };
        let spec = spawn_spec(&m, 8101, &placed);
        assert_eq!(spec.program, "/bin/siesta");
        let argv = spec.args.join(" ");
        assert!(argv.starts_with(
            "fake-vllm serve Qwen/Qwen3-8B --host 127.0.0.1 --port 8101 --served-model-name chat --enable-sleep-mode --tensor-parallel-size 2 --gpu-memory-utilization 0.45 --startup-time"
        ), "{argv}");
        assert!(
            spec.env
                .contains(&("CUDA_VISIBLE_DEVICES".into(), "2,3".into()))
        );
        assert!(
            spec.env
                .contains(&("VLLM_SERVER_DEV_MODE".into(), "1".into()))
        );
    }

    /// The engine's GPU arguments and environment are the placement's,
    /// exactly: there is no second builder to disagree with it.
    #[test]
    fn the_gpu_part_of_the_argv_and_env_is_the_placements() {
        let cfg = Config::demo(vec!["/bin/siesta".into(), "fake-vllm".into()]);
        let mut m = cfg.models[0].clone();
        (m.gpus, m.gpu_memory) = (1, Some(GpuMemory::Bytes(20 << 30)));
        let machine = Machine::uniform(2, 80 << 30);
        let p = place(&machine, &[needs_of(&m)], &Policy::default()).unwrap();
        let placed = p[0].placed();
        assert_eq!(placed.gpu_memory_utilization, 0.25);
        let spec = spawn_spec(&m, 8101, &placed);
        let want = placed.engine_args();
        assert_eq!(want, ["--gpu-memory-utilization", "0.25"]);
        assert!(
            spec.args.windows(want.len()).any(|w| w == want.as_slice()),
            "{:?}",
            spec.args
        );
        assert!(!spec.args.contains(&"--tensor-parallel-size".to_string()));
        for kv in placed.engine_env() {
            assert!(spec.env.contains(&kv), "{kv:?} missing from {:?}", spec.env);
        }
        assert!(
            spec.env
                .contains(&("CUDA_VISIBLE_DEVICES".into(), p[0].cuda_visible_devices()))
        );
    }

    #[tokio::test]
    async fn a_missing_program_says_which_and_what_to_set() {
        let dir = tempfile::tempdir().unwrap();
        let spec = SpawnSpec {
            program: "/nonexistent/vllm".into(),
            args: vec![],
            env: vec![],
        };
        let logs = Arc::new(LogRing::new(10));
        let e = spawn("m", &spec, "tag", dir.path(), 1, logs, |_| {}).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.starts_with("cannot run \"/nonexistent/vllm\": ") && msg.contains("`executable`"),
            "{msg}"
        );
    }

    /// Spawns an engine leader (`sh`, tagged `tag`) that first runs
    /// `children` in the background, then exits once the returned file
    /// exists.
    fn leader_until_told(dir: &Path, children: &str, tag: &str) -> (ProcHandle, PathBuf) {
        let go = dir.join("go");
        let script = format!(
            "{children} while [ ! -e '{}' ]; do sleep 0.05; done",
            go.display()
        );
        let spec = SpawnSpec {
            program: "sh".into(),
            args: vec!["-c".into(), script],
            env: vec![],
        };
        let logs = Arc::new(LogRing::new(10));
        let h = spawn("m", &spec, tag, dir, 1, logs, |_| {}).unwrap();
        (h, go)
    }

    /// Polls `done` every 20 ms for up to 10 s.
    async fn eventually(done: impl Fn() -> bool) -> bool {
        for _ in 0..500 {
            if done() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        done()
    }

    /// Tells the leader to exit and waits (up to 20 s) until the engine
    /// has ended: leader reaped, what it left killed and gone.
    async fn end(h: &ProcHandle, go: &Path) {
        std::fs::write(go, "").unwrap();
        let mut exited = h.exited.clone();
        tokio::time::timeout(Duration::from_secs(20), exited.wait_for(|e| *e))
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn children_left_by_an_exited_engine_are_killed_with_its_group() {
        let dir = tempfile::tempdir().unwrap();
        // Two children (engine core and a TP worker, neither watching its
        // parent) stay in the leader's group.
        let (h, go) = leader_until_told(dir.path(), "sleep 600 & sleep 600 &", "tag-exit");
        let pid = h.pid;
        let two_children = || procfs::group_members(pid).len() >= 3;
        assert!(
            eventually(two_children).await,
            "{:?}",
            procfs::group_members(pid)
        );
        end(&h, &go).await;
        // Ended means gone: a killed member keeps its (GPU) memory until it
        // has exited, so the engine may not count as stopped before.
        assert_eq!(procfs::group_members(pid), Vec::<u32>::new());
    }

    /// A worker that left the engine's process group (`setsid`) is out of
    /// reach of its group's signals, but keeps the engine's tag: the engine
    /// has ended only once it is killed and gone too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_that_left_the_group_is_killed_when_the_engine_exits() {
        let dir = tempfile::tempdir().unwrap();
        let tag = format!("tag-setsid-{}", std::process::id());
        let (h, go) = leader_until_told(dir.path(), "setsid sleep 600 &", &tag);
        let pid = h.pid;
        let escaped = || {
            procfs::pids_with_env(TAG_ENV, &tag)
                .into_iter()
                .filter(|p| procfs::pgid(*p).is_some_and(|g| g != pid))
                .collect::<Vec<_>>()
        };
        assert!(eventually(|| !escaped().is_empty()).await);
        let worker = escaped();
        assert_eq!(worker.len(), 1, "the setsid worker: {worker:?}");
        end(&h, &go).await;
        assert!(
            !procfs::alive(worker[0], None),
            "worker {} outlived its engine",
            worker[0]
        );
    }

    #[tokio::test]
    async fn start_locks_serialise_per_gpu() {
        let locks = Arc::new(GpuLocks::default());
        let g = locks.acquire(&[0, 1]).await;
        let l2 = locks.clone();
        let waiter = tokio::spawn(async move { l2.acquire(&[1]).await.len() });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        // Another GPU is free.
        assert_eq!(locks.acquire(&[2]).await.len(), 1);
        drop(g);
        assert_eq!(waiter.await.unwrap(), 1);
    }

    /// Frees share the lock with each other and wait for a start; a start
    /// waits for the frees under way.
    #[tokio::test]
    async fn frees_wait_for_starts_and_starts_for_frees() {
        let locks = Arc::new(GpuLocks::default());
        let a = locks.try_free(&[0]).expect("no start");
        let b = locks.try_free(&[0, 1]).expect("no start");
        let l2 = locks.clone();
        let start = tokio::spawn(async move { l2.acquire(&[1]).await });
        tokio::task::yield_now().await;
        assert!(!start.is_finished(), "a start waits for the frees");
        drop((a, b));
        let started = start.await.unwrap();
        assert!(locks.try_free(&[1]).is_none(), "a free waits for the start");
        assert!(locks.try_free(&[0]).is_some(), "another GPU is free");
        let l3 = locks.clone();
        let free = tokio::spawn(async move { l3.free(&[0, 1]).await.len() });
        tokio::task::yield_now().await;
        assert!(!free.is_finished());
        drop(started);
        assert_eq!(free.await.unwrap(), 2);
    }

    /// A start's hold ends the moment the model's task releases it (a free
    /// right after finds the GPU free), also when the release came before
    /// the spawn task took the locks.
    #[tokio::test]
    async fn a_start_hold_ends_at_once_when_released() {
        let locks = GpuLocks::default();
        let hold = StartHold::default();
        hold.keep(locks.acquire(&[0]).await);
        assert!(locks.try_free(&[0]).is_none(), "held");
        hold.clone().release();
        assert!(locks.try_free(&[0]).is_some(), "released synchronously");
        let late = StartHold::default();
        late.release();
        late.keep(locks.acquire(&[0]).await);
        assert!(
            locks.try_free(&[0]).is_some(),
            "released before it was kept"
        );
    }

    /// Wakes on a GPU go side by side; a sleep there waits for them and
    /// they for it; other GPUs and starts are not concerned.
    #[tokio::test]
    async fn a_sleep_and_wakes_on_one_gpu_take_turns() {
        let locks = GpuLocks::default();
        let wakes = (locks.wake(&[0]).await, locks.try_wake(&[0, 1]));
        assert!(wakes.1.is_some(), "wakes share");
        assert!(locks.try_sleep(&[0]).is_none(), "a sleep waits for wakes");
        assert!(locks.try_sleep(&[2]).is_some(), "other GPUs are free");
        assert!(locks.try_free(&[0]).is_some(), "the start lock is another");
        drop(wakes);
        let sleep = locks.sleep(&[1, 0]).await;
        assert!(locks.try_wake(&[1]).is_none(), "a wake waits for the sleep");
        assert!(locks.try_sleep(&[0]).is_none(), "sleeps take turns");
        drop(sleep);
        assert!(locks.try_wake(&[0, 1]).is_some());
    }
}
