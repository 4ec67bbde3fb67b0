//! The transition function.

use super::drive::{
    begin_yield, deadlines, drain, give_up_yield, next_wakeup, reconcile, terminate,
};
use super::*;
mod engine;
mod orders;
mod suspend;
mod transitions;

/// Applies `event` at `now`; returns the new state and what to do.
pub fn step(mut m: ModelState, event: Event, now: Instant) -> (ModelState, Vec<Effect>) {
    let mut fx = Vec::new();
    let (intent_before, restart_before, pin_before) = (m.intent, m.restart_asked, m.pin);
    let (epoch_before, calibration_before) = (m.epoch, m.calibration);
    let history_before = (m.restarts, m.last_activity, m.idle_floor);
    expire_pin(&mut m, now);
    m.proxies
        .retain(|_, p| now.saturating_duration_since(p.at) < PROXY_STALE);
    handle(&mut m, event, now, &mut fx);
    forget_failures(&mut m, now, &mut fx);
    reconcile(&mut m, now, &mut fx);
    if m.phase == Phase::Awake && m.intent.desired == Desired::Awake {
        // Served: the proxies release what they held.
        m.demand_since = None;
    }
    // An unpin may leave the intent as it was (woken by an operator while
    // pinned): the pin is recorded beside it, or a restart pins it again.
    if m.intent != intent_before || m.restart_asked != restart_before || m.pin != pin_before {
        fx.push(Effect::Persist);
    } else if (m.restarts, m.last_activity, m.idle_floor) != history_before {
        fx.push(Effect::PersistHistory);
    }
    if m.calibration != calibration_before {
        fx.push(Effect::PersistCalibration);
    }
    if m.epoch != epoch_before {
        record_phase(&m, &mut fx);
    }
    fx.push(Effect::Timer(next_wakeup(&m, now)));
    (m, fx)
}

/// What is recorded as a phase begins (also for the phase an adopted
/// engine is found in): its sleep level, and asleep, what it holds on its
/// GPUs (measured; the measure lives in memory only).
pub(super) fn record_phase(m: &ModelState, fx: &mut Vec<Effect>) {
    match m.phase {
        Phase::Awake => fx.push(Effect::RecordSleepLevel(0)),
        Phase::Asleep { level } => {
            fx.push(Effect::RecordSleepLevel(level));
            fx.push(Effect::MeasureResidual);
        }
        // An engine that cannot say whether it sleeps (SGLang) is taken
        // as asleep from the moment its release is asked: a control
        // restarted mid-release resumes it rather than sending it
        // requests.
        Phase::Sleeping { level, .. } if !m.settings.kind.capabilities().sleep_query => {
            fx.push(Effect::RecordSleepLevel(level));
        }
        _ => {}
    }
}

/// An engine up [`STABLE_AFTER`] since it became ready after failures is
/// taken as fixed: the next failure backs off from the shortest delay.
fn forget_failures(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    if m.stable_at.is_some_and(|t| t <= now) {
        m.stable_at = None;
        fx.push(Effect::Log(format!(
            "up {} s since it became ready: its {} failure(s) are forgotten",
            STABLE_AFTER.as_secs(),
            m.failures
        )));
        m.failures = 0;
    }
}

pub(super) fn set_phase(m: &mut ModelState, phase: Phase, now: Instant) {
    m.phase = phase;
    m.since = now;
    m.epoch += 1;
    m.health_strikes = 0;
    // A busy spell is its engine's in this phase: a restarted or woken
    // engine, met by the burst of requests held meanwhile, gets the grace
    // afresh.
    m.busy_timeouts_since = None;
}

pub(super) fn set_intent(m: &mut ModelState, desired: Desired, reason: Reason, now: Instant) {
    if m.intent.desired != desired || m.intent.reason != reason {
        m.intent = Intent {
            desired,
            reason,
            since: now,
            until: None,
        };
    }
}

fn expire_pin(m: &mut ModelState, now: Instant) {
    if let Pin::Until(t) = m.pin
        && t <= now
    {
        m.pin = Pin::None;
        if m.intent.reason == Reason::Pin {
            m.intent.reason = Reason::Operator;
            m.intent.until = None;
        }
    }
}

pub(super) fn fail(m: &mut ModelState, error: String, now: Instant, fx: &mut Vec<Effect>) {
    m.failures = m.failures.saturating_add(1);
    // The next start (after backoff) may again be made anew at once.
    m.profile_races = 0;
    m.stable_at = None;
    m.recorded_floor = None;
    if !m.settings.attach {
        fx.push(Effect::Kill);
    }
    fx.push(Effect::ReleaseStartLock);
    let retry_at = (m.intent.desired != Desired::Stopped).then(|| now + m.backoff());
    let retry = match retry_at {
        Some(t) => format!("retry in {:.1} s", (t - now).as_secs_f64()),
        None => "no retry (stopped)".to_string(),
    };
    fx.push(Effect::Log(format!(
        "failed ({} in a row): {error}; {retry}",
        m.failures
    )));
    m.last_error = Some(error);
    // A process of its generation still there (SIGKILLed just now, or one
    // that outlived its SIGKILL) holds its GPU memory until its exit is
    // seen; an attached engine's end is never seen.
    let process_gone = m.pid.is_none() && !m.settings.attach;
    set_phase(
        m,
        Phase::Failed {
            retry_at,
            process_gone,
        },
        now,
    );
}

/// A demand wins over idle tiers, an eviction and an operator's sleep: the
/// idle clock restarts here, and no tier fires until the model is awake.
/// Only an operator's stop (the proxies answer its requests) and a reload's
/// retirement (its held requests go to the new engine) refuse it.
/// Returns whether the demand was taken.
pub(super) fn demand(m: &mut ModelState, now: Instant) -> bool {
    let operator_stop = m.intent.desired == Desired::Stopped && m.intent.reason == Reason::Operator;
    if operator_stop || m.retiring {
        return false;
    }
    if m.intent.desired != Desired::Awake {
        set_intent(m, Desired::Awake, Reason::Demand, now);
    }
    m.idle_floor = now;
    m.demand_since.get_or_insert(now);
    true
}

/// An operator's stop, or a reload's retirement: wanted stopped (no pin, no
/// demand pending); a transition under way is interrupted at once, an awake
/// engine drains first (`drive::reconcile`).
fn stop_for_good(m: &mut ModelState, reason: Reason, now: Instant, fx: &mut Vec<Effect>) {
    m.pin = Pin::None;
    m.demand_since = None;
    set_intent(m, Desired::Stopped, reason, now);
    let busy = matches!(
        m.phase,
        Phase::Starting { .. }
            | Phase::Sleeping { .. }
            | Phase::Waking { .. }
            | Phase::Resuming { .. }
    );
    if busy && !m.settings.attach {
        terminate(m, now, fx);
    } else if matches!(m.phase, Phase::Yielding { .. }) && !m.settings.attach {
        // Still serving what was in flight: those answers finish first.
        drain(m, now, fx);
    }
}

fn handle(m: &mut ModelState, event: Event, now: Instant, fx: &mut Vec<Effect>) {
    let epoch = m.epoch;
    match event {
        // Leaving with a reload: commands and pins no longer apply to it.
        Event::Command(_) | Event::Pin(_) | Event::Unpin if m.retiring => {}
        Event::Command(cmd) => orders::command(m, cmd, now, fx),
        Event::Retire => {
            m.retiring = true;
            stop_for_good(m, Reason::Config, now, fx);
        }
        Event::Demand => {
            demand(m, now);
        }
        Event::Evict => orders::evict(m, now, fx),
        Event::Yield { to } => {
            let level = m.settings.kind.capabilities().sleep_levels.first().copied();
            if m.phase == Phase::Awake
                && !m.retiring
                && m.intent.desired != Desired::Stopped
                && !m.pinned(now)
                && let Some(level) = level
            {
                begin_yield(m, level, &to, now, fx);
            }
        }
        Event::CallOffYield { to, why } => {
            call_off_yield(m, &format!("\"{to}\" {why}"), now, fx);
        }
        Event::Pin(until) => {
            m.pin = until.map_or(Pin::Forever, Pin::Until);
            set_intent(m, Desired::Awake, Reason::Pin, now);
            m.intent.until = until;
            m.intent.since = now;
            retry_now(m, now);
            // A pinned model never makes room.
            call_off_yield(m, "pinned", now, fx);
        }
        Event::Unpin => {
            m.pin = Pin::None;
            if m.intent.reason == Reason::Pin {
                m.intent.reason = Reason::Operator;
                m.intent.until = None;
            }
        }
        Event::Activity {
            proxy,
            in_flight,
            held,
            active,
            last_finished,
        } => {
            if in_flight == 0 && held == 0 {
                m.proxies.remove(&proxy);
            } else {
                let load = ProxyLoad {
                    in_flight,
                    held,
                    at: now,
                };
                m.proxies.insert(proxy, load);
            }
            // Held requests keep the idle clock going too: no tier fires
            // while any are held, and once they are answered (a failed
            // wake's 503 with Retry-After) the time they waited is not
            // idle time that fires a stop tier before the retry they were
            // promised.
            if active || in_flight > 0 || held > 0 {
                // `last_finished` is on the proxy's clock: a proxy whose
                // clock lags by more than a tier would have put a model
                // serving steady short requests to sleep. A request reported
                // as just finished finished within the last report or so
                // (they go out every 100 ms).
                let at = last_finished
                    .unwrap_or(now)
                    .clamp(now.checked_sub(REPORT_LAG).unwrap_or(now), now);
                let at = if in_flight > 0 || held > 0 { now } else { at };
                m.last_activity = Some(m.last_activity.map_or(at, |a| a.max(at)));
            }
        }
        Event::EngineMetrics { running } => {
            if running > 0 || m.engine_running > 0 {
                m.last_activity = Some(now);
            }
            m.engine_running = running;
        }
        Event::Spawned { proc_gen, pid } => engine::spawned(m, proc_gen, pid, epoch, now, fx),
        Event::SpawnFailed { proc_gen, error } => {
            if matches!(m.phase, Phase::Starting { .. }) && proc_gen == m.proc_gen {
                fail(m, format!("spawn failed: {error}"), now, fx);
            }
        }
        Event::ChildExited {
            proc_gen,
            status,
            cause,
        } => engine::child_exited(m, proc_gen, status, cause, now, fx),
        Event::HealthOk { epoch: e, asleep } if e == epoch => engine::health_ok(m, asleep, now, fx),
        Event::HealthFailed {
            epoch: e,
            error,
            timed_out,
            refused,
        } if e == epoch => engine::health_failed(m, error, timed_out, refused, now, fx),
        Event::FoundAsleep { epoch: e, level }
            if e == epoch && matches!(m.phase, Phase::Awake | Phase::Yielding { .. }) =>
        {
            fx.push(Effect::Log(format!(
                "the engine is asleep at level {level} while taken as awake (a sleep siesta did \
                 not see finish, or one sent to the engine directly): taken as asleep"
            )));
            // Its gauge is read only while awake: what it last said is over.
            m.engine_running = 0;
            set_phase(m, Phase::Asleep { level }, now);
        }
        Event::ProbeOk { epoch: e } if e == epoch => {
            m.health_strikes = 0;
            m.busy_timeouts_since = None;
        }
        Event::FreeBegan { epoch: e } if e == epoch => transitions::free_began(m, now),
        Event::SleepDone { epoch: e } if e == epoch => transitions::sleep_done(m, now, fx),
        Event::WakeBegan { epoch: e, step } if e == epoch => transitions::wake_began(m, step, now),
        Event::WakeStepDone { epoch: e, step } if e == epoch => {
            transitions::wake_step_done(m, step, epoch, now, fx)
        }
        Event::Admitted { epoch: e } if e == epoch => transitions::admitted(m, now),
        Event::SleepCalledOff { epoch: e, running } if e == epoch => {
            transitions::sleep_called_off(m, running, now, fx)
        }
        Event::SleepFailed { epoch: e, error } if e == epoch => {
            if matches!(m.phase, Phase::Sleeping { .. }) {
                fail(m, format!("sleep failed: {error}"), now, fx);
            }
        }
        Event::WakeFailed { epoch: e, error } if e == epoch => {
            if matches!(m.phase, Phase::Waking { .. }) {
                fail(m, format!("wake failed: {error}"), now, fx);
            }
        }
        Event::SuspendDone { epoch: e } if e == epoch => suspend::suspend_done(m, now, fx),
        Event::Drained { epoch: e, error } if e == epoch => transitions::drained(m, error, now, fx),
        Event::SuspendCalledOff { epoch: e } if e == epoch => {
            suspend::suspend_called_off(m, now, fx)
        }
        Event::SuspendFailed { epoch: e, error } if e == epoch => {
            suspend::suspend_failed(m, error, now, fx)
        }
        Event::ResumeDone { epoch: e } if e == epoch => suspend::resume_done(m, now, fx),
        Event::ResumeFailed { epoch: e, error } if e == epoch => {
            if matches!(m.phase, Phase::Resuming { .. }) {
                fail(
                    m,
                    format!("resume failed, restarting the engine: {error}"),
                    now,
                    fx,
                );
            }
        }
        Event::Tick => deadlines(m, now, fx),
        // A result of a phase that is over (its epoch is past): discarded.
        Event::SuspendDone { .. }
        | Event::Drained { .. }
        | Event::SuspendCalledOff { .. }
        | Event::SuspendFailed { .. }
        | Event::ResumeDone { .. }
        | Event::ResumeFailed { .. }
        | Event::HealthOk { .. }
        | Event::HealthFailed { .. }
        | Event::ProbeOk { .. }
        | Event::FoundAsleep { .. }
        | Event::FreeBegan { .. }
        | Event::SleepDone { .. }
        | Event::SleepFailed { .. }
        | Event::SleepCalledOff { .. }
        | Event::WakeBegan { .. }
        | Event::WakeStepDone { .. }
        | Event::Admitted { .. }
        | Event::WakeFailed { .. } => {}
    }
}

pub(super) fn become_awake(m: &mut ModelState, now: Instant) {
    if m.intent.desired == Desired::Awake {
        m.idle_floor = now;
    }
    // Its next sleep's deeper tier has its own idle clock.
    m.deepen_after = None;
    set_phase(m, Phase::Awake, now);
}

/// A failed model the operator asks for is retried at once.
fn retry_now(m: &mut ModelState, now: Instant) {
    if let Phase::Failed { process_gone, .. } = m.phase {
        m.phase = Phase::Failed {
            retry_at: Some(now),
            process_gone,
        };
    }
}

/// A yielding model is wanted serving (an operator's pin or wake, or the
/// model it yields to found room without it): while it still finishes
/// its requests, the yield is called off and what was held is released;
/// once its sleep has begun, nothing changes.
fn call_off_yield(m: &mut ModelState, why: &str, now: Instant, fx: &mut Vec<Effect>) {
    if let Phase::Yielding { .. } = m.phase {
        fx.push(Effect::Log(format!(
            "{why}: yield called off, serving again"
        )));
        become_awake(m, now);
    }
}
