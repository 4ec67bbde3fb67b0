//! What the engine's process and its health probes report.

use super::*;

/// The engine of a start was spawned (`epoch`: the start's); one spawned for
/// a start no longer wanted is killed.
pub(super) fn spawned(
    m: &mut ModelState,
    proc_gen: u64,
    pid: u32,
    epoch: u64,
    now: Instant,
    fx: &mut Vec<Effect>,
) {
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

/// The engine's process exited: expected (stopping), seen after a failure
/// (its GPU memory is free now), or a failure, or vLLM's profiling race
/// (started again at once, a few times).
pub(super) fn child_exited(
    m: &mut ModelState,
    proc_gen: u64,
    status: String,
    cause: Option<String>,
    now: Instant,
    fx: &mut Vec<Effect>,
) {
    if proc_gen != m.proc_gen {
        return;
    }
    m.exited_gen = Some(proc_gen);
    m.pid = None;
    m.engine_running = 0;
    m.stable_at = None;
    match m.phase {
        // Draining, nothing is signalled yet: an engine that ends then with
        // an error (a non-zero status, a signal other than a SIGTERM)
        // crashed, and is failed as one (counted, backed off, its last
        // words in `last_error`). It was taken for stopped: a crashing
        // engine drained by the refused-probe path restarted at once,
        // leaving no trace. A clean end (status 0, or the SIGTERM someone
        // sent it) is a stop, as before.
        Phase::Draining { .. } if exited_with_error(&status) => {
            let error = match &cause {
                Some(cause) => format!("engine exited while draining ({status}): {cause}"),
                None => format!("engine exited while draining ({status})"),
            };
            fail(m, error, now, fx);
        }
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

/// An exit as the supervisor words it (std's `ExitStatus`: `exit status:
/// 1`, `signal: 9 (SIGKILL)`) that says the engine failed: a status other
/// than 0, or a signal other than the SIGTERM someone sent it (vLLM ends
/// on it). An exit not known (an adopted engine's) says nothing.
fn exited_with_error(status: &str) -> bool {
    if let Some(code) = status.strip_prefix("exit status: ") {
        return code != "0";
    }
    status
        .strip_prefix("signal: ")
        .is_some_and(|sig| sig.split(' ').next() != Some("15"))
}

/// `/health` answered: a start is done (serving, or found asleep).
pub(super) fn health_ok(
    m: &mut ModelState,
    asleep: Option<u8>,
    now: Instant,
    fx: &mut Vec<Effect>,
) {
    if let Phase::Starting { spawned: true, .. } = m.phase {
        let took = now.saturating_duration_since(m.transition_start);
        // An engine adopted mid-start began before this daemon did: the
        // time since its adoption is no start time (a false, short sample
        // made the proxies' estimates for held requests too short).
        let known = !std::mem::take(&mut m.start_time_unknown);
        if !m.settings.attach && known {
            m.calibration.start.add(took);
        }
        // Without it an operator's `siesta logs` showed the spawn
        // and then nothing: when the engine began to serve, and
        // how long its start took, were not to be read anywhere.
        let after = if known {
            format!("after {:.1} s", took.as_secs_f64())
        } else {
            format!("{:.1} s after its adoption", took.as_secs_f64())
        };
        fx.push(Effect::Log(match asleep {
            Some(level) => format!("ready {after}, found asleep at level {level}"),
            None => format!("ready {after}: serving"),
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

/// A periodic probe failed: one strike, forgiven while busy for a while;
/// refused with answers under way, the engine is shutting down.
pub(super) fn health_failed(
    m: &mut ModelState,
    error: String,
    timed_out: bool,
    refused: bool,
    now: Instant,
    fx: &mut Vec<Effect>,
) {
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
