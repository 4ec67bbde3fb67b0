//! A configuration with a model that can never fit its GPUs is refused by
//! `siesta config check` (exit 1) and by `siesta-control` (exit non-zero,
//! nothing started), with the same line naming the file, the key, the
//! model and the arithmetic. GPUs listed by hand (`[[gpu]]`); where NVML is
//! present the inventory is the real one and these tests skip.

use siesta_tests::cli::siesta;
use siesta_tests::{DEADLINE, control_exit};
use std::path::Path;
use std::time::Duration;

fn nvml_here() -> bool {
    if Path::new("/dev/nvidiactl").exists() {
        eprintln!("skipped: NVML GPUs here, the inventory is not the config's");
        return true;
    }
    false
}

/// One 80 GiB GPU, a model that fits, and `bad`.
fn config_with(dir: &Path, bad: &str) -> std::path::PathBuf {
    let path = dir.join("siesta.toml");
    let text = format!(
        r#"
[control]
state_dir = "{state}"
p2p_probe = "off"

[[gpu]]
index = 0
name = "test-gpu"
memory = "80GiB"

[[model]]
name = "fits"
model = "m"
gpus = 1
gpu_memory = 0.5

[[model]]
model = "m"
{bad}
"#,
        state = dir.join("state").display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs the daemon on `config` until it exits (it must, within the
/// deadline): (exit code, stderr).
async fn daemon(config: &Path) -> (Option<i32>, String) {
    let args = [
        "--config".as_ref(),
        config.as_os_str(),
        "--listen".as_ref(),
        "127.0.0.1:0".as_ref(),
    ];
    control_exit(&args, &[], DEADLINE.max(Duration::from_secs(60))).await
}

#[tokio::test]
async fn a_model_that_can_never_fit_is_refused_by_config_check_and_the_daemon_alike() {
    if nvml_here() {
        return;
    }
    let cases = [
        (
            "name = \"big\"\ngpus = 1\ngpu_memory = \"100GiB\"",
            "model[1].gpu_memory: model \"big\": needs 1 × 100.0 GiB but GPU 0 has 80.0 GiB",
        ),
        (
            "name = \"tp\"\ngpus = 2",
            "model[1].gpus: model \"tp\": needs 2 GPUs but the box has 1 (0)",
        ),
    ];
    for (bad, why) in cases {
        let dir = tempfile::tempdir().unwrap();
        let config = config_with(dir.path(), bad);
        let want = format!("{}: {why}", config.display());

        let check = siesta(&["config", "check", config.to_str().unwrap()]).await;
        assert_eq!(check.code, 1, "{check:#?}");
        assert_eq!(check.stderr.trim_end(), want, "{check:#?}");
        assert_eq!(check.stdout, "", "{check:#?}");

        let (code, stderr) = daemon(&config).await;
        assert!(code.is_some_and(|c| c != 0), "{code:?}: {stderr}");
        assert!(stderr.contains(&want), "the daemon says: {stderr}");
        assert!(!stderr.contains("serving"), "{stderr}");
    }
}

#[tokio::test]
async fn a_config_that_fits_is_ok_with_its_placement_counted() {
    if nvml_here() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = config_with(
        dir.path(),
        "name = \"small\"\ngpus = 1\ngpu_memory = \"20GiB\"",
    );
    let run = siesta(&["config", "check", config.to_str().unwrap()])
        .await
        .ok();
    assert_eq!(
        run.stdout.trim_end(),
        format!("{}: ok (2 model(s) placed on the GPUs)", config.display()),
        "{run:#?}"
    );
}
