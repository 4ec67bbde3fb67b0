//! After `kill -9` of siesta-control, the adopted engine keeps its history:
//! the restart count and the last activity are those shown before.

use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;

#[tokio::test]
async fn restarts_and_last_activity_survive_adoption() {
    let ctl_cfg = config(&fake_model("chat", "awake", &[], ""));
    let mut ctl = start(&ctl_cfg).await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    // A second start: restarts 2.
    c.restart(pb::ModelRequest {
        name: "chat".into(),
    })
    .await
    .expect("Restart");
    wait_status(&mut c, "chat", "restarted and awake", LONG, |s| {
        state(s) == pb::ModelState::Awake && s.restarts == 2
    })
    .await;
    // A request served through a proxy, as the proxy reports it.
    let finished = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    c.report_activity(pb::ReportActivityRequest {
        proxy_id: "test-proxy".into(),
        models: vec![pb::ModelActivity {
            model: "chat".into(),
            started: 1,
            finished: 1,
            in_flight: 0,
            last_finished_unix_ms: finished,
            held: 0,
            fenced_since_unix_ms: 0,
        }],
        ..Default::default()
    })
    .await
    .expect("ReportActivity");
    let before = wait_status(&mut c, "chat", "the activity recorded", LONG, |s| {
        s.last_activity_unix_ms >= finished
    })
    .await;
    let pid = before.pid;

    ctl.restart().await;
    let mut c = ctl.client().await;
    let after = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    assert_eq!(after.pid, pid, "engine not adopted");
    assert_eq!(after.restarts, before.restarts, "{after:#?}");
    assert_eq!(
        after.last_activity_unix_ms, before.last_activity_unix_ms,
        "{after:#?}"
    );
}
