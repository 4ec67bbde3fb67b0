//! One task per model: owns its [`ModelState`], feeds events to
//! [`step`](crate::reconciler::step) and carries out the effects (I/O at the edges).

mod effects;
mod persist;
mod probe;
mod publish;
mod suspect;
mod suspend;
mod turns;

pub use suspect::Refused;

use crate::config::{Launch, ModelConfig};
use crate::engine::EngineClient;
use crate::hub::Hub;
use crate::reconciler::{Desired, Effect, Event, ModelState, Phase, Reason, Settings, step};
use crate::recovery::Adopted;
use crate::status::{Clock, Endpoint, EngineFacts, ModelStatus, model_status};
use crate::store::Store;
use crate::supervisor::{GpuLocks, KILL_WAIT, LogRing, ProcHandle};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What every model task shares.
#[derive(Debug)]
pub struct Shared {
    pub hub: Arc<Hub>,
    pub clock: Clock,
    pub locks: GpuLocks,
    pub store: Arc<Store>,
    pub log_dir: PathBuf,
    pub control_id: String,
    /// How often an awake or asleep engine is probed.
    pub poll_every: Duration,
    /// The CUDA checkpoint helper (`[control] cuda_checkpoint`).
    pub cuda_checkpoint: PathBuf,
    /// Stop engines when the server shuts down.
    pub stop_engines_on_exit: bool,
    /// Room on the GPUs before a start or wake.
    pub admission: crate::admission::Admission,
    /// Idle time of pooled connections to engines (`[control] engine_idle_timeout`).
    pub engine_idle_timeout: Duration,
    /// What every proxy confirmed it stopped forwarding (before a suspend).
    pub fences: Arc<crate::fence::Fences>,
    /// How long the model tasks may take to end (kept by `Models`).
    pub stop_bound: StopBound,
    /// Every model's engine port (kept by `Models`, picked by the tasks).
    pub ports: crate::supervisor::PortBook,
}

/// The longest the model tasks may take to end once cancelled, stopping
/// their engines (they end at once, so the longest one's [`Runner::end`]),
/// for the models configured now: a reload moves it. What `siesta up`
/// gives its control plane before it exits.
#[derive(Debug, Clone, Default)]
pub struct StopBound(Arc<std::sync::atomic::AtomicU64>);

impl StopBound {
    pub(crate) fn for_models(models: &[ModelConfig]) -> StopBound {
        let bound = StopBound::default();
        bound.set(models);
        bound
    }

    pub fn get(&self) -> Duration {
        Duration::from_millis(self.0.load(std::sync::atomic::Ordering::Relaxed))
    }

    pub(crate) fn set(&self, models: &[ModelConfig]) {
        let longest = models.iter().map(end_bound).max().unwrap_or_default();
        let ms = u64::try_from(longest.as_millis()).unwrap_or(u64::MAX);
        self.0.store(ms, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The longest [`Runner::end`] of `cfg`'s task may take when it stops the
/// engine: the spawn tasks on their way end, an engine one launched
/// meanwhile is killed, then SIGTERM, the stop grace, SIGKILL, the reaping
/// and the sweep of the group.
fn end_bound(cfg: &ModelConfig) -> Duration {
    SPAWN_END_WAIT + KILL_WAIT + cfg.timeouts.stop_grace + KILL_WAIT
}

pub use crate::placement::Placed;

pub(crate) enum Msg {
    Event(Event, Option<oneshot::Sender<Applied>>),
    /// `Event::Retire`, answered with the status from just before it: the
    /// intent and pin a changed model's new engine goes on from, with no
    /// gap in which an operator's command could land unseen.
    Retire(oneshot::Sender<ModelStatus>),
    /// A proxy's `Event::Activity`, with the `state_since` of the
    /// non-serving state it had applied (its fence; 0: it forwarded).
    Activity(Event, i64),
    Spawned(ProcHandle),
    /// What a start or wake waits for (None: nothing).
    WaitingFor(Option<String>),
    /// The asleep residual measured after a sleep.
    Residual(crate::status::Residual),
    Poll {
        epoch: u64,
        /// The awake engine's metrics (None: asleep, or not polled).
        result: Result<Option<crate::engine::EngineMetrics>, crate::engine::ProbeError>,
    },
    /// A reload changed only siesta's own settings for the model, none
    /// that needs a new engine (see [`ModelHandle::reconfigure`]): take
    /// them, keep the engine.
    Reconfigure(Arc<ModelConfig>),
    /// A proxy reports the engine refused a connection (see `suspect.rs`).
    Refused(Refused),
    /// Stop the engine (if `stop_engine`) and end the task.
    Shutdown {
        stop_engine: bool,
        done: oneshot::Sender<()>,
    },
}

/// The API's handle on a model task.
#[derive(Debug)]
pub struct ModelHandle {
    /// The model's configuration now: a reload that needs no new engine
    /// replaces it ([`ModelHandle::reconfigure`]).
    cfg: std::sync::RwLock<Arc<ModelConfig>>,
    tx: mpsc::UnboundedSender<Msg>,
    pub status: watch::Receiver<ModelStatus>,
    pub logs: Arc<LogRing>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Msg::Event(e, _) => write!(f, "Event({e:?})"),
            Msg::Retire(_) => write!(f, "Retire"),
            Msg::Activity(e, fence) => write!(f, "Activity({e:?}, fenced since {fence})"),
            Msg::Spawned(h) => write!(f, "Spawned({})", h.pid),
            Msg::WaitingFor(w) => write!(f, "WaitingFor({w:?})"),
            Msg::Residual(r) => write!(f, "Residual({r:?})"),
            Msg::Reconfigure(c) => write!(f, "Reconfigure({})", c.name),
            Msg::Poll { epoch, result } => write!(f, "Poll({epoch}, {result:?})"),
            Msg::Refused(r) => write!(f, "Refused({r:?})"),
            Msg::Shutdown { stop_engine, .. } => write!(f, "Shutdown({stop_engine})"),
        }
    }
}

/// An event applied by the model's task: its status right after, and
/// whether the intent the event changed is durable.
#[derive(Debug, Clone)]
pub struct Applied {
    pub status: ModelStatus,
    /// False when the event changed the intent and the state store could
    /// not write it: the task goes on with it, and the store keeps trying
    /// (every second), but a restart of siesta-control before the write
    /// lands goes on from the intent before.
    pub durable: bool,
}

impl ModelHandle {
    /// Sends an event; returns the status right after it was applied.
    pub async fn send(&self, event: Event) -> Option<ModelStatus> {
        self.send_applied(event).await.map(|a| a.status)
    }

    /// [`Self::send`], saying whether the intent it changed is durable.
    pub async fn send_applied(&self, event: Event) -> Option<Applied> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Msg::Event(event, Some(tx))).ok()?;
        rx.await.ok()
    }

    /// Retires the model (a reload removes it, or a new engine follows
    /// under its name): it stops for good, answers under way first, and
    /// takes no more commands or pins. Returns its status from just before.
    pub async fn retire(&self) -> Option<ModelStatus> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Msg::Retire(tx)).ok()?;
        rx.await.ok()
    }

    /// Sends an event without waiting.
    pub fn notify(&self, event: Event) {
        let _ = self.tx.send(Msg::Event(event, None));
    }

    /// Sends a proxy's [`Event::Activity`] with the fence it reported.
    pub fn notify_activity(&self, event: Event, fenced_since_unix_ms: i64) {
        let _ = self.tx.send(Msg::Activity(event, fenced_since_unix_ms));
    }

    /// Sends a proxy's report of the engine refusing a connection.
    pub fn endpoint_refused(&self, refused: Refused) {
        let _ = self.tx.send(Msg::Refused(refused));
    }

    /// Waits for the task to end (after cancellation or shutdown).
    pub async fn join(&self) {
        let task = self.task.lock().unwrap().take();
        if let Some(t) = task {
            let _ = t.await;
        }
    }

    /// The model's configuration now.
    pub fn cfg(&self) -> Arc<ModelConfig> {
        self.cfg.read().unwrap().clone()
    }

    /// Hands the task `cfg`, which runs the same engine (same command,
    /// environment, launch and GPU needs: the caller checks) with other
    /// settings of siesta's own: timeouts, backoff, idle tiers, preload,
    /// hold policy, aliases, health path. They apply from the next
    /// operation (one under way keeps its deadline); new idle tiers count
    /// from the same idle clock.
    pub fn reconfigure(&self, cfg: Arc<ModelConfig>) {
        *self.cfg.write().unwrap() = cfg.clone();
        let _ = self.tx.send(Msg::Reconfigure(cfg));
    }

    /// Ends the task, stopping the engine first when asked.
    pub async fn shutdown(&self, stop_engine: bool) {
        let (done, rx) = oneshot::channel();
        if self.tx.send(Msg::Shutdown { stop_engine, done }).is_ok() {
            let _ = rx.await;
        }
    }
}

/// Starts a model's task.
#[cfg(test)]
pub fn spawn_model(
    cfg: ModelConfig,
    placed: Placed,
    shared: Arc<Shared>,
    cancel: CancellationToken,
) -> std::io::Result<ModelHandle> {
    spawn_model_adopting(cfg, placed, None, false, shared, cancel)
}

/// Starts a model's task, taking over `adopted` (an engine found running
/// at start-up) when given. Its recorded intent and pin are restored (not
/// one that came from the configuration); `carried_over`: it replaces the
/// model's engine in a reload, so its recorded restart count and last
/// activity go on too (an adopted or attached engine's always do, and so
/// does its idle clock).
pub fn spawn_model_adopting(
    cfg: ModelConfig,
    placed: Placed,
    adopted: Option<Adopted>,
    carried_over: bool,
    shared: Arc<Shared>,
    cancel: CancellationToken,
) -> std::io::Result<ModelHandle> {
    let now = Instant::now();
    let adopted = adopted.filter(|_| !cfg.is_attach());
    // An adopted engine runs with the P2P switches it was spawned with
    // (its next spawn takes the verdict of then).
    let placed = match &adopted {
        Some(a) => Placed {
            p2p_disabled: a.p2p_disabled,
            ..placed
        },
        None => placed,
    };
    let (base_url, served, port) = match &cfg.launch {
        Launch::Process { host, port, .. } => {
            let port = match (port, &adopted) {
                (_, Some(a)) => {
                    shared.ports.record(&cfg.name, a.port);
                    a.port
                }
                (Some(p), None) => *p,
                (None, None) => shared.ports.pick(&cfg.name, host)?,
            };
            (crate::engine::base_url(host, port), cfg.name.clone(), port)
        }
        Launch::Attach {
            url,
            served_model_name,
        } => (url.clone(), served_model_name.clone(), 0),
    };
    let mut state = ModelState::new(Settings::from_config(&cfg), cfg.preload, now);
    if let Some(rec) = shared.store.get(&cfg.name) {
        rec.restore(&mut state, &shared.clock);
        // An attached engine is the one siesta had before (it neither
        // starts nor stops it).
        if carried_over || cfg.is_attach() {
            rec.restore_history(&mut state, &shared.clock);
        }
    }
    if let Some(c) = shared.store.calibration(&cfg.name) {
        state.calibration = (&c).into();
    }
    let logs = Arc::new(LogRing::new(2000));
    let (tx, rx) = mpsc::unbounded_channel();
    let (proc, initial_fx) = match &adopted {
        Some(a) => {
            let (handle, fx) =
                persist::take_over(&cfg.name, a, &mut state, &shared, &tx, &logs, now);
            (Some(handle), fx)
        }
        None => (None, Vec::new()),
    };
    let facts = EngineFacts {
        endpoint: Endpoint {
            url: base_url.clone(),
            served_model_name: served,
        },
        gpus: placed.gpus.clone(),
        p2p_disabled: placed.p2p_disabled,
        control_id: shared.control_id.clone(),
        waiting_for: String::new(),
        asleep_residual: shared.admission.residual_of(&cfg.name, cfg.gpus),
    };
    let status = model_status(&cfg, &facts, &state, &shared.clock, now);
    let (status_tx, status_rx) = watch::channel(status.clone());
    shared.hub.publish_model(status);
    let cfg = Arc::new(cfg);
    let runner = Runner {
        cfg: cfg.clone(),
        client: EngineClient::for_model(&base_url, shared.engine_idle_timeout, &cfg),
        facts,
        port,
        placed,
        shared,
        state,
        tx: tx.clone(),
        status_tx,
        logs: logs.clone(),
        proc,
        initial_fx,
        start_hold: None,
        spawn_cancel: CancellationToken::new(),
        spawning: Vec::new(),
        ops: Vec::new(),
        timer: None,
        hub_due: None,
        polling: false,
        suspect: None,
        probe_soon: None,
        poll_started: Instant::now(),
        awake_since_unix_ms: 0,
        found_asleep: None,
        probe_gate: Arc::default(),
        frozen: Arc::default(),
        suspend_cancel: CancellationToken::new(),
        landed: None,
        unshown: Vec::new(),
        intent_not_durable: false,
    };
    let task = tokio::spawn(runner.run(rx, cancel));
    Ok(ModelHandle {
        cfg: std::sync::RwLock::new(cfg),
        tx,
        status: status_rx,
        logs,
        task: std::sync::Mutex::new(Some(task)),
    })
}

struct Runner {
    cfg: Arc<ModelConfig>,
    client: EngineClient,
    facts: EngineFacts,
    port: u16,
    placed: Placed,
    shared: Arc<Shared>,
    state: ModelState,
    tx: mpsc::UnboundedSender<Msg>,
    status_tx: watch::Sender<ModelStatus>,
    logs: Arc<LogRing>,
    proc: Option<ProcHandle>,
    /// Effects of adopting a running engine, carried out first.
    initial_fx: Vec<Effect>,
    /// The start lock a start of this model holds (see `ReleaseStartLock`).
    start_hold: Option<crate::supervisor::StartHold>,
    spawn_cancel: CancellationToken,
    /// Spawn tasks (admission, start lock, launch) not known to be done:
    /// the model task's end waits for them (see [`Runner::end`]).
    spawning: Vec<tokio::task::JoinHandle<()>>,
    /// Effect tasks of the current epoch (aborted when it changes).
    ops: Vec<AbortHandle>,
    timer: Option<Instant>,
    /// When a change of the deadline alone goes to the hub (`publish.rs`).
    hub_due: Option<Instant>,
    polling: bool,
    /// Since and until when a proxy's report keeps the probes quick
    /// (`suspect.rs`).
    suspect: Option<(Instant, Instant)>,
    /// The next quick probe.
    probe_soon: Option<Instant>,
    /// When the last probe began.
    poll_started: Instant,
    /// `state_since` of the model's last published `awake`.
    awake_since_unix_ms: i64,
    /// The epoch whose last poll found the engine asleep while awake.
    found_asleep: Option<u64>,
    /// Held by a periodic probe while it talks to the engine; a suspend
    /// takes it first, so no probe is on its way when the helper runs.
    probe_gate: Arc<tokio::sync::Mutex<()>>,
    /// Set while the engine is suspending, suspended or resuming: a probe
    /// that got the gate late sends nothing.
    frozen: Arc<std::sync::atomic::AtomicBool>,
    /// Cancelled when a demand arrives while a suspend waits for proxies:
    /// the suspend is called off before the helper starts.
    suspend_cancel: CancellationToken,
    /// A spawned engine waiting for `step` to keep it or kill it.
    landed: Option<ProcHandle>,
    /// Records queued by this step's effects that a client must not see
    /// before they are durable (history, sleep level): awaited before the
    /// status goes out, so what was shown survives a `kill -9`.
    unshown: Vec<(crate::store::Committed, &'static str)>,
    /// The intent written since the last event answered did not become
    /// durable (the store failed it): the answer says so.
    intent_not_durable: bool,
}

impl Runner {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Msg>, cancel: CancellationToken) {
        for effect in std::mem::take(&mut self.initial_fx) {
            self.perform(effect);
        }
        self.hold_start_lock_if_starting();
        self.apply(Event::Tick).await;
        // Each model polls at its own phase of the period (from its name):
        // a thousand models do not all probe their engines at once.
        let every = self.shared.poll_every;
        let phase = every.mul_f64(poll_phase(&self.cfg.name));
        let mut poll = tokio::time::interval_at(Instant::now() + phase, every);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let (timer, hub_due) = (self.timer, self.hub_due);
            tokio::select! {
                _ = cancel.cancelled() => {
                    let stop = self.shared.stop_engines_on_exit;
                    self.end(&mut rx, stop).await;
                    return;
                }
                msg = rx.recv() => match msg {
                    None => return,
                    Some(Msg::Shutdown { stop_engine, done }) => {
                        self.end(&mut rx, stop_engine).await;
                        let _ = done.send(());
                        return;
                    }
                    Some(msg) => self.on_msg(msg).await,
                },
                _ = tokio::time::sleep_until(timer.unwrap_or_else(Instant::now)), if timer.is_some() => {
                    self.timer = None;
                    self.apply(Event::Tick).await;
                }
                _ = tokio::time::sleep_until(hub_due.unwrap_or_else(Instant::now)), if hub_due.is_some() => {
                    self.publish_due();
                }
                _ = poll.tick() => self.poll(),
                _ = tokio::time::sleep_until(self.probe_soon.unwrap_or_else(Instant::now)), if self.probe_soon.is_some() => {
                    self.probe_soon = None;
                    self.poll();
                }
            }
        }
    }

    async fn on_msg(&mut self, msg: Msg) {
        match msg {
            Msg::Activity(mut event, fenced_since_unix_ms) => {
                // Requests a proxy held under a fence from before the model
                // was last awake are being released to the engine: its
                // report was taken before it saw the awake (its next one
                // says where they are). They are in flight, not a demand:
                // counted as held they woke a model just put to sleep;
                // counted as nothing, an operator's sleep waiting for them
                // began while they were on their way (demand_e2e, in CI).
                // (A proxy that sees the model awake reports fence 0; what
                // it holds then waits for a suspect endpoint, for as long
                // as that lasts: not in flight, and not a demand either.)
                if let Event::Activity {
                    held, in_flight, ..
                } = &mut event
                    && fenced_since_unix_ms <= self.awake_since_unix_ms
                {
                    if fenced_since_unix_ms > 0 {
                        *in_flight = in_flight.saturating_add(*held);
                    }
                    *held = 0;
                }
                self.apply(event).await;
            }
            Msg::Event(event, reply) => {
                self.intent_not_durable = false;
                self.apply(event).await;
                if let Some(reply) = reply {
                    let _ = reply.send(Applied {
                        status: self.status_tx.borrow().clone(),
                        durable: !self.intent_not_durable,
                    });
                }
            }
            Msg::Retire(reply) => {
                let before = self.status_tx.borrow().clone();
                self.apply(Event::Retire).await;
                let _ = reply.send(before);
            }
            Msg::Spawned(handle) => {
                // `step` decides: KeepSpawned or KillStray takes it.
                let (proc_gen, pid) = (handle.proc_gen, handle.pid);
                self.landed = Some(handle);
                self.apply(Event::Spawned { proc_gen, pid }).await;
            }
            Msg::WaitingFor(w) => {
                self.facts.waiting_for = w.unwrap_or_default();
                self.publish(Instant::now());
            }
            Msg::Residual(r) => {
                self.facts.asleep_residual = r;
                self.publish(Instant::now());
            }
            Msg::Reconfigure(cfg) => {
                tracing::info!(model = %cfg.name, "configuration updated in place; engine kept");
                // Deadlines of the phase under way were set when it began:
                // new timeouts are for the next operation, a new backoff
                // for the next failure.
                self.state.settings = Settings::from_config(&cfg);
                // A new `preload` stands for an intent that is still the
                // configuration's (not an operator's, a tier's or demand's).
                if cfg.preload != self.cfg.preload && self.state.intent.reason == Reason::Config {
                    let desired = Desired::from_preload(cfg.preload, self.state.settings.attach);
                    if desired != self.state.intent.desired {
                        self.state.intent.desired = desired;
                        self.state.intent.since = Instant::now();
                        self.persist().await;
                    }
                }
                if cfg.health_path != self.cfg.health_path {
                    self.client = EngineClient::for_model(
                        self.client.base(),
                        self.shared.engine_idle_timeout,
                        &cfg,
                    );
                }
                self.cfg = cfg;
                // Re-arms the idle timer with the new tiers (the idle
                // clock is the same) and publishes the new settings.
                self.apply(Event::Tick).await;
            }
            Msg::Poll { epoch, result } => {
                self.polling = false;
                if epoch != self.state.epoch {
                    return;
                }
                self.after_probe(result.is_ok(), self.poll_started);
                match result {
                    Ok(metrics) => {
                        if self.state.health_strikes > 0 || self.state.busy_timeouts_since.is_some()
                        {
                            self.apply(Event::ProbeOk { epoch }).await;
                        }
                        // Asleep in two polls in a row (a second apart), not
                        // in one: a wake seen half done, or a direct sleep
                        // and wake of a pinned engine, is left alone.
                        // `/is_sleeping` true with the metric saying awake
                        // (a partial wake, a draining sleep): the level is
                        // unknown, and a level-2 wake is right for any.
                        let asleep = metrics.and_then(|m| {
                            m.sleep_level
                                .filter(|l| *l > 0)
                                .or((m.is_sleeping == Some(true)).then_some(2))
                        });
                        let before =
                            std::mem::replace(&mut self.found_asleep, asleep.map(|_| epoch));
                        if let Some(level) = asleep {
                            if before == Some(epoch) {
                                tracing::warn!(model = %self.cfg.name, level, "engine found asleep while taken as awake");
                                self.apply(Event::FoundAsleep { epoch, level }).await;
                            }
                            return;
                        }
                        // Taken and not scheduled yet counts too, as the
                        // look before a sleep counts it (else a request
                        // waiting a step had each poll begin a sleep that
                        // look then called off).
                        if let Some(running) = metrics.map(|m| m.running + m.waiting)
                            && (running > 0 || running != self.state.engine_running)
                        {
                            self.apply(Event::EngineMetrics { running }).await;
                        }
                    }
                    Err(crate::engine::ProbeError {
                        message,
                        timed_out,
                        refused,
                    }) => {
                        tracing::warn!(model = %self.cfg.name, error = %message, timed_out, "engine probe failed");
                        self.apply(Event::HealthFailed {
                            epoch,
                            error: message,
                            timed_out,
                            refused,
                        })
                        .await;
                    }
                }
            }
            Msg::Refused(r) => self.on_refused(r),
            Msg::Shutdown { .. } => {}
        }
    }

    /// One step of the state machine, its effects, and the new status.
    async fn apply(&mut self, event: Event) {
        let now = Instant::now();
        let epoch = self.state.epoch;
        let error_before = self.state.last_error.clone();
        let (state, effects) = step(self.state.clone(), event, now);
        self.state = state;
        self.frozen.store(
            self.state.phase.untouchable(),
            std::sync::atomic::Ordering::SeqCst,
        );
        // The intent is durable before anything is done about it.
        if effects.contains(&Effect::Persist) {
            self.persist().await;
        }
        // A suspend not begun yet (waiting for the proxies' fences, or for
        // an engine start on its GPUs) is called off by a request held for
        // the model, and by an operator's wake or pin: cheaper than a
        // checkpoint and a restore of an engine that was still awake.
        if matches!(self.state.phase, Phase::Suspending { .. })
            && (self.state.demand_since.is_some() || self.state.intent.desired == Desired::Awake)
        {
            self.suspend_cancel.cancel();
        }
        if self.state.epoch != epoch {
            // Results of the old epoch's operations would be ignored anyway.
            let waited_for = std::mem::take(&mut self.facts.waiting_for);
            if let Some(e) = no_room_why(&error_before, &self.state.last_error, &waited_for) {
                self.state.last_error = Some(e);
            }
            for op in self.ops.drain(..) {
                op.abort();
            }
            // A report was about the engine of the old epoch.
            self.suspect = None;
            self.probe_soon = None;
            if !matches!(self.state.phase, Phase::Starting { .. }) {
                self.spawn_cancel.cancel();
            }
        }
        for effect in effects {
            self.perform(effect);
        }
        // The task waits for the group commit; no thread does.
        for (committed, failed) in std::mem::take(&mut self.unshown) {
            if !committed.wait().await {
                self.logs.push("siesta", failed);
            }
        }
        self.publish(now);
    }

    /// Measures (NVML, where present) what the engine keeps on its GPUs
    /// asleep; placement counts that from now on.
    fn measure_residual(&self, pgid: u32) {
        let (admission, name, tx) = (
            self.shared.admission.clone(),
            self.cfg.name.clone(),
            self.tx.clone(),
        );
        tokio::task::spawn_blocking(move || {
            if let Some(r) = admission.measure_residual(&name, pgid) {
                let _ = tx.send(Msg::Residual(r));
            }
        });
    }

    /// Ends the model task so that no engine it launched outlives it
    /// unowned: nothing more is received; a spawn on its way either gives
    /// up before it launches or launches, finds nobody to take the engine
    /// and kills it (its task is waited for: the process may exit right
    /// after this, and an engine launched by a task still running then
    /// would be left behind); one that landed before is stopped, or kept
    /// running for the next start to adopt. Then [`Runner::finish`].
    async fn end(&mut self, rx: &mut mpsc::UnboundedReceiver<Msg>, stop: bool) {
        rx.close();
        if self.hub_due.is_some() {
            self.publish_due();
        }
        self.spawn_cancel.cancel();
        // A spawn holding the start lock: no start is under way any more.
        self.release_start_lock();
        for task in std::mem::take(&mut self.spawning) {
            if tokio::time::timeout(SPAWN_END_WAIT, task).await.is_err() {
                tracing::warn!(model = %self.cfg.name, "a spawn task did not end in time");
            }
        }
        while let Ok(msg) = rx.try_recv() {
            if let Msg::Spawned(handle) = msg {
                if stop {
                    tracing::info!(model = %self.cfg.name, pid = handle.pid, "stopping an engine spawned during shutdown");
                    handle.kill_and_wait().await;
                } else {
                    self.proc.get_or_insert(handle);
                }
            }
        }
        self.finish(stop).await;
    }

    /// Stops the engine if asked (SIGTERM, grace, SIGKILL), then ends.
    async fn finish(&mut self, stop_engine: bool) {
        for op in self.ops.drain(..) {
            op.abort();
        }
        self.spawn_cancel.cancel();
        let Some(proc) = self.proc.take() else {
            return;
        };
        if !stop_engine || proc.has_exited() {
            if !proc.has_exited() {
                tracing::info!(model = %self.cfg.name, pid = proc.pid, "leaving engine running");
            }
            return;
        }
        tracing::info!(model = %self.cfg.name, pid = proc.pid, "stopping engine");
        proc.signal(nix::sys::signal::Signal::SIGTERM);
        let mut exited = proc.exited.clone();
        let grace = self.cfg.timeouts.stop_grace;
        if tokio::time::timeout(grace, exited.wait_for(|e| *e))
            .await
            .is_err()
        {
            proc.kill_and_wait().await;
        }
    }
}

/// How long the end of a model task waits for a spawn task: one killing a
/// previous engine waits up to 10 s for it to be reaped, and up to
/// `SWEEP_DEADLINE` more for the rest of its group to be gone.
const SPAWN_END_WAIT: Duration =
    Duration::from_secs(15).saturating_add(crate::supervisor::SWEEP_DEADLINE);

/// A wait for room given up in this step (`before` → `after`): its error
/// with what admission last said it waited for (its models, or processes
/// siesta does not run), which the reconciler cannot know.
fn no_room_why(
    before: &Option<String>,
    after: &Option<String>,
    waited_for: &str,
) -> Option<String> {
    let e = after.as_deref()?;
    (!waited_for.is_empty() && after != before && e.starts_with(crate::reconciler::NO_ROOM))
        .then(|| format!("{e}; it waited for {waited_for}"))
}

#[cfg(test)]
pub(crate) mod tests;

/// A fraction of the poll period in [0, 1), fixed per model name.
fn poll_phase(name: &str) -> f64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    (h.finish() % 1000) as f64 / 1000.0
}
