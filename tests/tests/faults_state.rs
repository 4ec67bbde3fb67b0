//! The state directory under faults: unusable, corrupt, shared by two
//! control planes. Errors are clear and name the path; nothing is corrupted
//! or silently reset.

use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;
use siesta_tests::{DEADLINE, bin_path, group_members, wait_until};
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Runs siesta-control with `config_toml` (`@DIR@` → `dir`) until it exits
/// on its own (it must: start-up fails) and returns its output.
fn run_to_failure(dir: &Path, config_toml: &str) -> Output {
    let cfg = dir.join("failing.toml");
    let text = config_toml
        .replace("@DIR@", &dir.display().to_string())
        .replace("@FAKE_VLLM@", &siesta_tests::fake_vllm_command());
    std::fs::write(&cfg, text).unwrap();
    let mut child = Command::new(bin_path("siesta-control"))
        .arg("--config")
        .arg(&cfg)
        .args(["--listen", "127.0.0.1:0"])
        .arg("--addr-file")
        .arg(dir.join("failing.addr"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > DEADLINE {
            child.kill().unwrap();
            panic!("siesta-control kept running with an unusable state directory");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    assert!(
        !dir.join("failing.addr").exists(),
        "announced an address before failing"
    );
    out
}

/// Not the state directory's fault, but start-up's: a model on a `host` that
/// is no address of this machine stops the start before the store is
/// opened, naming the file, the key and the model (it said only "cannot
/// start: cannot pick a free port on ...").
#[tokio::test]
async fn a_host_that_is_no_address_of_this_machine_is_named_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_to_failure(
        dir.path(),
        "[control]\nstate_dir = \"@DIR@/state\"\n[[model]]\nname = \"far\"\nmodel = \"m\"\n\
         gpus = 0\nhost = \"192.0.2.1\"\n",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "failing.toml: model[0].host: model \"far\": cannot pick a free port on \"192.0.2.1\""
        ),
        "{err}"
    );
    assert!(!dir.path().join("state").exists(), "the store was opened");
}

#[tokio::test]
async fn a_state_dir_that_cannot_be_created_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("file"), "precious").unwrap();
    let cfg =
        config(&fake_model("chat", "awake", &[], "")).replace("@DIR@/state", "@DIR@/file/state");
    let out = run_to_failure(dir.path(), &cfg);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let path = dir.path().join("file/state");
    assert!(stderr.contains(&*path.to_string_lossy()), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("file")).unwrap(),
        "precious"
    );
    // No engine was started.
    assert!(
        siesta_tests::pids_with_env("SIESTA_TEST_TAG", &dir.path().display().to_string())
            .is_empty()
    );
}

#[tokio::test]
async fn an_unusable_part_of_the_state_dir_fails_without_touching_the_store() {
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
    ctl.terminate().await;
    let state_dir = ctl.dir.path().join("state");
    let store = std::fs::read(state_dir.join("siesta.redb")).unwrap();
    // The logs directory is replaced by a file: the state dir is unusable.
    std::fs::remove_dir_all(state_dir.join("logs")).unwrap();
    std::fs::write(state_dir.join("logs"), "not a directory").unwrap();
    let out = run_to_failure(ctl.dir.path(), &cfg);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&*state_dir.join("logs").to_string_lossy()),
        "{stderr}"
    );
    assert_eq!(std::fs::read(state_dir.join("siesta.redb")).unwrap(), store);
    // Repaired, the intent recorded before is still in force.
    std::fs::remove_file(state_dir.join("logs")).unwrap();
    ctl.restart().await;
    let mut c = ctl.client().await;
    let s = status(&mut c, "chat").await;
    assert_eq!(state(&s), pb::ModelState::Stopped);
    assert_eq!(s.intent.unwrap().reason, pb::IntentReason::Operator as i32);
}

#[tokio::test]
async fn a_corrupt_store_is_reported_and_moved_aside() {
    let ctl_dir = tempfile::tempdir().unwrap();
    let state = ctl_dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let garbage = vec![0xa5u8; 20000];
    std::fs::write(state.join("siesta.redb"), &garbage).unwrap();
    let cfg = config(&fake_model("chat", "asleep", &[], ""))
        .replace("@DIR@/state", &state.display().to_string());
    let ctl = start(&cfg).await;
    let line = ctl.child.output().wait_for("moved aside", DEADLINE).await;
    assert!(line.contains("siesta.redb.corrupt-"), "{line}");
    let aside: Vec<_> = std::fs::read_dir(&state)
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("siesta.redb.corrupt-")
        })
        .collect();
    assert_eq!(aside.len(), 1);
    assert_eq!(std::fs::read(aside[0].path()).unwrap(), garbage);
    let mut c = ctl.client().await;
    wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG).await;
}

#[tokio::test]
async fn a_second_control_plane_on_the_same_state_dir_is_refused() {
    let cfg = config(&fake_model("chat", "awake", &[], ""));
    let ctl = start(&cfg).await;
    let mut c = ctl.client().await;
    let pid = wait_state(&mut c, "chat", pb::ModelState::Awake, LONG)
        .await
        .pid;
    let other = tempfile::tempdir().unwrap();
    let shared = cfg.replace(
        "@DIR@/state",
        &ctl.dir.path().join("state").display().to_string(),
    );
    let out = run_to_failure(other.path(), &shared);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("in use"), "{stderr}");
    // The first one and its engine are undisturbed.
    let s = status(&mut c, "chat").await;
    assert_eq!((state(&s), s.pid), (pb::ModelState::Awake, pid));
}

#[tokio::test]
async fn a_start_that_hangs_leaves_no_process_behind_before_the_retry() {
    let model = fake_model(
        "chat",
        "awake",
        &["--hang-on-startup"],
        r#"start_timeout = "1s""#,
    );
    let ctl = start(&config(&model)).await;
    let mut c = ctl.client().await;
    let first = wait_status(&mut c, "chat", "spawned", LONG, |s| s.pid != 0)
        .await
        .pid as i32;
    let failed = wait_state(&mut c, "chat", pb::ModelState::Failed, LONG).await;
    assert!(failed.last_error.contains("start timed out"));
    wait_until("hung engine's group gone", LONG, || async {
        group_members(first).is_empty()
    })
    .await;
    let next = wait_status(&mut c, "chat", "retried", LONG, |s| {
        s.pid != 0 && s.pid as i32 != first
    })
    .await;
    assert!(next.restarts >= 2);
}
