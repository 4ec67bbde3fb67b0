//! Domain → `siesta.v1` messages (errors are mapped in `errors.rs`).

use crate::config::{IdleAction, IdleTier};
use crate::hub::{Body, WatchItem};
use crate::reconciler::{Calibration, Desired, Reason};
use crate::status::{ModelStatus, PinView, State};
use crate::supervisor::LogLine;
use siesta_proto::v1 as pb;

mod gpu;
#[cfg(test)]
pub use gpu::gpu_budget;
pub use gpu::{gpu_list, model_placement, p2p_diag, placement};

/// `SleepRequest.level` (0: not given, level 1); a value no `u8` holds
/// is refused as itself, not as another number.
pub fn sleep_level(level: u32) -> Result<u8, crate::OpError> {
    match level {
        0 => Ok(1),
        l => u8::try_from(l).map_err(|_| {
            crate::OpError::invalid("level", format!("{l} is not a sleep level (1 or 2)"))
        }),
    }
}

fn state(s: State) -> pb::ModelState {
    match s {
        State::Stopped => pb::ModelState::Stopped,
        State::Starting => pb::ModelState::Starting,
        State::Awake => pb::ModelState::Awake,
        State::Sleeping => pb::ModelState::Sleeping,
        State::Asleep => pb::ModelState::Asleep,
        State::Waking => pb::ModelState::Waking,
        State::Stopping => pb::ModelState::Stopping,
        State::Failed => pb::ModelState::Failed,
        State::Suspending => pb::ModelState::Suspending,
        State::Suspended => pb::ModelState::Suspended,
    }
}

fn reason(r: Reason) -> pb::IntentReason {
    match r {
        Reason::Config => pb::IntentReason::Config,
        Reason::Demand => pb::IntentReason::Demand,
        Reason::Operator => pb::IntentReason::Operator,
        Reason::Pin => pb::IntentReason::Pin,
        Reason::IdleTier => pb::IntentReason::IdleTier,
        Reason::Eviction => pb::IntentReason::Eviction,
    }
}

fn tier(t: &IdleTier) -> pb::IdleTier {
    let (action, level) = match t.action {
        IdleAction::Sleep(l) => (pb::IdleAction::Sleep, u32::from(l)),
        IdleAction::Stop => (pb::IdleAction::Stop, 0),
        IdleAction::Suspend => (pb::IdleAction::Suspend, 0),
    };
    pb::IdleTier {
        after_ms: t.after.as_millis() as u64,
        action: action as i32,
        level,
    }
}

fn calibration(c: &Calibration) -> pb::Calibration {
    pb::Calibration {
        start_ms: c.start.millis(),
        wake_l1_ms: c.wake[0].millis(),
        wake_l2_ms: c.wake[1].millis(),
        sleep_l1_ms: c.sleep[0].millis(),
        sleep_l2_ms: c.sleep[1].millis(),
        start_samples: c.start.samples,
        wake_l1_samples: c.wake[0].samples,
        wake_l2_samples: c.wake[1].samples,
        sleep_l1_samples: c.sleep[0].samples,
        sleep_l2_samples: c.sleep[1].samples,
        suspend_ms: c.suspend.millis(),
        resume_ms: c.resume.millis(),
        suspend_samples: c.suspend.samples,
        resume_samples: c.resume.samples,
    }
}

/// The wire form of a pin: 0 for none, `i64::MAX` for until unpinned.
fn pinned_until(p: PinView) -> i64 {
    match p {
        PinView::None => 0,
        PinView::Until(at) => at,
        PinView::Forever => i64::MAX,
    }
}

/// The wire form of a status: absent values become proto3's zero values.
pub fn model_status(s: &ModelStatus) -> pb::ModelStatus {
    let (desired, level) = match s.intent.desired {
        Desired::Stopped => (pb::DesiredState::Stopped, 0),
        Desired::Awake => (pb::DesiredState::Awake, 0),
        Desired::Asleep(l) => (pb::DesiredState::Asleep, u32::from(l)),
        Desired::Suspended => (pb::DesiredState::Suspended, 0),
    };
    pb::ModelStatus {
        name: s.name.clone(),
        aliases: s.aliases.clone(),
        model: s.model.clone(),
        launch: s.launch.to_string(),
        state: state(s.state) as i32,
        sleep_level: u32::from(s.sleep_level),
        state_since_unix_ms: s.state_since_unix_ms,
        deadline_unix_ms: s.deadline_unix_ms.unwrap_or(0),
        endpoints: s
            .endpoints
            .iter()
            .map(|e| pb::Endpoint {
                url: e.url.clone(),
                served_model_name: e.served_model_name.clone(),
            })
            .collect(),
        gpus: s.gpus.clone(),
        hold: Some(pb::HoldPolicy {
            max_queue: s.max_queue,
            max_hold_ms: s.max_hold_ms,
        }),
        calibration: Some(calibration(&s.calibration)),
        last_activity_unix_ms: s.last_activity_unix_ms.unwrap_or(0),
        in_flight: s.in_flight,
        held: s.held,
        next_tier: s.next_tier.as_ref().map(|(t, _)| tier(t)),
        next_tier_unix_ms: s.next_tier.as_ref().map_or(0, |(_, at)| *at),
        intent: Some(pb::Intent {
            desired: desired as i32,
            level,
            reason: reason(s.intent.reason) as i32,
            since_unix_ms: s.intent.since_unix_ms,
            until_unix_ms: s.intent.until_unix_ms.unwrap_or(0),
        }),
        pinned_until_unix_ms: pinned_until(s.pin),
        last_error: s.last_error.clone().unwrap_or_default(),
        failures: s.failures,
        retry_at_unix_ms: s.retry_at_unix_ms.unwrap_or(0),
        waiting_for: s.waiting_for.clone().unwrap_or_default(),
        pid: s.pid.unwrap_or(0),
        restarts: s.restarts,
        p2p_disabled: s.p2p_disabled,
        control_id: s.control_id.clone(),
        asleep_residual_bytes: s.asleep_residual.bytes,
        asleep_residual_measured: s.asleep_residual.measured,
        warning: s.asleep_residual.warning(),
        engine: s.engine.name().to_string(),
        capabilities: Some(capabilities(s)),
    }
}

/// The wire form of what the model's engine kind can do.
fn capabilities(s: &ModelStatus) -> pb::EngineCapabilities {
    let c = s.engine.capabilities();
    pb::EngineCapabilities {
        sleep_levels: c.sleep_levels.iter().map(|l| u32::from(*l)).collect(),
        can_stop: s.launch != "attach",
        can_suspend: c.suspend && s.launch != "attach",
        sleep_query: c.sleep_query,
        activity_metric: c.activity_metric.unwrap_or_default().to_string(),
        health_path: match s.engine {
            crate::config::EngineKind::Openai => s.health_path.clone(),
            _ => "/health".to_string(),
        },
    }
}

pub fn watch_event(item: &WatchItem, control_id: &str) -> pb::WatchEvent {
    use pb::watch_event::Kind;
    let kind = match &item.body {
        Body::Snapshot(s) => Kind::Snapshot(pb::Snapshot {
            models: s.models.iter().map(|m| model_status(m)).collect(),
            gpus: s.gpus.as_deref().map(gpu_list),
            placement: s.placement.as_deref().map(placement),
            resync: s.resync,
        }),
        Body::Model(m) => Kind::Model(model_status(m)),
        Body::ModelRemoved(name) => Kind::ModelRemoved(name.clone()),
        Body::Gpus(g) => Kind::Gpus(gpu_list(g)),
        Body::Placement(p) => Kind::Placement(placement(p)),
        Body::Heartbeat(every) => Kind::Heartbeat(pb::Heartbeat {
            interval_ms: every.as_millis().try_into().unwrap_or(u32::MAX),
        }),
    };
    pb::WatchEvent {
        revision: item.revision,
        at_unix_ms: item.at_unix_ms,
        control_id: control_id.to_string(),
        kind: Some(kind),
    }
}

pub fn log_line(l: &LogLine) -> pb::LogLine {
    pb::LogLine {
        seq: l.seq,
        at_unix_ms: l.at_unix_ms,
        stream: l.stream.to_string(),
        line: l.line.clone(),
    }
}

#[cfg(test)]
mod level_tests {
    /// Level 300 was refused as "255 is not a sleep level".
    #[test]
    fn a_sleep_level_is_refused_as_sent() {
        assert_eq!(super::sleep_level(0).unwrap(), 1);
        assert_eq!(super::sleep_level(2).unwrap(), 2);
        let err = super::sleep_level(300).unwrap_err().to_string();
        assert!(err.contains("300 is not a sleep level"), "{err}");
    }
}
