//! Reloads: the settings a reload does not apply are named; a changed
//! model's new engine goes on from its old one's intent, pin and history;
//! the stop bound `siesta up` waits for follows the stop grace.

use super::commands::{NOT_DURABLE, account, still_waking, waited_wake_says};
use super::*;
use crate::reconciler::{Command, Desired, Reason};
use crate::runner::tests::shared;
use crate::status::State;
use std::time::Duration;

const BOOT: &str = "[control]\ntoken = \"old\"\n[defaults]\nmax_queue = 8\n";

#[tokio::test]
async fn a_reload_names_what_waits_for_a_restart_until_the_daemon_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let boot = Config::parse(BOOT, "c.toml").unwrap();
    let cancel = CancellationToken::new();
    let models = Models::start(
        &boot,
        &BTreeMap::new(),
        BTreeMap::new(),
        shared(dir.path()),
        cancel.clone(),
    )
    .unwrap();
    let s = models.reload(&boot).await.unwrap();
    assert_eq!(s.not_applied, Vec::<String>::new());
    let rotated = BOOT.replace("old", "new").replace("8", "9");
    let new = Config::parse(&rotated, "c.toml").unwrap();
    let s = models.reload(&new).await.unwrap();
    assert_eq!(s.not_applied, ["control.token"]);
    // Still not in force: a second reload of that file says so again.
    let s = models.reload(&new).await.unwrap();
    assert_eq!(s.not_applied, ["control.token"]);
    cancel.cancel();
}

/// A process model `name` whose engine never answers (it stays starting):
/// what a reload carries over shows in its intent, pin and history alone.
fn sleeper(name: &str, preload: &str, args: &str, stop_grace: &str) -> String {
    format!(
        r#"
[[model]]
name = "{name}"
model = "m"
command = ["sh", "-c", "exec sleep 60", "engine"]
args = [{args}]
gpus = 0
preload = "{preload}"
start_timeout = "10m"
stop_grace = "{stop_grace}"
"#
    )
}

fn boot(text: &str, shared: Arc<Shared>) -> (Models, CancellationToken) {
    let config = Config::parse(text, "c.toml").unwrap();
    let cancel = CancellationToken::new();
    let models = Models::start(
        &config,
        &BTreeMap::new(),
        BTreeMap::new(),
        shared,
        cancel.clone(),
    )
    .unwrap();
    (models, cancel)
}

async fn wait_status(
    models: &Models,
    name: &str,
    what: &str,
    f: impl Fn(&ModelStatus) -> bool,
) -> ModelStatus {
    let mut rx = models.resolve(name).unwrap().status.clone();
    match tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|s| f(s))).await {
        Ok(Ok(s)) => s.clone(),
        _ => panic!("{name}: {what} not seen: {:#?}", models.status(name)),
    }
}

fn calibrated() -> crate::store::CalibrationRecord {
    let mut c = crate::reconciler::Calibration::default();
    c.start.add(Duration::from_secs(42));
    c.wake[0].add(Duration::from_secs(3));
    crate::store::CalibrationRecord::from(&c)
}

/// `preload = "none"`, woken by an operator and pinned: a reload that
/// changes its engine restarts it on a new pid, still wanted awake, still
/// pinned, with its restart count and last activity. Its calibration
/// survives a restart that keeps the engine command (here a change of its
/// GPU needs, `exclusive`), not one of its `args` (the old measurements are
/// of another engine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_model_keeps_its_intent_pin_and_history() {
    let dir = tempfile::tempdir().unwrap();
    let shared = shared(dir.path());
    shared.store.set_calibration("chat", &calibrated());
    let (models, cancel) = boot(&sleeper("chat", "none", "", "1s"), shared.clone());
    models.command("chat", Command::Wake).await.unwrap();
    models.pin("chat", 0).await.unwrap();
    let first = wait_status(&models, "chat", "a pid", |s| s.pid.is_some()).await;
    assert_eq!(first.restarts, 1);
    // A second ago (one reported older is taken as at most REPORT_LAG old).
    let finished = shared.clock.now_ms() - 1_000;
    models.activity(
        "proxy",
        &[Activity {
            model: "chat".into(),
            started: 1,
            finished: 1,
            in_flight: 0,
            held: 0,
            last_finished_unix_ms: finished,
            fenced_since_unix_ms: 0,
        }],
    );
    wait_status(&models, "chat", "the activity", |s| {
        s.last_activity_unix_ms == Some(finished)
    })
    .await;

    let check = |s: &ModelStatus, restarts: u32| {
        assert_eq!(
            (s.intent.desired, s.intent.reason, s.pin),
            (Desired::Awake, Reason::Pin, crate::status::PinView::Forever),
            "{s:#?}"
        );
        assert_eq!(s.restarts, restarts, "{s:#?}");
        assert_eq!(s.last_activity_unix_ms, Some(finished), "{s:#?}");
    };
    // The engine command is the same: its calibration still holds.
    let exclusive = format!("{}exclusive = true\n", sleeper("chat", "none", "", "1s"));
    let config = Config::parse(&exclusive, "c.toml").unwrap();
    let s = models.reload(&config).await.unwrap();
    assert_eq!(s.changed, ["chat"]);
    let second = wait_status(&models, "chat", "a new pid", |s| {
        s.pid.is_some_and(|p| Some(p) != first.pid)
    })
    .await;
    check(&second, 2);
    assert_eq!(
        crate::store::CalibrationRecord::from(&second.calibration),
        calibrated()
    );
    // New args: another engine, measured afresh.
    let config = Config::parse(&sleeper("chat", "none", "\"--x\"", "1s"), "c.toml").unwrap();
    let s = models.reload(&config).await.unwrap();
    assert_eq!(s.changed, ["chat"]);
    let third = wait_status(&models, "chat", "a new pid", |s| {
        s.pid.is_some_and(|p| Some(p) != second.pid)
    })
    .await;
    check(&third, 3);
    assert_eq!(third.calibration, Default::default(), "{third:#?}");
    assert_eq!(shared.store.calibration("chat"), None);
    models.resolve("chat").unwrap().shutdown(true).await;
    cancel.cancel();
}

/// A reload whose only changes are siesta's own settings for a model (its
/// timeouts, backoff, idle tiers, preload, hold policy): nothing of the
/// engine's command line, environment, launch or GPU needs. The engine is
/// kept (same pid, no drain, no restart counted), and the model's task and
/// handle take the new settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_of_siestas_own_settings_keeps_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    let shared = shared(dir.path());
    let (models, cancel) = boot(&sleeper("chat", "none", "", "1s"), shared.clone());
    models.command("chat", Command::Wake).await.unwrap();
    let first = wait_status(&models, "chat", "a pid", |s| s.pid.is_some()).await;
    let settings = format!(
        "{}wake_timeout = \"7m\"\nsleep_timeout = \"3m\"\nbackoff_initial = \"9s\"\n\
         max_hold = \"42s\"\nidle = [{{ after = \"1h\", action = \"sleep\", level = 1 }}]\n",
        sleeper("chat", "asleep", "", "20s")
            .replace("start_timeout = \"10m\"", "start_timeout = \"11m\"")
    );
    let config = Config::parse(&settings, "c.toml").unwrap();
    let s = models.reload(&config).await.unwrap();
    assert_eq!(
        (s.changed.clone(), s.reconfigured.clone()),
        (vec![], vec!["chat".to_string()]),
        "{s:?}"
    );
    // The task has taken the message once it answers an event.
    let h = models.resolve("chat").unwrap();
    let now = h.send(Event::Tick).await.unwrap();
    assert_eq!(
        (now.pid, now.restarts),
        (first.pid, first.restarts),
        "{now:#?}"
    );
    assert_eq!(now.max_hold_ms, 42_000, "{now:#?}");
    // The start under way keeps its deadline: a new start_timeout is for
    // the next start.
    assert_eq!(now.state, State::Starting, "{now:#?}");
    assert_eq!(now.deadline_unix_ms, first.deadline_unix_ms, "{now:#?}");
    assert_eq!(*h.cfg(), config.models[0]);
    // A reload of the same file again changes nothing.
    let s = models.reload(&config).await.unwrap();
    assert_eq!(s.unchanged, ["chat"], "{s:?}");
    h.shutdown(true).await;
    cancel.cancel();
}

/// A new `preload` is applied in place to an intent that is still the
/// configuration's: `none` → `awake` starts the model without a restart
/// of siesta-control (it was reported "in place" and did nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_preload_is_applied_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let (models, cancel) = boot(&sleeper("chat", "none", "", "1s"), shared(dir.path()));
    let h = models.resolve("chat").unwrap();
    let s = h.send(Event::Tick).await.unwrap();
    assert_eq!(
        (s.state, s.intent.desired),
        (State::Stopped, Desired::Stopped)
    );
    let config = Config::parse(&sleeper("chat", "awake", "", "1s"), "c.toml").unwrap();
    let s = models.reload(&config).await.unwrap();
    assert_eq!(s.reconfigured, ["chat"], "{s:?}");
    let s = wait_status(&models, "chat", "started for the new preload", |s| {
        s.pid.is_some()
    })
    .await;
    assert_eq!(
        (s.intent.desired, s.intent.reason),
        (Desired::Awake, Reason::Config)
    );
    h.shutdown(true).await;
    cancel.cancel();
}

/// `preload = "awake"`, stopped by an operator: a reload that changes its
/// engine leaves it stopped (it does not take its GPUs back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_stop_outlasts_a_reload_that_changes_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    let (models, cancel) = boot(&sleeper("big", "awake", "", "1s"), shared(dir.path()));
    wait_status(&models, "big", "a pid", |s| s.pid.is_some()).await;
    models.command("big", Command::Stop).await.unwrap();
    wait_status(&models, "big", "stopped", |s| s.state == State::Stopped).await;
    let config = Config::parse(&sleeper("big", "awake", "\"--x\"", "1s"), "c.toml").unwrap();
    let s = models.reload(&config).await.unwrap();
    assert_eq!(s.changed, ["big"]);
    // The new task's first step has run once it answers an event.
    let h = models.resolve("big").unwrap();
    let s = h.send(Event::Tick).await.unwrap();
    assert_eq!(
        (s.state, s.pid, s.intent.desired, s.intent.reason),
        (State::Stopped, None, Desired::Stopped, Reason::Operator),
        "{s:#?}"
    );
    cancel.cancel();
}

/// What `siesta up` gives the control plane to stop follows the models'
/// stop grace, reloads included.
#[tokio::test]
async fn the_stop_bound_follows_the_stop_grace_through_reloads() {
    let dir = tempfile::tempdir().unwrap();
    let shared = shared(dir.path());
    let (models, cancel) = boot(&sleeper("m", "none", "", "1s"), shared.clone());
    let before = shared.stop_bound.get();
    assert!(before > Duration::from_secs(1), "{before:?}");
    let config = Config::parse(&sleeper("m", "none", "", "100s"), "c.toml").unwrap();
    models.reload(&config).await.unwrap();
    assert_eq!(shared.stop_bound.get() - before, Duration::from_secs(99));
    cancel.cancel();
}

/// `big`, stopped, woken with `wake --wait` (the waiting call), its engine
/// spawned (it never becomes ready).
async fn waited_wake(
    dir: &std::path::Path,
) -> (
    Arc<Models>,
    CancellationToken,
    tokio::task::JoinHandle<Result<Answer, OpError>>,
) {
    let (models, cancel) = boot(&sleeper("big", "none", "", "1s"), shared(dir));
    let models = Arc::new(models);
    let waiting = tokio::spawn({
        let models = models.clone();
        async move { models.wake("big", true, None).await }
    });
    wait_status(&models, "big", "a pid", |s| s.pid.is_some()).await;
    (models, cancel, waiting)
}

/// `wake --wait` ends when the wake is called off (an operator's stop, or
/// a wake that found no room gives up, which sets the intent back): it
/// does not wait out the whole start and wake time for a wake no longer
/// going on, and says what happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waited_wake_ends_when_the_wake_is_called_off() {
    let dir = tempfile::tempdir().unwrap();
    let (models, cancel, waiting) = waited_wake(dir.path()).await;
    models.command("big", Command::Stop).await.unwrap();
    let Answer {
        status: s,
        message: msg,
        ..
    } = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("wake --wait still waiting after the wake was called off")
        .unwrap()
        .unwrap();
    assert_ne!(s.state, State::Awake);
    assert!(msg.contains("stopped (operator)"), "{msg}");
    cancel.cancel();
}

/// `siesta sleep` or `suspend` of a model an operator stopped is refused
/// while its engine is still stopping, as once stopped. Before, it was
/// accepted and the engine started again (a cold start) to be put to sleep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleep_while_an_operators_stop_goes_on_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // An engine that ignores SIGTERM: it stops for the whole stop grace.
    let text = sleeper("chat", "none", "", "10s").replace("exec sleep", "trap '' TERM; exec sleep");
    let (models, cancel) = boot(&text, shared(dir.path()));
    models.command("chat", Command::Wake).await.unwrap();
    let first = wait_status(&models, "chat", "a pid", |s| s.pid.is_some()).await;
    models.command("chat", Command::Stop).await.unwrap();
    wait_status(&models, "chat", "stopping", |s| s.state == State::Stopping).await;
    for cmd in [Command::Sleep(1), Command::Suspend] {
        let e = models.command("chat", cmd).await.unwrap_err().to_string();
        assert!(e.contains("chat is stopping, to stay stopped"), "{e}");
    }
    let s = models.status("chat").unwrap();
    assert_eq!(s.intent.desired, Desired::Stopped, "{s:#?}");
    assert_eq!(s.pid, first.pid, "{s:#?}");
    // A wake is still taken: the operator starts it again.
    models.command("chat", Command::Wake).await.unwrap();
    let woken = models.status("chat").unwrap();
    assert_eq!(woken.intent.desired, Desired::Awake, "{woken:#?}");
    models.resolve("chat").unwrap().shutdown(true).await;
    cancel.cancel();
}

/// A reload whose new or changed model cannot get a port (its `host` is
/// not an address of this machine) is refused, naming the file, key and
/// model, before anything is stopped: the running models keep running
/// with their old settings.
#[tokio::test]
async fn a_reload_with_an_unbindable_host_is_refused_before_anything_stops() {
    let dir = tempfile::tempdir().unwrap();
    let text = sleeper("a", "awake", "", "5s");
    let (models, cancel) = boot(&text, shared(dir.path()));
    wait_status(&models, "a", "starting", |s| s.state == State::Starting).await;
    let bad = |m: &str| format!("{m}host = \"192.0.2.1\"\n");
    let changed = text.replace("args = []", "args = [\"--x\"]");
    for reload in [
        format!("{text}{}", bad(&sleeper("b", "none", "", "5s"))),
        bad(&changed),
    ] {
        let config = Config::parse(&reload, "c.toml").unwrap();
        let e = models.reload(&config).await.unwrap_err().to_string();
        assert!(e.starts_with("c.toml: model["), "{e}");
        assert!(e.contains("].host: model "), "{e}");
        assert!(e.contains("192.0.2.1"), "{e}");
        assert!(e.contains("nothing was reloaded"), "{e}");
        let a = models.status("a").unwrap();
        assert_eq!(a.state, State::Starting, "{a:#?}");
        assert!(models.resolve("a").unwrap().cfg().args.is_empty());
        assert!(models.resolve("b").is_err());
    }
    models.resolve("a").unwrap().shutdown(true).await;
    cancel.cancel();
}

/// An operator's command or pin sent while a reload drains the model's old
/// engine is refused, saying why (it was acknowledged and then dropped: the
/// retiring task ignores them). The state store keeps what the model wanted
/// before the reload all through the drain, so a restart of siesta then
/// goes on from it; the new engine does too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_during_a_reloads_drain_are_refused_and_the_intent_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let shared = shared(dir.path());
    // An engine that ignores SIGTERM: its drain lasts the stop grace (10 s,
    // far more than the commands below take on a loaded machine).
    let text = sleeper("chat", "none", "", "10s").replace("exec sleep", "trap '' TERM; exec sleep");
    let (models, cancel) = boot(&text, shared.clone());
    let models = Arc::new(models);
    models.command("chat", Command::Wake).await.unwrap();
    models.pin("chat", 0).await.unwrap();
    let first = wait_status(&models, "chat", "a pid", |s| s.pid.is_some()).await;
    let changed = Config::parse(&text.replace("args = []", "args = [\"--x\"]"), "c.toml").unwrap();
    let reload = tokio::spawn({
        let models = models.clone();
        async move { models.reload(&changed).await }
    });
    wait_status(&models, "chat", "retiring", |s| s.retiring).await;
    let kept = |what: &str| {
        let rec = shared.store.get("chat").expect("an intent record");
        assert_eq!(
            (
                rec.desired.as_str(),
                rec.reason.as_str(),
                rec.pinned_until_unix_ms
            ),
            ("awake", "pin", i64::MAX),
            "{what}: {rec:?}"
        );
    };
    kept("at the drain's start");
    let refused = |r: Result<Answer, OpError>| match r {
        // Names a command that exists (it said `siesta status chat`).
        Err(OpError::Refused(m)) => assert!(
            m.contains("leaving with a reload") && m.contains("(`siesta get chat` shows"),
            "{m}"
        ),
        other => panic!("not refused: {other:?}"),
    };
    refused(models.command("chat", Command::Sleep(1)).await);
    refused(models.command("chat", Command::Stop).await);
    refused(models.pin_for("chat", Duration::from_secs(60)).await);
    refused(models.unpin("chat").await);
    let s = models.status("chat").unwrap();
    assert!(s.retiring && s.pid == first.pid, "{s:#?}");
    kept("after the refused commands, still draining");
    let s = tokio::time::timeout(Duration::from_secs(30), reload)
        .await
        .expect("the reload did not end")
        .unwrap()
        .unwrap();
    assert_eq!(s.changed, ["chat"]);
    let second = wait_status(&models, "chat", "a new pid", |s| {
        s.pid.is_some_and(|p| Some(p) != first.pid)
    })
    .await;
    assert_eq!(
        (
            second.intent.desired,
            second.intent.reason,
            second.pin,
            second.retiring
        ),
        (
            Desired::Awake,
            Reason::Pin,
            crate::status::PinView::Forever,
            false
        ),
        "{second:#?}"
    );
    // The new engine takes commands again.
    models.unpin("chat").await.unwrap();
    models.resolve("chat").unwrap().shutdown(true).await;
    cancel.cancel();
}

/// An unpin is durable though it leaves the intent as it was: pinned, then
/// woken by an operator (the intent's reason is no longer the pin), then
/// unpinned, the record says unpinned, or a restart of siesta would pin the
/// model again for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpin_that_leaves_the_intent_as_it_was_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let shared = shared(dir.path());
    let (models, cancel) = boot(&sleeper("chat", "none", "", "1s"), shared.clone());
    let pinned = || {
        let rec = shared.store.get("chat").expect("an intent record");
        (rec.reason, rec.pinned_until_unix_ms)
    };
    models.pin("chat", 0).await.unwrap();
    assert_eq!(pinned(), ("pin".to_string(), i64::MAX));
    models.command("chat", Command::Wake).await.unwrap();
    assert_eq!(pinned(), ("operator".to_string(), i64::MAX));
    let s = models.unpin("chat").await.unwrap().status;
    assert_eq!(s.pin, crate::status::PinView::None, "{s:#?}");
    assert_eq!(pinned(), ("operator".to_string(), 0));
    models.resolve("chat").unwrap().shutdown(true).await;
    cancel.cancel();
}

/// What a command's reply says: a deeper sleep of a model asleep at level
/// 1 says it wakes it first (it read "waking", as if the sleep had been
/// taken for a wake); the same or a shallower level is already done.
#[test]
fn a_deeper_sleep_says_it_wakes_the_model_first() {
    let mut asleep = crate::status::test_status("chat", 0);
    (asleep.state, asleep.sleep_level) = (State::Asleep, 1);
    let mut waking = asleep.clone();
    waking.state = State::Waking;
    assert_eq!(
        account(&asleep, &waking, Command::Sleep(2)),
        "asleep at level 1: waking it to sleep again at level 2"
    );
    assert_eq!(
        account(&asleep, &asleep, Command::Sleep(1)),
        "already asleep at level 1"
    );
    // A restart said "stopping", as if for good.
    let mut stopping = asleep.clone();
    stopping.state = State::Stopping;
    assert_eq!(account(&asleep, &stopping, Command::Restart), "restarting");
}

/// `wake --wait` cut short by the control plane stopping says so: it said
/// "the wake was called off: the intent is now awake (operator)".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waited_wake_cut_short_by_shutdown_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (_models, cancel, waiting) = waited_wake(dir.path()).await;
    cancel.cancel();
    let r = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("wake --wait still waiting after the shutdown")
        .unwrap();
    assert!(matches!(r, Err(OpError::ShuttingDown)), "{r:?}");
}

/// `wake --wait` whose model's task ends while the control plane goes on (a
/// reload replaced the model) says so; it said "the control plane is
/// shutting down".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waited_wake_whose_model_a_reload_replaced_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (models, cancel, waiting) = waited_wake(dir.path()).await;
    models.resolve("big").unwrap().shutdown(true).await;
    let r = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("wake --wait still waiting after its model's task ended")
        .unwrap();
    match r {
        Err(OpError::Refused(m)) => assert!(m.contains("replaced or removed by a reload"), "{m}"),
        other => panic!("{other:?}"),
    }
    cancel.cancel();
}

/// A waited wake that runs out of time says what the model waits for (the
/// room processes siesta does not run hold, say), not only its state.
#[tokio::test]
async fn a_waited_wake_out_of_time_says_what_the_model_waits_for() {
    let dir = tempfile::tempdir().unwrap();
    let (models, cancel) = boot(&sleeper("m", "none", "", "1s"), shared(dir.path()));
    let mut s = models.status("m").unwrap();
    s.state = State::Starting;
    s.waiting_for = Some(
        "room on GPU 0: ... held by 98.5 GiB by processes siesta does not run: pid 833 (98.5 GiB)"
            .into(),
    );
    assert_eq!(
        still_waking(&s, Duration::from_secs(15)),
        "still starting after 15s, waiting for room on GPU 0: ... held by 98.5 GiB by \
         processes siesta does not run: pid 833 (98.5 GiB); the wake goes on"
    );
    s.waiting_for = None;
    assert_eq!(
        still_waking(&s, Duration::from_secs(15)),
        "still starting after 15s; the wake goes on"
    );
    // Failed (or awake) right at the deadline: told as it is, never "still
    // failed ...; the wake goes on".
    s.state = State::Failed;
    s.last_error = Some("engine exited unexpectedly".into());
    assert_eq!(
        waited_wake_says(&s, Duration::from_secs(15)),
        "failed: engine exited unexpectedly"
    );
    s.state = State::Awake;
    assert_eq!(waited_wake_says(&s, Duration::from_secs(15)), "awake");
    cancel.cancel();
}

/// A reload that removes a model queues the deletion of its records and
/// waits for it without blocking the task that reloads: a future joined
/// with the reload runs while the write is held back. (It once waited in
/// `block_in_place`, which stops every future of the task.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_removes_a_model_waits_for_the_store_without_blocking_its_task() {
    let dir = tempfile::tempdir().unwrap();
    let shared = shared(dir.path());
    let text = format!("{BOOT}{}", sleeper("x", "none", "", "1s"));
    let (models, cancel) = boot(&text, shared.clone());
    models.command("x", Command::Stop).await.unwrap();
    assert!(shared.store.get("x").is_some(), "x's intent recorded");
    // The store's writer is held back until the probe below says so, or a
    // deadline passes.
    let (release, released) = std::sync::mpsc::channel::<()>();
    let (paused, is_paused) = std::sync::mpsc::channel::<()>();
    let store = shared.store.clone();
    let holder = std::thread::spawn(move || {
        let _held = store.pause_writes();
        paused.send(()).unwrap();
        released.recv_timeout(Duration::from_secs(20)).is_ok()
    });
    is_paused.recv().unwrap();
    let store = shared.store.clone();
    let probe = async move {
        // Reads see queued writes: x's records are gone once the removal
        // is queued, while the reload waits for it to be durable.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while store.get("x").is_some() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = release.send(());
    };
    let empty = Config::parse(BOOT, "c.toml").unwrap();
    let (summary, ()) = tokio::join!(models.reload(&empty), probe);
    assert_eq!(summary.unwrap().removed, ["x"]);
    assert!(
        holder.join().unwrap(),
        "the future joined with the reload did not run while the removal waited for the store"
    );
    assert!(shared.store.get("x").is_none());
    cancel.cancel();
}

/// A changed model whose old engine is gone stays found by name and listed
/// while other models of the same reload still drain: an operator's call
/// for it is told it is being replaced, never that it does not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_model_stays_found_while_another_drains() {
    let dir = tempfile::tempdir().unwrap();
    // `slow` ignores SIGTERM: its drain lasts its stop grace (8 s); `quick`
    // ends at SIGTERM.
    let slow = sleeper("slow", "awake", "", "8s").replace("exec sleep", "trap '' TERM; exec sleep");
    let text = format!("{BOOT}{slow}{}", sleeper("quick", "awake", "", "8s"));
    let (models, cancel) = boot(&text, shared(dir.path()));
    let models = Arc::new(models);
    for name in ["slow", "quick"] {
        wait_status(&models, name, "a pid", |s| s.pid.is_some()).await;
    }
    let changed = Config::parse(&text.replace("args = []", "args = [\"--x\"]"), "c.toml").unwrap();
    let reload = tokio::spawn({
        let models = models.clone();
        async move { models.reload(&changed).await }
    });
    let mut checks = 0;
    while !reload.is_finished() {
        for name in ["slow", "quick"] {
            match models.status(name) {
                Ok(_) => {}
                Err(e) => panic!("{name} during the reload, check {checks}: {e}"),
            }
            assert!(
                models.list().iter().any(|s| s.name == name),
                "{name} not listed during the reload, check {checks}"
            );
            match models.command(name, Command::Wake).await {
                Ok(_) => {}
                Err(OpError::Refused(m)) => assert!(
                    m.contains("leaving with a reload") || m.contains("replaced or removed"),
                    "{m}"
                ),
                Err(e) => panic!("{name}: wake during the reload, check {checks}: {e}"),
            }
        }
        checks += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let s = reload.await.unwrap().unwrap();
    assert_eq!(s.changed, ["slow", "quick"]);
    assert!(
        checks > 10,
        "the reload ended before it could be watched: {checks} checks"
    );
    for name in ["slow", "quick"] {
        assert!(!models.status(name).unwrap().retiring, "{name}");
        models.resolve(name).unwrap().shutdown(true).await;
    }
    cancel.cancel();
}

/// A reload that comes while the daemon shuts down starts nothing: an
/// added model's task would not be among those the shutdown waits for.
#[tokio::test]
async fn a_reload_after_the_shutdown_began_starts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (models, cancel) = boot(BOOT, shared(dir.path()));
    cancel.cancel();
    let added = Config::parse(
        &format!("{BOOT}{}", sleeper("x", "awake", "", "1s")),
        "c.toml",
    )
    .unwrap();
    match models.reload(&added).await {
        Err(OpError::ShuttingDown) => {}
        other => panic!("not refused: {other:?}"),
    }
    assert!(models.resolve("x").is_err());
    assert!(models.list().is_empty());
}

/// An operator's command whose intent the state store cannot write (a full
/// disk) is applied all the same, and its answer says it is not durable;
/// once the disk has room again, the next command's answer warns of
/// nothing. (The answer said nothing before: `siesta pin` read as done
/// while a restart of siesta-control would have lost the pin.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_the_store_cannot_write_is_answered_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let shared = shared(dir.path());
    let (models, cancel) = boot(&sleeper("chat", "none", "", "1s"), shared.clone());
    let file = dir.path().join(crate::store::FILE_NAME);
    crate::store::faults::disk_full(&file, true);
    let a = models.pin("chat", 0).await.unwrap();
    assert_eq!(a.warning.as_deref(), Some(NOT_DURABLE), "{a:#?}");
    assert_eq!(a.status.pin, crate::status::PinView::Forever, "applied");
    crate::store::faults::disk_full(&file, false);
    let a = models.unpin("chat").await.unwrap();
    assert_eq!(a.warning, None, "{a:#?}");
    assert_eq!(a.status.pin, crate::status::PinView::None, "{a:#?}");
    cancel.cancel();
}

/// A pin for a while says how long as a person reads it: `2h`, not
/// `7200s` (nor `3155760000s` for `--for 100y`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pin_for_a_while_says_how_long_in_words() {
    let dir = tempfile::tempdir().unwrap();
    let (models, cancel) = boot(&sleeper("chat", "none", "", "1s"), shared(dir.path()));
    let a = models
        .pin_for("chat", Duration::from_secs(7200))
        .await
        .unwrap();
    assert_eq!(a.message, "pinned awake for 2h");
    let a = models
        .pin_for("chat", Duration::from_secs(90))
        .await
        .unwrap();
    assert_eq!(a.message, "pinned awake for 1m 30s");
    cancel.cancel();
}
