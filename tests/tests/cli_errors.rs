//! `siesta` exit codes and error messages: control plane down (3), usage
//! errors (2), failed operations and every error the control plane answers
//! (1), `config check`, tokens, completion.

use siesta_tests::spawn_control_with;

use siesta_tests::cli::{at, closed_port, siesta, siesta_env, wait_state};

#[tokio::test]
async fn unreachable_control_plane_is_exit_3_with_one_clear_line() {
    let url = format!("http://127.0.0.1:{}", closed_port());
    let want =
        format!("cannot reach siesta-control at {url}: connection refused — is it running?\n");
    for args in [
        &["status"][..],
        &["wake", "chat", "--wait"],
        &["watch", "-o", "json"],
        &["logs", "chat", "-f"],
    ] {
        let mut all = vec!["--control", url.as_str()];
        all.extend_from_slice(args);
        let run = siesta(&all).await;
        assert_eq!(run.code, 3, "{args:?}: {run:#?}");
        assert_eq!(run.stderr, want, "{args:?}");
        assert_eq!(run.stdout, "", "{args:?}");
    }
    // The address also comes from SIESTA_CONTROL.
    let run = siesta_env(&["status"], &[("SIESTA_CONTROL", &url)]).await;
    assert_eq!((run.code, run.stderr.as_str()), (3, want.as_str()));
}

#[tokio::test]
async fn usage_errors_are_exit_2() {
    for args in [
        &["sleep", "chat", "--level", "3"][..],
        &["frobnicate"],
        &["pin", "chat", "--for", "soon"],
        &[],
    ] {
        let run = siesta(args).await;
        assert_eq!(run.code, 2, "{args:?}: {run:#?}");
    }
}

#[tokio::test]
async fn config_check_prints_each_problem_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        "[[model]]\nname = \"chat\"\nmodel = \"m\"\ngpus = 0\n",
    )
    .unwrap();
    let run = siesta(&["config", "check", good.to_str().unwrap()])
        .await
        .ok();
    assert!(run.stdout.contains("ok"), "{run:#?}");

    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[model]]\nname = \"chat\"\nmodel = \"m\"\ncolour = \"red\"\npreload = \"maybe\"\n",
    )
    .unwrap();
    let run = siesta(&["config", "check", bad.to_str().unwrap()]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    let lines: Vec<&str> = run.stderr.lines().collect();
    assert_eq!(lines.len(), 2, "one line per problem: {run:#?}");
    let file = bad.display().to_string();
    assert!(
        lines
            .iter()
            .all(|l| l.starts_with(&format!("{file}: model[0]."))),
        "{run:#?}"
    );
    assert!(run.stderr.contains("colour"), "{run:#?}");
    assert!(run.stderr.contains("preload"), "{run:#?}");
}

/// `config check` refuses what the daemon refuses to start with: an
/// address beyond loopback (`listen`, `web_listen`) and no token. It used
/// to say "ok" for such a file. A token in the file or in `SIESTA_TOKEN`
/// satisfies it, as for the daemon.
#[tokio::test]
async fn config_check_refuses_an_exposed_listener_without_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let model = "[[model]]\nname = \"chat\"\nmodel = \"m\"\ngpus = 0\n";
    for (key, control) in [
        ("control.listen", "listen = \"0.0.0.0:50051\"\n"),
        ("control.web_listen", "web_listen = \"0.0.0.0:8081\"\n"),
    ] {
        let path = dir.path().join("exposed.toml");
        std::fs::write(&path, format!("[control]\n{control}\n{model}")).unwrap();
        let file = path.to_str().unwrap();
        let run = siesta(&["config", "check", file]).await;
        assert_eq!(run.code, 1, "{key}: {run:#?}");
        assert!(
            run.stderr.starts_with(&format!("{file}: {key}: ")) && run.stderr.contains("token"),
            "{key}: {run:#?}"
        );
        assert_eq!(run.stderr.lines().count(), 1, "{key}: {run:#?}");
        // SIESTA_TOKEN in the environment satisfies it...
        let run = siesta_env(&["config", "check", file], &[("SIESTA_TOKEN", "t")]).await;
        assert_eq!(run.code, 0, "{key} with SIESTA_TOKEN: {run:#?}");
        // ...and so does the file's own token.
        std::fs::write(
            &path,
            format!("[control]\n{control}token = \"t\"\n\n{model}"),
        )
        .unwrap();
        siesta(&["config", "check", file]).await.ok();
    }
}

/// A process engine whose port siesta picks, on a `host` that is no address
/// of this machine (TEST-NET-1 here): `config check` refuses it naming the
/// file, the key and the model, as the daemon does at start. It said "ok",
/// and the daemon then failed with no file or key.
#[tokio::test]
async fn config_check_refuses_a_host_that_is_no_address_of_this_machine() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("far.toml");
    let far = "[[model]]\nname = \"far\"\nmodel = \"m\"\ngpus = 0\nhost = \"192.0.2.1\"\n";
    std::fs::write(&path, far).unwrap();
    let file = path.to_str().unwrap();
    let run = siesta(&["config", "check", file]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert!(
        run.stderr
            .starts_with(&format!("{file}: model[0].host: model \"far\": ")),
        "{run:#?}"
    );
    assert!(run.stderr.contains("192.0.2.1"), "{run:#?}");
    // With its own fixed port the engine binds what it is told: nothing to pick.
    std::fs::write(&path, format!("{far}port = 8000\n")).unwrap();
    siesta(&["config", "check", file]).await.ok();
}

#[tokio::test]
async fn completion_scripts_are_generated() {
    for shell in ["bash", "zsh", "fish"] {
        let run = siesta(&["completion", shell]).await.ok();
        assert!(run.stdout.contains("siesta"), "{shell}: {run:#?}");
        assert!(run.stdout.contains("placement"), "{shell}: {run:#?}");
    }
}

/// A control plane with one fake model, `name`, whose engine fails to start
/// (`extra`: the model's `args` or `env` that make it fail); a failure is
/// retried only after 30 s, so the test sees it stay failed.
fn failing_model(name: &str, extra: &str) -> String {
    format!(
        r#"
[control]
state_dir = "@DIR@/state"

[defaults]
start_timeout = "20s"
backoff_initial = "30s"

[[model]]
name = "{name}"
model = "m"
executable = "@FAKE_VLLM@"
gpus = 0
{extra}
"#
    )
}

/// `siesta wake --wait` to a control plane that stops answering with the
/// connection still open (its host frozen: here SIGSTOP) ends as
/// unreachable within seconds, not at the end of a 10-minute wake.
#[tokio::test]
async fn wake_wait_ends_when_the_control_plane_goes_silent() {
    use nix::sys::signal::Signal;
    use siesta_proto::v1::ModelState;
    let config = failing_model(
        "slow",
        "preload = \"asleep\"\nargs = [\"--wake-time\", \"600s\"]",
    );
    let mut control = spawn_control_with(&config, &["--stop-engines-on-exit"]).await;
    wait_state(&control, "slow", ModelState::Asleep, None).await;
    let url = control.url();
    let wake =
        tokio::spawn(async move { siesta(&["--control", &url, "wake", "slow", "--wait"]).await });
    wait_state(&control, "slow", ModelState::Waking, None).await;
    control.child.signal(Signal::SIGSTOP);
    let run = wake.await.unwrap();
    control.child.signal(Signal::SIGCONT);
    assert_eq!(run.code, 3, "{run:#?}");
    assert!(
        run.stderr.contains("cannot reach siesta-control"),
        "{run:#?}"
    );
    control.terminate().await;
}

/// `name` on fake-vllm's simulated 10 GiB GPU whose holders are files in
/// `gpu` (`gpu-0/PID` = bytes), so a test can take its memory.
fn on_simulated_gpu(name: &str, gpu: &std::path::Path) -> String {
    failing_model(
        name,
        &format!(
            r#"env = {{ FAKE_VLLM_GPU_TOTAL_BYTES = "10737418240", FAKE_VLLM_GPU_DIR = "{}" }}"#,
            gpu.display()
        ),
    )
}

#[tokio::test]
async fn wake_wait_of_a_failing_model_exits_1_with_the_error() {
    let config = failing_model("broken", r#"args = ["--exit-during-startup"]"#);
    let mut control = spawn_control_with(&config, &["--stop-engines-on-exit"]).await;
    let run = at(&control, &["wake", "broken", "--wait"]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert!(run.stderr.contains("broken: not awake after"), "{run:#?}");
    let json = at(&control, &["status", "-o", "json"]).await.ok().json();
    assert_eq!(json["models"][0]["state"], "failed", "{json}");
    assert_ne!(json["models"][0]["last_error"], "", "{json}");
    let run = at(&control, &["status"]).await.ok();
    assert!(
        run.stdout.contains("failed") && run.stdout.contains("retry"),
        "{run:#?}"
    );
    control.terminate().await;
}

/// An engine that cannot start because another process holds its GPU's
/// memory (fake-vllm's simulated GPU: 8 of 10 GiB held by a process siesta
/// does not run, this test): the start fails, and `last_error` says why in
/// the engine's own words (vLLM's `ValueError: Free memory on device ...`),
/// not only its exit status.
#[tokio::test]
async fn a_start_refused_for_memory_another_process_holds_says_why() {
    let gpu = tempfile::tempdir().unwrap();
    let held = gpu.path().join("gpu-0");
    std::fs::create_dir_all(&held).unwrap();
    std::fs::write(
        held.join(std::process::id().to_string()),
        (8u64 << 30).to_string(),
    )
    .unwrap();
    let config = on_simulated_gpu("crowded", gpu.path());
    let mut control = spawn_control_with(&config, &["--stop-engines-on-exit"]).await;
    let run = at(&control, &["wake", "crowded", "--wait"]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    // The operator who asked reads why at once.
    assert!(
        run.stderr
            .contains("ValueError: Free memory on device cuda:0"),
        "{run:#?}"
    );
    let json = at(&control, &["get", "crowded", "-o", "json"])
        .await
        .ok()
        .json();
    assert_eq!(json["model"]["state"], "failed", "{json}");
    let error = json["model"]["last_error"].as_str().unwrap();
    assert!(
        error.starts_with("engine exited unexpectedly (exit status: 1): ValueError: Free memory on device cuda:0 (2.00/10.00 GiB)"),
        "{error}"
    );
    assert!(
        error.contains("reduce GPU memory used by other processes"),
        "{error}"
    );
    // `siesta get` shows it whole.
    let run = at(&control, &["get", "crowded"]).await.ok();
    assert!(run.stdout.contains(error), "{run:#?}");
    control.terminate().await;
}

/// Asleep, a model's GPU memory is taken by another process; its wake then
/// runs out of memory (fake-vllm's simulated GPU answers `/wake_up` 500 with
/// vLLM 0.24's words for it), and the failed `siesta wake --wait` and
/// `last_error` say so in the engine's words, not as a cut JSON body.
#[tokio::test]
async fn a_wake_that_runs_out_of_memory_says_why() {
    let gpu = tempfile::tempdir().unwrap();
    let config = on_simulated_gpu("m", gpu.path());
    let mut control = spawn_control_with(&config, &["--stop-engines-on-exit"]).await;
    at(&control, &["wake", "m", "--wait"]).await.ok();
    at(&control, &["sleep", "m", "--level", "1", "--wait"])
        .await
        .ok();
    // Another process takes 8 of the GPU's 10 GiB while it sleeps.
    let held = gpu.path().join("gpu-0");
    std::fs::create_dir_all(&held).unwrap();
    std::fs::write(
        held.join(std::process::id().to_string()),
        (8u64 << 30).to_string(),
    )
    .unwrap();
    let run = at(&control, &["wake", "m", "--wait"]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    let want = "POST /wake_up: HTTP 500 Internal Server Error: Call to wake_up method failed: \
                CUDA Error: out of memory";
    assert!(run.stderr.contains(want), "{run:#?}");
    let json = at(&control, &["get", "m", "-o", "json"]).await.ok().json();
    let error = json["model"]["last_error"].as_str().unwrap();
    assert!(error.contains(want) && !error.contains("{\""), "{error}");
    control.terminate().await;
}

#[tokio::test]
async fn the_token_is_sent_as_a_bearer() {
    let config = r#"
[control]
state_dir = "@DIR@/state"
token = "s3cret-token"

[[model]]
name = "chat"
model = "m"
executable = "@FAKE_VLLM@"
gpus = 0
"#;
    let mut control = spawn_control_with(config, &["--stop-engines-on-exit"]).await;
    let url = control.url();
    let run = siesta(&["--control", &url, "status"]).await;
    assert_eq!(run.code, 1, "no token: {run:#?}");
    assert!(run.stderr.contains("SIESTA_TOKEN"), "{run:#?}");
    let run = siesta(&["--control", &url, "--token", "wrong", "status"]).await;
    assert_eq!(run.code, 1, "wrong token: {run:#?}");
    siesta(&["--control", &url, "--token", "s3cret-token", "status"])
        .await
        .ok();
    siesta_env(
        &["--control", &url, "status"],
        &[("SIESTA_TOKEN", "s3cret-token")],
    )
    .await
    .ok();
    control.terminate().await;
}

/// One model, never started (no engine needed).
const ONE_MODEL: &str = r#"
[control]
state_dir = "@DIR@/state"

[[model]]
name = "chat"
model = "m"
executable = "@FAKE_VLLM@"
gpus = 0
"#;

#[tokio::test]
async fn errors_the_daemon_answers_are_exit_1_and_only_no_daemon_is_3() {
    let mut control = spawn_control_with(ONE_MODEL, &["--stop-engines-on-exit"]).await;
    let file = control.config_path.display().to_string();
    let good = std::fs::read_to_string(&control.config_path).unwrap();

    let run = at(&control, &["get", "nope"]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert!(
        run.stderr.starts_with("error: model \"nope\" not found"),
        "{run:#?}"
    );

    // A key the file must not have: refused, naming the file and the key.
    std::fs::write(&control.config_path, format!("{good}colour = \"red\"\n")).unwrap();
    let run = at(&control, &["reload"]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert!(
        run.stderr
            .starts_with(&format!("error: {file}: model[0].colour: unknown key")),
        "{run:#?}"
    );

    // A valid file the daemon cannot apply (a host not of this machine):
    // an error it answered, not "cannot reach", naming file, key and model,
    // before anything was stopped.
    std::fs::write(
        &control.config_path,
        format!(
            "{good}\n[[model]]\nname = \"far\"\nmodel = \"m\"\nexecutable = \"/bin/true\"\ngpus = 0\nhost = \"192.0.2.1\"\n"
        ),
    )
    .unwrap();
    let run = at(&control, &["reload"]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert!(
        run.stderr
            .starts_with(&format!("error: {file}: model[1].host: model \"far\"")),
        "{run:#?}"
    );
    assert!(run.stderr.contains("192.0.2.1"), "{run:#?}");
    assert!(run.stderr.contains("nothing was reloaded"), "{run:#?}");
    assert!(!run.stderr.contains("cannot reach"), "{run:#?}");

    // The same control plane, stopped: now it cannot be reached.
    control.terminate().await;
    let run = at(&control, &["status"]).await;
    assert_eq!(run.code, 3, "{run:#?}");
    assert!(
        run.stderr.starts_with(&format!(
            "cannot reach siesta-control at {}: connection refused",
            control.url()
        )),
        "{run:#?}"
    );
}
