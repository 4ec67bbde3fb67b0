//! The one owner of GPU admission: every start and wake of a model that
//! needs GPU memory asks this task for room, and it alone decides, in
//! arrival order, who may take its GPUs and which idle models must sleep
//! first.
//!
//! Data flow: a model's effect task calls [`Admission::admit`] (its ask
//! joins the queue); the admission task plans over the models' published
//! states (the hub) and the placement (the GPU view); an ask that fits is
//! answered, one that needs room sends `Evict` to the victims through the
//! registry (name → evictor, filled by `models`), one that cannot be helped
//! is told what it waits for. It plans again on every published change.
//!
//! Why one task: each model used to decide alone from snapshots of the
//! others, counting every Starting or Waking model at its full share, even
//! one that was itself still waiting. Two wakes on a shared GPU then waited
//! for each other until their deadlines. Here a queued ask counts only what
//! its engine holds now (an asleep residual, or nothing before a start);
//! once answered, the model's Waking or Starting state counts at full share
//! until it is awake or gives up, so nothing waits on another model's wait
//! and no GPU is promised twice.

mod metrics;
mod queue;
#[cfg(test)]
mod tests;

use crate::gpu_view::GpuView;
use crate::hub::Hub;
use crate::reconciler::Event;
use crate::status::Clock;
pub use metrics::AdmissionMetrics;
use queue::{Ask, Core};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

/// Asks one model to make room: sends it `Event::Evict` (it is idle) or
/// `Event::Yield` (it is busy and its turn is over).
pub type Evictor = Arc<dyn Fn(Event) + Send + Sync>;

/// Tells a waiting model what it waits for (None: admitted).
pub type Waiting = Box<dyn Fn(Option<String>) + Send + Sync>;

/// Who can be asked to make room, by model name.
#[derive(Default, Clone)]
pub struct Registry(Arc<RwLock<BTreeMap<String, Evictor>>>);

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.0.read().unwrap().keys().cloned().collect();
        f.debug_tuple("Registry").field(&names).finish()
    }
}

impl Registry {
    pub fn insert(&self, model: &str, evict: Evictor) {
        self.0.write().unwrap().insert(model.to_string(), evict);
    }

    pub fn remove(&self, model: &str) {
        self.0.write().unwrap().remove(model);
    }

    fn evict(&self, model: &str, how: Event) {
        let f = self.0.read().unwrap().get(model).cloned();
        if let Some(f) = f {
            f(how);
        }
    }
}

/// The admission task ended while the daemon was not shutting down (a
/// panic in it: a bug, in its log): nothing can be given room any more, so
/// a start, wake or resume that asks fails instead of taking GPUs that no
/// one accounted for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "GPU admission is not running (its task ended; the daemon's log says why): restart siesta-control"
)]
pub struct AdmissionGone;

/// Why an ask was not answered with room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotAdmitted {
    /// The task died outside shutdown: the start, wake or resume fails.
    #[error(transparent)]
    Gone(#[from] AdmissionGone),
    /// The daemon is shutting down: nothing is started, woken or resumed
    /// any more (no engine call, no failure recorded: the op just ends).
    #[error("siesta-control is shutting down")]
    ShuttingDown,
}

/// Settings of the admission task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionPolicy {
    /// A woken model stays awake at least this long before it may be put
    /// to sleep for another, and is idle only once nothing has been in
    /// flight for this long (against thrashing when two models alternate).
    pub min_awake: Duration,
    /// A busy model keeps GPUs another model waits for at most this long
    /// (its turn), and only once the other has waited as long (None: until
    /// it is idle).
    pub yield_after: Option<Duration>,
}

enum Msg {
    Ask(Ask),
    Cancel(u64),
}

/// The handle every model task holds.
#[derive(Debug, Clone)]
pub struct Admission {
    gpus: Option<Arc<GpuView>>,
    tx: Option<mpsc::UnboundedSender<Msg>>,
    registry: Registry,
    metrics: Arc<AdmissionMetrics>,
    /// Asks are answered only once this is true (see [`Self::start_planning`]).
    planning: Arc<watch::Sender<bool>>,
    /// The daemon's shutdown: an ask left unanswered then is let through
    /// (nothing is started any more); at any other time it is refused.
    shutdown: CancellationToken,
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Msg::Ask(a) => write!(f, "Ask({}, {})", a.model, a.id),
            Msg::Cancel(id) => write!(f, "Cancel({id})"),
        }
    }
}

/// Removes an ask from the queue when its waiter goes away unanswered.
struct CancelOnDrop<'a> {
    tx: &'a mpsc::UnboundedSender<Msg>,
    id: u64,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Msg::Cancel(self.id));
        }
    }
}

impl Admission {
    /// Starts the admission task over `gpus`, planning on every change
    /// published on `hub`, until `cancel`.
    pub fn start(
        gpus: Arc<GpuView>,
        hub: Arc<Hub>,
        clock: Clock,
        policy: AdmissionPolicy,
        cancel: CancellationToken,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let registry = Registry::default();
        let metrics = Arc::new(AdmissionMetrics::default());
        let core =
            Core::new(gpus.clone(), registry.clone(), clock, policy).with_metrics(metrics.clone());
        let planning = Arc::new(watch::Sender::new(false));
        tokio::spawn(run(core, hub, rx, planning.subscribe(), cancel.clone()));
        Self {
            gpus: Some(gpus),
            tx: Some(tx),
            registry,
            metrics,
            planning,
            shutdown: cancel,
        }
    }

    /// Every model of the configuration has published its first state
    /// (an engine adopted after a restart as it was found: awake ones hold
    /// their GPUs): asks queued so far, and all later ones, are planned from
    /// now on. Until then nothing is admitted, so a model that asks first
    /// cannot be given room that an adopted engine not yet published holds.
    pub fn start_planning(&self) {
        self.planning.send_replace(true);
    }

    /// Lets everything through (tests).
    #[cfg(test)]
    pub fn open() -> Self {
        Self {
            gpus: None,
            tx: None,
            registry: Registry::default(),
            metrics: Arc::default(),
            planning: Arc::new(watch::Sender::new(true)),
            shutdown: CancellationToken::new(),
        }
    }

    /// What admission did, for Prometheus.
    pub fn metrics(&self) -> &AdmissionMetrics {
        &self.metrics
    }

    /// The GPU view admission plans over (None: [`Self::open`]).
    pub fn gpus(&self) -> Option<&Arc<GpuView>> {
        self.gpus.as_ref()
    }

    /// Where models register how to put them to sleep.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Whether `model`, running on `gpus`, must start with NCCL P2P off, as
    /// placement decides now (a P2P probe may have changed it since the last
    /// start). None: placement does not know the model on these GPUs (e.g.
    /// it was changed by a reload): keep what it has.
    pub fn p2p_disabled(&self, model: &str, gpus: &[u32]) -> Option<bool> {
        self.gpus
            .as_ref()?
            .placed_one(model)
            .filter(|p| p.gpus == gpus)
            .map(|p| p.p2p_disabled)
    }

    /// What `model` (on `gpus` GPUs) holds per GPU asleep, as placement
    /// counts it.
    pub fn residual_of(&self, model: &str, gpus: u32) -> crate::status::Residual {
        match &self.gpus {
            Some(v) => v.residual_of(model),
            None => crate::status::Residual {
                bytes: crate::placement::default_residual(gpus),
                ..Default::default()
            },
        }
    }

    /// Measures the asleep residual of `model`'s engine (process group
    /// `pgid`) with NVML. Blocking.
    pub fn measure_residual(&self, model: &str, pgid: u32) -> Option<crate::status::Residual> {
        self.gpus.as_ref()?.measure_residual(model, pgid)
    }

    /// The CUDA processes of process group `pgid` and their GPU memory
    /// (NVML; None without it). Blocking.
    pub fn engine_cuda_processes(&self, pgid: u32) -> Option<Vec<(u32, u64)>> {
        self.gpus.as_ref()?.engine_cuda_processes(pgid)
    }

    /// Returns once `model` may take its GPUs awake. `waiting` is told what
    /// it waits for while it waits. The caller's deadline bounds the wait:
    /// drop the future to leave the queue. Refused if the admission task
    /// has ended: [`NotAdmitted::Gone`] outside shutdown, else
    /// [`NotAdmitted::ShuttingDown`].
    pub async fn admit(&self, model: &str, waiting: Waiting) -> Result<(), NotAdmitted> {
        let Some(tx) = &self.tx else {
            return Ok(());
        };
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (reply, answered) = oneshot::channel();
        let ask = Ask {
            id,
            model: model.to_string(),
            waiting,
            reply,
            told: None,
            asked_at: tokio::time::Instant::now(),
            evicted: Default::default(),
            yields: Default::default(),
        };
        if tx.send(Msg::Ask(ask)).is_err() {
            return self.gone(model);
        }
        let mut guard = CancelOnDrop {
            tx,
            id,
            armed: true,
        };
        match answered.await {
            Ok(()) => {
                guard.armed = false;
                Ok(())
            }
            Err(_) => self.gone(model),
        }
    }

    /// The task is gone without answering: shutting down (nothing is
    /// started any more: a wake that waited for room and went on would
    /// reach its engine beside the neighbours it waited for), or it died.
    fn gone(&self, model: &str) -> Result<(), NotAdmitted> {
        if self.shutdown.is_cancelled() {
            tracing::debug!(model = %model, "not admitted: shutting down");
            return Err(NotAdmitted::ShuttingDown);
        }
        tracing::error!(model = %model, "{AdmissionGone}");
        Err(AdmissionGone.into())
    }
}

/// How often the queue is planned again with no change published (NVML
/// memory moves, `min_awake` runs out).
const RECHECK: Duration = Duration::from_millis(250);

async fn run(
    mut core: Core,
    hub: Arc<Hub>,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    mut planning: watch::Receiver<bool>,
    cancel: CancellationToken,
) {
    let mut changes = hub.subscribe(0);
    let mut tick = tokio::time::interval(RECHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut open = *planning.borrow();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            r = planning.changed(), if !open => {
                // A dropped handle cannot open it any more: plan anyway.
                open = r.is_err() || *planning.borrow();
            }
            msg = rx.recv() => match msg {
                None => return,
                Some(Msg::Ask(ask)) => core.push(ask),
                Some(Msg::Cancel(id)) => core.cancel(id),
            },
            item = async {
                match changes.as_mut() {
                    Some(s) => s.next().await,
                    None => std::future::pending().await,
                }
            } => {
                if item.is_none() {
                    changes = None;
                }
            }
            _ = tick.tick() => {}
        }
        // Take what else is ready before planning once.
        while let Ok(msg) = rx.try_recv() {
            match msg {
                Msg::Ask(ask) => core.push(ask),
                Msg::Cancel(id) => core.cancel(id),
            }
        }
        if open && !core.is_empty() {
            core.plan(&hub.models().0);
        }
    }
}
