//! A minimal HTTP/1.1 keep-alive client on hyper's connection API, with the
//! timestamps the scenarios need (first body frame, end of body, frames).

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Microseconds since the Unix epoch, from the system clock (shared with
/// fake-vllm on this machine).
pub fn unix_us() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1e6)
        .unwrap_or(0.0)
}

/// `http://127.0.0.1:8000` → the socket address.
pub fn socket_addr(base: &str) -> Result<SocketAddr> {
    let uri: Uri = base.parse().with_context(|| format!("bad URL {base}"))?;
    let auth = uri
        .authority()
        .ok_or_else(|| anyhow!("no host in {base}"))?;
    auth.as_str()
        .parse()
        .with_context(|| format!("{base}: need IP:PORT"))
}

/// One keep-alive HTTP/1.1 connection.
#[derive(Debug)]
pub struct Conn {
    addr: SocketAddr,
    sender: SendRequest<Full<Bytes>>,
}

/// What one request saw.
#[derive(Debug, Clone, Default)]
pub struct Timed {
    pub status: u16,
    /// Request sent → first non-empty body frame.
    pub first_byte: Duration,
    /// Request sent → end of body.
    pub total: Duration,
    /// Non-empty body frames read.
    pub frames: usize,
    pub body: Bytes,
}

impl Conn {
    pub async fn connect(addr: SocketAddr) -> Result<Conn> {
        Conn::connect_from(addr, None).await
    }

    /// Connects from a chosen local address (another loopback address has
    /// its own ephemeral ports: one has about 28,000 toward one server).
    pub async fn connect_from(addr: SocketAddr, from: Option<std::net::IpAddr>) -> Result<Conn> {
        let stream = match from {
            None => TcpStream::connect(addr).await,
            Some(ip) => {
                let sock = tokio::net::TcpSocket::new_v4()?;
                // The port is chosen at connect, unique per 4-tuple: a bind
                // to port 0 would reserve one and, with tens of thousands
                // already bound, make the kernel scan for a free one.
                nix::sys::socket::setsockopt(
                    &sock,
                    nix::sys::socket::sockopt::IpBindAddressNoPort,
                    &true,
                )
                .context("IP_BIND_ADDRESS_NO_PORT")?;
                sock.bind(SocketAddr::new(ip, 0))
                    .with_context(|| format!("bind {ip}"))?;
                sock.connect(addr).await
            }
        }
        .with_context(|| format!("connect {addr} from {from:?}"))?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Conn { addr, sender })
    }

    /// Sends `method path` with an optional JSON body and reads the whole
    /// response, timing it. Reconnects once if the server closed the
    /// connection.
    pub async fn request(&mut self, method: &str, path: &str, json: Option<&str>) -> Result<Timed> {
        if self.sender.ready().await.is_err() {
            *self = Conn::connect(self.addr).await?;
        }
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("host", self.addr.to_string());
        if json.is_some() {
            b = b.header("content-type", "application/json");
        }
        let body = Full::new(Bytes::from(json.unwrap_or("").to_string()));
        let req = b.body(body)?;
        let start = Instant::now();
        let resp = self.sender.send_request(req).await?;
        let mut timed = Timed {
            status: resp.status().as_u16(),
            ..Timed::default()
        };
        let mut body = resp.into_body();
        let mut buf = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame?;
            if let Some(data) = frame.data_ref() {
                if data.is_empty() {
                    continue;
                }
                if timed.frames == 0 {
                    timed.first_byte = start.elapsed();
                }
                timed.frames += 1;
                buf.extend_from_slice(data);
            }
        }
        timed.total = start.elapsed();
        timed.body = Bytes::from(buf);
        Ok(timed)
    }

    pub async fn get_json(&mut self, path: &str) -> Result<serde_json::Value> {
        let t = self.request("GET", path, None).await?;
        if t.status != 200 {
            bail!("GET {path}: status {}", t.status);
        }
        Ok(serde_json::from_slice(&t.body)?)
    }
}

/// A small chat completion request body. Streams set vLLM's `ignore_eos`
/// so that exactly `max_tokens` tokens come back.
pub fn chat_body(model: &str, max_tokens: u32, stream: bool) -> String {
    let mut v = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": max_tokens,
        "stream": stream,
    });
    if stream {
        v["ignore_eos"] = true.into();
    }
    v.to_string()
}

/// Counts SSE events (`data:` lines) in a response body.
pub fn sse_events(body: &[u8]) -> usize {
    body.split(|&b| b == b'\n')
        .filter(|line| line.starts_with(b"data:"))
        .count()
}

/// The state the proxy's `GET /v1/models` reports for `model`, if its
/// listing carries one (any string field of the entry whose name says
/// "state" or "status").
pub async fn proxy_state(conn: &mut Conn, model: &str) -> Result<Option<String>> {
    let v = conn.get_json("/v1/models").await?;
    let entries = v["data"].as_array().cloned().unwrap_or_default();
    for e in entries {
        if e["id"].as_str() != Some(model) {
            continue;
        }
        if let Some(obj) = e.as_object() {
            for (k, val) in obj {
                let key = k.to_ascii_lowercase();
                if key.contains("state") || key.contains("status") {
                    if let Some(s) = val.as_str() {
                        return Ok(Some(s.to_ascii_lowercase()));
                    }
                    if let Some(s) = val["state"].as_str() {
                        return Ok(Some(s.to_ascii_lowercase()));
                    }
                }
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_sse() {
        let b = b"data: {\"a\":1}\n\ndata: {\"a\":2}\n\ndata: [DONE]\n\n";
        assert_eq!(sse_events(b), 3);
    }

    #[test]
    fn parses_addr() {
        assert_eq!(
            socket_addr("http://127.0.0.1:8000").unwrap(),
            "127.0.0.1:8000".parse().unwrap()
        );
    }
}
