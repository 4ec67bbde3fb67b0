//! The admission queue: asks for room in arrival order, and what planning
//! (`plan.rs`) needs to remember between plans. Pure over the models'
//! states, the placement and the clock, so tests drive it directly.

mod plan;

use super::{AdmissionMetrics, AdmissionPolicy, Registry, Waiting};
use crate::gpu_view::{GpuView, runtime};
use crate::placement::{Foreign, ModelRuntime, RunState, WakePlan};
use crate::reconciler::{Desired, Event, ROOM_WAIT, Reason};
use crate::status::{Clock, ModelStatus, State};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// A busy model's turn after `given_up` yields given up in a row: doubled
/// for each (up to 32×), but within half the time a wake waits for room (a
/// longer turn would outlast every wait for it).
pub(super) fn longer_turn(turn: Duration, given_up: u32) -> Duration {
    (turn * (1 << given_up.min(5))).min((ROOM_WAIT / 2).max(turn))
}

/// What is left of `d` after `elapsed_ms`, in ms.
fn ms_left(d: Duration, elapsed_ms: i64) -> u64 {
    (d.as_millis() as i64 - elapsed_ms).max(0) as u64
}

/// An answered ask (or a model asked to sleep), as the hub showed the
/// model then (tokio's clock, like every timer here).
struct Grant {
    state: State,
    since_ms: i64,
    at: Instant,
}

impl Grant {
    fn of(m: &ModelStatus) -> Grant {
        Grant {
            state: m.state,
            since_ms: m.state_since_unix_ms,
            at: Instant::now(),
        }
    }

    /// The model's published state has not moved since, for at most `max`.
    fn unmoved(&self, m: &ModelStatus, max: Duration) -> bool {
        self.state == m.state && self.since_ms == m.state_since_unix_ms && self.at.elapsed() < max
    }
}

/// One model's request for room.
pub(crate) struct Ask {
    pub id: u64,
    pub model: String,
    pub waiting: Waiting,
    pub reply: oneshot::Sender<()>,
    /// What the waiter was last told (only changes are sent).
    pub told: Option<String>,
    /// When it joined the queue (tokio's clock: `yield_after` counts from
    /// here, and tests run it under paused time).
    pub asked_at: Instant,
    /// Models asked to sleep for this ask (each counted once).
    pub evicted: BTreeSet<String>,
    /// Of those, the busy ones asked to yield (they may be called off).
    pub yields: BTreeSet<String>,
}

impl Ask {
    fn tell(&mut self, what: String) {
        if self.told.as_deref() != Some(&what) {
            (self.waiting)(Some(what.clone()));
            self.told = Some(what);
        }
    }
}

/// The queue, in arrival order, and what planning needs.
pub(crate) struct Core {
    queue: VecDeque<Ask>,
    /// Answered asks whose model may not have published its Waking or
    /// Starting yet: the hub lags the answer (the model's task runs on
    /// another thread), and a plan in between must not count the model at
    /// its asleep residual, or one GPU is promised twice.
    granted: BTreeMap<String, Grant>,
    /// Models asked to sleep whose sleep the hub may not show yet: a plan
    /// in between must not take them for awake and ask another model to
    /// sleep for the same room.
    asked_to_sleep: BTreeMap<String, Grant>,
    /// What processes siesta does not run hold per GPU, as of this plan.
    foreign: BTreeMap<u32, Foreign>,
    gpus: Arc<GpuView>,
    registry: Registry,
    clock: Clock,
    policy: AdmissionPolicy,
    metrics: Arc<AdmissionMetrics>,
}

impl Core {
    pub fn new(
        gpus: Arc<GpuView>,
        registry: Registry,
        clock: Clock,
        policy: AdmissionPolicy,
    ) -> Self {
        Self {
            queue: VecDeque::new(),
            granted: BTreeMap::new(),
            asked_to_sleep: BTreeMap::new(),
            foreign: BTreeMap::new(),
            gpus,
            registry,
            clock,
            policy,
            metrics: Arc::default(),
        }
    }

    pub fn with_metrics(mut self, metrics: Arc<AdmissionMetrics>) -> Self {
        self.metrics = metrics;
        self
    }

    pub fn push(&mut self, mut ask: Ask) {
        // One ask per model: a newer one (a new epoch) replaces the old,
        // and the models yielding for the old one now yield for it.
        if let Some(i) = self.queue.iter().position(|a| a.model == ask.model) {
            let old = self.queue.remove(i).expect("index in range");
            ask.evicted.extend(old.evicted);
            ask.yields.extend(old.yields);
        }
        self.granted.remove(&ask.model);
        self.queue.push_back(ask);
    }

    /// Makes every queued ask older by `by` (tests of `yield_after`).
    #[cfg(test)]
    pub fn age_asks(&mut self, by: Duration) {
        for a in &mut self.queue {
            a.asked_at -= by;
        }
    }

    pub fn cancel(&mut self, id: u64) {
        if let Some(i) = self.queue.iter().position(|a| a.id == id) {
            let ask = self.queue.remove(i).expect("index in range");
            self.call_off_yields(&ask);
        }
    }

    /// `ask` left the queue unanswered (cancelled, or its waiter gone): the
    /// busy models yielding for it serve again, rather than hold their own
    /// new requests and sleep for nobody.
    fn call_off_yields(&mut self, ask: &Ask) {
        for y in &ask.yields {
            tracing::info!(model = %ask.model, yielder = %y, "the wake a busy model yields for is over: calling the yield off");
            self.call_off(y, &ask.model, "no longer waits for room");
        }
    }

    /// Tells `yielder` to serve again rather than sleep for `to`.
    fn call_off(&mut self, yielder: &str, to: &str, why: &'static str) {
        self.registry.evict(
            yielder,
            Event::CallOffYield {
                to: to.to_owned(),
                why,
            },
        );
        self.metrics.yield_called_off(yielder);
        self.asked_to_sleep.remove(yielder);
    }

    /// Nothing waits (answered asks not yet seen in the hub do not count:
    /// they matter only to a later ask).
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}
