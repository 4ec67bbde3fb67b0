//! The model task under paused time: timers, deadlines and backoff driven by
//! the real runner (the engine's URL refuses connections).

use super::*;
use crate::config::Config;
use crate::status::State;

fn shared(dir: &std::path::Path) -> Arc<Shared> {
    let clock = Clock::new();
    Arc::new(Shared {
        hub: Hub::new(clock, 100, 100),
        clock,
        locks: StartLocks::default(),
        store: Store::open(dir).unwrap(),
        log_dir: dir.join("logs"),
        control_id: "test".into(),
        poll_every: Duration::from_secs(1),
        stop_engines_on_exit: false,
        admission: crate::admission::Admission::open(),
    })
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
    assert_eq!(s.last_error, "start timed out");
    assert_eq!(s.retry_at_unix_ms - s.state_since_unix_ms, 60_000);
    // Retried after the backoff, fails again, then the delay is capped.
    let mut delays = vec![];
    for _ in 0..3 {
        rx.wait_for(|s| s.state == State::Starting).await.unwrap();
        let s = rx
            .wait_for(|s| s.state == State::Failed)
            .await
            .unwrap()
            .clone();
        delays.push((s.retry_at_unix_ms - s.state_since_unix_ms) / 1000);
    }
    assert_eq!(delays, [120, 120, 120]);
    assert_eq!(h.status.borrow().failures, 4);
    cancel.cancel();
    h.join().await;
}
