//! The CUDA-suspend tier in the pure step: it fires only when idle with
//! nothing in flight, a demand while suspending or suspended resumes and
//! holds the request until awake, nothing probes a suspended engine, a
//! failed resume restarts the engine and says why, a failed suspend leaves
//! it running, and an attached engine is never suspended.

use super::*;

/// Awake vLLM engine, one tier: suspend after 10 s.
fn sim_suspend_tier(attach: bool) -> Sim {
    let now = Instant::now();
    let mut settings = settings(attach);
    settings.tiers = vec![IdleTier {
        after: secs(10),
        action: IdleAction::Suspend,
    }];
    let mut s = Sim {
        m: ModelState::new(settings, Preload::Awake, now),
        now,
        fx: vec![],
    };
    s.ev(Event::Tick);
    if !attach {
        s.boot();
    }
    s
}

fn suspends(fx: &[Effect]) -> bool {
    fx.iter().any(|f| matches!(f, Effect::Suspend { .. }))
}

/// Nothing that talks to the engine: probes, sleep or wake calls.
fn touches_engine(fx: &[Effect]) -> bool {
    fx.iter().any(|f| {
        matches!(
            f,
            Effect::ProbeHealth { .. } | Effect::Sleep { .. } | Effect::Wake { .. }
        )
    })
}

fn suspended(s: &mut Sim) {
    s.advance(secs(11));
    assert!(suspends(&s.fx), "{:?}", s.fx);
    s.now += secs(2);
    s.ev(Event::SuspendDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Suspended { under: 0 });
}

#[test]
fn the_suspend_tier_fires_only_when_idle_and_records_first() {
    let mut s = sim_suspend_tier(false);
    // A request in flight (re-reported every second) holds it awake past
    // the tier.
    for _ in 0..20 {
        s.report(1, 0);
        s.advance(secs(1));
    }
    assert_eq!(s.m.phase, Phase::Awake);
    assert!(!suspends(&s.fx));
    // The engine's own gauge counts too.
    s.ev(Event::Activity {
        proxy: "p".into(),
        in_flight: 0,
        held: 0,
        active: true,
        last_finished: Some(s.now),
    });
    s.ev(Event::EngineMetrics { running: 1 });
    s.advance(secs(30));
    assert!(
        !suspends(&s.fx),
        "suspended with the engine busy: {:?}",
        s.fx
    );
    s.ev(Event::EngineMetrics { running: 0 });
    s.advance(secs(9));
    assert!(!suspends(&s.fx), "fired before the tier's 10 s");
    s.advance(secs(2));
    assert!(suspends(&s.fx), "{:?}", s.fx);
    // Recorded for recovery before the helper is asked.
    let record =
        s.fx.iter()
            .position(|f| matches!(f, Effect::RecordSuspended { under: 0 }));
    let suspend =
        s.fx.iter()
            .position(|f| matches!(f, Effect::Suspend { .. }));
    assert!(record.is_some() && record < suspend, "{:?}", s.fx);
    assert!(s.m.phase.untouchable());
    s.now += secs(3);
    s.ev(Event::SuspendDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Suspended { under: 0 });
    assert_eq!(s.m.calibration.suspend.millis(), 3000);
}

#[test]
fn demand_while_suspending_or_suspended_resumes_and_holds_until_awake() {
    let mut s = sim_suspend_tier(false);
    s.advance(secs(11));
    assert!(matches!(s.m.phase, Phase::Suspending { .. }));
    // A demand mid-suspend: the checkpoint finishes first (it cannot be
    // interrupted), then the resume starts at once.
    s.ev(Event::Demand);
    assert!(s.m.demand_since.is_some());
    assert!(matches!(s.m.phase, Phase::Suspending { .. }));
    assert!(!touches_engine(&s.fx), "{:?}", s.fx);
    s.ev(Event::SuspendDone { epoch: s.m.epoch });
    assert!(matches!(
        s.m.phase,
        Phase::Resuming {
            admitted: false,
            ..
        }
    ));
    assert!(s.has(|f| matches!(f, Effect::Resume { .. })));
    s.ev(Event::Admitted { epoch: s.m.epoch });
    assert!(matches!(s.m.phase, Phase::Resuming { admitted: true, .. }));
    // Still held: the demand is served only once awake.
    assert!(s.m.demand_since.is_some());
    s.now += secs(1);
    s.ev(Event::ResumeDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Awake);
    assert!(s.m.demand_since.is_none());
    assert_eq!(s.m.calibration.resume.millis(), 1000);
    assert!(s.has(|f| matches!(f, Effect::RecordSleepLevel(0))));

    // From suspended, the same.
    let mut s = sim_suspend_tier(false);
    suspended(&mut s);
    s.ev(Event::Demand);
    assert!(s.has(|f| matches!(f, Effect::Resume { .. })));
    assert!(!touches_engine(&s.fx), "{:?}", s.fx);
}

#[test]
fn nothing_probes_or_calls_a_suspended_engine() {
    let mut s = sim_suspend_tier(false);
    suspended(&mut s);
    // Time passes, stale probe results and activity arrive: nothing is
    // planned that reaches the engine, and no strike is counted.
    for _ in 0..20 {
        s.advance(secs(60));
        assert!(!touches_engine(&s.fx), "{:?}", s.fx);
    }
    let old = s.m.epoch - 1;
    s.ev(Event::HealthFailed {
        epoch: old,
        error: "x".into(),
        timed_out: false,
        refused: false,
    });
    assert_eq!(s.m.phase, Phase::Suspended { under: 0 });
    assert_eq!(s.m.health_strikes, 0);
    // An operator wake resumes through the helper alone: no wake call is
    // sent to the engine until the restore is done.
    s.ev(Event::Command(Command::Wake));
    assert!(!touches_engine(&s.fx), "{:?}", s.fx);
    assert!(matches!(s.m.phase, Phase::Resuming { .. }));
}

#[test]
fn a_failed_resume_restarts_the_engine_and_says_why() {
    let mut s = sim_suspend_tier(false);
    suspended(&mut s);
    s.ev(Event::Demand);
    s.ev(Event::Admitted { epoch: s.m.epoch });
    s.ev(Event::ResumeFailed {
        epoch: s.m.epoch,
        error: "restore failed: CUDA_ERROR_OPERATING_SYSTEM (304)".into(),
    });
    assert!(matches!(s.m.phase, Phase::Failed { .. }));
    assert!(s.has(|f| matches!(f, Effect::Kill)));
    let err = s.m.last_error.clone().unwrap();
    assert!(
        err.contains("resume failed") && err.contains("OPERATING_SYSTEM"),
        "{err}"
    );
    // Once the killed engine has exited, the retry starts a fresh one (the
    // demand still wants it awake).
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "signal: 9 (SIGKILL)".into(),
        cause: None,
    });
    let retry = s.timer().unwrap();
    s.now = retry;
    s.ev(Event::Tick);
    assert!(s.has(|f| matches!(f, Effect::Spawn { .. })), "{:?}", s.fx);
}

#[test]
fn a_failed_suspend_leaves_it_running_and_does_not_loop() {
    let mut s = sim_suspend_tier(false);
    s.advance(secs(11));
    s.ev(Event::SuspendFailed {
        epoch: s.m.epoch,
        error: "driver has no cuCheckpointProcessLock: needs r570+".into(),
    });
    assert_eq!(s.m.phase, Phase::Awake);
    assert!(s.m.last_error.as_deref().unwrap().contains("r570"));
    assert!(!suspends(&s.fx), "retried at once: {:?}", s.fx);
    // Tried again only after another idle period.
    s.advance(secs(5));
    assert!(!suspends(&s.fx));
    s.advance(secs(6));
    assert!(suspends(&s.fx), "{:?}", s.fx);
}

#[test]
fn operator_suspend_and_wake_and_the_attached_refusal() {
    let mut s = sim_suspend_tier(false);
    s.ev(Event::Command(Command::Suspend));
    assert!(suspends(&s.fx));
    s.ev(Event::SuspendDone { epoch: s.m.epoch });
    // No tier re-fires or stop comes from a suspended engine's idle time
    // unless a deeper tier exists (none here).
    s.advance(secs(100));
    assert_eq!(s.m.phase, Phase::Suspended { under: 0 });
    s.ev(Event::Command(Command::Wake));
    assert!(s.has(|f| matches!(f, Effect::Resume { .. })));

    // An asleep engine is suspended as it is and resumes asleep.
    let mut s = sim_suspend_tier(false);
    s.ev(Event::Command(Command::Sleep(1)));
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    s.ev(Event::Command(Command::Suspend));
    assert!(s.has(|f| matches!(f, Effect::RecordSuspended { under: 1 })));
    s.ev(Event::SuspendDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Suspended { under: 1 });
    s.ev(Event::Demand);
    s.ev(Event::Admitted { epoch: s.m.epoch });
    s.ev(Event::ResumeDone { epoch: s.m.epoch });
    // Restored asleep, then woken through the kind's wake calls.
    assert!(matches!(s.m.phase, Phase::Waking { from_level: 1, .. }));

    // Attached: the command is ignored, the tier asks for nothing.
    let mut s = sim_suspend_tier(true);
    s.ev(Event::HealthOk {
        epoch: s.m.epoch,
        asleep: None,
    });
    assert_eq!(s.m.phase, Phase::Awake);
    s.ev(Event::Command(Command::Suspend));
    assert!(!suspends(&s.fx));
    s.advance(secs(60));
    assert!(!suspends(&s.fx), "{:?}", s.fx);
    assert_eq!(s.m.phase, Phase::Awake);
}

#[test]
fn a_stop_of_a_suspended_engine_signals_it_and_a_restart_adopts_it_suspended() {
    let mut s = sim_suspend_tier(false);
    suspended(&mut s);
    s.ev(Event::Command(Command::Stop));
    assert!(s.has(|f| matches!(f, Effect::Terminate { .. })));
    assert!(!s.has(|f| matches!(f, Effect::Resume { .. })));

    let mut m = ModelState::new(settings(false), Preload::None, s.now);
    m.intent.desired = Desired::Suspended;
    let fx = adopt(&mut m, 3, 99, Observed::Suspended(0), s.now);
    assert_eq!(m.phase, Phase::Suspended { under: 0 });
    assert!(!touches_engine(&fx), "{fx:?}");
}

#[test]
fn a_suspend_called_off_by_a_demand_leaves_it_serving_without_an_error() {
    let mut s = sim_suspend_tier(false);
    s.advance(secs(10));
    assert!(suspends(&s.fx), "{:?}", s.fx);
    assert!(matches!(s.m.phase, Phase::Suspending { .. }));
    s.ev(Event::Demand);
    s.ev(Event::SuspendCalledOff { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Awake);
    assert_eq!(s.m.intent.desired, Desired::Awake);
    assert_eq!(s.m.last_error, None, "not an error: nothing was done");
    // The idle clock counts from here: the tier is 10 s away again.
    assert_eq!(s.timer(), Some(s.now + secs(10)));
}

/// A suspend that waited for an engine starting on its GPUs (the runner's
/// `FreeBegan` ends the wait) gets its whole time from there, and its
/// calibration counts only the checkpoint.
#[test]
fn a_suspend_that_waits_for_a_start_counts_its_time_from_when_it_began() {
    let mut s = sim_suspend_tier(false);
    s.advance(secs(11));
    assert!(suspends(&s.fx), "{:?}", s.fx);
    let Phase::Suspending { deadline, .. } = s.m.phase else {
        panic!("{:?}", s.m.phase)
    };
    s.now += secs(200);
    s.ev(Event::FreeBegan { epoch: s.m.epoch });
    let Phase::Suspending {
        deadline: later, ..
    } = s.m.phase
    else {
        panic!("{:?}", s.m.phase)
    };
    assert_eq!(later, s.now + SUSPEND_TIMEOUT);
    assert_eq!(later - deadline, secs(200));
    s.now += secs(2);
    s.ev(Event::SuspendDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Suspended { under: 0 });
    assert_eq!(s.m.calibration.suspend.millis(), 2000);
}

/// A pinned model whose resume found no room keeps its pin's intent and
/// asks again, like a wake or a start
/// (`a_pinned_model_whose_wake_found_no_room_asks_again`). Before, the
/// resume's give-up set the intent to `Suspended (Eviction)` while the pin
/// stayed in force: shown pinned, it stayed suspended until a request.
#[test]
fn a_pinned_model_whose_resume_found_no_room_asks_again() {
    let mut s = sim_suspend_tier(false);
    s.advance(secs(11));
    s.now += secs(2);
    s.ev(Event::SuspendDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Suspended { under: 0 });
    // The operator pins it: a resume, which waits for room.
    s.ev(Event::Pin(None));
    assert!(
        matches!(
            s.m.phase,
            Phase::Resuming {
                admitted: false,
                ..
            }
        ),
        "{:?}",
        s.m.phase
    );
    s.advance(ROOM_WAIT);
    assert!(s.m.pinned(s.now), "the pin is still shown in force");
    assert_eq!(
        (s.m.intent.desired, s.m.intent.reason),
        (Desired::Awake, Reason::Pin),
        "phase {:?}",
        s.m.phase
    );
}
