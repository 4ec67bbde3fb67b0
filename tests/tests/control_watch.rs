//! The Watch stream of the real siesta-control: ordering under concurrent
//! transitions, resuming, many subscribers; shutdown.

use futures::future::join_all;
use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;
use std::collections::BTreeMap;
use std::time::Duration;

const MODELS: [&str; 4] = ["m0", "m1", "m2", "m3"];

fn four_models() -> String {
    MODELS
        .iter()
        .map(|n| fake_model(n, "none", &["--startup-time", "100ms"], ""))
        .collect::<Vec<_>>()
        .join("\n")
}

async fn watch(c: &mut Client, since: u64) -> tonic::Streaming<pb::WatchEvent> {
    watch_of(c, since, 0).await
}

/// Watch after revision `since` of the run that started at `incarnation`.
async fn watch_of(
    c: &mut Client,
    since: u64,
    incarnation: i64,
) -> tonic::Streaming<pb::WatchEvent> {
    c.watch(pb::WatchRequest {
        since_revision: since,
        client_id: "t".into(),
        incarnation,
        heartbeat: false,
    })
    .await
    .unwrap()
    .into_inner()
}

async fn next(s: &mut tonic::Streaming<pb::WatchEvent>) -> pb::WatchEvent {
    tokio::time::timeout(LONG, s.message())
        .await
        .expect("watch event in time")
        .unwrap()
        .expect("stream open")
}

/// Drives every model through start, sleep and wake at once.
async fn churn(ctl: &Ctl) {
    let tasks = MODELS.iter().map(|name| async move {
        let mut c = ctl.client().await;
        c.wake(pb::WakeRequest {
            name: name.to_string(),
            wait: true,
            timeout_ms: 0,
        })
        .await
        .unwrap();
        c.sleep(pb::SleepRequest {
            name: name.to_string(),
            level: 1,
        })
        .await
        .unwrap();
        wait_state(&mut c, name, pb::ModelState::Asleep, LONG).await;
        c.wake(pb::WakeRequest {
            name: name.to_string(),
            wait: true,
            timeout_ms: 0,
        })
        .await
        .unwrap();
    });
    join_all(tasks).await;
}

#[tokio::test]
async fn revisions_strictly_increase_and_nothing_is_missed() {
    let ctl = start(&config(&four_models())).await;
    let mut c = ctl.client().await;
    let mut s = watch(&mut c, 0).await;
    let first = next(&mut s).await;
    let Some(pb::watch_event::Kind::Snapshot(snap)) = first.kind else {
        panic!("snapshot first")
    };
    assert_eq!(snap.models.len(), 4);
    let mut last = first.revision;
    // Each model's last published status, rebuilt from events only.
    let mut view: BTreeMap<String, pb::ModelStatus> = snap
        .models
        .into_iter()
        .map(|m| (m.name.clone(), m))
        .collect();
    let reader = tokio::spawn(async move {
        loop {
            let ev = next(&mut s).await;
            assert!(ev.revision > last, "revision {} after {last}", ev.revision);
            assert_eq!(ev.revision, last + 1, "an event was missed");
            last = ev.revision;
            if let Some(pb::watch_event::Kind::Model(m)) = ev.kind {
                view.insert(m.name.clone(), m);
            }
            let all_awake = view.values().all(|m| {
                state(m) == pb::ModelState::Awake
                    && m.calibration
                        .as_ref()
                        .is_some_and(|c| c.wake_l1_samples == 1)
            });
            if all_awake {
                return (last, view);
            }
        }
    });
    churn(&ctl).await;
    let (last, view) = tokio::time::timeout(LONG, reader).await.unwrap().unwrap();
    // The rebuilt view equals the server's own.
    let listed = c
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(listed.revision >= last);
    for m in listed.models {
        assert_eq!(view[&m.name].state, m.state);
    }
}

#[tokio::test]
async fn since_revision_resumes_without_a_snapshot() {
    let ctl = start(&config(&four_models())).await;
    let mut c = ctl.client().await;
    let mut s = watch(&mut c, 0).await;
    let rev = next(&mut s).await.revision;
    drop(s);
    c.wake(pb::WakeRequest {
        name: "m0".into(),
        wait: true,
        timeout_ms: 0,
    })
    .await
    .unwrap();
    let mut resumed = watch(&mut c, rev).await;
    let ev = next(&mut resumed).await;
    assert_eq!(ev.revision, rev + 1);
    assert!(
        matches!(ev.kind, Some(pb::watch_event::Kind::Model(_))),
        "{ev:?}"
    );
    // A revision from another life gets a fresh snapshot marked resync:
    // one above this run's, or one of another run (its start time given),
    // even where this run has passed it (revisions start over at a
    // restart). Of this run, given the same way, it resumes.
    let started = c
        .get_info(pb::GetInfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .started_unix_ms;
    for (since, of) in [(1_000_000, 0), (rev, started - 1)] {
        let mut stale = watch_of(&mut c, since, of).await;
        let ev = next(&mut stale).await;
        let Some(pb::watch_event::Kind::Snapshot(snap)) = ev.kind else {
            panic!("after {since} of {of}: {ev:?}")
        };
        assert!(snap.resync);
    }
    let mut same = watch_of(&mut c, rev, started).await;
    assert_eq!(next(&mut same).await.revision, rev + 1);
}

#[tokio::test]
async fn hundred_subscribers_see_the_same_events() {
    let ctl = start(&config(&four_models())).await;
    let c = ctl.client().await;
    let mut streams = Vec::new();
    for _ in 0..100 {
        let mut c = c.clone();
        streams.push(watch(&mut c, 0).await);
    }
    let readers: Vec<_> = streams
        .into_iter()
        .map(|mut s| {
            tokio::spawn(async move {
                let mut revs = Vec::new();
                let mut awake = 0;
                while awake < 2 {
                    let ev = next(&mut s).await;
                    if let Some(pb::watch_event::Kind::Model(m)) = &ev.kind
                        && state(m) == pb::ModelState::Awake
                    {
                        awake += 1;
                    }
                    revs.push(ev.revision);
                }
                revs
            })
        })
        .collect();
    let mut c2 = c.clone();
    let a = c2.wake(pb::WakeRequest {
        name: "m0".into(),
        wait: true,
        timeout_ms: 0,
    });
    let mut c3 = c.clone();
    let b = c3.wake(pb::WakeRequest {
        name: "m1".into(),
        wait: true,
        timeout_ms: 0,
    });
    let (a, b) = tokio::join!(a, b);
    a.unwrap();
    b.unwrap();
    let all: Vec<Vec<u64>> = join_all(readers)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    for revs in &all {
        assert!(revs.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(revs.last(), all[0].last());
    }
}

#[tokio::test]
async fn sigterm_ends_streams_and_leaves_engines_running() {
    let ctl_cfg = config(&fake_model("chat", "awake", &[], ""));
    let mut ctl = start(&ctl_cfg).await;
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    let pid = s.pid as i32;
    let mut stream = watch(&mut c, 0).await;
    next(&mut stream).await;
    let status = ctl.terminate().await;
    assert!(status.success(), "{status}");
    // The stream ends rather than hanging.
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                _ => return,
            }
        }
    })
    .await;
    assert!(end.is_ok());
    assert!(siesta_tests::alive(pid), "engine was stopped on SIGTERM");
    // The test cleans up the engine it left behind.
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .ok();
}

#[tokio::test]
async fn stop_engines_on_exit_stops_them() {
    let cfg = config(&fake_model("chat", "awake", &[], ""));
    let mut ctl = start_with(&cfg, &["--stop-engines-on-exit"]).await;
    let mut c = ctl.client().await;
    let pid = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG)
        .await
        .pid as i32;
    assert!(ctl.terminate().await.success());
    assert!(siesta_tests::group_members(pid).is_empty());
}
