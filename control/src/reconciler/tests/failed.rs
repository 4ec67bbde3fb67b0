//! A failed model and what is left of its engine: SIGKILLed processes keep
//! their GPU memory until they have exited, so `Failed` says whether they
//! are gone (placement counts the model's share until then).

use super::*;

/// The engine of `proc_gen` has exited and its process group is gone.
fn exited(s: &mut Sim, proc_gen: u64) {
    s.ev(Event::ChildExited {
        proc_gen,
        status: "signal: 9 (SIGKILL)".into(),
        cause: None,
    });
}

fn failed_gone(m: &ModelState) -> Option<bool> {
    match m.phase {
        Phase::Failed { process_gone, .. } => Some(process_gone),
        _ => None,
    }
}

/// Stop grace over, SIGKILL, and the engine is still there at the kill
/// grace: it failed with its processes known alive. It neither counts as
/// stopped (it was, at once: the next model on its GPUs was admitted and
/// could run out of memory) nor restarts beside them, until their exit.
#[test]
fn an_engine_alive_after_sigkill_holds_its_gpus_until_it_exits() {
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers.clear();
    s.boot();
    s.ev(Event::Command(Command::Stop));
    s.advance(secs(3));
    s.term_sent();
    s.advance(secs(3));
    assert!(s.has(|f| matches!(f, Effect::Kill)));
    // Not before the supervisor may have told the exit (the group swept).
    s.advance(secs(21));
    assert!(
        matches!(s.m.phase, Phase::Stopping { killed: true, .. }),
        "{:?}",
        s.m.phase
    );
    s.advance(secs(1));
    assert_eq!(failed_gone(&s.m), Some(false), "{:?}", s.m.phase);
    let said = s.m.last_error.clone().unwrap();
    assert!(
        said.starts_with("stopping: its engine (pid 42) has not exited 22 s after SIGKILL"),
        "{said}"
    );
    // Wanted stopped: still failed (and counted) while they are there, with
    // no timer spinning on it, and said once.
    s.advance(secs(600));
    assert_eq!(failed_gone(&s.m), Some(false), "{:?}", s.m.phase);
    assert_eq!(s.timer(), None);
    assert_eq!(s.m.last_error.as_deref(), Some(&*said));
    // An older generation's exit says nothing of this one's.
    let older = s.m.proc_gen - 1;
    exited(&mut s, older);
    assert_eq!(failed_gone(&s.m), Some(false));
    let current = s.m.proc_gen;
    exited(&mut s, current);
    assert_eq!(s.m.phase, Phase::Stopped);
}

/// The same wanted running (an operator's restart): the retry waits for the
/// exit (a new engine beside the old processes would find no memory), then
/// starts at once if it is due.
#[test]
fn a_retry_waits_for_the_killed_engine_to_exit() {
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers.clear();
    s.boot();
    s.ev(Event::Command(Command::Restart));
    s.advance(secs(3));
    s.term_sent();
    s.advance(secs(3));
    s.advance(drive::KILL_GRACE);
    let Phase::Failed {
        retry_at: Some(t),
        process_gone: false,
    } = s.m.phase
    else {
        panic!("{:?}", s.m.phase)
    };
    // No timer for a retry that cannot happen yet (the exit wakes it),
    // one only to say the exit is overdue.
    assert_eq!(s.timer(), Some(s.m.since + drive::KILL_GRACE));
    s.now = t + secs(5);
    s.ev(Event::Tick);
    assert!(!s.has(|f| matches!(f, Effect::Spawn { .. })), "{:?}", s.fx);
    assert_eq!(failed_gone(&s.m), Some(false));
    let current = s.m.proc_gen;
    exited(&mut s, current);
    assert!(s.has(|f| matches!(f, Effect::Spawn { .. })), "{:?}", s.fx);
    assert!(matches!(s.m.phase, Phase::Starting { .. }));

    // An exit seen before the retry is due: it retries on time.
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers.clear();
    s.boot();
    for _ in 0..3 {
        s.ev(Event::HealthFailed {
            epoch: s.m.epoch,
            error: "refused".into(),
            timed_out: false,
            refused: false,
        });
    }
    assert!(s.has(|f| matches!(f, Effect::Kill)));
    let Phase::Failed {
        retry_at: Some(t),
        process_gone: false,
    } = s.m.phase
    else {
        panic!("{:?}", s.m.phase)
    };
    let current = s.m.proc_gen;
    exited(&mut s, current);
    assert_eq!(failed_gone(&s.m), Some(true));
    assert_eq!(s.timer(), Some(t));
    s.advance(t - s.now);
    assert!(matches!(s.m.phase, Phase::Starting { .. }));
}

/// Nothing to wait for: a spawn that failed (no process), and an engine
/// that exited on its own (its exit is the failure).
#[test]
fn a_failure_without_a_live_process_leaves_nothing() {
    let mut s = Sim::new(Preload::Awake);
    s.ev(Event::SpawnFailed {
        proc_gen: s.m.proc_gen,
        error: "no such file".into(),
    });
    assert_eq!(failed_gone(&s.m), Some(true));

    let mut s = Sim::new(Preload::Awake);
    s.boot();
    let current = s.m.proc_gen;
    exited(&mut s, current);
    assert_eq!(failed_gone(&s.m), Some(true));
}

/// A spawn that lands after its start failed is killed as a stray; until
/// its exit it holds what it took.
#[test]
fn a_stray_spawn_landing_on_a_failed_model_is_waited_for() {
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers.clear();
    let proc_gen = s.m.proc_gen;
    s.ev(Event::Admitted { epoch: s.m.epoch });
    // The start lock never came within twice the start timeout.
    s.advance(secs(120));
    assert_eq!(failed_gone(&s.m), Some(true), "{:?}", s.m.phase);
    s.ev(Event::Spawned { proc_gen, pid: 7 });
    assert!(s.has(|f| matches!(f, Effect::KillStray { .. })));
    assert_eq!(failed_gone(&s.m), Some(false));
    exited(&mut s, proc_gen);
    assert_eq!(failed_gone(&s.m), Some(true));
}

/// An attached engine that failed (three probes) runs on as far as siesta
/// knows: it is never seen gone, and it retries on time.
#[test]
fn an_attached_failed_engine_is_never_taken_as_gone() {
    let mut s = Sim::attached();
    s.ev(Event::HealthOk {
        epoch: s.m.epoch,
        asleep: None,
    });
    assert_eq!(s.m.phase, Phase::Awake);
    for _ in 0..3 {
        s.ev(Event::HealthFailed {
            epoch: s.m.epoch,
            error: "refused".into(),
            timed_out: false,
            refused: false,
        });
    }
    assert!(!s.has(|f| matches!(f, Effect::Terminate { .. } | Effect::Kill)));
    let Phase::Failed {
        retry_at: Some(t),
        process_gone: false,
    } = s.m.phase
    else {
        panic!("{:?}", s.m.phase)
    };
    assert_eq!(s.timer(), Some(t));
    s.advance(t - s.now);
    assert!(
        matches!(s.m.phase, Phase::Starting { .. }),
        "{:?}",
        s.m.phase
    );
}

/// A failed engine whose SIGKILLed process never exits (stuck in the
/// kernel, in the GPU driver) is not restarted beside it, and once the
/// exit is overdue its `last_error` says what the model waits for, naming
/// the pid, once (it showed a retry time long past, for ever). Its exit,
/// however late, lets the retry go.
#[test]
fn a_killed_engine_that_never_exits_is_named_in_last_error() {
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers.clear();
    s.boot();
    for _ in 0..HEALTH_STRIKES {
        s.ev(Event::HealthFailed {
            epoch: s.m.epoch,
            error: "connection refused".into(),
            timed_out: false,
            refused: false,
        });
    }
    assert!(
        matches!(
            s.m.phase,
            Phase::Failed {
                process_gone: false,
                ..
            }
        ),
        "{:?}",
        s.m.phase
    );
    assert!(s.has(|f| matches!(f, Effect::Kill)));
    // The retry is due, but the killed process is still there.
    s.advance(secs(5));
    assert!(!s.has(|f| matches!(f, Effect::Spawn { .. })));
    assert!(!s.m.last_error.as_deref().unwrap().contains("pid 42"));
    // The step asks to be woken when the exit is overdue, and says so then.
    assert_eq!(s.timer(), Some(s.m.since + drive::KILL_GRACE));
    s.now = s.m.since + drive::KILL_GRACE;
    s.ev(Event::Tick);
    let said = s.m.last_error.clone().unwrap();
    assert!(said.starts_with("health check failed"), "{said}");
    assert!(
        said.contains("(pid 42) has not exited 22 s after SIGKILL"),
        "{said}"
    );
    assert!(s.has(|f| matches!(f, Effect::Log(l) if *l == said)));
    s.advance(secs(60));
    assert_eq!(s.m.last_error.as_deref(), Some(&*said), "said once");
    assert!(
        !s.has(|f| matches!(f, Effect::Log(_))),
        "said once: {:?}",
        s.fx
    );
    assert!(!s.has(|f| matches!(f, Effect::Spawn { .. })));
    // Its exit at last: the retry goes.
    s.ev(Event::ChildExited {
        proc_gen: s.m.proc_gen,
        status: "signal: 9 (SIGKILL)".into(),
        cause: None,
    });
    s.advance(secs(8));
    assert!(
        matches!(s.m.phase, Phase::Starting { .. }),
        "{:?}",
        s.m.phase
    );
}

/// An engine that exits at once (a refused flag) can have its exit seen
/// before its spawn is reported: the model fails with nothing left of its
/// engine, and the late `Spawned` does not make it wait for an exit that
/// was already seen (it stayed failed for ever, its share counted).
#[test]
fn an_exit_seen_before_its_spawn_does_not_leave_the_model_waiting_for_it() {
    let mut s = Sim::new(Preload::Awake);
    let current = s.m.proc_gen;
    exited(&mut s, current);
    assert_eq!(failed_gone(&s.m), Some(true), "{:?}", s.m.phase);
    s.ev(Event::Spawned {
        proc_gen: current,
        pid: 42,
    });
    assert_eq!(failed_gone(&s.m), Some(true), "{:?}", s.m.phase);
    s.advance(secs(1));
    assert!(
        matches!(s.m.phase, Phase::Starting { .. }),
        "{:?}",
        s.m.phase
    );
}

/// A model whose engine keeps crashing (out of memory on each start) is
/// retried with backoff; once nothing waits for it and it has been idle
/// past its stop tier, the tier ends the retries (it was restarted every
/// few minutes for ever, and idle tiers never fired). The next request
/// starts it again.
#[test]
fn a_failing_model_nobody_waits_for_is_stopped_by_its_stop_tier() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    let spawns = std::cell::Cell::new(0);
    let crash_once = |s: &mut Sim| crash(s, &spawns);
    // Serving: a request in flight, then the crash.
    s.report(1, 0);
    crash_once(&mut s);
    assert!(matches!(s.m.phase, Phase::Failed { .. }), "{:?}", s.m.phase);
    for _ in 0..60 {
        s.advance(secs(1));
        crash_once(&mut s);
        if s.m.phase == Phase::Stopped {
            break;
        }
    }
    assert!(spawns.get() >= 3, "{}", spawns.get());
    assert_eq!(s.m.phase, Phase::Stopped, "{:?}", s.m);
    assert_eq!(s.m.intent.desired, Desired::Stopped);
    stays_stopped_until_a_request(&mut s, &spawns);
}

/// Stopped by its stop tier: no retry for ten minutes; the next request
/// starts it again.
fn stays_stopped_until_a_request(s: &mut Sim, spawns: &std::cell::Cell<u32>) {
    let before = spawns.get();
    for _ in 0..600 {
        s.advance(secs(1));
        crash(s, spawns);
    }
    assert_eq!(spawns.get(), before, "retried after its stop tier");
    s.ev(Event::Demand);
    assert!(
        matches!(s.m.phase, Phase::Starting { .. }),
        "{:?}",
        s.m.phase
    );
}

/// Spawns what is asked (counted in `spawns`) and lets it crash at once.
fn crash(s: &mut Sim, spawns: &std::cell::Cell<u32>) {
    if let Phase::Starting { spawned: false, .. } = s.m.phase {
        spawns.set(spawns.get() + 1);
        s.ev(Event::Spawned {
            proc_gen: s.m.proc_gen,
            pid: 42,
        });
    }
    if s.m.pid.is_some() {
        let current = s.m.proc_gen;
        exited(s, current);
    }
}

/// A stopped model woken by requests whose engine fails on every start:
/// retried while demands keep coming; once none has come for its stop
/// tier's time, the tier ends the retries. Before, a demand never served
/// counted as waiting for ever: no tier fired and it was retried without
/// end. The next request starts it again.
#[test]
fn a_failing_model_woken_by_requests_is_stopped_once_they_stop_coming() {
    let mut s = Sim::new(Preload::None);
    let spawns = std::cell::Cell::new(0);
    s.ev(Event::Demand);
    // Requests keep coming for longer than every tier.
    for _ in 0..45 {
        crash(&mut s, &spawns);
        s.advance(secs(1));
        s.ev(Event::Demand);
    }
    assert_ne!(s.m.intent.desired, Desired::Stopped, "{:?}", s.m);
    assert!(spawns.get() >= 5, "{}", spawns.get());
    // They stop: the stop tier (30 s) ends the retries.
    for _ in 0..60 {
        s.advance(secs(1));
        crash(&mut s, &spawns);
        if s.m.phase == Phase::Stopped {
            break;
        }
    }
    assert_eq!(
        (s.m.phase, s.m.intent.desired),
        (Phase::Stopped, Desired::Stopped),
        "{:?}",
        s.m
    );
    stays_stopped_until_a_request(&mut s, &spawns);
}

/// Someone else's SIGTERM: vLLM closes its listener and finishes (with
/// `--shutdown-timeout`) what it runs. A refused probe with answers under
/// way drains and restarts it (no kill to cut them); with none under way
/// it is an engine that does not listen: strikes, failed, killed.
#[test]
fn a_refused_probe_with_answers_under_way_drains_and_restarts_the_engine() {
    let refused = |s: &mut Sim| {
        s.ev(Event::HealthFailed {
            epoch: s.m.epoch,
            error: "GET /health: connection refused".into(),
            timed_out: false,
            refused: true,
        });
    };
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers.clear();
    s.boot();
    let proc_gen = s.m.proc_gen;
    s.report(2, 0);
    refused(&mut s);
    assert!(
        matches!(s.m.phase, Phase::Draining { .. }),
        "{:?}",
        s.m.phase
    );
    assert!(!s.has(|f| matches!(f, Effect::Kill | Effect::Terminate { .. })));
    assert!(s.has(|f| matches!(f, Effect::Drain { .. })));
    assert!(s.has(
        |f| matches!(f, Effect::Log(l) if l.contains("refuses connections with 2 answer(s) under way"))
    ));
    assert!(s.m.restart_asked.is_some());
    // It exits once its answers are done, on its own: started again.
    s.ev(Event::ChildExited {
        proc_gen,
        status: "exit status: 0".into(),
        cause: None,
    });
    assert!(s.has(|f| matches!(f, Effect::Spawn { .. })), "{:?}", s.fx);
    assert_eq!(s.m.failures, 0);

    // One that crashes while drained (a non-zero status): failed as a
    // crash, counted and backed off, its last words shown (it was taken
    // for stopped and restarted at once, leaving no trace).
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers.clear();
    s.boot();
    let proc_gen = s.m.proc_gen;
    s.report(2, 0);
    refused(&mut s);
    s.ev(Event::ChildExited {
        proc_gen,
        status: "exit status: 1".into(),
        cause: Some("RuntimeError: boom".into()),
    });
    assert!(matches!(s.m.phase, Phase::Failed { .. }), "{:?}", s.m.phase);
    assert_eq!(s.m.failures, 1);
    assert_eq!(
        s.m.last_error.as_deref(),
        Some("engine exited while draining (exit status: 1): RuntimeError: boom")
    );
    // Ended by the SIGTERM someone sent it, or an adopted engine's exit
    // whose status is not known: a stop, as before. A SIGKILL: a crash.
    for (status, crash) in [
        ("signal: 15 (SIGTERM)", false),
        ("exited (adopted engine: exit status unknown)", false),
        ("signal: 9 (SIGKILL)", true),
    ] {
        let mut s = Sim::new(Preload::Awake);
        s.m.settings.tiers.clear();
        s.boot();
        let proc_gen = s.m.proc_gen;
        s.report(2, 0);
        refused(&mut s);
        s.ev(Event::ChildExited {
            proc_gen,
            status: status.into(),
            cause: None,
        });
        assert_eq!(s.m.failures, u32::from(crash), "{status}: {:?}", s.m.phase);
        assert_eq!(
            s.has(|f| matches!(f, Effect::Spawn { .. })),
            !crash,
            "{status}"
        );
    }

    // Nothing under way: the strikes fail it as before.
    let mut s = Sim::new(Preload::Awake);
    s.m.settings.tiers.clear();
    s.boot();
    for _ in 0..HEALTH_STRIKES {
        refused(&mut s);
    }
    assert!(matches!(s.m.phase, Phase::Failed { .. }), "{:?}", s.m.phase);
    assert!(s.has(|f| matches!(f, Effect::Kill)));
}

/// An engine found asleep while taken as awake drops the running gauge of
/// its last awake poll (no poll reads it while asleep). Before, the model
/// counted those requests in flight for ever: a wake that then gave up for
/// lack of room left it asleep with a phantom load, its stop tier never
/// fired and admission could never stop it (asleep victims need nothing
/// in flight).
#[test]
fn an_engine_found_asleep_does_not_keep_a_phantom_load() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    // Last awake poll: two requests running.
    s.ev(Event::EngineMetrics { running: 2 });
    assert_eq!(s.m.in_flight(), 2);
    // They finish, someone (or a sleep siesta did not see end) puts the
    // engine to sleep; the next polls find it asleep.
    s.ev(Event::FoundAsleep {
        epoch: s.m.epoch,
        level: 1,
    });
    // Wanted awake: a wake, which finds no room within ROOM_WAIT.
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
    s.advance(ROOM_WAIT);
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    assert_eq!(
        s.m.in_flight(),
        0,
        "asleep with a phantom load of {} request(s) from the engine's last awake poll",
        s.m.in_flight()
    );
}

/// Same, seen through what the phantom load blocked: admission's stop of
/// an asleep victim.
#[test]
fn an_engine_found_asleep_after_a_busy_poll_can_be_stopped_to_make_room() {
    let mut s = Sim::new(Preload::Awake);
    s.boot();
    s.ev(Event::EngineMetrics { running: 1 });
    s.ev(Event::FoundAsleep {
        epoch: s.m.epoch,
        level: 1,
    });
    s.advance(ROOM_WAIT);
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    s.ev(Event::Evict);
    assert_eq!(
        s.m.intent.desired,
        Desired::Stopped,
        "an asleep, idle, unpinned model asked to make room is stopped"
    );
}
