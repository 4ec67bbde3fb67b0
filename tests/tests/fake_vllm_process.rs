//! fake-vllm's processes and connections, as unkind as vLLM's: TP workers that outlive a
//! SIGKILLed server, a server that dies with its engine core, uvicorn's keep-alive timeout.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use siesta_tests::{
    DEADLINE, any_alive, proc_stat, spawn_fake_vllm, spawn_fake_vllm_env, wait_until,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The `n` TP workers of the engine core `core`, once all have started.
async fn tp_workers(core: i32, n: usize) -> Vec<i32> {
    siesta_tests::wait_for("the TP workers", DEADLINE, || {
        let w: Vec<i32> = siesta_tests::descendants(core)
            .into_iter()
            .filter(|p| proc_stat(*p).is_some_and(|s| s.comm == "VLLM::Worker_TP"))
            .collect();
        (w.len() == n).then_some(w)
    })
    .await
}

#[tokio::test]
async fn tp_workers_and_engine_core_outlive_a_sigkilled_server() {
    let mut fv = spawn_fake_vllm(&["m", "--tensor-parallel-size", "3"]).await;
    let core = fv.engine_core_pid().await;
    let workers = tp_workers(core, 3).await;
    for w in &workers {
        let st = proc_stat(*w).unwrap();
        assert_eq!((st.ppid, st.pgrp), (core, fv.child.pgid()), "{st:?}");
    }
    fv.child.signal(Signal::SIGKILL);
    fv.child.wait_exit(DEADLINE).await;
    // Absence of exit can only be sampled: give the children several polls.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut all = workers.clone();
    all.push(core);
    assert_eq!(
        any_alive(&all),
        all,
        "like vLLM the engine core and workers live on"
    );
    fv.child.signal_group(Signal::SIGKILL);
    wait_until("the group kill to reach them", DEADLINE, || async {
        any_alive(&all).is_empty()
    })
    .await;
}

/// What `/proc/PID/environ` shows of the engine core and its workers: nothing, as of
/// vLLM's, whose py-setproctitle zeroes it when it names them; all of it with
/// `SPT_NOENV=1` (siesta sets it: it finds an engine's leftovers by their environment).
#[tokio::test]
async fn the_engine_core_and_workers_show_no_environment_unless_spt_noenv() {
    for noenv in ["", "1"] {
        let fv = spawn_fake_vllm_env(
            &["m", "-tp", "2"],
            &[("SPT_NOENV", noenv), ("SIESTA_TEST_MARK", "x")],
        )
        .await;
        let core = fv.engine_core_pid().await;
        let workers = tp_workers(core, 2).await;
        let shows = |pid: i32| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
            env.split(|b| *b == 0).any(|kv| kv == b"SIESTA_TEST_MARK=x")
        };
        assert!(shows(fv.child.pid() as i32), "the server is not renamed");
        for pid in std::iter::once(core).chain(workers) {
            assert_eq!(shows(pid), noenv == "1", "SPT_NOENV={noenv:?}, pid {pid}");
        }
    }
}

#[tokio::test]
async fn sigterm_stops_the_engine_core_and_its_workers() {
    let mut fv = spawn_fake_vllm(&["m", "-tp", "2"]).await;
    wait_until("the workers to start", DEADLINE, || async {
        fv.child.group_members().len() == 4
    })
    .await;
    fv.child.signal(Signal::SIGTERM);
    assert!(fv.child.wait_exit(DEADLINE).await.success());
    wait_until("the whole group to exit", DEADLINE, || async {
        fv.child.group_members().is_empty()
    })
    .await;
}

/// Like vLLM's engine core (SIGTERM and SIGINT both raise SystemExit), a
/// SIGINT to the engine core alone ends it cleanly: its workers go with it.
#[tokio::test]
async fn sigint_to_the_engine_core_stops_it_and_its_workers() {
    let fv = spawn_fake_vllm(&["m", "-tp", "2"]).await;
    let core = fv.engine_core_pid().await;
    let workers = tp_workers(core, 2).await;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(core), Signal::SIGINT).unwrap();
    let mut all = workers.clone();
    all.push(core);
    wait_until(
        "the engine core and its workers to exit",
        DEADLINE,
        || async { any_alive(&all).is_empty() },
    )
    .await;
}

#[tokio::test]
async fn a_dead_engine_core_turns_health_503_and_ends_the_server() {
    let mut fv = spawn_fake_vllm(&["m"]).await;
    let core = fv.engine_core_pid().await;
    let killed = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(core), Signal::SIGKILL).unwrap();
    wait_until("/health to answer 503", DEADLINE, || async {
        fv.get("/health").await.status() == 503
    })
    .await;
    let status = fv.child.wait_exit(DEADLINE).await;
    assert_eq!(status.code(), Some(1), "{status}");
    assert!(
        killed.elapsed() < Duration::from_secs(8),
        "exited {:?} after its engine core died",
        killed.elapsed()
    );
    assert!(fv.child.output().contains("died unexpectedly"));
}

/// Requests in flight when the engine core dies are answered, as vLLM's output handler
/// fails them with `EngineDeadError`: a 500 in vLLM's error shape, or in a stream an error
/// event and `data: [DONE]`. Before, they ran on until the server exited and their
/// connections were cut, a kinder failure than vLLM's for a proxy to meet.
#[tokio::test]
async fn requests_in_flight_when_the_engine_core_dies_get_engine_dead_errors() {
    let fv = spawn_fake_vllm(&["m", "--tokens-per-second", "20"]).await;
    let client = reqwest::Client::new();
    let ask = |stream: bool| {
        client
            .post(fv.at("/v1/chat/completions"))
            .json(&serde_json::json!({
                "model": "m", "max_tokens": 2000, "ignore_eos": true, "stream": stream,
                "messages": [{"role": "user", "content": "hi"}],
            }))
            .send()
    };
    let plain = tokio::spawn(ask(false));
    let streamed = ask(true).await.unwrap();
    assert_eq!(streamed.status(), 200);
    wait_until("both requests running", DEADLINE, || async {
        fv.metric("vllm:num_requests_running", "").await == 2.0
    })
    .await;
    let core = fv.engine_core_pid().await;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(core), Signal::SIGKILL).unwrap();
    siesta_tests::assert_engine_dead_answers(plain, streamed).await;
}

async fn http_get(stream: &mut TcpStream, path: &str) -> String {
    let req = format!("GET {path} HTTP/1.1\r\nHost: fake\r\n\r\n");
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = stream.read(&mut buf).await.unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Waits for the server to close `stream` (EOF or reset); returns when it did.
async fn closed(stream: &mut TcpStream) -> Instant {
    let mut buf = [0u8; 64];
    match tokio::time::timeout(DEADLINE, stream.read(&mut buf)).await {
        Ok(Ok(0) | Err(_)) => Instant::now(),
        Ok(Ok(n)) => panic!("unexpected bytes: {:?}", &buf[..n]),
        Err(_) => panic!("the server kept an idle connection open for {DEADLINE:?}"),
    }
}

#[tokio::test]
async fn idle_keep_alive_connections_are_closed_but_busy_ones_are_not() {
    let fv = spawn_fake_vllm_env(
        &["m", "--enable-sleep-mode"],
        &[("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "1")],
    )
    .await;
    let mut s = TcpStream::connect(fv.addr).await.unwrap();
    assert!(
        http_get(&mut s, "/health")
            .await
            .starts_with("HTTP/1.1 200")
    );
    let answered = Instant::now();
    let at = closed(&mut s).await;
    let idle = at - answered;
    assert!(
        idle >= Duration::from_millis(900),
        "closed after only {idle:?}"
    );

    // A request held by a sleeping engine keeps its connection open past the timeout.
    assert_eq!(fv.post("/sleep").await.status(), 200);
    let mut s = TcpStream::connect(fv.addr).await.unwrap();
    let body = r#"{"prompt":"hi","max_tokens":2}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: fake\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    wait_until("the request to be held", DEADLINE, || async {
        fv.stats().await["held"] == 1
    })
    .await;
    // Sampled: twice the keep-alive timeout.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(fv.post("/wake_up").await.status(), 200);
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(DEADLINE, s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
}
