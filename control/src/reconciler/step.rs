//! The transition function.

use super::tiers::{due_tier, next_tier, tier_desired};
use super::*;

/// Grace after SIGKILL for the process to be reaped.
const KILL_GRACE: Duration = Duration::from_secs(10);

/// Applies `event` at `now`; returns the new state and what to do.
pub fn step(mut m: ModelState, event: Event, now: Instant) -> (ModelState, Vec<Effect>) {
    let mut fx = Vec::new();
    let intent_before = m.intent;
    expire_pin(&mut m, now);
    handle(&mut m, event, now, &mut fx);
    reconcile(&mut m, now, &mut fx);
    if m.intent != intent_before {
        fx.push(Effect::Persist);
    }
    fx.push(Effect::Timer(next_wakeup(&m, now)));
    (m, fx)
}

fn set_phase(m: &mut ModelState, phase: Phase, now: Instant) {
    m.phase = phase;
    m.since = now;
    m.epoch += 1;
}

fn set_intent(m: &mut ModelState, desired: Desired, reason: Reason, now: Instant) {
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

fn fail(m: &mut ModelState, error: String, now: Instant, fx: &mut Vec<Effect>) {
    m.failures = m.failures.saturating_add(1);
    if !m.settings.attach {
        fx.push(Effect::Signal(Signal::Kill));
    }
    fx.push(Effect::ReleaseStartLock);
    let retry_at = (m.intent.desired != Desired::Stopped).then(|| now + m.backoff());
    fx.push(Effect::Log(format!(
        "failed ({} in a row): {error}; retry in {:?}",
        m.failures,
        retry_at.map(|t| t - now)
    )));
    m.last_error = Some(error);
    set_phase(m, Phase::Failed { retry_at }, now);
}

fn handle(m: &mut ModelState, event: Event, now: Instant, fx: &mut Vec<Effect>) {
    let epoch = m.epoch;
    match event {
        Event::Command(cmd) => command(m, cmd, now, fx),
        Event::Demand => {
            let operator_stop =
                m.intent.desired == Desired::Stopped && m.intent.reason == Reason::Operator;
            if !operator_stop && m.intent.desired != Desired::Awake {
                set_intent(m, Desired::Awake, Reason::Demand, now);
            }
        }
        Event::Pin(until) => {
            m.pin = until.map_or(Pin::Forever, Pin::Until);
            set_intent(m, Desired::Awake, Reason::Pin, now);
            m.intent.until = until;
            m.intent.since = now;
            retry_now(m, now);
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
            active,
            last_finished,
        } => {
            if in_flight == 0 {
                m.proxies.remove(&proxy);
            } else {
                m.proxies.insert(proxy, in_flight);
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
            if let Phase::Starting { spawned: false, .. } = m.phase
                && proc_gen == m.proc_gen
            {
                m.pid = Some(pid);
                m.restarts = m.restarts.saturating_add(1);
                m.transition_start = now;
                m.phase = Phase::Starting {
                    deadline: now + m.settings.timeouts.start,
                    spawned: true,
                };
                fx.push(Effect::Log(format!("engine spawned, pid {pid}")));
                fx.push(Effect::ProbeHealth { epoch });
            }
        }
        Event::SpawnFailed { proc_gen, error } => {
            if matches!(m.phase, Phase::Starting { .. }) && proc_gen == m.proc_gen {
                fail(m, format!("spawn failed: {error}"), now, fx);
            }
        }
        Event::ChildExited { proc_gen, status } => {
            if proc_gen != m.proc_gen {
                return;
            }
            m.pid = None;
            m.engine_running = 0;
            match m.phase {
                Phase::Stopping { .. } => {
                    fx.push(Effect::Log(format!("engine stopped ({status})")));
                    set_phase(m, Phase::Stopped, now);
                }
                Phase::Stopped | Phase::Failed { .. } => {}
                _ => fail(m, format!("engine exited unexpectedly ({status})"), now, fx),
            }
        }
        Event::HealthOk { epoch: e, asleep } if e == epoch => {
            if let Phase::Starting { spawned: true, .. } = m.phase {
                if !m.settings.attach {
                    m.calibration.start.add(now - m.transition_start);
                }
                m.failures = 0;
                m.last_error = None;
                fx.push(Effect::ReleaseStartLock);
                match asleep {
                    Some(level) => {
                        if m.intent.reason == Reason::Config {
                            set_intent(m, Desired::Asleep(level), Reason::Config, now);
                        }
                        set_phase(m, Phase::Asleep { level }, now);
                    }
                    None => become_awake(m, now),
                }
            }
        }
        Event::HealthFailed { epoch: e, error } if e == epoch => {
            if matches!(m.phase, Phase::Awake | Phase::Asleep { .. }) {
                fail(m, format!("health check failed: {error}"), now, fx);
            }
        }
        Event::SleepDone { epoch: e } if e == epoch => {
            if let Phase::Sleeping { level, .. } = m.phase {
                m.calibration.sleep_mut(level).add(now - m.transition_start);
                fx.push(Effect::Log(format!("asleep at level {level}")));
                set_phase(m, Phase::Asleep { level }, now);
            }
        }
        Event::WakeStepDone { epoch: e, step } if e == epoch => {
            if let Phase::Waking {
                from_level,
                step: current,
                deadline,
            } = m.phase
                && step == current
            {
                let calls = wake_calls(from_level);
                if step + 1 < calls.len() {
                    m.phase = Phase::Waking {
                        from_level,
                        step: step + 1,
                        deadline,
                    };
                    fx.push(Effect::Wake {
                        epoch,
                        step: step + 1,
                        call: calls[step + 1],
                    });
                } else {
                    m.calibration
                        .wake_mut(from_level)
                        .add(now - m.transition_start);
                    fx.push(Effect::Log(format!(
                        "awake (woken from level {from_level})"
                    )));
                    become_awake(m, now);
                }
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
        Event::Tick => deadlines(m, now, fx),
        Event::HealthOk { .. }
        | Event::HealthFailed { .. }
        | Event::SleepDone { .. }
        | Event::SleepFailed { .. }
        | Event::WakeStepDone { .. }
        | Event::WakeFailed { .. } => {}
    }
}

fn become_awake(m: &mut ModelState, now: Instant) {
    if m.intent.desired == Desired::Awake {
        m.idle_floor = now;
    }
    set_phase(m, Phase::Awake, now);
}

/// A failed model the operator asks for is retried at once.
fn retry_now(m: &mut ModelState, now: Instant) {
    if let Phase::Failed { .. } = m.phase {
        m.phase = Phase::Failed {
            retry_at: Some(now),
        };
    }
}

fn command(m: &mut ModelState, cmd: Command, now: Instant, fx: &mut Vec<Effect>) {
    match cmd {
        Command::Wake | Command::Start => {
            set_intent(m, Desired::Awake, Reason::Operator, now);
            m.intent.since = now;
            m.idle_floor = now;
            retry_now(m, now);
        }
        Command::Sleep(level) => {
            m.pin = Pin::None;
            set_intent(m, Desired::Asleep(level), Reason::Operator, now);
            retry_now(m, now);
        }
        Command::Stop => {
            m.pin = Pin::None;
            set_intent(m, Desired::Stopped, Reason::Operator, now);
            // An operator stop interrupts a transition under way.
            let busy = matches!(
                m.phase,
                Phase::Starting { .. } | Phase::Sleeping { .. } | Phase::Waking { .. }
            );
            if busy && !m.settings.attach {
                terminate(m, now, fx);
            }
        }
        Command::Restart => {
            set_intent(m, Desired::Awake, Reason::Operator, now);
            m.idle_floor = now;
            retry_now(m, now);
            let running = matches!(
                m.phase,
                Phase::Starting { .. }
                    | Phase::Awake
                    | Phase::Sleeping { .. }
                    | Phase::Asleep { .. }
                    | Phase::Waking { .. }
            );
            if running && !m.settings.attach {
                terminate(m, now, fx);
            }
        }
    }
}

fn terminate(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    fx.push(Effect::ReleaseStartLock);
    if m.pid.is_none() {
        // Not spawned yet (waiting for the start lock): nothing to signal.
        fx.push(Effect::Log("stopped before the engine was spawned".into()));
        set_phase(m, Phase::Stopped, now);
        return;
    }
    fx.push(Effect::Signal(Signal::Term));
    fx.push(Effect::Log("stopping: SIGTERM to the process group".into()));
    let deadline = now + m.settings.timeouts.stop_grace;
    set_phase(
        m,
        Phase::Stopping {
            deadline,
            killed: false,
        },
        now,
    );
}

fn deadlines(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    let Some(deadline) = m.phase.deadline() else {
        return;
    };
    if deadline > now {
        return;
    }
    match m.phase {
        Phase::Starting { .. } => fail(m, "start timed out".into(), now, fx),
        Phase::Sleeping { level, .. } => {
            fail(m, format!("sleep (level {level}) timed out"), now, fx)
        }
        Phase::Waking { from_level, .. } => fail(
            m,
            format!("wake from level {from_level} timed out"),
            now,
            fx,
        ),
        Phase::Stopping { killed: false, .. } => {
            fx.push(Effect::Signal(Signal::Kill));
            fx.push(Effect::Log(
                "stop grace over: SIGKILL to the process group".into(),
            ));
            m.phase = Phase::Stopping {
                deadline: now + KILL_GRACE,
                killed: true,
            };
        }
        Phase::Stopping { killed: true, .. } => {
            fail(m, "engine did not exit after SIGKILL".into(), now, fx)
        }
        _ => {}
    }
}

fn start(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    m.transition_start = now;
    m.engine_running = 0;
    if m.settings.attach {
        let deadline = now + m.settings.timeouts.start;
        set_phase(
            m,
            Phase::Starting {
                deadline,
                spawned: true,
            },
            now,
        );
        fx.push(Effect::ProbeHealth { epoch: m.epoch });
    } else {
        // Waiting for the start lock counts too, up to another start timeout.
        let deadline = now + m.settings.timeouts.start * 2;
        set_phase(
            m,
            Phase::Starting {
                deadline,
                spawned: false,
            },
            now,
        );
        m.proc_gen += 1;
        fx.push(Effect::Spawn {
            proc_gen: m.proc_gen,
        });
    }
}

fn begin_sleep(m: &mut ModelState, level: u8, now: Instant, fx: &mut Vec<Effect>) {
    m.transition_start = now;
    let deadline = now + m.settings.timeouts.sleep;
    set_phase(m, Phase::Sleeping { level, deadline }, now);
    fx.push(Effect::Log(format!("sleeping at level {level}")));
    fx.push(Effect::Sleep {
        epoch: m.epoch,
        level,
    });
}

fn begin_wake(m: &mut ModelState, from_level: u8, now: Instant, fx: &mut Vec<Effect>) {
    m.transition_start = now;
    let deadline = now + m.settings.timeouts.wake;
    set_phase(
        m,
        Phase::Waking {
            from_level,
            step: 0,
            deadline,
        },
        now,
    );
    fx.push(Effect::Log(format!("waking from level {from_level}")));
    fx.push(Effect::Wake {
        epoch: m.epoch,
        step: 0,
        call: wake_calls(from_level)[0],
    });
}

/// Takes one step towards the intent from a stable phase.
fn reconcile(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    if let Some(tier) = due_tier(m, now) {
        let desired = tier_desired(&tier, m.settings.attach);
        fx.push(Effect::Log(format!(
            "idle tier fired after {:?}: {desired:?}",
            tier.after
        )));
        set_intent(m, desired, Reason::IdleTier, now);
    }
    let desired = m.intent.desired;
    match m.phase {
        Phase::Stopped => {
            if desired != Desired::Stopped {
                start(m, now, fx);
            }
        }
        Phase::Failed { retry_at } => {
            if desired == Desired::Stopped && !m.settings.attach {
                set_phase(m, Phase::Stopped, now);
            } else if desired != Desired::Stopped && retry_at.is_some_and(|t| t <= now) {
                start(m, now, fx);
            } else if desired != Desired::Stopped && retry_at.is_none() {
                m.phase = Phase::Failed {
                    retry_at: Some(now + m.backoff()),
                };
            }
        }
        Phase::Awake => match desired {
            Desired::Awake => {}
            Desired::Asleep(level) => {
                if m.in_flight() == 0 {
                    begin_sleep(m, level, now, fx);
                }
            }
            Desired::Stopped if m.settings.attach => {
                if m.in_flight() == 0 {
                    begin_sleep(m, 2, now, fx);
                }
            }
            Desired::Stopped => terminate(m, now, fx),
        },
        Phase::Asleep { level } => match desired {
            Desired::Awake => begin_wake(m, level, now, fx),
            // Deeper sleep: wake, then sleep again at the new level.
            Desired::Asleep(l) if l > level => begin_wake(m, level, now, fx),
            Desired::Asleep(_) => {}
            Desired::Stopped if m.settings.attach => {
                if level < 2 {
                    begin_wake(m, level, now, fx);
                }
            }
            Desired::Stopped => terminate(m, now, fx),
        },
        Phase::Starting { .. }
        | Phase::Sleeping { .. }
        | Phase::Waking { .. }
        | Phase::Stopping { .. } => {}
    }
}

/// The earliest time something must be re-checked.
fn next_wakeup(m: &ModelState, now: Instant) -> Option<Instant> {
    let mut times = Vec::new();
    times.extend(m.phase.deadline());
    if let Phase::Failed {
        retry_at: Some(t), ..
    } = m.phase
    {
        times.push(t);
    }
    if let Pin::Until(t) = m.pin {
        times.push(t);
    }
    if let Some((_, at)) = next_tier(m, now) {
        times.push(at);
    }
    times.into_iter().min()
}
