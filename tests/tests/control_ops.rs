//! siesta-control operations beyond sleep and wake: logs, restart, pin,
//! reload, intents that survive a restart of the control plane.

use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;
use siesta_tests::wait_until;
use std::time::Duration;

#[tokio::test]
async fn logs_tail_and_follow() {
    let ctl = start(&config(&fake_model("chat", "awake", &[], ""))).await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    // The engine's uvicorn line reaches the ring (tailed from its log file).
    wait_until("uvicorn line in logs", LONG, || {
        let mut c = c.clone();
        async move {
            let mut s = c
                .logs(pb::LogsRequest {
                    name: "chat".into(),
                    tail: None,
                    follow: false,
                })
                .await
                .unwrap()
                .into_inner();
            let mut found = false;
            while let Some(l) = s.message().await.unwrap() {
                found |= l.stream == "stdout" && l.line.contains("Uvicorn running on");
            }
            found
        }
    })
    .await;
    let mut follow = c
        .logs(pb::LogsRequest {
            name: "chat".into(),
            tail: Some(1),
            follow: true,
        })
        .await
        .unwrap()
        .into_inner();
    let first = follow.message().await.unwrap().unwrap();
    c.sleep(pb::SleepRequest {
        name: "chat".into(),
        level: 1,
    })
    .await
    .unwrap();
    let mut last_seq = first.seq;
    let line = tokio::time::timeout(LONG, async {
        loop {
            let l = follow.message().await.unwrap().unwrap();
            assert!(l.seq > last_seq);
            last_seq = l.seq;
            if l.stream == "siesta" && l.line.contains("sleeping at level 1") {
                return l;
            }
        }
    })
    .await
    .expect("siesta line followed");
    assert!(line.at_unix_ms > 0);
}

#[tokio::test]
async fn restart_replaces_the_engine_and_pin_blocks_tiers() {
    let model = fake_model(
        "chat",
        "awake",
        &[],
        r#"idle = [ { after = "1s", action = "sleep", level = 1 } ]"#,
    );
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    let old_pid = s.pid as i32;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let r = c
        .pin(pb::PinRequest {
            name: "chat".into(),
            until_unix_ms: now + 60_000,
            for_ms: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.model.unwrap().pinned_until_unix_ms > now);
    // For a while, on the control plane's clock: an `until` a client with a
    // clock behind sent in the past is not read.
    let r = c
        .pin(pb::PinRequest {
            name: "chat".into(),
            until_unix_ms: now - 40_000,
            for_ms: 60_000,
        })
        .await
        .expect("a pin for 60 s from a client whose clock is behind")
        .into_inner();
    let until = r.model.unwrap().pinned_until_unix_ms;
    assert!(
        (now + 50_000..now + 120_000).contains(&until),
        "{until} vs {now}"
    );
    c.restart(pb::ModelRequest {
        name: "chat".into(),
    })
    .await
    .unwrap();
    let s = wait_status(&mut c, "chat", "a new engine awake", LONG, |s| {
        state(s) == pb::ModelState::Awake && s.pid as i32 != old_pid
    })
    .await;
    assert_eq!(s.restarts, 2);
    wait_until("old group gone", LONG, || async {
        siesta_tests::group_members(old_pid).is_empty()
    })
    .await;
    // Pinned: no tier is scheduled, and the 1 s tier does not fire. The
    // sleep is deliberate (absence can only be sampled); the pin timing
    // itself is unit-tested (reconciler `pin_blocks_tiers_until_it_expires`).
    assert!(s.next_tier.is_none(), "{s:?}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(state(&status(&mut c, "chat").await), pb::ModelState::Awake);
    c.unpin(pb::ModelRequest {
        name: "chat".into(),
    })
    .await
    .unwrap();
    wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG).await;
}

#[tokio::test]
async fn reload_adds_and_removes_models() {
    let a = fake_model("a", "awake", &[], "");
    let ctl = start(&config(&a)).await;
    let mut c = ctl.client().await;
    let pid = wait_state(&mut c, "a", pb::ModelState::Awake, LONG)
        .await
        .pid as i32;
    let text = std::fs::read_to_string(&ctl.config_path).unwrap();
    // An invalid file is refused and changes nothing.
    std::fs::write(&ctl.config_path, format!("{text}\nbogus = 1\n")).unwrap();
    let e = c.reload(pb::ReloadRequest {}).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(
        e.message().contains("bogus: unknown key"),
        "{}",
        e.message()
    );
    // Replace model a by b.
    let b = text
        .replace("name = \"a\"", "name = \"b\"")
        .replace("fake/a", "fake/b");
    std::fs::write(&ctl.config_path, b).unwrap();
    let r = c.reload(pb::ReloadRequest {}).await.unwrap().into_inner();
    assert_eq!(
        (r.added, r.removed),
        (vec!["b".to_string()], vec!["a".to_string()])
    );
    assert_eq!(
        c.get_model(pb::GetModelRequest { name: "a".into() })
            .await
            .unwrap_err()
            .code(),
        tonic::Code::NotFound
    );
    assert!(
        siesta_tests::group_members(pid).is_empty(),
        "removed model's engine still runs"
    );
    wait_state(&mut c, "b", pb::ModelState::Awake, LONG).await;
}

#[tokio::test]
async fn operator_intents_survive_a_control_restart() {
    let cfg = config(&fake_model("chat", "awake", &[], ""));
    let mut ctl = start(&cfg).await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    c.stop(pb::ModelRequest {
        name: "chat".into(),
    })
    .await
    .unwrap();
    wait_state(&mut c, "chat", pb::ModelState::Stopped, LONG).await;
    // The intent is committed to the state store before Stop answers.
    ctl.restart().await;
    let mut c = ctl.client().await;
    let s = status(&mut c, "chat").await;
    assert_eq!(state(&s), pb::ModelState::Stopped);
    let intent = s.intent.unwrap();
    assert_eq!(intent.desired, pb::DesiredState::Stopped as i32);
    assert_eq!(intent.reason, pb::IntentReason::Operator as i32);
}
