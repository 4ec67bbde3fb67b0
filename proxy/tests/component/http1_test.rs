//! The proxy's own HTTP/1.1 server (`server/http1.rs`), seen from a raw
//! client: keep-alive, pipelining, the hand-over to hyper, `Connection:
//! close`, the idle timeout, the drain, framing.

use std::time::{Duration, Instant};

use siesta_proto::v1::ModelState;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::control::{ScriptedControl, model};
use crate::engine::Engine;
use crate::support::*;

/// One response read off a raw connection.
#[derive(Debug)]
struct RawReply {
    status: u16,
    /// The head's lines, lowercased.
    head: String,
    body: Vec<u8>,
}

impl RawReply {
    fn header(&self, name: &str) -> Option<&str> {
        self.head
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    }
}

/// Reads more of `s` into `buf`; false when it closed.
async fn fill(s: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 8192];
    match tokio::time::timeout(DEADLINE, s.read(&mut chunk))
        .await
        .expect("no answer within the deadline")
    {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            true
        }
    }
}

/// Reads one response (Content-Length or chunked) from `s`, `buf` keeping
/// what came after it; `None` if the connection closed first.
async fn read_reply(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<RawReply> {
    let end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        if !fill(s, buf).await {
            return None;
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    buf.drain(..end);
    let mut reply = RawReply {
        status,
        head,
        body: Vec::new(),
    };
    if status == 204 || status == 304 {
        return Some(reply);
    }
    if reply.header("transfer-encoding") == Some("chunked") {
        loop {
            let line = loop {
                if let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
                    break i;
                }
                assert!(fill(s, buf).await, "closed inside a chunked body");
            };
            let size = usize::from_str_radix(std::str::from_utf8(&buf[..line]).unwrap(), 16)
                .expect("a chunk size");
            while buf.len() < line + 2 + size + 2 {
                assert!(fill(s, buf).await, "closed inside a chunk");
            }
            assert_eq!(&buf[line + 2 + size..line + 4 + size], b"\r\n");
            reply
                .body
                .extend_from_slice(&buf[line + 2..line + 2 + size]);
            buf.drain(..line + 4 + size);
            if size == 0 {
                return Some(reply);
            }
        }
    }
    let len: usize = reply
        .header("content-length")
        .expect("neither a length nor chunked")
        .parse()
        .unwrap();
    while buf.len() < len {
        assert!(fill(s, buf).await, "closed inside a sized body");
    }
    reply.body = buf.drain(..len).collect();
    Some(reply)
}

fn post_bytes(path: &str, extra: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Waits until the server closes `s` (EOF or reset).
async fn closed_after(s: &mut TcpStream) {
    let mut b = [0u8; 64];
    match tokio::time::timeout(DEADLINE, s.read(&mut b))
        .await
        .expect("the connection was never closed")
    {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("unexpected bytes: {:?}", String::from_utf8_lossy(&b[..n])),
    }
}

#[tokio::test]
async fn requests_on_one_connection_are_answered_in_order_pipelined_or_not_and_after_a_hand_over_to_hyper()
 {
    let e = Engine::start("e1").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let before = accepted(&p).await;
    // (Waiting for readiness went to hyper: GET /readyz.)
    let to_hyper =
        || async { metric(&p.metrics().await, "siesta_proxy_hyper_connections_total").unwrap() };
    let hyper_before = to_hyper().await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    let mut buf = Vec::new();

    // Two at once in one write, then one alone.
    let mut two = post_bytes("/v1/chat/completions", "", &chat("m"));
    two.extend(post_bytes(
        "/v1/embeddings",
        "",
        r#"{"model":"m","input":"x"}"#,
    ));
    s.write_all(&two).await.unwrap();
    let a = read_reply(&mut s, &mut buf).await.unwrap();
    let b = read_reply(&mut s, &mut buf).await.unwrap();
    assert_eq!((a.status, b.status), (200, 200), "{a:?} {b:?}");
    assert!(String::from_utf8_lossy(&a.body).contains("chat.completion"));
    assert!(String::from_utf8_lossy(&b.body).contains("embedding"));
    for r in [&a, &b] {
        assert_eq!(r.header("x-engine"), Some("e1"));
        assert!(r.header("date").is_some(), "no date: {}", r.head);
        assert!(r.header("connection").is_none(), "{}", r.head);
        assert!(r.header("x-hop").is_none(), "a hop-by-hop header leaked");
    }
    s.write_all(&post_bytes("/v1/chat/completions?x=1", "", &chat("m")))
        .await
        .unwrap();
    assert_eq!(read_reply(&mut s, &mut buf).await.unwrap().status, 200);
    assert_eq!(
        to_hyper().await - hyper_before,
        0.0,
        "hyper served a plain request"
    );

    // A GET goes to hyper with the rest of the connection; a POST after it
    // is hyper's too, answered all the same.
    s.write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let list = read_reply(&mut s, &mut buf).await.unwrap();
    assert_eq!(list.status, 200);
    assert!(String::from_utf8_lossy(&list.body).contains("\"m\""));
    s.write_all(&post_bytes("/v1/chat/completions", "", &chat("m")))
        .await
        .unwrap();
    assert_eq!(read_reply(&mut s, &mut buf).await.unwrap().status, 200);

    assert_eq!(
        to_hyper().await - hyper_before,
        1.0,
        "the GET's connection went to hyper"
    );
    assert_eq!(e.count(), 4, "{:?}", e.received());
    assert_eq!(accepted(&p).await - before, 1.0, "more than one connection");
}

#[tokio::test]
async fn a_client_asking_to_close_gets_connection_close_and_the_connection_closes() {
    let e = Engine::start("e1").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    let mut buf = Vec::new();
    s.write_all(&post_bytes(
        "/v1/chat/completions",
        "connection: close\r\n",
        &chat("m"),
    ))
    .await
    .unwrap();
    let r = read_reply(&mut s, &mut buf).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("connection"), Some("close"), "{}", r.head);
    closed_after(&mut s).await;
}

#[tokio::test]
async fn an_idle_connection_is_closed_after_the_header_timeout_not_before() {
    let e = Engine::start("e1").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let timeout = Duration::from_millis(600);
    let p = ready_proxy(vec![c.url()], |cfg| cfg.header_timeout = timeout).await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    let mut buf = Vec::new();
    // The proxy's idle clock starts after the request came, so after this.
    let sent = Instant::now();
    s.write_all(&post_bytes("/v1/chat/completions", "", &chat("m")))
        .await
        .unwrap();
    assert_eq!(read_reply(&mut s, &mut buf).await.unwrap().status, 200);
    closed_after(&mut s).await;
    let open = sent.elapsed();
    assert!(
        open >= timeout,
        "closed {open:?} after the request was sent, before the header timeout of {timeout:?}"
    );
}

/// A request whose head is not whole within the header timeout is closed
/// then, with no answer, as hyper's server does; before, its bytes went to
/// hyper, which waited a header timeout of its own before closing.
#[tokio::test]
async fn a_head_not_whole_within_the_header_timeout_is_closed_after_one_timeout() {
    let e = Engine::start("e1").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let timeout = Duration::from_millis(1500);
    let p = ready_proxy(vec![c.url()], |cfg| cfg.header_timeout = timeout).await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    let sent = Instant::now();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-le")
        .await
        .unwrap();
    closed_after(&mut s).await;
    let open = sent.elapsed();
    assert!(open >= timeout, "closed after {open:?}, before the timeout");
    assert!(
        open < 2 * timeout,
        "closed after {open:?}: two header timeouts of {timeout:?}"
    );
}

#[tokio::test]
async fn the_drain_closes_idle_connections_at_once_and_finishes_a_request_begun_with_connection_close()
 {
    let e = Engine::start("e1").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    // An idle connection would otherwise stay open for a minute.
    let p = ready_proxy(vec![c.url()], |cfg| {
        cfg.header_timeout = Duration::from_secs(60);
    })
    .await;
    let mut idle = TcpStream::connect(p.addr).await.unwrap();
    let mut ibuf = Vec::new();
    idle.write_all(&post_bytes("/v1/chat/completions", "", &chat("m")))
        .await
        .unwrap();
    assert_eq!(read_reply(&mut idle, &mut ibuf).await.unwrap().status, 200);

    e.set_gate(false);
    let mut busy = TcpStream::connect(p.addr).await.unwrap();
    let mut bbuf = Vec::new();
    busy.write_all(&post_bytes("/v1/chat/completions", "", &chat("m")))
        .await
        .unwrap();
    wait_until("the engine has the request", || async { e.count() == 2 }).await;

    p.shutdown.cancel();
    closed_after(&mut idle).await;
    e.set_gate(true);
    let r = read_reply(&mut busy, &mut bbuf).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("connection"), Some("close"), "{}", r.head);
    closed_after(&mut busy).await;
}

#[tokio::test]
async fn a_streamed_answer_is_chunked_whole_and_an_error_answer_is_sized() {
    let e = Engine::start("e1").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    let mut buf = Vec::new();
    s.write_all(&post_bytes("/v1/chat/completions", "", &chat_stream("m")))
        .await
        .unwrap();
    let r = read_reply(&mut s, &mut buf).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let text = String::from_utf8(r.body).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 3, "{text:?}");
    assert!(events[0].contains("tok1") && events[1].contains("tok2"));
    assert_eq!(events[2], "data: [DONE]");

    // The proxy's own answer on the same connection: sized, kept open.
    s.write_all(&post_bytes("/v1/chat/completions", "", &chat("nope")))
        .await
        .unwrap();
    let r = read_reply(&mut s, &mut buf).await.unwrap();
    assert_eq!(r.status, 404);
    assert_eq!(
        r.header("content-length")
            .map(|l| l.parse::<usize>().unwrap()),
        Some(r.body.len())
    );
    assert!(String::from_utf8_lossy(&r.body).contains("nope"));
    s.write_all(&post_bytes("/v1/chat/completions", "", &chat("m")))
        .await
        .unwrap();
    assert_eq!(read_reply(&mut s, &mut buf).await.unwrap().status, 200);
}

#[tokio::test]
async fn a_sized_answer_cut_midway_is_never_read_past_its_length_and_the_connection_closes() {
    // An event stream with a length, cut after 11 of 40 bytes: the proxy
    // ends an event stream with an error event, which must not be read as
    // the rest of the 40 bytes (or as the next answer).
    let (url, _script) = crate::upstream_http_test::engine(vec![(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 40\r\n\r\ndata: one\n\n",
        true,
    )])
    .await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    s.write_all(&post_bytes("/v1/chat/completions", "", &chat_stream("m")))
        .await
        .unwrap();
    let mut all = Vec::new();
    while fill(&mut s, &mut all).await {}
    let end = all.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let head = String::from_utf8_lossy(&all[..end]).to_lowercase();
    assert!(head.contains("content-length: 40"), "{head}");
    let body = &all[end..];
    assert!(
        body.len() <= 40,
        "{} bytes sent for a length of 40",
        body.len()
    );
    assert!(
        body.starts_with(b"data: one\n\n"),
        "{:?}",
        String::from_utf8_lossy(body)
    );
}

#[tokio::test]
async fn an_empty_engine_answer_keeps_its_headers_and_a_204_has_no_body() {
    let (url, script) = crate::upstream_http_test::engine(vec![
        (
            "HTTP/1.1 200 OK\r\nx-engine-said: yes\r\ncontent-length: 0\r\n\r\n",
            false,
        ),
        (
            "HTTP/1.1 204 No Content\r\nx-b: 1\r\nContent-Length: 0\r\nx-c: 2\r\n\r\n",
            false,
        ),
        (
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
            false,
        ),
    ])
    .await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    let mut buf = Vec::new();
    let ask = async |s: &mut TcpStream, buf: &mut Vec<u8>| {
        s.write_all(&post_bytes("/v1/chat/completions", "", &chat("m")))
            .await
            .unwrap();
        read_reply(s, buf).await.unwrap()
    };
    let empty = ask(&mut s, &mut buf).await;
    assert_eq!(empty.status, 200);
    assert_eq!(empty.header("x-engine-said"), Some("yes"), "{}", empty.head);
    assert_eq!(empty.header("content-length"), Some("0"), "{}", empty.head);
    assert!(
        empty.header("date").is_some(),
        "no date added: {}",
        empty.head
    );
    let none = ask(&mut s, &mut buf).await;
    assert_eq!(none.status, 204);
    assert_eq!(none.header("x-b"), Some("1"));
    assert_eq!(none.header("x-c"), Some("2"));
    // The engine's length is not relayed on a 204 (RFC 9110 §8.6).
    assert!(
        none.header("content-length").is_none() && none.header("transfer-encoding").is_none(),
        "{}",
        none.head
    );
    let after = ask(&mut s, &mut buf).await;
    assert_eq!((after.status, &after.body[..]), (200, &b"{}"[..]));
    assert_eq!(
        script.connections.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the engine connection was not kept"
    );
}
