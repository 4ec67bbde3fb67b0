//! siesta-control under faults: engine crash, wake that hangs, engine that
//! never becomes healthy.

use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;
use siesta_tests::{group_members, wait_until};
use std::time::Duration;

/// Collects each distinct state the model passes through until `until`.
async fn states_until(
    stream: &mut tonic::Streaming<pb::WatchEvent>,
    name: &str,
    until: impl Fn(&pb::ModelStatus) -> bool,
) -> Vec<pb::ModelState> {
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let ev = tokio::time::timeout_at(deadline, stream.message())
            .await
            .unwrap_or_else(|_| panic!("timed out; states so far {seen:?}"))
            .unwrap()
            .unwrap();
        let models = match ev.kind {
            Some(pb::watch_event::Kind::Model(m)) => vec![m],
            Some(pb::watch_event::Kind::Snapshot(s)) => s.models,
            _ => vec![],
        };
        for m in models.into_iter().filter(|m| m.name == name) {
            let st = state(&m);
            if seen.last() != Some(&st) {
                seen.push(st);
            }
            if until(&m) {
                return seen;
            }
        }
    }
}

#[tokio::test]
async fn engine_crash_goes_failed_then_restarts() {
    let model = fake_model("chat", "awake", &["--crash-after-requests", "1"], "");
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    let first_pid = s.pid as i32;
    let mut stream = c
        .watch(pb::WatchRequest {
            since_revision: 0,
            client_id: "t".into(),
            incarnation: 0,
            heartbeat: false,
        })
        .await
        .unwrap()
        .into_inner();
    let url = endpoint(&s);
    assert!(chat(&url, "chat").await.contains("siesta"));
    // The second request kills the engine.
    let _ = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]}))
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    let seen = states_until(&mut stream, "chat", |m| {
        state(m) == pb::ModelState::Awake && m.restarts >= 2
    })
    .await;
    let failed = seen
        .iter()
        .position(|s| *s == pb::ModelState::Failed)
        .expect("failed seen");
    let starting = seen
        .iter()
        .rposition(|s| *s == pb::ModelState::Starting)
        .unwrap();
    assert!(failed < starting, "{seen:?}");
    let s = status(&mut c, "chat").await;
    assert_ne!(s.pid as i32, first_pid);
    assert!(
        group_members(first_pid).is_empty(),
        "old engine group still alive"
    );
    assert!(chat(&endpoint(&s), "chat").await.contains("siesta"));
}

#[tokio::test]
async fn wake_that_hangs_is_killed_at_its_deadline_and_retried() {
    let model = fake_model(
        "chat",
        "asleep",
        &["--hang-on-wake"],
        r#"wake_timeout = "2s""#,
    );
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG).await;
    let pid = s.pid as i32;
    assert!(!group_members(pid).is_empty());
    let mut stream = c
        .watch(pb::WatchRequest {
            since_revision: 0,
            client_id: "t".into(),
            incarnation: 0,
            heartbeat: false,
        })
        .await
        .unwrap()
        .into_inner();
    let d = c
        .demand(pb::DemandRequest {
            model: "chat".into(),
            proxy_id: "t".into(),
            queued: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(d.accepted);
    let waking = wait_state(&mut c, "chat", pb::ModelState::Waking, LONG).await;
    assert!(waking.deadline_unix_ms > 0);
    let failed = wait_state(&mut c, "chat", pb::ModelState::Failed, LONG).await;
    assert!(failed.last_error.contains("wake"), "{}", failed.last_error);
    assert!(failed.retry_at_unix_ms > 0);
    assert_eq!(failed.failures, 1);
    // The whole process group (fake-vllm and its engine-core child) is gone.
    wait_until("hung engine's process group gone", LONG, || async {
        group_members(pid).is_empty()
    })
    .await;
    // Retried: a fresh engine, awake (demand wants it awake).
    let seen = states_until(&mut stream, "chat", |m| state(m) == pb::ModelState::Awake).await;
    assert!(seen.contains(&pb::ModelState::Starting), "{seen:?}");
    let s = status(&mut c, "chat").await;
    assert_ne!(s.pid as i32, pid);
    // Forgotten only once the new engine has stayed up 60 s.
    assert_eq!(s.failures, 1);
}

#[tokio::test]
async fn start_that_never_finishes_fails_with_backoff() {
    let model = fake_model(
        "chat",
        "awake",
        &["--hang-on-startup"],
        r#"start_timeout = "1s""#,
    );
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let s = wait_status(&mut c, "chat", "two failures", LONG, |s| s.failures >= 2).await;
    assert!(s.last_error.contains("start timed out"), "{}", s.last_error);
    assert!(s.restarts >= 2);
    // Stop wins over the retries.
    c.stop(pb::ModelRequest {
        name: "chat".into(),
    })
    .await
    .unwrap();
    let s = wait_state(&mut c, "chat", pb::ModelState::Stopped, LONG).await;
    assert_eq!(s.retry_at_unix_ms, 0);
}

/// An engine whose command line vLLM refuses (a flag it does not know)
/// exits 2 after argparse's refusal: the model's `last_error` says which
/// flag, where it said only `exit status: 2` and the reason was in the
/// engine's log alone.
#[tokio::test]
async fn a_refused_command_line_is_named_in_last_error() {
    let model = fake_model("chat", "awake", &["--no-such-flag"], "");
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let failed = wait_state(&mut c, "chat", pb::ModelState::Failed, LONG).await;
    assert!(
        failed
            .last_error
            .contains("vllm serve: error: unrecognized arguments: --no-such-flag"),
        "{}",
        failed.last_error
    );
}
