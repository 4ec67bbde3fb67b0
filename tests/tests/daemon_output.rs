//! What the daemons write to their own stderr: no engine output (it stays in
//! the engine's log files and `siesta logs`), and no colour codes when
//! stderr is not a terminal.

use siesta_tests::cli;

use siesta_proto::v1 as pb;
use siesta_tests::ctl::{LONG, config, fake_model, start, wait_state};
use siesta_tests::{bin_path, spawn_proxy, wait_until};

/// The start of an ANSI escape sequence (colours, bold).
const ESC: &str = "\x1b[";

#[tokio::test]
async fn engine_output_stays_out_of_the_daemon_log_and_in_siesta_logs() {
    let ctl = start(&config(&fake_model("chat", "awake", &[], ""))).await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    // siesta's own /health probe (about once a second) shows in the
    // engine's access log, which `siesta logs` serves.
    wait_until(
        "the engine's /health access lines in siesta logs",
        LONG,
        || async {
            let run = cli::at(&ctl, &["logs", "chat"]).await.ok();
            run.stdout.matches("\"GET /health HTTP/1.1\" 200").count() >= 3
        },
    )
    .await;
    let logs = cli::at(&ctl, &["logs", "chat"]).await.ok();
    assert!(logs.stdout.contains("Uvicorn running on"), "{logs:#?}");
    // ... and never in the daemon's own log.
    let daemon = ctl.child.output().text();
    assert!(daemon.contains("siesta-control listening"), "{daemon}");
    for engine_line in ["GET /health", "GET /metrics", "Uvicorn running on"] {
        assert!(
            !daemon.contains(engine_line),
            "engine output {engine_line:?} in the daemon's log:\n{daemon}"
        );
    }
}

#[tokio::test]
async fn no_colour_codes_when_stderr_is_not_a_terminal() {
    // siesta-control and siesta-proxy log to a pipe here.
    let ctl = start(&config(&fake_model("chat", "awake", &[], ""))).await;
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await;
    wait_until("the proxy to watch the control plane", LONG, || async {
        proxy.child.output().contains("INFO")
    })
    .await;
    for (name, text) in [
        ("siesta-control", ctl.child.output().text()),
        ("siesta-proxy", proxy.child.output().text()),
    ] {
        assert!(text.contains("INFO"), "{name} logged nothing:\n{text}");
        assert!(!text.contains(ESC), "{name} wrote colour codes:\n{text}");
    }
    // The CLI's log (trace shows the connection attempts).
    let out = tokio::process::Command::new(bin_path("siesta"))
        .args(["--control", "http://127.0.0.1:1", "status"])
        .env("RUST_LOG", "trace")
        .env_remove("NO_COLOR")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("running siesta");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("TRACE"), "siesta logged nothing:\n{text}");
    assert!(!text.contains(ESC), "siesta wrote colour codes:\n{text}");
}
