//! Slow and huge clients: heads and bodies that stall or trickle, heads
//! too large.

use std::time::{Duration, Instant};

use siesta_proto::v1::ModelState;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::control::{ScriptedControl, model};
use crate::engine::Engine;
use crate::support::*;

#[tokio::test]
async fn slow_or_huge_requests_are_cut_off() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |cfg| {
        cfg.max_header_bytes = 8192;
        cfg.body_timeout = Duration::from_millis(300);
        cfg.header_timeout = Duration::from_millis(300);
    })
    .await;
    // A body that never arrives.
    let line = raw(
        p.addr,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{",
    )
    .await;
    assert!(line.contains("408"), "{line}");
    // Headers that never end: the connection is closed.
    let started = Instant::now();
    let line = raw(p.addr, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n").await;
    assert!(line.is_empty() || line.contains("408"), "{line}");
    assert!(started.elapsed() < Duration::from_secs(10));
    // Headers too large.
    let big = format!(
        "GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
        "a".repeat(20_000)
    );
    let line = raw(p.addr, big.as_bytes()).await;
    assert!(line.is_empty() || line.contains("431"), "{line}");
    // Paths that would resolve to engine admin routes.
    for path in ["/v1/../sleep", "/v1/%2e%2e/wake_up", "/v1//x"] {
        let r = post(&p.url(path), &chat("m")).await;
        assert_eq!(r.status, 404, "{path}");
    }
    assert_eq!(e.count(), 0);
}

/// Sends a POST whose body comes in `pieces` (each after its pause);
/// `via_hyper`: on a connection whose first request, a health check, is
/// already answered (so hyper and the handler read this one), else first
/// on its connection (the proxy's own HTTP/1.1 server reads it). Returns
/// the answer, read until the proxy closes. The writes go on while the
/// answer is read, and fail silently once the proxy has closed.
async fn post_in_pieces(
    addr: std::net::SocketAddr,
    pieces: Vec<(u64, Vec<u8>)>,
    via_hyper: bool,
) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    if via_hyper {
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
    }
    let mut buf = Vec::new();
    while via_hyper && !buf.ends_with(b"ok\n") {
        let mut b = [0u8; 1024];
        let n = tokio::time::timeout(DEADLINE, s.read(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed after the health check");
        buf.extend_from_slice(&b[..n]);
    }
    let len: usize = pieces.iter().map(|(_, p)| p.len()).sum();
    let (mut rd, mut wr) = s.into_split();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         connection: close\r\ncontent-length: {len}\r\n\r\n"
    );
    wr.write_all(head.as_bytes()).await.unwrap();
    let writer = tokio::spawn(async move {
        for (pause_ms, piece) in pieces {
            tokio::time::sleep(Duration::from_millis(pause_ms)).await;
            if wr.write_all(&piece).await.is_err() {
                return;
            }
        }
        // Held open until the answer is read.
        std::future::pending::<()>().await;
    });
    let mut answer = Vec::new();
    tokio::time::timeout(DEADLINE, rd.read_to_end(&mut answer))
        .await
        .expect("no answer")
        .unwrap();
    writer.abort();
    String::from_utf8_lossy(&answer).into_owned()
}

/// A chat body of about `pad` bytes, for model `m`.
fn padded_chat(pad: usize) -> Vec<u8> {
    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(pad)}]})
        .to_string()
        .into_bytes()
}

/// `--body-timeout` is a timeout between reads (nginx's
/// `client_body_timeout`), not a deadline on the whole body: a large body
/// over a slow uplink that keeps arriving is served however long it takes;
/// one that stalls for the timeout gets 408 naming it and what had arrived.
#[tokio::test]
async fn the_body_timeout_is_between_reads_not_for_the_whole_body() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |cfg| {
        cfg.body_timeout = Duration::from_secs(1);
    })
    .await;
    // Five pieces 300 ms apart: 1.2 s in all, never a second without data.
    let body = padded_chat(20_000);
    let pieces: Vec<(u64, Vec<u8>)> = body
        .chunks(body.len() / 5 + 1)
        .enumerate()
        .map(|(i, c)| (if i == 0 { 0 } else { 300 }, c.to_vec()))
        .collect();
    assert_eq!(pieces.len(), 5);
    let answer = post_in_pieces(p.addr, pieces, true).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(e.count(), 1);
    // Half the body, then nothing (the rest would come after 2.5 s).
    let (a, b) = body.split_at(10_000);
    let started = Instant::now();
    let answer = post_in_pieces(p.addr, vec![(0, a.to_vec()), (2500, b.to_vec())], true).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert!(
        answer.contains("1000 ms") && answer.contains("10000 of"),
        "the timeout and the bytes that came: {answer}"
    );
    assert_eq!(e.count(), 1);
}

/// A body that never stalls for the body timeout but trickles in (a byte
/// every 100 ms) is still cut: once it has taken longer than the body
/// timeout it must have averaged the minimum rate. Read by hyper or by the
/// proxy's own server alike, and within about the body timeout (the own
/// server's body is not given the header timeout first).
#[tokio::test]
async fn a_body_trickling_in_below_the_minimum_rate_is_cut() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |cfg| {
        cfg.header_timeout = Duration::from_secs(20);
        cfg.body_timeout = Duration::from_secs(1);
    })
    .await;
    let body = padded_chat(600);
    for via_hyper in [true, false] {
        let pieces = body.iter().map(|b| (100, vec![*b])).collect::<Vec<_>>();
        let started = Instant::now();
        let answer = post_in_pieces(p.addr, pieces, via_hyper).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{via_hyper}: {answer}");
        assert!(
            answer.contains("bytes/s"),
            "names the minimum rate: {answer}"
        );
        let took = started.elapsed();
        assert!(took < Duration::from_secs(10), "{via_hyper}: {took:?}");
    }
    assert_eq!(e.count(), 0);
}

/// A head over `--max-header-bytes` gets an OpenAI-shaped 431 (hyper's
/// had no body), whole, before the connection closes.
#[tokio::test]
async fn headers_too_large_are_answered_openai_shaped() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |cfg| cfg.max_header_bytes = 8192).await;
    let body = r#"{"model":"m","messages":[]}"#;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         x-big: {}\r\ncontent-length: {}\r\n\r\n{body}",
        "a".repeat(70_000),
        body.len()
    );
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    // The proxy answers after 8 KiB; the rest of the write may fail.
    let _ = s.write_all(req.as_bytes()).await;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut answer))
        .await
        .expect("no end of the answer in 30 s");
    let answer = String::from_utf8_lossy(&answer);
    assert!(read.is_ok(), "{read:?}: {answer}");
    assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
    assert!(
        answer.contains("\"code\":\"headers_too_large\""),
        "{answer}"
    );
    assert!(answer.contains("--max-header-bytes"), "{answer}");
    assert_eq!(e.count(), 0);
}

/// `--body-timeout` counts from when the body stalls (its last bytes, or
/// the end of the head when none came), on the proxy's own HTTP/1.1 server
/// too (a plain POST, first on its connection), and `--header-timeout` is
/// the head's alone. Before, that server gave the whole request the header
/// timeout, then hyper timed the body afresh: a stalled body got its 408
/// after both (70 s with the defaults, not 60).
#[tokio::test]
async fn a_stalled_body_gets_408_after_the_body_timeout_not_the_header_timeout_too() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |cfg| {
        cfg.header_timeout = Duration::from_secs(20);
        cfg.body_timeout = Duration::from_secs(1);
    })
    .await;
    for sent in [126, 0] {
        let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
        let mut req = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\
            content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
            .to_vec();
        req.extend(std::iter::repeat_n(b' ', sent));
        let started = Instant::now();
        s.write_all(&req).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(DEADLINE, s.read_to_end(&mut answer))
            .await
            .expect("no answer, or the connection stayed open")
            .unwrap();
        let took = started.elapsed();
        let answer = String::from_utf8_lossy(&answer).to_lowercase();
        assert!(answer.starts_with("http/1.1 408"), "{answer}");
        assert!(
            took >= Duration::from_secs(1) && took < Duration::from_secs(10),
            "the 408 came after {took:?} (body timeout 1 s, header timeout 20 s)"
        );
        assert!(
            answer.contains("1000 ms") && answer.contains(&format!("after {sent} of 1000 bytes")),
            "the timeout and the bytes that came: {answer}"
        );
        let head = answer.split("\r\n\r\n").next().unwrap();
        assert!(head.lines().any(|l| l == "connection: close"), "{head}");
    }
    let m = p.metrics().await;
    assert_eq!(
        metric(&m, "siesta_proxy_requests_total{model=\"\",status=\"408\"}"),
        Some(2.0),
        "{m}"
    );
    assert_eq!(e.count(), 0);
}
