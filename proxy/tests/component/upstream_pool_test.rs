//! The proxy's own pool of upstream connections: connections are reused,
//! concurrent requests each get their own, one the engine closed while idle
//! is not used, one whose client hung up mid-stream is not put back, and
//! the idle ones are closed when the proxy stops.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http_body_util::BodyExt;
use siesta_proto::v1::ModelState;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::control::{ScriptedControl, model};
use crate::support::*;

const SSE_EVENTS: [&str; 3] = ["data: one\n\n", "data: two\n\n", "data: [DONE]\n\n"];

/// A raw HTTP/1.1 engine that counts connections and requests, answers
/// once its gate is open (a stream: its first event at once, the rest once
/// the gate is open), closes connections idle for `idle_close` like
/// uvicorn, and counts connections the proxy closed.
struct PoolEngine {
    url: String,
    connections: Arc<AtomicUsize>,
    c: Counters,
    gate: watch::Sender<bool>,
}

#[derive(Clone)]
struct Counters {
    requests: Arc<AtomicUsize>,
    /// Connections the engine closed because they were idle.
    idle_closed: Arc<AtomicUsize>,
    /// Connections the proxy closed.
    peer_closed: Arc<AtomicUsize>,
    gate: watch::Receiver<bool>,
    idle_close: Option<Duration>,
}

impl Counters {
    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
    fn idle_closed(&self) -> usize {
        self.idle_closed.load(Ordering::SeqCst)
    }
    fn peer_closed(&self) -> usize {
        self.peer_closed.load(Ordering::SeqCst)
    }
}

/// Waits for the gate; true when the proxy closed the connection first.
async fn closed_before_gate(gate: &mut watch::Receiver<bool>, s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    tokio::select! {
        _ = gate.wait_for(|open| *open) => false,
        r = s.read(&mut b) => matches!(r, Ok(0) | Err(_)),
    }
}

fn chunk(data: &str) -> String {
    format!("{:x}\r\n{data}\r\n", data.len())
}

/// Answers one request; false when the proxy closed the connection.
async fn answer(s: &mut TcpStream, c: &mut Counters, stream: bool) -> bool {
    if stream {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        let first = format!("{head}{}", chunk(SSE_EVENTS[0]));
        if s.write_all(first.as_bytes()).await.is_err() || closed_before_gate(&mut c.gate, s).await
        {
            return false;
        }
        let rest: String = SSE_EVENTS[1..].iter().map(|e| chunk(e)).collect();
        return s
            .write_all(format!("{rest}0\r\n\r\n").as_bytes())
            .await
            .is_ok();
    }
    if closed_before_gate(&mut c.gate, s).await {
        return false;
    }
    let body = r#"{"object":"chat.completion","choices":[]}"#;
    let resp = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(resp.as_bytes()).await.is_ok()
}

async fn serve(mut s: TcpStream, mut c: Counters) {
    let mut buf = Vec::new();
    loop {
        let read = read_request(&mut s, &mut buf);
        let req = match c.idle_close {
            Some(idle) => match tokio::time::timeout(idle, read).await {
                Ok(req) => req,
                Err(_) => {
                    c.idle_closed.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            },
            None => read.await,
        };
        let Some(req) = req else {
            c.peer_closed.fetch_add(1, Ordering::SeqCst);
            return;
        };
        c.requests.fetch_add(1, Ordering::SeqCst);
        if !answer(&mut s, &mut c, req.contains("\"stream\":true")).await {
            c.peer_closed.fetch_add(1, Ordering::SeqCst);
            return;
        }
    }
}

impl PoolEngine {
    async fn start(idle_close: Option<Duration>) -> PoolEngine {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (gate, gate_rx) = watch::channel(true);
        let c = Counters {
            requests: Default::default(),
            idle_closed: Default::default(),
            peer_closed: Default::default(),
            gate: gate_rx,
            idle_close,
        };
        let connections = Arc::new(AtomicUsize::new(0));
        let (conns, counters) = (connections.clone(), c.clone());
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                conns.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(s, counters.clone()));
            }
        });
        PoolEngine {
            url,
            connections,
            c,
            gate,
        }
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

async fn proxy_to(e: &PoolEngine) -> (ScriptedControl, TestProxy) {
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |cfg| {
        cfg.upstream_idle_timeout = Duration::from_secs(60);
    })
    .await;
    (c, p)
}

async fn stream_events(p: &TestProxy) -> String {
    let r = post(&p.url("/v1/chat/completions"), &chat_stream("m")).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    String::from_utf8(r.body.to_vec()).unwrap()
}

#[tokio::test]
async fn upstream_connections_are_reused_whole_and_streamed() {
    let e = PoolEngine::start(None).await;
    let (_c, p) = proxy_to(&e).await;
    for i in 0..5 {
        let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
        assert_eq!(r.status, 200, "request {i}: {:?}", r.body);
        assert_eq!(stream_events(&p).await, SSE_EVENTS.concat());
    }
    assert_eq!(e.c.requests(), 10);
    assert_eq!(
        e.connections(),
        1,
        "every request on the one pooled connection"
    );
    assert_eq!(e.c.peer_closed(), 0);
}

#[tokio::test]
async fn concurrent_requests_each_get_their_own_connection() {
    let e = PoolEngine::start(None).await;
    let (_c, p) = proxy_to(&e).await;
    e.gate.send_replace(false);
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            let url = p.url("/v1/chat/completions");
            tokio::spawn(async move { post(&url, &chat("m")).await })
        })
        .collect();
    // HTTP/1 without pipelining: three at the engine at once means three
    // connections.
    wait_until("3 requests at the engine", || async { e.c.requests() == 3 }).await;
    assert_eq!(e.connections(), 3);
    e.gate.send_replace(true);
    for t in tasks {
        assert_eq!(t.await.unwrap().status, 200);
    }
    // All three went back to the pool: three more at once reuse them.
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            let url = p.url("/v1/chat/completions");
            tokio::spawn(async move { post(&url, &chat("m")).await })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().status, 200);
    }
    assert_eq!(e.c.requests(), 6);
    assert_eq!(e.connections(), 3);
}

#[tokio::test]
async fn an_idle_connection_the_engine_closed_is_not_used() {
    // The engine closes connections idle for 200 ms (uvicorn does at 5 s);
    // the proxy would keep them 60 s.
    let e = PoolEngine::start(Some(Duration::from_millis(200))).await;
    let (_c, p) = proxy_to(&e).await;
    let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
    assert_eq!(r.status, 200);
    wait_until("the engine closed the idle connection", || async {
        e.c.idle_closed() == 1
    })
    .await;
    for i in 0..3 {
        let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
        assert_eq!(r.status, 200, "request {i}: {:?}", r.body);
    }
    // Not sent on the closed connection (that would read nothing there and
    // be sent again): the engine saw each request once, the new connection
    // carried the three.
    assert_eq!(e.c.requests(), 4);
    assert_eq!(e.connections(), 2);
}

#[tokio::test]
async fn a_stream_the_client_left_does_not_return_its_connection_to_the_pool() {
    let e = PoolEngine::start(None).await;
    let (_c, p) = proxy_to(&e).await;
    e.gate.send_replace(false);
    let resp = send_chat_stream(&p.url("/v1/chat/completions"), "m").await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first, SSE_EVENTS[0]);
    drop(body);
    // The proxy closes the half-read upstream connection.
    wait_until("the proxy closed the upstream connection", || async {
        e.c.peer_closed() == 1
    })
    .await;
    e.gate.send_replace(true);
    assert_eq!(stream_events(&p).await, SSE_EVENTS.concat());
    let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
    assert_eq!(r.status, 200);
    assert_eq!(e.connections(), 2, "a new connection after the cut one");
    assert_eq!(e.c.requests(), 3);
}

#[tokio::test]
async fn idle_connections_are_closed_when_the_proxy_stops_not_at_the_idle_timeout() {
    let e = PoolEngine::start(None).await;
    // The proxy keeps idle connections 60 s (longer than the deadline).
    let (_c, mut p) = proxy_to(&e).await;
    let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
    assert_eq!(r.status, 200);
    assert_eq!(e.c.peer_closed(), 0, "pooled, open");
    p.shutdown.cancel();
    let stopped = tokio::time::timeout(DEADLINE, &mut p.task).await;
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "{stopped:?}");
    wait_until("the engine saw the idle connection closed", || async {
        e.c.peer_closed() == 1
    })
    .await;
}
