//! The simulated engine: sleep state, the gates that hold requests while asleep, counters.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

use crate::cli::ServeArgs;
use crate::memory::{Level, Memory, MemoryError, Tags};
use crate::sim_gpu::{SimGpu, SimGpuError};

mod gpu;
use crate::version::Imitated;

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
}

/// Which parts are asleep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SleepState {
    /// The level the engine reports (`vllm:engine_sleep_state`): that of the last `/sleep`,
    /// even when a repeated sleep changed nothing (level 2 over level 1 keeps the weights).
    pub level: u8,
    /// Weights not yet woken.
    pub weights_asleep: bool,
    /// KV cache not yet woken.
    pub kv_asleep: bool,
    /// Scheduling paused (every sleep, level 0 included).
    pub paused: bool,
}

impl SleepState {
    /// `GET /is_sleeping`: true until every tag is awake.
    pub fn is_sleeping(&self) -> bool {
        self.weights_asleep || self.kv_asleep || self.paused
    }
}

/// What a wake restores: the memory tags and, from vLLM 0.33, `scheduling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WakeTags {
    /// `weights` and `kv_cache`.
    pub memory: Tags,
    /// `scheduling` (resumes a level-0 sleep).
    pub scheduling: bool,
}

impl WakeTags {
    /// A wake without `tags`.
    pub const ALL: WakeTags = WakeTags {
        memory: Tags::ALL,
        scheduling: true,
    };

    /// The tag names, as `/wake_up` answers them.
    pub fn names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.memory.weights {
            v.push("weights");
        }
        if self.memory.kv_cache {
            v.push("kv_cache");
        }
        if self.scheduling {
            v.push("scheduling");
        }
        v
    }
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
    ops: tokio::sync::Mutex<()>,
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
        });
        Engine {
            args,
            memory: Arc::from(memory),
            gpu,
            gpu_holder: AtomicU32::new(std::process::id()),
            gpu_bytes: AtomicU64::new(0),
            dead: AtomicBool::new(false),
            ops: tokio::sync::Mutex::new(()),
            sleep: Mutex::new(SleepState::default()),
            gate,
            running: AtomicU64::new(0),
            held: AtomicU64::new(0),
            arrived: AtomicU64::new(0),
            served: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
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

    /// Without `--enable-sleep-mode`, 0.33 sleeps and wakes (freeing nothing); older fail.
    fn sleep_allowed(&self) -> Result<(), EngineError> {
        if self.args.enable_sleep_mode || self.version().json_sleep_bodies() {
            Ok(())
        } else {
            Err(EngineError::SleepDisabled)
        }
    }

    /// Applies a `/sleep` `mode` to the requests in flight and held.
    async fn pause(&self, mode: SleepMode) {
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
            SleepMode::Wait => {
                self.gate.send_modify(|g| g.admit = false);
                while self.running.load(Ordering::SeqCst) > 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                self.gate.send_modify(|g| g.run = false);
            }
        }
    }

    /// `POST /sleep?level=0|1|2`. Asleep already: re-applies `mode` (the default `abort`
    /// aborts requests held meanwhile) and reports the new level, freeing nothing more.
    pub async fn sleep(&self, level: u8, mode: SleepMode) -> Result<(), EngineError> {
        self.sleep_allowed()?;
        let _op = self.ops.lock().await;
        self.pause(mode).await;
        if self.sleep_state().is_sleeping() {
            tracing::warn!(level, ?mode, "Executor is already sleeping.");
            if level > 0 {
                self.sleep.lock().unwrap().level = level;
            }
            return Ok(());
        }
        tokio::time::sleep(self.args.sim.sleep_time).await;
        if level > 0 && self.args.enable_sleep_mode {
            let lv = if level == 1 { Level::One } else { Level::Two };
            self.blocking(move |m| m.sleep(lv)).await?;
        }
        let st = SleepState {
            level,
            weights_asleep: level > 0,
            kv_asleep: level > 0,
            paused: true,
        };
        *self.sleep.lock().unwrap() = st;
        self.set_gpu_usage(self.gpu_usage(st), false)?;
        self.sleeps.fetch_add(1, Ordering::SeqCst);
        tracing::info!(level, ?mode, "engine asleep");
        Ok(())
    }

    /// `POST /wake_up`: wakes `tags`; requests resume once every tag is awake. Returns the
    /// state after the wake.
    pub async fn wake(&self, tags: WakeTags) -> Result<SleepState, EngineError> {
        self.sleep_allowed()?;
        let _op = self.ops.lock().await;
        if self.args.faults.hang_on_wake {
            tracing::warn!("fault: --hang-on-wake, this wake never finishes");
            std::future::pending::<()>().await;
        }
        let before = self.sleep_state();
        if tags.memory.weights && before.weights_asleep {
            tokio::time::sleep(self.args.sim.wake_time).await;
        }
        let mut after = before;
        after.weights_asleep &= !tags.memory.weights;
        after.kv_asleep &= !tags.memory.kv_cache;
        if !after.weights_asleep && !after.kv_asleep && (tags.scheduling || before.level > 0) {
            after.paused = false;
        }
        self.set_gpu_usage(self.gpu_usage(after), true)
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
            let t = tags.memory;
            self.blocking(move |m| m.wake(t)).await?;
        }
        if !after.is_sleeping() {
            after.level = 0;
        }
        *self.sleep.lock().unwrap() = after;
        if !after.is_sleeping() && !self.gate.borrow().admit {
            self.last_wake_finished_ns
                .store(unix_ns(), Ordering::SeqCst);
            self.wakes.fetch_add(1, Ordering::SeqCst);
            self.gate.send_modify(|g| {
                g.admit = true;
                g.run = true;
            });
            tracing::info!(intact = self.weights_intact(), "engine awake");
        }
        Ok(after)
    }

    /// `GET /is_sleeping`: a utility call that waits behind a running wake or RPC.
    pub async fn is_sleeping(&self) -> bool {
        let _op = self.ops.lock().await;
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

    /// `collective_rpc reload_weights`.
    pub async fn reload_weights(&self) -> Result<(), EngineError> {
        let _op = self.ops.lock().await;
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
