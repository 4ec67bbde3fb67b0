//! `kill -9` of siesta-control in the middle of a wake, a sleep, a start and
//! a stop: after a restart every model converges to its intent, running
//! engines are adopted (same pid), none is duplicated, none orphaned.

use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;
use siesta_tests::{pids_with_env, proc_stat, wait_until};
use std::collections::BTreeSet;

/// Process groups of every live engine process of this test (fake-vllm and
/// its engine-core child share one).
fn engine_groups(ctl: &Ctl) -> BTreeSet<i32> {
    let tag = ctl.dir.path().display().to_string();
    pids_with_env("SIESTA_TEST_TAG", &tag)
        .into_iter()
        .filter_map(|p| proc_stat(p).map(|s| s.pgrp))
        .collect()
}

/// Exactly one engine process group runs, led by `pid`.
async fn only_engine(ctl: &Ctl, pid: i32) {
    wait_until("exactly the adopted engine's group", LONG, || async {
        engine_groups(ctl) == BTreeSet::from([pid])
    })
    .await;
}

#[tokio::test]
async fn killed_during_a_wake_the_wake_is_carried_out_on_the_same_engine() {
    let model = fake_model("chat", "asleep", &["--wake-time", "3s"], "");
    let mut ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let pid = wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG)
        .await
        .pid as i32;
    wake(&mut c, "chat", false).await;
    wait_state(&mut c, "chat", pb::ModelState::Waking, LONG).await;
    ctl.restart().await;
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    assert_eq!(s.pid as i32, pid, "engine not adopted");
    let intent = s.intent.unwrap();
    assert_eq!(intent.desired, pb::DesiredState::Awake as i32);
    only_engine(&ctl, pid).await;
    assert!(chat(&endpoint(&s), "chat").await.contains("siesta"));
}

#[tokio::test]
async fn killed_during_a_sleep_the_engine_ends_asleep_at_that_level() {
    let model = fake_model("chat", "awake", &["--sleep-time", "3s"], "");
    let mut ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let pid = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG)
        .await
        .pid as i32;
    c.sleep(pb::SleepRequest {
        name: "chat".into(),
        level: 2,
    })
    .await
    .unwrap();
    wait_state(&mut c, "chat", pb::ModelState::Sleeping, LONG).await;
    ctl.restart().await;
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG).await;
    assert_eq!(s.sleep_level, 2);
    assert_eq!(s.pid as i32, pid, "engine not adopted");
    only_engine(&ctl, pid).await;
}

#[tokio::test]
async fn killed_during_a_start_the_starting_engine_is_adopted() {
    let model = fake_model("chat", "awake", &["--startup-time", "4s"], "");
    let mut ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let pid = wait_status(&mut c, "chat", "spawned", LONG, |s| {
        state(s) == pb::ModelState::Starting && s.pid != 0
    })
    .await
    .pid as i32;
    ctl.restart().await;
    let mut c = ctl.client().await;
    let s = status(&mut c, "chat").await;
    assert_eq!(state(&s), pb::ModelState::Starting, "{s:#?}");
    assert_eq!(s.pid as i32, pid);
    let s = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    assert_eq!(s.pid as i32, pid, "engine not adopted");
    // The one spawn before the kill, carried over by adoption: no new one.
    assert_eq!(s.restarts, 1, "no new engine was spawned");
    only_engine(&ctl, pid).await;
}

#[tokio::test]
async fn killed_during_a_stop_the_engine_ends_stopped() {
    let model = fake_model("chat", "awake", &[], "");
    let mut ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    c.stop(pb::ModelRequest {
        name: "chat".into(),
    })
    .await
    .unwrap();
    ctl.restart().await;
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "chat", pb::ModelState::Stopped, LONG).await;
    assert_eq!(s.intent.unwrap().desired, pb::DesiredState::Stopped as i32);
    wait_until("no engine left", LONG, || async {
        engine_groups(&ctl).is_empty()
    })
    .await;
}

#[tokio::test]
async fn engines_of_removed_models_are_stopped_and_dead_ones_respawned() {
    let models = format!(
        "{}{}{}",
        fake_model("keep", "awake", &[], ""),
        fake_model("gone", "awake", &[], ""),
        fake_model("dead", "awake", &[], "")
    );
    let mut ctl = start(&config(&models)).await;
    let mut c = ctl.client().await;
    let mut pids = Vec::new();
    for m in ["keep", "gone", "dead"] {
        pids.push(wait_state(&mut c, m, pb::ModelState::Awake, LONG).await.pid as i32);
    }
    ctl.kill9();
    // While siesta is down: one engine dies, one model leaves the config.
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pids[2]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let text = std::fs::read_to_string(&ctl.config_path).unwrap();
    let without = text.replacen(
        &fake_model("gone", "awake", &[], "")
            .replace("@DIR@", &ctl.dir.path().display().to_string())
            .replace("@FAKE_VLLM@", &siesta_tests::fake_vllm_command()),
        "",
        1,
    );
    assert_ne!(without, text, "model not removed from the config");
    std::fs::write(&ctl.config_path, without).unwrap();
    ctl.restart().await;
    let mut c = ctl.client().await;
    let keep = wait_state(&mut c, "keep", pb::ModelState::Awake, LONG).await;
    assert_eq!(keep.pid as i32, pids[0], "running engine not adopted");
    let dead = wait_state(&mut c, "dead", pb::ModelState::Awake, LONG).await;
    assert_ne!(dead.pid as i32, pids[2]);
    wait_until("removed model's engine stopped", LONG, || async {
        siesta_tests::group_members(pids[1]).is_empty()
    })
    .await;
    assert_eq!(
        engine_groups(&ctl),
        BTreeSet::from([pids[0], dead.pid as i32])
    );
}

/// Operations with kills at arbitrary moments: every model ends as its
/// last intent says, with one engine per running model.
#[tokio::test]
async fn repeated_kills_at_arbitrary_moments_converge() {
    let flags = [
        "--startup-time",
        "300ms",
        "--sleep-time",
        "300ms",
        "--wake-time",
        "300ms",
    ];
    let mut ctl = start(&config(&fake_model("chat", "awake", &flags, ""))).await;
    let ops: [(&str, u64); 8] = [
        ("sleep", 100),
        ("wake", 150),
        ("stop", 50),
        ("start", 200),
        ("sleep", 250),
        ("restart", 120),
        ("wake", 0),
        ("sleep", 350),
    ];
    for (op, delay_ms) in ops {
        let mut c = ctl.client().await;
        let name = "chat".to_string();
        match op {
            "sleep" => drop(c.sleep(pb::SleepRequest { name, level: 1 }).await),
            "wake" => {
                wake(&mut c, &name, false).await;
            }
            "stop" => drop(c.stop(pb::ModelRequest { name }).await),
            "start" => drop(c.start(pb::ModelRequest { name }).await),
            _ => drop(c.restart(pb::ModelRequest { name }).await),
        }
        tokio::time::sleep(std::time::Duration::from_millis(delay_ms)).await;
        ctl.restart().await;
    }
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG).await;
    assert_eq!(s.sleep_level, 1);
    only_engine(&ctl, s.pid as i32).await;
}

/// A proxy holding requests while siesta-control is killed in the middle
/// of the wake they caused: after the restart they are served (within
/// `max_hold`), by the same engine.
#[tokio::test]
async fn requests_held_across_a_control_restart_are_served() {
    let model = fake_model("sleepy", "asleep", &["--wake-time", "2s"], "");
    let mut ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let pid = wait_state(&mut c, "sleepy", pb::ModelState::Asleep, LONG)
        .await
        .pid;
    let proxy = siesta_tests::spawn_proxy(&[ctl.url()], &[]).await;
    let ready = format!("{}/readyz", proxy.url());
    wait_until("proxy ready", LONG, || async {
        reqwest::get(&ready).await.is_ok_and(|r| r.status() == 200)
    })
    .await;
    let url = format!("{}/v1/chat/completions", proxy.url());
    let held: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let body = serde_json::json!({"model": "sleepy", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}]});
                let r = reqwest::Client::new()
                    .post(&url)
                    .json(&body)
                    .timeout(std::time::Duration::from_secs(60))
                    .send()
                    .await
                    .unwrap();
                r.status().as_u16()
            })
        })
        .collect();
    wait_state(&mut c, "sleepy", pb::ModelState::Waking, LONG).await;
    ctl.restart().await;
    for h in held {
        assert_eq!(h.await.unwrap(), 200);
    }
    let mut c = ctl.client().await;
    let s = status(&mut c, "sleepy").await;
    assert_eq!((state(&s), s.pid), (pb::ModelState::Awake, pid));
    only_engine(&ctl, pid as i32).await;
}

/// `chat` (fake-vllm whose engine core outlives its server) awake; then
/// siesta-control killed with `kill -9`, and the engine's server with it:
/// its engine core is left running. Returns the control plane, down, and
/// the dead server's pid (its process group's).
async fn down_with_an_engine_core_left() -> (Ctl, i32) {
    let model = fake_model("chat", "awake", &["--orphan-engine-core"], "");
    let mut ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let pid = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG)
        .await
        .pid as i32;
    wait_until("engine-core child up", LONG, || async {
        siesta_tests::group_members(pid).len() >= 2
    })
    .await;
    ctl.kill9();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_until("server gone, engine core left", LONG, || async {
        !siesta_tests::alive(pid) && !siesta_tests::group_members(pid).is_empty()
    })
    .await;
    (ctl, pid)
}

/// The engine's server died while siesta was down but its engine-core child
/// lives on (as vLLM's does): the leftover is killed, a fresh engine started.
#[tokio::test]
async fn leftovers_of_an_engine_that_died_while_siesta_was_down_are_killed() {
    let (mut ctl, pid) = down_with_an_engine_core_left().await;
    ctl.restart().await;
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    assert_ne!(s.pid as i32, pid);
    wait_until("leftover engine core killed", LONG, || async {
        siesta_tests::group_members(pid).is_empty()
    })
    .await;
    only_engine(&ctl, s.pid as i32).await;
}

/// The store was lost while siesta was down (here: turned to garbage, so it
/// is moved aside): the engine it recorded still runs, with its engine core
/// child. It is found by the state directory in its environment and stopped
/// before the model's new engine starts (which needs its port).
#[tokio::test]
async fn an_engine_whose_record_was_lost_with_the_store_is_stopped_first() {
    let model = fake_model("chat", "awake", &["--orphan-engine-core"], "");
    let mut ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let old = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG)
        .await
        .pid as i32;
    wait_until("engine-core child up", LONG, || async {
        siesta_tests::group_members(old).len() >= 2
    })
    .await;
    ctl.kill9();
    let store = ctl.dir.path().join("state/siesta.redb");
    std::fs::write(&store, vec![0xa5u8; 20000]).unwrap();
    ctl.restart().await;
    ctl.child
        .output()
        .wait_for("has no record (its store was lost)", LONG)
        .await;
    let mut c = ctl.client().await;
    let new = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    assert_ne!(new.pid as i32, old);
    // Gone before the new one started, not eventually.
    assert_eq!(siesta_tests::group_members(old), Vec::<i32>::new());
    only_engine(&ctl, new.pid as i32).await;
}

/// The store was lost and the engine's server died while siesta was down: only its
/// engine core is left (as vLLM's outlives its server), renamed as vLLM names it, which
/// zeroes what `/proc` shows of its environment unless `SPT_NOENV` is set. siesta sets
/// it, so the leftover is found by its state directory and killed before the new engine
/// starts; before, it was never found, and kept its GPU memory.
#[tokio::test]
async fn an_engine_core_left_by_a_dead_server_whose_record_was_lost_is_killed() {
    let (mut ctl, old) = down_with_an_engine_core_left().await;
    let store = ctl.dir.path().join("state/siesta.redb");
    std::fs::write(&store, vec![0xa5u8; 20000]).unwrap();
    ctl.restart().await;
    let mut c = ctl.client().await;
    let new = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    assert_ne!(new.pid as i32, old);
    // Gone before the new one started, not eventually.
    assert_eq!(siesta_tests::group_members(old), Vec::<i32>::new());
    only_engine(&ctl, new.pid as i32).await;
}

/// A SIGTERM while the restarted control plane is still recovering (here:
/// its adopted engine's `/is_sleeping` waits behind a long wake, up to the
/// 300 s wake timeout) ends it promptly, not when recovery is over.
#[tokio::test]
async fn a_sigterm_during_recovery_is_not_kept_waiting() {
    let model = fake_model(
        "chat",
        "asleep",
        &["--wake-time", "300s"],
        r#"wake_timeout = "300s""#,
    );
    let mut ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let pid = wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG)
        .await
        .pid as i32;
    wake(&mut c, "chat", false).await;
    let s = wait_state(&mut c, "chat", pb::ModelState::Waking, LONG).await;
    // Waking is published before admission answers and the wake call goes:
    // restart only once the engine has the wake (its /is_sleeping then
    // waits behind it, as vLLM's does).
    let is_sleeping = format!("{}/is_sleeping", endpoint(&s));
    wait_until("the engine waking", LONG, || {
        let url = is_sleeping.clone();
        async move {
            reqwest::Client::new()
                .get(url)
                .timeout(std::time::Duration::from_millis(300))
                .send()
                .await
                .is_err()
        }
    })
    .await;
    ctl.restart().await;
    ctl.child
        .output()
        .wait_for("/is_sleeping not answered yet", LONG)
        .await;
    // `terminate` waits 30 s for the exit; recovery alone would take 300.
    let status = ctl.terminate().await;
    assert!(status.success(), "{status:?}");
    let log = ctl.child.output().text();
    assert!(log.contains("recovery abandoned"), "{log}");
    // The engine is left running, as at any exit, for the next start.
    assert!(siesta_tests::alive(pid));
}
