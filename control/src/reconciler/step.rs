//! The transition function.

use super::drive::{
    begin_yield, deadlines, drain, give_up_yield, next_wakeup, reconcile, terminate,
};
use super::*;
use crate::config::IdleAction;

/// Applies `event` at `now`; returns the new state and what to do.
pub fn step(mut m: ModelState, event: Event, now: Instant) -> (ModelState, Vec<Effect>) {
    let mut fx = Vec::new();
    let (intent_before, restart_before) = (m.intent, m.restart_asked);
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
    if m.intent != intent_before || m.restart_asked != restart_before {
        fx.push(Effect::Persist);
    } else if (m.restarts, m.last_activity, m.idle_floor) != history_before {
        fx.push(Effect::PersistHistory);
    }
    if m.calibration != calibration_before {
        fx.push(Effect::PersistCalibration);
    }
    if m.epoch != epoch_before {
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
    fx.push(Effect::Timer(next_wakeup(&m, now)));
    (m, fx)
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
    fx.push(Effect::Log(format!(
        "failed ({} in a row): {error}; retry in {:?}",
        m.failures,
        retry_at.map(|t| t - now)
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
        Event::Command(cmd) => command(m, cmd, now, fx),
        Event::Retire => {
            m.retiring = true;
            stop_for_good(m, Reason::Config, now, fx);
        }
        Event::Demand => {
            demand(m, now);
        }
        Event::Evict => {
            if m.phase == Phase::Awake
                && m.intent.desired == Desired::Awake
                && m.in_flight() == 0
                && !m.pinned(now)
            {
                // The shallowest sleep the kind has; one that cannot sleep
                // is stopped (an attached one cannot make room at all).
                let kind = m.settings.kind;
                let desired = match kind.capabilities().sleep_levels.first() {
                    Some(&l) => Some(Desired::Asleep(l)),
                    None if m.settings.attach => None,
                    None => Some(Desired::Stopped),
                };
                if let Some(desired) = desired {
                    let how = if desired == Desired::Stopped {
                        "stopping"
                    } else {
                        "sleeping"
                    };
                    fx.push(Effect::Log(format!(
                        "evicted: {how} to make room on its GPUs"
                    )));
                    set_intent(m, desired, Reason::Eviction, now);
                }
            } else if matches!(m.phase, Phase::Asleep { .. })
                && matches!(m.intent.desired, Desired::Asleep(_))
                && m.in_flight() == 0
                && m.held() == 0
                && !m.settings.attach
                && !m.retiring
            {
                // Asleep, it still keeps memory another model needs.
                fx.push(Effect::Log(
                    "evicted: stopping, asleep, to free what it keeps on its GPUs".into(),
                ));
                set_intent(m, Desired::Stopped, Reason::Eviction, now);
            }
        }
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
            if active || in_flight > 0 {
                let at = last_finished.unwrap_or(now).min(now);
                let at = if in_flight > 0 { now } else { at };
                m.last_activity = Some(m.last_activity.map_or(at, |a| a.max(at)));
            }
        }
        Event::EngineMetrics { running } => {
            if running > 0 || m.engine_running > 0 {
                m.last_activity = Some(now);
            }
            m.engine_running = running;
        }
        Event::Spawned { proc_gen, pid } => {
            let wanted =
                matches!(m.phase, Phase::Starting { spawned: false, .. }) && proc_gen == m.proc_gen;
            if !wanted {
                fx.push(Effect::KillStray { proc_gen });
                fx.push(Effect::Log(format!(
                    "killing engine pid {pid}: spawned for a start no longer wanted"
                )));
                // Its start failed before it landed: until its exit is seen
                // it holds what it took (an exit seen already, from a
                // process that ended at once, is not seen again).
                if let Phase::Failed { retry_at, .. } = m.phase
                    && proc_gen == m.proc_gen
                    && m.exited_gen != Some(proc_gen)
                {
                    m.phase = Phase::Failed {
                        retry_at,
                        process_gone: false,
                    };
                }
            }
            if wanted {
                fx.push(Effect::KeepSpawned { proc_gen });
                m.pid = Some(pid);
                m.restarts = m.restarts.saturating_add(1);
                // An operator's restart is done once a new engine runs.
                m.restart_asked = None;
                m.transition_start = now;
                m.phase = Phase::Starting {
                    deadline: now + m.settings.timeouts.start,
                    spawned: true,
                    admitted: true,
                };
                fx.push(Effect::Log(format!("engine spawned, pid {pid}")));
                fx.push(Effect::ProbeHealth {
                    epoch,
                    check_sleep: false,
                });
            }
        }
        Event::SpawnFailed { proc_gen, error } => {
            if matches!(m.phase, Phase::Starting { .. }) && proc_gen == m.proc_gen {
                fail(m, format!("spawn failed: {error}"), now, fx);
            }
        }
        Event::ChildExited {
            proc_gen,
            status,
            cause,
        } => {
            if proc_gen != m.proc_gen {
                return;
            }
            m.exited_gen = Some(proc_gen);
            m.pid = None;
            m.engine_running = 0;
            m.stable_at = None;
            match m.phase {
                Phase::Stopping { .. } | Phase::Draining { .. } => {
                    fx.push(Effect::Log(format!("engine stopped ({status})")));
                    set_phase(m, Phase::Stopped, now);
                }
                Phase::Failed {
                    retry_at,
                    process_gone: false,
                } => {
                    fx.push(Effect::Log(format!(
                        "failed engine gone ({status}): its GPU memory is free"
                    )));
                    m.phase = Phase::Failed {
                        retry_at,
                        process_gone: true,
                    };
                }
                Phase::Stopped | Phase::Failed { .. } => {}
                _ => {
                    // Why, where the engine said: an operator reads it in
                    // `last_error` without digging through its log.
                    let error = match &cause {
                        Some(cause) => format!("engine exited unexpectedly ({status}): {cause}"),
                        None => format!("engine exited unexpectedly ({status})"),
                    };
                    let raced = matches!(m.phase, Phase::Starting { .. })
                        && cause.as_deref().is_some_and(profiling_race);
                    if raced && m.profile_races < PROFILE_RETRIES {
                        m.profile_races += 1;
                        fx.push(Effect::ReleaseStartLock);
                        fx.push(Effect::Log(format!(
                            "start failed: memory was freed on its GPUs while vLLM profiled (a \
                             process siesta does not run, or one that crashed); starting again \
                             at once ({}/{PROFILE_RETRIES}): {error}",
                            m.profile_races
                        )));
                        m.last_error = Some(error);
                        drive::start(m, now, fx);
                    } else {
                        fail(m, error, now, fx);
                    }
                }
            }
        }
        Event::HealthOk { epoch: e, asleep } if e == epoch => {
            if let Phase::Starting { spawned: true, .. } = m.phase {
                let took = now.saturating_duration_since(m.transition_start);
                if !m.settings.attach {
                    m.calibration.start.add(took);
                }
                // Without it an operator's `siesta logs` showed the spawn
                // and then nothing: when the engine began to serve, and
                // how long its start took, were not to be read anywhere.
                fx.push(Effect::Log(match asleep {
                    Some(level) => format!(
                        "ready after {:.1} s, found asleep at level {level}",
                        took.as_secs_f64()
                    ),
                    None => format!("ready after {:.1} s: serving", took.as_secs_f64()),
                }));
                // Failures are forgotten once it has stayed up a while
                // (`forget_failures`), not now: an engine that dies soon
                // after it became ready keeps backing off.
                m.stable_at = (m.failures > 0).then(|| now + STABLE_AFTER);
                m.last_error = None;
                m.profile_races = 0;
                // The idle clock starts when the engine is ready, not when
                // it was asked for (real vLLM takes a minute or more); an
                // attached engine found serving after a restart of siesta
                // goes on with the clock recorded before (a tier overdue by
                // now waits until its requests in flight are known).
                m.idle_floor = match m.recorded_floor.take() {
                    Some(t) => {
                        m.tiers_after = Some(now + PROXY_STALE);
                        t.min(now)
                    }
                    None => now,
                };
                fx.push(Effect::ReleaseStartLock);
                match asleep {
                    Some(level) => {
                        if m.intent.reason == Reason::Config {
                            set_intent(m, Desired::Asleep(level), Reason::Config, now);
                        }
                        set_phase(m, Phase::Asleep { level }, now);
                    }
                    // The idle floor is set above.
                    None => set_phase(m, Phase::Awake, now),
                }
            }
        }
        Event::HealthFailed {
            epoch: e,
            error,
            timed_out,
            refused,
        } if e == epoch => {
            // Refused with answers under way: the engine closed its listener
            // and is shutting down (vLLM at a SIGTERM siesta did not send);
            // with `--shutdown-timeout` it finishes them. Killing it would
            // cut them: it is drained and started again, as an operator's
            // restart is.
            if refused && m.in_flight() > 0 && !m.settings.attach && m.phase == Phase::Awake {
                fx.push(Effect::Log(format!(
                    "the engine refuses connections with {} answer(s) under way: it is \
                     shutting down; restarting it once they end: {error}",
                    m.in_flight()
                )));
                m.restart_asked = Some(now);
                drive::drain(m, now, fx);
                return;
            }
            if matches!(
                m.phase,
                Phase::Awake | Phase::Asleep { .. } | Phase::Yielding { .. }
            ) {
                // A slow answer while requests are in flight is load, not a
                // fault: killing a working engine would lose them all.
                if timed_out && m.in_flight() > 0 {
                    let since = *m.busy_timeouts_since.get_or_insert(now);
                    if now.saturating_duration_since(since) < BUSY_PROBE_GRACE {
                        fx.push(Effect::Log(format!(
                            "probe timed out with {} request(s) in flight: taken for load, not \
                             counted (for up to {} s): {error}",
                            m.in_flight(),
                            BUSY_PROBE_GRACE.as_secs()
                        )));
                        return;
                    }
                }
                m.health_strikes = m.health_strikes.saturating_add(1);
                if m.health_strikes >= HEALTH_STRIKES {
                    fail(
                        m,
                        format!("health check failed {HEALTH_STRIKES} times in a row: {error}"),
                        now,
                        fx,
                    );
                } else {
                    fx.push(Effect::Log(format!(
                        "probe failed ({} of {HEALTH_STRIKES}): {error}",
                        m.health_strikes
                    )));
                }
            }
        }
        Event::FoundAsleep { epoch: e, level }
            if e == epoch && matches!(m.phase, Phase::Awake | Phase::Yielding { .. }) =>
        {
            fx.push(Effect::Log(format!(
                "the engine is asleep at level {level} while taken as awake (a sleep siesta did \
                 not see finish, or one sent to the engine directly): taken as asleep"
            )));
            set_phase(m, Phase::Asleep { level }, now);
        }
        Event::ProbeOk { epoch: e } if e == epoch => {
            m.health_strikes = 0;
            m.busy_timeouts_since = None;
        }
        // Its wait for starts on its GPUs is over: the sleep's, stop's or
        // suspend's own time (deadline, calibration) counts from here.
        Event::FreeBegan { epoch: e } if e == epoch => match m.phase {
            Phase::Sleeping { level, .. } => {
                m.transition_start = now;
                m.phase = Phase::Sleeping {
                    level,
                    deadline: now + m.settings.timeouts.sleep,
                };
            }
            Phase::Stopping { killed: false, .. } => {
                m.phase = Phase::Stopping {
                    deadline: now + m.settings.timeouts.stop_grace,
                    killed: false,
                };
            }
            Phase::Suspending { under, .. } => {
                m.transition_start = now;
                m.phase = Phase::Suspending {
                    under,
                    deadline: now + SUSPEND_TIMEOUT,
                };
            }
            _ => {}
        },
        Event::SleepDone { epoch: e } if e == epoch => {
            if let Phase::Sleeping { level, .. } = m.phase {
                m.calibration.sleep_mut(level).add(now - m.transition_start);
                fx.push(Effect::Log(format!("asleep at level {level}")));
                if m.intent.reason == Reason::Config {
                    // A preload's tiers count from its end.
                    m.idle_floor = now;
                }
                set_phase(m, Phase::Asleep { level }, now);
            }
        }
        Event::WakeBegan { epoch: e, step } if e == epoch => match m.phase {
            Phase::Waking {
                from_level,
                step: current,
                admitted: true,
                left: Some(left),
                budget,
                ..
            } if step == current => {
                if step == 0 {
                    m.transition_start = now;
                }
                m.phase = Phase::Waking {
                    from_level,
                    step,
                    deadline: now + left,
                    admitted: true,
                    left: None,
                    budget,
                };
            }
            Phase::Resuming {
                under,
                admitted: true,
                ..
            } => {
                m.transition_start = now;
                m.phase = Phase::Resuming {
                    under,
                    deadline: now + m.settings.timeouts.wake,
                    admitted: true,
                };
            }
            _ => {}
        },
        Event::WakeStepDone { epoch: e, step } if e == epoch => {
            if let Phase::Waking {
                from_level,
                step: current,
                deadline,
                admitted,
                left,
                budget,
            } = m.phase
                && step == current
            {
                let calls = wake_calls(m.settings.kind, from_level);
                if step + 1 < calls.len() {
                    // The next call may wait for a neighbour's sleep: that
                    // wait is not the wake's time. (Before admission the
                    // deadline is admission's.)
                    let left = left.unwrap_or_else(|| deadline.saturating_duration_since(now));
                    m.phase = Phase::Waking {
                        from_level,
                        step: step + 1,
                        deadline: if admitted {
                            now + ROOM_WAIT + left
                        } else {
                            deadline
                        },
                        admitted,
                        left: admitted.then_some(left),
                        budget,
                    };
                    fx.push(Effect::Wake {
                        epoch,
                        step: step + 1,
                        call: calls[step + 1],
                    });
                } else {
                    // The wake's own time: its calls, not the waits for
                    // neighbours' sleeps between them (each call's
                    // `WakeBegan` set the deadline to the time left of
                    // `budget`, the wake timeout at admission: a reload
                    // may change the settings' meanwhile). Never more than
                    // since its first call began.
                    let since_first = now - m.transition_start;
                    let took = match left {
                        None if admitted => budget
                            .saturating_sub(deadline.saturating_duration_since(now))
                            .min(since_first),
                        _ => since_first,
                    };
                    m.calibration.wake_mut(from_level).add(took);
                    fx.push(Effect::Log(format!(
                        "awake (woken from level {from_level})"
                    )));
                    become_awake(m, now);
                }
            }
        }
        Event::Admitted { epoch: e } if e == epoch && matches!(m.phase, Phase::Waking { .. }) => {
            if let Phase::Waking {
                from_level,
                step: 0,
                admitted: false,
                ..
            } = m.phase
            {
                // Its call may still wait for a draining sleep and a
                // neighbour's sleep (`WakeBegan` ends those waits).
                let left = m.settings.timeouts.wake;
                m.transition_start = now;
                m.phase = Phase::Waking {
                    from_level,
                    step: 0,
                    deadline: now + first_call_wait(left) + left,
                    admitted: true,
                    left: Some(left),
                    budget: left,
                };
            }
        }
        Event::Admitted { epoch: e } if e == epoch && matches!(m.phase, Phase::Starting { .. }) => {
            if let Phase::Starting {
                spawned: false,
                admitted: false,
                ..
            } = m.phase
            {
                // Room is there; what is left before the spawn is the start
                // lock (engines sharing a GPU start one at a time): up to
                // twice the start timeout, as before admission existed.
                m.phase = Phase::Starting {
                    deadline: now + m.settings.timeouts.start * 2,
                    spawned: false,
                    admitted: true,
                };
            }
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
        Event::SuspendDone { epoch: e } if e == epoch => {
            if let Phase::Suspending { under, .. } = m.phase {
                m.calibration.suspend.add(now - m.transition_start);
                fx.push(Effect::Log(
                    "suspended: GPU state checkpointed to host memory".into(),
                ));
                set_phase(m, Phase::Suspended { under }, now);
            }
        }
        Event::Drained { epoch: e, error } if e == epoch => match m.phase {
            Phase::Draining { .. } => {
                if let Some(error) = error {
                    fx.push(Effect::Log(format!("stopping anyway: {error}")));
                }
                terminate(m, now, fx);
            }
            Phase::Yielding {
                level, deadline, ..
            } => match error {
                // `reconcile` sleeps it once nothing else is in flight.
                None => {
                    m.phase = Phase::Yielding {
                        level,
                        deadline,
                        drained: true,
                    }
                }
                Some(error) => give_up_yield(m, &error, now, fx),
            },
            _ => {}
        },
        Event::SuspendCalledOff { epoch: e } if e == epoch => {
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
        Event::SuspendFailed { epoch: e, error } if e == epoch => {
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
        Event::ResumeDone { epoch: e } if e == epoch => {
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
        Event::Admitted { epoch: e } if e == epoch && matches!(m.phase, Phase::Resuming { .. }) => {
            if let Phase::Resuming {
                under,
                admitted: false,
                ..
            } = m.phase
            {
                // The restore may still wait for a neighbour's sleep
                // (`WakeBegan` ends that wait).
                m.transition_start = now;
                m.phase = Phase::Resuming {
                    under,
                    deadline: now + ROOM_WAIT + m.settings.timeouts.wake,
                    admitted: true,
                };
            }
        }
        Event::Tick => deadlines(m, now, fx),
        Event::SuspendDone { .. }
        | Event::Drained { .. }
        | Event::SuspendCalledOff { .. }
        | Event::SuspendFailed { .. }
        | Event::ResumeDone { .. }
        | Event::ResumeFailed { .. } => {}
        Event::HealthOk { .. }
        | Event::HealthFailed { .. }
        | Event::ProbeOk { .. }
        | Event::FoundAsleep { .. }
        | Event::FreeBegan { .. }
        | Event::SleepDone { .. }
        | Event::SleepFailed { .. }
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

fn command(m: &mut ModelState, cmd: Command, now: Instant, fx: &mut Vec<Effect>) {
    match cmd {
        Command::Wake | Command::Start => {
            set_intent(m, Desired::Awake, Reason::Operator, now);
            m.intent.since = now;
            m.idle_floor = now;
            retry_now(m, now);
            call_off_yield(m, "woken by an operator", now, fx);
        }
        Command::Sleep(level) if !m.settings.kind.can_sleep(level) => {
            // The API refuses it first; nothing is planned that the kind lacks.
            fx.push(Effect::Log(format!(
                "sleep at level {level} ignored: engine = \"{}\" cannot do it",
                m.settings.kind
            )));
        }
        Command::Sleep(level) => {
            m.pin = Pin::None;
            m.demand_since = None;
            set_intent(m, Desired::Asleep(level), Reason::Operator, now);
            // Deeper tiers count from the operator's choice: an overdue one
            // does not replace it at once.
            m.idle_floor = now;
            retry_now(m, now);
        }
        Command::Suspend if !m.settings.kind.can(IdleAction::Suspend, m.settings.attach) => {
            fx.push(Effect::Log(format!(
                "suspend ignored: an {}engine = \"{}\" cannot be suspended",
                if m.settings.attach { "attached " } else { "" },
                m.settings.kind
            )));
        }
        Command::Suspend => {
            m.pin = Pin::None;
            m.demand_since = None;
            set_intent(m, Desired::Suspended, Reason::Operator, now);
            m.idle_floor = now;
            retry_now(m, now);
        }
        Command::Stop => stop_for_good(m, Reason::Operator, now, fx),
        Command::Restart => {
            set_intent(m, Desired::Awake, Reason::Operator, now);
            m.idle_floor = now;
            retry_now(m, now);
            let running = matches!(
                m.phase,
                Phase::Starting { .. }
                    | Phase::Sleeping { .. }
                    | Phase::Asleep { .. }
                    | Phase::Waking { .. }
                    | Phase::Suspending { .. }
                    | Phase::Suspended { .. }
                    | Phase::Resuming { .. }
            );
            if matches!(m.phase, Phase::Awake | Phase::Yielding { .. }) && !m.settings.attach {
                // Answers under way finish first.
                m.restart_asked = Some(now);
                drain(m, now, fx);
            } else if running && !m.settings.attach {
                m.restart_asked = Some(now);
                terminate(m, now, fx);
            }
        }
    }
}
