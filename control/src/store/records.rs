//! What the store holds per model: the intent, the engine process, the
//! calibration. Serialised as JSON values inside redb tables.

use crate::reconciler::{Average, Calibration, Desired, Intent, ModelState, Pin, Reason};
use crate::status::{Clock, ModelStatus, PinView};
use serde::{Deserialize, Serialize};

/// One model's persisted intent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IntentRecord {
    /// "stopped", "awake", "asleep" or "suspended".
    pub desired: String,
    #[serde(default)]
    pub level: u8,
    /// "config", "demand", "operator", "pin", "idle_tier" or "eviction".
    pub reason: String,
    pub since_unix_ms: i64,
    #[serde(default)]
    pub until_unix_ms: i64,
    /// 0: not pinned; i64::MAX: until Unpin.
    #[serde(default)]
    pub pinned_until_unix_ms: i64,
    /// Engine (re)starts so far, restored when a running engine is adopted.
    #[serde(default)]
    pub restarts: u32,
    /// End of the last request (0: none yet), restored on adoption.
    #[serde(default)]
    pub last_activity_unix_ms: i64,
    /// Idle time never counts from before this (the engine becoming ready,
    /// the last demand, an operator's command; 0: unknown), restored on
    /// adoption: the engine's idle clock goes on across a restart.
    #[serde(default)]
    pub idle_floor_unix_ms: i64,
    /// An operator's last restart of a running engine (0: none): an engine
    /// spawned before it is not adopted (see [`IntentRecord::restart_pending`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub restart_asked_unix_ms: i64,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

fn reason_name(r: Reason) -> &'static str {
    match r {
        Reason::Config => "config",
        Reason::Demand => "demand",
        Reason::Operator => "operator",
        Reason::Pin => "pin",
        Reason::IdleTier => "idle_tier",
        Reason::Eviction => "eviction",
    }
}

fn desired_name(d: Desired) -> (&'static str, u8) {
    match d {
        Desired::Stopped => ("stopped", 0),
        Desired::Awake => ("awake", 0),
        Desired::Asleep(l) => ("asleep", l),
        Desired::Suspended => ("suspended", 0),
    }
}

impl IntentRecord {
    pub fn from_state(m: &ModelState, clock: &Clock) -> Self {
        let (desired, level) = desired_name(m.intent.desired);
        Self {
            desired: desired.into(),
            level,
            reason: reason_name(m.intent.reason).into(),
            since_unix_ms: clock.unix_ms(m.intent.since),
            until_unix_ms: m.intent.until.map_or(0, |t| clock.unix_ms(t)),
            pinned_until_unix_ms: match m.pin {
                Pin::None => 0,
                Pin::Forever => i64::MAX,
                Pin::Until(t) => clock.unix_ms(t),
            },
            restarts: m.restarts,
            last_activity_unix_ms: m.last_activity.map_or(0, |t| clock.unix_ms(t)),
            idle_floor_unix_ms: clock.unix_ms(m.idle_floor),
            restart_asked_unix_ms: m.restart_asked.map_or(0, |t| clock.unix_ms(t)),
        }
    }

    /// An operator asked for a restart after `engine` was spawned, and the
    /// control plane stopped before the old engine did: adopting it would
    /// lose the restart.
    pub fn restart_pending(&self, engine: &EngineRecord) -> bool {
        self.restart_asked_unix_ms > 0 && self.restart_asked_unix_ms >= engine.spawned_unix_ms
    }

    /// The record of a published status: what a model wanted (and was
    /// pinned), with its restart count and last activity.
    pub fn from_status(s: &ModelStatus) -> Self {
        let (desired, level) = desired_name(s.intent.desired);
        Self {
            desired: desired.into(),
            level,
            reason: reason_name(s.intent.reason).into(),
            since_unix_ms: s.intent.since_unix_ms,
            until_unix_ms: s.intent.until_unix_ms.unwrap_or(0),
            pinned_until_unix_ms: match s.pin {
                PinView::None => 0,
                PinView::Forever => i64::MAX,
                PinView::Until(t) => t,
            },
            restarts: s.restarts,
            last_activity_unix_ms: s.last_activity_unix_ms.unwrap_or(0),
            // A new engine: its readiness starts its idle clock.
            idle_floor_unix_ms: 0,
            restart_asked_unix_ms: 0,
        }
    }

    /// Puts the recorded restart count, last activity and idle floor into
    /// the state of a model whose running engine is adopted (or attached):
    /// it is the same engine, so its history goes on, and so does its idle
    /// clock (counted
    /// from the daemon's start, a tier never fired for a control plane
    /// restarted more often than it).
    pub fn restore_history(&self, m: &mut ModelState, clock: &Clock) {
        m.restarts = m.restarts.max(self.restarts);
        if self.last_activity_unix_ms > 0 {
            let at = clock.instant(self.last_activity_unix_ms);
            m.last_activity = Some(m.last_activity.map_or(at, |a| a.max(at)));
        }
        if self.idle_floor_unix_ms > 0 {
            m.idle_floor = clock.instant(self.idle_floor_unix_ms).min(m.idle_floor);
            // Its first readiness here is not its start (see `recorded_floor`).
            if m.settings.attach {
                m.recorded_floor = Some(m.idle_floor);
            }
        }
    }

    /// Puts the recorded intent (and pin) into a fresh state. Intents that
    /// came from the configuration are not restored: the file in force wins.
    pub fn restore(&self, m: &mut ModelState, clock: &Clock) {
        let desired = match (self.desired.as_str(), self.level) {
            ("stopped", _) => Desired::Stopped,
            ("awake", _) => Desired::Awake,
            ("asleep", l @ (1 | 2)) => Desired::Asleep(l),
            ("suspended", _) => Desired::Suspended,
            _ => return,
        };
        let reason = match self.reason.as_str() {
            "demand" => Reason::Demand,
            "operator" => Reason::Operator,
            "pin" => Reason::Pin,
            "idle_tier" => Reason::IdleTier,
            "eviction" => Reason::Eviction,
            _ => return,
        };
        let now_ms = clock.now_ms();
        m.pin = match self.pinned_until_unix_ms {
            0 => Pin::None,
            i64::MAX => Pin::Forever,
            t if t > now_ms => Pin::Until(clock.instant(t)),
            _ => Pin::None,
        };
        m.intent = Intent {
            desired,
            reason,
            since: clock.instant(self.since_unix_ms),
            until: (self.until_unix_ms > 0).then(|| clock.instant(self.until_unix_ms)),
        };
    }
}

/// An engine process siesta spawned, written before the spawn (pid 0) and
/// again once the pid is known; removed once the process is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineRecord {
    /// 0 while spawning: find the process by `tag` instead.
    pub pid: u32,
    /// Process group (the engine leads its own).
    pub pgid: u32,
    pub port: u16,
    /// `/proc/PID/stat` field 22 (clock ticks after boot): tells a reused pid apart.
    pub start_time: u64,
    /// Hash of program, arguments and environment (see `supervisor::command_hash`).
    pub command_hash: String,
    /// Value of `SIESTA_ENGINE_TAG` in the engine's environment.
    pub tag: String,
    pub proc_gen: u64,
    /// Last known sleep level (0: awake or unknown).
    #[serde(default)]
    pub sleep_level: u8,
    /// Checkpointed (or being checkpointed) by the CUDA helper: a restarted
    /// control adopts it as suspended and never probes it. `sleep_level`
    /// is then the level it was asleep at underneath.
    #[serde(default)]
    pub suspended: bool,
    /// The processes the suspend checkpointed (what a resume restores).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub suspended_pids: Vec<u32>,
    pub spawned_unix_ms: i64,
    /// The GPUs it was placed on (its `CUDA_VISIBLE_DEVICES`): a restarted
    /// control places the model there again where that still fits, so its
    /// command hash still matches and the engine is adopted, not stopped.
    /// Empty in records from before this field (placed afresh) and for
    /// engines without GPUs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<u32>,
}

/// One moving average.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct AverageRecord {
    pub ms: f64,
    pub samples: u32,
}

/// Measured transition durations of one model.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct CalibrationRecord {
    pub start: AverageRecord,
    pub sleep: [AverageRecord; 2],
    pub wake: [AverageRecord; 2],
    /// CUDA checkpoint and restore (absent in records from before).
    #[serde(default)]
    pub suspend: AverageRecord,
    #[serde(default)]
    pub resume: AverageRecord,
}

fn avg_rec(a: &Average) -> AverageRecord {
    AverageRecord {
        ms: a.ms,
        samples: a.samples,
    }
}

fn avg(a: &AverageRecord) -> Average {
    Average {
        ms: a.ms,
        samples: a.samples,
    }
}

impl From<&Calibration> for CalibrationRecord {
    fn from(c: &Calibration) -> Self {
        Self {
            start: avg_rec(&c.start),
            sleep: c.sleep.each_ref().map(avg_rec),
            wake: c.wake.each_ref().map(avg_rec),
            suspend: avg_rec(&c.suspend),
            resume: avg_rec(&c.resume),
        }
    }
}

impl From<&CalibrationRecord> for Calibration {
    fn from(c: &CalibrationRecord) -> Self {
        Self {
            start: avg(&c.start),
            sleep: c.sleep.each_ref().map(avg),
            wake: c.wake.each_ref().map(avg),
            suspend: avg(&c.suspend),
            resume: avg(&c.resume),
        }
    }
}
