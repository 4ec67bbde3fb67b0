//! A wake waiting for room on its GPUs, before anything is asked of the
//! engine: what calls it off, and how one that finds no room ends.

use super::*;

fn asleep_at_1() -> Sim {
    let s = Sim::asleep_without_tiers();
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    s
}

/// An operator's sleep while the operator's wake still waits for room: the
/// wake is called off, the engine left asleep (no wake call), no error at
/// the room's deadline. (The wake went on once room came, the engine woken
/// against the sleep, and one that found none ended in an error.)
#[test]
fn an_operators_sleep_calls_off_a_wake_still_waiting_for_room() {
    let mut s = asleep_at_1();
    s.ev(Event::Command(Command::Wake));
    assert!(s.waiting_for_room(), "{:?}", s.m.phase);
    let epoch = s.m.epoch;
    s.ev(Event::Command(Command::Sleep(1)));
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    assert!(
        s.m.epoch > epoch,
        "the wait for room is dropped with its epoch"
    );
    assert!(
        s.has(|f| matches!(f, Effect::Log(l) if l.contains("wake called off before it began"))),
        "{:?}",
        s.fx
    );
    // Room comes for the old epoch: nothing is woken.
    s.ev(Event::Admitted { epoch });
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    assert!(!s.has(|f| matches!(f, Effect::Wake { .. })));
    s.advance(ROOM_WAIT + secs(1));
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    assert_eq!(s.m.last_error, None);
    assert_eq!(
        (s.m.intent.desired, s.m.intent.reason),
        (Desired::Asleep(1), Reason::Operator)
    );
}

/// With requests held for the model, its wake goes on: they are served
/// first, and it sleeps after.
#[test]
fn a_sleep_does_not_call_off_a_wake_requests_are_held_for() {
    let mut s = asleep_at_1();
    s.report(0, 3);
    s.ev(Event::Demand);
    assert!(s.waiting_for_room(), "{:?}", s.m.phase);
    s.ev(Event::Command(Command::Sleep(1)));
    assert!(s.waiting_for_room(), "{:?}", s.m.phase);
}

/// A wake for a deeper sleep (asleep at 1, an operator's sleep at 2) is not
/// called off by that sleep: vLLM sleeps deeper only from awake.
#[test]
fn a_deeper_sleeps_wake_is_not_called_off_by_it() {
    let mut s = asleep_at_1();
    s.ev(Event::Command(Command::Sleep(2)));
    assert!(s.waiting_for_room(), "{:?}", s.m.phase);
    s.advance(secs(1));
    assert!(s.waiting_for_room(), "{:?}", s.m.phase);
}

/// A stop tier's drain, before its SIGTERM, is called off by a request's
/// demand: the engine serves again at once, no cold start. (The drain went
/// on to the SIGTERM, and the held request waited for a whole new start:
/// minutes on a real engine.) An operator's stop, or a restart, is not.
#[test]
fn a_stop_tiers_drain_is_called_off_by_a_request() {
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers = vec![IdleTier {
        after: secs(10),
        action: IdleAction::Stop,
    }];
    s.boot();
    s.advance(secs(10));
    assert!(
        matches!(s.m.phase, Phase::Draining { .. }),
        "{:?}",
        s.m.phase
    );
    s.report(0, 1);
    s.ev(Event::Demand);
    assert_eq!(s.m.phase, Phase::Awake);
    assert!(!s.has(|f| matches!(f, Effect::Terminate { .. } | Effect::Kill)));
    assert!(
        s.has(
            |f| matches!(f, Effect::Log(l) if l.starts_with("stop called off before its SIGTERM"))
        ),
        "{:?}",
        s.fx
    );
    // The Drained of the old epoch changes nothing.
    s.ev(Event::Drained {
        epoch: s.m.epoch - 1,
        error: None,
    });
    assert_eq!(s.m.phase, Phase::Awake);

    // An operator's stop drains on: demand does not turn it.
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers.clear();
    s.boot();
    s.ev(Event::Command(Command::Stop));
    assert!(
        matches!(s.m.phase, Phase::Draining { .. }),
        "{:?}",
        s.m.phase
    );
    s.ev(Event::Demand);
    assert!(
        matches!(s.m.phase, Phase::Draining { .. }),
        "{:?}",
        s.m.phase
    );
    // Nor a restart's.
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers.clear();
    s.boot();
    s.ev(Event::Command(Command::Restart));
    assert!(
        matches!(s.m.phase, Phase::Draining { .. }),
        "{:?}",
        s.m.phase
    );
    s.ev(Event::Demand);
    assert!(
        matches!(s.m.phase, Phase::Draining { .. }),
        "{:?}",
        s.m.phase
    );
}
