//! Starting an in-process proxy and talking HTTP to it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use siesta_proxy::{Proxy, ProxyConfig};
use tokio_util::sync::CancellationToken;

pub const DEADLINE: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub struct TestProxy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<Result<(), siesta_proxy::Error>>,
}

impl Drop for TestProxy {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl TestProxy {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    pub async fn metrics(&self) -> String {
        let r = get(&self.admin_url("/metrics")).await;
        String::from_utf8(r.body.to_vec()).unwrap()
    }
}

pub async fn start_proxy(controls: Vec<String>, tweak: impl FnOnce(&mut ProxyConfig)) -> TestProxy {
    let mut cfg = ProxyConfig {
        controls,
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        ..ProxyConfig::default()
    };
    tweak(&mut cfg);
    let proxy = Proxy::bind(cfg).unwrap();
    let (addr, admin) = (proxy.local_addr(), proxy.admin_addr());
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(proxy.run(shutdown.clone()));
    TestProxy {
        addr,
        admin,
        shutdown,
        task,
    }
}

/// Starts a proxy and waits until it has a snapshot.
pub async fn ready_proxy(controls: Vec<String>, tweak: impl FnOnce(&mut ProxyConfig)) -> TestProxy {
    let p = start_proxy(controls, tweak).await;
    let url = p.url("/readyz");
    wait_until("proxy ready", || async {
        get(&url).await.status == StatusCode::OK
    })
    .await;
    p
}

pub async fn wait_until<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    pub fn retry_after(&self) -> Option<u64> {
        self.headers
            .get("retry-after")
            .map(|v| v.to_str().unwrap().parse().unwrap())
    }
}

fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

pub async fn send(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> http::Response<Incoming> {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(body)).unwrap();
    tokio::time::timeout(DEADLINE, client().request(req))
        .await
        .expect("request timed out")
        .expect("request failed")
}

/// POSTs a streamed chat completion for `model` to `url`.
pub async fn send_chat_stream(url: &str, model: &str) -> http::Response<Incoming> {
    send(Method::POST, url, &[], Bytes::from(chat_stream(model))).await
}

pub async fn reply(resp: http::Response<Incoming>) -> Reply {
    let (parts, body) = resp.into_parts();
    let body = tokio::time::timeout(DEADLINE, body.collect())
        .await
        .expect("body timed out")
        .expect("body failed")
        .to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub async fn get(url: &str) -> Reply {
    reply(send(Method::GET, url, &[], Bytes::new()).await).await
}

pub async fn post(url: &str, body: &str) -> Reply {
    post_with(url, &[], body).await
}

pub async fn post_with(url: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    let h: Vec<(&str, &str)> = [("content-type", "application/json")]
        .into_iter()
        .chain(headers.iter().copied())
        .collect();
    reply(send(Method::POST, url, &h, Bytes::from(body.to_owned())).await).await
}

pub fn chat(model: &str) -> String {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}).to_string()
}

pub fn chat_stream(model: &str) -> String {
    serde_json::json!({"model": model, "stream": true, "messages": [{"role": "user", "content": "hi"}]}).to_string()
}

/// Waits until `/v1/models` shows `model` in `state` ("awake", "asleep", ...).
pub async fn wait_state(p: &TestProxy, model: &str, state: &str) {
    let url = p.url(&format!("/v1/models/{model}"));
    wait_until(&format!("{model} {state}"), || async {
        let r = get(&url).await;
        r.status == StatusCode::OK && r.json()["siesta_state"] == state
    })
    .await;
}

/// Client connections the proxy has accepted, over its serving threads.
pub async fn accepted(p: &TestProxy) -> f64 {
    p.metrics()
        .await
        .lines()
        .filter(|l| l.starts_with("siesta_proxy_connections_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The value of a metric line that starts with `prefix` (labels included).
pub fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Sends raw bytes and returns the status line of the answer.
pub async fn raw(addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(DEADLINE, s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    String::from_utf8_lossy(&buf[..n])
        .lines()
        .next()
        .unwrap_or("")
        .to_owned()
}

/// A raw engine's side: reads one request (head and content-length body)
/// off `s` into `buf`; None when the peer closed.
pub async fn read_request(s: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    use tokio::io::AsyncReadExt;
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                let req = String::from_utf8_lossy(&buf[..end + 4 + len]).into_owned();
                buf.drain(..end + 4 + len);
                return Some(req);
            }
        }
        let mut chunk = [0u8; 4096];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}
