//! deploy/ passes `scripts/validate-deploy`: the Kubernetes manifests against
//! the Kubernetes JSON schemas (strict) and the systemd units through
//! `systemd-analyze`. The validators come from package registries
//! (`pip install kubernetes-validate==1.37.0`, Debian `systemd`); where they
//! are missing the tests say so and pass, except under CI (`CI` set), where
//! a missing validator fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs the script on `deploy_dir`; `None` when a validator is not installed.
fn validate(deploy_dir: &Path) -> Option<Output> {
    let out = Command::new("bash")
        .arg(repo().join("scripts/validate-deploy"))
        .env("DEPLOY_DIR", deploy_dir)
        .output()
        .expect("running scripts/validate-deploy");
    if out.status.code() == Some(127) {
        let why = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            std::env::var_os("CI").is_none(),
            "validators missing under CI: {why}"
        );
        eprintln!("SKIPPED: {why}");
        return None;
    }
    Some(out)
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A copy of deploy/ with `edit` applied to one file.
fn broken_copy(file: &str, from: &str, to: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for sub in ["kubernetes", "kubernetes/examples", "systemd"] {
        std::fs::create_dir_all(dir.path().join(sub)).unwrap();
        for entry in std::fs::read_dir(repo().join("deploy").join(sub)).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                continue;
            }
            let rel = format!("{sub}/{}", path.file_name().unwrap().to_string_lossy());
            let mut body = std::fs::read_to_string(&path).unwrap();
            if rel == file {
                assert!(body.contains(from), "{rel} has no {from:?}");
                body = body.replacen(from, to, 1);
            }
            std::fs::write(dir.path().join(&rel), body).unwrap();
        }
    }
    dir
}

#[test]
fn deploy_folder_validates() {
    let Some(out) = validate(&repo().join("deploy")) else {
        return;
    };
    assert!(
        out.status.success(),
        "validate-deploy failed:\n{}",
        text(&out)
    );
    assert!(text(&out).contains("8 manifests"), "{}", text(&out));
}

#[test]
fn a_misspelt_manifest_field_is_rejected() {
    let dir = broken_copy(
        "kubernetes/proxy-deployment.yaml",
        "containerPort: 8080",
        "containerPrt: 8080",
    );
    let Some(out) = validate(dir.path()) else {
        return;
    };
    assert!(
        !out.status.success(),
        "a broken manifest passed:\n{}",
        text(&out)
    );
    assert!(
        text(&out).contains("proxy-deployment.yaml"),
        "{}",
        text(&out)
    );
}

#[test]
fn a_wrongly_typed_manifest_field_is_rejected() {
    let dir = broken_copy(
        "kubernetes/control-daemonset.yaml",
        "failureThreshold: 60",
        "failureThreshold: sixty",
    );
    let Some(out) = validate(dir.path()) else {
        return;
    };
    assert!(
        !out.status.success(),
        "a broken manifest passed:\n{}",
        text(&out)
    );
    assert!(
        text(&out).contains("control-daemonset.yaml"),
        "{}",
        text(&out)
    );
}

#[test]
fn a_bad_systemd_directive_is_rejected() {
    let dir = broken_copy(
        "systemd/siesta-control.service",
        "\nKillMode=process\n",
        "\nKillMode=proces\n",
    );
    let Some(out) = validate(dir.path()) else {
        return;
    };
    assert!(
        !out.status.success(),
        "a broken unit passed:\n{}",
        text(&out)
    );
    assert!(
        text(&out).contains("siesta-control.service"),
        "{}",
        text(&out)
    );
}

#[test]
fn control_unit_leaves_engines_to_be_adopted() {
    let unit =
        std::fs::read_to_string(repo().join("deploy/systemd/siesta-control.service")).unwrap();
    let directive = |k: &str| {
        unit.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .map(str::trim)
    };
    assert_eq!(directive("KillMode"), Some("process"));
    assert_eq!(directive("KillSignal"), Some("SIGTERM"));
    assert!(
        !directive("ExecStart")
            .unwrap()
            .contains("--stop-engines-on-exit")
    );
}

/// siesta-control is not PID 1 of its pod: the pause process is, and reaps
/// the engine workers handed to PID 1 when their leader is SIGKILLed
/// (siesta-control waits only for what it spawned; as PID 1 they would
/// pile up as zombies).
#[test]
fn control_pods_have_an_init_to_reap_orphans() {
    let manifest =
        std::fs::read_to_string(repo().join("deploy/kubernetes/control-daemonset.yaml")).unwrap();
    assert!(
        manifest
            .lines()
            .any(|l| l.trim() == "shareProcessNamespace: true"),
        "control-daemonset.yaml: no shareProcessNamespace: true"
    );
}
