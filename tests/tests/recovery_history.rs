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
    let restarted = wait_status(&mut c, "chat", "restarted and awake", LONG, |s| {
        state(s) == pb::ModelState::Awake && s.restarts == 2
    })
    .await;
    // A request served through a proxy, as the proxy reports it, finished
    // well after the restart's own activity (so the two cannot be taken
    // for each other below).
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };
    let apart = restarted.last_activity_unix_ms + 500 - now_ms();
    if apart > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(apart as u64)).await;
    }
    let finished = now_ms();
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
    // Within 100 ms of `finished`, not `>=`: the daemon maps Unix times
    // onto its monotonic clock from one pair of readings taken at its
    // start and clamps a time past its own now to now; on a loaded box the
    // two readings can be a few ms apart (CI saw it never reach `finished`).
    let before = wait_status(&mut c, "chat", "the activity recorded", LONG, |s| {
        s.last_activity_unix_ms + 100 >= finished
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
