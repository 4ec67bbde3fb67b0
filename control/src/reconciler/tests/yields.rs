//! A busy model yields its GPUs to one that waited (`[control]
//! yield_after`): published as sleeping so proxies hold new requests, it
//! sleeps only once nothing is in flight, its held requests wake it again
//! (admission puts that wake behind the waiting model), and nothing is cut.

use super::*;

fn yield_to_b(s: &mut Sim) {
    s.ev(Event::Yield { to: "b".into() });
}

/// Every proxy confirmed it has nothing more in flight.
fn drained(s: &mut Sim) {
    s.ev(Event::Drained {
        epoch: s.m.epoch,
        error: None,
    });
}

/// Awake and serving 2 requests.
fn serving() -> Sim {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.report(2, 0);
    assert_eq!(s.m.phase, Phase::Awake);
    s
}

#[test]
fn a_busy_model_holds_new_requests_finishes_those_in_flight_then_sleeps() {
    let mut s = serving();
    yield_to_b(&mut s);
    assert!(
        matches!(
            s.m.phase,
            Phase::Yielding {
                level: 1,
                drained: false,
                ..
            }
        ),
        "{:?}",
        s.m.phase
    );
    assert!(s.has(|f| matches!(f, Effect::Drain { .. })), "{:?}", s.fx);
    assert!(!s.has(|f| matches!(f, Effect::Sleep { .. })));
    // Wanted as before until the sleep begins (a yield given up, or a
    // control plane restarted meanwhile, must not sleep it without a drain).
    assert_eq!(s.m.intent.desired, Desired::Awake);
    // Published as going to sleep (status/tests.rs): proxies hold what comes.
    // A new request is held; its demand does not call the yield off.
    s.ev(Event::Demand);
    s.report(2, 1);
    assert!(matches!(s.m.phase, Phase::Yielding { .. }));
    // Every proxy confirmed, but the engine's own gauge still counts one.
    s.ev(Event::EngineMetrics { running: 1 });
    drained(&mut s);
    assert!(matches!(s.m.phase, Phase::Yielding { drained: true, .. }));
    s.report(0, 3);
    assert!(
        !s.has(|f| matches!(f, Effect::Sleep { .. })),
        "slept with one in flight"
    );
    s.ev(Event::EngineMetrics { running: 0 });
    assert!(
        s.has(|f| matches!(f, Effect::Sleep { level: 1, .. })),
        "{:?}",
        s.fx
    );
    assert!(matches!(s.m.phase, Phase::Sleeping { level: 1, .. }));
    // The demand that came during the yield is not served yet: it keeps
    // the model wanted awake through the sleep.
    assert_eq!(s.m.intent.desired, Desired::Awake);
    assert!(s.m.demand_since.is_some());
    // Asleep with 3 held: it asks for its GPUs again at once (admission
    // puts that behind the model it yielded to).
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert!(
        matches!(
            s.m.phase,
            Phase::Waking {
                admitted: false,
                ..
            }
        ),
        "{:?}",
        s.m.phase
    );
    assert_eq!(s.m.intent.desired, Desired::Awake);
}

/// With no demand during the yield, the sleep is the model's rest: it
/// stays asleep, for the model it yielded to, until asked again.
#[test]
fn a_yield_with_nothing_asked_meanwhile_leaves_it_asleep() {
    let mut s = serving();
    yield_to_b(&mut s);
    drained(&mut s);
    s.report(0, 0);
    assert!(matches!(s.m.phase, Phase::Sleeping { level: 1, .. }));
    assert_eq!(
        (s.m.intent.desired, s.m.intent.reason),
        (Desired::Asleep(1), Reason::Eviction)
    );
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    // A demand later wakes it as any asleep model.
    s.ev(Event::Demand);
    assert!(matches!(s.m.phase, Phase::Waking { .. }));
}

#[test]
fn a_yield_whose_requests_do_not_finish_in_time_serves_again() {
    let mut s = serving();
    yield_to_b(&mut s);
    let epoch = s.m.epoch;
    // stop_grace is 3 s in these settings.
    s.advance(secs(3));
    assert_eq!(s.m.phase, Phase::Awake, "{:?}", s.fx);
    assert!(!s.has(|f| matches!(
        f,
        Effect::Sleep { .. } | Effect::Terminate { .. } | Effect::Kill
    )));
    assert!(s.has(|f| matches!(f, Effect::Log(l) if l.contains("yield given up (1 in a row)"))));
    assert_eq!(s.m.yields_given_up, 1);
    // The drain's late answer is stale.
    s.ev(Event::Drained { epoch, error: None });
    assert_eq!(s.m.phase, Phase::Awake);
    // A proxy that never confirmed gives it up too.
    yield_to_b(&mut s);
    s.ev(Event::Drained {
        epoch: s.m.epoch,
        error: Some("proxy p has 2 request(s) in flight".into()),
    });
    assert_eq!(s.m.phase, Phase::Awake);
    assert_eq!(s.m.yields_given_up, 2);
    // Idle now: still wanted awake, so no sleep without a drain; the
    // waiting model's admission evicts it as an idle model, and its turns
    // are back to one `yield_after`.
    assert_eq!(s.m.intent.desired, Desired::Awake);
    s.report(0, 0);
    assert_eq!(s.m.phase, Phase::Awake);
    s.ev(Event::Evict);
    assert!(matches!(s.m.phase, Phase::Sleeping { level: 1, .. }));
    assert_eq!(s.m.yields_given_up, 0);
}

#[test]
fn a_pinned_or_asleep_model_does_not_yield() {
    let mut s = serving();
    s.ev(Event::Pin(None));
    yield_to_b(&mut s);
    assert_eq!(s.m.phase, Phase::Awake, "pinned");
    s.ev(Event::Unpin);
    // Pinned while yielding: the yield is called off.
    yield_to_b(&mut s);
    assert!(matches!(s.m.phase, Phase::Yielding { .. }));
    s.ev(Event::Pin(None));
    assert_eq!(s.m.phase, Phase::Awake);

    let mut s = Sim::new(Preload::Asleep);
    s.boot();
    yield_to_b(&mut s);
    assert!(
        matches!(s.m.phase, Phase::Sleeping { .. }),
        "{:?}",
        s.m.phase
    );
}

/// What an operator asks during a yield is kept: a deeper sleep is the
/// one it goes to, a suspend follows the sleep, a wake calls the yield off.
#[test]
fn an_operators_sleep_suspend_or_wake_during_a_yield_is_kept() {
    let mut s = serving();
    yield_to_b(&mut s);
    s.ev(Event::Command(Command::Sleep(2)));
    assert!(matches!(s.m.phase, Phase::Yielding { .. }));
    drained(&mut s);
    s.report(0, 1);
    assert!(
        s.has(|f| matches!(f, Effect::Sleep { level: 2, .. })),
        "{:?}",
        s.fx
    );
    assert_eq!(
        (s.m.intent.desired, s.m.intent.reason),
        (Desired::Asleep(2), Reason::Operator)
    );

    // (Requests held would be a demand, which wins over a suspend; none
    // are held here.)
    let mut s = serving();
    yield_to_b(&mut s);
    s.ev(Event::Command(Command::Suspend));
    drained(&mut s);
    s.report(0, 0);
    assert!(matches!(s.m.phase, Phase::Sleeping { level: 1, .. }));
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert!(
        matches!(s.m.phase, Phase::Suspending { under: 1, .. }),
        "{:?}",
        s.m.phase
    );
    assert_eq!(s.m.intent.reason, Reason::Operator);

    let mut s = serving();
    yield_to_b(&mut s);
    s.ev(Event::Command(Command::Wake));
    assert_eq!(s.m.phase, Phase::Awake);
    assert!(s.has(|f| matches!(f, Effect::Log(l) if l.contains("yield called off"))));
}

/// The model it yields to found room without it (an idle model made it):
/// still finishing its requests, it serves again, wanted awake as before;
/// once its sleep has begun, or when it is not yielding, nothing changes.
#[test]
fn a_yield_no_longer_needed_is_called_off_until_its_sleep_begins() {
    let call_off = |s: &mut Sim| {
        s.ev(Event::CallOffYield {
            to: "b".into(),
            why: "found room without it",
        });
    };
    let mut s = serving();
    yield_to_b(&mut s);
    call_off(&mut s);
    assert_eq!(s.m.phase, Phase::Awake, "{:?}", s.fx);
    assert!(s.has(|f| matches!(f, Effect::Log(l)
        if l == "\"b\" found room without it: yield called off, serving again")));
    assert_eq!(s.m.intent.desired, Desired::Awake);
    assert!(!s.has(|f| matches!(f, Effect::Sleep { .. })));
    // Drained meanwhile, the engine's own gauge still counting one: the
    // same.
    let mut s = serving();
    yield_to_b(&mut s);
    s.ev(Event::EngineMetrics { running: 1 });
    drained(&mut s);
    s.report(0, 0);
    assert!(matches!(s.m.phase, Phase::Yielding { drained: true, .. }));
    call_off(&mut s);
    assert_eq!(s.m.phase, Phase::Awake);

    // Its sleep began: too late, it sleeps.
    let mut s = serving();
    yield_to_b(&mut s);
    drained(&mut s);
    s.report(0, 0);
    assert!(matches!(s.m.phase, Phase::Sleeping { level: 1, .. }));
    call_off(&mut s);
    assert!(matches!(s.m.phase, Phase::Sleeping { level: 1, .. }));
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });

    // Not yielding: nothing to call off.
    let mut s = serving();
    call_off(&mut s);
    assert_eq!(s.m.phase, Phase::Awake);
    assert!(!s.has(|f| matches!(f, Effect::Log(l) if l.contains("called off"))));
}

#[test]
fn a_stop_or_restart_while_yielding_lets_the_answers_finish() {
    for cmd in [Command::Stop, Command::Restart] {
        let mut s = serving();
        yield_to_b(&mut s);
        s.ev(Event::Command(cmd));
        assert!(
            matches!(s.m.phase, Phase::Draining { .. }),
            "{cmd:?}: {:?}",
            s.m.phase
        );
        assert!(s.has(|f| matches!(f, Effect::Drain { .. })));
        assert!(
            !s.has(|f| matches!(f, Effect::Terminate { .. } | Effect::Kill)),
            "{cmd:?} cut answers"
        );
    }
}

#[test]
fn an_engine_that_dies_while_yielding_fails_as_it_would_awake() {
    let mut s = serving();
    yield_to_b(&mut s);
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "signal: 9".into(),
        cause: None,
    });
    assert!(matches!(s.m.phase, Phase::Failed { .. }), "{:?}", s.m.phase);
}
