//! Sleeps and wakes under way: their calls began, ended or failed, or they
//! were admitted to their GPUs.

use super::*;

/// Its wait for starts on its GPUs is over: the sleep's, stop's or
/// suspend's own time (deadline, calibration) counts from here.
pub(super) fn free_began(m: &mut ModelState, now: Instant) {
    match m.phase {
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
    }
}

pub(super) fn sleep_done(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
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

/// Requests reached the engine as its sleep began: it stays awake for
/// them (counted in flight, from its gauge), and the sleep, still wanted,
/// begins once they are done (the next poll that reads the gauge at 0).
pub(super) fn sleep_called_off(
    m: &mut ModelState,
    running: u32,
    now: Instant,
    fx: &mut Vec<Effect>,
) {
    if let Phase::Sleeping { level, .. } = m.phase {
        fx.push(Effect::Log(format!(
            "sleep (level {level}) called off: {running} request(s) reached the engine as it \
             began; it sleeps once they are done"
        )));
        become_awake(m, now);
        m.engine_running = running;
        m.last_activity = Some(now);
    }
}

/// A wake step's call, or a restore, begins now: its deadline counts from
/// here.
pub(super) fn wake_began(m: &mut ModelState, step: usize, now: Instant) {
    match m.phase {
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
    }
}

/// A wake step's call ended: the next call, or awake.
pub(super) fn wake_step_done(
    m: &mut ModelState,
    step: usize,
    epoch: u64,
    now: Instant,
    fx: &mut Vec<Effect>,
) {
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

/// A wake, resume or start waited for room on its GPUs and has it now.
pub(super) fn admitted(m: &mut ModelState, now: Instant) {
    match m.phase {
        Phase::Waking {
            from_level,
            step: 0,
            admitted: false,
            ..
        } => {
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
        Phase::Starting {
            spawned: false,
            admitted: false,
            ..
        } => {
            // Room is there; what is left before the spawn is the start
            // lock (engines sharing a GPU start one at a time): up to
            // twice the start timeout, as before admission existed.
            m.phase = Phase::Starting {
                deadline: now + m.settings.timeouts.start * 2,
                spawned: false,
                admitted: true,
            };
        }
        Phase::Resuming {
            under,
            admitted: false,
            ..
        } => {
            // The restore may still wait for a neighbour's sleep
            // (`WakeBegan` ends that wait).
            m.transition_start = now;
            m.phase = Phase::Resuming {
                under,
                deadline: now + ROOM_WAIT + m.settings.timeouts.wake,
                admitted: true,
            };
        }
        _ => {}
    }
}

/// Every live proxy has nothing in flight to the engine (or the wait for
/// that ended): a stop goes on, a yield sleeps once nothing is in flight.
pub(super) fn drained(
    m: &mut ModelState,
    error: Option<String>,
    now: Instant,
    fx: &mut Vec<Effect>,
) {
    match m.phase {
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
    }
}
