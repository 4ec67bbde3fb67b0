use super::*;
use crate::config::Config;
use crate::config::{IdleAction, IdleTier, Preload};
use crate::reconciler::{
    Desired, Effect, Event, ModelState, Observed, Phase, Pin, Reason, Settings, adopt, next_tier,
    step,
};
use crate::status::Clock;
use records::AverageRecord;
use tokio::time::Instant;

/// `b`'s engine record removed if it is still the one tagged `t`, the
/// record read with `committed` (as an engine's exit removes its own).
fn remove_b_if_tagged_t(
    s: &Store,
    committed: impl Fn() -> Option<Vec<u8>>,
) -> Option<super::writer::Committed> {
    let ours = |b: Option<&[u8]>| {
        b.and_then(|b| serde_json::from_slice::<EngineRecord>(b).ok())
            .is_some_and(|r| r.tag == "t")
    };
    let delete = super::writer::Op::Delete {
        tables: vec![ENGINES],
        key: "b".into(),
    };
    s.writes.submit_if((ENGINES, "b"), ours, committed, delete)
}

pub(super) fn engine(pid: u32, proc_gen: u64) -> EngineRecord {
    EngineRecord {
        pid,
        pgid: pid,
        port: 8101,
        start_time: 12345,
        command_hash: "abc".into(),
        tag: "t".into(),
        proc_gen,
        sleep_level: 0,
        suspended: false,
        suspended_pids: Vec::new(),
        spawned_unix_ms: 1,
        gpus: Vec::new(),
    }
}

#[test]
fn intents_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Clock::new();
    let cfg = Config::demo(vec!["x".into()]);
    let settings = Settings::from_config(&cfg.models[0]);
    let mut m = ModelState::new(settings.clone(), cfg.models[0].preload, Instant::now());
    m.intent.desired = Desired::Asleep(2);
    m.intent.reason = Reason::Operator;
    m.pin = Pin::Forever;
    {
        let store = Store::open(dir.path()).unwrap();
        store.set("chat", IntentRecord::from_state(&m, &clock));
    }
    let again = Store::open(dir.path()).unwrap();
    assert!(again.moved_aside().is_none());
    let rec = again.get("chat").unwrap();
    let mut fresh = ModelState::new(settings, cfg.models[0].preload, Instant::now());
    rec.restore(&mut fresh, &clock);
    assert_eq!(fresh.intent.desired, Desired::Asleep(2));
    assert_eq!(fresh.intent.reason, Reason::Operator);
    assert_eq!(fresh.pin, Pin::Forever);
}

#[test]
fn engine_records_and_calibration_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = Store::open(dir.path()).unwrap();
        assert!(s.set_engine("a", &engine(10, 1)));
        assert!(s.set_engine("b", &engine(11, 3)));
        let cal = CalibrationRecord {
            start: AverageRecord {
                ms: 1500.0,
                samples: 2,
            },
            ..Default::default()
        };
        s.set_calibration("a", &cal);
        // The record of another engine is kept, even of the same
        // generation (an engine of an earlier daemon, stopped late).
        s.remove_engine("b", "t-of-an-earlier-daemon");
        assert!(s.engine("b").is_some());
        s.remove_engine("b", "t");
        assert!(s.engine("b").is_none());
    }
    let s = Store::open(dir.path()).unwrap();
    assert_eq!(s.engines(), vec![("a".to_string(), engine(10, 1))]);
    assert_eq!(s.calibration("a").unwrap().start.samples, 2);
    assert!(s.set("a", intent(1)));
    assert_eq!(s.intent_names(), ["a"]);
    assert!(s.forget("a").wait_blocking());
    assert!(s.get("a").is_none() && s.calibration("a").is_none());
    assert!(
        s.engine("a").is_some(),
        "engine record kept until it is gone"
    );
    assert!(s.remove("a").wait_blocking());
    assert!(s.engine("a").is_none());
}

#[test]
fn restarts_and_last_activity_survive_into_an_adopting_state() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Clock::new();
    let cfg = Config::demo(vec!["x".into()]);
    let settings = Settings::from_config(&cfg.models[0]);
    let mut m = ModelState::new(settings.clone(), cfg.models[0].preload, Instant::now());
    m.restarts = 3;
    m.last_activity = Some(Instant::now() - std::time::Duration::from_secs(7));
    let at = clock.unix_ms(m.last_activity.unwrap());
    {
        let store = Store::open(dir.path()).unwrap();
        store.set("chat", IntentRecord::from_state(&m, &clock));
    }
    let rec = Store::open(dir.path()).unwrap().get("chat").unwrap();
    assert_eq!((rec.restarts, rec.last_activity_unix_ms), (3, at));
    // A fresh state (config intent: not restored) still gets the history.
    let mut fresh = ModelState::new(settings, cfg.models[0].preload, Instant::now());
    rec.restore(&mut fresh, &clock);
    assert_eq!((fresh.restarts, fresh.last_activity), (0, None));
    rec.restore_history(&mut fresh, &clock);
    assert_eq!(fresh.restarts, 3);
    assert_eq!(clock.unix_ms(fresh.last_activity.unwrap()), at);
}

/// Steps `m` with `event` at `now` and writes its record when the runner
/// would (`Persist`, `PersistHistory`).
fn step_and_persist(store: &Store, clock: &Clock, m: &mut ModelState, event: Event, now: Instant) {
    let (next, fx) = step(m.clone(), event, now);
    *m = next;
    if fx.contains(&Effect::Persist) || fx.contains(&Effect::PersistHistory) {
        store.set("chat", IntentRecord::from_state(m, clock));
    }
}

/// A control plane restarted while its engine runs adopts the engine, and
/// the engine's idle clock goes on from where it was (its readiness, its
/// last request), not from the daemon's start: a 15-minute tier of an
/// engine idle for 14 fired 15 minutes after the restart, and a control
/// plane restarted more often than a tier (a daily `stop`, a 3 h level 2)
/// never let that tier fire.
#[test]
fn an_adopted_engine_keeps_its_idle_clock() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Clock::new();
    let cfg = Config::demo(vec!["x".into()]);
    let mut settings = Settings::from_config(&cfg.models[0]);
    let min = |n: u64| std::time::Duration::from_secs(60 * n);
    settings.tiers = vec![
        IdleTier {
            after: min(15),
            action: IdleAction::Sleep(1),
        },
        IdleTier {
            after: min(180),
            action: IdleAction::Sleep(2),
        },
    ];
    let t0 = Instant::now();
    let ready = t0 + min(1);
    let near = |a: Instant, b: Instant| a.max(b) - a.min(b) <= std::time::Duration::from_millis(2);
    {
        // Started for a request, ready a minute later, not used since.
        let store = Store::open(dir.path()).unwrap();
        let mut m = ModelState::new(settings.clone(), Preload::None, t0);
        step_and_persist(&store, &clock, &mut m, Event::Demand, t0);
        let (proc_gen, pid) = (m.proc_gen, 42);
        step_and_persist(&store, &clock, &mut m, Event::Spawned { proc_gen, pid }, t0);
        let epoch = m.epoch;
        let ok = Event::HealthOk {
            epoch,
            asleep: None,
        };
        step_and_persist(&store, &clock, &mut m, ok, ready);
        assert_eq!(m.phase, Phase::Awake);
        assert_eq!(next_tier(&m, ready).unwrap().1, ready + min(15));
    }
    // Restarted 14 minutes after the engine became ready: it is adopted awake.
    let restart = ready + min(14);
    let adopted = |observed: Observed, at: Instant| {
        let rec = Store::open(dir.path()).unwrap().get("chat").unwrap();
        let mut m = ModelState::new(settings.clone(), Preload::None, at);
        rec.restore(&mut m, &clock);
        rec.restore_history(&mut m, &clock);
        adopt(&mut m, 1, 42, observed, at);
        m
    };
    let m = adopted(Observed::Awake, restart);
    let (tier, at) = next_tier(&m, restart).unwrap();
    assert_eq!(tier.action, IdleAction::Sleep(1));
    assert!(
        near(at, ready + min(15)),
        "the first tier fires {:?} after the restart, not 1 min",
        at - restart
    );
    // Its tier puts it to sleep; a restart 2 h later finds it asleep, and
    // level 2 still comes 3 h after its last use.
    let store = Store::open(dir.path()).unwrap();
    let mut m = m;
    step_and_persist(&store, &clock, &mut m, Event::Tick, at);
    assert!(
        matches!(m.phase, Phase::Sleeping { level: 1, .. }),
        "{:?}",
        m.phase
    );
    let epoch = m.epoch;
    step_and_persist(&store, &clock, &mut m, Event::SleepDone { epoch }, at);
    drop(store);
    let restart = ready + min(120);
    let m = adopted(Observed::Asleep(1), restart);
    let (tier, at) = next_tier(&m, restart).unwrap();
    assert_eq!(tier.action, IdleAction::Sleep(2));
    assert!(
        near(at, ready + min(180)),
        "level 2 comes {:?} after the restart, not 1 h",
        at - restart
    );
}

#[test]
fn intent_records_written_before_the_history_fields_still_load() {
    let old = r#"{"desired":"asleep","level":1,"reason":"idle_tier","since_unix_ms":5}"#;
    let rec: IntentRecord = serde_json::from_str(old).unwrap();
    assert_eq!((rec.restarts, rec.last_activity_unix_ms), (0, 0));
    assert_eq!(rec.desired, "asleep");
}

#[test]
fn a_corrupt_store_is_moved_aside_not_reset_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(FILE_NAME);
    let garbage = vec![0x5au8; 8192];
    std::fs::write(&path, &garbage).unwrap();
    let s = Store::open(dir.path()).unwrap();
    let aside = s.moved_aside().expect("moved aside").to_path_buf();
    assert!(
        aside
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("siesta.redb.corrupt-"),
        "{}",
        aside.display()
    );
    // The old bytes are kept intact for inspection.
    assert_eq!(std::fs::read(&aside).unwrap(), garbage);
    assert!(s.set_engine("a", &engine(1, 1)));
}

#[test]
fn an_incompatible_schema_is_moved_aside() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(FILE_NAME);
    {
        let db = redb::Database::create(&path).unwrap();
        let tx = db.begin_write().unwrap();
        tx.open_table(META)
            .unwrap()
            .insert("schema_version", 99)
            .unwrap();
        tx.commit().unwrap();
    }
    let s = Store::open(dir.path()).unwrap();
    let aside = s.moved_aside().expect("moved aside");
    assert!(aside.to_string_lossy().contains("incompatible-"));
    assert!(s.engines().is_empty());
}

#[test]
fn an_unusable_state_dir_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, "x").unwrap();
    let state = file.join("state");
    let e = Store::open(&state).unwrap_err();
    assert!(e.to_string().contains(&*state.to_string_lossy()), "{e}");
    // Nothing was touched.
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "x");
}

#[test]
fn a_store_in_use_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _first = Store::open(dir.path()).unwrap();
    let e = Store::open(dir.path()).unwrap_err();
    assert!(matches!(e, StoreError::InUse(_)), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_work_from_workers_blocking_threads_and_block_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let s = tokio::task::spawn_blocking(move || {
        let s = Store::open(&path).unwrap();
        assert!(s.set_engine("blocking", &engine(3, 1)));
        s
    })
    .await
    .unwrap();
    let s2 = s.clone();
    tokio::spawn(async move { assert!(s2.set_engine("w", &engine(1, 1))) })
        .await
        .unwrap();
    assert!(s.set_engine("main", &engine(2, 1)));
    assert_eq!(s.engines().len(), 3);
}

pub(super) fn intent(since_unix_ms: i64) -> IntentRecord {
    IntentRecord {
        desired: "awake".into(),
        level: 0,
        reason: "config".into(),
        since_unix_ms,
        until_unix_ms: 0,
        pinned_until_unix_ms: 0,
        restarts: 0,
        last_activity_unix_ms: 0,
        idle_floor_unix_ms: 0,
        restart_asked_unix_ms: 0,
    }
}

/// 1,000 model tasks writing at once (a daemon starting with 1,000
/// models) are committed together, a few transactions in all, while the
/// tasks await without taking a thread each: the runtime's two workers
/// carry them all. Each write waited for its own transaction in
/// `block_in_place` before (1,000 commits, and a new thread for every
/// task waiting its turn).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_from_many_tasks_at_once_commit_together() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(dir.path()).unwrap();
    let tasks: Vec<_> = (0..1000)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move { s.set_soon(&format!("m{i}"), intent(i)).wait().await })
        })
        .collect();
    for t in tasks {
        assert!(t.await.unwrap());
    }
    let commits = s.writes.commits();
    assert!(commits <= 500, "{commits} transactions for 1,000 writes");
    drop(s);
    let again = Store::open(dir.path()).unwrap();
    assert_eq!(again.intent_names().len(), 1000);
    assert_eq!(again.get("m999"), Some(intent(999)));
}

/// With the writer held still: a queued write is read back at once, a
/// record equal only to what is queued is
/// written again (that commit may still fail) while one equal to the
/// committed record is not, and what is queued when the store closes is
/// committed before its writer ends.
#[test]
fn queued_writes_are_read_back_and_committed_when_the_store_closes() {
    let dir = tempfile::tempdir().unwrap();
    let newer = EngineRecord {
        tag: "t2".into(),
        ..engine(5, 2)
    };
    {
        let s = Store::open(dir.path()).unwrap();
        assert!(s.set("a", intent(1)));
        assert!(s.set_engine("b", &engine(4, 1)));
        assert!(s.set_soon("a", intent(1)).is_already());
        let held = s.writes.pause();
        drop(s.set_soon("a", intent(2)));
        assert_eq!(s.get("a"), Some(intent(2)));
        let again = s.set_soon("a", intent(1));
        assert!(
            !again.is_already(),
            "equal to the committed, not to the queued"
        );
        drop(again);
        assert_eq!(s.get("a"), Some(intent(1)));
        drop(s.set_soon("b", intent(7)));
        s.set_calibration("b", &CalibrationRecord::default());
        assert!(s.calibration("b").is_some());
        // An engine's exit removes its own record, not a newer one queued
        // for the model (tag "t2"), nor the committed one (tag "t") once
        // the newer is queued.
        drop(s.set_engine_soon("b", &newer));
        s.remove_engine("b", "t");
        assert_eq!(s.engine("b"), Some(newer.clone()));
        assert_eq!(s.writes.commits(), 2, "nothing committed while held");
        s.writes.close();
        drop(held);
    }
    let s = Store::open(dir.path()).unwrap();
    assert_eq!(s.get("a"), Some(intent(1)));
    assert_eq!(s.get("b"), Some(intent(7)));
    assert!(s.calibration("b").is_some());
    assert_eq!(s.engine("b"), Some(newer));
}

/// Engine records from before the GPUs were recorded still load (no GPUs:
/// their models are placed afresh at start-up, as before); new ones give
/// start-up placement where their engines run.
#[test]
fn engine_records_without_gpus_load_and_are_not_kept() {
    let old = r#"{"pid":7,"pgid":7,"port":8101,"start_time":1,"command_hash":"abc",
        "tag":"t","proc_gen":1,"spawned_unix_ms":1}"#;
    let rec: EngineRecord = serde_json::from_str(old).unwrap();
    assert!(rec.gpus.is_empty());
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    assert!(store.set_engine("old", &rec));
    let mut new = engine(8, 1);
    new.gpus = vec![1, 2];
    assert!(store.set_engine("new", &new));
    assert_eq!(
        store.engine_gpus(),
        BTreeMap::from([("new".to_string(), vec![1, 2])])
    );
    assert_eq!(store.engine("new").unwrap().gpus, [1, 2]);
}

/// A conditional write (an engine's exit removing its own record) reads
/// the file outside the queue's lock, and sees a round that commits the
/// same key between that read and the queueing: the record of a newer
/// engine committed meanwhile is not removed. (The read was under the
/// lock before: a write from inside it could not even be queued.)
#[test]
fn a_conditional_write_sees_a_commit_that_lands_while_it_reads_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(dir.path()).unwrap();
    assert!(s.set_engine("b", &engine(4, 1)));
    let newer = EngineRecord {
        tag: "t2".into(),
        ..engine(5, 2)
    };
    let (done, result) = std::sync::mpsc::channel();
    let (s2, newer2) = (s.clone(), newer.clone());
    std::thread::spawn(move || {
        let reads = std::cell::Cell::new(0);
        let committed = || {
            let before = s2.read_committed(ENGINES, "b");
            if reads.replace(reads.get() + 1) == 0 {
                // A newer engine's record, committed after this read.
                assert!(s2.set_engine("b", &newer2));
            }
            before
        };
        let queued = remove_b_if_tagged_t(&s2, committed);
        let _ = done.send((queued.is_some(), reads.get()));
    });
    let Ok((queued, reads)) = result.recv_timeout(std::time::Duration::from_secs(30)) else {
        // The store's lock is held for good: dropping it would wait too.
        std::mem::forget(s);
        panic!("the conditional write did not return: it read the file under the queue's lock");
    };
    assert!(!queued, "the newer engine's record would have been removed");
    assert_eq!(
        reads, 2,
        "the file read again after the round that ended meanwhile"
    );
    assert_eq!(s.engine("b"), Some(newer));
}

/// A conditional write whose every read of the file outside the queue's
/// lock sees a round end (other keys committed meanwhile, as when many
/// engines exit at once) still ends: after `READS_OUTSIDE` reads it reads
/// the file under the lock. The read after them commits from another
/// thread and waits for it: under the lock that commit waits, so none
/// lands before the write returns. Without the bound every read would
/// commit again and the write would never return.
#[test]
fn a_conditional_write_ends_though_a_round_ends_during_every_read() {
    use super::writer::READS_OUTSIDE;
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(dir.path()).unwrap();
    assert!(s.set_engine("b", &engine(4, 1)));
    let (done, result) = std::sync::mpsc::channel();
    let s2 = s.clone();
    std::thread::spawn(move || {
        let reads = std::cell::Cell::new(0u32);
        let landed_under_lock = std::cell::Cell::new(0u32);
        let committed = || {
            let before = s2.read_committed(ENGINES, "b");
            let n = reads.get();
            reads.set(n + 1);
            let other = format!("other-{n}");
            if n < READS_OUTSIDE {
                assert!(s2.set_engine(&other, &engine(9, 1)));
            } else {
                let (landed, is_landed) = std::sync::mpsc::channel();
                let s3 = s2.clone();
                std::thread::spawn(move || {
                    let _ = landed.send(s3.set_engine(&other, &engine(9, 1)));
                });
                if is_landed.recv_timeout(Duration::from_millis(300)).is_ok() {
                    landed_under_lock.set(landed_under_lock.get() + 1);
                }
            }
            before
        };
        let queued = remove_b_if_tagged_t(&s2, committed);
        let waited = queued.map(Committed::wait_blocking);
        let _ = done.send((waited, reads.get(), landed_under_lock.get()));
    });
    let Ok((waited, reads, landed)) = result.recv_timeout(Duration::from_secs(30)) else {
        std::mem::forget(s);
        panic!("the conditional write did not return: a round ended during every read");
    };
    assert_eq!(waited, Some(true), "the engine's own record is removed");
    assert_eq!(reads, READS_OUTSIDE + 1);
    assert_eq!(
        landed, 0,
        "the last read was not under the queue's lock: a commit landed during it"
    );
    assert_eq!(s.engine("b"), None);
}

/// A writer that does not get through (the disk stops answering: here the
/// writer is held): a task's wait for its write ends after its limit,
/// false, as after a failed write, instead of stopping the model's task
/// (deadlines and all) for as long as the disk hangs. The write stays
/// queued, is read back meanwhile, and lands once the writer goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
// The guard held across the waits is the stuck disk: the writer thread
// waits on it, no task does.
#[allow(clippy::await_holding_lock)]
async fn a_wait_for_a_commit_that_does_not_come_ends() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(dir.path()).unwrap();
    let held = s.writes.pause();
    let limit = std::time::Duration::from_millis(300);
    let wait = s.set_soon("a", intent(1)).wait_within(limit);
    let waited = tokio::time::timeout(std::time::Duration::from_secs(20), wait)
        .await
        .expect("the wait ended");
    assert!(!waited, "not committed");
    assert_eq!(s.get("a"), Some(intent(1)), "read back while queued");
    drop(held);
    assert!(s.set_soon("b", intent(2)).wait().await);
    drop(s);
    let s = Store::open(dir.path()).unwrap();
    assert_eq!(s.get("a"), Some(intent(1)), "it landed");
}

/// A model changed by a reload has its records forgotten and its intent
/// written in one transaction (two before: a crash between them lost the
/// operator's stop or pin).
#[test]
fn a_replaced_intent_is_one_transaction_that_forgets_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(dir.path()).unwrap();
    assert!(s.set("a", intent(1)));
    assert!(s.set_engine("a", &engine(4, 1)));
    s.set_calibration("a", &CalibrationRecord::default());
    assert!(s.writes.submit(Vec::new()).wait_blocking());
    let before = s.writes.commits();
    assert!(s.replace("a", &intent(9)).wait_blocking());
    assert_eq!(s.writes.commits(), before + 1);
    assert_eq!(s.get("a"), Some(intent(9)));
    assert_eq!(s.engine("a"), None);
    assert!(s.calibration("a").is_none());
    drop(s);
    let again = Store::open(dir.path()).unwrap();
    assert_eq!(again.get("a"), Some(intent(9)));
    assert_eq!(again.engine("a"), None);
}
