//! A suspend (the engine's GPU state checkpointed to host memory) and its
//! resume, ended.

use super::*;

pub(super) fn suspend_done(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    if let Phase::Suspending { under, .. } = m.phase {
        m.calibration.suspend.add(now - m.transition_start);
        fx.push(Effect::Log(
            "suspended: GPU state checkpointed to host memory".into(),
        ));
        set_phase(m, Phase::Suspended { under }, now);
    }
}

pub(super) fn suspend_called_off(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    if let Phase::Suspending { under, .. } = m.phase {
        fx.push(Effect::Log(
            "suspend called off: a request arrived before the checkpoint began".into(),
        ));
        if under == 0 {
            become_awake(m, now);
        } else {
            set_phase(m, Phase::Asleep { level: under }, now);
        }
    }
}

pub(super) fn suspend_failed(
    m: &mut ModelState,
    error: String,
    now: Instant,
    fx: &mut Vec<Effect>,
) {
    if let Phase::Suspending { under, .. } = m.phase {
        // The helper put back what it did: the engine runs as before.
        // Tiers count again from here (no retry loop); an operator
        // asks again.
        let error = format!("suspend failed, the engine keeps running: {error}");
        fx.push(Effect::Log(error.clone()));
        m.last_error = Some(error);
        m.idle_floor = now;
        let back = if under == 0 {
            Desired::Awake
        } else {
            Desired::Asleep(under)
        };
        if m.intent.desired == Desired::Suspended {
            let reason = m.intent.reason;
            set_intent(m, back, reason, now);
        }
        let phase = if under == 0 {
            Phase::Awake
        } else {
            Phase::Asleep { level: under }
        };
        set_phase(m, phase, now);
    }
}

pub(super) fn resume_done(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    if let Phase::Resuming { under, .. } = m.phase {
        m.calibration.resume.add(now - m.transition_start);
        fx.push(Effect::Log("resumed: GPU state restored".into()));
        if under == 0 {
            become_awake(m, now);
        } else {
            set_phase(m, Phase::Asleep { level: under }, now);
        }
    }
}
