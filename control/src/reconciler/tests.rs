//! Transition tests (pure; time is passed in).

use super::*;
use crate::config::{IdleAction, IdleTier};

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn settings(attach: bool) -> Settings {
    Settings {
        attach,
        kind: crate::config::EngineKind::Vllm,
        tiers: vec![
            IdleTier {
                after: secs(10),
                action: IdleAction::Sleep(1),
            },
            IdleTier {
                after: secs(20),
                action: IdleAction::Sleep(2),
            },
            IdleTier {
                after: secs(30),
                action: IdleAction::Stop,
            },
        ],
        timeouts: Timeouts {
            start: secs(60),
            wake: secs(5),
            sleep: secs(5),
            stop_grace: secs(3),
        },
        backoff: Backoff {
            initial: secs(1),
            max: secs(8),
        },
    }
}

struct Sim {
    m: ModelState,
    now: Instant,
    fx: Vec<Effect>,
}

impl Sim {
    fn new(preload: Preload) -> Self {
        let now = Instant::now();
        let mut s = Sim {
            m: ModelState::new(settings(false), preload, now),
            now,
            fx: vec![],
        };
        s.ev(Event::Tick);
        s
    }
    /// An attached engine (not spawned), first probe under way.
    fn attached() -> Self {
        let now = Instant::now();
        let mut s = Sim {
            m: ModelState::new(settings(true), Preload::None, now),
            now,
            fx: vec![],
        };
        s.ev(Event::Tick);
        s
    }
    fn ev(&mut self, e: Event) -> &[Effect] {
        let (m, fx) = step(self.m.clone(), e, self.now);
        self.m = m;
        self.fx = fx;
        &self.fx
    }
    fn advance(&mut self, d: Duration) {
        self.now += d;
        self.ev(Event::Tick);
    }
    /// Proxy "p" reports `in_flight` and `held` requests.
    fn report(&mut self, in_flight: u32, held: u32) -> &[Effect] {
        self.ev(Event::Activity {
            proxy: "p".into(),
            in_flight,
            held,
            active: true,
            last_finished: None,
        })
    }
    /// The stop asked the runner for SIGTERM, and the runner (past its
    /// wait for starts on the GPUs) sent it.
    fn term_sent(&mut self) {
        assert!(self.has(|f| matches!(f, Effect::Terminate { .. })));
        assert!(matches!(self.m.phase, Phase::Stopping { .. }));
        self.ev(Event::FreeBegan {
            epoch: self.m.epoch,
        });
    }

    fn has(&self, f: impl Fn(&Effect) -> bool) -> bool {
        self.fx.iter().any(f)
    }
    fn timer(&self) -> Option<Instant> {
        self.fx.iter().find_map(|f| match f {
            Effect::Timer(t) => *t,
            _ => None,
        })
    }
    /// Drives spawn + health to Awake.
    fn boot(&mut self) {
        self.ev(Event::Spawned {
            proc_gen: self.m.proc_gen,
            pid: 42,
        });
        assert!(self.has(|f| matches!(f, Effect::ProbeHealth { .. })));
        self.now += secs(2);
        self.ev(Event::HealthOk {
            epoch: self.m.epoch,
            asleep: None,
        });
    }
    /// Booted asleep at level 1, no idle tiers.
    fn asleep_without_tiers() -> Self {
        let mut s = Sim::new(Preload::Asleep);
        s.m.settings.tiers.clear();
        s.boot();
        s.ev(Event::SleepDone { epoch: s.m.epoch });
        s
    }
    /// A wake (or start) waiting for room on its GPUs.
    fn waiting_for_room(&self) -> bool {
        matches!(
            self.m.phase,
            Phase::Waking {
                admitted: false,
                ..
            } | Phase::Starting {
                admitted: false,
                ..
            }
        )
    }
    /// From asleep at level 1 to level 2: a wake, then a sleep.
    fn sleep_to_level_2(&mut self) {
        self.ev(Event::Command(Command::Sleep(2)));
        self.ev(Event::Admitted {
            epoch: self.m.epoch,
        });
        self.wake_all();
        self.ev(Event::FreeBegan {
            epoch: self.m.epoch,
        });
        self.ev(Event::SleepDone {
            epoch: self.m.epoch,
        });
        assert_eq!(self.m.phase, Phase::Asleep { level: 2 }, "{:?}", self.m);
    }
    fn wake_all(&mut self) {
        while let Phase::Waking { step, .. } = self.m.phase {
            self.ev(Event::WakeBegan {
                epoch: self.m.epoch,
                step,
            });
            self.ev(Event::WakeStepDone {
                epoch: self.m.epoch,
                step,
            });
        }
    }
}

#[test]
fn start_to_awake_and_calibrates() {
    let mut s = Sim::new(Preload::None);
    assert_eq!(s.m.phase, Phase::Stopped);
    s.ev(Event::Demand);
    assert!(s.has(|f| matches!(f, Effect::Spawn { .. })));
    s.boot();
    assert_eq!(s.m.phase, Phase::Awake);
    assert_eq!(s.m.calibration.start.millis(), 2000);
    // The operator's log says when it began to serve and how long it took.
    assert!(
        s.has(|f| matches!(f, Effect::Log(l) if l == "ready after 2.0 s: serving")),
        "{:?}",
        s.fx
    );
    assert_eq!(s.m.restarts, 1);
}

/// vLLM fails a start whose GPU's free memory grew while it profiled (a
/// neighbour crashed, or a process siesta does not run ended): that cause
/// is gone once the memory is free, so the start is made again at once,
/// still `starting` (held requests stay held; a failed model's would be
/// answered 503), up to `PROFILE_RETRIES` times in a row; other exits fail.
#[test]
fn a_start_failed_by_memory_freed_while_profiling_is_made_again_at_once() {
    let profiling = "AssertionError: Error in memory profiling. Initial free memory 44.00 GiB, \
                     current free memory 79.00 GiB.";
    let mut s = Sim::new(Preload::None);
    s.ev(Event::Demand);
    for round in 1..=PROFILE_RETRIES + 1 {
        let spawned = s.m.proc_gen;
        s.ev(Event::Admitted { epoch: s.m.epoch });
        s.ev(Event::Spawned {
            proc_gen: spawned,
            pid: 42,
        });
        s.now += secs(1);
        s.ev(Event::ChildExited {
            proc_gen: spawned,
            status: "exit status: 1".into(),
            cause: Some(profiling.into()),
        });
        if round <= PROFILE_RETRIES {
            assert!(
                matches!(s.m.phase, Phase::Starting { spawned: false, .. }),
                "round {round}: {:?}",
                s.m.phase
            );
            assert!(
                s.has(|f| matches!(f, Effect::Spawn { proc_gen, .. } if *proc_gen == spawned + 1))
            );
            assert!(s.has(|f| matches!(f, Effect::ReleaseStartLock)));
            assert_eq!(s.m.failures, 0);
            assert!(
                s.m.last_error
                    .as_deref()
                    .unwrap()
                    .contains("memory profiling")
            );
        } else {
            assert!(matches!(s.m.phase, Phase::Failed { .. }), "{:?}", s.m.phase);
            assert_eq!(s.m.failures, 1);
        }
    }
    // After the backoff, the next start may be made anew at once again.
    s.advance(secs(1));
    assert!(
        matches!(s.m.phase, Phase::Starting { .. }),
        "{:?}",
        s.m.phase
    );
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit status: 1".into(),
        cause: Some(profiling.into()),
    });
    assert!(
        matches!(s.m.phase, Phase::Starting { .. }),
        "{:?}",
        s.m.phase
    );
    // Once an engine has come up, the count starts again.
    let mut s = Sim::new(Preload::None);
    s.ev(Event::Demand);
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit status: 1".into(),
        cause: Some(profiling.into()),
    });
    assert_eq!(s.m.profile_races, 1);
    s.boot();
    assert_eq!((s.m.phase, s.m.profile_races), (Phase::Awake, 0));
    // Any other cause fails the start as before.
    let mut s = Sim::new(Preload::None);
    s.ev(Event::Demand);
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit status: 1".into(),
        cause: Some("ValueError: Free memory on device cuda:0 (2.0/79.1 GiB)".into()),
    });
    assert!(matches!(s.m.phase, Phase::Failed { .. }), "{:?}", s.m.phase);
}

#[test]
fn preload_asleep_starts_then_sleeps_level_1() {
    let mut s = Sim::new(Preload::Asleep);
    assert!(matches!(s.m.phase, Phase::Starting { .. }));
    s.boot();
    assert!(s.has(|f| matches!(f, Effect::Sleep { level: 1, .. })));
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
}

#[test]
fn tiers_fire_in_order() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    assert_eq!(s.timer(), Some(s.now + secs(10)));
    s.advance(secs(10));
    assert!(s.has(|f| matches!(f, Effect::Sleep { level: 1, .. })));
    assert_eq!(s.m.intent.reason, Reason::IdleTier);
    // Said in words in the model's log (it read `Asleep(1)`).
    assert!(
        s.has(
            |f| matches!(f, Effect::Log(l) if l == "idle tier fired after 10s: asleep at level 1")
        ),
        "{:?}",
        s.fx
    );
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert_eq!(s.timer(), Some(s.m.idle_floor + secs(20)));
    s.advance(secs(10));
    // Level 1 -> 2: wake then sleep at level 2.
    assert!(s.has(|f| matches!(
        f,
        Effect::Wake {
            call: WakeCall::WakeUp,
            ..
        }
    )));
    s.wake_all();
    assert!(s.has(|f| matches!(f, Effect::Sleep { level: 2, .. })));
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Asleep { level: 2 });
    s.advance(secs(10));
    assert!(s.has(|f| matches!(f, Effect::Terminate { .. })));
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit 0".into(),
        cause: None,
    });
    assert_eq!(s.m.phase, Phase::Stopped);
    assert_eq!(s.timer(), None);
}

#[test]
fn never_sleeps_with_requests_in_flight() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    // A long request: the proxy re-reports it (every second) while it runs.
    for _ in 0..20 {
        s.ev(Event::Activity {
            proxy: "p".into(),
            in_flight: 1,
            held: 0,
            active: false,
            last_finished: None,
        });
        s.advance(secs(5));
        assert_eq!(s.m.phase, Phase::Awake);
    }
    assert_eq!(s.m.in_flight(), 1);
    // The engine's own gauge counts too.
    s.ev(Event::Activity {
        proxy: "p".into(),
        in_flight: 0,
        held: 0,
        active: true,
        last_finished: Some(s.now),
    });
    s.ev(Event::EngineMetrics { running: 2 });
    s.advance(secs(100));
    assert_eq!(s.m.phase, Phase::Awake);
    // Operator sleep waits for in-flight requests too.
    s.ev(Event::Command(Command::Sleep(1)));
    assert_eq!(s.m.phase, Phase::Awake);
    s.ev(Event::EngineMetrics { running: 0 });
    assert!(matches!(s.m.phase, Phase::Sleeping { level: 1, .. }));
}

/// A proxy whose clock lags control's by a minute reports steady short
/// requests as finished a minute ago: the idle clock took its word, and
/// the 10 s sleep tier fired while requests kept coming.
#[test]
fn a_proxy_whose_clock_lags_does_not_make_a_busy_model_idle() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    for _ in 0..12 {
        s.advance(secs(5));
        s.ev(Event::Activity {
            proxy: "p".into(),
            in_flight: 0,
            held: 0,
            active: true,
            last_finished: Some(s.now - secs(60)),
        });
        assert_eq!(s.m.phase, Phase::Awake, "{:?}", s.fx);
    }
    // Once the requests stop, the tier fires as before.
    s.advance(secs(11));
    assert!(matches!(s.m.phase, Phase::Sleeping { level: 1, .. }));
}

#[test]
fn level_2_wake_is_four_calls_in_order() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.ev(Event::Command(Command::Sleep(2)));
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    s.ev(Event::Demand);
    let mut calls = vec![];
    while let Phase::Waking { step, .. } = s.m.phase {
        calls.extend(s.fx.iter().filter_map(|f| match f {
            Effect::Wake { call, .. } => Some(*call),
            _ => None,
        }));
        s.ev(Event::WakeStepDone {
            epoch: s.m.epoch,
            step,
        });
    }
    assert_eq!(calls, wake_calls(crate::config::EngineKind::Vllm, 2));
    assert_eq!(s.m.phase, Phase::Awake);
    assert_eq!(s.m.calibration.wake[1].samples, 1);
}

#[test]
fn every_transition_has_a_deadline() {
    // Start.
    let mut s = Sim::new(Preload::Awake);
    s.ev(Event::Spawned {
        proc_gen: s.m.proc_gen,
        pid: 1,
    });
    assert_eq!(s.timer(), Some(s.now + secs(60)));
    s.advance(secs(60));
    assert!(matches!(s.m.phase, Phase::Failed { .. }));
    assert!(s.has(|f| matches!(f, Effect::Kill)));
    // Wake.
    let mut s = Sim::new(Preload::Asleep);
    s.boot();
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    s.ev(Event::Demand);
    s.ev(Event::Admitted { epoch: s.m.epoch });
    // From when the engine is called (a neighbour's sleep on its GPUs
    // before that has its own bound).
    assert_eq!(s.timer(), Some(s.now + first_call_wait(secs(5)) + secs(5)));
    s.ev(Event::WakeBegan {
        epoch: s.m.epoch,
        step: 0,
    });
    s.advance(secs(5));
    assert!(matches!(s.m.phase, Phase::Failed { .. }));
    assert!(s.has(|f| matches!(f, Effect::Kill)));
    // Sleep: from when the engine is asked (the wait for starts on its
    // GPUs before that has its own bound).
    let mut s = Sim::new(Preload::Asleep);
    s.boot();
    assert_eq!(s.timer(), Some(s.now + ROOM_WAIT + secs(5)));
    s.ev(Event::FreeBegan { epoch: s.m.epoch });
    s.advance(secs(5));
    assert!(matches!(s.m.phase, Phase::Failed { .. }));
    // Stop: drain (one grace at most), TERM, grace, KILL.
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.ev(Event::Command(Command::Stop));
    assert!(matches!(s.m.phase, Phase::Draining { .. }));
    assert_eq!(s.timer(), Some(s.now + secs(3)));
    s.advance(secs(3));
    // SIGTERM once no engine starts on its GPUs (that wait has its own
    // bound), then one grace.
    assert!(s.has(|f| matches!(f, Effect::Terminate { .. })));
    assert_eq!(s.timer(), Some(s.now + ROOM_WAIT + secs(3)));
    s.advance(secs(2));
    s.ev(Event::FreeBegan { epoch: s.m.epoch });
    assert_eq!(s.timer(), Some(s.now + secs(3)));
    s.advance(secs(3));
    assert!(s.has(|f| matches!(f, Effect::Kill)));
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "killed".into(),
        cause: None,
    });
    assert_eq!(s.m.phase, Phase::Stopped);
}

/// A sleep may wait for an engine starting on its GPUs (the runner's
/// `FreeBegan` ends the wait): its deadline allows that wait, then counts
/// from `FreeBegan`, as its calibration does. A demand meanwhile does not
/// undo it (the engine may be asked already): it wakes once asleep.
#[test]
fn a_sleep_that_waits_for_a_start_counts_its_time_from_when_it_began() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.advance(secs(10));
    assert!(matches!(s.m.phase, Phase::Sleeping { level: 1, .. }));
    assert_eq!(s.timer(), Some(s.now + ROOM_WAIT + secs(5)));
    s.now += secs(100);
    s.ev(Event::Demand);
    assert!(
        matches!(s.m.phase, Phase::Sleeping { .. }),
        "{:?}",
        s.m.phase
    );
    assert!(!s.has(|f| matches!(f, Effect::Wake { .. })));
    s.ev(Event::FreeBegan { epoch: s.m.epoch });
    assert_eq!(s.timer(), Some(s.now + secs(5)));
    assert_eq!(s.m.transition_start, s.now);
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert!(matches!(s.m.phase, Phase::Waking { .. }), "{:?}", s.m.phase);
}

/// A stop tier is decided when nothing was in flight as the proxies last
/// reported, but one may have forwarded a request since: the SIGTERM waits
/// for the same fence as an operator's stop (vLLM ends a request its
/// SIGTERM catches with `finish_reason: "abort"`, and answers one that
/// arrives then empty). A request held meanwhile starts it again.
#[test]
fn a_stop_tier_waits_for_the_proxies_fence_before_the_sigterm() {
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers = vec![IdleTier {
        after: secs(30),
        action: IdleAction::Stop,
    }];
    s.boot();
    s.advance(secs(31));
    assert!(
        matches!(s.m.phase, Phase::Draining { .. }),
        "{:?}",
        s.m.phase
    );
    assert_eq!(
        (s.m.intent.desired, s.m.intent.reason),
        (Desired::Stopped, Reason::IdleTier)
    );
    assert!(s.has(|f| matches!(f, Effect::Drain { epoch } if *epoch == s.m.epoch)));
    assert!(!s.has(|f| matches!(f, Effect::Terminate { .. } | Effect::Kill)));
    assert!(s.has(|f| matches!(f, Effect::Log(l) if l.contains("once every proxy confirms"))));
    // A proxy that saw `stopping` holds a new request.
    s.report(0, 1);
    assert!(!s.has(|f| matches!(f, Effect::Terminate { .. } | Effect::Kill)));
    s.ev(Event::Drained {
        epoch: s.m.epoch,
        error: None,
    });
    s.term_sent();
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit 0".into(),
        cause: None,
    });
    assert!(
        matches!(s.m.phase, Phase::Starting { .. }),
        "{:?}",
        s.m.phase
    );
}

#[test]
fn operator_stop_and_restart_let_requests_in_flight_finish() {
    // Stop: published as stopping; SIGTERM once the proxies have drained.
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.ev(Event::Command(Command::Stop));
    assert!(matches!(s.m.phase, Phase::Draining { .. }));
    assert!(s.has(|f| matches!(f, Effect::Drain { epoch } if *epoch == s.m.epoch)));
    assert!(!s.has(|f| matches!(f, Effect::Terminate { .. } | Effect::Kill)));
    let epoch = s.m.epoch;
    s.ev(Event::Drained {
        epoch: epoch - 1,
        error: None,
    });
    assert!(matches!(s.m.phase, Phase::Draining { .. }), "stale answer");
    s.now += secs(1);
    s.ev(Event::Drained { epoch, error: None });
    assert!(s.has(|f| matches!(f, Effect::Terminate { .. })));
    assert!(matches!(s.m.phase, Phase::Stopping { killed: false, .. }));
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit 0".into(),
        cause: None,
    });
    assert_eq!(s.m.phase, Phase::Stopped);
    // Restart: the same drain (a proxy that did not confirm in time is
    // named in the log), then a fresh start.
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    let proc_gen = s.m.proc_gen;
    s.ev(Event::Command(Command::Restart));
    assert!(matches!(s.m.phase, Phase::Draining { .. }));
    assert!(!s.has(|f| matches!(f, Effect::Terminate { .. } | Effect::Kill)));
    s.ev(Event::Drained {
        epoch: s.m.epoch,
        error: Some("proxy p has 1 request(s) in flight".into()),
    });
    assert!(s.has(|f| matches!(f, Effect::Log(l) if l.contains("stopping anyway: proxy p"))));
    assert!(s.has(|f| matches!(f, Effect::Terminate { .. })));
    s.ev(Event::ChildExited {
        proc_gen,
        status: "exit 0".into(),
        cause: None,
    });
    assert!(s.has(|f| matches!(f, Effect::Spawn { .. })));
    // The engine exiting on its own and cleanly while draining: stopped,
    // not failed (as the supervisor words it).
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.ev(Event::Command(Command::Stop));
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit status: 0".into(),
        cause: None,
    });
    assert_eq!(s.m.phase, Phase::Stopped);
    assert_eq!(s.m.last_error, None);
}

#[test]
fn a_model_retired_by_a_reload_drains_and_stays_stopped() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.ev(Event::Retire);
    assert!(matches!(s.m.phase, Phase::Draining { .. }));
    assert!(s.has(|f| matches!(f, Effect::Drain { .. })));
    // Neither demand nor an operator brings it back while it leaves.
    s.ev(Event::Demand);
    s.ev(Event::Command(Command::Wake));
    assert!(matches!(s.m.phase, Phase::Draining { .. }));
    assert_eq!(s.m.intent.desired, Desired::Stopped);
    s.ev(Event::Drained {
        epoch: s.m.epoch,
        error: None,
    });
    assert!(s.has(|f| matches!(f, Effect::Terminate { .. })));
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit 0".into(),
        cause: None,
    });
    s.ev(Event::Demand);
    assert_eq!(s.m.phase, Phase::Stopped);
    assert!(!s.has(|f| matches!(f, Effect::Spawn { .. })));
    // Asleep: stopped at once (nothing can be in flight).
    let mut s = Sim::new(Preload::Asleep);
    s.boot();
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    s.ev(Event::Retire);
    assert!(matches!(s.m.phase, Phase::Stopping { .. }));
}

/// A reload retires an attached engine while siesta first probes it, and
/// the probe finds it asleep at level 1: it is left asleep, its
/// retirement the last word. Its old idle tiers no longer apply (before,
/// its level-2 tier fired on an engine no longer configured, replacing the
/// reload's intent with the tier's).
#[test]
fn an_attached_engine_retired_is_not_moved_by_its_old_tiers() {
    let mut s = Sim::attached();
    s.ev(Event::Retire);
    s.ev(Event::HealthOk {
        epoch: s.m.epoch,
        asleep: Some(1),
    });
    assert!(
        s.has(|f| matches!(f, Effect::Log(l) if l.starts_with("ready after") && l.ends_with("found asleep at level 1"))),
        "{:?}",
        s.fx
    );
    let intent = s.m.intent;
    assert_eq!(intent.reason, Reason::Config, "{intent:?}");
    for _ in 0..6 {
        s.advance(secs(10));
        assert_eq!(s.m.intent, intent, "{:?}", s.fx);
    }
}

/// A reload removes an attached engine a tier put to sleep at level 1: it
/// is left asleep. Its retirement wanted it "stopped", which for an
/// attached engine is a stop tier's deepest sleep: a wake first, which
/// took GPU memory back for an engine no longer configured (its task ends
/// right after, cutting the wake or the sleep after it).
#[test]
fn an_attached_engine_retired_asleep_is_left_asleep() {
    let mut s = Sim::attached();
    s.ev(Event::HealthOk {
        epoch: s.m.epoch,
        asleep: None,
    });
    s.advance(secs(10));
    assert!(matches!(s.m.phase, Phase::Sleeping { level: 1, .. }));
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    s.ev(Event::Retire);
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 }, "{:?}", s.fx);
    assert!(!s.has(|f| matches!(f, Effect::Wake { .. })), "{:?}", s.fx);
}

/// An attached engine removed by a reload while it serves steady traffic
/// stops taking new requests (published as not serving, so proxies hold
/// them), lets those in flight finish, then sleeps. It stayed awake and
/// routed before, never idle, so its sleep never came, and once removed
/// nothing counted the GPU memory it held.
#[test]
fn an_attached_engine_retired_while_serving_drains_then_sleeps() {
    let mut s = Sim::attached();
    s.ev(Event::HealthOk {
        epoch: s.m.epoch,
        asleep: None,
    });
    s.report(1, 0);
    assert_eq!(s.m.phase, Phase::Awake);
    s.ev(Event::Retire);
    assert!(
        matches!(s.m.phase, Phase::Yielding { .. }),
        "{:?}",
        s.m.phase
    );
    assert!(s.has(|f| matches!(f, Effect::Drain { .. })), "{:?}", s.fx);
    s.ev(Event::Drained {
        epoch: s.m.epoch,
        error: None,
    });
    s.report(0, 0);
    assert!(
        matches!(s.m.phase, Phase::Sleeping { .. }),
        "{:?}",
        s.m.phase
    );
}

/// An attached engine found serving after a restart of siesta goes on
/// with its recorded idle clock; a tier overdue by then waits until the
/// proxies and its gauge have said what is in flight, as for an adopted
/// engine.
#[test]
fn an_attached_engine_found_serving_waits_for_reports_before_an_overdue_tier() {
    let mut s = Sim::attached();
    s.m.recorded_floor = Some(s.now);
    s.now += secs(3600);
    s.ev(Event::HealthOk {
        epoch: s.m.epoch,
        asleep: None,
    });
    assert_eq!(s.m.phase, Phase::Awake);
    assert!(!s.has(|f| matches!(f, Effect::Sleep { .. })), "{:?}", s.fx);
    let at = s.timer().expect("a timer for the tier");
    assert!(at > s.now && at <= s.now + PROXY_STALE, "{:?}", at - s.now);
    s.now = at;
    s.ev(Event::Tick);
    assert!(
        matches!(s.m.phase, Phase::Sleeping { .. }),
        "{:?}",
        s.m.phase
    );
}

/// The spawn under way fails; returns the backoff before the next try.
fn spawn_fails(s: &mut Sim) -> Duration {
    s.ev(Event::SpawnFailed {
        proc_gen: s.m.proc_gen,
        error: "nope".into(),
    });
    let Phase::Failed {
        retry_at: Some(t), ..
    } = s.m.phase
    else {
        panic!("{:?}", s.m.phase)
    };
    t - s.now
}

#[test]
fn backoff_doubles_and_is_capped() {
    let mut s = Sim::new(Preload::Awake);
    // No stop tier to end the retries (see `failed::a_failing_model_nobody_waits_for_is_stopped_by_its_stop_tier`).
    s.m.settings.tiers.clear();
    let mut delays = vec![];
    for _ in 0..6 {
        let wait = spawn_fails(&mut s);
        delays.push(wait.as_secs());
        s.advance(wait);
        assert!(matches!(s.m.phase, Phase::Starting { .. }));
    }
    assert_eq!(delays, [1, 2, 4, 8, 8, 8]);
    s.m.settings.tiers.clear();
    s.boot();
    assert_eq!(s.m.last_error, None);
    // Forgotten once it has stayed up a while.
    assert_eq!(s.m.failures, 6);
    assert_eq!(s.timer(), Some(s.now + STABLE_AFTER));
    s.advance(STABLE_AFTER);
    assert_eq!(s.m.failures, 0);
}

/// An operator's start (or wake, or restart) is a fresh attempt: the
/// failures before it are forgotten, and a failure after it is retried
/// after `backoff_initial`, not after the cap the earlier ones reached.
#[test]
fn an_operators_start_forgets_the_failures_before_it() {
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers.clear();
    for _ in 0..5 {
        let wait = spawn_fails(&mut s);
        s.advance(wait);
    }
    assert_eq!(s.m.failures, 5);
    s.ev(Event::Command(Command::Stop));
    s.ev(Event::Command(Command::Start));
    assert_eq!(s.m.failures, 0);
    s.advance(secs(0));
    assert!(
        matches!(s.m.phase, Phase::Starting { .. }),
        "{:?}",
        s.m.phase
    );
    assert_eq!(
        spawn_fails(&mut s),
        secs(1),
        "backed off as the sixth failure in a row"
    );
}

/// An engine that dies soon after it became ready (out of memory on its
/// first request) backs off like one that never came up; its failures are
/// forgotten only once it has stayed up a while. (They were forgotten when
/// it became ready: restarted every start time plus a second, for ever.)
#[test]
fn a_crash_soon_after_ready_backs_off_and_a_long_run_forgets_failures() {
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers.clear();
    let crash = |s: &mut Sim| {
        s.ev(Event::ChildExited {
            proc_gen: s.m.proc_gen,
            status: "signal: 9 (SIGKILL)".into(),
            cause: None,
        });
        let Phase::Failed {
            retry_at: Some(t), ..
        } = s.m.phase
        else {
            panic!("{:?}", s.m.phase)
        };
        t - s.now
    };
    let mut delays = vec![];
    for _ in 0..5 {
        s.boot();
        assert_eq!(s.m.phase, Phase::Awake);
        s.now += secs(1);
        let delay = crash(&mut s);
        delays.push(delay.as_secs());
        s.advance(delay);
        assert!(matches!(s.m.phase, Phase::Starting { .. }), "{:?}", s.m);
    }
    assert_eq!(delays, [1, 2, 4, 8, 8]);
    // Up (awake, then asleep) as long as `STABLE_AFTER`: forgotten.
    s.boot();
    s.advance(secs(30));
    s.ev(Event::Command(Command::Sleep(1)));
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    s.advance(STABLE_AFTER - secs(31));
    assert_eq!(s.m.failures, 5);
    s.advance(secs(1));
    assert_eq!(s.m.failures, 0, "{:?}", s.fx);
    s.advance(secs(600));
    assert_eq!(crash(&mut s), secs(1));
}

#[test]
fn crash_goes_failed_then_restarts() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit 1".into(),
        cause: None,
    });
    assert!(matches!(
        s.m.phase,
        Phase::Failed {
            retry_at: Some(_),
            ..
        }
    ));
    assert!(s.m.last_error.as_deref().unwrap().contains("exit 1"));
    // In seconds, not `Some(1s)`.
    assert!(
        s.has(|f| matches!(f, Effect::Log(l) if l.ends_with("; retry in 1.0 s"))),
        "{:?}",
        s.fx
    );
    s.advance(secs(1));
    assert!(s.has(|f| matches!(f, Effect::Spawn { .. })));
    // An exit of the old process is ignored.
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen - 1,
        status: "late".into(),
        cause: None,
    });
    assert!(matches!(s.m.phase, Phase::Starting { .. }));
}

/// An engine that exits on its own says why in `last_error`: the exception
/// its output ended with (here vLLM's for too little free GPU memory at
/// start-up). An engine siesta stopped is not failed, whatever it printed.
#[test]
fn an_engine_that_exits_says_why_in_last_error() {
    let cause = "ValueError: Free memory on device cuda:0 (2.0/139.8 GiB) on startup is less \
                 than desired GPU memory utilization (0.5, 69.9 GiB).";
    let mut s = Sim::new(Preload::Awake);
    s.ev(Event::Spawned {
        proc_gen: s.m.proc_gen,
        pid: 42,
    });
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit status: 1".into(),
        cause: Some(cause.into()),
    });
    assert!(matches!(s.m.phase, Phase::Failed { .. }), "{:?}", s.m.phase);
    assert_eq!(
        s.m.last_error.as_deref(),
        Some(&*format!(
            "engine exited unexpectedly (exit status: 1): {cause}"
        ))
    );

    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.ev(Event::Command(Command::Stop));
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit status: 0".into(),
        cause: Some("RuntimeError: cancelled".into()),
    });
    assert_eq!(s.m.phase, Phase::Stopped);
    assert_eq!(s.m.last_error, None);
}

#[test]
fn demands_coalesce_and_operator_stop_wins() {
    let mut s = Sim::new(Preload::None);
    s.ev(Event::Demand);
    let spawns =
        s.fx.iter()
            .filter(|f| matches!(f, Effect::Spawn { .. }))
            .count();
    for _ in 0..5 {
        s.ev(Event::Demand);
        assert!(!s.has(|f| matches!(f, Effect::Spawn { .. })));
    }
    assert_eq!(spawns, 1);
    s.boot();
    s.ev(Event::Command(Command::Stop));
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "0".into(),
        cause: None,
    });
    s.ev(Event::Demand);
    assert_eq!(s.m.phase, Phase::Stopped);
    assert_eq!(s.m.intent.reason, Reason::Operator);
}

#[test]
fn pin_blocks_tiers_until_it_expires() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.ev(Event::Pin(Some(s.now + secs(100))));
    assert_eq!(s.timer(), Some(s.now + secs(100)));
    s.advance(secs(50));
    assert_eq!(s.m.phase, Phase::Awake);
    s.advance(secs(50));
    // Idle for 100 s: the deepest due tier (stop) fires at once.
    assert!(matches!(s.m.phase, Phase::Draining { .. }));
}

#[test]
fn operator_wake_restarts_idle_count() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.advance(secs(10));
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    s.now += secs(5);
    s.ev(Event::Command(Command::Wake));
    s.wake_all();
    assert_eq!(s.m.phase, Phase::Awake);
    assert_eq!(s.m.intent.reason, Reason::Operator);
    assert_eq!(s.timer(), Some(s.now + secs(10)));
}

#[test]
fn stale_results_are_ignored() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    let old = s.m.epoch - 1;
    s.ev(Event::HealthFailed {
        epoch: old,
        error: "old".into(),
        timed_out: false,
        refused: false,
    });
    assert_eq!(s.m.phase, Phase::Awake);
}

#[test]
fn attach_never_spawns_and_stop_tier_sleeps_deepest() {
    let mut s = Sim::attached();
    assert!(s.has(|f| matches!(f, Effect::ProbeHealth { .. })));
    s.ev(Event::HealthOk {
        epoch: s.m.epoch,
        asleep: None,
    });
    assert_eq!(s.m.phase, Phase::Awake);
    s.advance(secs(40));
    assert!(s.has(|f| matches!(f, Effect::Sleep { level: 2, .. })));
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert!(!s.has(|f| matches!(
        f,
        Effect::Terminate { .. } | Effect::Kill | Effect::Spawn { .. }
    )));
    s.ev(Event::Command(Command::Restart));
    assert!(!s.has(|f| matches!(f, Effect::Terminate { .. } | Effect::Kill)));
}

#[test]
fn operator_stop_interrupts_a_start() {
    let mut s = Sim::new(Preload::Awake);
    // Still waiting for the start lock: stopped at once.
    s.ev(Event::Command(Command::Stop));
    assert_eq!(s.m.phase, Phase::Stopped);
    // A late spawn of that start is not adopted.
    s.ev(Event::Spawned {
        proc_gen: s.m.proc_gen,
        pid: 7,
    });
    assert_eq!(s.m.phase, Phase::Stopped);
    // Spawned and probing: TERM to the group.
    s.ev(Event::Command(Command::Start));
    s.ev(Event::Spawned {
        proc_gen: s.m.proc_gen,
        pid: 8,
    });
    s.ev(Event::Command(Command::Stop));
    assert!(matches!(s.m.phase, Phase::Stopping { .. }));
    assert!(s.has(|f| matches!(f, Effect::Terminate { .. })));
}

#[test]
fn eviction_sleeps_only_an_idle_unpinned_awake_model() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.report(1, 0);
    s.ev(Event::Evict);
    assert_eq!(s.m.phase, Phase::Awake);
    s.report(0, 0);
    s.ev(Event::Pin(None));
    s.ev(Event::Evict);
    assert_eq!(s.m.phase, Phase::Awake);
    s.ev(Event::Unpin);
    s.ev(Event::Evict);
    assert!(matches!(s.m.phase, Phase::Sleeping { level: 1, .. }));
    assert_eq!(s.m.intent.reason, Reason::Eviction);
    // Demand wakes it again.
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    s.ev(Event::Demand);
    assert!(matches!(s.m.phase, Phase::Waking { .. }));
}

/// Asleep, a model evicted for what it still keeps on its GPUs stops
/// (not with a request held for it, nor attached); a demand starts it again.
#[test]
fn eviction_stops_an_asleep_model_unless_requests_wait_for_it() {
    // A request held for it wakes it; an eviction then changes nothing.
    let mut h = Sim::asleep_without_tiers();
    h.report(0, 1);
    h.ev(Event::Evict);
    assert_eq!(h.m.intent.desired, Desired::Awake);
    assert!(h.waiting_for_room(), "{:?}", h.m.phase);

    let mut s = Sim::asleep_without_tiers();
    s.ev(Event::Evict);
    assert_eq!(s.m.intent.desired, Desired::Stopped);
    assert_eq!(s.m.intent.reason, Reason::Eviction);
    assert!(
        matches!(s.m.phase, Phase::Stopping { .. }),
        "{:?}",
        s.m.phase
    );
    assert!(s.has(|f| matches!(f, Effect::Terminate { .. })));
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit 0".into(),
        cause: None,
    });
    assert_eq!(s.m.phase, Phase::Stopped);
    s.ev(Event::Demand);
    assert!(
        matches!(s.m.phase, Phase::Starting { .. }),
        "{:?}",
        s.m.phase
    );

    let mut a = Sim::attached();
    a.ev(Event::HealthOk {
        epoch: a.m.epoch,
        asleep: Some(1),
    });
    a.m.intent.desired = Desired::Asleep(1);
    a.ev(Event::Evict);
    assert_ne!(a.m.intent.desired, Desired::Stopped, "{:?}", a.m.phase);
}

#[test]
fn wake_deadline_counts_from_admission() {
    let mut s = Sim::new(Preload::Asleep);
    s.boot();
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    s.ev(Event::Demand);
    s.now += secs(4);
    s.ev(Event::Admitted { epoch: s.m.epoch });
    s.ev(Event::WakeBegan {
        epoch: s.m.epoch,
        step: 0,
    });
    s.advance(secs(4));
    assert!(matches!(s.m.phase, Phase::Waking { .. }));
    s.advance(secs(1));
    assert!(matches!(s.m.phase, Phase::Failed { .. }));
}

/// A wake's call waits for a neighbour's sleep on its GPUs (vLLM fails a
/// sleep whose GPU's memory grows meanwhile), before its first call or
/// between two: that wait, bounded by the runner's turn (`ROOM_WAIT`), is
/// not the wake's time. It was: a neighbour's sleep longer than the wake
/// timeout failed the wake and had the engine killed.
#[test]
fn a_wakes_time_counts_only_while_its_calls_run() {
    let mut s = Sim::asleep_without_tiers();
    s.sleep_to_level_2();
    s.ev(Event::Command(Command::Wake));
    s.ev(Event::Admitted { epoch: s.m.epoch });
    let epoch = s.m.epoch;
    // Its first call waits 60 s for a neighbour's sleep (wake timeout 5 s).
    s.advance(secs(60));
    assert!(
        matches!(s.m.phase, Phase::Waking { step: 0, .. }),
        "{:?}",
        s.m.phase
    );
    s.ev(Event::WakeBegan { epoch, step: 0 });
    s.advance(secs(2));
    s.ev(Event::WakeStepDone { epoch, step: 0 });
    // The second waits as long: 3 s of wake time are left.
    s.advance(secs(60));
    assert!(
        matches!(s.m.phase, Phase::Waking { step: 1, .. }),
        "{:?}",
        s.m.phase
    );
    s.ev(Event::WakeBegan { epoch, step: 1 });
    s.advance(secs(2));
    assert!(
        matches!(s.m.phase, Phase::Waking { step: 1, .. }),
        "{:?}",
        s.m.phase
    );
    s.advance(secs(1));
    assert!(
        matches!(s.m.phase, Phase::Failed { .. }),
        "the calls' 5 s are spent: {:?}",
        s.m.phase
    );
    assert!(
        s.m.last_error
            .as_deref()
            .unwrap()
            .contains("wake from level 2 timed out")
    );
    // A first call that never begins (the runner's waits are bounded)
    // times out after those waits and the wake's time.
    let mut s = Sim::asleep_without_tiers();
    s.ev(Event::Demand);
    s.ev(Event::Admitted { epoch: s.m.epoch });
    s.advance(first_call_wait(secs(5)) + secs(4));
    assert!(matches!(s.m.phase, Phase::Waking { .. }), "{:?}", s.m.phase);
    s.advance(secs(1));
    assert!(matches!(s.m.phase, Phase::Failed { .. }), "{:?}", s.m.phase);
}

/// A wake that hung with requests held: they were answered 503 with
/// Retry-After 1 s when it failed, and at that moment the stop tier fired
/// (the time held counted as idle), so the retrying clients found the model
/// stopped and paid a cold start. The idle clock runs from when the held
/// requests were last held.
#[test]
fn a_failed_wakes_held_requests_are_not_idle_time_for_its_stop_tier() {
    let mut s = Sim::asleep_without_tiers();
    s.m.settings.tiers = vec![IdleTier {
        after: secs(3),
        action: IdleAction::Stop,
    }];
    let held = |n| Event::Activity {
        proxy: "p".into(),
        in_flight: 0,
        held: n,
        active: false,
        last_finished: None,
    };
    s.ev(Event::Demand);
    s.ev(held(10));
    s.ev(Event::Admitted { epoch: s.m.epoch });
    s.ev(Event::WakeBegan {
        epoch: s.m.epoch,
        step: 0,
    });
    // The engine hangs; the proxy re-reports what it holds every second.
    while matches!(s.m.phase, Phase::Waking { .. }) {
        s.advance(secs(1));
        s.ev(held(10));
    }
    assert!(matches!(s.m.phase, Phase::Failed { .. }), "{:?}", s.m.phase);
    // The hung engine is killed and reaped.
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "signal 9".into(),
        cause: None,
    });
    // The proxy answers them 503 (Retry-After: the retry is due in 1 s).
    s.advance(Duration::from_millis(100));
    s.ev(held(0));
    assert!(
        matches!(s.m.phase, Phase::Failed { .. }),
        "the stop tier fired at the failure: {:?}",
        s.m.phase
    );
    assert_eq!(s.m.intent.desired, Desired::Awake);
    // The retry comes when it said.
    let Phase::Failed {
        retry_at: Some(retry),
        ..
    } = s.m.phase
    else {
        panic!("no retry: {:?}", s.m.phase)
    };
    s.advance(retry.saturating_duration_since(s.now));
    assert!(
        matches!(s.m.phase, Phase::Starting { .. } | Phase::Waking { .. }),
        "{:?}",
        s.m.phase
    );
}

#[test]
fn a_wakes_calibration_counts_its_calls_not_the_waits_between_them() {
    let mut s = Sim::asleep_without_tiers();
    s.sleep_to_level_2();
    s.ev(Event::Command(Command::Wake));
    s.ev(Event::Admitted { epoch: s.m.epoch });
    let epoch = s.m.epoch;
    // Each of the four calls waits 30 s for a neighbour's sleep, then
    // takes 250 ms.
    let mut calls = 0;
    while let Phase::Waking { step, .. } = s.m.phase {
        s.advance(secs(30));
        s.ev(Event::WakeBegan { epoch, step });
        s.advance(Duration::from_millis(250));
        s.ev(Event::WakeStepDone { epoch, step });
        calls += 1;
    }
    assert_eq!(calls, 4);
    assert_eq!(s.m.phase, Phase::Awake, "{:?}", s.m);
    let took = s.m.calibration.wake_mut(2).ms;
    assert!(
        (took - 1000.0).abs() < 1.0,
        "the wake took 1 s of calls, calibrated {took} ms"
    );
}

/// A reload that changes the wake timeout mid-wake changes nothing in
/// what the wake is calibrated at: its calls' time (it read 0 ms when the
/// timeout was lowered, and the waits between calls too when raised).
#[test]
fn a_wakes_calibration_holds_when_a_reload_changes_its_timeout_mid_wake() {
    for factor in [0.25, 4.0] {
        let mut s = Sim::asleep_without_tiers();
        s.sleep_to_level_2();
        s.ev(Event::Command(Command::Wake));
        s.ev(Event::Admitted { epoch: s.m.epoch });
        let epoch = s.m.epoch;
        let wake = s.m.settings.timeouts.wake;
        while let Phase::Waking { step, .. } = s.m.phase {
            s.advance(secs(30));
            s.ev(Event::WakeBegan { epoch, step });
            s.advance(Duration::from_millis(250));
            if step == 1 {
                s.m.settings.timeouts.wake = wake.mul_f64(factor);
            }
            s.ev(Event::WakeStepDone { epoch, step });
        }
        assert_eq!(s.m.phase, Phase::Awake, "{:?}", s.m);
        let took = s.m.calibration.wake_mut(2).ms;
        assert!(
            (took - 1000.0).abs() < 1.0,
            "timeout ×{factor} mid-wake: 1 s of calls, calibrated {took} ms"
        );
    }
}

#[test]
fn a_wake_that_finds_no_room_gives_up_without_harming_the_engine() {
    let mut s = Sim::asleep_without_tiers();
    s.ev(Event::Demand);
    s.advance(ROOM_WAIT - secs(1));
    assert!(s.waiting_for_room(), "{:?}", s.m);
    s.advance(secs(1));
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    assert!(!s.has(|f| matches!(f, Effect::Terminate { .. } | Effect::Kill)));
    assert!(s.m.last_error.as_deref().unwrap().contains("no room"));
    assert_eq!(s.m.intent.desired, Desired::Asleep(1));
    // The next demand tries again.
    s.ev(Event::Demand);
    assert!(matches!(s.m.phase, Phase::Waking { .. }));
}

/// A pinned model whose wake found no room keeps its pin's intent and asks
/// again: it was left asleep, `siesta get` showing the pin in force, until
/// some request came.
#[test]
fn a_pinned_model_whose_wake_found_no_room_asks_again() {
    let mut s = Sim::asleep_without_tiers();
    s.ev(Event::Pin(None));
    assert!(s.waiting_for_room(), "{:?}", s.m.phase);
    let epoch = s.m.epoch;
    s.advance(ROOM_WAIT);
    assert!(s.m.last_error.as_deref().unwrap().contains("no room"));
    assert_eq!(
        (s.m.intent.desired, s.m.intent.reason),
        (Desired::Awake, Reason::Pin)
    );
    assert!(
        s.waiting_for_room() && s.m.epoch > epoch,
        "asks for room again: {:?}",
        s.m.phase
    );
    // Room at last: awake, as pinned.
    s.ev(Event::Admitted { epoch: s.m.epoch });
    s.wake_all();
    assert_eq!(s.m.phase, Phase::Awake);
    // A start that found no room, the same.
    let mut s = Sim::new(Preload::None);
    s.ev(Event::Pin(None));
    assert!(s.waiting_for_room(), "{:?}", s.m.phase);
    let epoch = s.m.epoch;
    s.advance(ROOM_WAIT);
    assert!(s.m.last_error.as_deref().unwrap().contains("no room"));
    assert_eq!(s.m.intent.desired, Desired::Awake);
    assert!(s.waiting_for_room() && s.m.epoch > epoch, "{:?}", s.m.phase);
}

/// A start waits for room on its GPUs like a wake, and gives up like one:
/// stopped, the demand cleared, no failure counted, the reason in
/// `last_error`. (It timed out after twice the start timeout, counted as a
/// failure with nothing spawned, and was retried for ever.)
#[test]
fn a_start_that_finds_no_room_gives_up_without_counting_a_failure() {
    let mut s = Sim::new(Preload::None);
    s.ev(Event::Demand);
    assert!(s.has(|f| matches!(f, Effect::Spawn { .. })));
    s.advance(ROOM_WAIT - secs(1));
    assert!(
        matches!(s.m.phase, Phase::Starting { spawned: false, .. }),
        "{:?}",
        s.m
    );
    s.advance(secs(1));
    assert_eq!(s.m.phase, Phase::Stopped, "{:?}", s.fx);
    assert_eq!(s.m.failures, 0);
    assert_eq!(s.m.demand_since, None);
    assert!(s.m.last_error.as_deref().unwrap().contains("no room"));
    assert!(s.has(|f| matches!(f, Effect::Log(l) if l.starts_with("start gave up: no room"))));
    assert!(!s.has(|f| matches!(f, Effect::Spawn { .. })));
    assert_eq!(s.timer(), None);
    s.advance(secs(3600));
    assert_eq!(s.m.phase, Phase::Stopped);
    // The next request tries again.
    s.ev(Event::Demand);
    assert!(s.has(|f| matches!(f, Effect::Spawn { .. })));
}

/// Once admitted, a start waits for the start lock and runs on its own
/// deadlines, however long its wait for room was.
#[test]
fn a_start_deadline_counts_from_admission() {
    let mut s = Sim::new(Preload::None);
    s.m.settings.tiers.clear();
    s.ev(Event::Demand);
    s.advance(ROOM_WAIT - secs(1));
    s.ev(Event::Admitted { epoch: s.m.epoch });
    // Waiting for the start lock: up to twice the start timeout (60 s).
    s.advance(secs(119));
    assert!(
        matches!(s.m.phase, Phase::Starting { spawned: false, .. }),
        "{:?}",
        s.m
    );
    s.advance(secs(1));
    assert!(matches!(s.m.phase, Phase::Failed { .. }), "{:?}", s.m);
    assert_eq!(s.m.last_error.as_deref(), Some("start timed out"));
    assert_eq!(s.m.failures, 1);
}

/// A deeper sleep an idle tier asks for needs a wake first; a wake that
/// finds no room gives up, and that tier waits as long again as the model
/// has been idle. (It fired again in the same step before: the model was
/// waking for ever, its ask heading the admission queue.) It is put off
/// quietly: no `last_error`, the intent still the tier's (it read `by
/// eviction` with a "no room" error, on a model nobody had asked anything
/// of).
#[test]
fn a_tier_wake_that_finds_no_room_tries_again_after_as_long_again() {
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers.truncate(2); // 10 s: sleep 1, 20 s: sleep 2
    deepen_without_room(&mut s);
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 }, "{:?}", s.fx);
    assert_eq!(s.m.last_error, None);
    assert!(
        s.has(|f| matches!(f, Effect::Log(l) if l.starts_with("deeper sleep put off"))),
        "{:?}",
        s.fx
    );
    assert_eq!(
        (s.m.intent.desired, s.m.intent.reason),
        (Desired::Asleep(1), Reason::IdleTier)
    );
    // Idle 20 s + ROOM_WAIT so far: the deeper sleep waits as long again,
    // so a GPU that stays full is not asked every few minutes.
    let idle = secs(20) + ROOM_WAIT;
    let gave_up = s.now;
    assert_eq!(s.timer(), Some(gave_up + idle));
    s.advance(idle - secs(1));
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 }, "{:?}", s.fx);
    s.advance(secs(1));
    assert!(deepening(&s.m), "{:?}", s.m.phase);
}

/// Booted, asleep at level 1 by the 10 s tier, then the 20 s tier's wake
/// to sleep deeper finds no room for `ROOM_WAIT`.
fn deepen_without_room(s: &mut Sim) {
    s.boot();
    s.advance(secs(10));
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    s.advance(secs(10));
    assert!(deepening(&s.m), "{:?}", s.m.phase);
    s.advance(ROOM_WAIT);
}

/// Waking from level 1 to sleep deeper, not yet admitted.
fn deepening(m: &ModelState) -> bool {
    matches!(
        m.phase,
        Phase::Waking {
            from_level: 1,
            admitted: false,
            ..
        }
    )
}

/// A deeper sleep that found no room holds off that tier alone: a stop
/// tier (which needs no wake) still comes on the model's idle clock. The
/// give-up restarted the whole clock before, so with a GPU that stayed full
/// the level-2 tier came back every few hours and the stop tier never.
#[test]
fn a_deeper_sleep_that_found_no_room_does_not_hold_off_the_stop_tier() {
    let mut s = Sim::new(Preload::Awake); // 10 s: L1, 20 s: L2, 30 s: stop
    // At the give-up, idle 320 s: the 30 s stop tier is long due.
    deepen_without_room(&mut s);
    assert!(
        s.has(|f| matches!(f, Effect::Log(l) if l.starts_with("deeper sleep put off"))),
        "{:?}",
        s.fx
    );
    assert!(
        matches!(s.m.phase, Phase::Stopping { .. }),
        "{:?}",
        s.m.phase
    );
}

#[test]
fn a_silent_proxy_stops_counting() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.ev(Event::Activity {
        proxy: "gone".into(),
        in_flight: 2,
        held: 0,
        active: true,
        last_finished: None,
    });
    assert_eq!(s.m.in_flight(), 2);
    assert_eq!(s.timer(), Some(s.now + PROXY_STALE));
    s.advance(PROXY_STALE);
    assert_eq!(s.m.in_flight(), 0);
}

/// What the proxies hold is summed across them, shown in the status, does
/// not count as in flight (it must not keep a model from sleeping), and
/// goes when a proxy says zero or falls silent.
#[test]
fn held_requests_are_summed_across_proxies_and_expire_with_them() {
    let mut s = Sim::new(Preload::Asleep);
    s.boot();
    for (proxy, held) in [("p1", 3), ("p2", 2)] {
        s.ev(Event::Activity {
            proxy: proxy.into(),
            in_flight: 0,
            held,
            active: false,
            last_finished: None,
        });
    }
    assert_eq!((s.m.held(), s.m.in_flight()), (5, 0));
    s.ev(Event::Activity {
        proxy: "p1".into(),
        in_flight: 0,
        held: 0,
        active: false,
        last_finished: None,
    });
    assert_eq!(s.m.held(), 2);
    s.advance(PROXY_STALE);
    assert_eq!(s.m.held(), 0, "a silent proxy's held count stays");
}

mod decisions;
mod demand;
mod failed;
mod kinds;
mod room;
mod suspend;
mod yields;
