//! What the daemons write to their own stderr: no engine output (it stays in
//! the engine's log files and `siesta logs`), and no colour codes when
//! stderr is not a terminal; and what siesta-control tells systemd.

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

/// Under systemd (`Type=notify`, `WatchdogSec=`): siesta-control says
/// `READY=1` once it serves and `WATCHDOG=1` while its Watch event path
/// makes rounds, on the socket in `NOTIFY_SOCKET`; its engines do not
/// inherit that socket or the watchdog's variables (one that spoke
/// sd_notify would answer for the daemon).
#[tokio::test]
async fn control_tells_systemd_it_is_ready_and_alive_and_its_engines_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("notify.sock");
    let notify = tokio::net::UnixDatagram::bind(&socket).unwrap();
    let tag = format!("notify-{}", std::process::id());
    let config = dir.path().join("siesta.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[control]
state_dir = "{state}"
[[model]]
name = "chat"
model = "fake/chat"
executable = "{fake}"
gpus = 0
preload = "awake"
env = {{ SIESTA_TEST_TAG = "{tag}" }}
"#,
            state = dir.path().join("state").display(),
            fake = siesta_tests::fake_vllm_command(),
        ),
    )
    .unwrap();
    let mut daemon = tokio::process::Command::new(bin_path("siesta-control"))
        .arg("--config")
        .arg(&config)
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--stop-engines-on-exit")
        .env("NOTIFY_SOCKET", &socket)
        .env("WATCHDOG_USEC", "20000000")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut said = Vec::new();
    let mut buf = [0u8; 256];
    while !said.iter().any(|m: &String| m.contains("WATCHDOG=1")) {
        let n = tokio::time::timeout(LONG, notify.recv(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("no READY=1 then WATCHDOG=1 from siesta-control: {said:?}"))
            .unwrap();
        said.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    assert_eq!(
        said.first().map(String::as_str),
        Some("READY=1\n"),
        "{said:?}"
    );
    let engines = siesta_tests::pids_with_env("SIESTA_TEST_TAG", &tag);
    assert!(!engines.is_empty(), "the engine runs");
    for pid in engines {
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        for key in ["NOTIFY_SOCKET=", "WATCHDOG_USEC=", "WATCHDOG_PID="] {
            assert!(
                !env.split(|b| *b == 0)
                    .any(|kv| kv.starts_with(key.as_bytes())),
                "engine {pid} inherited {key}"
            );
        }
    }
    let pid = daemon.id().unwrap() as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    tokio::time::timeout(LONG, daemon.wait())
        .await
        .expect("exits")
        .unwrap();
}
