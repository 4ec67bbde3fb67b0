//! The `siesta` CLI against a real siesta-control with fake-vllm engines:
//! every command, text and `-o json`.

use serde_json::Value;
use siesta_proto::v1 as pb;
use siesta_tests::{Child, DEADLINE, bin_path, spawn_control_with, wait_addr_file, wait_until};
use tokio::io::{AsyncBufReadExt, BufReader};

use siesta_tests::cli::{CONFIG, at, model_state, next_line, siesta, spawn_siesta, wait_state};

#[tokio::test]
async fn every_command_against_a_real_control_plane() {
    let mut control = spawn_control_with(CONFIG, &["--stop-engines-on-exit"]).await;
    wait_state(&control, "chat", pb::ModelState::Asleep, Some(1)).await;

    // status: table and JSON.
    let run = at(&control, &["status"]).await.ok();
    let header = run.stdout.lines().next().unwrap_or("");
    for col in [
        "MODEL",
        "STATE",
        "GPUS",
        "ENDPOINT",
        "IDLE",
        "IN FLIGHT",
        "NEXT TIER",
        "LAST ERROR",
    ] {
        assert!(header.contains(col), "{col} missing: {run:#?}");
    }
    let chat_line = run
        .stdout
        .lines()
        .find(|l| l.starts_with("chat "))
        .expect("chat row");
    assert!(chat_line.contains("asleep(l1)"), "{run:#?}");
    let json = at(&control, &["status", "-o", "json"]).await.ok().json();
    let names: Vec<&str> = json["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["chat", "embed"]);
    assert_eq!(json["models"][0]["state"], "asleep");
    assert_eq!(json["models"][0]["sleep_level"], 1);
    assert!(json["revision"].as_u64().unwrap() > 0);

    // get: by alias, text and JSON, with calibration and placement.
    let run = at(&control, &["get", "gpt-4o-mini"]).await.ok();
    for key in ["Name:", "State:", "Calibration:", "start:", "Placement:"] {
        assert!(run.stdout.contains(key), "{key}: {run:#?}");
    }
    let json = at(&control, &["get", "chat", "-o", "json"])
        .await
        .ok()
        .json();
    assert_eq!(json["model"]["name"], "chat");
    assert_eq!(json["model"]["aliases"][0], "gpt-4o-mini");
    assert!(
        json["model"]["calibration"]["start_ms"].as_u64().unwrap() > 0,
        "start measured: {json}"
    );
    assert!(json["placement"].is_object(), "{json}");

    // An unknown model: exit 1 with the server's message.
    let run = at(&control, &["get", "no-such-model"]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert!(
        run.stderr.starts_with("error: ") && run.stderr.contains("no-such-model"),
        "{run:#?}"
    );

    // wake --wait: ends awake, says how long against the estimate.
    let run = at(&control, &["wake", "chat", "--wait"]).await.ok();
    assert!(run.stdout.starts_with("chat: awake after "), "{run:#?}");
    assert_eq!(model_state(&control, "chat").await.0, pb::ModelState::Awake);

    // sleep --level 2, then a JSON wake --wait.
    let json = at(&control, &["sleep", "chat", "--level", "2", "-o", "json"])
        .await
        .ok()
        .json();
    assert_eq!(json["model"]["name"], "chat");
    wait_state(&control, "chat", pb::ModelState::Asleep, Some(2)).await;
    let json = at(&control, &["wake", "chat", "--wait", "-o", "json"])
        .await
        .ok()
        .json();
    assert_eq!(json["model"]["state"], "awake", "{json}");

    // pin --for / unpin.
    at(&control, &["pin", "chat", "--for", "1h"]).await.ok();
    let json = at(&control, &["get", "chat", "-o", "json"])
        .await
        .ok()
        .json();
    let pinned = json["model"]["pinned_until_unix_ms"].as_i64().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    assert!(
        (now + 3_500_000..=now + 3_700_000).contains(&pinned),
        "pinned until {pinned}, now {now}"
    );
    at(&control, &["unpin", "chat"]).await.ok();
    let json = at(&control, &["get", "chat", "-o", "json"])
        .await
        .ok()
        .json();
    assert_eq!(json["model"]["pinned_until_unix_ms"], 0);

    // logs: the engine's own output, and siesta's lines for the model
    // (when it began to serve).
    let run = at(&control, &["logs", "chat"]).await.ok();
    assert!(run.stdout.contains("Uvicorn running on"), "{run:#?}");
    assert!(
        run.stdout
            .lines()
            .any(|l| l.contains("ready after") && l.ends_with(" s: serving")),
        "{run:#?}"
    );
    let run = at(&control, &["logs", "chat", "--tail", "1", "-o", "json"])
        .await
        .ok();
    let lines: Vec<Value> = run
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{run:#?}");
    assert!(lines[0]["seq"].is_u64() && lines[0]["line"].is_string());
    // --tail 0: no line (it printed every line kept: 0 read as "all").
    let run = at(&control, &["logs", "chat", "--tail", "0"]).await.ok();
    assert_eq!(run.stdout, "", "{run:#?}");

    // watch -o json: a snapshot first, then the events of a stop and a start.
    let mut watch = spawn_siesta(&control, &["watch", "-o", "json"]);
    let mut events = BufReader::new(watch.stdout.take().unwrap()).lines();
    let first: Value = serde_json::from_str(&next_line(&mut events).await).unwrap();
    assert_eq!(first["type"], "snapshot");
    assert_eq!(first["models"].as_array().unwrap().len(), 2);

    // stop / start / restart.
    let run = at(&control, &["stop", "embed"]).await.ok();
    assert!(run.stdout.starts_with("embed: "), "{run:#?}");
    wait_state(&control, "embed", pb::ModelState::Stopped, None).await;
    at(&control, &["start", "embed"]).await.ok();
    wait_state(&control, "embed", pb::ModelState::Awake, None).await;
    let mut last_rev = first["revision"].as_u64().unwrap();
    let mut saw_awake = false;
    while !saw_awake {
        let ev: Value = serde_json::from_str(&next_line(&mut events).await).unwrap();
        let rev = ev["revision"].as_u64().unwrap();
        assert!(rev > last_rev, "revisions increase: {rev} after {last_rev}");
        last_rev = rev;
        saw_awake = ev["type"] == "model"
            && ev["model"]["name"] == "embed"
            && ev["model"]["state"] == "awake";
    }
    drop(watch);
    let json = at(&control, &["restart", "embed", "-o", "json"])
        .await
        .ok()
        .json();
    assert_eq!(json["model"]["name"], "embed");
    wait_until("embed restarted", DEADLINE, || async {
        let mut c = control.client().await;
        let m = c
            .get_model(pb::GetModelRequest {
                name: "embed".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .model
            .unwrap();
        m.state() == pb::ModelState::Awake && m.restarts >= 2
    })
    .await;

    // watch, human-readable: a snapshot line, then one line per model.
    let mut watch = spawn_siesta(&control, &["watch"]);
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    assert!(next_line(&mut lines).await.contains("snapshot"));
    let chat = next_line(&mut lines).await;
    assert!(chat.contains("chat: awake"), "{chat}");
    drop(watch);

    // gpus, placement, diag p2p: no GPUs here, still answered.
    let run = at(&control, &["gpus"]).await.ok();
    assert!(run.stdout.starts_with("inventory: "), "{run:#?}");
    let json = at(&control, &["gpus", "-o", "json"]).await.ok().json();
    assert!(
        json["gpus"].is_array() && json["source"].is_string(),
        "{json}"
    );
    let run = at(&control, &["placement"]).await.ok();
    assert!(
        run.stdout.contains("chat") && run.stdout.contains("embed"),
        "{run:#?}"
    );
    let json = at(&control, &["placement", "-o", "json"]).await.ok().json();
    assert_eq!(json["models"].as_array().unwrap().len(), 2, "{json}");
    let run = at(&control, &["diag", "p2p", "-o", "json"]).await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert!(run.json()["results"].is_array());
    // A probe deadline past an hour is a usage error, naming the flag
    // (the daemon refuses it as well, for other clients).
    let run = at(&control, &["diag", "p2p", "--timeout", "2h"]).await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(
        run.stderr
            .contains("'--timeout <TIMEOUT>': must be at most 1h"),
        "{run:#?}"
    );

    // reload: the same file, nothing changes.
    let json = at(&control, &["reload", "-o", "json"]).await.ok().json();
    assert_eq!(json["unchanged"].as_array().unwrap().len(), 2, "{json}");

    // Operations on an unknown model fail with exit 1.
    let run = at(&control, &["sleep", "nope"]).await;
    assert_eq!(run.code, 1, "{run:#?}");

    control.terminate().await;
}

#[tokio::test]
async fn logs_follow_streams_new_lines() {
    let mut control = spawn_control_with(CONFIG, &["--stop-engines-on-exit"]).await;
    wait_state(&control, "chat", pb::ModelState::Asleep, Some(1)).await;
    let mut follow = spawn_siesta(&control, &["logs", "chat", "-f"]);
    let mut lines = BufReader::new(follow.stdout.take().unwrap()).lines();
    // A wake makes the engine (and siesta) log new lines.
    at(&control, &["wake", "chat"]).await.ok();
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !seen.iter().any(|l: &String| l.contains("wake")) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no wake line in {seen:#?}"
        );
        seen.push(next_line(&mut lines).await);
    }
    assert!(
        follow.try_wait().unwrap().is_none(),
        "logs -f keeps running"
    );
    // The control plane stops: the follow ends with exit 1 and the reason
    // (`the control plane is shutting down`), not exit 0 as if it were done.
    control.terminate().await;
    let ended = tokio::time::timeout(DEADLINE, follow.wait())
        .await
        .expect("logs -f ends when the control plane stops")
        .unwrap();
    assert_eq!(ended.code(), Some(1), "{ended}");
}

/// `diag p2p` on two GPUs where the probe cannot run is a failed operation:
/// exit 1, the reason on stderr. It used to print "P2P not probed: …" on
/// stdout and exit 0, as if there were nothing to probe.
///
/// The control plane looks for `siesta-p2p-probe` next to its own binary,
/// so it runs here from a copy in a directory of its own: no probe there.
#[tokio::test]
async fn diag_p2p_that_cannot_probe_two_gpus_is_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let control_bin = dir.path().join("siesta-control");
    std::fs::copy(bin_path("siesta-control"), &control_bin).unwrap();
    assert!(!dir.path().join("siesta-p2p-probe").exists());
    let config = dir.path().join("siesta.toml");
    std::fs::write(
        &config,
        format!(
            "[control]\nstate_dir = {:?}\np2p_probe = \"off\"\n\n\
             [[gpu]]\nindex = 0\nname = \"test-gpu\"\nmemory = \"80GiB\"\n\
             [[gpu]]\nindex = 1\nname = \"test-gpu\"\nmemory = \"80GiB\"\n",
            dir.path().join("state"),
        ),
    )
    .unwrap();
    let addr_file = dir.path().join("control.addr");
    let mut cmd = std::process::Command::new(&control_bin);
    cmd.arg("--config")
        .arg(&config)
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--addr-file")
        .arg(&addr_file);
    let mut control = Child::spawn("siesta-control", cmd);
    let grpc = wait_addr_file(&mut control, &addr_file, &["grpc"], DEADLINE).await[0];
    let url = format!("http://{grpc}");

    let gpus = siesta(&["--control", &url, "gpus", "-o", "json"])
        .await
        .ok()
        .json();
    if gpus["source"] != "config" {
        eprintln!(
            "skipped: GPUs come from {} here, not the config",
            gpus["source"]
        );
        return;
    }
    assert_eq!(gpus["gpus"].as_array().unwrap().len(), 2, "{gpus}");
    for args in [&["diag", "p2p"][..], &["diag", "p2p", "-o", "json"]] {
        let mut all = vec!["--control", url.as_str()];
        all.extend_from_slice(args);
        let run = siesta(&all).await;
        assert_eq!(run.code, 1, "{args:?}: {run:#?}");
        assert!(
            run.stderr.starts_with("error: ")
                && run.stderr.contains("P2P not probed")
                && run.stderr.contains("siesta-p2p-probe not found"),
            "{args:?}: {run:#?}"
        );
        assert_eq!(run.stdout, "", "{args:?}: {run:#?}");
    }
}

/// Output into a pipe whose reader has gone (`siesta status | head -1`)
/// ends the command quietly, exit 0, streams (`watch`) included. It used
/// to panic ("failed printing to stdout: Broken pipe", exit 101; clap's
/// "failed to write completion file" for `completion`), or with `-o json`
/// fail with "error: Broken pipe (os error 32)" (exit 1).
#[tokio::test]
async fn a_closed_stdout_ends_a_command_quietly() {
    let mut control = spawn_control_with(CONFIG, &["--stop-engines-on-exit"]).await;
    wait_state(&control, "chat", pb::ModelState::Asleep, Some(1)).await;
    let url = control.url();
    for args in [
        &["status"][..],
        &["status", "-o", "json"],
        &["logs", "chat"],
        &["logs", "chat", "-o", "json"],
        &["watch"],
        &["completion", "bash"],
    ] {
        let mut cmd = tokio::process::Command::new(bin_path("siesta"));
        cmd.arg("--control")
            .arg(&url)
            .args(args)
            .env_remove("SIESTA_TOKEN")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("spawning siesta");
        // The reader goes away before anything is written.
        drop(child.stdout.take());
        let out = tokio::time::timeout(DEADLINE, child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("siesta {args:?} with its stdout closed did not end"))
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert_eq!(stderr, "", "{args:?}");
    }
    control.terminate().await;
}
