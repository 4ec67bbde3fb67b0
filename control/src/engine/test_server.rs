//! A small scripted HTTP/1.1 server on port 0 standing in for an engine
//! (tests only): each request is answered as a script says.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the scripted engine does with one request.
#[derive(Debug, Clone)]
pub(crate) enum Act {
    /// 200 with this JSON body (empty: no body).
    Ok(&'static str),
    /// Close the connection without answering.
    Close,
    /// Never answer.
    Hang,
}

/// `script(connection index, request index on that connection, request line)`.
type Script = dyn Fn(usize, usize, &str) -> Act + Send + Sync;

pub(crate) struct Engine {
    pub url: String,
    pub connections: Arc<AtomicUsize>,
    /// Request lines, in arrival order.
    pub requests: Arc<Mutex<Vec<String>>>,
    /// The accept loop and every connection's task.
    tasks: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Engine {
    /// As vLLM at SIGTERM: the listener closes (connections are refused)
    /// and so do the open connections.
    pub fn close(&self) {
        for t in self.tasks.lock().unwrap().drain(..) {
            t.abort();
        }
    }
}

/// Reads one request head and its body; `None` at EOF.
async fn read_request(s: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let mut chunk = [0u8; 4096];
                let n = s.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            buf.drain(..end + 4 + len);
            return head.lines().next().map(str::to_string);
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

pub(crate) async fn engine(
    script: impl Fn(usize, usize, &str) -> Act + Send + Sync + 'static,
) -> Engine {
    engine_at("127.0.0.1:0", script).await
}

/// [`engine`] listening on `addr`.
pub(crate) async fn engine_at(
    addr: &str,
    script: impl Fn(usize, usize, &str) -> Act + Send + Sync + 'static,
) -> Engine {
    let listener = TcpListener::bind(addr).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let connections = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(Mutex::new(Vec::new()));
    let script: Arc<Script> = Arc::new(script);
    let (conns, reqs) = (connections.clone(), requests.clone());
    let tasks: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
    let handles = tasks.clone();
    let accept = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let conn = conns.fetch_add(1, Ordering::SeqCst);
            let (script, reqs) = (script.clone(), reqs.clone());
            let conn_task = tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut n = 0;
                while let Some(line) = read_request(&mut s, &mut buf).await {
                    reqs.lock().unwrap().push(line.clone());
                    match script(conn, n, &line) {
                        Act::Ok(body) => {
                            let resp = format!(
                                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                                body.len()
                            );
                            if s.write_all(resp.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                        Act::Close => return,
                        Act::Hang => {
                            std::future::pending::<()>().await;
                        }
                    }
                    n += 1;
                }
            });
            handles.lock().unwrap().push(conn_task.abort_handle());
        }
    });
    tasks.lock().unwrap().push(accept.abort_handle());
    Engine {
        url,
        connections,
        requests,
        tasks,
    }
}
