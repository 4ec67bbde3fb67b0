//! A model's published status (domain form of `siesta.v1.ModelStatus`).
//! Absent values are `None`, never proto3 sentinels (0, `i64::MAX`, ""):
//! only `api/convert.rs` writes the wire form.

use crate::config::{EngineKind, IdleTier, ModelConfig};
use crate::reconciler::{Calibration, Desired, ModelState, Phase, Pin, Reason, next_tier};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::time::Instant;

/// Maps tokio instants to Unix milliseconds (works under paused time).
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    base: Instant,
    base_unix_ms: i64,
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock {
    /// The two clocks read as close together as a few tries give: a
    /// preemption between the reads (a loaded box) would offset every time
    /// mapped, and a Unix time a proxy reports would read as in the future
    /// (and be clamped to now) by that much.
    pub fn new() -> Self {
        let mut best: Option<(std::time::Duration, Self)> = None;
        for _ in 0..8 {
            let before = Instant::now();
            let unix = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as i64)
                .unwrap_or(0);
            let gap = before.elapsed();
            let pair = Self {
                base: before + gap / 2,
                base_unix_ms: unix,
            };
            if best.as_ref().is_none_or(|(g, _)| gap < *g) {
                best = Some((gap, pair));
            }
            if gap < std::time::Duration::from_micros(100) {
                break;
            }
        }
        best.map(|(_, c)| c).expect("read at least once")
    }

    pub fn unix_ms(&self, t: Instant) -> i64 {
        if t >= self.base {
            self.base_unix_ms + (t - self.base).as_millis() as i64
        } else {
            self.base_unix_ms - (self.base - t).as_millis() as i64
        }
    }

    pub fn now_ms(&self) -> i64 {
        self.unix_ms(Instant::now())
    }

    /// The instant of a Unix time (clamped to a century ahead).
    pub fn instant(&self, unix_ms: i64) -> Instant {
        let delta = unix_ms - self.base_unix_ms;
        if delta >= 0 {
            self.base + std::time::Duration::from_millis(delta.min(3_153_600_000_000) as u64)
        } else {
            self.base
                .checked_sub(std::time::Duration::from_millis((-delta) as u64))
                .unwrap_or(self.base)
        }
    }
}

/// Observed state names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Stopped,
    Starting,
    Awake,
    Sleeping,
    Asleep,
    Waking,
    Stopping,
    Failed,
    /// The CUDA checkpoint helper is copying its GPU state to host memory.
    Suspending,
    /// GPU state in host memory; `sleep_level` is the level it was asleep
    /// at (0: awake). A resume shows as `Waking`.
    Suspended,
}

/// Where a proxy forwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub url: String,
    pub served_model_name: String,
}

/// The intent, in Unix time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntentView {
    pub desired: Desired,
    pub reason: Reason,
    pub since_unix_ms: i64,
    /// When the intent lapses; `None`: it holds until replaced.
    pub until_unix_ms: Option<i64>,
}

/// Whether a model is pinned awake, in Unix time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PinView {
    #[default]
    None,
    /// Pinned until this Unix time (ms).
    Until(i64),
    /// Pinned until unpinned.
    Forever,
}

impl PinView {
    pub fn is_pinned(self) -> bool {
        self != PinView::None
    }
}

/// Everything published about one model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelStatus {
    pub name: String,
    pub aliases: Vec<String>,
    pub model: String,
    pub launch: &'static str,
    /// The engine kind (its capabilities come from [`EngineKind::capabilities`]).
    pub engine: EngineKind,
    /// Where an `openai` engine is probed.
    pub health_path: String,
    pub state: State,
    pub sleep_level: u8,
    pub state_since_unix_ms: i64,
    /// When the transition under way times out; `None` outside transitions.
    pub deadline_unix_ms: Option<i64>,
    pub endpoints: Vec<Endpoint>,
    pub gpus: Vec<u32>,
    pub max_queue: u32,
    pub max_hold_ms: u64,
    pub calibration: Calibration,
    /// The end of the last request (or engine-reported activity); `None`
    /// before any.
    pub last_activity_unix_ms: Option<i64>,
    pub in_flight: u32,
    /// Requests the proxies hold for it now.
    pub held: u32,
    pub next_tier: Option<(IdleTier, i64)>,
    pub intent: IntentView,
    pub pin: PinView,
    pub last_error: Option<String>,
    pub failures: u32,
    /// When a failed model is retried; `None` unless a retry is scheduled.
    pub retry_at_unix_ms: Option<i64>,
    /// What a start or wake waits for right now, if anything.
    pub waiting_for: Option<String>,
    /// The engine's process (group leader), while one runs.
    pub pid: Option<u32>,
    /// Failed, and its engine may still hold its GPU memory: its processes
    /// (SIGKILLed) are not yet seen gone, or it is attached (siesta can
    /// neither stop it nor see it end). Placement counts its share.
    pub failed_holds_gpus: bool,
    /// Its start, wake or restore waits for room on its GPUs (not admitted
    /// yet): its engine holds what it held before, nothing or what it
    /// keeps asleep (the placement report counts that, not its full share).
    pub awaiting_room: bool,
    pub restarts: u32,
    pub p2p_disabled: bool,
    pub control_id: String,
    pub asleep_residual: Residual,
    /// Yields given up in a row (see `ModelState::yields_given_up`).
    pub yields_given_up: u32,
    /// Leaving with a reload (removed, or a new engine follows): commands
    /// and pins no longer apply to it.
    pub retiring: bool,
}

/// GPU memory placement counts per GPU for a model while it is asleep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Residual {
    pub bytes: u64,
    /// Measured with NVML after the engine's last sleep (else a default).
    pub measured: bool,
    /// Asleep, the engine still held at least half of its awake share: it
    /// does not really sleep (vLLM started without `--enable-sleep-mode`
    /// answers `/sleep` with 200 and frees almost nothing). Placement counts
    /// what it holds; the status says so.
    pub ineffective: bool,
}

impl Residual {
    /// A warning for the status, if the engine does not really sleep.
    pub fn warning(&self) -> String {
        if !self.ineffective {
            return String::new();
        }
        format!(
            "the engine does not free its GPU memory when asleep: it still holds {:.1} GiB \
             per GPU (started without --enable-sleep-mode?); placement counts it as awake",
            self.bytes as f64 / (1u64 << 30) as f64
        )
    }
}

/// Static facts about a model's engine that the state does not hold.
#[derive(Debug, Clone)]
pub struct EngineFacts {
    pub endpoint: Endpoint,
    pub gpus: Vec<u32>,
    pub p2p_disabled: bool,
    pub control_id: String,
    /// What a start or wake waits for right now (room on the GPUs).
    pub waiting_for: String,
    pub asleep_residual: Residual,
}

/// Builds the status from config, facts and state.
pub fn model_status(
    cfg: &ModelConfig,
    facts: &EngineFacts,
    m: &ModelState,
    clock: &Clock,
    now: Instant,
) -> ModelStatus {
    let ms = |t: Instant| clock.unix_ms(t);
    let (state, sleep_level) = match m.phase {
        Phase::Stopped => (State::Stopped, 0),
        Phase::Starting { .. } => (State::Starting, 0),
        Phase::Awake => (State::Awake, 0),
        Phase::Sleeping { level, .. } | Phase::Yielding { level, .. } => (State::Sleeping, level),
        Phase::Asleep { level } => (State::Asleep, level),
        Phase::Waking { from_level, .. } => (State::Waking, from_level),
        Phase::Draining { .. } | Phase::Stopping { .. } => (State::Stopping, 0),
        Phase::Failed { .. } => (State::Failed, 0),
        Phase::Suspending { under, .. } => (State::Suspending, under),
        Phase::Suspended { under } => (State::Suspended, under),
        Phase::Resuming { under, .. } => (State::Waking, under),
    };
    let retry_at = match m.phase {
        Phase::Failed {
            retry_at: Some(t), ..
        } => Some(ms(t)),
        _ => None,
    };
    let waiting_for = match m.phase {
        _ if !facts.waiting_for.is_empty() => Some(facts.waiting_for.clone()),
        Phase::Starting { spawned: false, .. } if facts.gpus.is_empty() => {
            Some("the engine process to be spawned".to_string())
        }
        Phase::Starting {
            spawned: false,
            admitted: false,
            ..
        } => Some(format!("room on GPUs {:?}", facts.gpus)),
        Phase::Starting { spawned: false, .. } => Some(format!(
            "start lock of GPUs {:?} (engines sharing a GPU start one at a time)",
            facts.gpus
        )),
        Phase::Awake if m.intent.desired != Desired::Awake && m.in_flight() > 0 => {
            Some(format!("{} request(s) in flight to finish", m.in_flight()))
        }
        Phase::Failed {
            process_gone: false,
            ..
        } if !m.settings.attach => Some(
            "its engine's processes to exit (SIGKILL sent): until they are gone, their GPU \
             memory counts as taken"
                .to_string(),
        ),
        Phase::Yielding { .. } => Some(format!(
            "yielding its GPUs: {} request(s) in flight to finish before it sleeps (new ones are \
             held for its next turn)",
            m.in_flight()
        )),
        _ => None,
    };
    ModelStatus {
        name: cfg.name.clone(),
        aliases: cfg.aliases.clone(),
        model: cfg.model.clone(),
        launch: cfg.launch_kind(),
        engine: cfg.engine,
        health_path: cfg.health_path.clone(),
        state,
        sleep_level,
        state_since_unix_ms: ms(m.since),
        deadline_unix_ms: m.phase.deadline().map(ms),
        endpoints: vec![facts.endpoint.clone()],
        gpus: facts.gpus.clone(),
        max_queue: cfg.max_queue,
        max_hold_ms: cfg.max_hold.as_millis() as u64,
        calibration: m.calibration,
        last_activity_unix_ms: m.last_activity.map(ms),
        in_flight: m.in_flight(),
        held: m.held(),
        next_tier: next_tier(m, now).map(|(t, at)| (t, ms(at))),
        intent: IntentView {
            desired: m.intent.desired,
            reason: m.intent.reason,
            since_unix_ms: ms(m.intent.since),
            until_unix_ms: m.intent.until.map(ms),
        },
        pin: match m.pin {
            Pin::None => PinView::None,
            Pin::Forever => PinView::Forever,
            Pin::Until(t) => PinView::Until(ms(t)),
        },
        last_error: m.last_error.clone(),
        failures: m.failures,
        retry_at_unix_ms: retry_at,
        waiting_for,
        pid: m.pid,
        failed_holds_gpus: matches!(
            m.phase,
            Phase::Failed {
                process_gone: false,
                ..
            }
        ),
        awaiting_room: matches!(
            m.phase,
            Phase::Starting {
                admitted: false,
                ..
            } | Phase::Waking {
                admitted: false,
                ..
            } | Phase::Resuming {
                admitted: false,
                ..
            }
        ),
        restarts: m.restarts,
        p2p_disabled: facts.p2p_disabled,
        control_id: facts.control_id.clone(),
        asleep_residual: facts.asleep_residual,
        yields_given_up: m.yields_given_up,
        retiring: m.retiring,
    }
}

/// A status for tests: the demo config's first model named `name`, with
/// `restarts`, on GPUs 0 and 1, waiting "a reason", of control plane "ctl".
#[cfg(test)]
pub(crate) fn test_status(name: &str, restarts: u32) -> ModelStatus {
    use crate::reconciler::{ModelState, Settings};
    let cfg = crate::config::Config::demo(vec!["fake-vllm".into()]);
    let mut m = cfg.models[0].clone();
    m.name = name.into();
    let facts = EngineFacts {
        endpoint: Endpoint {
            url: "http://x".into(),
            served_model_name: name.into(),
        },
        gpus: vec![0, 1],
        p2p_disabled: false,
        control_id: "ctl".into(),
        waiting_for: "a reason".into(),
        asleep_residual: Default::default(),
    };
    let now = tokio::time::Instant::now();
    let mut st = ModelState::new(Settings::from_config(&m), m.preload, now);
    st.restarts = restarts;
    model_status(&m, &facts, &st, &Clock::new(), now)
}

#[cfg(test)]
mod tests;
