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
    assert!(s.has(|f| matches!(f, Effect::Signal(Signal::Kill))));
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
