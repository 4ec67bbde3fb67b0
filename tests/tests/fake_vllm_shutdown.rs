//! fake-vllm's SIGTERM, as vLLM 0.24's on the GPU machine (`scripts/vllm-check sigterm`,
//! `--shutdown-timeout`): the listener closes at once; a request that still reaches the
//! server is answered 500 "cannot schedule new futures after shutdown"; by default the
//! answers in flight are aborted (what they produced is sent, `finish_reason: "abort"`),
//! with a timeout they finish, and past it they fail as with a dead engine core. A kinder
//! fake (connections cut at SIGTERM) let a proxy take every such request for an engine it
//! could route again; one that kept accepting hid that a stopping engine refuses.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use siesta_tests::{DEADLINE, FakeVllm, spawn_fake_vllm, wait_until};

fn chat(max_tokens: u32, stream: bool) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
           "max_tokens": max_tokens, "ignore_eos": true, "stream": stream})
}

async fn send(url: &str, body: Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .timeout(DEADLINE)
        .send()
        .await
        .expect("an answer, not a cut connection")
}

/// The finish reason and text of a non-streamed chat answer.
async fn finished(resp: reqwest::Response) -> (String, String) {
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    let c = &v["choices"][0];
    (
        c["finish_reason"].as_str().unwrap_or_default().to_string(),
        c["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )
}

async fn running(fv: &FakeVllm) -> f64 {
    let text = fv.get("/metrics").await.text().await.unwrap();
    text.lines()
        .find(|l| l.starts_with("vllm:num_requests_running"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_sigterm_aborts_the_answers_under_way_and_they_end_well_formed() {
    // 20 tokens/s: 200 tokens would take 10 s.
    let mut fv = spawn_fake_vllm(&["m", "--tokens-per-second", "20"]).await;
    let plain = tokio::spawn({
        let url = fv.url.clone();
        async move { finished(send(&url, chat(200, false)).await).await }
    });
    let mut stream = send(&fv.url, chat(200, true)).await;
    let first = stream.chunk().await.unwrap().expect("a first event");
    assert!(first.starts_with(b"data: "), "{first:?}");
    wait_until("both requests to run", DEADLINE, || async {
        running(&fv).await == 2.0
    })
    .await;
    // As siesta stops an engine: the whole process group.
    fv.child.signal_group(Signal::SIGTERM);
    let mut rest = Vec::new();
    while let Some(c) = stream.chunk().await.expect("the stream is not cut") {
        rest.extend_from_slice(&c);
    }
    let rest = String::from_utf8(rest).unwrap();
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
    assert!(rest.contains(r#""finish_reason":"abort""#), "{rest}");
    let (reason, text) = plain.await.unwrap();
    assert_eq!(reason, "abort");
    assert!(text.len() < 200, "aborted, not finished: {text}");
    assert!(fv.child.wait_exit(DEADLINE).await.success());
}

#[tokio::test]
async fn with_a_shutdown_timeout_answers_under_way_finish_and_new_connections_are_refused() {
    // 100 tokens of 20 a second: 5 s, ample for the refusal to be seen first.
    let mut fv =
        spawn_fake_vllm(&["m", "--tokens-per-second", "20", "--shutdown-timeout", "60"]).await;
    let under_way = tokio::spawn({
        let url = fv.url.clone();
        async move { finished(send(&url, chat(100, false)).await).await }
    });
    // A request whose body is still on its way when the SIGTERM comes.
    let addr = fv.url.trim_start_matches("http://").to_string();
    let mut late = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let body = chat(5, false).to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    late.write_all(head.as_bytes()).await.unwrap();
    late.write_all(&body.as_bytes()[..1]).await.unwrap();
    wait_until("the request to run", DEADLINE, || async {
        running(&fv).await == 1.0
    })
    .await;
    fv.child.signal(Signal::SIGTERM);
    // vLLM 0.24 (`vllm-check sigterm`): the listener closes at once, while the answer under
    // way goes on.
    wait_until("new connections to be refused", DEADLINE, || async {
        tokio::net::TcpStream::connect(&addr).await.is_err()
    })
    .await;
    assert!(
        !under_way.is_finished(),
        "refused only once the answer ended"
    );
    // The request already read in part is answered as vLLM did one that reached it then.
    late.write_all(&body.as_bytes()[1..]).await.unwrap();
    let mut answer = Vec::new();
    late.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 500"), "{answer}");
    assert!(
        answer.contains("cannot schedule new futures after shutdown"),
        "{answer}"
    );
    // The request under way is answered whole.
    let (reason, _) = under_way.await.unwrap();
    assert_eq!(reason, "length");
    assert!(fv.child.wait_exit(DEADLINE).await.success());
}

#[tokio::test]
async fn past_the_shutdown_timeout_answers_still_running_fail_as_with_a_dead_engine() {
    // 100 tokens of 10 a second: 10 s, past a 1 s timeout.
    let mut fv =
        spawn_fake_vllm(&["m", "--tokens-per-second", "10", "--shutdown-timeout", "1"]).await;
    let under_way = tokio::spawn({
        let url = fv.url.clone();
        async move { send(&url, chat(100, false)).await }
    });
    wait_until("the request to run", DEADLINE, || async {
        running(&fv).await == 1.0
    })
    .await;
    fv.child.signal(Signal::SIGTERM);
    let resp = tokio::time::timeout(Duration::from_secs(8), under_way)
        .await
        .expect("failed at the timeout, not run to its end")
        .unwrap();
    assert_eq!(resp.status(), 500);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], 500, "{v}");
    fv.child.wait_exit(DEADLINE).await;
}

/// A server whose stdout and stderr were pipes nobody reads any more (the reader went
/// away) still stops on SIGTERM, as vLLM does: its logging drops what it cannot write.
/// fake-vllm's SIGTERM log line used to fail, tracing-subscriber reported that on the
/// closed stderr, the report panicked the task that was to shut the server down, and the
/// process never exited.
#[tokio::test]
async fn sigterm_stops_a_server_whose_output_pipes_are_closed() {
    use std::process::Stdio;
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(siesta_tests::bin_path("fake-vllm"))
        .args(["serve", "m", "--host", "127.0.0.1", "--port", "0"])
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn fake-vllm");
    let pid = nix::unistd::Pid::from_raw(child.id().expect("running") as i32);
    let err = child.stderr.take().unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    // Read until it serves, then close both read ends.
    let ready = tokio::time::timeout(DEADLINE, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains("Uvicorn running on") {
                return true;
            }
        }
        false
    })
    .await;
    assert!(matches!(ready, Ok(true)), "fake-vllm did not start");
    drop(lines);
    drop(err);
    nix::sys::signal::kill(pid, Signal::SIGTERM).unwrap();
    if tokio::time::timeout(DEADLINE, child.wait()).await.is_err() {
        // Its whole group: the engine core too.
        let _ = nix::sys::signal::killpg(pid, Signal::SIGKILL);
        panic!("fake-vllm still running {DEADLINE:?} after SIGTERM with its output closed");
    }
}
