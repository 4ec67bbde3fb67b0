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

/// An HTTP/2 frame: type, flags, stream, payload.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = len.to_be_bytes()[1..].to_vec();
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The same with an HTTP/2 client (prior knowledge, h2c) whose request
/// comes with its connection preface: the request is served, and the
/// drain ends when it is (hyper's GOAWAY closes the connection), not at the
/// drain timeout. Before, the connection was served as HTTP/1 (the
/// draining path), which cannot read it: closed, the request unanswered.
/// The client is written out frame by frame so that its request is sent
/// before anything the proxy says (a real client's may be).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_http2_request_sent_as_the_drain_begins_is_served() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let mut p = ready_proxy(vec![c.url()], |cfg| {
        cfg.drain_timeout = 4 * DEADLINE;
    })
    .await;
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
    // Header fields as literals never indexed, with literal names (HPACK).
    let mut block = Vec::new();
    for (k, v) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/v1/chat/completions"),
        (":authority", "proxy"),
        ("content-type", "application/json"),
    ] {
        block.push(0x10);
        block.push(k.len() as u8);
        block.extend_from_slice(k.as_bytes());
        block.push(v.len() as u8);
        block.extend_from_slice(v.as_bytes());
    }
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(h2_frame(4, 0, 0, &[]));
    out.extend(h2_frame(1, 0x4, 1, &block));
    out.extend(h2_frame(0, 0x1, 1, chat("m").as_bytes()));
    s.write_all(&out).await.unwrap();
    // Read frames until the proxy closes, acknowledging its SETTINGS and
    // PINGs (its graceful GOAWAY waits for the PING's).
    let (mut status, mut body, mut ended) = (None, Vec::new(), false);
    let read_all = async {
        loop {
            let mut head = [0u8; 9];
            if s.read_exact(&mut head).await.is_err() {
                return;
            }
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let (kind, flags) = (head[3], head[4]);
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; len];
            if s.read_exact(&mut payload).await.is_err() {
                return;
            }
            match (kind, stream) {
                (4, 0) if flags & 1 == 0 => s.write_all(&h2_frame(4, 1, 0, &[])).await.unwrap(),
                (6, 0) if flags & 1 == 0 => {
                    let _ = s.write_all(&h2_frame(6, 1, 0, &payload)).await;
                }
                // `:status: 200` is entry 8 of HPACK's static table.
                (1, 1) => status = payload.first().copied(),
                (0, 1) => {
                    body.extend_from_slice(&payload);
                    ended |= flags & 1 == 1;
                }
                _ => {}
            }
        }
    };
    tokio::time::timeout(DEADLINE, read_all)
        .await
        .expect("the proxy neither answered nor closed the connection");
    assert_eq!(e.count(), 1, "the request never reached the engine");
    assert_eq!(
        status,
        Some(0x88),
        "not a 200: {:?}",
        String::from_utf8_lossy(&body)
    );
    assert!(ended, "the answer did not end");
    assert!(String::from_utf8_lossy(&body).contains("chat.completion"));
    tokio::time::timeout(DEADLINE, &mut p.task)
        .await
        .expect("the drain waited on the HTTP/2 connection")
        .unwrap()
        .unwrap();
}
