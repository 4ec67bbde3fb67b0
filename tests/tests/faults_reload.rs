//! Configuration reload by SIGHUP: added models appear, removed ones are
//! stopped, changed ones restarted (as the operator left them: woken,
//! pinned or stopped), unchanged ones not disturbed; an invalid file is
//! refused and the running configuration stays.

use nix::sys::signal::Signal;
use siesta_proto::v1 as pb;
use siesta_tests::cli::at;
use siesta_tests::ctl::*;
use siesta_tests::{DEADLINE, group_members, wait_until};

fn expand(ctl: &Ctl, text: &str) -> String {
    text.replace("@DIR@", &ctl.dir.path().display().to_string())
        .replace("@FAKE_VLLM@", &siesta_tests::fake_vllm_command())
}

/// Waits until model `name` is listed (`listed`) or not found.
async fn wait_listed(c: &Client, name: &str, listed: bool) {
    let what = format!("{name} {}", if listed { "listed" } else { "gone" });
    wait_until(&what, LONG, || {
        let mut c = c.clone();
        async move {
            let r = c.get_model(pb::GetModelRequest { name: name.into() }).await;
            match listed {
                true => r.is_ok(),
                false => r.is_err_and(|e| e.code() == tonic::Code::NotFound),
            }
        }
    })
    .await;
}

#[tokio::test]
async fn sighup_applies_additions_removals_and_changes_only() {
    let (same, changed, removed) = (
        fake_model("same", "awake", &[], ""),
        fake_model("changed", "awake", &[], ""),
        fake_model("removed", "awake", &[], ""),
    );
    let ctl = start(&config(&format!("{same}{changed}{removed}"))).await;
    let mut c = ctl.client().await;
    let mut pids = Vec::new();
    for m in ["same", "changed", "removed"] {
        pids.push(wait_state(&mut c, m, pb::ModelState::Awake, LONG).await.pid);
    }
    let changed2 = fake_model("changed", "awake", &["--max-model-len", "4096"], "");
    let added = fake_model("added", "asleep", &[], "");
    let new = config(&format!("{same}{changed2}{added}"));
    std::fs::write(&ctl.config_path, expand(&ctl, &new)).unwrap();
    ctl.child.signal(Signal::SIGHUP);
    wait_listed(&c, "added", true).await;
    wait_state(&mut c, "added", pb::ModelState::Asleep, LONG).await;
    let s = wait_status(&mut c, "changed", "restarted", LONG, |s| {
        state(s) == pb::ModelState::Awake && s.pid != pids[1]
    })
    .await;
    assert!(s.pid != 0);
    wait_listed(&c, "removed", false).await;
    wait_until("removed model's engine stopped", LONG, || async {
        group_members(pids[2] as i32).is_empty()
    })
    .await;
    let s = status(&mut c, "same").await;
    assert_eq!((state(&s), s.pid), (pb::ModelState::Awake, pids[0]));
    assert_eq!(s.restarts, 1, "unchanged model disturbed");

    // An invalid file is refused: everything stays as it is.
    let before = std::fs::read_to_string(&ctl.config_path).unwrap();
    std::fs::write(&ctl.config_path, format!("{before}\n[[model]]\nname = 3\n")).unwrap();
    ctl.child.signal(Signal::SIGHUP);
    ctl.child
        .output()
        .wait_for("configuration refused", DEADLINE)
        .await;
    for m in ["same", "changed", "added"] {
        status(&mut c, m).await;
    }
    let s = status(&mut c, "same").await;
    assert_eq!((state(&s), s.pid), (pb::ModelState::Awake, pids[0]));

    // A rotated token is read at start-up only: the reload says so, naming
    // the key (never the value), and the running token stays in force.
    let rotated = before.replace("[control]\n", "[control]\ntoken = \"rotated-secret\"\n");
    assert_ne!(rotated, before);
    std::fs::write(&ctl.config_path, rotated).unwrap();
    let run = at(&ctl, &["reload"]).await.ok();
    assert!(
        run.stdout
            .starts_with("configuration reloaded; not applied until restart: control.token\n"),
        "{run:#?}"
    );
    assert!(!run.stdout.contains("rotated-secret"), "{run:#?}");
    ctl.child
        .output()
        .wait_for("not applied until restart: control.token", DEADLINE)
        .await;
    status(&mut c, "same").await;
}

/// A reload that changes a model's engine hands its new engine what the
/// model wanted: `chat` (preload "none", woken and pinned by the operator)
/// is awake again on a new pid, still pinned for the same hour; `big`
/// (preload "awake", stopped by the operator for maintenance) stays
/// stopped and does not take its resources back.
#[tokio::test]
async fn a_changed_model_keeps_the_operators_wake_pin_and_stop() {
    let ctl = start(&config(&format!(
        "{}{}",
        fake_model("chat", "none", &[], ""),
        fake_model("big", "awake", &[], "")
    )))
    .await;
    let mut c = ctl.client().await;
    let big = wait_state(&mut c, "big", pb::ModelState::Awake, LONG).await;
    at(&ctl, &["stop", "big"]).await.ok();
    wait_state(&mut c, "big", pb::ModelState::Stopped, LONG).await;
    wait_until("big's engine gone", LONG, || async {
        group_members(big.pid as i32).is_empty()
    })
    .await;
    at(&ctl, &["wake", "chat"]).await.ok();
    at(&ctl, &["pin", "chat", "--for", "1h"]).await.ok();
    let chat = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    assert!(chat.pinned_until_unix_ms > 0, "{chat:#?}");

    let new = config(&format!(
        "{}{}",
        fake_model("chat", "none", &["--max-model-len", "4096"], ""),
        fake_model("big", "awake", &["--max-model-len", "4096"], "")
    ));
    std::fs::write(&ctl.config_path, expand(&ctl, &new)).unwrap();
    let run = at(&ctl, &["reload"]).await.ok();
    assert!(run.stdout.contains("restarted  chat, big"), "{run:#?}");
    let s = wait_status(&mut c, "chat", "awake on a new engine", LONG, |s| {
        state(s) == pb::ModelState::Awake && s.pid != chat.pid
    })
    .await;
    assert_eq!(s.pinned_until_unix_ms, chat.pinned_until_unix_ms, "{s:#?}");
    assert_eq!(s.restarts, chat.restarts + 1, "{s:#?}");
    // `chat`'s new engine started meanwhile: `big` would have too.
    let s = status(&mut c, "big").await;
    assert_eq!((state(&s), s.pid), (pb::ModelState::Stopped, 0), "{s:#?}");
    let intent = s.intent.expect("intent");
    assert_eq!(
        (intent.desired, intent.reason),
        (
            pb::DesiredState::Stopped as i32,
            pb::IntentReason::Operator as i32
        ),
        "{s:#?}"
    );
}

/// A reload that removes an attached model puts its engine to sleep, as the
/// README says (siesta cannot stop an engine it does not run): it was left
/// awake, holding its GPU memory with nothing counting it any more, and
/// with no model left in siesta to put it to sleep.
#[tokio::test]
async fn a_reload_that_removes_an_attached_model_puts_its_engine_to_sleep() {
    let engine = siesta_tests::spawn_fake_vllm(&[
        "ext-model",
        "--enable-sleep-mode",
        "--served-model-name",
        "ext",
    ])
    .await;
    let ext = format!(
        "\n[[model]]\nname = \"ext\"\nlaunch = \"attach\"\nurl = \"{}\"\ngpus = 0\n",
        engine.url
    );
    let other = fake_model("other", "none", &[], "");
    let ctl = start(&config(&format!("{ext}{other}"))).await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "ext", pb::ModelState::Awake, LONG).await;

    std::fs::write(&ctl.config_path, expand(&ctl, &config(&other))).unwrap();
    let run = at(&ctl, &["reload"]).await.ok();
    assert!(run.stdout.contains("removed    ext"), "{run:#?}");
    let e = c
        .get_model(pb::GetModelRequest { name: "ext".into() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    wait_until("the removed attached engine asleep", DEADLINE, || async {
        let v: serde_json::Value = engine.get("/is_sleeping").await.json().await.unwrap();
        v["is_sleeping"] == true
    })
    .await;
}

/// A reload that changes only siesta's own settings for a model (here the
/// `[defaults]` stop grace and the model's idle tier) keeps its engine: no
/// drain, no new pid, no restart counted; the reply says it was updated in
/// place. The new tier counts from the same idle clock: idle longer than it
/// already, the model is put to sleep at once, not a whole tier after the
/// reload.
#[tokio::test]
async fn a_reload_of_timeouts_and_tiers_only_keeps_the_engine() {
    let tier =
        |after: &str| format!("idle = [{{ after = \"{after}\", action = \"sleep\", level = 1 }}]");
    let ctl = start(&config(&fake_model("chat", "awake", &[], &tier("1h")))).await;
    let mut c = ctl.client().await;
    let awake = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    // Idle for longer than the new tier by the time of the reload.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    let new = config(&fake_model("chat", "awake", &[], &tier("4s")))
        .replace("stop_grace = \"5s\"", "stop_grace = \"7s\"");
    assert!(new.contains("stop_grace = \"7s\""));
    std::fs::write(&ctl.config_path, expand(&ctl, &new)).unwrap();
    let reload_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let run = at(&ctl, &["reload"]).await.ok();
    assert!(run.stdout.contains("in place   chat"), "{run:#?}");
    assert!(!run.stdout.contains("restarted"), "{run:#?}");
    let asleep = wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG).await;
    assert_eq!(
        (asleep.pid, asleep.restarts),
        (awake.pid, awake.restarts),
        "the engine was restarted: {asleep:#?}"
    );
    assert!(
        asleep.state_since_unix_ms < reload_ms + 4_000,
        "the tier counted from the reload, not from the last activity: {asleep:#?}"
    );
    assert!(!group_members(awake.pid as i32).is_empty());
}

/// A reload whose client goes away (Ctrl-C on `siesta reload`, or its
/// deadline) while a removed model's engine takes its `stop_grace` to stop
/// is still carried out whole: the removed model goes, the added one
/// starts. Cut short, it left the removed model retiring for ever
/// (commands on it dropped) and never added the new one.
#[tokio::test]
async fn a_reload_whose_client_goes_away_is_carried_out_whole() {
    // The engine's group leader ignores SIGTERM: its stop takes the grace.
    let slow = r#"
[[model]]
name = "slow"
model = "org/slow"
engine = "openai"
preload = "awake"
command = ["sh", "-c", "trap '' TERM; \"$0\" --personality openai serve slow --host \"$1\" --port \"$2\" & while :; do sleep 1; done", "@FAKE_VLLM@"]
args = ["{host}", "{port}"]
env = { SIESTA_TEST_TAG = "@DIR@" }
stop_grace = "4s"
"#;
    let ctl = start(&config(slow)).await;
    let mut c = ctl.client().await;
    let pid = wait_state(&mut c, "slow", pb::ModelState::Awake, LONG)
        .await
        .pid;
    let added = fake_model("added", "asleep", &[], "");
    std::fs::write(&ctl.config_path, expand(&ctl, &config(&added))).unwrap();
    let mut req = tonic::Request::new(pb::ReloadRequest {});
    req.set_timeout(std::time::Duration::from_millis(500));
    let cut = c
        .reload(req)
        .await
        .expect_err("the reload outlasts its client");
    assert!(
        matches!(
            cut.code(),
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        "{cut:?}"
    );
    wait_listed(&c, "added", true).await;
    wait_state(&mut c, "added", pb::ModelState::Asleep, LONG).await;
    wait_listed(&c, "slow", false).await;
    wait_until("removed model's engine stopped", LONG, || async {
        group_members(pid as i32).is_empty()
    })
    .await;
    ctl.child
        .output()
        .wait_for("configuration reloaded", DEADLINE)
        .await;
}
