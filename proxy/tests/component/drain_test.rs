//! A proxy's drain (SIGTERM, a rolling restart of `--reuse-port` replicas)
//! answers every client that reached it: connections the kernel had queued
//! for its listener, and connections whose first request comes as the
//! drain begins.

use siesta_proto::v1::ModelState;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::control::{ScriptedControl, model};
use crate::engine::Engine;
use crate::support::*;

fn raw_chat(model: &str) -> String {
    let body = chat(model);
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Everything the proxy sends on `s` until it closes it.
async fn answer(mut s: tokio::net::TcpStream) -> String {
    let mut out = Vec::new();
    let read = tokio::time::timeout(DEADLINE, s.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "no end of the answer within {DEADLINE:?}");
    String::from_utf8_lossy(&out).into_owned()
}

/// Single-threaded runtime: the proxy runs only while this test awaits, so
/// the connections below wait in the listener's queue, requests sent,
/// until after the drain has begun. Closing the listener with them queued
/// resets them.
#[tokio::test]
async fn connections_queued_when_the_drain_begins_are_served() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let mut queued = Vec::new();
    for _ in 0..20 {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(p.addr).unwrap();
        s.write_all(raw_chat("m").as_bytes()).unwrap();
        s.set_nonblocking(true).unwrap();
        queued.push(s);
    }
    p.shutdown.cancel();
    for (i, s) in queued.into_iter().enumerate() {
        let got = answer(tokio::net::TcpStream::from_std(s).unwrap()).await;
        assert!(got.starts_with("HTTP/1.1 200"), "connection {i}: {got:?}");
        assert!(got.contains("\"choices\""), "connection {i}: {got:?}");
    }
    assert_eq!(e.count(), 20);
}

/// A client connects, the proxy accepts, the drain begins, and only then
/// does the request arrive (a client's connect and send are two steps):
/// it is served, and the connection closed after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_request_sent_as_the_drain_begins_is_served() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let before = accepted(&p).await;
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    wait_until("connection accepted", || async {
        accepted(&p).await > before
    })
    .await;
    p.shutdown.cancel();
    wait_until("listener closed", || async {
        tokio::net::TcpStream::connect(p.addr).await.is_err()
    })
    .await;
    s.write_all(raw_chat("m").as_bytes()).await.unwrap();
    let got = answer(s).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
    assert!(
        got.to_ascii_lowercase().contains("connection: close"),
        "{got:?}"
    );
    assert_eq!(e.count(), 1);
}
