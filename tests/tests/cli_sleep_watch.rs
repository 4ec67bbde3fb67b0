//! `siesta sleep` says "in flight" only while requests are, and `--wait`
//! reports the outcome; `siesta watch` survives a control-plane restart.

use siesta_tests::cli;

use std::process::Stdio;
use std::time::Duration;

use siesta_proto::v1 as pb;
use siesta_tests::ctl::{
    LONG, config, endpoint, fake_model, start, wait_state, wait_status, wake_awake,
};
use siesta_tests::{DEADLINE, bin_path, wait_for};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// A completion straight to the engine producing exactly `tokens` tokens
/// (at 10 per second with `--tokens-per-second 10`); its finish reason.
async fn completion(base_url: String, tokens: u32) -> String {
    let body = serde_json::json!({
        "model": "chat",
        "prompt": "hello",
        "max_tokens": tokens,
        "ignore_eos": true,
    });
    let resp = reqwest::Client::new()
        .post(format!("{base_url}/v1/completions"))
        .json(&body)
        .timeout(LONG)
        .send()
        .await
        .expect("completion request");
    assert!(resp.status().is_success(), "HTTP {}", resp.status());
    let v: serde_json::Value = resp.json().await.expect("completion JSON");
    v["choices"][0]["finish_reason"]
        .as_str()
        .expect("finish_reason")
        .to_owned()
}

#[tokio::test]
async fn sleep_says_in_flight_only_while_requests_are_and_wait_reports_the_outcome() {
    let ctl = start(&config(&fake_model(
        "chat",
        "awake",
        &["--tokens-per-second", "10"],
        "",
    )))
    .await;
    let mut c = ctl.client().await;
    let url = endpoint(&wait_state(&mut c, "chat", pb::ModelState::Awake, LONG).await);

    // A 2 s request the control plane counts in flight, then finishes.
    let req = tokio::spawn(completion(url.clone(), 20));
    wait_status(&mut c, "chat", "a request in flight", LONG, |s| {
        s.in_flight > 0
    })
    .await;
    assert_eq!(req.await.unwrap(), "length");
    // At once: the count control last read may still hold it, but nothing
    // is in flight, and the answer must not say otherwise.
    let run = cli::at(&ctl, &["sleep", "chat"]).await.ok();
    assert!(!run.stdout.contains("in flight"), "{run:#?}");
    wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG).await;

    // A request really in flight: said so; --wait reports the sleep once
    // the request has finished (not aborted).
    wake_awake(&mut c, "chat").await;
    let req = tokio::spawn(completion(url.clone(), 40));
    wait_status(&mut c, "chat", "a request in flight", LONG, |s| {
        s.in_flight > 0
    })
    .await;
    let run = cli::at(&ctl, &["sleep", "chat"]).await.ok();
    assert!(
        run.stdout
            .contains("will sleep once 1 request(s) in flight finish"),
        "{run:#?}"
    );
    let run = cli::at(&ctl, &["sleep", "chat", "--wait"]).await.ok();
    assert!(
        run.stdout.starts_with("chat: asleep at level 1 after "),
        "{run:#?}"
    );
    assert!(req.is_finished(), "asleep before the request finished");
    assert_eq!(req.await.unwrap(), "length");

    // --wait that runs out: exit 1, says what it is waiting for.
    let url = endpoint(&wake_awake(&mut c, "chat").await);
    let req = tokio::spawn(completion(url, 50));
    wait_status(&mut c, "chat", "a request in flight", LONG, |s| {
        s.in_flight > 0
    })
    .await;
    let run = cli::at(&ctl, &["sleep", "chat", "--wait", "--timeout", "1s"]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert!(
        run.stderr
            .starts_with("error: chat: not asleep: still awake after ")
            && run.stderr.contains("in flight"),
        "{run:#?}"
    );
    assert_eq!(req.await.unwrap(), "length");
}

/// Collects a child's lines from `src` into a shared list.
fn collect(
    src: impl AsyncRead + Unpin + Send + 'static,
) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = lines.clone();
    tokio::spawn(async move {
        let mut r = BufReader::new(src).lines();
        while let Ok(Some(l)) = r.next_line().await {
            eprintln!("[siesta watch] {l}");
            sink.lock().unwrap().push(l);
        }
    });
    lines
}

#[tokio::test]
async fn watch_resumes_across_a_control_plane_restart() {
    let mut ctl = start(&config(&fake_model("chat", "asleep", &[], ""))).await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG).await;
    let mut watch = tokio::process::Command::new(bin_path("siesta"))
        .args(["--control", &ctl.url(), "watch"])
        .env_remove("SIESTA_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawning siesta watch");
    let out = collect(watch.stdout.take().unwrap());
    let err = collect(watch.stderr.take().unwrap());
    let seen = |lines: &std::sync::Arc<std::sync::Mutex<Vec<String>>>, needle: &str| {
        lines.lock().unwrap().iter().any(|l| l.contains(needle))
    };
    wait_for("the first snapshot", DEADLINE, || {
        seen(&out, "chat: asleep(l1)").then_some(())
    })
    .await;

    // kill -9, and a new control plane on the same state dir and address.
    ctl.restart().await;
    wait_for("reconnecting… on stderr", DEADLINE, || {
        seen(&err, "reconnecting…").then_some(())
    })
    .await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "chat", pb::ModelState::Asleep, LONG).await;
    // The new run's revisions start over: it says so and resyncs.
    wait_for("the resync snapshot", LONG, || {
        seen(&out, "snapshot (resync)").then_some(())
    })
    .await;
    assert!(seen(&err, "resyncing"), "{:?}", err.lock().unwrap());
    let before = out.lock().unwrap().len();

    // A change made through the new control plane reaches the same watch.
    wake_awake(&mut c, "chat").await;
    wait_for("the wake printed by the same watch", LONG, || {
        out.lock().unwrap()[before..]
            .iter()
            .any(|l| l.contains("chat: ") && l.contains("→ awake"))
            .then_some(())
    })
    .await;
    assert!(watch.try_wait().unwrap().is_none(), "siesta watch exited");
    let _ = tokio::time::timeout(Duration::from_secs(5), watch.kill()).await;
}
