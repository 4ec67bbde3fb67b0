//! Driving towards the intent: starting transitions from stable phases,
//! deadlines, and when to look again.

use super::step::{demand, fail, set_intent, set_phase};
use super::tiers::{due_tier, next_tier, tier_desired};
use super::*;

/// Grace after SIGKILL for the process to be reaped: what the supervisor
/// may take to tell the exit (the leader reaped, what is left of its group
/// swept, the cause looked for in its log). It was 10 s, shorter than
/// that: a tensor-parallel engine whose workers took 12 s to go was failed
/// as "stuck in the kernel" though its leader was gone.
pub(super) const KILL_GRACE: Duration =
    crate::supervisor::KILL_WAIT.saturating_add(crate::supervisor::EXIT_CAUSE_WAIT);

pub(super) fn terminate(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    // An engine still starting keeps its GPUs' start lock until it has
    // exited (the stop takes the hold over): released now, a neighbour's
    // start waiting for the lock began beside an engine still loading (two
    // vLLM starts on one GPU miscount each other), and the stop's SIGTERM
    // waited for that whole start, up to ROOM_WAIT.
    if !matches!(m.phase, Phase::Starting { spawned: true, .. }) || m.pid.is_none() {
        fx.push(Effect::ReleaseStartLock);
    }
    if m.pid.is_none() {
        // Not spawned yet (waiting for the start lock): nothing to signal.
        fx.push(Effect::Log("stopped before the engine was spawned".into()));
        set_phase(m, Phase::Stopped, now);
        return;
    }
    // SIGTERM once no engine starts on its GPUs (`FreeBegan`).
    let deadline = now + ROOM_WAIT + m.settings.timeouts.stop_grace;
    set_phase(
        m,
        Phase::Stopping {
            deadline,
            killed: false,
        },
        now,
    );
    fx.push(Effect::Log("stopping: SIGTERM to the process group".into()));
    fx.push(Effect::Terminate { epoch: m.epoch });
}

/// A stop (or restart) of an awake engine: answers under way finish first
/// (see [`Phase::Draining`]), then [`terminate`].
pub(super) fn drain(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    if m.pid.is_none() || m.settings.attach {
        terminate(m, now, fx);
        return;
    }
    let grace = m.settings.timeouts.stop_grace;
    set_phase(
        m,
        Phase::Draining {
            deadline: now + grace,
        },
        now,
    );
    fx.push(Effect::Log(match m.intent.reason {
        Reason::Operator | Reason::Config | Reason::Pin | Reason::Demand => format!(
            "stopping: requests in flight finish first (up to {} s), then SIGTERM",
            grace.as_secs()
        ),
        Reason::IdleTier | Reason::Eviction => {
            "stopping: SIGTERM once every proxy confirms it forwards nothing more".into()
        }
    }));
    fx.push(Effect::Drain { epoch: m.epoch });
}

/// Busy past its turn while `to` waits for its GPUs: stop taking requests
/// (published as sleeping, so proxies hold new ones), let those in flight
/// finish, then sleep at `level` (see [`Phase::Yielding`]). Requests held
/// meanwhile are a demand: once asleep it asks for its GPUs again, behind
/// `to`. The intent is left as it is until the sleep begins
/// ([`yield_sleep`]): a yield given up, or a control plane restarted
/// meanwhile, finds the model wanted as it was, not put to sleep later
/// without a drain.
pub(super) fn begin_yield(
    m: &mut ModelState,
    level: u8,
    to: &str,
    now: Instant,
    fx: &mut Vec<Effect>,
) {
    let why = format!("yielding its GPUs to \"{to}\", which waited for them");
    drain_then_sleep(m, level, &why, now, fx);
}

/// Stops taking requests (published as sleeping: proxies hold new ones),
/// lets those in flight finish (up to one stop grace), then sleeps at
/// `level` ([`Phase::Yielding`]); `why` starts its log line.
fn drain_then_sleep(m: &mut ModelState, level: u8, why: &str, now: Instant, fx: &mut Vec<Effect>) {
    let grace = m.settings.timeouts.stop_grace;
    set_phase(
        m,
        Phase::Yielding {
            level,
            deadline: now + grace,
            drained: false,
        },
        now,
    );
    fx.push(Effect::Log(format!(
        "{why}: new requests are held, the {} in flight finish (up to {} s), then it sleeps at \
         level {level}",
        m.in_flight(),
        grace.as_secs()
    )));
    fx.push(Effect::Drain { epoch: m.epoch });
}

/// A yield whose requests in flight did not finish within its stop grace:
/// it serves again (nothing is cut); admission may ask again after another
/// turn, longer for each yield given up in a row (`admission/queue.rs`).
pub(super) fn give_up_yield(m: &mut ModelState, why: &str, now: Instant, fx: &mut Vec<Effect>) {
    m.yields_given_up = m.yields_given_up.saturating_add(1);
    fx.push(Effect::Log(format!(
        "yield given up ({} in a row), serving again (nothing cut): {why}; its next turn is \
         longer",
        m.yields_given_up
    )));
    super::step::become_awake(m, now);
}

/// A yield is drained and nothing is in flight: it sleeps, at its level or
/// the deeper one an operator or a tier asked for meanwhile (an operator's
/// suspend is carried out from there). A model wanted awake as before is
/// put to sleep for the model it yielded to (requests held meanwhile wake
/// it again behind that one); a demand not yet served keeps it wanted
/// awake, so it asks for its GPUs again at once, behind that one (put to
/// sleep, a demand whose held count had not been reported yet was lost).
fn yield_sleep(m: &mut ModelState, level: u8, now: Instant, fx: &mut Vec<Effect>) {
    let level = match m.intent.desired {
        Desired::Asleep(l) => l.max(level),
        Desired::Awake if m.demand_since.is_some() => level,
        Desired::Awake => {
            set_intent(m, Desired::Asleep(level), Reason::Eviction, now);
            level
        }
        Desired::Suspended | Desired::Stopped => level,
    };
    begin_sleep(m, level, now, fx);
}

pub(super) fn deadlines(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    let Some(deadline) = m.phase.deadline() else {
        return;
    };
    if deadline > now {
        return;
    }
    match m.phase {
        Phase::Starting {
            admitted: false, ..
        } => {
            // No room within ROOM_WAIT: nothing was spawned, so nothing
            // failed; the model stays stopped until the next request.
            let error = format!(
                "{NO_ROOM} {ROOM_WAIT:?}: the models holding them stayed busy or pinned, or \
                 processes siesta does not run kept their memory (`siesta placement` shows who \
                 holds what); the engine was not started and the next request tries again"
            );
            fx.push(Effect::Log(format!("start gave up: {error}")));
            fx.push(Effect::ReleaseStartLock);
            m.last_error = Some(error);
            m.demand_since = None;
            // A pin still wants it awake: it asks again (reconcile below).
            if m.pin == Pin::None {
                set_intent(m, Desired::Stopped, Reason::Eviction, now);
            }
            set_phase(m, Phase::Stopped, now);
        }
        Phase::Starting { .. } => fail(m, "start timed out".into(), now, fx),
        Phase::Sleeping { level, .. } => {
            fail(m, format!("sleep (level {level}) timed out"), now, fx)
        }
        Phase::Waking {
            from_level,
            admitted: false,
            ..
        } => {
            // No room within ROOM_WAIT: the engine stays asleep, unharmed.
            // A tier's deeper sleep (the wake it needs first) is put off
            // quietly: nobody asked for it, and its tier is still the
            // model's (it was shown as an error and an eviction).
            let tier_deepening = m.intent.reason == Reason::IdleTier
                && matches!(m.intent.desired, Desired::Asleep(l) if l > from_level);
            if tier_deepening {
                fx.push(Effect::Log(format!(
                    "deeper sleep put off: no room on its GPUs within {ROOM_WAIT:?} to wake it \
                     first; the tier asks again after as long again as the model has been idle"
                )));
                m.demand_since = None;
                m.deepen_after = Some(now + now.saturating_duration_since(m.idle_start()));
                set_intent(m, Desired::Asleep(from_level), Reason::IdleTier, now);
                set_phase(m, Phase::Asleep { level: from_level }, now);
                return;
            }
            let error = format!(
                "{NO_ROOM} {ROOM_WAIT:?}: the models holding them stayed busy or pinned, or \
                 processes siesta does not run kept their memory (`siesta placement` shows who \
                 holds what); the engine stays asleep and the next request tries again"
            );
            fx.push(Effect::Log(format!("wake gave up: {error}")));
            m.last_error = Some(error);
            m.demand_since = None;
            if m.intent.desired == Desired::Awake {
                // A demand's held requests ended about now (`max_hold`):
                // tiers count again from here, and one due meanwhile would
                // only ask for the same room again.
                m.idle_floor = now;
            } else {
                // A tier's deeper sleep (which needs this wake) waits as
                // long again as the model has been idle, so a GPU that
                // stays full is not asked again every few minutes; a stop
                // tier, which needs no wake, keeps to the idle clock.
                m.deepen_after = Some(now + now.saturating_duration_since(m.idle_start()));
            }
            // A pin still wants it awake: it asks again (reconcile below),
            // rather than being left asleep with the pin shown in force.
            if m.pin == Pin::None {
                set_intent(m, Desired::Asleep(from_level), Reason::Eviction, now);
            }
            set_phase(m, Phase::Asleep { level: from_level }, now);
        }
        Phase::Waking { from_level, .. } => fail(
            m,
            format!("wake from level {from_level} timed out"),
            now,
            fx,
        ),
        Phase::Suspending { .. } => fail(
            m,
            "suspend timed out (the checkpoint helper did not finish)".into(),
            now,
            fx,
        ),
        Phase::Resuming {
            under,
            admitted: false,
            ..
        } => {
            // No room within ROOM_WAIT: the engine stays suspended, unharmed.
            let error = format!(
                "{NO_ROOM} {ROOM_WAIT:?} to restore it: the models holding them stayed busy or \
                 pinned, or processes siesta does not run kept their memory; the engine stays \
                 suspended and the next request tries again"
            );
            fx.push(Effect::Log(format!("resume gave up: {error}")));
            m.last_error = Some(error);
            m.demand_since = None;
            // A pin asks again (as a wake's or a start's give-up does).
            if m.pin == Pin::None {
                set_intent(m, Desired::Suspended, Reason::Eviction, now);
            }
            set_phase(m, Phase::Suspended { under }, now);
        }
        Phase::Resuming { .. } => fail(m, "resume timed out".into(), now, fx),
        Phase::Draining { .. } => {
            fx.push(Effect::Log(
                "drain time over with requests still in flight: stopping anyway".into(),
            ));
            terminate(m, now, fx);
        }
        Phase::Yielding { .. } => {
            let why = format!(
                "{} request(s) still in flight after {} s",
                m.in_flight(),
                m.settings.timeouts.stop_grace.as_secs()
            );
            give_up_yield(m, &why, now, fx);
        }
        Phase::Stopping { killed: false, .. } => {
            fx.push(Effect::Kill);
            fx.push(Effect::Log(
                "stop grace over: SIGKILL to the process group".into(),
            ));
            m.phase = Phase::Stopping {
                deadline: now + KILL_GRACE,
                killed: true,
            };
        }
        Phase::Stopping { killed: true, .. } => {
            let error = match m.pid {
                Some(pid) => format!("stopping: {}", unreaped(pid)),
                None => "engine did not exit after SIGKILL".into(),
            };
            fail(m, error, now, fx)
        }
        _ => {}
    }
}

/// A failed engine's SIGKILLed process has not exited [`KILL_GRACE`]
/// after the kill (stuck in the kernel: in the GPU driver, or on a dead
/// mount): it is not restarted beside it (its GPU memory is still taken),
/// and its `last_error` says so once, naming the pid, rather than showing a
/// retry that never comes.
fn report_unreaped(m: &mut ModelState, fx: &mut Vec<Effect>) {
    let Some(pid) = m.pid else { return };
    let first = m.last_error.as_deref().unwrap_or("failed");
    if first.contains(UNREAPED) {
        return;
    }
    let error = format!("{first}; {}", unreaped(pid));
    fx.push(Effect::Log(error.clone()));
    m.last_error = Some(error);
}

const UNREAPED: &str = " s after SIGKILL (stuck in the kernel?";

fn unreaped(pid: u32) -> String {
    format!(
        "its engine (pid {pid}) has not exited {}{UNREAPED} `ps -o pid,stat,wchan -p {pid}`): its \
         GPU memory stays counted, and it is not started again until that process is gone",
        KILL_GRACE.as_secs()
    )
}

pub(super) fn start(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    m.transition_start = now;
    m.start_time_unknown = false;
    m.stable_at = None;
    m.engine_running = 0;
    // The previous generation's process is the runner's to reap; its pid
    // must not make a later stop wait for it.
    m.pid = None;
    if m.settings.attach {
        let deadline = now + m.settings.timeouts.start;
        set_phase(
            m,
            Phase::Starting {
                deadline,
                spawned: true,
                admitted: true,
            },
            now,
        );
        fx.push(Effect::ProbeHealth {
            epoch: m.epoch,
            check_sleep: true,
        });
    } else {
        // Room on its GPUs first (admission), at most ROOM_WAIT; the start
        // lock's wait is timed from the answer (`Admitted`).
        let deadline = now + ROOM_WAIT;
        set_phase(
            m,
            Phase::Starting {
                deadline,
                spawned: false,
                admitted: false,
            },
            now,
        );
        m.proc_gen += 1;
        fx.push(Effect::Spawn {
            proc_gen: m.proc_gen,
            fresh_port: m.failures > 0,
        });
    }
}

fn begin_sleep(m: &mut ModelState, level: u8, now: Instant, fx: &mut Vec<Effect>) {
    m.transition_start = now;
    // Nothing in flight: whatever outlasted earlier yields is done.
    m.yields_given_up = 0;
    // The engine is asked once no engine starts on its GPUs (`FreeBegan`).
    let deadline = now + ROOM_WAIT + m.settings.timeouts.sleep;
    set_phase(m, Phase::Sleeping { level, deadline }, now);
    fx.push(Effect::Log(format!("sleeping at level {level}")));
    fx.push(Effect::Sleep {
        epoch: m.epoch,
        level,
    });
}

fn begin_suspend(m: &mut ModelState, under: u8, now: Instant, fx: &mut Vec<Effect>) {
    m.transition_start = now;
    let deadline = now + SUSPEND_TIMEOUT;
    // Recorded first: a control restarted mid-suspend adopts the engine
    // as suspended and never probes it.
    fx.push(Effect::RecordSuspended { under });
    set_phase(m, Phase::Suspending { under, deadline }, now);
    fx.push(Effect::Log(
        "suspending: checkpointing GPU state to host memory".into(),
    ));
    fx.push(Effect::Suspend { epoch: m.epoch });
}

fn begin_resume(m: &mut ModelState, under: u8, now: Instant, fx: &mut Vec<Effect>) {
    m.transition_start = now;
    let deadline = now + ROOM_WAIT;
    set_phase(
        m,
        Phase::Resuming {
            under,
            deadline,
            admitted: false,
        },
        now,
    );
    fx.push(Effect::Log("resuming: restoring GPU state".into()));
    fx.push(Effect::Resume { epoch: m.epoch });
}

fn begin_wake(m: &mut ModelState, from_level: u8, now: Instant, fx: &mut Vec<Effect>) {
    m.transition_start = now;
    let deadline = now + ROOM_WAIT;
    set_phase(
        m,
        Phase::Waking {
            from_level,
            step: 0,
            deadline,
            admitted: false,
            left: None,
            budget: m.settings.timeouts.wake,
        },
        now,
    );
    fx.push(Effect::Log(format!("waking from level {from_level}")));
    fx.push(Effect::Wake {
        epoch: m.epoch,
        step: 0,
        call: wake_calls(m.settings.kind, from_level)[0],
    });
}

/// Requests the proxies hold are a demand still waiting. A proxy sends one
/// `Demand` per wait; an operator's sleep or suspend since then (or a
/// failed transition) put the model at rest with them still held, and
/// nothing else would wake it before their `max_hold`. True when it now
/// wants the model awake for them.
///
/// So are requests a proxy has in flight to an asleep engine: forwarded by
/// a proxy that had not yet seen the sleep begin (a sleep does not wait
/// for proxies to fence), they sit in vLLM's queue until a wake (a
/// request can begin only once nothing is in flight, so any in flight
/// while asleep came after).
fn held_is_demand(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) -> bool {
    let at_rest = matches!(
        m.phase,
        Phase::Asleep { .. } | Phase::Stopped | Phase::Suspended { .. }
    );
    let stuck = match m.phase {
        Phase::Asleep { .. } => m.proxies_in_flight(),
        _ => 0,
    };
    let waiting = m.held().saturating_add(stuck);
    if waiting == 0 || m.intent.desired == Desired::Awake || !at_rest || !demand(m, now) {
        return false;
    }
    fx.push(Effect::Log(if stuck > 0 {
        format!("{stuck} request(s) reached the engine as it went to sleep: waking for them")
    } else {
        format!("{} request(s) held: waking for them", m.held())
    }));
    true
}

/// Takes one step towards the intent from a stable phase.
pub(super) fn reconcile(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    held_is_demand(m, now, fx);
    if let Some(tier) = due_tier(m, now)
        && let Some(desired) = tier_desired(&tier, &m.settings)
    {
        fx.push(Effect::Log(format!(
            "idle tier fired after {:?}: {}",
            tier.after,
            desired.describe()
        )));
        set_intent(m, desired, Reason::IdleTier, now);
    }
    fit_intent(m, fx);
    let desired = m.intent.desired;
    let deepest = m.settings.kind.deepest_sleep();
    match m.phase {
        Phase::Stopped => {
            if desired != Desired::Stopped {
                start(m, now, fx);
            }
        }
        Phase::Failed {
            retry_at,
            process_gone,
        } => {
            // Its killed processes still hold its GPU memory: it is not
            // stopped, and a new engine beside them would find none, until
            // their exit (`ChildExited`) is seen.
            let exiting = !process_gone && !m.settings.attach;
            if exiting && now >= m.since + KILL_GRACE {
                report_unreaped(m, fx);
            }
            if desired == Desired::Stopped && !m.settings.attach {
                if process_gone {
                    set_phase(m, Phase::Stopped, now);
                    if held_is_demand(m, now, fx) {
                        start(m, now, fx);
                    }
                }
            } else if desired != Desired::Stopped && retry_at.is_some_and(|t| t <= now) {
                if !exiting {
                    start(m, now, fx);
                }
            } else if desired != Desired::Stopped && retry_at.is_none() {
                m.phase = Phase::Failed {
                    retry_at: Some(now + m.backoff()),
                    process_gone,
                };
            }
        }
        Phase::Awake => match desired {
            Desired::Awake => {}
            Desired::Suspended => {
                if m.in_flight() == 0 && m.held() == 0 {
                    begin_suspend(m, 0, now, fx);
                }
            }
            // Requests held for the model are served first: the proxies
            // release them on the `awake` this wake published. Sleeping at
            // once (an operator's sleep that came during the wake) held
            // them again, and an operator sleeping every few seconds kept
            // them from being served at all.
            Desired::Asleep(level) => {
                if m.in_flight() == 0 && m.held() == 0 {
                    begin_sleep(m, level, now, fx);
                }
            }
            Desired::Stopped if m.settings.attach => {
                if let Some(level) = deepest {
                    if m.in_flight() == 0 && m.held() == 0 {
                        begin_sleep(m, level, now, fx);
                    } else if m.retiring {
                        // Removed while serving: steady traffic would keep
                        // it awake for ever, its memory no longer counted.
                        let why = "removed from the configuration (siesta cannot stop an \
                                   attached engine: it sleeps)";
                        drain_then_sleep(m, level, why, now, fx);
                    }
                }
            }
            // An operator's stop lets answers under way finish. A tier's
            // or an eviction's is decided when nothing was in flight as the
            // proxies last reported; a request one forwarded since then is
            // answered before the SIGTERM (vLLM would end it with
            // `finish_reason: "abort"`, or take a new one and answer it
            // empty): the same fence, which takes one activity report.
            Desired::Stopped => drain(m, now, fx),
        },
        Phase::Asleep { level } => match desired {
            Desired::Awake => begin_wake(m, level, now, fx),
            // A sleeping engine is suspended as it is (less to copy); the
            // resume lands asleep at the same level.
            Desired::Suspended => {
                if m.in_flight() == 0 && m.held() == 0 {
                    begin_suspend(m, level, now, fx);
                }
            }
            // Deeper sleep: wake, then sleep again at the new level.
            Desired::Asleep(l) if l > level => begin_wake(m, level, now, fx),
            Desired::Asleep(_) => {}
            // A stop tier deepens an attached engine's sleep (a wake, then
            // the deepest sleep); a reload that removes it leaves it asleep.
            Desired::Stopped if m.settings.attach => {
                if deepest.is_some_and(|d| level < d) && !m.retiring {
                    begin_wake(m, level, now, fx);
                }
            }
            Desired::Stopped => terminate(m, now, fx),
        },
        Phase::Suspended { under } => match desired {
            Desired::Suspended => {}
            // Stopping a checkpointed process: SIGTERM, SIGKILL at the grace.
            Desired::Stopped if !m.settings.attach => terminate(m, now, fx),
            _ => begin_resume(m, under, now, fx),
        },
        // Every proxy confirmed; the engine's own gauge too.
        Phase::Yielding {
            level,
            drained: true,
            ..
        } if m.in_flight() == 0 => yield_sleep(m, level, now, fx),
        // A tier's or an eviction's stop still draining (no SIGTERM yet)
        // is called off by a request's demand: the engine still serves,
        // and the requests held under the proxies' fence are released at
        // the awake, not made to wait for a cold start. (Not a restart, a
        // reload's retirement or an operator's stop: demand does not turn
        // those.)
        Phase::Draining { .. }
            if desired == Desired::Awake
                && m.intent.reason == Reason::Demand
                && m.restart_asked.is_none()
                && !m.retiring =>
        {
            fx.push(Effect::Log(
                "stop called off before its SIGTERM: a request came; serving again".into(),
            ));
            super::step::become_awake(m, now);
        }
        // Still waiting for room, nothing asked of the engine yet: a sleep
        // at its level wanted now (an operator's) calls the wake off, the
        // engine left asleep and the room no longer asked for. Not with
        // requests held for it: they are served first. (The wake went on
        // once room came, against the operator's sleep, and one that found
        // none gave up after 5 minutes with an error.)
        Phase::Waking {
            from_level,
            admitted: false,
            ..
        } if matches!(desired, Desired::Asleep(l) if l <= from_level) && m.held() == 0 => {
            fx.push(Effect::Log(format!(
                "wake called off before it began (it waited for room): wanted asleep at level \
                 {from_level} now"
            )));
            set_phase(m, Phase::Asleep { level: from_level }, now);
        }
        Phase::Starting { .. }
        | Phase::Sleeping { .. }
        | Phase::Waking { .. }
        | Phase::Suspending { .. }
        | Phase::Resuming { .. }
        | Phase::Draining { .. }
        | Phase::Yielding { .. }
        | Phase::Stopping { .. } => {}
    }
}

/// Keeps the intent within what the engine kind can do (an intent restored
/// from before a config change, an eviction, a level the kind lacks): a
/// sleep it lacks becomes its deepest sleep, else a stop, else (an attached
/// engine that cannot sleep) staying awake.
fn fit_intent(m: &mut ModelState, fx: &mut Vec<Effect>) {
    let kind = m.settings.kind;
    if m.intent.desired == Desired::Suspended
        && !kind.can(crate::config::IdleAction::Suspend, m.settings.attach)
    {
        let fitted = match kind.deepest_sleep() {
            Some(l) => Desired::Asleep(l),
            None => Desired::Awake,
        };
        fx.push(Effect::Log(format!(
            "this engine = \"{kind}\" cannot be suspended: {fitted:?} instead"
        )));
        m.intent.desired = fitted;
        return;
    }
    let Desired::Asleep(level) = m.intent.desired else {
        return;
    };
    if kind.can_sleep(level) {
        return;
    }
    let fitted = match kind.deepest_sleep() {
        Some(l) => Desired::Asleep(l),
        None if m.settings.attach => Desired::Awake,
        None => Desired::Stopped,
    };
    fx.push(Effect::Log(format!(
        "engine = \"{kind}\" cannot sleep at level {level}: {fitted:?} instead"
    )));
    m.intent.desired = fitted;
}

/// The earliest time something must be re-checked.
pub(super) fn next_wakeup(m: &ModelState, now: Instant) -> Option<Instant> {
    let mut times = Vec::new();
    times.extend(m.phase.deadline());
    // A retry waiting for the failed engine's exit is woken by it (and
    // looks again once that exit is overdue, to say so).
    if let Phase::Failed {
        retry_at,
        process_gone,
    } = m.phase
    {
        if process_gone || m.settings.attach {
            times.extend(retry_at);
        } else if now < m.since + KILL_GRACE {
            times.push(m.since + KILL_GRACE);
        }
    }
    if let Pin::Until(t) = m.pin {
        times.push(t);
    }
    times.extend(m.stable_at);
    times.extend(m.proxies.values().map(|p| p.at + PROXY_STALE).min());
    if let Some((_, at)) = next_tier(m, now) {
        times.push(at);
    }
    times.into_iter().min()
}
