//! A demand always wins over idle tiers (issue: a request for a model idle
//! past its tiers was held and never woken), and the idle clock starts when
//! the engine is ready.

use super::*;

fn is_wake(f: &Effect) -> bool {
    matches!(f, Effect::Wake { step: 0, .. })
}

/// Preloaded asleep, then left alone `idle` after the preload ended.
fn preloaded_then_idle(idle: Duration) -> Sim {
    let mut s = Sim::new(Preload::Asleep);
    s.boot();
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    // Let every timer fire on the way, completing what the tiers start.
    let end = s.now + idle;
    while let Some(t) = s.timer().filter(|t| *t <= end) {
        s.now = t;
        s.ev(Event::Tick);
        s.wake_all();
        if let Phase::Sleeping { .. } = s.m.phase {
            s.ev(Event::SleepDone { epoch: s.m.epoch });
        }
    }
    s.now = end;
    s.ev(Event::Tick);
    s
}

#[test]
fn a_demand_past_two_tiers_wakes_at_once() {
    // Past L1 (10 s) and L2 (20 s), before the stop tier (30 s).
    let mut s = preloaded_then_idle(secs(25));
    assert_eq!(s.m.phase, Phase::Asleep { level: 2 });
    s.ev(Event::Demand);
    assert!(s.has(is_wake), "{:?} {:?}", s.m.phase, s.fx);
    assert_eq!(s.m.intent.desired, Desired::Awake);
    assert_eq!(s.m.intent.reason, Reason::Demand);
    s.wake_all();
    assert_eq!(s.m.phase, Phase::Awake);
    // The idle clock counts from the wake: the next tier is 10 s away.
    assert_eq!(s.timer(), Some(s.now + secs(10)));
}

#[test]
fn a_demand_at_level_1_long_past_its_tier_wakes() {
    let mut s = Sim::new(Preload::Asleep);
    s.m.settings.tiers.truncate(1);
    s.boot();
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    s.advance(secs(3600));
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    s.ev(Event::Demand);
    assert!(s.has(is_wake), "{:?}", s.fx);
    s.wake_all();
    assert_eq!(s.m.phase, Phase::Awake);
}

#[test]
fn a_demand_after_a_stop_tier_starts_the_engine() {
    let mut s = preloaded_then_idle(secs(40));
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit 0".into(),
        cause: None,
    });
    assert_eq!(s.m.phase, Phase::Stopped);
    s.now += secs(3600);
    s.ev(Event::Demand);
    assert!(s.has(|f| matches!(f, Effect::Spawn { .. })));
    s.boot();
    assert_eq!(s.m.phase, Phase::Awake);
    assert_eq!(s.timer(), Some(s.now + secs(10)));
}

#[test]
fn a_demand_during_a_slow_tier_sleep_wakes_when_it_ends() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.advance(secs(10));
    assert!(matches!(s.m.phase, Phase::Sleeping { level: 1, .. }));
    s.ev(Event::FreeBegan { epoch: s.m.epoch });
    s.ev(Event::Demand);
    // The sleep ends long after both later tiers would have been due.
    s.now += secs(4);
    s.m.settings.tiers[1].after = secs(12);
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert!(s.has(is_wake), "{:?} {:?}", s.m.intent, s.fx);
    assert_eq!(s.m.intent.reason, Reason::Demand);
}

#[test]
fn no_tier_fires_while_a_demand_waits() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.advance(secs(10));
    s.ev(Event::FreeBegan { epoch: s.m.epoch });
    s.ev(Event::Demand);
    // The sleep never answers; the deadline fails it, backoff retries.
    s.advance(secs(5));
    assert!(matches!(s.m.phase, Phase::Failed { .. }));
    assert_eq!(s.m.intent.reason, Reason::Demand);
    // The killed engine exits (a retry waits for that).
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "signal: 9 (SIGKILL)".into(),
        cause: None,
    });
    s.advance(secs(1));
    assert!(s.has(|f| matches!(f, Effect::Spawn { .. })));
    // A slow start, longer than every tier.
    s.ev(Event::Spawned {
        proc_gen: s.m.proc_gen,
        pid: 7,
    });
    s.advance(secs(50));
    s.ev(Event::HealthOk {
        epoch: s.m.epoch,
        asleep: None,
    });
    assert_eq!(s.m.phase, Phase::Awake);
    assert_eq!(s.m.intent.reason, Reason::Demand);
    assert_eq!(s.m.demand_since, None);
}

#[test]
fn a_demand_during_a_stop_restarts_after_the_exit() {
    let mut s = preloaded_then_idle(secs(30));
    assert!(matches!(s.m.phase, Phase::Stopping { .. }));
    s.ev(Event::Demand);
    s.now += secs(2);
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "exit 0".into(),
        cause: None,
    });
    assert!(
        s.has(|f| matches!(f, Effect::Spawn { .. })),
        "{:?}",
        s.m.phase
    );
}

#[test]
fn an_operator_stop_still_wins_over_a_demand() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.ev(Event::Command(Command::Stop));
    s.ev(Event::Demand);
    assert_eq!(s.m.intent.desired, Desired::Stopped);
    assert_eq!(s.m.demand_since, None);
}

#[test]
fn a_slow_preload_counts_its_tiers_from_the_end_of_the_preload() {
    let mut s = Sim::new(Preload::Asleep);
    s.ev(Event::Spawned {
        proc_gen: s.m.proc_gen,
        pid: 9,
    });
    // 92 s to start, longer than every tier.
    s.now += secs(92);
    s.ev(Event::HealthOk {
        epoch: s.m.epoch,
        asleep: None,
    });
    assert!(s.has(|f| matches!(f, Effect::Sleep { level: 1, .. })));
    s.now += secs(1);
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    // No tier fired on the way; the level-2 tier is 20 s from now.
    assert!(!s.has(is_wake));
    assert_eq!(s.timer(), Some(s.now + secs(20)));
}

/// Pinned awake long past every tier, then the operator asks for a level:
/// the deeper tiers count from that command, not from the last request, so
/// an overdue tier does not replace the operator's choice at once.
fn pinned_for_an_hour_then(cmd: Command) -> (Sim, Instant) {
    let mut s = Sim::new(Preload::None);
    s.ev(Event::Demand);
    s.boot();
    s.ev(Event::Pin(None));
    s.advance(secs(3600));
    assert_eq!(s.m.phase, Phase::Awake, "a pinned model stays awake");
    let at = s.now;
    s.ev(Event::Command(cmd));
    (s, at)
}

#[test]
fn an_operators_sleep_is_not_deepened_at_once_by_an_overdue_tier() {
    // Tiers: L1 10 s, L2 20 s, stop 30 s; idle for an hour.
    let (mut s, at) = pinned_for_an_hour_then(Command::Sleep(1));
    assert!(
        matches!(s.m.phase, Phase::Sleeping { level: 1, .. }),
        "{:?}",
        s.m.phase
    );
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    s.advance(secs(5));
    assert_eq!(s.m.intent.desired, Desired::Asleep(1));
    assert_eq!(s.m.intent.reason, Reason::Operator);
    // The next tier is L2, 20 s after the operator's command.
    assert_eq!(s.timer(), Some(at + secs(20)));
    s.now = at + secs(20);
    s.ev(Event::Tick);
    assert_eq!(s.m.intent.desired, Desired::Asleep(2));
    assert_eq!(s.m.intent.reason, Reason::IdleTier);
}

#[test]
fn an_operators_suspend_is_not_replaced_at_once_by_an_overdue_stop_tier() {
    let (mut s, at) = pinned_for_an_hour_then(Command::Suspend);
    assert!(
        matches!(s.m.phase, Phase::Suspending { .. }),
        "{:?}",
        s.m.phase
    );
    s.ev(Event::SuspendDone { epoch: s.m.epoch });
    assert!(
        matches!(s.m.phase, Phase::Suspended { .. }),
        "{:?}",
        s.m.phase
    );
    s.advance(secs(1));
    assert_eq!(s.m.intent.desired, Desired::Suspended);
    assert_eq!(s.m.intent.reason, Reason::Operator);
    // The stop tier (30 s) counts from the command too.
    s.now = at + secs(30);
    s.ev(Event::Tick);
    assert_eq!(s.m.intent.desired, Desired::Stopped);
}

fn held(s: &mut Sim, n: u32) {
    s.ev(Event::Activity {
        proxy: "p".into(),
        in_flight: 0,
        held: n,
        active: false,
        last_finished: None,
    });
}

/// Requests held when an operator puts the model to sleep (here during the
/// start they asked for) are served first: the sleep waits until the
/// proxies hold none. Before, it began the moment the start ended, the
/// requests stayed held, and an operator's sleep every few seconds kept
/// them from ever being served (scripts/chaos with a 2 s sleep: answers
/// after 40 s).
#[test]
fn requests_held_when_an_operators_sleep_comes_are_served_before_it() {
    let mut s = Sim::new(Preload::None);
    s.ev(Event::Demand);
    held(&mut s, 3);
    s.ev(Event::Command(Command::Sleep(1)));
    s.boot();
    assert_eq!(s.m.phase, Phase::Awake, "the held requests come first");
    s.advance(secs(2));
    assert!(!s.has(|f| matches!(f, Effect::Sleep { .. })), "{:?}", s.fx);
    // Released and answered: now the operator's sleep.
    s.report(3, 0);
    assert_eq!(s.m.phase, Phase::Awake);
    held(&mut s, 0);
    assert!(
        matches!(s.m.phase, Phase::Sleeping { level: 1, .. }),
        "the operator's sleep is carried out: {:?}",
        s.m.phase
    );
}

/// Requests held when an operator's sleep has begun wake the model again
/// once it is done. Before, the proxy's one `Demand` was forgotten: they
/// waited out `max_hold` while the tiers stopped the engine (scripts/chaos:
/// 64 requests held for a model stopped by its tier, nothing starting it).
#[test]
fn requests_held_through_an_operators_sleep_wake_the_model_after_it() {
    let mut s = Sim::new(Preload::None);
    s.ev(Event::Demand);
    s.ev(Event::Command(Command::Sleep(1)));
    assert_eq!(s.m.demand_since, None);
    s.boot();
    assert!(
        matches!(s.m.phase, Phase::Sleeping { level: 1, .. }),
        "the operator's sleep is carried out: {:?}",
        s.m.phase
    );
    held(&mut s, 3);
    s.now += secs(1);
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert!(s.has(is_wake), "{:?} {:?}", s.m.phase, s.fx);
    assert_eq!(s.m.intent.desired, Desired::Awake);
    assert_eq!(s.m.intent.reason, Reason::Demand);
    s.wake_all();
    assert_eq!(s.m.phase, Phase::Awake);
}

/// Held requests start a model stopped by a tier or never started, but
/// not one an operator stopped (its proxies answer them instead).
#[test]
fn held_requests_start_a_stopped_model_unless_an_operator_stopped_it() {
    let mut s = Sim::new(Preload::None);
    assert_eq!(s.m.phase, Phase::Stopped);
    held(&mut s, 2);
    assert!(s.has(|f| matches!(f, Effect::Spawn { .. })), "{:?}", s.fx);
    assert_eq!(s.m.intent.reason, Reason::Demand);

    let mut s = Sim::new(Preload::None);
    s.ev(Event::Command(Command::Stop));
    held(&mut s, 2);
    s.advance(secs(5));
    assert!(!s.has(|f| matches!(f, Effect::Spawn { .. })), "{:?}", s.fx);
    assert_eq!(s.m.phase, Phase::Stopped);
    assert_eq!(s.m.intent.reason, Reason::Operator);
}

/// A model with requests held is not idle: no tier fires (a proxy's count
/// can trail the release of its requests by a report), and the time they
/// were held is not idle time either: the tier comes its whole time after
/// the last report that held any.
#[test]
fn no_tier_fires_while_requests_are_held() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    // The proxy re-reports them every second.
    for _ in 0..15 {
        held(&mut s, 2);
        s.advance(secs(1));
    }
    assert_eq!(s.m.phase, Phase::Awake, "L1 is due after 10 s idle");
    assert!(!s.has(|f| matches!(f, Effect::Sleep { .. })));
    held(&mut s, 0);
    assert_eq!(s.m.phase, Phase::Awake, "held time taken as idle");
    // 10 s after the last report that held some, the tier fires.
    s.advance(secs(8));
    assert_eq!(s.m.phase, Phase::Awake);
    s.advance(secs(2));
    assert!(
        matches!(s.m.phase, Phase::Sleeping { level: 1, .. }),
        "{:?}",
        s.m.phase
    );
}

/// An engine a probe finds asleep while it is taken as awake (a sleep a
/// restarted control plane did not see finish, or one sent to the engine
/// directly) is taken as asleep, and woken when it is wanted awake;
/// a stale probe's finding is ignored.
#[test]
fn an_engine_found_asleep_while_taken_as_awake_is_woken() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    assert_eq!(s.m.phase, Phase::Awake);
    let stale = s.m.epoch - 1;
    s.ev(Event::FoundAsleep {
        epoch: stale,
        level: 1,
    });
    assert_eq!(s.m.phase, Phase::Awake);
    s.ev(Event::FoundAsleep {
        epoch: s.m.epoch,
        level: 2,
    });
    assert!(
        matches!(s.m.phase, Phase::Waking { from_level: 2, .. }),
        "{:?}",
        s.m.phase
    );
    s.wake_all();
    assert_eq!(s.m.phase, Phase::Awake);
}

/// A request a proxy forwarded as the model began to sleep (its view was
/// a moment behind) reaches an asleep engine and waits in its queue: a
/// proxy reporting it in flight to the asleep model wakes it (demand_e2e
/// hung 30 s once in CI).
#[test]
fn a_request_in_flight_to_an_asleep_engine_wakes_it() {
    let mut s = Sim::new(Preload::Asleep);
    s.boot();
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    s.report(1, 0);
    assert!(
        matches!(s.m.phase, Phase::Waking { .. }),
        "{:?} {:?}",
        s.m.phase,
        s.fx
    );
    assert_eq!(s.m.intent.desired, Desired::Awake);
}

/// Proxies' in-flight and held counts come from the wire as they are: a
/// sum that overflows saturates. Before, it panicked the model task in a
/// debug build and wrapped to a small number in release (where a sleep
/// could begin with requests in flight).
#[test]
fn huge_in_flight_reports_do_not_overflow() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.ev(Event::Activity {
        proxy: "a".into(),
        in_flight: u32::MAX,
        held: 0,
        active: true,
        last_finished: None,
    });
    s.ev(Event::Activity {
        proxy: "b".into(),
        in_flight: 1,
        held: 0,
        active: true,
        last_finished: None,
    });
    assert_eq!(s.m.in_flight(), u32::MAX);
    s.ev(Event::Activity {
        proxy: "a".into(),
        in_flight: 0,
        held: u32::MAX,
        active: true,
        last_finished: None,
    });
    s.ev(Event::Activity {
        proxy: "b".into(),
        in_flight: 0,
        held: 2,
        active: true,
        last_finished: None,
    });
    assert_eq!(s.m.held(), u32::MAX);
}

/// A request a proxy forwards is counted by the proxy and by the engine's
/// gauge: the model's in-flight count is the larger of the two, not their
/// sum (which showed twice the real load in `siesta get`, Watch and the
/// metrics). Either alone still counts: requests sent to the engine
/// directly, or on their way to it.
#[test]
fn a_forwarded_request_is_counted_once() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    let report = |in_flight| Event::Activity {
        proxy: "p".into(),
        in_flight,
        held: 0,
        active: true,
        last_finished: None,
    };
    s.ev(report(3));
    s.ev(Event::EngineMetrics { running: 3 });
    assert_eq!(s.m.in_flight(), 3);
    s.ev(report(0));
    assert_eq!(
        s.m.in_flight(),
        3,
        "the engine's own count, direct requests"
    );
    s.ev(Event::EngineMetrics { running: 0 });
    s.ev(report(1));
    assert_eq!(s.m.in_flight(), 1, "on its way to the engine");
    s.ev(report(0));
    assert_eq!(s.m.in_flight(), 0);
}
