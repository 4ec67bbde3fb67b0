//! Taking over an engine found running at start-up (see `recovery`).

use super::drive::terminate;
use super::step::{record_phase, set_phase};
use super::*;

/// What an adopted engine answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observed {
    Awake,
    Asleep(u8),
    /// Recorded as suspended (or being suspended) by the CUDA checkpoint
    /// helper, asleep at this level underneath (0: awake); never probed.
    Suspended(u8),
    /// Running but `/health` does not answer (still starting, or stuck).
    NotServing,
}

/// Puts a fresh state (intent already restored) on an engine found running
/// as process generation `proc_gen`; returns the effects to carry out. The
/// next event drives it towards the intent like any other engine.
pub fn adopt(
    m: &mut ModelState,
    proc_gen: u64,
    pid: u32,
    observed: Observed,
    now: Instant,
) -> Vec<Effect> {
    let mut fx = vec![Effect::Log(format!(
        "adopted the running engine, pid {pid} ({observed:?})"
    ))];
    m.proc_gen = proc_gen;
    m.pid = Some(pid);
    m.transition_start = now;
    m.engine_running = 0;
    // The idle clock goes on as recorded (restored with the history): the
    // engine was ready before this daemon started. A tier overdue by now
    // waits until its requests in flight are known.
    m.tiers_after = Some(now + PROXY_STALE);
    match observed {
        Observed::Awake => set_phase(m, Phase::Awake, now),
        Observed::Asleep(level) => set_phase(m, Phase::Asleep { level }, now),
        Observed::Suspended(under) => set_phase(m, Phase::Suspended { under }, now),
        Observed::NotServing if m.intent.desired == Desired::Stopped => terminate(m, now, &mut fx),
        Observed::NotServing => {
            m.start_time_unknown = true;
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
        }
    }
    // Recorded as `step` records a phase that begins: without it an engine
    // found asleep was never measured, and one whose sleep frees little (no
    // sleep mode) was counted at the default residual after a restart.
    record_phase(m, &mut fx);
    fx
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Backoff, Timeouts};

    fn fresh(desired: Desired) -> ModelState {
        let s = Duration::from_secs(5);
        let settings = Settings {
            attach: false,
            kind: crate::config::EngineKind::Vllm,
            tiers: vec![],
            timeouts: Timeouts {
                start: s,
                wake: s,
                sleep: s,
                stop_grace: s,
            },
            backoff: Backoff { initial: s, max: s },
        };
        let now = Instant::now();
        let mut m = ModelState::new(settings, crate::config::Preload::None, now);
        m.intent.desired = desired;
        m
    }

    /// A control plane down longer than a stop tier, while proxies kept
    /// serving an engine: adopted with its recorded idle clock, the tier is
    /// overdue, but what is in flight is known only once the proxies and
    /// the engine's gauge have reported. No tier fires before then (a stop
    /// tier signals at once: it cut the requests under way).
    #[test]
    fn an_overdue_tier_waits_until_the_adopted_engines_requests_are_known() {
        let t0 = Instant::now();
        let mut m = fresh(Desired::Awake);
        m.settings.tiers = vec![crate::config::IdleTier {
            after: Duration::from_secs(60),
            action: crate::config::IdleAction::Stop,
        }];
        // As restored: idle since long before the restart.
        m.idle_floor = t0;
        let now = t0 + Duration::from_secs(3600);
        adopt(&mut m, 1, 10, Observed::Awake, now);
        let (m, fx) = step(m, Event::Tick, now);
        assert_eq!(m.phase, Phase::Awake, "{fx:?}");
        assert!(
            !fx.iter().any(|f| matches!(f, Effect::Terminate { .. })),
            "{fx:?}"
        );
        // A proxy reports a request in flight a moment later: it is served.
        let report = |in_flight| Event::Activity {
            proxy: "p".into(),
            in_flight,
            held: 0,
            active: true,
            last_finished: None,
        };
        let (m, _) = step(m, report(1), now + Duration::from_millis(500));
        let (m, _) = step(m, Event::Tick, now + Duration::from_secs(30));
        assert_eq!(m.phase, Phase::Awake);
        // Once it is done and the tier's time has passed, the tier fires.
        let done = now + Duration::from_secs(40);
        let (m, _) = step(m, report(0), done);
        let later = done + Duration::from_secs(60);
        let (m, fx) = step(m, Event::Tick, later);
        assert!(
            matches!(m.phase, Phase::Draining { .. }),
            "{:?} {fx:?}",
            m.phase
        );
        // With nothing reported at all, it fires once the reports are due.
        let mut m = fresh(Desired::Awake);
        m.settings.tiers = vec![crate::config::IdleTier {
            after: Duration::from_secs(60),
            action: crate::config::IdleAction::Stop,
        }];
        m.idle_floor = t0;
        adopt(&mut m, 1, 10, Observed::Awake, now);
        let (m, fx) = step(m, Event::Tick, now);
        let wake = fx.iter().find_map(|f| match f {
            Effect::Timer(t) => *t,
            _ => None,
        });
        let settled = wake.expect("a timer for the settled tier");
        assert!(
            settled > now && settled <= now + PROXY_STALE,
            "{:?}",
            settled - now
        );
        let (m, _) = step(m, Event::Tick, settled);
        assert!(matches!(m.phase, Phase::Draining { .. }), "{:?}", m.phase);
    }

    #[test]
    fn an_asleep_engine_wanted_awake_is_woken_not_respawned() {
        let now = Instant::now();
        let mut m = fresh(Desired::Awake);
        adopt(&mut m, 7, 4242, Observed::Asleep(2), now);
        assert_eq!(m.phase, Phase::Asleep { level: 2 });
        let (m, fx) = step(m, Event::Tick, now);
        assert!(matches!(m.phase, Phase::Waking { from_level: 2, .. }));
        assert!(!fx.iter().any(|f| matches!(f, Effect::Spawn { .. })));
        assert_eq!((m.pid, m.proc_gen), (Some(4242), 7));
    }

    /// An engine adopted asleep was never measured (the residual lives
    /// in memory only) nor its level recorded: one whose sleep frees little
    /// was counted at the default residual after a restart.
    #[test]
    fn an_engine_adopted_asleep_is_measured_and_its_level_recorded() {
        let now = Instant::now();
        let mut m = fresh(Desired::Asleep(1));
        let fx = adopt(&mut m, 1, 10, Observed::Asleep(1), now);
        let (m, more) = step(m, Event::Tick, now);
        assert_eq!(m.phase, Phase::Asleep { level: 1 });
        let all: Vec<_> = fx.iter().chain(&more).collect();
        assert!(all.contains(&&Effect::MeasureResidual), "{all:?}");
        assert!(all.contains(&&Effect::RecordSleepLevel(1)), "{all:?}");
        let mut m = fresh(Desired::Awake);
        let fx = adopt(&mut m, 1, 10, Observed::Awake, now);
        assert!(fx.contains(&Effect::RecordSleepLevel(0)), "{fx:?}");
        assert!(!fx.contains(&Effect::MeasureResidual), "{fx:?}");
    }

    /// An engine adopted before it served: the time from its adoption to
    /// its first answer was taken as its start time (0.8 s for a start of a
    /// minute), and saved.
    #[test]
    fn an_engine_adopted_mid_start_gives_no_start_time() {
        let now = Instant::now();
        let mut m = fresh(Desired::Awake);
        adopt(&mut m, 1, 10, Observed::NotServing, now);
        let epoch = m.epoch;
        let ready = Event::HealthOk {
            epoch,
            asleep: None,
        };
        let (m, fx) = step(m, ready, now + Duration::from_secs(1));
        assert_eq!(m.phase, Phase::Awake);
        assert_eq!(m.calibration.start.samples, 0, "{fx:?}");
        assert!(!fx.contains(&Effect::PersistCalibration), "{fx:?}");
        assert!(
            fx.iter().any(
                |f| matches!(f, Effect::Log(l) if l.contains("1.0 s after its adoption: serving"))
            ),
            "{fx:?}"
        );
        // Its next start is one siesta spawned: timed.
        assert!(!m.start_time_unknown);
    }

    #[test]
    fn a_starting_engine_is_probed_and_a_stopped_intent_stops_it() {
        let now = Instant::now();
        let mut m = fresh(Desired::Awake);
        let fx = adopt(&mut m, 1, 10, Observed::NotServing, now);
        assert!(matches!(m.phase, Phase::Starting { spawned: true, .. }));
        assert!(fx.contains(&Effect::ProbeHealth {
            epoch: m.epoch,
            check_sleep: true
        }));
        let epoch = m.epoch;
        let (m, _) = step(
            m,
            Event::HealthOk {
                epoch,
                asleep: None,
            },
            now,
        );
        assert_eq!(m.phase, Phase::Awake);

        let mut m = fresh(Desired::Stopped);
        let fx = adopt(&mut m, 1, 10, Observed::NotServing, now);
        assert!(matches!(m.phase, Phase::Stopping { .. }));
        assert!(fx.iter().any(|f| matches!(f, Effect::Terminate { .. })));
        // An engine that exits is seen as stopped, not as a crash.
        let (m, _) = step(
            m,
            Event::ChildExited {
                proc_gen: 1,
                status: "gone".into(),
                cause: None,
            },
            now,
        );
        assert_eq!(m.phase, Phase::Stopped);
    }

    #[test]
    fn an_awake_engine_wanted_asleep_is_put_to_sleep() {
        let now = Instant::now();
        let mut m = fresh(Desired::Asleep(1));
        adopt(&mut m, 1, 10, Observed::Awake, now);
        let (m, fx) = step(m, Event::Tick, now);
        assert!(matches!(m.phase, Phase::Sleeping { level: 1, .. }));
        assert!(
            fx.iter()
                .any(|f| matches!(f, Effect::Sleep { level: 1, .. }))
        );
    }
}
