//! The simulated engine: sleep state, the gates that hold requests while asleep, counters.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

use crate::cli::ServeArgs;
use crate::memory::{Level, Memory, MemoryError, Tags};
use crate::sim_gpu::{SimGpu, SimGpuError};

mod drain;
mod gpu;
mod shutdown;
use crate::version::Imitated;
pub use shutdown::Drained;

/// What `/sleep?mode=` does with requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SleepMode {
    /// Abort them (vLLM's default).
    Abort,
    /// Wait for them to finish, then sleep.
    Wait,
    /// Freeze them; they resume after the wake.
    Keep,
}

/// Whether requests may be scheduled, and the abort epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Gate {
    /// New requests may start.
    admit: bool,
    /// Requests in flight may produce tokens.
    run: bool,
    /// Bumped by an aborting sleep; requests started in an older epoch stop.
    epoch: u64,
    /// SIGTERM came: a request that arrives now is refused (or aborted, if it
    /// passed the server's check first).
    closed: bool,
}

/// Which parts are asleep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SleepState {
    /// The level of the last `/sleep`, even when a repeated sleep changed nothing (level 2
    /// over level 1 keeps the weights).
    pub level: u8,
    /// What `vllm:engine_sleep_state` says: asleep at `level` from the end of a `/sleep`
    /// until a wake records awake (`AsyncLLM.wake_up`: after every wake in 0.24, only after
    /// a full one from 0.32).
    pub recorded_asleep: bool,
    /// Weights not yet woken (in the executor's `sleeping_tags`).
    pub weights_asleep: bool,
    /// KV cache not yet woken.
    pub kv_asleep: bool,
    /// Scheduling paused: by every sleep (level 0 included) from its start, a draining
    /// `mode=wait` one too; resumed by a wake that leaves no executor tag asleep.
    pub paused: bool,
}

impl SleepState {
    /// `GET /is_sleeping` (`EngineCore.is_sleeping`: scheduler paused or executor asleep):
    /// true until every tag is awake.
    pub fn is_sleeping(&self) -> bool {
        self.executor_asleep() || self.paused
    }

    /// The executor holds a tag asleep.
    pub fn executor_asleep(&self) -> bool {
        self.weights_asleep || self.kv_asleep
    }
}

/// What a `/wake_up` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Woken {
    /// The state after it.
    pub state: SleepState,
    /// No executor tag is asleep (`EngineCore.wake_up`'s answer, `"status": "awake"`).
    pub fully_awake: bool,
}

/// A request stopped by an aborting sleep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Aborted;

/// Failures of engine operations, answered as HTTP 500.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// `--enable-sleep-mode` was not given.
    #[error("Sleep mode is not enabled in the model config")]
    SleepDisabled,
    /// The GPU's free memory shrank while the engine slept (another process allocated more
    /// than it freed): the worker's `assert freed_bytes >= 0` fails after its memory was
    /// freed (seen on vLLM 0.24, H200, a neighbour waking during a level-2 sleep).
    #[error("Call to sleep method failed: Memory usage increased after sleeping.")]
    SleepMemoryGrew,
    /// The memory backend failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The simulated GPU has no room (or its accounting failed).
    #[error(transparent)]
    Gpu(#[from] SimGpuError),
    /// A wake found no room: what vLLM 0.24 answers (seen on an H200 with
    /// another process holding the memory; `scripts/vllm-check crowded`).
    #[error(
        "Call to wake_up method failed: CUDA Error: out of memory at \
         /workspace/csrc/cumem_allocator.cpp:163"
    )]
    WakeOutOfMemory,
    /// A tag named twice in one `/wake_up`: the executor's second `sleeping_tags.remove`
    /// raises `KeyError` after the wake.
    #[error("Call to wake_up method failed: '{0}'")]
    WakeTagTwice(String),
    /// `/collective_rpc` of a method the worker lacks.
    #[error("Call to collective_rpc method failed: {0}")]
    RpcFailed(String),
}

/// The engine, shared by every connection.
#[derive(Debug)]
pub struct Engine {
    /// The command line.
    pub args: ServeArgs,
    memory: Arc<dyn Memory>,
    /// The simulated GPU, when configured.
    pub gpu: Option<SimGpu>,
    /// The pid holding the (simulated) GPU memory: the engine core's.
    pub gpu_holder: AtomicU32,
    /// Bytes per GPU this engine has recorded on the simulated GPU.
    pub gpu_bytes: AtomicU64,
    /// The engine core died.
    pub dead: AtomicBool,
    /// One engine-core operation at a time (sleep, wake, RPC, `/is_sleeping`).
    ops: Arc<tokio::sync::Mutex<()>>,
    /// Sleeps waiting for a drain to end (see `drain.rs`).
    drains: Mutex<drain::Drains>,
    sleep: Mutex<SleepState>,
    gate: watch::Sender<Gate>,
    /// Requests producing tokens.
    pub running: AtomicU64,
    /// Requests held until a wake (not in vLLM's gauges: a sleeping engine takes no steps).
    pub held: AtomicU64,
    /// Generation requests that arrived.
    pub arrived: AtomicU64,
    /// Requests answered to the end.
    pub served: AtomicU64,
    /// Prompt tokens processed.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub generation_tokens: AtomicU64,
    /// Prefill chunks done by the requests still prefilling or running (their KV cache).
    pub prefill_chunks: AtomicU64,
    /// Completed sleeps and wakes.
    pub sleeps: AtomicU64,
    /// Completed (full) wakes.
    pub wakes: AtomicU64,
    /// Unix ns at which the last full wake finished (0: never).
    pub last_wake_finished_ns: AtomicU64,
    /// When the last generation request arrived (unix ns; 0: none yet).
    pub last_request_arrived_ns: AtomicU64,
    ready_at: Mutex<Option<Instant>>,
}

/// Unix time in ns.
pub fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl Engine {
    /// A fresh, awake engine.
    pub fn new(args: ServeArgs, memory: Box<dyn Memory>, gpu: Option<SimGpu>) -> Engine {
        let (gate, _) = watch::channel(Gate {
            admit: true,
            run: true,
            epoch: 0,
            closed: false,
        });
        Engine {
            args,
            memory: Arc::from(memory),
            gpu,
            gpu_holder: AtomicU32::new(std::process::id()),
            gpu_bytes: AtomicU64::new(0),
            dead: AtomicBool::new(false),
            ops: Arc::new(tokio::sync::Mutex::new(())),
            drains: Mutex::new(Vec::new()),
            sleep: Mutex::new(SleepState::default()),
            gate,
            running: AtomicU64::new(0),
            held: AtomicU64::new(0),
            arrived: AtomicU64::new(0),
            served: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            prefill_chunks: AtomicU64::new(0),
            sleeps: AtomicU64::new(0),
            wakes: AtomicU64::new(0),
            last_wake_finished_ns: AtomicU64::new(0),
            last_request_arrived_ns: AtomicU64::new(0),
            ready_at: Mutex::new(None),
        }
    }

    /// Marks start-up as done (the instant `--fail-health-after` counts from).
    pub fn set_ready(&self) {
        *self.ready_at.lock().unwrap() = Some(Instant::now());
    }

    /// The imitated vLLM version.
    pub fn version(&self) -> Imitated {
        Imitated::parse(&self.args.sim.imitate_version).unwrap_or(Imitated::JSON_SLEEP)
    }

    /// False once the engine core died (requests in flight fail).
    pub fn core_alive(&self) -> bool {
        !self.dead.load(Ordering::SeqCst)
    }

    /// False once the engine core died or `--fail-health-after` has passed since start-up.
    pub fn healthy(&self) -> bool {
        if self.dead.load(Ordering::SeqCst) {
            return false;
        }
        match (
            self.args.faults.fail_health_after,
            *self.ready_at.lock().unwrap(),
        ) {
            (Some(after), Some(at)) => at.elapsed() < after,
            _ => true,
        }
    }

    /// The sleep state.
    pub fn sleep_state(&self) -> SleepState {
        *self.sleep.lock().unwrap()
    }

    /// Whether answers come from intact weights.
    pub fn weights_intact(&self) -> bool {
        self.memory.weights_intact()
    }

    /// Every resident weight byte compared with the pattern.
    pub fn verify_all(&self) -> Result<bool, String> {
        self.memory.verify_all().map_err(|e| e.to_string())
    }

    /// Bytes the memory backend holds on the device.
    pub fn device_bytes(&self) -> u64 {
        self.memory.device_bytes()
    }

    /// Waits until new requests may be scheduled (counted as held meanwhile), and returns
    /// the abort epoch the request runs in; `Err` when an aborting `/sleep` came first.
    pub async fn admit(&self) -> Result<u64, Aborted> {
        let mut rx = self.gate.subscribe();
        let start = rx.borrow().epoch;
        if rx.borrow().closed {
            // Past the server's check before the SIGTERM, refused by the engine core
            // (`EngineCore._reject_add_in_shutdown`): aborted.
            return Err(Aborted);
        }
        let mut counted = false;
        let result = loop {
            let g = *rx.borrow_and_update();
            if g.epoch != start {
                break Err(Aborted);
            }
            if g.admit {
                break Ok(g.epoch);
            }
            if !counted {
                self.held.fetch_add(1, Ordering::SeqCst);
                counted = true;
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        if counted {
            self.held.fetch_sub(1, Ordering::SeqCst);
        }
        result
    }

    /// Before each token: waits while the engine is frozen; `Err` if an aborting sleep began
    /// after the request started.
    pub async fn step(&self, epoch: u64) -> Result<(), Aborted> {
        let mut rx = self.gate.subscribe();
        loop {
            let g = *rx.borrow_and_update();
            if g.epoch != epoch {
                return Err(Aborted);
            }
            if g.run {
                return Ok(());
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Without `--enable-sleep-mode`, 0.24 and later sleep and wake (freeing nothing); older
    /// fail.
    fn sleep_allowed(&self) -> Result<(), EngineError> {
        if self.args.enable_sleep_mode || self.version().sleeps_without_flag() {
            Ok(())
        } else {
            Err(EngineError::SleepDisabled)
        }
    }

    /// Applies a `/sleep` `mode` to the requests in flight and held (`pause_scheduler`):
    /// `abort` and `keep` stop them at once, `wait` only stops admitting new ones.
    fn pause(&self, mode: SleepMode) {
        match mode {
            SleepMode::Abort => self.gate.send_modify(|g| {
                g.admit = false;
                g.run = false;
                g.epoch += 1;
            }),
            SleepMode::Keep => self.gate.send_modify(|g| {
                g.admit = false;
                g.run = false;
            }),
            SleepMode::Wait => self.gate.send_modify(|g| g.admit = false),
        }
        self.sleep.lock().unwrap().paused = true;
    }

    /// `POST /sleep?level=0|1|2`, as vLLM's `EngineCore.sleep`: the scheduler is paused at
    /// once (so `/is_sleeping` answers true from then on); with `mode=wait` and requests in
    /// flight the executor sleeps only once they are done, and the engine core serves other
    /// calls meanwhile: `/is_sleeping` answers, and a `/wake_up` finds the executor awake and
    /// resumes the scheduler, yet the executor still goes to sleep when the drain ends, with
    /// the scheduler running (a request then reaches freed memory: see
    /// [`Engine::executor_freed`]). Asleep already: re-applies `mode` (the default `abort`
    /// aborts requests held meanwhile) and records the new level, freeing nothing more.
    pub async fn sleep(&self, level: u8, mode: SleepMode) -> Result<(), EngineError> {
        self.sleep_allowed()?;
        let (before, drain) = {
            let _op = self.op().await;
            let before = self.sleep_state();
            self.pause(mode);
            (
                before,
                mode == SleepMode::Wait && self.running.load(Ordering::SeqCst) > 0,
            )
        };
        // `has_work()`: requests the scheduler runs, those admitted after a
        // resume too. The last to end hands over the lock (`drain.rs`).
        let _op = if drain {
            tracing::info!("Waiting for in-flight requests to complete before sleeping...");
            self.drained().await
        } else {
            self.op().await
        };
        self.gate.send_modify(|g| {
            if !g.admit {
                g.run = false;
            }
        });
        let mut st = self.sleep_state();
        // The executor's "already sleeping": any tag asleep in 0.24, the weights from 0.32
        // (a half-woken executor sleeps again).
        let already = if self.version().sleep_rework() {
            st.weights_asleep
        } else {
            st.executor_asleep()
        };
        if level == 0 {
            if !before.is_sleeping() {
                tokio::time::sleep(self.args.sim.sleep_time).await;
                self.sleeps.fetch_add(1, Ordering::SeqCst);
            }
        } else if already {
            tracing::warn!(level, ?mode, "Executor is already sleeping.");
        } else {
            // The worker reads the GPU's free memory before and after (`mem_get_info`).
            let others_before = self.gpu_others()?;
            let own_before = self.gpu_bytes.load(Ordering::SeqCst);
            tokio::time::sleep(self.args.sim.sleep_time).await;
            if self.args.enable_sleep_mode {
                let lv = if level == 1 { Level::One } else { Level::Two };
                self.blocking(move |m| m.sleep(lv)).await?;
            }
            st.weights_asleep = true;
            st.kv_asleep = true;
            self.set_gpu_usage(self.gpu_usage(st), false)?;
            self.sleeps.fetch_add(1, Ordering::SeqCst);
            let freed = own_before.saturating_sub(self.gpu_bytes.load(Ordering::SeqCst));
            let grew = self
                .gpu_others()?
                .iter()
                .zip(&others_before)
                .any(|(now, was)| *now > was + freed);
            if grew {
                // Freed, but the engine core never records the sleep.
                *self.sleep.lock().unwrap() = SleepState {
                    level: before.level,
                    recorded_asleep: before.recorded_asleep,
                    ..st
                };
                tracing::error!("AssertionError: Memory usage increased after sleeping.");
                return Err(EngineError::SleepMemoryGrew);
            }
        }
        // `AsyncLLM.sleep` records the level once the engine core answered.
        st.level = level;
        st.recorded_asleep = true;
        *self.sleep.lock().unwrap() = st;
        if st.executor_asleep() && !st.paused {
            tracing::warn!(
                "the executor went to sleep after a drain during which a wake resumed the \
                 scheduler: requests now reach freed memory"
            );
        }
        tracing::info!(level, ?mode, "engine asleep");
        Ok(())
    }

    /// `POST /wake_up`, as vLLM's `EngineCore.wake_up`: `tags` (none: every tag asleep) minus
    /// `scheduling` go to the executor, which does nothing when no tag is asleep or when one
    /// named is not asleep (an unknown one too); the scheduler resumes whenever no executor
    /// tag is left asleep. A tag named twice wakes, then fails as vLLM's `set.remove` does.
    pub async fn wake(&self, tags: Option<&[String]>) -> Result<Woken, EngineError> {
        self.sleep_allowed()?;
        let _op = self.op().await;
        if self.args.faults.hang_on_wake {
            tracing::warn!("fault: --hang-on-wake, this wake never finishes");
            std::future::pending::<()>().await;
        }
        let before = self.sleep_state();
        let rest: Option<Vec<&str>> = tags.map(|t| {
            t.iter()
                .map(String::as_str)
                .filter(|t| *t != "scheduling")
                .collect()
        });
        let asleep = |t: &str| match t {
            "weights" => before.weights_asleep,
            "kv_cache" => before.kv_asleep,
            _ => false,
        };
        let woken: Option<Tags> = match &rest {
            Some(r) if r.is_empty() => None,
            _ if !before.executor_asleep() => {
                tracing::warn!("Executor is not sleeping.");
                None
            }
            None => Some(Tags {
                weights: before.weights_asleep,
                kv_cache: before.kv_asleep,
            }),
            Some(r) => match r.iter().find(|t| !asleep(t)) {
                Some(t) => {
                    tracing::warn!("Tag {t} is not in sleeping tags");
                    None
                }
                None => Some(Tags {
                    weights: r.contains(&"weights"),
                    kv_cache: r.contains(&"kv_cache"),
                }),
            },
        };
        let mut after = before;
        if let Some(t) = woken {
            if t.weights {
                tokio::time::sleep(self.args.sim.wake_time).await;
            }
            let mut state = after;
            state.weights_asleep &= !t.weights;
            state.kv_asleep &= !t.kv_cache;
            self.set_gpu_usage(self.gpu_usage(state), true)
                .map_err(|e| match e {
                    SimGpuError::OutOfMemory { .. } => {
                        // The engine core's log line; the answer says less.
                        tracing::error!(
                            "RuntimeError: CUDA Error: out of memory at \
                             /workspace/csrc/cumem_allocator.cpp:163 ({e})"
                        );
                        EngineError::WakeOutOfMemory
                    }
                    e => e.into(),
                })?;
            if self.args.enable_sleep_mode {
                self.blocking(move |m| m.wake(t)).await?;
            }
            // Then each named tag leaves `sleeping_tags` in turn.
            match &rest {
                None => after = state,
                Some(r) => {
                    for (i, tag) in r.iter().enumerate() {
                        if r[..i].contains(tag) {
                            *self.sleep.lock().unwrap() = after;
                            return Err(EngineError::WakeTagTwice(tag.to_string()));
                        }
                        match *tag {
                            "weights" => after.weights_asleep = false,
                            _ => after.kv_asleep = false,
                        }
                    }
                }
            }
        }
        let fully_awake = !after.executor_asleep();
        if fully_awake {
            after.paused = false;
        }
        if fully_awake || !self.version().sleep_rework() {
            after.recorded_asleep = false;
        }
        if !after.is_sleeping() {
            after.level = 0;
        }
        *self.sleep.lock().unwrap() = after;
        if fully_awake && !self.gate.borrow().admit {
            self.last_wake_finished_ns
                .store(unix_ns(), Ordering::SeqCst);
            self.wakes.fetch_add(1, Ordering::SeqCst);
            self.gate.send_modify(|g| {
                g.admit = true;
                g.run = true;
            });
            tracing::info!(intact = self.weights_intact(), "engine awake");
        }
        Ok(Woken {
            state: after,
            fully_awake,
        })
    }

    /// A request is about to run on an executor whose memory a sleep freed (the scheduler was
    /// resumed during a draining sleep): what it reads is unmapped, so the engine core dies
    /// of a CUDA error. Without `--enable-sleep-mode` nothing was freed.
    pub fn executor_freed(&self) -> bool {
        self.args.enable_sleep_mode && self.sleep_state().executor_asleep()
    }

    /// `GET /is_sleeping`: a utility call that waits behind a running wake or RPC.
    pub async fn is_sleeping(&self) -> bool {
        let _op = self.op().await;
        self.sleep_state().is_sleeping()
    }

    /// Runs a memory operation (a real backend copies to and from the GPU) off the async
    /// workers.
    async fn blocking<F>(&self, op: F) -> Result<(), MemoryError>
    where
        F: FnOnce(&dyn Memory) -> Result<(), MemoryError> + Send + 'static,
    {
        let memory = self.memory.clone();
        tokio::task::spawn_blocking(move || op(memory.as_ref()))
            .await
            .unwrap_or_else(|e| Err(MemoryError::Device(format!("memory task failed: {e}"))))
    }

    /// `reset_prefix_cache` (a utility call, one at a time with sleeps, wakes and RPCs): false
    /// while running requests (a frozen `mode=keep` one too) hold KV-cache blocks, as the
    /// block pool refuses to reset then.
    pub async fn reset_prefix_cache(&self) -> bool {
        let _op = self.op().await;
        self.running.load(Ordering::SeqCst) == 0
    }

    /// `collective_rpc reload_weights`.
    pub async fn reload_weights(&self) -> Result<(), EngineError> {
        let _op = self.op().await;
        if self.sleep_state().weights_asleep {
            return Err(MemoryError::WeightsAsleep.into());
        }
        tracing::info!("reloading weights");
        tokio::time::sleep(self.args.sim.reload_time).await;
        self.blocking(|m| m.reload_weights()).await?;
        tracing::info!("weights reloaded");
        Ok(())
    }
}
