//! The model task under paused time: timers, deadlines and backoff driven by
//! the real runner (the engine's URL refuses connections).

use super::*;
use crate::config::Config;
use crate::status::State;

/// The model tasks' shared state over a store in `dir` (also for the
/// models' tests).
pub(crate) fn shared(dir: &std::path::Path) -> Arc<Shared> {
    let clock = Clock::new();
    Arc::new(Shared {
        hub: Hub::new(clock, 100, 100),
        clock,
        locks: GpuLocks::default(),
        store: Store::open(dir).unwrap(),
        log_dir: dir.join("logs"),
        control_id: "test".into(),
        poll_every: Duration::from_secs(1),
        cuda_checkpoint: crate::checkpoint::default_tool(),
        stop_engines_on_exit: false,
        admission: crate::admission::Admission::open(),
        engine_idle_timeout: crate::engine::DEFAULT_IDLE_TIMEOUT,
        fences: Default::default(),
        stop_bound: Default::default(),
        ports: Default::default(),
    })
}

/// An attach model `name` of the engine at `url`, on no GPU.
fn attach(name: &str, url: &str) -> crate::config::ModelConfig {
    let text =
        format!("[[model]]\nname = \"{name}\"\nlaunch = \"attach\"\nurl = \"{url}\"\ngpus = 0\n");
    Config::parse(&text, "t.toml").unwrap().models.remove(0)
}

#[tokio::test(start_paused = true)]
async fn start_deadline_then_capped_backoff_retries() {
    let dir = tempfile::tempdir().unwrap();
    let text = r#"
[[model]]
name = "ext"
launch = "attach"
url = "http://127.0.0.1:9"
gpus = 0
start_timeout = "10m"
backoff_initial = "1m"
backoff_max = "2m"
"#;
    let cfg = Config::parse(text, "t.toml").unwrap().models.remove(0);
    let cancel = CancellationToken::new();
    let h = spawn_model(cfg, Placed::default(), shared(dir.path()), cancel.clone()).unwrap();
    let mut rx = h.status.clone();
    let started = Instant::now();
    rx.wait_for(|s| s.state == State::Starting).await.unwrap();
    let s = rx
        .wait_for(|s| s.state == State::Failed)
        .await
        .unwrap()
        .clone();
    assert!(started.elapsed() >= Duration::from_secs(600));
    assert_eq!(s.last_error.as_deref(), Some("start timed out"));
    assert_eq!(s.retry_at_unix_ms.unwrap() - s.state_since_unix_ms, 60_000);
    // Retried after the backoff, fails again, then the delay is capped.
    let mut delays = vec![];
    for _ in 0..3 {
        rx.wait_for(|s| s.state == State::Starting).await.unwrap();
        let s = rx
            .wait_for(|s| s.state == State::Failed)
            .await
            .unwrap()
            .clone();
        delays.push((s.retry_at_unix_ms.unwrap() - s.state_since_unix_ms) / 1000);
    }
    assert_eq!(delays, [120, 120, 120]);
    assert_eq!(h.status.borrow().failures, 4);
    cancel.cancel();
    h.join().await;
}

/// A reload that changes only siesta's own settings hands the task its new
/// `ModelConfig` in place: a timeout applies to the next operation, not to
/// the one under way; a new backoff to the next failure.
#[tokio::test(start_paused = true)]
async fn new_timeouts_and_backoff_apply_from_the_next_operation() {
    let dir = tempfile::tempdir().unwrap();
    let text = |start: &str, backoff: &str| {
        format!(
            "[[model]]\nname = \"ext\"\nlaunch = \"attach\"\nurl = \"http://127.0.0.1:9\"\n\
             gpus = 0\nstart_timeout = \"{start}\"\nbackoff_initial = \"{backoff}\"\n\
             backoff_max = \"10m\"\n"
        )
    };
    let parse = |t: String| Config::parse(&t, "t.toml").unwrap().models.remove(0);
    let cancel = CancellationToken::new();
    let h = spawn_model(
        parse(text("10m", "1m")),
        Placed::default(),
        shared(dir.path()),
        cancel.clone(),
    )
    .unwrap();
    let mut rx = h.status.clone();
    let started = Instant::now();
    rx.wait_for(|s| s.state == State::Starting).await.unwrap();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let new = Arc::new(parse(text("2m", "5m")));
    h.reconfigure(new.clone());
    assert_eq!(h.cfg(), new);
    // The start under way keeps its 10 min.
    let s = rx
        .wait_for(|s| s.state == State::Failed)
        .await
        .unwrap()
        .clone();
    assert!(started.elapsed() >= Duration::from_secs(600), "{s:#?}");
    assert_eq!(s.last_error.as_deref(), Some("start timed out"));
    // The new backoff, then the new start timeout.
    assert_eq!(s.retry_at_unix_ms.unwrap() - s.state_since_unix_ms, 300_000);
    rx.wait_for(|s| s.state == State::Starting).await.unwrap();
    let again = Instant::now();
    rx.wait_for(|s| s.state == State::Failed).await.unwrap();
    let took = again.elapsed();
    assert!(
        took >= Duration::from_secs(120) && took < Duration::from_secs(130),
        "{took:?}"
    );
    cancel.cancel();
    h.join().await;
}

/// A model (`sh` sleeping, `extra` TOML lines added) whose spawn waits for
/// GPU 0's start lock, held by "someone else" (the returned guard): its
/// task, once Starting.
async fn waiting_for_the_start_lock(
    dir: &std::path::Path,
    extra: &str,
) -> (
    ModelHandle,
    crate::supervisor::StartGuards,
    CancellationToken,
    tokio::sync::watch::Receiver<ModelStatus>,
) {
    let text = format!(
        "[[model]]\nname = \"m\"\nmodel = \"m\"\n\
         command = [\"sh\", \"-c\", \"exec sleep 60\", \"engine\"]\n\
         gpus = 0\npreload = \"awake\"\n{extra}\n"
    );
    let cfg = Config::parse(&text, "t.toml").unwrap().models.remove(0);
    let shared = shared(dir);
    let held = shared.locks.acquire(&[0]).await;
    let placed = Placed {
        gpus: vec![0],
        ..Placed::default()
    };
    let cancel = CancellationToken::new();
    let h = spawn_model(cfg, placed, shared, cancel.clone()).unwrap();
    let mut rx = h.status.clone();
    rx.wait_for(|s| s.state == State::Starting).await.unwrap();
    (h, held, cancel, rx)
}

/// A restart while the first spawn still waits for the GPU's start lock
/// cancels that spawn: once the lock is free only the new generation's
/// engine is launched (the lock is FIFO, so a stale spawn would go first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_before_the_spawn_lands_launches_one_engine() {
    let dir = tempfile::tempdir().unwrap();
    // Someone else is starting on GPU 0: the model's spawn waits.
    let (h, held, cancel, mut rx) =
        waiting_for_the_start_lock(dir.path(), "stop_grace = \"5s\"").await;
    let s = h
        .send(Event::Command(crate::reconciler::Command::Restart))
        .await
        .unwrap();
    assert_eq!((s.state, s.pid), (State::Starting, None), "{s:?}");
    drop(held);
    let s = tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|s| s.pid.is_some()))
        .await
        .expect("the engine is spawned once the lock is free")
        .unwrap()
        .clone();
    let spawns: Vec<String> = h
        .logs
        .tail(None)
        .0
        .into_iter()
        .filter(|l| l.line.starts_with("spawning:"))
        .map(|l| l.line)
        .collect();
    assert_eq!(spawns.len(), 1, "{spawns:#?}");
    let pid = s.pid.unwrap();
    assert!(supervisor_alive(pid));
    h.shutdown(true).await;
    assert!(!supervisor_alive(pid));
    cancel.cancel();
}

/// A start that has room (admission answered) and then waits for the
/// start lock longer than a wait for room may last is not given up for
/// want of room: the spawn reports the answer (`Admitted`), and the lock's
/// wait runs on the start timeout.
#[tokio::test(start_paused = true)]
async fn a_start_admitted_then_waiting_for_the_start_lock_is_not_given_up_for_room() {
    let dir = tempfile::tempdir().unwrap();
    // Someone else is starting on GPU 0 all along: the spawn never comes.
    let (h, _held, cancel, mut rx) =
        waiting_for_the_start_lock(dir.path(), "start_timeout = \"10m\"").await;
    let started = Instant::now();
    let s = rx
        .wait_for(|s| s.state != State::Starting)
        .await
        .unwrap()
        .clone();
    assert_eq!(s.state, State::Failed, "{s:?}");
    assert_eq!(s.last_error.as_deref(), Some("start timed out"));
    // Twice the start timeout, from the answer (at once: no GPU to plan).
    assert_eq!(started.elapsed().as_secs(), 1200);
    cancel.cancel();
    h.join().await;
}

fn supervisor_alive(pid: u32) -> bool {
    crate::supervisor::procfs::alive(pid, None)
}

#[tokio::test]
async fn an_attach_engine_that_does_not_say_its_level_is_not_taken_for_level_one() {
    use crate::engine::test_server::{Act, engine};
    // Asleep, but no vllm:engine_sleep_state (--disable-log-stats).
    let e = engine(|_, _, line| {
        if line.contains("/is_sleeping") {
            Act::Ok(r#"{"is_sleeping":true}"#)
        } else {
            Act::Ok("")
        }
    })
    .await;
    let client = EngineClient::new(&e.url);
    let t = Duration::from_secs(5);
    // Nothing recorded: the safe level 2.
    assert_eq!(
        super::probe::sleep_level(&client, "ext", 2, t).await,
        Some(2)
    );
    // The level siesta put it to, from the intent in the store.
    assert_eq!(
        super::probe::sleep_level(&client, "ext", 1, t).await,
        Some(1)
    );
    // /is_sleeping decides: the metric alone never says awake.
    let awake_metric = engine(|_, _, line| {
        if line.contains("/is_sleeping") {
            Act::Ok(r#"{"is_sleeping":true}"#)
        } else {
            Act::Ok("vllm:engine_sleep_state{sleep_state=\"awake\"} 1\n")
        }
    })
    .await;
    let client = EngineClient::new(&awake_metric.url);
    assert_eq!(
        super::probe::sleep_level(&client, "ext", 2, t).await,
        Some(2)
    );
    let awake = engine(|_, _, _| Act::Ok(r#"{"is_sleeping":false}"#)).await;
    let client = EngineClient::new(&awake.url);
    assert_eq!(super::probe::sleep_level(&client, "ext", 2, t).await, None);
}

/// Requests a proxy reports held under a fence from before the model was
/// last awake are being released (the report was taken before the proxy
/// saw the awake): they count as in flight, not held. Held under a later
/// fence, they count as held. Counted as held, they woke a model just put
/// to sleep (swap_e2e); counted as nothing, an operator's sleep began
/// while they were on their way to the engine (demand_e2e).
#[tokio::test]
async fn held_requests_fenced_before_the_last_awake_count_as_in_flight() {
    use crate::engine::test_server::{Act, engine};
    let e = engine(|_, _, line| {
        if line.contains("/is_sleeping") {
            Act::Ok(r#"{"is_sleeping":false}"#)
        } else {
            Act::Ok("")
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = attach("ext", &e.url);
    let cancel = CancellationToken::new();
    let h = spawn_model(cfg, Placed::default(), shared(dir.path()), cancel.clone()).unwrap();
    let mut rx = h.status.clone();
    let awake = rx
        .wait_for(|s| s.state == State::Awake)
        .await
        .unwrap()
        .state_since_unix_ms;
    let report = |held, fence| {
        h.notify_activity(
            Event::Activity {
                proxy: "p".into(),
                in_flight: 0,
                held,
                active: false,
                last_finished: None,
            },
            fence,
        )
    };
    // Taken while the model was waking, before the awake.
    report(10, awake - 1);
    let s = h.send(Event::Tick).await.unwrap();
    assert_eq!((s.held, s.in_flight), (0, 10), "{s:?}");
    // Held by a proxy that sees it awake (a suspect endpoint): neither.
    report(4, 0);
    let s = h.send(Event::Tick).await.unwrap();
    assert_eq!((s.held, s.in_flight), (0, 0), "{s:?}");
    // Held under a non-serving state that began after the awake.
    report(3, awake + 5);
    let s = h.send(Event::Tick).await.unwrap();
    assert_eq!((s.held, s.in_flight), (3, 0), "{s:?}");
    cancel.cancel();
    h.join().await;
}

/// A restarted control plane finds an attached engine serving, as it was
/// before the restart: its idle clock goes on as recorded (siesta neither
/// started it nor saw it start), so its 15-minute tier, 14 minutes into
/// its idle time, fires in a minute, not 15 minutes after the restart (a
/// control plane restarted more often than a tier never let it fire).
#[tokio::test]
async fn an_attached_engine_found_serving_after_a_restart_keeps_its_idle_clock() {
    use crate::engine::test_server::{Act, engine};
    let e = engine(|_, _, line| {
        if line.contains("/is_sleeping") {
            Act::Ok(r#"{"is_sleeping":false}"#)
        } else {
            Act::Ok("")
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[[model]]\nname = \"ext\"\nlaunch = \"attach\"\nurl = \"{}\"\ngpus = 0\n\
         idle = [ {{ after = \"15m\", action = \"sleep\", level = 1 }} ]\n",
        e.url
    );
    let cfg = Config::parse(&text, "t.toml").unwrap().models.remove(0);
    let shared = shared(dir.path());
    // What the daemon before the restart recorded: woken for a request
    // that ended 14 minutes ago.
    let ago = shared.clock.now_ms() - 14 * 60_000;
    shared.store.set(
        "ext",
        crate::store::IntentRecord {
            desired: "awake".into(),
            level: 0,
            reason: "demand".into(),
            since_unix_ms: ago - 1000,
            until_unix_ms: 0,
            pinned_until_unix_ms: 0,
            restarts: 0,
            last_activity_unix_ms: ago,
            idle_floor_unix_ms: ago - 1000,
            restart_asked_unix_ms: 0,
        },
    );
    let cancel = CancellationToken::new();
    let h = spawn_model(cfg, Placed::default(), shared, cancel.clone()).unwrap();
    let mut rx = h.status.clone();
    let s = tokio::time::timeout(
        Duration::from_secs(30),
        rx.wait_for(|s| s.state == State::Awake),
    )
    .await
    .expect("awake")
    .unwrap()
    .clone();
    let (_, at) = s.next_tier.expect("a next tier");
    let from_restart = at - s.state_since_unix_ms;
    assert!(
        (at - (ago + 15 * 60_000)).abs() < 1000,
        "the tier fires {} s after the restart, not 60",
        from_restart / 1000
    );
    cancel.cancel();
    h.join().await;
}

/// An IPv6 `host` is bracketed in the URL siesta probes and publishes
/// (`http://[::1]:PORT`); a bare `::1` makes no URL at all.
#[tokio::test]
async fn an_ipv6_host_makes_a_url_with_brackets() {
    let dir = tempfile::tempdir().unwrap();
    let text = r#"
[[model]]
name = "m"
model = "m"
command = ["sh", "-c", "exec sleep 60", "engine"]
host = "::1"
gpus = 0
"#;
    let cfg = Config::parse(text, "t.toml").unwrap().models.remove(0);
    let cancel = CancellationToken::new();
    let h = spawn_model(cfg, Placed::default(), shared(dir.path()), cancel.clone()).unwrap();
    let url = h.status.borrow().endpoints[0].url.clone();
    let uri: hyper::Uri = url.parse().unwrap_or_else(|e| panic!("{url}: {e}"));
    assert_eq!(uri.host(), Some("[::1]"), "{url}");
    assert!(uri.port_u16().is_some_and(|p| p > 0), "{url}");
    cancel.cancel();
    h.join().await;
}

/// A wait for room given up says what it waited for, as admission last
/// told it (the reconciler's error cannot know whether models or processes
/// siesta does not run held the room); other errors, an error not new in
/// this step, or nothing told, are left as they are.
#[test]
fn a_wait_for_room_given_up_says_what_it_waited_for() {
    let no_room = Some(format!("{} 300s: ...", crate::reconciler::NO_ROOM));
    let told =
        "room on GPU 0: ... held by 98.5 GiB by processes siesta does not run: pid 833 (98.5 GiB)";
    let e = no_room_why(&None, &no_room, told).unwrap();
    assert!(e.ends_with(&format!("; it waited for {told}")), "{e}");
    assert_eq!(no_room_why(&no_room, &no_room, told), None);
    assert_eq!(no_room_why(&None, &no_room, ""), None);
    assert_eq!(
        no_room_why(&None, &Some("start timed out".into()), told),
        None
    );
    assert_eq!(no_room_why(&None, &None, told), None);
}

/// A sleep and a wake move their deadline at each step; a change of the
/// deadline alone reaches the hub only with the next change, or alone
/// after [`publish::DEADLINE_COALESCE`]: on a quiet machine the Watch
/// streams get one event per state (`sleeping`, `asleep`, `waking`,
/// `awake`), where they got seven. The model's own status is current
/// throughout.
#[tokio::test]
async fn a_deadline_that_moves_alone_waits_for_the_next_change() {
    use crate::engine::test_server::{Act, engine};
    use crate::hub::Body;
    use crate::reconciler::Command;
    use std::sync::atomic::{AtomicBool, Ordering};
    let asleep = Arc::new(AtomicBool::new(false));
    let hang_sleep = Arc::new(AtomicBool::new(false));
    let e = engine({
        let (asleep, hang_sleep) = (asleep.clone(), hang_sleep.clone());
        move |_, _, line| {
            if line.contains("/sleep") && hang_sleep.load(Ordering::SeqCst) {
                return Act::Hang;
            }
            if line.contains("/sleep") {
                asleep.store(true, Ordering::SeqCst);
            } else if line.contains("/wake_up") {
                asleep.store(false, Ordering::SeqCst);
            }
            if line.contains("/is_sleeping") {
                if asleep.load(Ordering::SeqCst) {
                    Act::Ok(r#"{"is_sleeping":true}"#)
                } else {
                    Act::Ok(r#"{"is_sleeping":false}"#)
                }
            } else {
                Act::Ok("")
            }
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = attach("ext", &e.url);
    let cancel = CancellationToken::new();
    let shared = shared(dir.path());
    let h = spawn_model(cfg, Placed::default(), shared.clone(), cancel.clone()).unwrap();
    let mut rx = h.status.clone();
    rx.wait_for(|s| s.state == State::Awake).await.unwrap();
    let mut sub = shared.hub.subscribe(shared.hub.revision()).unwrap();
    for (cmd, want) in [
        (Command::Sleep(1), State::Asleep),
        (Command::Wake, State::Awake),
    ] {
        h.notify(Event::Command(cmd));
        rx.wait_for(|s| s.state == want).await.unwrap();
    }
    let mut events: Vec<(i64, crate::status::ModelStatus)> = Vec::new();
    while events.last().map(|(_, s)| s.state) != Some(State::Awake) {
        let item = tokio::time::timeout(Duration::from_secs(30), sub.next())
            .await
            .expect("the awake event")
            .unwrap();
        if let Body::Model(s) = &item.body {
            events.push((item.at_unix_ms, (**s).clone()));
        }
    }
    let mut states: Vec<State> = events.iter().map(|(_, s)| s.state).collect();
    states.dedup();
    assert_eq!(
        states,
        [State::Sleeping, State::Asleep, State::Waking, State::Awake]
    );
    // On a quiet machine one event per state; on a loaded one a step may
    // take longer than the wait, and its deadline then goes out alone, but
    // never sooner (before, each went out a millisecond after the last).
    for pair in events.windows(2) {
        let ((t1, a), (t2, b)) = (&pair[0], &pair[1]);
        if publish::only_deadline_moved(a, b) {
            assert!(
                t2 - t1 >= publish::DEADLINE_COALESCE.as_millis() as i64,
                "a deadline alone published {} ms after the change before it",
                t2 - t1
            );
        }
    }

    // Alone, a moved deadline is published after the wait: here the
    // engine never answers the sleep call, so the step from the drain's
    // deadline to the call's is the last change for a while.
    hang_sleep.store(true, Ordering::SeqCst);
    h.notify(Event::Command(Command::Sleep(1)));
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let item = tokio::time::timeout(Duration::from_secs(30), sub.next())
            .await
            .expect("the sleeping events")
            .unwrap();
        if let Body::Model(s) = &item.body {
            seen.push((item.at_unix_ms, s.state, s.deadline_unix_ms));
        }
    }
    let ((t1, s1, d1), (t2, s2, d2)) = (seen[0], seen[1]);
    assert_eq!((s1, s2), (State::Sleeping, State::Sleeping));
    assert_ne!(d1, d2, "{seen:?}");
    assert_eq!(d2, rx.borrow().deadline_unix_ms, "the call's deadline");
    assert!(
        t2 - t1 >= publish::DEADLINE_COALESCE.as_millis() as i64,
        "published after the wait: {seen:?}"
    );
    cancel.cancel();
    h.join().await;
}

/// A proxy's report of a finished request is shown (`GetModel`, Watch)
/// only once its record is committed: a control killed right after a
/// client saw it comes back with the same last activity (CI once lost it
/// when the record was written after the status went out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(
    clippy::await_holding_lock,
    reason = "the store's writer thread, not a task, waits on it: holding it is the test"
)]
async fn a_reported_activity_is_shown_only_once_it_is_durable() {
    let e = crate::engine::test_server::engine(healthy).await;
    let dir = tempfile::tempdir().unwrap();
    let cancel = CancellationToken::new();
    let shared = shared(dir.path());
    let h = spawn_model(
        attach("ext", &e.url),
        Placed::default(),
        shared.clone(),
        cancel.clone(),
    )
    .unwrap();
    let mut rx = h.status.clone();
    let before = rx
        .wait_for(|s| s.state == State::Awake)
        .await
        .unwrap()
        .last_activity_unix_ms;
    shared.store.flush().await;
    // A finish in a later millisecond than any activity before.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let finished = Instant::now();
    let shown = |s: &crate::status::ModelStatus| s.last_activity_unix_ms != before;
    let held = shared.store.pause_writes();
    h.notify_activity(
        Event::Activity {
            proxy: "p".into(),
            in_flight: 0,
            held: 0,
            active: true,
            last_finished: Some(finished),
        },
        0,
    );
    // Not shown while its record cannot be committed (half a second is
    // ample: a status sent at once comes within milliseconds).
    let early = tokio::time::timeout(Duration::from_millis(500), rx.wait_for(shown))
        .await
        .is_ok();
    assert!(
        !early,
        "shown before its record was committed: {:?}",
        rx.borrow()
    );
    drop(held);
    let s = tokio::time::timeout(Duration::from_secs(30), rx.wait_for(shown))
        .await
        .expect("shown once committed")
        .unwrap()
        .clone();
    let stored = shared.store.get("ext").unwrap().last_activity_unix_ms;
    assert_eq!(Some(stored), s.last_activity_unix_ms);
    cancel.cancel();
    h.join().await;
}

/// The scripted engine as an attach model sees it healthy and awake.
fn healthy(_: usize, _: usize, line: &str) -> crate::engine::test_server::Act {
    use crate::engine::test_server::Act;
    if line.contains("/is_sleeping") {
        Act::Ok(r#"{"is_sleeping":false}"#)
    } else {
        Act::Ok("")
    }
}

/// What a proxy's report of a refused connection sets off.
fn refused(url: &str) -> Refused {
    Refused {
        proxy: "p".into(),
        url: url.into(),
        error: "connection refused".into(),
    }
}

/// A healthy scripted engine, attached and awake.
async fn awake_attached() -> (
    crate::engine::test_server::Engine,
    tempfile::TempDir,
    CancellationToken,
    ModelHandle,
) {
    let e = crate::engine::test_server::engine(healthy).await;
    let dir = tempfile::tempdir().unwrap();
    let cancel = CancellationToken::new();
    let h = spawn_model(
        attach("ext", &e.url),
        Placed::default(),
        shared(dir.path()),
        cancel.clone(),
    )
    .unwrap();
    h.status
        .clone()
        .wait_for(|s| s.state == State::Awake)
        .await
        .unwrap();
    (e, dir, cancel, h)
}

/// An engine that closed its listener (vLLM at SIGTERM) while taken as
/// awake: on a proxy's report it is probed at once and every 200 ms, and
/// fails after three strikes within a second, not three poll periods.
#[tokio::test(start_paused = true)]
async fn an_engine_a_proxy_reports_refusing_is_failed_within_a_second() {
    let (e, _dir, cancel, h) = awake_attached().await;
    let mut rx = h.status.clone();
    e.close();
    let reported = Instant::now();
    h.endpoint_refused(refused(&e.url));
    let s = rx
        .wait_for(|s| s.state == State::Failed)
        .await
        .unwrap()
        .clone();
    let took = reported.elapsed();
    assert!(took < Duration::from_secs(1), "failed after {took:?}");
    assert!(
        s.last_error
            .as_deref()
            .is_some_and(|e| e.contains("health check failed 3 times")),
        "{s:?}"
    );
    let logs = h.logs.tail(None).0;
    assert!(
        logs.iter().any(|l| l
            .line
            .contains("proxy p reports the engine refused a connection")),
        "{logs:?}"
    );
    cancel.cancel();
    h.join().await;
}

/// Without a report the same engine fails only after three poll periods;
/// a report about another URL (an engine already replaced) changes
/// nothing; and one about an engine that still answers leaves it awake.
#[tokio::test(start_paused = true)]
async fn reports_about_another_engine_or_a_healthy_one_change_nothing() {
    let (e, _dir, cancel, h) = awake_attached().await;
    let mut rx = h.status.clone();
    // A healthy engine reported: probed, still awake after the quick window.
    h.endpoint_refused(refused(&e.url));
    tokio::time::sleep(Duration::from_secs(6)).await;
    let s = h.send(Event::Tick).await.unwrap();
    assert_eq!(s.state, State::Awake, "{s:?}");
    assert_eq!(s.failures, 0);
    e.close();
    let closed = Instant::now();
    h.endpoint_refused(refused("http://127.0.0.1:9"));
    rx.wait_for(|s| s.state == State::Failed).await.unwrap();
    let took = closed.elapsed();
    assert!(took >= Duration::from_secs(2), "failed after {took:?}");
    cancel.cancel();
    h.join().await;
}

/// A request that reached the engine as its sleep began (forwarded before
/// a proxy saw the sleep, or sent to the engine directly; the poll has not
/// read it yet): the engine's gauges, read just before `/sleep`, show it,
/// and the sleep is called off, the engine serving it, counted in flight.
/// Once the gauges read 0 the sleep, still wanted, goes ahead. (`/sleep`
/// went out before, and vLLM's `mode=wait` drained the request under the
/// sleep's timeout: one longer than that had the healthy engine killed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleep_is_called_off_by_a_request_the_engine_has_and_siesta_did_not_count() {
    use crate::engine::test_server::{Act, engine};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let busy = Arc::new(AtomicBool::new(false));
    let slept = Arc::new(AtomicUsize::new(0));
    let e = engine({
        let (busy, slept) = (busy.clone(), slept.clone());
        move |_, _, line| {
            if line.contains("/sleep") {
                slept.fetch_add(1, Ordering::SeqCst);
                Act::Ok("")
            } else if line.contains("/is_sleeping") {
                match slept.load(Ordering::SeqCst) {
                    0 => Act::Ok(r#"{"is_sleeping":false}"#),
                    _ => Act::Ok(r#"{"is_sleeping":true}"#),
                }
            } else if line.contains("/metrics") && busy.load(Ordering::SeqCst) {
                Act::Ok(
                    "vllm:num_requests_running{engine=\"0\"} 0.0\n\
                     vllm:num_requests_waiting{engine=\"0\"} 1.0\n",
                )
            } else {
                Act::Ok("")
            }
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut shared = shared(dir.path());
    // No poll reads the gauge meanwhile: the sleep's own look must.
    Arc::get_mut(&mut shared).unwrap().poll_every = Duration::from_secs(3600);
    let cancel = CancellationToken::new();
    let h = spawn_model(
        attach("ext", &e.url),
        Placed::default(),
        shared,
        cancel.clone(),
    )
    .unwrap();
    let mut rx = h.status.clone();
    rx.wait_for(|s| s.state == State::Awake).await.unwrap();
    busy.store(true, Ordering::SeqCst);
    let s = h
        .send(Event::Command(crate::reconciler::Command::Sleep(1)))
        .await
        .unwrap();
    assert_eq!(s.state, State::Sleeping, "{s:?}");
    let s = tokio::time::timeout(
        Duration::from_secs(20),
        rx.wait_for(|s| s.state == State::Awake),
    )
    .await
    .expect("the sleep was not called off")
    .unwrap()
    .clone();
    assert_eq!(s.in_flight, 1, "{s:?}");
    assert_eq!(slept.load(Ordering::SeqCst), 0, "/sleep was sent");
    let logs = h.logs.tail(None).0;
    assert!(
        logs.iter().any(|l| l
            .line
            .contains("called off: 1 request(s) reached the engine")),
        "{logs:?}"
    );
    // The request is done (what the next poll reads): the sleep goes ahead.
    busy.store(false, Ordering::SeqCst);
    h.notify(Event::EngineMetrics { running: 0 });
    let s = tokio::time::timeout(
        Duration::from_secs(20),
        rx.wait_for(|s| s.state == State::Asleep),
    )
    .await
    .expect("not asleep once the request was done")
    .unwrap()
    .clone();
    assert_eq!((s.sleep_level, s.failures), (1, 0), "{s:?}");
    assert_eq!(slept.load(Ordering::SeqCst), 1);
    cancel.cancel();
    h.join().await;
}

/// A stop of an engine still starting keeps its start's hold on its GPU
/// until the engine has exited, and signals it at once: a neighbour's
/// start queued for the GPU's start lock begins only once the engine is
/// gone. (The hold was released first: the neighbour started beside an
/// engine still loading, two vLLM starts on one GPU, and the stop's
/// SIGTERM waited for the neighbour's whole start.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_a_start_keeps_the_start_lock_until_the_engine_has_exited() {
    let dir = tempfile::tempdir().unwrap();
    let text = "[[model]]\nname = \"a\"\nmodel = \"m\"\n\
                command = [\"sh\", \"-c\", \"exec sleep 60\", \"engine\"]\n\
                gpus = 0\npreload = \"awake\"\nstop_grace = \"20s\"\n";
    let cfg = Config::parse(text, "t.toml").unwrap().models.remove(0);
    let shared = shared(dir.path());
    let placed = Placed {
        gpus: vec![0],
        ..Placed::default()
    };
    let cancel = CancellationToken::new();
    let h = spawn_model(cfg, placed, shared.clone(), cancel.clone()).unwrap();
    let mut rx = h.status.clone();
    let pid = rx
        .wait_for(|s| s.state == State::Starting && s.pid.is_some())
        .await
        .unwrap()
        .pid
        .unwrap();
    // A neighbour's start, queued for GPU 0's start lock.
    let neighbour = tokio::spawn({
        let shared = shared.clone();
        async move {
            let _guards = shared.locks.acquire(&[0]).await;
            supervisor_alive(pid)
        }
    });
    // (Its place in the lock's queue: taken at once, the lock being held.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!neighbour.is_finished(), "the start lock was free");
    let stopped = Instant::now();
    h.send(Event::Command(crate::reconciler::Command::Stop))
        .await
        .unwrap();
    let alive_when_let_in = tokio::time::timeout(Duration::from_secs(30), neighbour)
        .await
        .expect("the neighbour's start never got the lock")
        .unwrap();
    assert!(
        !alive_when_let_in,
        "the neighbour's start began while the stopped engine still ran"
    );
    let s = tokio::time::timeout(
        Duration::from_secs(30),
        rx.wait_for(|s| s.state == State::Stopped),
    )
    .await
    .expect("not stopped")
    .unwrap()
    .clone();
    // SIGTERM at once (`sleep` dies of it), not after the stop grace.
    let took = stopped.elapsed();
    assert!(
        took < Duration::from_secs(15),
        "stopped after {took:?}: {s:?}"
    );
    cancel.cancel();
    h.join().await;
}

/// A model whose configured `port` another process holds is not started
/// there: the start fails naming the port (and is tried again after the
/// backoff). Started, a vLLM 0.24 engine would bind beside the other
/// process (SO_REUSEPORT) and the kernel would share the port between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_port_another_process_holds_is_not_started_on() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[[model]]\nname = \"m\"\nmodel = \"m\"\n\
         command = [\"sh\", \"-c\", \"exec sleep 60\", \"engine\"]\n\
         host = \"127.0.0.1\"\nport = {port}\ngpus = 0\npreload = \"awake\"\n"
    );
    let cfg = Config::parse(&text, "t.toml").unwrap().models.remove(0);
    let cancel = CancellationToken::new();
    let h = spawn_model(cfg, Placed::default(), shared(dir.path()), cancel.clone()).unwrap();
    let s = tokio::time::timeout(
        Duration::from_secs(30),
        h.status.clone().wait_for(|s| s.state == State::Failed),
    )
    .await
    .expect("the start did not fail")
    .unwrap()
    .clone();
    let error = s.last_error.clone().unwrap_or_default();
    assert!(
        error.contains(&format!(
            "port {port} on 127.0.0.1 (the model's `port`) is in use"
        )),
        "{s:?}"
    );
    assert_eq!(s.pid, None, "{s:?}");
    let logs = h.logs.tail(None).0;
    assert!(
        !logs.iter().any(|l| l.line.starts_with("spawning:")),
        "{logs:?}"
    );
    drop(held);
    cancel.cancel();
    h.join().await;
}

/// The periodic poll counts a request the engine has taken and not
/// scheduled yet (`vllm:num_requests_waiting`) in flight, as the look
/// before a sleep does: counted by the look alone, each poll began a sleep
/// that the look called off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_poll_counts_requests_the_engine_has_not_scheduled_yet() {
    use crate::engine::test_server::{Act, engine};
    let e = engine(|_, _, line| {
        if line.contains("/is_sleeping") {
            Act::Ok(r#"{"is_sleeping":false}"#)
        } else if line.contains("/metrics") {
            Act::Ok("vllm:num_requests_waiting{engine=\"0\"} 2.0\n")
        } else {
            Act::Ok("")
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let cancel = CancellationToken::new();
    let h = spawn_model(
        attach("ext", &e.url),
        Placed::default(),
        shared(dir.path()),
        cancel.clone(),
    )
    .unwrap();
    let s = tokio::time::timeout(
        Duration::from_secs(30),
        h.status
            .clone()
            .wait_for(|s| s.state == State::Awake && s.in_flight == 2),
    )
    .await
    .expect("the waiting requests were never counted in flight")
    .unwrap()
    .clone();
    assert_eq!(s.in_flight, 2, "{s:?}");
    cancel.cancel();
    h.join().await;
}
