//! A reload names the settings it does not apply.

use super::*;
use crate::hub::Hub;
use crate::status::Clock;
use crate::store::Store;
use crate::supervisor::StartLocks;

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
        cuda_checkpoint: crate::checkpoint::default_tool(),
        stop_engines_on_exit: false,
        admission: crate::admission::Admission::open(),
        engine_idle_timeout: crate::engine::DEFAULT_IDLE_TIMEOUT,
        fences: Default::default(),
    })
}

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
