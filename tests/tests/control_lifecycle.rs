//! siesta-control with fake-vllm engines: start, sleep, wake, idle tiers,
//! requests in flight, attach engines.

use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;
use std::time::Duration;

#[tokio::test]
async fn start_sleep_wake_at_both_levels() {
    let ctl = start(&config(&fake_model(
        "chat",
        "none",
        &["--startup-time", "300ms"],
        "",
    )))
    .await;
    let mut c = ctl.client().await;
    assert_eq!(
        state(&status(&mut c, "chat").await),
        pb::ModelState::Stopped
    );

    let s = wake_awake(&mut c, "chat").await;
    assert!(s.pid > 0);
    assert!(s.calibration.as_ref().unwrap().start_ms > 0);
    let url = endpoint(&s);
    assert!(chat(&url, "chat").await.contains("siesta"));

    for level in [1u32, 2] {
        c.sleep(pb::SleepRequest {
            name: "chat".into(),
            level,
        })
        .await
        .unwrap();
        let s = wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG).await;
        assert_eq!(s.sleep_level, level);
        let intent = s.intent.unwrap();
        assert_eq!(intent.reason, pb::IntentReason::Operator as i32);
        let r = c
            .wake(pb::WakeRequest {
                name: "chat".into(),
                wait: true,
                timeout_ms: 0,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            state(r.model.as_ref().unwrap()),
            pb::ModelState::Awake,
            "{}",
            r.message
        );
        // After a level-2 wake the weights were reloaded: a real answer, not garbage.
        let answer = chat(&url, "chat").await;
        assert!(
            answer.contains("siesta"),
            "answer after level-{level} wake: {answer:?}"
        );
    }
    let s = status(&mut c, "chat").await;
    let cal = s.calibration.unwrap();
    assert_eq!((cal.sleep_l1_samples, cal.sleep_l2_samples), (1, 1));
    assert_eq!((cal.wake_l1_samples, cal.wake_l2_samples), (1, 1));
    assert!(cal.wake_l2_ms > 0);

    // Stop: the process group is gone.
    let pid = s.pid as i32;
    c.stop(pb::ModelRequest {
        name: "chat".into(),
    })
    .await
    .unwrap();
    wait_state(&mut c, "chat", pb::ModelState::Stopped, LONG).await;
    siesta_tests::wait_until("engine group gone", LONG, || async {
        siesta_tests::group_members(pid).is_empty()
    })
    .await;
    // Demand does not start a model an operator stopped.
    let d = c
        .demand(pb::DemandRequest {
            model: "chat".into(),
            proxy_id: "t".into(),
            queued: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!d.accepted);
}

#[tokio::test]
async fn errors_map_to_status_codes() {
    let ctl = start(&config(&fake_model(
        "chat",
        "none",
        &[],
        "aliases = [\"gpt\"]",
    )))
    .await;
    let mut c = ctl.client().await;
    let e = c
        .get_model(pb::GetModelRequest {
            name: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    let e = c
        .sleep(pb::SleepRequest {
            name: "gpt".into(),
            level: 3,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let e = c
        .pin(pb::PinRequest {
            name: "chat".into(),
            until_unix_ms: 1000,
            for_ms: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let info = c
        .get_info(pb::GetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(info.config_path.ends_with("siesta.toml"));
}

#[tokio::test]
async fn idle_tiers_fire_in_order() {
    let model = fake_model(
        "chat",
        "awake",
        &[],
        r#"idle = [ { after = "2s", action = "sleep", level = 1 },
         { after = "4s", action = "sleep", level = 2 },
         { after = "6s", action = "stop" } ]"#,
    );
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    let tier = s.next_tier.unwrap();
    assert_eq!((tier.action, tier.level), (pb::IdleAction::Sleep as i32, 1));
    // Watch the transitions as they happen.
    let mut stream = c
        .watch(pb::WatchRequest {
            since_revision: 0,
            client_id: "test".into(),
            incarnation: 0,
            heartbeat: false,
        })
        .await
        .unwrap()
        .into_inner();
    let mut seen: Vec<(i32, u32)> = Vec::new();
    let deadline = tokio::time::Instant::now() + LONG;
    while !seen
        .iter()
        .any(|(st, _)| *st == pb::ModelState::Stopped as i32)
    {
        let ev = tokio::time::timeout_at(deadline, stream.message())
            .await
            .expect("tiers did not fire in time")
            .unwrap()
            .unwrap();
        if let Some(pb::watch_event::Kind::Model(m)) = ev.kind {
            let entry = (m.state, m.sleep_level);
            if seen.last() != Some(&entry) {
                seen.push(entry);
            }
        }
    }
    let asleep = |l| (pb::ModelState::Asleep as i32, l);
    let i1 = seen
        .iter()
        .position(|e| *e == asleep(1))
        .expect("asleep at 1");
    let i2 = seen
        .iter()
        .position(|e| *e == asleep(2))
        .expect("asleep at 2");
    assert!(i1 < i2, "{seen:?}");
    let s = status(&mut c, "chat").await;
    assert_eq!(s.intent.unwrap().reason, pb::IntentReason::IdleTier as i32);
}

#[tokio::test]
async fn a_model_with_requests_in_flight_is_not_put_to_sleep() {
    let model = fake_model(
        "chat",
        "awake",
        &[],
        r#"idle = [ { after = "1s", action = "sleep", level = 1 } ]"#,
    );
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    let report = |in_flight, finished| pb::ReportActivityRequest {
        proxy_id: "proxy-1".into(),
        models: vec![pb::ModelActivity {
            model: "chat".into(),
            started: 1,
            finished,
            in_flight,
            last_finished_unix_ms: 0,
            held: 0,
            fenced_since_unix_ms: 0,
        }],
        failures: vec![],
    };
    c.report_activity(report(1, 0)).await.unwrap();
    wait_status(&mut c, "chat", "in_flight = 1", LONG, |s| s.in_flight == 1).await;
    // With a request in flight no tier is scheduled; one and a half idle
    // periods pass (deliberate: absence can only be sampled) and it is still
    // awake.
    assert!(status(&mut c, "chat").await.next_tier.is_none());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let s = status(&mut c, "chat").await;
    assert_eq!(state(&s), pb::ModelState::Awake);
    assert!(s.next_tier.is_none());
    // Request done: the tier fires one idle period later.
    c.report_activity(report(0, 1)).await.unwrap();
    wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG).await;
}

#[tokio::test]
async fn attach_engine_is_slept_and_woken() {
    let engine = siesta_tests::spawn_fake_vllm(&[
        "ext-model",
        "--enable-sleep-mode",
        "--served-model-name",
        "ext",
    ])
    .await;
    let model = format!(
        r#"
[[model]]
name = "ext"
launch = "attach"
url = "{}"
gpus = 0
"#,
        engine.url
    );
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "ext", pb::ModelState::Awake, LONG).await;
    assert_eq!(s.launch, "attach");
    assert_eq!(s.pid, 0);
    c.sleep(pb::SleepRequest {
        name: "ext".into(),
        level: 2,
    })
    .await
    .unwrap();
    wait_state(&mut c, "ext", pb::ModelState::Asleep, LONG).await;
    let sleeping: serde_json::Value = reqwest::get(engine.at("/is_sleeping"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(sleeping["is_sleeping"], true);
    let e = c
        .stop(pb::ModelRequest { name: "ext".into() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    c.demand(pb::DemandRequest {
        model: "ext".into(),
        proxy_id: "t".into(),
        queued: 1,
    })
    .await
    .unwrap();
    wait_state(&mut c, "ext", pb::ModelState::Awake, LONG).await;
    assert!(chat(&engine.url, "ext").await.contains("siesta"));
}
