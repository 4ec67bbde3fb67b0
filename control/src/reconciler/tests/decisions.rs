//! Decisions that used to live in the runner and are `step`'s now: health
//! strikes, stale spawns, a fresh port after a failure, and what to persist.

use super::*;

#[test]
fn three_failed_probes_in_a_row_fail_the_engine_and_an_answer_resets_them() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    let fail = |s: &mut Sim| {
        s.ev(Event::HealthFailed {
            epoch: s.m.epoch,
            error: "connection reset".into(),
            timed_out: false,
            refused: false,
        });
    };
    fail(&mut s);
    fail(&mut s);
    assert_eq!(s.m.phase, Phase::Awake, "two strikes are not a fault");
    s.ev(Event::ProbeOk { epoch: s.m.epoch });
    assert_eq!(s.m.health_strikes, 0);
    fail(&mut s);
    fail(&mut s);
    assert_eq!(s.m.phase, Phase::Awake);
    fail(&mut s);
    assert!(matches!(s.m.phase, Phase::Failed { .. }));
    assert!(s.m.last_error.as_deref().unwrap().contains("3 times"));
    assert!(s.has(|f| matches!(f, Effect::Kill)));
}

#[test]
fn a_spawn_that_lands_after_a_stop_is_killed_and_a_wanted_one_kept() {
    let mut s = Sim::new(Preload::Awake);
    let pg = s.m.proc_gen;
    s.ev(Event::Command(Command::Stop));
    s.ev(Event::Spawned {
        proc_gen: pg,
        pid: 7,
    });
    assert!(s.has(|f| *f == Effect::KillStray { proc_gen: pg }));
    assert!(!s.has(|f| matches!(f, Effect::KeepSpawned { .. })));
    s.ev(Event::Command(Command::Start));
    let pg = s.m.proc_gen;
    s.ev(Event::Spawned {
        proc_gen: pg,
        pid: 8,
    });
    assert!(s.has(|f| *f == Effect::KeepSpawned { proc_gen: pg }));
    assert_eq!(s.m.pid, Some(8));
}

#[test]
fn a_start_after_a_failure_asks_for_a_fresh_port() {
    let mut s = Sim::new(Preload::Awake);
    assert!(s.has(|f| matches!(
        f,
        Effect::Spawn {
            fresh_port: false,
            ..
        }
    )));
    s.ev(Event::SpawnFailed {
        proc_gen: s.m.proc_gen,
        error: "address in use".into(),
    });
    s.advance(secs(1));
    assert!(s.has(|f| matches!(
        f,
        Effect::Spawn {
            fresh_port: true,
            ..
        }
    )));
}

#[test]
fn what_changed_is_persisted_by_effects() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    assert!(s.has(|f| *f == Effect::RecordSleepLevel(0)));
    assert!(
        s.has(|f| *f == Effect::PersistCalibration),
        "start time learned"
    );
    s.ev(Event::Command(Command::Sleep(2)));
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert!(s.has(|f| *f == Effect::RecordSleepLevel(2)));
    assert!(s.has(|f| *f == Effect::MeasureResidual));
    assert!(s.has(|f| *f == Effect::PersistCalibration));
    s.ev(Event::Activity {
        proxy: "p".into(),
        in_flight: 0,
        held: 0,
        active: true,
        last_finished: Some(s.now),
    });
    assert!(s.has(|f| *f == Effect::PersistHistory));
    // Nothing changed: nothing persisted.
    s.ev(Event::Tick);
    assert!(!s.has(|f| matches!(
        f,
        Effect::Persist | Effect::PersistHistory | Effect::PersistCalibration
    )));
}

/// A probe that times out while requests are in flight is load, not a fault,
/// for up to `BUSY_PROBE_GRACE`; refusals count at once, and an answer
/// clears the grace.
#[test]
fn slow_probes_while_busy_are_load_for_a_while_and_refusals_still_count() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    let busy = |s: &mut Sim, in_flight| {
        s.ev(Event::Activity {
            proxy: "p".into(),
            in_flight,
            held: 0,
            active: true,
            last_finished: None,
        });
    };
    let probe = |s: &mut Sim, timed_out| {
        s.ev(Event::HealthFailed {
            epoch: s.m.epoch,
            error: "GET /health: no answer within 2s".into(),
            timed_out,
            refused: false,
        });
    };
    // The proxy reports its requests in flight every second.
    for _ in 0..10 {
        busy(&mut s, 40);
        probe(&mut s, true);
        s.now += secs(1);
    }
    assert_eq!((s.m.phase, s.m.health_strikes), (Phase::Awake, 0));
    // Still no answer a minute on: now they count.
    s.now += BUSY_PROBE_GRACE;
    busy(&mut s, 40);
    for _ in 0..HEALTH_STRIKES {
        probe(&mut s, true);
    }
    assert!(matches!(s.m.phase, Phase::Failed { .. }), "{:?}", s.m.phase);
    // The next engine gets the grace afresh: the requests held through the
    // restart all come at once, and its first probes may time out for it
    // (the old spell's start made every timeout a strike, killing it in
    // seconds, again and again while the load lasted).
    let current = s.m.proc_gen;
    s.ev(Event::ChildExited {
        proc_gen: current,
        status: "signal: 9 (SIGKILL)".into(),
        cause: None,
    });
    s.advance(secs(1));
    s.boot();
    assert_eq!(s.m.phase, Phase::Awake);
    busy(&mut s, 100);
    for _ in 0..HEALTH_STRIKES {
        probe(&mut s, true);
        s.now += secs(1);
    }
    assert_eq!((s.m.phase, s.m.health_strikes), (Phase::Awake, 0));

    // Refusals are not slowness: they count even when busy.
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    busy(&mut s, 40);
    for _ in 0..HEALTH_STRIKES {
        probe(&mut s, false);
    }
    assert!(matches!(s.m.phase, Phase::Failed { .. }));

    // Idle: timeouts count as before; an answer clears a busy spell.
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    probe(&mut s, true);
    assert_eq!(s.m.health_strikes, 1);
    s.ev(Event::ProbeOk { epoch: s.m.epoch });
    busy(&mut s, 1);
    probe(&mut s, true);
    assert!(s.m.busy_timeouts_since.is_some());
    s.ev(Event::ProbeOk { epoch: s.m.epoch });
    assert_eq!((s.m.health_strikes, s.m.busy_timeouts_since), (0, None));
}
