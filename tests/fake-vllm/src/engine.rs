//! The simulated engine: sleep state, the gates that hold requests while asleep, counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

use crate::cli::ServeArgs;
use crate::memory::{Level, Memory, MemoryError, Tags};

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
    /// 0 awake, else the level of the last sleep.
    pub level: u8,
    /// Weights not yet woken.
    pub weights_asleep: bool,
    /// KV cache not yet woken.
    pub kv_asleep: bool,
}

impl SleepState {
    /// `GET /is_sleeping`: true until every tag is awake.
    pub fn is_sleeping(&self) -> bool {
        self.weights_asleep || self.kv_asleep
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
}

/// The engine, shared by every connection.
#[derive(Debug)]
pub struct Engine {
    /// The command line.
    pub args: ServeArgs,
    memory: Arc<dyn Memory>,
    ops: tokio::sync::Mutex<()>,
    sleep: Mutex<SleepState>,
    gate: watch::Sender<Gate>,
    /// Requests producing tokens.
    pub running: AtomicU64,
    /// Requests held until a wake.
    pub waiting: AtomicU64,
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
    pub fn new(args: ServeArgs, memory: Box<dyn Memory>) -> Engine {
        let (gate, _) = watch::channel(Gate {
            admit: true,
            run: true,
            epoch: 0,
        });
        Engine {
            args,
            memory: Arc::from(memory),
            ops: tokio::sync::Mutex::new(()),
            sleep: Mutex::new(SleepState::default()),
            gate,
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
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

    /// False once `--fail-health-after` has passed since start-up.
    pub fn healthy(&self) -> bool {
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

    /// Bytes the memory backend holds on the device.
    pub fn device_bytes(&self) -> u64 {
        self.memory.device_bytes()
    }

    /// Waits until new requests may be scheduled (counted as waiting meanwhile), and returns
    /// the abort epoch the request runs in.
    pub async fn admit(&self) -> u64 {
        let mut rx = self.gate.subscribe();
        let mut counted = false;
        loop {
            let g = *rx.borrow_and_update();
            if g.admit {
                if counted {
                    self.waiting.fetch_sub(1, Ordering::SeqCst);
                }
                return g.epoch;
            }
            if !counted {
                self.waiting.fetch_add(1, Ordering::SeqCst);
                counted = true;
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
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

    /// `POST /sleep`: no-op when already asleep.
    pub async fn sleep(&self, level: Level, mode: SleepMode) -> Result<(), EngineError> {
        if !self.args.enable_sleep_mode {
            return Err(EngineError::SleepDisabled);
        }
        let _op = self.ops.lock().await;
        if self.sleep_state().is_sleeping() {
            tracing::warn!("Executor is already sleeping.");
            return Ok(());
        }
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
        tokio::time::sleep(self.args.sim.sleep_time).await;
        self.blocking(move |m| m.sleep(level)).await?;
        *self.sleep.lock().unwrap() = SleepState {
            level: if level == Level::One { 1 } else { 2 },
            weights_asleep: true,
            kv_asleep: true,
        };
        self.sleeps.fetch_add(1, Ordering::SeqCst);
        tracing::info!(?level, ?mode, "engine asleep");
        Ok(())
    }

    /// `POST /wake_up`: wakes `tags`; requests resume once every tag is awake.
    pub async fn wake(&self, tags: Tags) -> Result<(), EngineError> {
        if !self.args.enable_sleep_mode {
            return Err(EngineError::SleepDisabled);
        }
        let _op = self.ops.lock().await;
        if self.args.faults.hang_on_wake {
            tracing::warn!("fault: --hang-on-wake, this wake never finishes");
            std::future::pending::<()>().await;
        }
        let st = self.sleep_state();
        if tags.weights && st.weights_asleep {
            tokio::time::sleep(self.args.sim.wake_time).await;
        }
        self.blocking(move |m| m.wake(tags)).await?;
        let st = {
            let mut s = self.sleep.lock().unwrap();
            s.weights_asleep &= !tags.weights;
            s.kv_asleep &= !tags.kv_cache;
            if !s.is_sleeping() {
                s.level = 0;
            }
            *s
        };
        if !st.is_sleeping() && !self.gate.borrow().admit {
            self.last_wake_finished_ns
                .store(unix_ns(), Ordering::SeqCst);
            self.wakes.fetch_add(1, Ordering::SeqCst);
            self.gate.send_modify(|g| {
                g.admit = true;
                g.run = true;
            });
            tracing::info!(intact = self.weights_intact(), "engine awake");
        }
        Ok(())
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
        tokio::time::sleep(self.args.sim.reload_time).await;
        self.blocking(|m| m.reload_weights()).await?;
        tracing::info!("weights reloaded");
        Ok(())
    }
}
