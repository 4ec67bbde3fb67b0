//! An engine whose uvicorn closes idle connections sooner than siesta keeps
//! them: `VLLM_HTTP_TIMEOUT_KEEP_ALIVE=2` in the model's environment (vLLM
//! has no flag for it) against the proxy's and the control's 4 s pools.
//! Requests sent after every idle gap around the engine's 2 s are answered:
//! a pooled connection the engine closed is dropped at checkout, and one it
//! closes as the request goes out is retried on a fresh one.

use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;
use siesta_tests::{DEADLINE, spawn_proxy};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn model() -> String {
    r#"
[[model]]
name = "tiny"
model = "fake/tiny"
executable = "@FAKE_VLLM@"
gpus = 0
preload = "awake"
env = { SIESTA_TEST_TAG = "@DIR@", VLLM_HTTP_TIMEOUT_KEEP_ALIVE = "2" }
args = []
"#
    .to_string()
}

/// How long the engine keeps an idle connection open.
async fn engine_keep_alive(engine: &str) -> Duration {
    let addr = engine.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"GET /health HTTP/1.1\r\nHost: e\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    let answered = Instant::now();
    let closed = tokio::time::timeout(DEADLINE, s.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0) | Err(_))),
        "idle connection not closed: {closed:?}"
    );
    answered.elapsed()
}

#[tokio::test]
async fn requests_after_idle_gaps_around_a_2s_engine_keep_alive_are_answered() {
    let ctl = start(&config(&model())).await;
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&proxy).await;
    let mut c = ctl.client().await;
    let st = wait_state(&mut c, "tiny", pb::ModelState::Awake, LONG).await;
    let kept = engine_keep_alive(&endpoint(&st)).await;
    assert!(
        kept >= Duration::from_millis(1800) && kept < Duration::from_secs(3),
        "the engine kept an idle connection {kept:?}"
    );

    let url = proxy.url();
    try_chat(&url, "tiny", 2, LONG).await.unwrap();
    for gap_ms in [1990, 2010, 2050, 2200, 3000] {
        tokio::time::sleep(Duration::from_millis(gap_ms)).await;
        if let Err(e) = try_chat(&url, "tiny", 2, LONG).await {
            panic!("after {gap_ms} ms idle: {e}");
        }
    }
    let st = status(&mut c, "tiny").await;
    assert_eq!(state(&st), pb::ModelState::Awake, "{st:#?}");
    assert_eq!(st.restarts, 1, "{st:#?}");
}
